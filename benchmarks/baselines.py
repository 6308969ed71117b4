"""Hand-written sharding baselines, as a careful user would write them with ``jax.jit``.

Each method maps a state pytree (and a batch) to ``NamedSharding``s by pytree-path
rules; ``compile_baseline`` compiles the step with them from abstract shapes.

- ``data_parallel``: parameters and optimizer state replicated, batch split over every device.
- ``zero2``: like data parallel, but optimizer state split over every device.
- ``fsdp``: parameters and optimizer state split over every device (ZeRO-3).
- ``megatron``: Megatron-LM tensor parallelism on one mesh axis, data parallelism on the other.
- ``fsdp_tp``: Megatron tensor parallelism on one axis and FSDP (ZeRO-3) over the other: each array's
  largest dimension that the Megatron rule leaves whole is split over the data axis.

``MEGATRON_RULES_BY_FAMILY`` extends the GPT rules to MoE experts and Wide-ResNet channels, and
``tensor_parallel_meshes`` lists the 2-D factorizations a Megatron sweep tries.
"""

from __future__ import annotations

import math
import re

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Megatron-LM's layout for a GPT block (and MoE experts / conv channels where the names fit).
MEGATRON_RULES = (
    (r"attn.*(query|key|value).*kernel", lambda tp: P(None, tp)),
    (r"attn.*(query|key|value).*bias", lambda tp: P(tp)),
    (r"attn.*out.*kernel", lambda tp: P(tp, None)),
    (r"mlp.*fc.*kernel", lambda tp: P(None, tp)),
    (r"mlp.*fc.*bias", lambda tp: P(tp)),
    (r"mlp.*proj.*kernel", lambda tp: P(tp, None)),
    (r"wte.*embedding", lambda tp: P(tp, None)),
)


# GShard MoE: the GPT rules, plus each expert's FFN split Megatron-style (wi by columns, wo by rows),
# as DeepSpeed-MoE / Megatron-LM do without expert parallelism.
MEGATRON_MOE_RULES = MEGATRON_RULES + (
    (r"moe.*wi", lambda tp: P(None, None, tp)),
    (r"moe.*wo", lambda tp: P(None, tp, None)),
)

# Wide-ResNet: in every bottleneck the wide 3x3 conv is split by output channels and the following 1x1
# conv by input channels (one all-reduce per block, like a Megatron MLP); the BatchNorm between them
# (parameters and running statistics) is split with its channels.
MEGATRON_WRESNET_RULES = (
    (r"conv2.*kernel", lambda tp: P(None, None, None, tp)),
    (r"bn2.*(scale|bias|mean|var)", lambda tp: P(tp)),
    (r"conv3.*kernel", lambda tp: P(None, None, tp, None)),
)

MEGATRON_RULES_BY_FAMILY = {
    "gpt": MEGATRON_RULES,
    "gpt_scan": MEGATRON_RULES,
    "moe": MEGATRON_MOE_RULES,
    "moe_layer": MEGATRON_MOE_RULES,
    "wresnet": MEGATRON_WRESNET_RULES,
}


