"""Plans that read the mesh axes by their names: an axis named like a batch axis carries the batch.

A mesh axis named ``data``, ``batch``, ``dp``, ``fsdp`` (any case, or a name such as
``data_parallel``) is a *batch axis*. When the batch is split at all, a batch axis splits it: the
planner never puts the batch on ``model`` alone while ``data`` does tensor parallelism, even where
the sizes of the axes would make that a little cheaper. Users name axes to say what they mean,
and other code (data loaders, checkpoints, multi-host input pipelines) relies on that reading.

The pass runs at the end of :func:`autoshard.planner.enumerate_strategies`:

1. :func:`batch_inputs`: the flat inputs that hold the batch (the arguments of a step that carries
   state whose leaves are not carried; see the function).
2. :func:`batch_roles`: for every value, which dimensions come from the batch inputs' leading
   dimension (the batch) and which from their others (the sequence); the rest are features. The
   roles flow op by op through the op's own rule: a strategy that moves no data and splits one
   operand dimension over one mesh axis splits the output dimensions it flows into over that
   axis. No knowledge about primitives lives here.
3. :func:`respect_batch_axes` drops the strategies whose result swaps the roles the names give
   (:func:`_misreads`): the batch split over model axes without a batch axis; a batch axis on the
   sequence; or a batch axis on the features (tensor parallelism) while a model axis splits the
   batch or the sequence (data parallelism). A node that would be left with none keeps them all.
   Tensor parallelism over every axis with the batch whole (a few hundred tokens at hidden 1024,
   where it is also the cheapest by XLA's compiled bytes) stays allowed, and so do parameters and
   optimizer state split over a batch axis (ZeRO, FSDP). Of two parameter layouts that cost the
   same, the one on model axes wins (:data:`TIE_BREAK`).

Pinned layouts win: a pinned input keeps its one strategy, and when a pinned batch input itself
reads the axes otherwise (the batch on a model axis, the sequence on a batch axis), the user has said so
and the rule is not applied.
"""

from __future__ import annotations

import dataclasses
import math
import re

from autoshard.spec import MeshInfo, ShardingSpec
from autoshard.strategies import is_scan, scan_counts

BATCH_AXIS_WORDS = frozenset({"data", "batch", "dp", "ddp", "fsdp", "replica"})
"""Words naming a mesh axis as one that carries the batch (``data``, ``Batch``, ``dp``, ``data_parallel``)."""

TIE_BREAK = 1e-4
"""Fraction of the time to move an input leaf once that a layout reading the axis names against
their meaning pays: far below any real cost difference, above the solver's MIP gap (1e-9)."""


def is_batch_axis(name) -> bool:
    """Whether a mesh axis name says it carries the batch.

    >>> [is_batch_axis(n) for n in ("data", "Batch", "dp", "fsdp", "data_parallel", "model", "tp")]
    [True, True, True, True, True, False, False]
    """
    words = [w for w in re.split(r"[^a-z0-9]+", str(name).lower()) if w]
    return any(w in BATCH_AXIS_WORDS or w.startswith(("data", "batch")) for w in words)


def batch_axes(mesh: MeshInfo) -> frozenset[int]:
    """Indices of the active mesh axes named like batch axes."""
    return frozenset(a for a in mesh.active_axes if is_batch_axis(mesh.names[a]))


def _shape(program, v) -> tuple[int, ...]:
    return tuple(int(d) for d in getattr(program.avals[v], "shape", ()))


def batch_inputs(program, tie_outputs=None) -> tuple[int, ...]:
    """Flat inputs that hold the batch.

    The step must carry state (some output replaces an input: the train state). Then every
    top-level argument none of whose leaves is carried holds the batch, and its leaves whose
    leading dimension is the batch size (the commonest leading size among those arguments' leaves)
    are the batch. Only leaves whose role is ``"input"`` (:mod:`autoshard.roles`) count: weights passed
    beside the batch (fp8 copies of a stage's stacked matmul weights, whose leading size is the layer
    count) are named so with ``parallelize(..., state_roles={path_regex: "parameter"})``. A step that
    carries nothing gives no way to tell its batch from its parameters, and a program that is not a
    user's step (a pipeline stage's, without ``in_tree``) has no arguments to read: then none."""
    carried = set((tie_outputs or {}).values())
    if not carried or program.in_tree is None:
        return ()
    roles = program.in_roles
    fresh, offset = {}, 0
    for arg in program.in_tree.children():
        leaves = range(offset, offset + arg.num_leaves)
        offset += arg.num_leaves
        if any(i in carried for i in leaves):
            continue
        for i in leaves:
            shape = _shape(program, program.graph.invars[i])
            if shape and (not roles or roles[i] == "input"):
                fresh[i] = shape[0]
    if not fresh:
        return ()
    sizes = list(fresh.values())
    size = max(set(sizes), key=lambda n: (sizes.count(n), n))
    return tuple(i for i, n in fresh.items() if n == size)


