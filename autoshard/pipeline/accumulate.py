"""Find the gradient-accumulation frontier of a black-box ``train_step(state, batch)``.

The step is captured twice: at the full batch ``B`` and at the microbatch ``b = B / k`` (at
``2B`` when ``k == 1``, only to see which values carry the batch). The two programs have the same
ops, so a value whose shape differs between them carries the batch. Every top-level op falls in
one region:

* ``P`` (prologue): no batch-dependent input and no batched output: parameter casts, optimizer
  constants. Pure functions of the state; recomputed wherever they are needed.
* ``M`` (microbatch): the per-example region. It runs once per microbatch, from the
  microbatch program (its shapes), with the full program's scalar literals (so ``1 / B`` stays
  ``1 / B``). An ``M`` op whose output no longer carries the batch sums over it (a weight
  gradient, the summed loss): that output is on the *frontier*, summed across microbatches.
* ``R`` (rest): consumes frontier sums: the optimizer update. Runs once, from the full program.

What cannot be accumulated exactly is rejected: a batch reduction that is not a sum (max over
the batch), and a batch statistic that feeds back into per-example values (BatchNorm).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from autoshard.capture import CapturedProgram, Const, Op, OpGraph, capture_graph
from autoshard.errors import InputError
from autoshard.pipeline.boundary import BOUNDARY

# Ops that draw random bits of a given shape from a key: drawn per example, they are sliced per microbatch.
DRAWS = frozenset({"random_bits"})
# Batch reductions that are sums: the frontier value of k microbatches is the sum of theirs.
SUM_REDUCTIONS = frozenset({"reduce_sum", "dot_general", "conv_general_dilated", "scatter-add", "scatter_add"})


@dataclasses.dataclass(frozen=True, eq=False)
class StepAnalysis:
    """The regions of a captured step (see the module docstring).

    Attributes:
      full: the program at the full batch.
      micro: the program at the microbatch, with the full program's scalar literals; value ids
        are shared with ``full``.
      region: top-level op position -> ``"P"``, ``"M"`` or ``"R"``.
      batched: value ids that carry the batch; ``batch_axis`` gives the axis.
      dependent: value ids that depend on batch data.
      frontier: value ids of the per-microbatch partial sums.
      batch_inputs: positions (in ``full.graph.invars``) of the leaves split into microbatches.
      metric_outputs: flat output positions that are not the next state (loss, metrics).
      carried: value id of a next-state output -> value id of the argument it replaces (the carried state).
      num_microbatches: k.
      draws: value id of random bits drawn with the batch's shape (dropout masks, at any depth) ->
        ``(axis, full length)``: each microbatch takes its own slice of the bits the full step draws
        (:data:`autoshard.lower.MICROBATCH`), so the split step draws what the full step draws.
    """

    full: CapturedProgram
    micro: CapturedProgram
    region: tuple[str, ...]
    batched: frozenset
    batch_axis: dict
    dependent: frozenset
    frontier: tuple[int, ...]
    batch_inputs: tuple[int, ...]
    metric_outputs: tuple[int, ...]
    num_microbatches: int
    carried: dict = dataclasses.field(default_factory=dict)
    draws: dict = dataclasses.field(default_factory=dict)

    def op(self, pos: int) -> Op:
        """The op to run at top-level position ``pos``: microbatch shapes inside ``M``."""
        return (self.micro if self.region[pos] == "M" else self.full).graph.ops[pos]

    @property
    def avals(self):
        return self.micro.avals


def _where(op: Op) -> str:
    return f"`{op.name}` at {op.source()}"


def _same_structure(a: CapturedProgram, b: CapturedProgram) -> bool:
    if len(a.ops) != len(b.ops) or len(a.avals) != len(b.avals):
        return False
    return all(x.name == y.name and x.outputs == y.outputs and len(x.inputs) == len(y.inputs)
               for x, y in zip(a.ops, b.ops, strict=True))


def _with_full_literals(op_micro: Op, op_full: Op) -> Op:
    """``op_micro`` with the full program's scalar literals (1/B, not 1/b)."""
    inputs = tuple(
        xf if isinstance(xm, Const) and isinstance(xf, Const) and np.ndim(xm.value) == 0 else xm
        for xm, xf in zip(op_micro.inputs, op_full.inputs, strict=True))
    body = op_micro.body
    if body is not None and op_full.body is not None:
        body = OpGraph(body.invars, tuple(_with_full_literals(a, b) for a, b in
                                          zip(body.ops, op_full.body.ops, strict=True)), body.outvars)
    return dataclasses.replace(op_micro, inputs=inputs, body=body)


