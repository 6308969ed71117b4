"""The work each op does under a strategy: flops, HBM bytes, the unit that runs it.

The planner asks a rule *how* an op can run (its layouts and collectives); it asks this module *what* the
op then does on one device, as a :class:`~autoshard.perf.Work` that :mod:`autoshard.perf.compute` prices.
The same work is what a plan reports (``PlanCost.flops``, ``PlanCost.hbm_bytes``) and what the step's
schedule runs.

- **Flops** are the op's own (:func:`autoshard.strategies.op_flops`), divided by the devices that split
  it: every mesh axis that splits one of its operands or results divides the work.
- **Bytes** approximate XLA's fusion with the memory estimate's rule (:func:`autoshard.memory.materialised_values`):
  an op reads the operands that are buffers and writes the results that are; a value fused into its
  reader costs no HBM traffic. The sum over a fused chain is the fusion's own traffic.
- **Attention.** Where the hardware has a fused attention kernel (every GPU and TPU preset), the score
  matrices of an attention (a matmul of queries and keys, normalised by a softmax, contracted with values)
  never reach HBM: the ops that read or write them run as the kernel, at its measured rate
  (:func:`attention_scores`). cuDNN's own attention primitives are the kernel by name.

Example:
    >>> from autoshard.work import TRAFFIC_NONE
    >>> TRAFFIC_NONE.kind
    'vector'
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from autoshard.attention import all_ops, attention_scores
from autoshard.perf.compute import Work, operand_class
from autoshard.spec import MeshInfo, ShardingSpec
from autoshard.strategies import op_flops, op_info

__all__ = ["TRAFFIC_NONE", "OpTraffic", "attention_scores", "backward_ops", "program_traffic", "strategy_work"]

_CUDNN_ATTENTION = ("dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper",
                    "dot_product_attention_fp8_fwd_wrapper", "dot_product_attention_fp8_bwd_wrapper")


@dataclasses.dataclass(frozen=True, slots=True)
class OpTraffic:
    """What an op moves through HBM, independent of its layout.

    Attributes:
      read: per operand, whether it is read from HBM (a buffer that is not an attention score).
      write: per result, whether it is written to HBM.
      kind: the :data:`~autoshard.perf.compute.KINDS` entry of the unit that runs it.
    """

    read: tuple[bool, ...] = ()
    write: tuple[bool, ...] = ()
    kind: str = "vector"


TRAFFIC_NONE = OpTraffic()


def backward_ops(graph, inherited: bool = False) -> set[int]:
    """Indices of the ops of jax.grad's backward pass: those whose name stack has ``transpose``, and every op
    in the body of such a scan (a body's own name stacks start afresh)."""
    out = set()
    for op in graph.ops:
        back = inherited or _in_backward(op)
        if back:
            out.add(op.index)
        if op.body is not None:
            out |= backward_ops(op.body, back)
    return out


def program_traffic(program, profile, *, fused_attention: bool) -> dict[int, OpTraffic]:
    """Op index -> :class:`OpTraffic` for every op of ``program`` (nested bodies included)."""
    from autoshard.memory import materialised_values

    mat = materialised_values(program, profile)
    scores = attention_scores(program) if fused_attention else frozenset()
    backward = backward_ops(program.graph) if scores else set()
    out = {}
    for op in all_ops(program.graph):
        touches = any(isinstance(x, int) and x in scores for x in op.inputs) or any(v in scores for v in op.outputs)
        if op.name in _CUDNN_ATTENTION:
            kind = "attention_bwd" if "bwd" in op.name else "attention_fwd"
        elif touches:
            kind = "attention_bwd" if op.index in backward else "attention_fwd"
        elif op_info(op.name).contraction:
            kind = "matmul"
        else:
            kind = "vector"
        read = tuple(isinstance(x, int) and (x in mat or _is_input(x, program)) and x not in scores
                     for x in op.inputs)
        write = tuple(v in mat and v not in scores for v in op.outputs)
        out[op.index] = OpTraffic(read, write, kind)
    return out


def _is_input(v: int, program) -> bool:
    return v not in program.producer


def _in_backward(op) -> bool:
    """An op made by transposing the forward (jax.grad's backward pass) carries ``transpose`` in its name stack."""
    stack = getattr(op.source_info, "name_stack", None)
    return stack is not None and "transpose" in str(stack)


def _local(shape, spec: ShardingSpec | None, mesh: MeshInfo) -> tuple[int, ...]:
    if spec is None:
        return tuple(shape)
    return tuple(n // mesh.axes_size(axes) if mesh.axes_size(axes) else n for n, axes in zip(shape, spec.dims,
                                                                                              strict=True))


def _bytes(shape, dtype, spec, mesh) -> float:
    itemsize = _itemsize(dtype)
    return math.prod(_local(shape, spec, mesh)) * itemsize


def _itemsize(dtype) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 8


def strategy_work(op, traffic: OpTraffic, strategy, ctx, avals) -> Work:
    """The :class:`~autoshard.perf.Work` one device does running ``op`` under ``strategy``."""
    mesh = ctx.mesh
    used = set()
    for spec in (*strategy.in_specs, *strategy.out_specs):
        if spec is not None:
            used |= spec.used_axes
    shards = mesh.axes_size(used)
    flops = op_flops(op, avals) / shards if op.body is None else 0.0
    nbytes = 0.0
    for k, (shape, dtype, spec) in enumerate(zip(ctx.in_shapes, ctx.in_dtypes, strategy.in_specs, strict=True)):
        if k < len(traffic.read) and traffic.read[k]:
            nbytes += _bytes(shape, dtype, spec, mesh)
    for k, (shape, dtype, spec) in enumerate(zip(ctx.out_shapes, ctx.out_dtypes, strategy.out_specs, strict=True)):
        if k < len(traffic.write) and traffic.write[k]:
            nbytes += _bytes(shape, dtype, spec, mesh)
    gemm, cls = None, "fp32"
    if traffic.kind == "matmul":
        cls = operand_class(ctx.in_dtypes[:2])
        if op.name == "dot_general":
            gemm = _gemm(op, ctx, strategy, mesh)
    return Work(flops, nbytes, traffic.kind, cls, gemm)


def _gemm(op, ctx, strategy, mesh) -> tuple[int, int, int, int]:
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs = _local(ctx.in_shapes[0], strategy.in_specs[0], mesh)
    rhs = _local(ctx.in_shapes[1], strategy.in_specs[1], mesh)
    batch = math.prod(lhs[d] for d in lb)
    k = math.prod(lhs[d] for d in lc)
    m = math.prod(lhs[d] for d in range(len(lhs)) if d not in lc and d not in lb)
    n = math.prod(rhs[d] for d in range(len(rhs)) if d not in rc and d not in rb)
    return (int(batch), int(m), int(n), int(k))
