"""Attention score matrices in a captured program: where a backend that fuses attention keeps values on chip.

Shared by the performance model (:mod:`autoshard.work`: attention priced as one kernel) and the memory models
(:func:`autoshard.memory.on_chip_values`: no buffer for the scores), so both agree on what is fused.
"""

from __future__ import annotations

import math
import weakref

_MAX_HEAD_DIM = 512  # a contraction this small producing a big square-ish result: queries times keys


def _shape(aval) -> tuple[int, ...]:
    return tuple(int(d) for d in getattr(aval, "shape", ()))


def _signature(shape) -> tuple[int, ...]:
    return tuple(sorted(d for d in shape if d > 1))


def all_ops(graph):
    """Every op of ``graph``, those of nested bodies (scan, cond, while) after the op that holds them."""
    for op in graph.ops:
        yield op
        if op.body is not None:
            yield from all_ops(op.body)


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
    ops = list(all_ops(program.graph))
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
