"""Strategy type, rule context and the per-primitive rule registry.

A rule is ``rule(op, ctx) -> list[Strategy]``. It is registered for one or more
primitive names with :func:`register_strategy`. ``follows=True`` marks ops that
the planner merges into the producer of their main operand (Alpa's followers):
they keep the operand's layout instead of being solved on their own.

Primitives that are right to run replicated are registered with
:func:`register_replicated`, together with the reason; :func:`autoshard.strategies.coverage`
reports it. Both fill the primitive's :class:`~autoshard.strategies.opinfo.OpInfo`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import numpy as np

from autoshard.cost import Collective, CostModel
from autoshard.spec import MeshInfo, ShardingSpec, replicated
from autoshard.strategies.opinfo import OpInfo, op_info, register_op, registered_ops


@dataclasses.dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run an op on the mesh.

    Attributes:
      name: short label, e.g. ``"S0,R x R,S1"``.
      in_specs: the layout each operand must have (None for constants: replicated).
      out_specs: the layout of each output.
      compute: seconds of compute per device.
      comm: seconds of communication inside the op (e.g. the all-reduce of a
        sharded contraction). Resharding between ops is priced on edges.
      collectives: what ``comm`` consists of, for reports.
      work: the :class:`~autoshard.perf.Work` (flops, HBM bytes, unit) behind ``compute``, set by the planner
        when the cluster has a hardware model (:mod:`autoshard.work`); None otherwise.
    """

    name: str
    in_specs: tuple[ShardingSpec | None, ...]
    out_specs: tuple[ShardingSpec, ...]
    compute: float = 0.0
    comm: float = 0.0
    collectives: tuple[Collective, ...] = ()
    work: object = None

    @property
    def cost(self) -> float:
        return self.compute + self.comm


@dataclasses.dataclass(frozen=True, slots=True)
class RuleContext:
    """What a rule may look at besides the op: shapes, the mesh, the cost model."""

    mesh: MeshInfo
    cost: CostModel
    in_shapes: tuple[tuple[int, ...], ...]
    in_dtypes: tuple[np.dtype, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[np.dtype, ...]
    const_inputs: tuple[bool, ...]

    def out_bytes(self, k: int = 0) -> int:
        return math.prod(self.out_shapes[k]) * itemsize(self.out_dtypes[k])

    def compute_time(self, flops: float, spec_or_shards) -> float:
        shards = spec_or_shards if isinstance(spec_or_shards, int) else spec_or_shards.num_shards(self.mesh)
        return self.cost.compute_time(flops / shards)

    def collective(self, kind: str, axes, nbytes: float) -> tuple[float, Collective]:
        """The seconds and record of one collective of ``nbytes`` per device that this op's strategy makes.
        A reduction of a 2-byte float result (a bf16 dot's partial sums) moves 4-byte floats on a backend that
        widens half-precision collectives (XLA:CPU promotes the all-reduce to f32:
        ``CostModel.widen_half_precision``), as the reshards' bytes are widened there."""
        if (self.cost.widen_half_precision and kind in ("all-reduce", "reduce-scatter") and self.out_dtypes
                and itemsize(self.out_dtypes[0]) == 2):
            nbytes = 2 * nbytes
        c = Collective(kind, tuple(sorted(axes)), float(nbytes))
        return self.cost.collective_time(c), c


def itemsize(dtype) -> int:
    """Bytes per element; an extended dtype (a typed PRNG key) counts its key data (8 for threefry)."""
    if dtype is None:
        return 4
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return int(getattr(dtype, "itemsize", 8))
    return np.dtype(dtype).itemsize


Rule = Callable[[object, RuleContext], list[Strategy]]

_REPLICATED_FAMILIES: dict[tuple[str, ...], str] = {}


def register_strategy(*names: str, follows: bool = False):
    """Register ``rule`` as the strategy rule of primitives ``names`` (their :class:`OpInfo` ``rule``).

    Example::

        @register_strategy("my_prim", follows=True)
        def _my_prim(op, ctx):
            return elementwise_strategies(ctx)
    """

    def deco(rule: Rule) -> Rule:
        register_op(*names, rule=rule, follows=follows, replicated_why=None)
        return rule

    return deco


def register_replicated(*names: str, why: str) -> None:
    """Run primitives ``names`` replicated on purpose, for the reason ``why`` (no warning).

    ``why`` says why that is right, e.g. ``"a host callback sees whole arrays"``.

    Example::

        register_replicated("my_callback", why="the host function sees whole arrays")
    """
    if not why:
        raise ValueError(f"register_replicated({', '.join(names)}) needs a reason: why=...")
    register_op(*names, rule=_replicated_rule, follows=False, replicated_why=why)


def register_replicated_family(*module_prefixes: str, why: str) -> None:
    """Classify every primitive defined only in modules under ``module_prefixes`` as replicated.

    For kernel languages (Pallas, Mosaic): their primitives exist only inside a kernel body,
    which is one opaque op to autoshard. :func:`autoshard.strategies.coverage` expands the
    family over the installed jax."""
    _REPLICATED_FAMILIES[tuple(module_prefixes)] = why


def _replicated_rule(op, ctx: RuleContext) -> list[Strategy]:
    return [replicated_strategy(ctx, sum(math.prod(s) for s in ctx.out_shapes))]


def lookup_rule(name: str) -> OpInfo | None:
    """The :class:`OpInfo` of ``name`` when it has a strategy rule (``.rule``, ``.follows``), else None."""
    info = op_info(name)
    return info if info.rule is not None else None


def registered_primitives() -> tuple[str, ...]:
    """Primitives with a strategy rule (their own, or the replicated one)."""
    return tuple(sorted(n for n, info in registered_ops().items() if info.rule is not None))


def replicated_reasons() -> dict[str, str]:
    """Primitive name -> why it runs replicated, for those registered with :func:`register_replicated`."""
    return {n: info.replicated_why for n, info in registered_ops().items() if info.replicated_why is not None}


def replicated_families() -> dict[tuple[str, ...], str]:
    return dict(_REPLICATED_FAMILIES)


def replicated_strategy(ctx: RuleContext, flops: float = 0.0, name: str = "replicated") -> Strategy:
    """Everything replicated: every device computes the whole op."""
    return Strategy(
        name,
        tuple(None if c else replicated(len(s)) for s, c in zip(ctx.in_shapes, ctx.const_inputs, strict=True)),
        tuple(replicated(len(s)) for s in ctx.out_shapes),
        compute=ctx.cost.compute_time(flops),
    )


def drop_axes(spec: ShardingSpec, dims) -> ShardingSpec:
    """``spec`` with dimensions ``dims`` unsharded."""
    dims = set(dims)
    return ShardingSpec(tuple(() if i in dims else d for i, d in enumerate(spec.dims)))


def assign_axes(rank: int, placements) -> ShardingSpec:
    """Build a spec from ``(dim, axis)`` pairs; axes on one dim sorted by index."""
    dims = [[] for _ in range(rank)]
    for d, a in placements:
        dims[d].append(a)
    return ShardingSpec(tuple(tuple(sorted(d)) for d in dims))


def divides(shape, spec: ShardingSpec, mesh: MeshInfo) -> bool:
    return all(n % mesh.axes_size(d) == 0 for n, d in zip(shape, spec.dims, strict=True))