def _contains_boundary(graph: OpGraph | None) -> Op | None:
    if graph is None:
        return None
    for op in graph.ops:
        if op.name == BOUNDARY:
            return op
        found = _contains_boundary(op.body)
        if found is not None:
            return found
    return None


def batch_leaf_positions(args, batch_argnums, num_microbatches: int, in_paths) -> tuple[tuple[int, ...], int]:
    """Flat positions of the batch leaves and the batch size; checks divisibility."""
    positions, sizes, offset, problems = [], {}, 0, []
    for i, a in enumerate(args):
        leaves = jax.tree_util.tree_leaves(a)
        if i in batch_argnums:
            for j, leaf in enumerate(leaves):
                shape = np.shape(leaf)
                if not shape:
                    problems.append(f"{in_paths[offset + j]} is a scalar; a batch leaf needs a leading batch axis")
                    continue
                positions.append(offset + j)
                sizes[in_paths[offset + j]] = shape[0]
        offset += len(leaves)
    if not positions and not problems:
        problems.append(f"arguments {tuple(batch_argnums)} hold no arrays to split into microbatches")
    if len(set(sizes.values())) > 1:
        problems.append("batch leaves disagree on the batch size: " +
                        ", ".join(f"{p}: {n}" for p, n in sizes.items()))
    elif sizes:
        b = next(iter(sizes.values()))
        if b % num_microbatches:
            problems.append(
                f"the batch size {b} (leading axis of {', '.join(sizes)}) is not divisible by "
                f"num_microbatches={num_microbatches}. Fix: use a batch size that is a multiple of "
                f"{num_microbatches}, or num_microbatches that divides {b}.")
    if problems:
        raise InputError("cannot split the batch into microbatches:\n  " + "\n  ".join(problems))
    return tuple(positions), next(iter(sizes.values()))


def analyze_step(fun, args, *, batch_positions, batch_size: int, num_microbatches: int,
                 metric_outputs, in_paths=None, full: CapturedProgram | None = None, ties=None) -> StepAnalysis:
    """Capture ``fun(*args)`` at the full batch and the microbatch, and classify every op.

    ``full``: ``fun(*args)`` already captured at the full batch (``capture_graph(fun, args)``), or None.
    ``ties``: flat output position -> the argument position it is the next version of."""
    k = num_microbatches
    full, micro, ref = _captures(fun, args, batch_positions=batch_positions, batch_size=batch_size, k=k,
                                 in_paths=in_paths, full=full)
    batched, axis = set(), {}
    for v, (a, b) in enumerate(zip(full.avals, ref.avals, strict=True)):
        sa, sb = tuple(getattr(a, "shape", ())), tuple(getattr(b, "shape", ()))
        if sa != sb:
            batched.add(v)
            axis[v] = next(d for d, (x, y) in enumerate(zip(sa, sb, strict=True)) if x != y)
    dependent = {full.graph.invars[p] for p in batch_positions}
    region, frontier = _regions(full, batched, dependent)
    # Bits drawn with the batch's shape from keys that are not themselves per example: each microbatch slices
    # the full draw. Per-example keys (split per example, vmapped) already draw each microbatch's own bits.
    drawn = [op.outputs[0] for op in full.ops if op.name in DRAWS and op.outputs[0] in batched
             and not any(isinstance(x, int) and x in batched for x in op.inputs)]
    return StepAnalysis(
        full=full, micro=micro, region=tuple(region), batched=frozenset(batched), batch_axis=axis,
        dependent=frozenset(dependent), frontier=tuple(frontier), batch_inputs=tuple(batch_positions),
        metric_outputs=tuple(metric_outputs), num_microbatches=k,
        carried={full.graph.outvars[j]: full.graph.invars[i] for j, i in (ties or {}).items()
                 if isinstance(full.graph.outvars[j], int)},
        draws={v: (axis[v], full.avals[v].shape[axis[v]]) for v in drawn} if k > 1 else {})


