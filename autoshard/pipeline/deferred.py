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
(ZeRO's sharded gradient) it takes ``|A|`` times more, so the stage's plan chooses, per gradient, between
reducing it every microbatch and holding it unreduced (``Plan.deferred``), with that memory counted
(:func:`autoshard.planner.deferral_twins`). ``Evaluator`` makes the partial with a ``shard_map`` manual over ``A``
only (:meth:`autoshard.lower.Evaluator.partial_sum`); once per step the runtime sums the leading
dimension into the planned layout (:func:`reduce_partials`), which XLA does as one all-reduce.
"""

from __future__ import annotations

import dataclasses
import math

from autoshard.lower import operand_spec
from autoshard.spec import MeshInfo, ShardingSpec
from autoshard.strategies import partial_sum_axes


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
        return ShardingSpec((self.axes, *self.spec.without(self.axes).dims))

    @property
    def scatters(self) -> bool:
        """The planned layout splits the reduced value over ``axes`` (a reduce-scatter, not an all-reduce)."""
        return bool(self.spec.used_axes & set(self.axes))

    def acc_shape(self, shape, mesh: MeshInfo) -> tuple[int, ...]:
        return (mesh.axes_size(self.axes), *shape)

    def bytes(self, aval, mesh: MeshInfo) -> tuple[float, float]:
        """Per-device bytes of the running sum and of the reduced value."""
        unreduced = self.spec.without(self.axes)
        size = aval.dtype.itemsize
        return (float(math.prod(unreduced.shard_shape(aval.shape, mesh)) * size),
                float(math.prod(self.spec.shard_shape(aval.shape, mesh)) * size))


def summed_axes(plan, op) -> tuple[int, ...]:
    """The mesh axes over which ``op`` leaves partial sums under ``plan``
    (:func:`~autoshard.strategies.partial_sum_axes` of the layouts it reads)."""
    return partial_sum_axes(op, [operand_spec(plan, op, i) for i in range(len(op.inputs))])


def partial_sums(tasks, plan, avals) -> dict[int, PartialSum]:
    """The frontier values of ``tasks`` (one stage's) to accumulate unreduced under ``plan``, by value id.

    Every value the plan all-reduces qualifies (its running sum takes the memory the reduced one did), and
    every one it reduce-scatters that its solver chose to hold unreduced (``Plan.deferred``, which its
    memory counts; :func:`autoshard.planner.deferral_twins`)."""
    if plan is None:
        return {}
    kept = {}
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
            if not ps.scatters or v in plan.deferred:
                kept[v] = ps
    return kept


def reduce_partials(evaluator, partials, accs):
    """The running sums ``accs`` of ``partials`` summed over their leading dimension, in their planned layouts."""
    return [evaluator.constrain(a.sum(axis=0), ps.spec) for ps, a in zip(partials, accs, strict=True)]
