"""Recompute each stage's forward in its backward: pipeline stages that keep only their inputs in flight.

A stage's forward task hands its backward the residuals it made (activations the backward reads), and
the schedule keeps those of every in-flight microbatch alive: up to ``S - s`` microbatches on stage
``s`` under 1F1B, all ``k`` under GPipe. :func:`recompute_forward` rewrites a :class:`Partition` so
that each backward task starts by running the forward ops its residuals come from, from the stage's
own inputs (the previous stage's activations, the batch slice, the weights); the forward task then
returns only what other stages or the step read. A stage keeps one input per in-flight microbatch
instead of all its residuals, for one more forward pass per microbatch: GPipe's rematerialisation and
Megatron-LM's full activation recomputation. ``parallelize(remat=True)`` on a pipeline asks for it;
``remat="auto"`` takes it when no pipeline fits the memory budget without it.

Both runtimes run the rewritten tasks as they are: the backward's recomputed ops are in another
jitted program (``device_put``) or another ``lax.switch`` branch (``spmd``) than the forward's, so XLA
cannot merge the two.
"""

from __future__ import annotations

import dataclasses

from autoshard.pipeline.partition import Partition, Task


def recompute_forward(part: Partition, outputs=frozenset()) -> Partition:
    """``part`` with every stage's backward recomputing the forward ops its residuals come from.

    ``outputs``: value ids the step returns (a forward value the step returns stays an output of its task)."""
    tasks = dict(part.tasks)
    for s in range(part.num_stages):
        f, b = tasks.get(("F", s)), tasks.get(("B", s))
        if f is None or b is None:
            continue
        residuals = set(f.outvars) & set(b.invars)
        if not residuals:
            continue
        read_elsewhere = {v for key, t in tasks.items() if key != b.key for v in t.invars}
        kept = tuple(v for v in f.outvars
                     if v not in residuals or v in read_elsewhere or v in outputs or v in f.frontier)
        ops = (*_slice(f.ops, residuals), *b.ops)
        produced = {v for op in ops for v in op.outputs}
        invars = tuple(dict.fromkeys(x for op in ops for x in op.inputs if isinstance(x, int) and x not in produced))
        tasks[f.key] = dataclasses.replace(f, outvars=kept, frontier=tuple(v for v in kept if v in f.frontier))
        tasks[b.key] = Task(b.key, ops, invars, b.outvars, b.frontier)
    return dataclasses.replace(part, tasks=tasks)


def _slice(ops, wanted: set) -> list:
    """The ops (in order) that ``wanted`` values depend on."""
    need, keep = set(wanted), []
    for op in reversed(ops):
        if any(v in need for v in op.outputs):
            keep.append(op)
            need.update(x for x in op.inputs if isinstance(x, int))
    return keep[::-1]