def _flow_table(strategies) -> dict[tuple[int, int, int], list[frozenset[int]]]:
    """``(operand k, its dimension b, mesh axis) ->`` per output, the dimensions that ``b`` flows into: those that
    every communication-free strategy splitting only that dimension over that axis splits over it too.

    One pass over the strategies answers every query of an op (an 80-layer step asks it about 140,000 times, most
    of them of strategy lists shared between layers)."""
    table: dict[tuple[int, int, int], list[frozenset[int]]] = {}
    for s in strategies:
        if s.comm:
            continue
        for k, spec in enumerate(s.in_specs):
            split = [] if spec is None else [(b, d) for b, d in enumerate(spec.dims) if d]
            if len(split) != 1 or len(split[0][1]) != 1:
                continue
            b, (axis,) = split[0]
            dims = [frozenset(d for d, axes in enumerate(o.dims) if axis in axes) for o in s.out_specs]
            key = (k, b, axis)
            table[key] = dims if key not in table else [x & y for x, y in zip(table[key], dims, strict=True)]
    return table


@dataclasses.dataclass(frozen=True, slots=True)
class Roles:
    """Which dimensions of a value come from the batch inputs: ``batch`` from their leading dimension,
    ``tokens`` from their others (the sequence). The rest are features (from the parameters)."""

    batch: frozenset[int] = frozenset()
    tokens: frozenset[int] = frozenset()

    def __or__(self, other: Roles) -> Roles:
        batch = self.batch | other.batch
        return Roles(batch, (self.tokens | other.tokens) - batch)

    def shifted(self, by: int) -> Roles:
        """The roles after a leading dimension is dropped (``by=-1``) or added (``by=1``)."""
        return Roles(frozenset(d + by for d in self.batch if d + by >= 0),
                     frozenset(d + by for d in self.tokens if d + by >= 0))

    def __bool__(self) -> bool:
        return bool(self.batch or self.tokens)


def batch_roles(program, strategies_of: dict, batch: tuple[int, ...], mesh: MeshInfo) -> dict[int, Roles]:
    """Value id -> the :class:`Roles` of its dimensions, flowing from the batch inputs.

    ``strategies_of`` maps an op's index to its rule's strategies."""
    labels = {}
    for i in batch:
        v = program.graph.invars[i]
        labels[v] = Roles(frozenset({0}), frozenset(range(1, len(_shape(program, v)))))
    axes = mesh.active_axes

    def roles_of(x) -> Roles:
        return labels.get(x, Roles()) if isinstance(x, int) else Roles()

    tables: dict[int, dict] = {}  # id of a strategy list (alive in strategies_of throughout) -> its _flow_table

    def label_op(op):
        strategies = strategies_of.get(op.index)
        if not strategies:
            return
        table = tables.get(id(strategies))
        if table is None:
            table = tables[id(strategies)] = _flow_table(strategies)
        found = [Roles() for _ in op.outputs]
        for k, x in enumerate(op.inputs):
            roles = roles_of(x)
            for d in sorted(roles.batch | roles.tokens):
                for a in axes:
                    for j, dims in enumerate(table.get((k, d, a), ())):
                        found[j] = found[j] | (Roles(dims) if d in roles.batch else Roles(tokens=dims))
        for v, roles in zip(op.outputs, found, strict=True):
            if roles:
                labels[v] = roles

    def label_scan(op):
        body, p = op.body, op.params
        n_consts, n_carry = scan_counts(p)
        for j, (b, x) in enumerate(zip(body.invars, op.inputs, strict=True)):
            roles = roles_of(x).shifted(-1) if j >= n_consts + n_carry else roles_of(x)  # xs lose the scanned dim
            if roles:
                labels[b] = roles
        visit(body.ops)
        for k, out in enumerate(op.outputs):
            y = body.outvars[k]
            roles = roles_of(y).shifted(1) if k >= n_carry else roles_of(y) | roles_of(op.inputs[n_consts + k])
            if roles:
                labels[out] = roles

    def visit(ops):
        for op in ops:
            if is_scan(op):
                label_scan(op)
            elif any(isinstance(x, int) and x in labels for x in op.inputs):
                label_op(op)

    visit(program.graph.ops)
    return labels


