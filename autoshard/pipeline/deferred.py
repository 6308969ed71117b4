"""Gradients reduced once per step: a stage keeps its microbatches' partial sums unreduced.

A weight gradient ``dW = x^T dy`` contracts over the batch. A stage plan that splits the batch over
mesh axes ``A`` leaves each device a partial sum, and the plan's strategy all-reduces it over ``A``
right away. A pipeline sums the gradients of its ``k`` microbatches anyway, and that sum commutes
with the sum over ``A``: each device can add up its own partials over the microbatches and the
step all-reduce them once, ``k`` times fewer bytes (Megatron-LM's gradient accumulation).

:func:`partial_sums` finds the frontier values of a stage (see :mod:`autoshard.pipeline.accumulate`)
that qualify under its plan: made by a sum (a contraction, ``reduce_sum``) whose summed dimensions
are split over ``A`` on every operand alike. Such a value's running sum has one more leading
dimension, of size ``|A|`` and split over ``A``: each device's row is its own partial sum. Where
the plan all-reduces, that takes exactly the memory the reduced value did; where it reduce-scatters
(ZeRO's sharded gradient) it takes ``|A|`` times more, so those are kept unreduced only while the
stage's memory limit allows. ``Evaluator`` makes the partial with a ``shard_map`` manual over ``A``
only (:meth:`autoshard.lower.Evaluator.partial_sum`); once per step the runtime sums the leading
dimension into the planned layout (:func:`reduce_partials`), which XLA does as one all-reduce.
"""

from __future__ import annotations

import dataclasses
import math

from autoshard.lower import operand_spec
from autoshard.spec import MeshInfo, ShardingSpec
from autoshard.strategies import op_info


@dataclasses.dataclass(frozen=True, slots=True)
class PartialSum:
    """A frontier value accumulated unreduced.

    Attributes:
      value: the value id.
      op_index: the sum (a contraction, ``reduce_sum``) that makes it, by its index in the captured program.
      axes: the mesh axes (indices) its partial sums span.
      spec: its planned (reduced) layout; where it uses ``axes`` the plan reduce-scatters.
    """

    value: int
    op_index: int
    axes: tuple[int, ...]
    spec: ShardingSpec

    def __post_init__(self):
        if not self.axes:
            raise ValueError(f"PartialSum of value {self.value}: no axes to keep unreduced")

    @property
    def acc_spec(self) -> ShardingSpec:
        """The running sum's layout: the leading dimension over ``axes``, the rest as planned without them."""
        return ShardingSpec((self.axes, *(tuple(a for a in d if a not in self.axes) for d in self.spec.dims)))

    @property
    def scatters(self) -> bool:
        """The planned layout splits the reduced value over ``axes`` (a reduce-scatter, not an all-reduce)."""
        return bool(self.spec.used_axes & set(self.axes))

    def acc_shape(self, shape, mesh: MeshInfo) -> tuple[int, ...]:
        return (mesh.axes_size(self.axes), *shape)

    def bytes(self, aval, mesh: MeshInfo) -> tuple[float, float]:
        """Per-device bytes of the running sum and of the reduced value."""
        unreduced = ShardingSpec(self.acc_spec.dims[1:])
        size = aval.dtype.itemsize
        return (float(math.prod(unreduced.shard_shape(aval.shape, mesh)) * size),
                float(math.prod(self.spec.shard_shape(aval.shape, mesh)) * size))


def summed_axes(plan, op) -> tuple[int, ...]:
    """The mesh axes over which ``op`` (a sum: :attr:`~autoshard.strategies.OpInfo.summed_dims`) leaves partial
    sums under ``plan``: those that split its summed dimensions alike on every operand and nothing else; ``()``
    when there are none or the operands disagree."""
    summed_dims = op_info(op.name).summed_dims
    if summed_dims is None:
        return ()
    specs = [operand_spec(plan, op, i) for i in range(len(op.inputs))]
    if any(s is None for s in specs):
        return ()
    per_operand = summed_dims(op, tuple(s.rank for s in specs))
    aligned = [[spec.dims[d] for d in dims] for spec, dims in zip(specs, per_operand, strict=False) if dims]
    if not aligned:
        return ()
    lead, *rest = aligned
    if any(other != lead for other in rest):
        return ()
    axes = {a for d in lead for a in d}
    for spec, dims in zip(specs, per_operand, strict=True):
        if any(axes & set(d) for i, d in enumerate(spec.dims) if i not in dims):
            return ()
    return tuple(sorted(axes))


def partial_sums(tasks, plan, avals, spare_bytes: float = math.inf) -> dict[int, PartialSum]:
    """The frontier values of ``tasks`` (one stage's) to accumulate unreduced under ``plan``, by value id.

    Every value the plan all-reduces qualifies (its running sum takes the memory the reduced one did).
    One the plan reduce-scatters qualifies while the running sums' extra bytes per device stay within
    ``spare_bytes``, the largest first."""
    if plan is None:
        return {}
    mesh = plan.mesh_info
    kept, scattered = {}, []
    for task in tasks:
        frontier = set(task.frontier)
        for op in task.ops:
            if len(op.outputs) != 1 or op.outputs[0] not in frontier:
                continue
            v = op.outputs[0]
            spec = plan.value_specs.get(v)
            axes = summed_axes(plan, op)
            if spec is None or not axes or len(spec.dims) != len(avals[v].shape):
                continue
            ps = PartialSum(v, op.index, axes, spec)
            if ps.scatters:
                scattered.append(ps)
            else:
                kept[v] = ps
    for ps in sorted(scattered, key=lambda p: -p.bytes(avals[p.value], mesh)[0]):
        acc, reduced = ps.bytes(avals[ps.value], mesh)
        if acc - reduced <= spare_bytes:
            kept[ps.value] = ps
            spare_bytes -= acc - reduced
    return kept


def reduce_partials(evaluator, partials, accs):
    """The running sums ``accs`` of ``partials`` summed over their leading dimension, in their planned layouts."""
    return [evaluator.constrain(a.sum(axis=0), ps.spec) for ps, a in zip(partials, accs, strict=True)]
