"""Hand-written sharding baselines, as a careful user would write them with ``jax.jit``.

Each method maps a state pytree (and a batch) to ``NamedSharding``s by pytree-path
rules; ``compile_baseline`` compiles the step with them from abstract shapes.

- ``data_parallel``: parameters and optimizer state replicated, batch split over every device.
- ``zero2``: like data parallel, but optimizer state split over every device.
- ``fsdp``: parameters and optimizer state split over every device (ZeRO-3).
- ``megatron``: Megatron-LM tensor parallelism on one mesh axis, data parallelism on the other.
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


METHODS = {"data_parallel": data_parallel, "zero2": zero2, "fsdp": fsdp, "megatron": megatron}


def compile_baseline(train_step, state, batch, mesh, method: str):
    """Compile ``train_step`` with a baseline's shardings from abstract shapes; returns the Compiled."""
    st_sh, b_sh = METHODS[method](state, batch, mesh)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, st_sh)
    abatch = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), batch, b_sh)
    out_state_sh = st_sh
    jitted = jax.jit(train_step, in_shardings=(st_sh, b_sh), out_shardings=(out_state_sh, None))
    return jitted.lower(abstract, abatch).compile()
