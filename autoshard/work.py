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
import weakref

import numpy as np

from autoshard.perf.compute import Work, operand_class
from autoshard.spec import MeshInfo, ShardingSpec
from autoshard.strategies import op_flops, op_info

__all__ = ["TRAFFIC_NONE", "OpTraffic", "attention_scores", "backward_ops", "program_traffic", "strategy_work"]

_CUDNN_ATTENTION = ("dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper",
                    "dot_product_attention_fp8_fwd_wrapper", "dot_product_attention_fp8_bwd_wrapper")
_MAX_HEAD_DIM = 512  # a contraction this small producing a big square-ish result: queries times keys


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


def _shape(aval) -> tuple[int, ...]:
    return tuple(int(d) for d in getattr(aval, "shape", ()))


def _signature(shape) -> tuple[int, ...]:
    return tuple(sorted(d for d in shape if d > 1))


def _all_ops(graph):
    for op in graph.ops:
        yield op
        if op.body is not None:
            yield from _all_ops(op.body)


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


_SCORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attention_scores(program) -> frozenset:
    """:func:`find_attention_scores` of ``program``, found once per program (the estimate and the row ask for
    every plan of it)."""
    try:
        return _SCORES[program]
    except KeyError:
        found = _SCORES[program] = find_attention_scores(program)
        return found
    except TypeError:  # not weakly referable
        return find_attention_scores(program)


def find_attention_scores(program) -> frozenset:
    """Value ids of attention score matrices (and their masks, softmax and gradients) in ``program``.

    An attention is found by its first matmul: a ``dot_general`` of small contraction (the head dim, at most
    512) whose result has a free dimension from each operand (queries, keys) larger than the contraction,
    and whose result is reduced over the keys' dimension downstream (the softmax's max or sum) before a
    second ``dot_general`` contracts that dimension (with the values). Every value of the same
    dimensions (sizes above 1) is a score value: the scores, their mask, softmax, dropout and gradients."""
    avals = program.avals
    ops = list(_all_ops(program.graph))
    readers: dict[int, list] = {}
    for op in ops:
        for x in op.inputs:
            if isinstance(x, int):
                readers.setdefault(x, []).append(op)
    signatures = set()
    for op in ops:
        if op.name != "dot_general":
            continue
        (lc, rc), (lb, rb) = op.params["dimension_numbers"]
        lhs, rhs = (_shape(avals[x]) if isinstance(x, int) else tuple(x.shape) for x in op.inputs[:2])
        k = math.prod(lhs[d] for d in lc)
        free_l = [lhs[d] for d in range(len(lhs)) if d not in lc and d not in lb]
        free_r = [rhs[d] for d in range(len(rhs)) if d not in rc and d not in rb]
        if k > _MAX_HEAD_DIM or not free_l or not free_r or math.prod(free_l) <= k or math.prod(free_r) <= k:
            continue
        out = op.outputs[0]
        sig = _signature(_shape(avals[out]))
        # one attention of a signature is enough: every layer's scores share it, and the search is not cheap
        if sig not in signatures and _reduced_then_contracted(out, readers, avals):
            signatures.add(sig)
    if not signatures:
        return frozenset()
    found = set()
    sizes = {math.prod(sig) for sig in signatures}  # a cheap test first: most values are not this big
    for v, aval in enumerate(avals) if isinstance(avals, (list, tuple)) else avals.items():
        shape = getattr(aval, "shape", None)
        if not shape or len(shape) < 2:
            continue
        n = math.prod(shape)  # a scan stacks a body's scores on a leading dimension (its residuals)
        if n in sizes and _signature(_shape(aval)) in signatures:
            found.add(v)
        elif shape[0] and n // shape[0] in sizes and _signature(_shape(aval)[1:]) in signatures:
            found.add(v)
    return frozenset(found)


def _reduced_then_contracted(value: int, readers, avals, depth: int = 24) -> bool:
    """Whether ``value`` reaches a max/sum reduction and a ``dot_general`` through elementwise ops."""
    sig = _signature(_shape(avals[value]))
    seen, stack, reduced, contracted = set(), [(value, 0)], False, False
    while stack:
        v, d = stack.pop()
        if v in seen or d > depth:
            continue
        seen.add(v)
        for op in readers.get(v, ()):
            if op.name in ("reduce_max", "reduce_sum", "argmax"):
                reduced = True
            elif op.name == "dot_general" and op.inputs and v in op.inputs[:2]:
                contracted = True
            for out in op.outputs:
                if _signature(_shape(avals[out])) == sig:
                    stack.append((out, d + 1))
        if reduced and contracted:
            return True
    return reduced and contracted


def program_traffic(program, profile, *, fused_attention: bool) -> dict[int, OpTraffic]:
    """Op index -> :class:`OpTraffic` for every op of ``program`` (nested bodies included)."""
    from autoshard.memory import materialised_values

    mat = materialised_values(program, profile)
    scores = attention_scores(program) if fused_attention else frozenset()
    backward = backward_ops(program.graph) if scores else set()
    out = {}
    for op in _all_ops(program.graph):
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
