"""What autoshard knows about a primitive: one :class:`OpInfo` per primitive name.

Every pass that needs to know what a primitive is asks this registry, never a list of names of
its own: the planner (the strategy rule, ``follows``, weak layout sources, contractions), the
memory estimate (what XLA fuses, reductions, expensive ops, bitcasts), remat (what may be
recomputed, flops), the layer clusterer (flops) and lowering (contractions, scans, local params).

Properties are registered beside the rules of their family (``strategies/*.py``), with
:func:`register_op`; :func:`~autoshard.strategies.register_strategy` and
:func:`~autoshard.strategies.register_replicated` fill the ``rule`` of the same entry. A new
primitive is one file: its rule and its properties.

Example::

    from autoshard.strategies import op_info, register_op, register_strategy

    @register_strategy("my_matmul")
    def _my_matmul(op, ctx): ...

    register_op("my_matmul", contraction=True, flops=lambda op, avals: 2.0 * ...)
    assert op_info("my_matmul").contraction
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

Flops = Callable[[object, object], float]
"""``flops(op, avals) -> float``: the unsharded flops of one op (``avals`` indexed by value id)."""

STRUCTURES = ("scan", "while", "cond", "inlined")
"""Structural kinds: ``scan`` (captured as one op over a body the planner solves), ``while`` and
``cond`` (opaque control flow, re-bound as is), ``inlined`` (calls whose body capture inlines:
``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat2``, ...)."""


@dataclasses.dataclass(frozen=True, slots=True)
class OpInfo:
    """Everything autoshard knows about one primitive.

    Attributes:
      name: the primitive's name.
      rule: ``rule(op, ctx) -> list[Strategy]``; None: no rule (runs replicated with a warning).
      follows: the planner merges the op into the producer of its main operand (Alpa's followers).
      replicated_why: why running replicated is right, for primitives registered so.
      weak_layout: a layout source readers should not follow (a broadcast, an iota, random bits,
        a remat fence): when picking a follower's main operand, others win.
      fused_source: XLA computes it inside its readers' fusion although its rule is not a follower
        (a broadcast, an iota): it is recomputed per element, never written out.
      reduction: XLA takes its producers into its fusion but writes its own result to a buffer.
      windowed: runs as a fusion of its own (a windowed reduction): its operands are buffers.
      expensive: XLA's fusion will not duplicate it into several readers (instruction_fusion.cc
        ``IsExpensive``): read twice, it is materialised once.
      bitcast: a reshape of a buffer that names the same bytes.
      contraction: a matmul-like op (the planner's terminal-op rule, remat's matmul flops floor,
        lowering's summed layout).
      contracted_dims: ``(op) -> dims`` of the left operand a contraction sums over.
      summed_dims: ``(op, ranks) -> (dims of operand 0, dims of operand 1, ...)``: the dimensions a sum (a
        contraction, ``reduce_sum``, a scatter-add into zeros) adds over, aligned across the operands that
        have any (``ranks``: each operand's rank); where a mesh axis splits them alike, and nothing else,
        each device holds a partial sum (a pipeline keeps those unreduced across microbatches).
      flops: ``flops(op, avals)``; None: one per output element.
      duplicable: remat may recompute it (not a side effect, not opaque control flow).
      structure: one of :data:`STRUCTURES`, or None for an ordinary op.
      local_params: ``(op, in_specs, out_specs, mesh_info) -> params | None``, for an op whose params depend
        on its operands' shapes (a Pallas kernel's grid): the params it has on each device's shards under
        the planned layouts, or None where they split nothing. Lowering then binds it inside a
        ``shard_map`` over the mesh axes that split it (``lower.Evaluator.bind_local``).
    """

    name: str
    rule: Callable | None = None
    follows: bool = False
    replicated_why: str | None = None
    weak_layout: bool = False
    fused_source: bool = False
    reduction: bool = False
    windowed: bool = False
    expensive: bool = False
    bitcast: bool = False
    contraction: bool = False
    contracted_dims: Callable | None = None
    summed_dims: Callable | None = None
    flops: Flops | None = None
    duplicable: bool = True
    structure: str | None = None
    local_params: Callable | None = None

    def __post_init__(self):
        if self.structure is not None and self.structure not in STRUCTURES:
            raise ValueError(f"OpInfo({self.name!r}): structure={self.structure!r} is not one of {STRUCTURES}. "
                             f"Fix: use one of them, or None for an ordinary op.")

    @property
    def fusible(self) -> bool:
        """XLA fuses it into its readers (loop fusion): a follower-rule op or a fused source."""
        return self.follows or self.fused_source


_INFO: dict[str, OpInfo] = {}


def register_op(*names: str, **properties) -> None:
    """Set ``properties`` (fields of :class:`OpInfo`) of primitives ``names``; others keep their value.

    Example::

        register_op("exp", "log", expensive=True)
    """
    unknown = set(properties) - {f.name for f in dataclasses.fields(OpInfo)} - {"name"}
    if unknown or "name" in properties:
        raise TypeError(f"register_op({', '.join(names)}): {sorted(unknown | ({'name'} & set(properties)))} "
                        f"are not OpInfo properties. Fix: use fields of autoshard.strategies.OpInfo.")
    for n in names:
        _INFO[n] = dataclasses.replace(_INFO.get(n) or OpInfo(n), **properties)


def op_info(name: str) -> OpInfo:
    """The :class:`OpInfo` of primitive ``name`` (a default one, with no rule, if nothing is registered).

    Example:
        >>> from autoshard.strategies import op_info
        >>> op_info("dot_general").contraction
        True
    """
    info = _INFO.get(name)
    return info if info is not None else OpInfo(name)


def partial_sum_axes(op, in_specs) -> tuple[int, ...]:
    """The mesh axes (indices) over which ``op``, read in the layouts ``in_specs``, leaves each device a partial
    sum: those that split its :attr:`OpInfo.summed_dims` alike on every operand and nothing else of them.
    ``()`` when the op is not a sum, an operand's layout is unknown (None), or the operands disagree."""
    summed_dims = op_info(op.name).summed_dims
    if summed_dims is None or not in_specs or any(s is None for s in in_specs):
        return ()
    per_operand = summed_dims(op, tuple(s.rank for s in in_specs))
    aligned = [[spec.dims[d] for d in dims] for spec, dims in zip(in_specs, per_operand, strict=False) if dims]
    if not aligned:
        return ()
    lead, *rest = aligned
    if any(other != lead for other in rest):
        return ()
    axes = {a for d in lead for a in d}
    for spec, dims in zip(in_specs, per_operand, strict=True):
        if any(axes & set(d) for i, d in enumerate(spec.dims) if i not in dims):
            return ()
    return tuple(sorted(axes))


def registered_ops() -> dict[str, OpInfo]:
    """Every primitive with a registry entry, by name."""
    return dict(_INFO)


def elements(aval) -> int:
    return math.prod(getattr(aval, "shape", ()))


def op_flops(op, avals) -> float:
    """Unsharded flops of one op: its :attr:`OpInfo.flops`, else one per output element.

    The one flop count that remat, the layer clusterer and the pipeline's stage costs use."""
    info = op_info(op.name)
    if info.flops is not None:
        return float(info.flops(op, avals))
    return float(sum(elements(avals[v]) for v in op.outputs))


def is_scan(op) -> bool:
    """A ``scan`` captured with its body (capture keeps it as one op over a nested graph)."""
    return op.body is not None and op_info(op.name).structure == "scan"


def scan_counts(params) -> tuple[int, int]:
    """``(consts, carry)``: how many of a ``scan``'s operands are loop constants and carried values (the rest
    are the scanned ``xs``). jax <= 0.10 names them ``num_consts`` / ``num_carry``; jax 0.11 keeps them in
    ``ft_in``, a flat tree packed as ``(consts, carry, xs)`` whose ``len`` counts leaves."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)