def _captures(fun, args, *, batch_positions, batch_size: int, k: int, in_paths, full=None):
    """``(full, micro, ref)``: the program at the full batch, the microbatch program (with the full
    program's scalar literals), and the program at the other batch size that tells batched values apart."""
    flat, tree = jax.tree_util.tree_flatten(args)
    other = batch_size // k if k > 1 else 2 * batch_size

    def resized(n):
        out = list(flat)
        for p in batch_positions:
            x = flat[p]
            out[p] = jax.ShapeDtypeStruct((n, *np.shape(x)[1:]), x.dtype)
        return jax.tree_util.tree_unflatten(tree, out)

    full = capture_graph(fun, resized(batch_size), in_paths=in_paths) if full is None else full
    other_prog = capture_graph(fun, resized(other), in_paths=in_paths)
    if not _same_structure(full, other_prog):
        raise InputError(
            f"the step traces to different programs at batch size {batch_size} and {other}: it branches on the "
            "batch size, so its microbatches cannot be run from one program. Fix: make the step's code "
            "independent of the batch size (e.g. no Python `if x.shape[0] == ...`).")
    for op in full.ops:
        inner = _contains_boundary(op.body) if op.body is not None else None
        if inner is not None:
            raise InputError(
                f"pipeline_boundary is called inside a `{op.name}` body ({_where(inner)}). A stage cut must "
                "be at the top level of the step: a loop body runs as one unit on one stage. Fix: call "
                "pipeline_boundary between loop iterations' code outside the scan (unroll the layers), "
                "or remove it and let num_stages='auto' cut the program.")
    if k == 1:
        return full, full, other_prog
    micro_ops = {o.index: o for o in other_prog.ops}
    fixed = {op.index: _with_full_literals(micro_ops[op.index], op) for op in full.graph.ops}
    micro_graph = OpGraph(other_prog.graph.invars, tuple(fixed[o.index] for o in other_prog.graph.ops),
                          other_prog.graph.outvars)
    return full, dataclasses.replace(other_prog, graph=micro_graph), other_prog


def _regions(full: CapturedProgram, batched: set, dependent: set) -> tuple[list, list]:
    """Each top-level op's region (``P``, ``M``, ``R``) and the frontier, growing ``dependent``.

    Raises:
      InputError: a batch reduction that is not a sum, or a batch statistic fed back (BatchNorm)."""
    reduced: dict[int, Op] = {}   # value -> the op that reduced the batch away
    region, frontier = [], []
    for op in full.graph.ops:
        ins = [x for x in op.inputs if isinstance(x, int)]
        in_dep = any(x in dependent for x in ins)
        in_batched = any(x in batched for x in ins)
        out_batched = any(v in batched for v in op.outputs)
        red = [x for x in ins if x in reduced]
        if not in_dep and not red:
            region.append("M" if out_batched else "P")
            continue
        if red and (in_batched or out_batched):
            src = reduced[red[0]]
            raise InputError(
                f"cannot accumulate gradients over microbatches: {_where(src)} reduces over the batch, and its "
                f"result feeds back into per-example values at {_where(op)}. That is a batch statistic (like "
                "BatchNorm's mean and variance): each microbatch would see a different one, so the split step "
                "would not equal the full step. Fix: use num_microbatches=1 for this model, or a "
                "per-example normalisation (LayerNorm, GroupNorm).")
        if red:
            region.append("R")
            for v in op.outputs:
                reduced[v] = reduced[red[0]]
            continue
        region.append("M")
        for v in op.outputs:
            if v in batched:
                dependent.add(v)
                continue
            _check_sum(full, op)
            reduced[v] = op
            frontier.append(v)
    return region, frontier


def _check_sum(full: CapturedProgram, op: Op) -> None:
    """Refuse a per-example op whose unbatched output is not a sum over the batch."""
    if op.name not in SUM_REDUCTIONS:
        raise InputError(
            f"cannot accumulate gradients over microbatches: {_where(op)} reduces over the batch axis, and "
            f"`{op.name}` is not a sum, so the full-batch result is not the sum of the microbatch results. "
            "Only sums over the batch (reduce_sum, a mean, matmuls contracting the batch) can be "
            "accumulated. Fix: use num_microbatches=1, or compute the statistic outside the step.")
    if op.name.startswith("scatter") and not _is_zero_operand(full, op.inputs[0]):
        raise InputError(
            f"cannot accumulate {_where(op)}: it scatter-adds per-example values into a non-zero base, "
            "which the sum over microbatches would count once per microbatch. Fix: scatter-add into zeros "
            "and add the base after the step's batch sums.")


def _is_zero_operand(program: CapturedProgram, x) -> bool:
    if isinstance(x, Const):
        return not np.any(np.asarray(x.value))
    prod = program.producer.get(x)
    if prod is None:
        return False
    op = program.ops[prod[0]]
    return op.name == "broadcast_in_dim" and isinstance(op.inputs[0], Const) and not np.any(
        np.asarray(op.inputs[0].value))