def _misreads(spec: ShardingSpec, roles: Roles, axes: frozenset[int]) -> bool:
    """Whether the layout swaps the roles the axis names give: a batch dimension split over model
    axes only; a batch axis on the sequence; or a batch axis on the features (tensor parallelism)
    while a model axis splits the batch or the sequence (data parallelism)."""
    features_on_batch_axis = model_on_tokens = False
    for d, split in enumerate(spec.dims):
        on_batch_axis, on_model_axis = bool(axes.intersection(split)), bool(set(split) - axes)
        if d in roles.batch and split and not on_batch_axis:
            return True
        if d in roles.tokens and on_batch_axis:
            return True
        features_on_batch_axis |= on_batch_axis and d not in roles.batch and d not in roles.tokens
        model_on_tokens |= on_model_axis and (d in roles.batch or d in roles.tokens)
    return features_on_batch_axis and model_on_tokens


def respect_batch_axes(nodes, program, cost, *, tie_outputs=None, pinned=None) -> dict[int, list]:
    """Node index -> its strategies restricted to those that read the axis names as meant.

    ``nodes`` are the planner's strategy nodes (``strategies``, ``outputs`` value ids, ``op``);
    ``pinned`` the flat inputs whose layout is fixed. Nodes that need no change are left out."""
    mesh = cost.mesh
    axes = batch_axes(mesh)
    if not axes or not set(mesh.active_axes) - axes:
        return {}
    pinned = pinned or {}
    batch = batch_inputs(program, tie_outputs)
    if any(i in pinned and _misreads(pinned[i], Roles(frozenset({0}), frozenset(range(1, pinned[i].rank))), axes)
           for i in batch):
        return {}  # the user pinned the batch to a model axis: their reading wins
    strategies_of = {n.op.index: n.strategies for n in nodes if n.op is not None}
    labels = batch_roles(program, strategies_of, batch, mesh)
    input_of = {v: i for i, v in enumerate(program.graph.invars)}
    carried = set((tie_outputs or {}).values())
    cache: dict = {}
    changed = {}
    for n, node in enumerate(nodes):
        labelled = tuple((j, labels[v]) for j, v in enumerate(node.outputs) if v in labels)
        i = input_of.get(node.outputs[0]) if node.kind == "input" and node.outputs else None
        nudge = i is not None and i in carried and i not in pinned
        if not (labelled or nudge) or (i is not None and i in pinned):
            continue
        key = (id(node.strategies), labelled, nudge)
        if key not in cache:
            kept = [s for s in node.strategies
                    if not any(_misreads(s.out_specs[j], roles, axes) for j, roles in labelled)]
            if not kept or len(kept) == len(node.strategies):
                kept = node.strategies  # none left: the rule yields; none dropped: keep the shared list
            cache[key] = _nudged(kept, program, node.outputs[0], axes, cost) if nudge else kept
        if cache[key] is not node.strategies:
            changed[n] = cache[key]
    return changed


def _nudged(strategies, program, v, axes, cost) -> list:
    """Carried-state strategies (parameters, optimizer state) charged :data:`TIE_BREAK` per batch
    axis that splits them: of two layouts that cost the same, the one on model axes wins."""
    shape = _shape(program, v)
    itemsize = getattr(getattr(program.avals[v], "dtype", None), "itemsize", 4) or 4
    nudge = TIE_BREAK * math.prod(shape) * itemsize * min(cost.beta)

    def misread(spec):
        return sum(a in axes for d in spec.dims for a in d)

    return [dataclasses.replace(s, compute=s.compute + nudge * k) if (k := misread(s.out_specs[0])) else s
            for s in strategies]


def splitting_axes(mesh: MeshInfo) -> tuple[int, ...]:
    """The mesh axes that may split the batch: the batch axes where the names give roles, else every
    active axis."""
    axes = batch_axes(mesh)
    return tuple(sorted(axes)) if axes and set(mesh.active_axes) - axes else mesh.active_axes


def indivisible_batch(program, tie_outputs, mesh: MeshInfo) -> tuple[str, ...]:
    """Paths of the batch inputs whose batch size no axis that may split it (:func:`splitting_axes`)
    divides: they are not split. A batch of one sequence is not among them: there is no batch to split (a
    long-context step splits the sequence, over a context axis or any other)."""
    sizes = [mesh.shape[a] for a in splitting_axes(mesh)]
    return tuple(program.in_paths[i] for i in batch_inputs(program, tie_outputs)
                 if sizes and (b := _shape(program, program.graph.invars[i])[0]) > 1 and all(b % n for n in sizes))