def tensor_parallel_meshes(num_devices: int, *, min_dp: int = 1) -> list[tuple[int, int]]:
    """The ``(dp, tp)`` factorizations of ``num_devices`` with ``tp >= 2`` and ``dp`` a multiple of ``min_dp``.

    ``min_dp`` keeps the tensor-parallel axis inside a node: on 2 nodes, ``min_dp=2``.
    """
    return [(num_devices // tp, tp) for tp in range(2, num_devices + 1)
            if num_devices % tp == 0 and (num_devices // tp) % min_dp == 0]


def _path(p) -> str:
    return jax.tree_util.keystr(p)


def _fits(shape, spec: P, mesh) -> bool:
    for n, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=False):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        if n % math.prod(mesh.shape[a] for a in axes):
            return False
    return len(spec) <= len(shape)


def _all_axes(mesh):
    return tuple(mesh.axis_names) if len(mesh.axis_names) > 1 else mesh.axis_names[0]


def _split_largest(shape, mesh, axes) -> P:
    """Split the largest dimension that the axes divide; replicate if none does."""
    n = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
    for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[d] % n == 0 and shape[d] >= n:
            return P(*([None] * d + [axes]))
    return P()


def batch_shardings(batch, mesh, axes):
    def one(x):
        spec = P(axes) if x.ndim and _fits(x.shape, P(axes), mesh) else P()
        return NamedSharding(mesh, spec)

    return jax.tree.map(one, batch)


def data_parallel(state, batch, mesh):
    rep = jax.tree.map(lambda _: NamedSharding(mesh, P()), state)
    return rep, batch_shardings(batch, mesh, _all_axes(mesh))


def zero2(state, batch, mesh):
    axes = _all_axes(mesh)

    def one(p, x):
        if "opt_state" in _path(p):
            return NamedSharding(mesh, _split_largest(x.shape, mesh, axes))
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(one, state), batch_shardings(batch, mesh, axes)


def fsdp(state, batch, mesh):
    axes = _all_axes(mesh)
    st = jax.tree.map(lambda x: NamedSharding(mesh, _split_largest(x.shape, mesh, axes)), state)
    return st, batch_shardings(batch, mesh, axes)


def megatron(state, batch, mesh, *, tp_axis="model", dp_axis="data", rules=MEGATRON_RULES):
    def one(p, x):
        path = _path(p)
        for pattern, make in rules:
            if re.search(pattern, path):
                spec = make(tp_axis)
                if _fits(x.shape, spec, mesh):
                    return NamedSharding(mesh, spec)
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(one, state), batch_shardings(batch, mesh, dp_axis)


def fsdp_tp(state, batch, mesh, *, tp_axis="model", dp_axis="data", rules=MEGATRON_RULES):
    """Megatron-LM tensor parallelism on ``tp_axis`` plus FSDP/ZeRO-3 over ``dp_axis`` (2-D sharding).

    Parameters and optimizer state follow ``megatron``'s rules on ``tp_axis``; then the largest
    dimension the rule left unsplit that ``dp_axis`` divides is split over ``dp_axis`` (arrays no rule
    matches: their largest such dimension, as ``fsdp`` does). The batch is split over ``dp_axis``.
    """
    n_dp = mesh.shape[dp_axis]

    def one(p, x):
        path, spec = _path(p), P()
        for pattern, make in rules:
            if re.search(pattern, path) and _fits(x.shape, make(tp_axis), mesh):
                spec = make(tp_axis)
                break
        entries = list(tuple(spec) + (None,) * (x.ndim - len(spec)))
        for d in sorted(range(x.ndim), key=lambda d: -x.shape[d]):
            if entries[d] is None and x.shape[d] % n_dp == 0 and x.shape[d] >= n_dp:
                entries[d] = dp_axis
                break
        return NamedSharding(mesh, P(*entries))

    return jax.tree_util.tree_map_with_path(one, state), batch_shardings(batch, mesh, dp_axis)


METHODS = {"data_parallel": data_parallel, "zero2": zero2, "fsdp": fsdp, "megatron": megatron, "fsdp_tp": fsdp_tp}


def jit_baseline(train_step, state, batch, mesh, method: str, *, donate: bool = False, **method_kwargs):
    """``(jitted step, state shardings, batch shardings)`` for a baseline; ``method_kwargs`` go to the method."""
    st_sh, b_sh = METHODS[method](state, batch, mesh, **method_kwargs)
    jitted = jax.jit(train_step, in_shardings=(st_sh, b_sh), out_shardings=(st_sh, None),
                     donate_argnums=(0,) if donate else ())
    return jitted, st_sh, b_sh


def lower_baseline(train_step, state, batch, mesh, method: str, *, donate: bool = False, **method_kwargs):
    """Lower ``train_step`` with a baseline's shardings from abstract shapes; returns the Lowered."""
    jitted, st_sh, b_sh = jit_baseline(train_step, state, batch, mesh, method, donate=donate, **method_kwargs)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, st_sh)
    abatch = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), batch, b_sh)
    return jitted.lower(abstract, abatch)


def compile_baseline(train_step, state, batch, mesh, method: str, *, donate: bool = False, **method_kwargs):
    """Compile ``train_step`` with a baseline's shardings from abstract shapes; returns the Compiled.

    ``donate=True`` donates the state, as a training loop does; ``method_kwargs`` go to the method
    (e.g. ``rules=MEGATRON_MOE_RULES`` for ``megatron``).
    """
    return lower_baseline(train_step, state, batch, mesh, method, donate=donate, **method_kwargs).compile()
