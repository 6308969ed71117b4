"""Build the strategy-selection problem from a captured program, and decode its solution.

Passes, in order (see docs/ARCHITECTURE.md):

1. ``enumerate_strategies``: one node per graph input and per op (scan bodies are
   expanded once, their costs scaled by the trip count), each with its rule's
   strategies, and one edge per use of a value.
2. ``merge_followers``: ops registered with ``follows=True`` join the node of
   their main operand's producer, taking for each of its strategies the one of
   theirs that keeps the layout (Alpa's follower merging). The problem the
   solver sees has only the leaders.
3. ``build_problem``: node costs, edge resharding matrices, and per-device memory
   over liveness intervals, as a :class:`~autoshard.solver.ShardingProblem`.
4. ``decode``: the solver's choice back to a layout for every value.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np

from autoshard.capture import CapturedProgram, Const, Op, op_spans
from autoshard.cost import Collective, CostModel
from autoshard.intent import indivisible_batch, respect_batch_axes, splitting_axes
from autoshard.solver import ShardingProblem
from autoshard.spec import ShardingSpec, candidate_specs, replicated
from autoshard.strategies import (
    RuleContext,
    Strategy,
    is_scan,
    lookup_rule,
    op_info,
    partial_sum_axes,
    replicated_strategy,
    scan_counts,
)


class AutoshardWarning(UserWarning):
    """A planning decision the user should know about (e.g. an unsupported primitive)."""


OVERLAP_CREDIT = 0.5
"""Where the backend runs collectives asynchronously (``CostModel.overlap``), the pairwise objective counts
this share of a hideable collective's time as hidden: the reshards of step inputs (a parameter's all-gather
can run while earlier layers compute) and the collectives of ops with no contraction downstream (a weight
gradient's reduction can run while the rest of the backward computes). How much actually hides depends on
the whole step, which no pairwise cost can see: the decoded plan's list schedule
(:func:`simulate_step`) gives the predicted step, and meshes and remat candidates are ranked by it."""


@dataclasses.dataclass(slots=True, eq=False)
class _Node:
    kind: str  # "input" | "op" | "scan_const" | "scan_carry" | "scan_x" | "scan_y"
    strategies: list[Strategy]
    outputs: tuple[int, ...]  # value ids, in out_specs order
    trips: int = 1
    weight: float = 1.0  # the objective counts the node this many times per trip (CapturedProgram.op_weights)
    comm_weight: float = 1.0  # ... and its strategies' communication this many (CapturedProgram.reduce_weights)
    each_run: tuple[int, ...] = ()  # strategies whose reduction runs every time: their communication counts `weight`
    deferred: dict = dataclasses.field(default_factory=dict)  # twin strategy -> layout of the unreduced sum it holds
    op: Op | None = None
    weak: bool = False  # a layout source we'd rather not follow (inputs, broadcasts, iota)
    label: str = ""
    # an input fed from the host: its transfer is priced in the objective (a sharded batch feeds faster), but an
    # input pipeline prefetches it beside the step, so the simulated step leaves it out
    fed: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class _Edge:
    src: int  # producer node
    src_pos: int  # position in the producer's out_specs
    dst: int  # consumer node
    dst_pos: int  # position in the consumer's in_specs; -1: the consumer's out_specs[0] (state ties)
    value: int  # value id carried
    scale: int


@dataclasses.dataclass(frozen=True, eq=False)
class StrategyGraph:
    """Nodes with strategies, and the uses between them, before merging."""

    nodes: tuple[_Node, ...]
    edges: tuple[_Edge, ...]
    producer: dict  # value id -> (node, out position)
    input_nodes: tuple[int, ...]
    output_ties: dict  # flat output index -> input node whose layout it must take
    unsupported: tuple[str, ...]


def _aval_shape(aval) -> tuple[int, ...]:
    return tuple(int(d) for d in getattr(aval, "shape", ()))


def _itemsize(aval) -> int:
    dt = getattr(aval, "dtype", None)
    try:
        return np.dtype(dt).itemsize
    except TypeError:  # extended dtypes (PRNG keys)
        return 8


def deferral_twins(op: Op, strategies: list[Strategy]):
    """``(strategies, each_run, deferred)`` of a sum whose partial sums a pipeline may keep unreduced over its
    microbatches (``CapturedProgram.held``; :mod:`autoshard.pipeline.deferred`).

    A strategy that all-reduces its partial sums keeps them unreduced at no cost in memory, and stays as
    it is. One that reduce-scatters them (its result split over the summed axes) is given twice: as it is,
    reduced in every run (its index in ``each_run``), and as a twin that holds the unreduced sum, the
    result's layout without the summed axes (``deferred``: twin index -> that layout), for the whole
    step and reduces it once. The solver weighs the twin's memory against its communication."""
    twins, each_run, deferred = [], [], {}
    for j, s in enumerate(strategies):
        axes = set(partial_sum_axes(op, s.in_specs))
        out = s.out_specs[0]
        if not axes or not (out.used_axes & axes):
            continue
        each_run.append(j)
        deferred[len(strategies) + len(twins)] = out.without(axes)
        twins.append(dataclasses.replace(s, name=f"{s.name} deferred"))
    return [*strategies, *twins], tuple(each_run), deferred


def _params_key(params):
    try:
        key = tuple(sorted(params.items()))
        hash(key)
        return key
    except TypeError:
        return None


def warn_indivisible_batch(program: CapturedProgram, tie_outputs, mesh) -> None:
    """One warning naming the batch leaves (see :mod:`autoshard.intent`) that no mesh axis which may
    split them divides: they are not split, and every device runs the whole batch."""
    paths = indivisible_batch(program, tie_outputs, mesh)
    if not paths:
        return
    size = _aval_shape(program.avals[program.graph.invars[program.in_paths.index(paths[0])]])[0]
    axes = splitting_axes(mesh)
    others = [a for a in mesh.active_axes if a not in axes and size % mesh.shape[a] == 0]

    def named(ax):
        return ", ".join(f"{mesh.names[a]}={mesh.shape[a]}" for a in ax)

    why = (f"no batch axis ({named(axes)}); {named(others)} divides it but is not named as a batch axis"
           if others else f"no mesh axis ({named(mesh.active_axes)})")
    warnings.warn(
        f"the batch of size {size} in {', '.join(paths)} is divisible by {why}, so it is not split: every "
        f"device runs the whole batch. Fix: use a batch size that is a multiple of one of "
        f"{sorted({mesh.shape[a] for a in axes})}, or pad the batch.",
        AutoshardWarning,
        stacklevel=3,
    )


def enumerate_strategies(program: CapturedProgram, cost: CostModel, *, pinned=None, donated=(),
                         tie_outputs=None, host_bandwidth: float | None = None, offloaded=(),
                         cache: dict | None = None) -> StrategyGraph:
    """Pass 1: nodes, strategies and edges for every input, op and scan body.

    Args:
      pinned: flat input index -> ShardingSpec the input must take.
      tie_outputs: flat output index -> flat input index whose layout the output must keep.
      host_bandwidth: bytes/s from host to one device; prices feeding the inputs that are not
        carried over from the previous step (the batch). None: feeding is free.
      offloaded: flat input indices kept in host memory (see :mod:`autoshard.offload`): each step
        moves the device's shard in and its replacement out, priced at ``host_bandwidth``.
      cache: the priced strategies of ops by signature (shapes, dtypes, params, traffic) and of layouts by
        shape, filled here; pass one dict to the calls of programs planned with the same ``cost`` (a remat
        search's candidates repeat the program's ops) so that each signature is enumerated once. None: this
        call's own.
    """
    pinned = pinned or {}
    b = _GraphBuilder(program, cost, cache)
    input_nodes = b.add_inputs(pinned, set((tie_outputs or {}).values()), host_bandwidth, offloaded)
    b.visit(program.graph.ops)
    ties = b.tie_outputs(tie_outputs or {}, input_nodes)
    nodes = b.nodes
    # A batch axis carries the batch (autoshard/intent.py); pinned inputs keep their layout.
    for n, restricted in respect_batch_axes(nodes, program, cost, tie_outputs=tie_outputs, pinned=pinned).items():
        nodes[n].strategies = restricted
    for i, n in enumerate(nodes):
        if b.follows.get(i):
            n.kind = "follower"
    return StrategyGraph(tuple(nodes), tuple(b.edges), b.producer, tuple(input_nodes), ties,
                         tuple(f"{k} (at {v})" for k, v in b.unsupported.items()))


class _GraphBuilder:
    """The state of :func:`enumerate_strategies`: nodes, edges and who produces each value."""

    def __init__(self, program: CapturedProgram, cost: CostModel, cache: dict | None = None):
        self.program, self.cost, self.mesh, self.avals = program, cost, cost.mesh, program.avals
        self.nodes: list[_Node] = []
        self.edges: list[_Edge] = []
        self.producer: dict[int, tuple[int, int]] = {}
        self.unsupported: dict[str, str] = {}
        self.follows: dict[int, bool] = {}
        self.cache: dict = {} if cache is None else cache
        self.terminal = _terminal_ops(program)
        self.quiet = cost.without_latency()
        self.traffic = None
        if cost.hardware is not None:  # every op priced by its roofline on the hardware (autoshard.work)
            from autoshard.backends import GPU
            from autoshard.work import program_traffic

            self.traffic = program_traffic(program, cost.profile or GPU,
                                           fused_attention=cost.hardware.accelerator.platform in ("gpu", "tpu"))

    def add_node(self, node: _Node) -> int:
        self.nodes.append(node)
        n = len(self.nodes) - 1
        for k, v in enumerate(node.outputs):
            self.producer[v] = (n, k)
        return n

    def spec_strategies(self, shape, specs=None):
        if specs is not None:
            return [Strategy(str(s), (), (s,)) for s in specs]
        key = ("layouts", shape)  # the candidate layouts of an unpinned value of this shape
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = [Strategy(str(s), (), (s,)) for s in candidate_specs(shape, self.mesh)]
        return hit

    def use(self, value, dst, pos, scale):
        if isinstance(value, Const) or value not in self.producer:
            return
        src, k = self.producer[value]
        self.edges.append(_Edge(src, k, dst, pos, value, scale))

    def add_inputs(self, pinned, carried, host_bandwidth, offloaded) -> list[int]:
        """One node per graph input (fresh inputs pay their feed, offloaded ones their move) and const."""
        program, avals, mesh = self.program, self.avals, self.mesh
        input_nodes = []
        for i, v in enumerate(program.graph.invars):
            shape = _aval_shape(avals[v])
            strategies = self.spec_strategies(shape, [pinned[i]] if i in pinned else None)
            if i not in carried and host_bandwidth:
                # Fresh inputs (the batch) are fed from the host every step: each device receives its shard.
                itemsize = _itemsize(avals[v])
                strategies = [dataclasses.replace(s, comm=_value_bytes_shape(shape, itemsize, s.out_specs[0], mesh)
                                                  / host_bandwidth) for s in strategies]
            elif i in offloaded and host_bandwidth:
                itemsize = _itemsize(avals[v])
                strategies = [dataclasses.replace(s, comm=2 * _value_bytes_shape(shape, itemsize, s.out_specs[0], mesh)
                                                  / host_bandwidth) for s in strategies]
            fed = i not in carried and bool(host_bandwidth)
            input_nodes.append(self.add_node(_Node("input", strategies, (v,), weak=True, label=program.in_paths[i],
                                                   fed=fed)))
        for v in program.consts:
            self.add_node(_Node("input", self.spec_strategies(_aval_shape(avals[v])), (v,), weak=True, label="<const>"))
        return input_nodes

    def op_context(self, op: Op) -> RuleContext:
        avals = self.avals
        in_shapes = tuple(x.shape if isinstance(x, Const) else _aval_shape(avals[x]) for x in op.inputs)
        # a typed PRNG key constant has a dtype but no numpy form
        in_dtypes = tuple((x.value.dtype if hasattr(x.value, "dtype") else np.asarray(x.value).dtype)
                          if isinstance(x, Const) else getattr(avals[x], "dtype", None) for x in op.inputs)
        return RuleContext(
            mesh=self.mesh,
            cost=self.quiet if op.index in self.terminal else self.cost,
            in_shapes=in_shapes,
            in_dtypes=in_dtypes,
            out_shapes=tuple(_aval_shape(avals[v]) for v in op.outputs),
            out_dtypes=tuple(getattr(avals[v], "dtype", None) for v in op.outputs),
            const_inputs=tuple(isinstance(x, Const) for x in op.inputs),
        )

    def op_strategies(self, op: Op, ctx: RuleContext):
        """The rule's strategies (cached by shapes and params) and whether the op is a follower."""
        traffic = None if self.traffic is None else self.traffic.get(op.index)
        entry = lookup_rule(op.name)
        if entry is None:
            if self.unsupported.get(op.name, "<unknown>") == "<unknown>":  # the first op with a user line
                self.unsupported[op.name] = op.source()
            flops = sum(math.prod(s) for s in ctx.out_shapes)
            return self.priced(op, ctx, traffic, [replicated_strategy(ctx, flops)]), False
        pkey = _params_key(op.params)
        key = None if pkey is None else (op.index in self.terminal, op.name, ctx.in_shapes, ctx.out_shapes,
                                          ctx.const_inputs, ctx.in_dtypes, ctx.out_dtypes, pkey, traffic)
        if key is not None and key in self.cache:
            return self.cache[key], entry.follows
        strategies = entry.rule(op, ctx)
        if not strategies:  # nothing divides evenly: fall back to replicated
            strategies = [replicated_strategy(ctx, sum(math.prod(s) for s in ctx.out_shapes))]
        strategies = self.priced(op, ctx, traffic, strategies)
        if key is not None:
            self.cache[key] = strategies
        return strategies, entry.follows

    def priced(self, op: Op, ctx: RuleContext, traffic, strategies: list[Strategy]) -> list[Strategy]:
        """With a hardware model, each strategy's compute is its :class:`~autoshard.perf.Work`'s roofline
        (:mod:`autoshard.work`); the rule's own compute (flops at one rate) stands otherwise. Where collectives
        overlap compute, the communication of an op with no contraction downstream (a weight gradient's
        reduction) counts :data:`OVERLAP_CREDIT` less in the objective."""
        if self.cost.overlap and op.index in self.terminal:
            strategies = [dataclasses.replace(s, comm=s.comm * (1 - OVERLAP_CREDIT)) if s.comm else s
                          for s in strategies]
        if traffic is None:
            return strategies
        from autoshard.work import strategy_work

        out = []
        for s in strategies:
            work = strategy_work(op, traffic, s, ctx, self.avals)
            out.append(dataclasses.replace(s, compute=self.cost.work_time(work), work=work))
        return out

    def visit(self, graph_ops):
        for op in graph_ops:
            if is_scan(op):
                self.visit_scan(op)
                continue
            ctx = self.op_context(op)
            strategies, is_follower = self.op_strategies(op, ctx)
            # Layout sources the readers should not follow (OpInfo.weak_layout: broadcasts, iotas, random
            # bits, whose dropout mask is as big as the activation it masks, and remat fences).
            weak = op_info(op.name).weak_layout
            weight = float(self.program.op_weights.get(op.index, 1.0))
            each_run, deferred = (), {}
            if len(op.outputs) == 1 and op.outputs[0] in self.program.held and op.index in self.program.reduce_weights:
                strategies, each_run, deferred = deferral_twins(op, strategies)
            n = self.add_node(_Node("op", strategies, op.outputs, trips=op.trips, op=op, weak=weak, label=op.name,
                                    weight=weight, comm_weight=float(self.program.reduce_weights.get(op.index, weight)),
                                    each_run=each_run, deferred=deferred))
            self.follows[n] = is_follower
            for i, x in enumerate(op.inputs):
                if strategies[0].in_specs[i] is not None:
                    self.use(x, n, i, op.trips)

    def visit_scan(self, op: Op):
        body, avals, mesh = op.body, self.avals, self.mesh
        p = op.params
        (n_consts, n_carry), length = scan_counts(p), int(p["length"])
        inner_trips = op.trips * length
        carry_nodes = []
        for j, (b, x) in enumerate(zip(body.invars, op.inputs, strict=True)):
            shape = _aval_shape(avals[b])
            if j < n_consts:
                n = self.add_node(_Node("scan_const", [Strategy(str(s), (s,), (s,))
                                                       for s in candidate_specs(shape, mesh)],
                                        (b,), trips=op.trips, label="scan const"))
            elif j < n_consts + n_carry:
                outer_out = op.outputs[j - n_consts]
                n = self.add_node(_Node("scan_carry", [Strategy(str(s), (s, s), (s, s))
                                                       for s in candidate_specs(shape, mesh)],
                                        (b, outer_out), trips=op.trips, label="scan carry"))
                carry_nodes.append(n)
            else:
                strategies = [Strategy(str(s), (ShardingSpec(((),) + s.dims),), (s,))
                              for s in candidate_specs(shape, mesh)]
                n = self.add_node(_Node("scan_x", strategies, (b,), trips=op.trips, label="scan xs"))
            self.use(x, n, 0, op.trips)
        self.visit(body.ops)
        for k, n in enumerate(carry_nodes):
            self.use(body.outvars[k], n, 1, inner_trips)
        for j, y in enumerate(body.outvars[n_carry:]):
            outer_v = op.outputs[n_carry + j]
            shape = _aval_shape(avals[outer_v])[1:]
            strategies = [Strategy(str(s), (s,), (ShardingSpec(((),) + s.dims),)) for s in candidate_specs(shape, mesh)]
            n = self.add_node(_Node("scan_y", strategies, (outer_v,), trips=op.trips, label="scan ys"))
            self.use(y, n, 0, inner_trips)

    def tie_outputs(self, tie_outputs, input_nodes) -> dict:
        """An edge from each carried output's producer to the input it replaces (the layout it keeps)."""
        ties = {}
        for out_i, in_i in tie_outputs.items():
            v = self.program.graph.outvars[out_i]
            node = input_nodes[in_i]
            ties[out_i] = node
            if isinstance(v, int) and v in self.producer and self.producer[v][0] != node:
                src, k = self.producer[v]
                self.edges.append(_Edge(src, k, node, -1, v, 1))
        return ties


def _terminal_ops(program: CapturedProgram) -> frozenset[int]:
    """Top-level ops with no contraction downstream: weight gradients and the optimizer update.

    Their collectives do not depend on one another, so XLA's combiners merge them into a few
    large ones; the planner prices them without per-collective latency."""
    feeds_contraction: set[int] = set()
    terminal = set()
    for op in reversed(program.graph.ops):
        downstream = any(v in feeds_contraction for v in op.outputs)
        if not downstream and op.body is None:
            terminal.add(op.index)
        if downstream or op_info(op.name).contraction or op.body is not None:
            feeds_contraction.update(x for x in op.inputs if isinstance(x, int))
    return frozenset(terminal)


@dataclasses.dataclass(frozen=True, eq=False)
class MergedGraph:
    """Pass 2's result: each node's root and the map from root strategies to its own."""

    graph: StrategyGraph
    root: np.ndarray  # node -> root node
    index_map: tuple[np.ndarray, ...]  # node -> int array over the root's strategies
    roots: tuple[int, ...]


def merge_followers(graph: StrategyGraph, cost: CostModel, avals, shrink: float | None = None) -> MergedGraph:
    """Pass 2: fold each follower into the node that produces its main operand.

    The main operand is the largest one, preferring producers that are not weak
    layout sources (inputs, broadcasts, iota). For each strategy of the producer's
    root, the follower takes its strategy that expects exactly that layout (the
    cheapest such), or else the one cheapest including the reshard. A follower that, for one
    layout of its main operand, may also split its output further leads a node of its own
    (:func:`_splits_more`).

    ``shrink``: a follower whose output is more than ``shrink`` times smaller than its
    main operand (a bias gradient summed over the batch) leads a node of its own. A
    merged group's memory is charged over its whole lifetime, so chaining the long-lived
    small values (gradients, their optimizer update) onto a short-lived activation makes
    the memory row count the activation until the update; the remat search uses this."""
    n = len(graph.nodes)
    root = np.arange(n)
    index_map: list[np.ndarray] = [np.arange(len(node.strategies)) for node in graph.nodes]
    in_edges: dict[int, list[_Edge]] = {}
    for e in graph.edges:
        in_edges.setdefault(e.dst, []).append(e)
    weak = [node.weak for node in graph.nodes]
    table = _SpecTable()
    by_in_cache: dict = {}
    maps: dict = {}
    numel = {}
    for i, node in enumerate(graph.nodes):
        if node.kind != "follower":
            continue
        cands = [e for e in in_edges.get(i, ()) if e.dst_pos >= 0]
        if not cands:
            continue
        for e in cands:
            if e.value not in numel:
                numel[e.value] = math.prod(_aval_shape(avals[e.value]))
        main = max(cands, key=lambda e: (numel[e.value], not weak[root[e.src]], -e.dst_pos))
        if shrink is not None and sum(math.prod(_aval_shape(avals[v])) for v in node.outputs) * shrink < \
                numel[main.value]:
            continue  # a reduction to a much smaller value leads a node of its own (see merge_followers)
        key = (id(node.strategies), main.dst_pos)
        hit = by_in_cache.get(key)
        if hit is None:
            by_in, splits = {}, {}
            for b, s in enumerate(node.strategies):
                spec = s.in_specs[main.dst_pos]
                splits.setdefault(spec, set()).add(_splits_more(s, spec))
                if spec not in by_in or s.cost < node.strategies[by_in[spec]].cost:
                    by_in[spec] = b
            hit = by_in_cache[key] = by_in, any(len(v) > 1 for v in splits.values())
        by_in, undecided = hit
        if undecided:
            continue  # its readers decide whether to split what its main operand leaves whole (_splits_more)
        r = root[main.src]
        weak[i] = weak[r]
        src_ids = table.out_ids(graph.nodes[main.src], main.src_pos)[index_map[main.src]]
        shape, itemsize = _aval_shape(avals[main.value]), _itemsize(avals[main.value])
        # followers of one kind on one shape repeat (every layer's): their map is computed once
        map_key = (key, shape, itemsize, src_ids.tobytes())
        mapped = maps.get(map_key)
        if mapped is None:
            uniq, inv = np.unique(src_ids, return_inverse=True)
            picks = np.empty(len(uniq), dtype=np.int64)
            for k, u in enumerate(uniq):
                spec = table.specs[u]
                b = by_in.get(spec)
                if b is None:
                    b = min(range(len(node.strategies)), key=lambda b: node.strategies[b].cost
                            + cost.reshard_time(shape, itemsize, spec, node.strategies[b].in_specs[main.dst_pos]))
                picks[k] = b
            mapped = maps[map_key] = picks[inv.reshape(-1)]
        root[i] = r
        index_map[i] = mapped
    return MergedGraph(graph, root, tuple(index_map), tuple(int(i) for i in range(n) if root[i] == i))


def _splits_more(strategy, spec: ShardingSpec | None) -> bool:
    """Whether ``strategy`` splits an output over a mesh axis that its main operand's layout ``spec`` leaves whole.

    A follower takes one strategy per layout of its main operand, chosen before its readers are known. Where
    one layout of the operand admits outputs both split further and not, the choice belongs to the solver,
    so the follower leads a node of its own: made split, the output saves its own compute, but a reader that
    needs it whole gathers it (slicing a whole value is free). flax's LayerNorm multiplies ``rsqrt(var)``
    (batch, seq, 1) by ``scale`` (hidden,) into a (batch, seq, hidden) array; merged into ``rsqrt(var)``
    it was made split over ``model`` where ``scale`` was, and each tensor-parallel block all-gathered it
    before its matmul (GPT-6.7B on (8, 2): 33 all-gathers a microbatch, 0.8 ms), while a class token
    ``jnp.tile``-d over the batch is best made split."""
    have = frozenset() if spec is None else spec.used_axes
    return any(a not in have for out in strategy.out_specs if out is not None for a in out.used_axes)


def tie_repeated_layers(merged: MergedGraph, avals, rounds: int = 3) -> dict[int, int]:
    """Pass 2b: give structurally identical nodes one shared choice.

    Repeated layers produce nodes whose neighbourhoods look alike. A few rounds of
    Weisfeiler-Lehman hashing over the merged graph (labels: primitive, params,
    shapes, strategies, members; edges: operand positions and shapes) group such
    nodes, and each group is solved as one node: the problem shrinks from every
    layer to about one. Nodes within ``rounds`` hops of a difference (the first and
    last layers, say) keep their own labels. This is a restriction, not an exact
    reduction: it assumes identical layers want identical layouts.

    Returns:
      root node -> the root node whose choice it takes.
    """
    graph = merged.graph
    roots = merged.roots
    root = merged.root
    names_cache: dict[int, int] = {}

    def strategies_key(node):
        k = names_cache.get(id(node.strategies))
        if k is None:
            k = names_cache[id(node.strategies)] = hash(tuple(s.name for s in node.strategies))
        return k

    def node_key(node):
        op = node.op
        shapes = tuple(tuple(getattr(avals[v], "shape", ())) for v in node.outputs)
        if op is None:
            return (node.kind, shapes, strategies_key(node), node.trips, node.weight, node.comm_weight)
        return (node.kind, op.name, _params_key(op.params) or op.name, shapes, strategies_key(node), node.trips,
                node.weight, node.comm_weight, node.each_run, tuple(node.deferred.items()))

    members: dict[int, list] = {}
    for i, node in enumerate(graph.nodes):
        members.setdefault(int(root[i]), []).append(node_key(node))
    label = {r: hash(tuple(sorted(map(hash, members[r])))) for r in roots}
    nbrs: dict[int, list] = {r: [] for r in roots}
    for e in graph.edges:
        u, v = int(root[e.src]), int(root[e.dst])
        if u == v:
            continue
        ekey = hash((e.src_pos, e.dst_pos, tuple(getattr(avals[e.value], "shape", ())), e.scale,
                     graph.nodes[e.dst].weight))
        nbrs[u].append((ekey, 1, v))
        nbrs[v].append((ekey, 0, u))
    for _ in range(rounds):
        label = {r: hash((label[r], tuple(sorted((k, d, label[w]) for k, d, w in nbrs[r])))) for r in roots}
    first: dict[int, int] = {}
    return {r: first.setdefault(label[r], r) for r in roots}


def _value_bytes_shape(shape, itemsize, spec: ShardingSpec, mesh) -> float:
    return float(math.prod(spec.shard_shape(shape, mesh)) * itemsize)


def _value_bytes(aval, spec: ShardingSpec, mesh) -> float:
    from autoshard.memory import value_bytes  # one byte count for the solver's row and the estimate

    return value_bytes(aval, spec, mesh)


def liveness(program: CapturedProgram, donated_inputs=()) -> dict[int, tuple[int, int]]:
    """Half-open live interval of every value, over :func:`autoshard.capture.op_spans`'s positions.

    Inputs live from 0; non-donated inputs until the end (the caller keeps them). A value lives from the
    first position of the op that makes it to the last of its last reader. Inside a scan body: the body's
    inputs (the carry and this iteration's slices) and outputs live through the whole scan, the rest from
    their op to their last reader within the body."""
    spans, end_t = op_spans(program.graph)
    start, end = {}, {}
    for i, v in enumerate(program.graph.invars):
        start[v] = 0
        end[v] = 1 if i in donated_inputs else end_t
    for v in program.consts:
        start[v], end[v] = 0, end_t

    def mark(graph) -> None:
        for op in graph.ops:
            first, last = spans[op.index]
            for v in op.outputs:
                start[v] = first
                end.setdefault(v, last + 1)
            for x in op.inputs:
                if isinstance(x, int):
                    end[x] = max(end.get(x, last + 1), last + 1)
            if op.body is not None:
                mark(op.body)
                for v in (*op.body.invars, *op.body.outvars):
                    if isinstance(v, int):
                        start[v] = first
                        end[v] = max(end.get(v, last + 1), last + 1)

    mark(program.graph)
    for x in program.graph.outvars:
        if isinstance(x, int):
            end[x] = end_t
    return {v: (start[v], end[v]) for v in start}


@dataclasses.dataclass(frozen=True, eq=False)
class BuiltProblem:
    """The solver's problem plus what is needed to decode its answer."""

    problem: ShardingProblem
    merged: MergedGraph
    root_index: dict  # root node -> problem node index


class _SpecTable:
    """Interns specs as small ints, and caches per-node strategy arrays, so edge
    matrices are built with numpy from the few distinct (source, destination) pairs."""

    def __init__(self):
        self.ids: dict = {}
        self.specs: list = []
        self._arrays: dict = {}

    def id(self, spec) -> int:
        i = self.ids.get(spec)
        if i is None:
            i = self.ids[spec] = len(self.specs)
            self.specs.append(spec)
        return i

    def out_ids(self, node: _Node, pos: int) -> np.ndarray:
        key = (id(node.strategies), "out", pos)
        a = self._arrays.get(key)
        if a is None:
            a = self._arrays[key] = np.array([self.id(s.out_specs[pos]) for s in node.strategies], np.int64)
        return a

    def in_ids(self, node: _Node, pos: int) -> np.ndarray:
        if pos < 0:
            return self.out_ids(node, 0)
        key = (id(node.strategies), "in", pos)
        a = self._arrays.get(key)
        if a is None:
            a = self._arrays[key] = np.array([self.id(s.in_specs[pos]) for s in node.strategies], np.int64)
        return a

    def costs(self, node: _Node, field: str = "cost") -> np.ndarray:
        """Each strategy's ``field`` (``"cost"``: compute + communication; ``"comm"``) of ``node``."""
        key = (id(node.strategies), field)
        a = self._arrays.get(key)
        if a is None:
            a = self._arrays[key] = np.array([getattr(s, field) for s in node.strategies], float)
        return a

    def reshard_matrix(self, cost: CostModel, shape, itemsize, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Matrix of reshard times between every row spec id and column spec id."""
        key = (shape, itemsize, rows.tobytes(), cols.tobytes())
        hit = self._arrays.get(key)
        if hit is not None:
            return hit
        urow, ri = np.unique(rows, return_inverse=True)
        ucol, ci = np.unique(cols, return_inverse=True)
        small = np.array([[self.time(cost, shape, itemsize, a, b) for b in ucol] for a in urow]).reshape(
            len(urow), len(ucol))
        out = self._arrays[key] = small[np.ix_(ri.reshape(-1), ci.reshape(-1))]
        return out

    def reshard_pairs(self, cost: CostModel, shape, itemsize, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Reshard time for each (rows[k], cols[k]) pair."""
        key = (shape, itemsize, "pairs", rows.tobytes(), cols.tobytes())
        hit = self._arrays.get(key)
        if hit is not None:
            return hit
        pairs = rows * len(self.specs) + cols
        upairs, inv = np.unique(pairs, return_inverse=True)
        n = len(self.specs)
        vals = np.array([self.time(cost, shape, itemsize, int(p // n), int(p % n)) for p in upairs])
        out = self._arrays[key] = vals[inv.reshape(-1)]
        return out

    def value_bytes(self, shape, itemsize, ids: np.ndarray, mesh) -> np.ndarray:
        """Per-device bytes of a value under each spec id in ``ids``."""
        key = (shape, itemsize, "bytes", ids.tobytes())
        hit = self._arrays.get(key)
        if hit is None:
            uniq, inv = np.unique(ids, return_inverse=True)
            per = np.array([_value_bytes_shape(shape, itemsize, self.specs[u], mesh) if shape else float(itemsize)
                            for u in uniq])
            hit = self._arrays[key] = per[inv.reshape(-1)]
        return hit

    def time(self, cost, shape, itemsize, a: int, b: int) -> float:
        if a == b:
            return 0.0
        src, dst = self.specs[a], self.specs[b]
        if src is None or dst is None:
            return 0.0
        return cost.reshard_time(shape, itemsize, src, dst)


def build_problem(merged: MergedGraph, program: CapturedProgram, cost: CostModel, *,
                  memory_limit=None, donated_inputs=(), ties: dict[int, int] | None = None,
                  carried: dict[int, int] | None = None, offloaded=()) -> BuiltProblem:
    """Pass 3: node costs, edge matrices and memory, in root-strategy space.

    ``ties`` (from :func:`tie_repeated_layers`) maps roots to the root whose choice they share.
    ``carried`` maps flat outputs to the flat inputs they replace: a donated input's buffer is
    reused for its replacement, so the two count once. ``offloaded`` flat inputs live in host
    memory: only their transient device copies count (see :func:`autoshard.offload.device_intervals`).
    Values the backend keeps on chip (attention scores where it fuses attention:
    :func:`autoshard.memory.on_chip_values`) take no memory."""
    from autoshard.memory import on_chip_values

    graph = merged.graph
    mesh = cost.mesh
    roots = tuple(r for r in merged.roots if ties is None or ties[r] == r)
    root_index = {r: k for k, r in enumerate(roots)}
    if ties is not None:
        root_index.update({r: root_index[t] for r, t in ties.items()})
    root_of = np.array([root_index[int(r)] for r in merged.root], np.int64)
    sizes = [len(graph.nodes[r].strategies) for r in roots]
    table = _SpecTable()
    node_costs = [np.zeros(s) for s in sizes]
    for i, node in enumerate(graph.nodes):
        node_costs[root_of[i]] += table.costs(node)[merged.index_map[i]] * (node.trips * node.weight)
        if node.comm_weight != node.weight:
            # its reductions count comm_weight times, but those that run every time (deferral_twins)
            extra = np.full(len(node.strategies), node.trips * (node.comm_weight - node.weight))
            extra[list(node.each_run)] = 0.0
            node_costs[root_of[i]] += (table.costs(node, "comm") * extra)[merged.index_map[i]]
    pair_costs: dict[tuple[int, int], np.ndarray] = {}
    for e in graph.edges:
        ru, rv = int(root_of[e.src]), int(root_of[e.dst])
        rows = table.out_ids(graph.nodes[e.src], e.src_pos)[merged.index_map[e.src]]
        cols = table.in_ids(graph.nodes[e.dst], e.dst_pos)[merged.index_map[e.dst]]
        aval = program.avals[e.value]
        shape, itemsize = _aval_shape(aval), _itemsize(aval)
        scale = e.scale * graph.nodes[e.dst].weight
        if cost.overlap and graph.nodes[e.src].kind == "input":
            scale *= 1 - OVERLAP_CREDIT  # a step input's reshard can run before its first reader needs it
        if ru == rv:
            node_costs[ru] += scale * table.reshard_pairs(cost, shape, itemsize, rows, cols)
            continue
        m = scale * table.reshard_matrix(cost, shape, itemsize, rows, cols)
        if ru > rv:
            ru, rv, m = rv, ru, m.T
        key = (ru, rv)
        pair_costs[key] = pair_costs[key] + m if key in pair_costs else m
    edges = np.array(list(pair_costs), dtype=np.int64).reshape(-1, 2)
    donated = set(donated_inputs)
    aliased_in = {program.graph.invars[i] for i in (carried or {}).values() if i in donated}
    aliased_out = {program.graph.outvars[o] for o, i in (carried or {}).items()
                   if i in donated and isinstance(program.graph.outvars[o], int)}
    memory, intervals = _memory(merged, program, root_of, sizes, mesh=mesh, table=table,
                                donated_inputs=donated_inputs, aliased_in=aliased_in, aliased_out=aliased_out,
                                offloaded=offloaded, carried=carried or {},
                                on_chip=on_chip_values(program, cost.profile))
    names = tuple(_label(graph.nodes[r]) for r in roots)
    reserve = _in_flight_interval(program)
    if reserve is not None:  # a constant: one more node, of one strategy, that nothing reads
        node_costs.append(np.zeros(1))
        memory = (*memory, np.array([program.in_flight_bytes]))
        intervals = np.concatenate([intervals, np.array([reserve], np.int64)])
        names = (*names, "activations of the microbatches in flight")
    problem = ShardingProblem(tuple(node_costs), edges, tuple(pair_costs.values()), memory, intervals,
                              memory_limit, names)
    return BuiltProblem(problem, merged, root_index)


def _in_flight_interval(program: CapturedProgram) -> tuple[int, int] | None:
    """Where ``program.in_flight_bytes`` count, over top-level op positions: from the start to the first
    reader of a held value (:func:`liveness`'s positions); None when they do not."""
    if not program.in_flight_bytes or not program.held:
        return None
    first = _first_reads(program)
    return (0, min(first.values())) if first else None


def _first_reads(program: CapturedProgram) -> dict[int, int]:
    """Held value (``CapturedProgram.held``) -> the position of its first top-level reader (:func:`liveness`'s
    positions), for those that have one."""
    spans, _ = op_spans(program.graph)
    position = {op.index: spans[op.index][0] for op in program.graph.ops}
    first = {}
    for v in program.held:
        at = [position[u] for u, _ in program.uses.get(v, ()) if u in position]
        if at:
            first[v] = min(at)
    return first


def _label(node: _Node) -> str:
    if node.op is not None:
        return f"{node.op.name} at {node.op.source()}"
    return f"{node.kind} {node.label}"


def _memory(merged, program, root_of, sizes, *, mesh, table: _SpecTable, donated_inputs=(), aliased_in=(),
            aliased_out=(), offloaded=(), carried=None, on_chip=()):
    """Per root: the peak, over its members' overlapping lifetimes, of their summed bytes.

    Only materialised values count (see :mod:`autoshard.memory`): results of fused
    elementwise/layout ops that one op reads are skipped. Exact for a root alone;
    for merged groups, each strategy's peak is taken separately over the group's
    whole interval, which can only overestimate."""
    graph = merged.graph
    live = liveness(program, donated_inputs)
    _, end_t = op_spans(program.graph)
    for v in aliased_in:  # the replacement is written into this buffer at the end
        live[v] = (0, end_t)
    if offloaded:
        from autoshard.offload import device_intervals

        host_resident = device_intervals(program, offloaded, carried or {})
        live.update(host_resident)
        aliased_out = set(aliased_out) - set(host_resident)
    uses = {v: len(u) for v, u in program.uses.items()}
    outputs = {x for x in program.graph.outvars if isinstance(x, int)}
    first_read = _first_reads(program)
    members: dict[int, list] = {}
    for i, node in enumerate(graph.nodes):
        r = int(root_of[i])
        fused = node.kind == "follower"  # XLA fuses these unless their result is an output or read twice
        for k, v in enumerate(node.outputs):
            if v not in live or v in aliased_out or v in on_chip or (
                    fused and v not in outputs and uses.get(v, 0) <= 1):
                continue
            aval = program.avals[v]
            shape, itemsize = _aval_shape(aval), _itemsize(aval)
            per_strategy = table.value_bytes(shape, itemsize, table.out_ids(node, k), mesh)
            first = first_read.get(v)   # a held value: its running sum, from the start until its first reader
            if first is not None and first > live[v][0]:
                running = per_strategy.copy()
                for j, spec in node.deferred.items():   # a twin holds it unreduced
                    running[j] = _value_bytes_shape(shape, itemsize, spec, mesh)
                members.setdefault(r, []).append(((0, first), running[merged.index_map[i]]))
                members[r].append(((first, live[v][1]), per_strategy[merged.index_map[i]]))
                continue
            members.setdefault(r, []).append((live[v], per_strategy[merged.index_map[i]]))
    memory, intervals = [], []
    for r in range(len(sizes)):
        ms = members.get(r, [])
        if not ms:
            memory.append(np.zeros(sizes[r]))
            intervals.append((0, 0))
            continue
        lo = min(m[0][0] for m in ms)
        hi = max(m[0][1] for m in ms)
        if len(ms) == 1:
            peak = ms[0][1]
        else:  # sweep over start and end events; ends sort before starts at the same time
            events = sorted([(s, 1, k) for k, ((s, _), _) in enumerate(ms)] +
                            [(e, 0, k) for k, ((_, e), _) in enumerate(ms)])
            cur = np.zeros(sizes[r])
            peak = np.zeros(sizes[r])
            for _, is_start, k in events:
                if is_start:
                    cur += ms[k][1]
                    np.maximum(peak, cur, out=peak)
                else:
                    cur -= ms[k][1]
        memory.append(peak)
        intervals.append((lo, hi))
    return tuple(memory), np.array(intervals, dtype=np.int64).reshape(-1, 2)


@dataclasses.dataclass(frozen=True, eq=False)
class Decoded:
    """Pass 4's result: every node's chosen strategy and every value's layout."""

    node_strategy: tuple[Strategy, ...]
    value_specs: dict  # value id -> ShardingSpec
    operand_specs: dict  # (op index, operand position) -> ShardingSpec where it differs from the value's
    collectives: tuple[tuple[Collective, int], ...]  # (collective, multiplicity)
    compute_seconds: float
    comm_seconds: float
    deferred: dict = dataclasses.field(default_factory=dict)  # value -> layout of the unreduced sum its strategy holds


def decode(built: BuiltProblem, choice, program: CapturedProgram, cost: CostModel) -> Decoded:
    """Pass 4: the chosen strategy of every node, value layouts and the predicted collectives."""
    merged = built.merged
    graph = merged.graph
    node_strategy, deferred = [], {}
    for i, node in enumerate(graph.nodes):
        r = built.root_index[int(merged.root[i])]
        j = int(merged.index_map[i][int(choice[r])])
        node_strategy.append(node.strategies[j])
        if j in node.deferred:  # a twin of deferral_twins
            deferred[node.outputs[0]] = node.deferred[j]
    value_specs: dict[int, ShardingSpec] = {}
    for node, s in zip(graph.nodes, node_strategy, strict=True):
        for v, spec in zip(node.outputs, s.out_specs, strict=True):
            value_specs[v] = spec
    for v in program.consts:
        value_specs.setdefault(v, replicated(len(_aval_shape(program.avals[v]))))
    colls, compute, comm = [], 0.0, 0.0
    for node, s in zip(graph.nodes, node_strategy, strict=True):
        compute += s.compute * node.trips
        comm += s.comm * node.trips
        colls.extend((c, node.trips) for c in s.collectives)
    operand_specs = {}
    resharded: set = set()  # XLA computes one reshard of a value to a layout for all its readers
    for e in graph.edges:
        src_spec = node_strategy[e.src].out_specs[e.src_pos]
        dst_s = node_strategy[e.dst]
        dst_spec = dst_s.out_specs[0] if e.dst_pos < 0 else dst_s.in_specs[e.dst_pos]
        if src_spec == dst_spec:
            continue
        node = graph.nodes[e.dst]
        if node.op is not None and e.dst_pos >= 0:
            operand_specs[(node.op.index, e.dst_pos)] = dst_spec
        key = (e.value, e.scale, node.trips, src_spec, dst_spec)
        if key in resharded:
            continue
        resharded.add(key)
        aval = program.avals[e.value]
        t, cs = cost.reshard(_aval_shape(aval), _itemsize(aval), src_spec, dst_spec)
        comm += t * e.scale
        colls.extend((c, e.scale) for c in cs)
    return Decoded(tuple(node_strategy), value_specs, operand_specs, tuple(colls), compute, comm, deferred)


@dataclasses.dataclass(frozen=True, slots=True)
class StepTime:
    """The simulated step of a decoded plan (:func:`simulate_step`).

    Attributes:
      step_seconds: the schedule's makespan: compute and communication, overlapped where the backend runs
        collectives asynchronously.
      compute_seconds, communication_seconds: the work on the compute stream and on the network streams.
      exposed_seconds: the part of the step the compute stream waits on communication.
      flops, hbm_bytes: per device, summed over every op's :class:`~autoshard.perf.Work` (0 without a
        hardware model).
      busy: stream -> seconds.
      by_kind: the compute per :class:`~autoshard.perf.Work` kind (matmul, attention, vector):
        ``{"seconds", "flops", "bytes", "ops"}``, what a report shows of why a plan is slow.
      forward_seconds: the compute of the forward pass's ops (those jax.grad did not make by transposing):
        the pipeline schedule splits a stage's time into forward and backward by it.
    """

    step_seconds: float
    compute_seconds: float
    communication_seconds: float
    exposed_seconds: float
    flops: float
    hbm_bytes: float
    busy: dict
    by_kind: dict = dataclasses.field(default_factory=dict)
    forward_seconds: float = 0.0


def _combine(combined: dict, collectives, cost: CostModel, quiet: CostModel, task: int) -> None:
    """Record terminal collectives that XLA's combiners merge into one per kind and device group: the group
    pays one latency (charged once, after its last member), not one per collective."""
    for c in collectives:
        stream, latency, tasks = combined.get((c.kind, tuple(c.axes)), (cost.stream(c), 0.0, []))
        tasks.append(task)
        latency = max(latency, cost.collective_time(c) - quiet.collective_time(c))
        combined[(c.kind, tuple(c.axes))] = (stream, latency, tasks)


def _forward_and_later_edges(graph: StrategyGraph) -> tuple[dict[int, list[_Edge]], dict[int, list[_Edge]]]:
    """Edges by the node that reads them, and back edges (loop carries, state ties) by their source."""
    into: dict[int, list[_Edge]] = {}
    later: dict[int, list[_Edge]] = {}
    for e in graph.edges:
        if e.dst_pos < 0 or e.src >= e.dst:
            later.setdefault(e.src, []).append(e)
        else:
            into.setdefault(e.dst, []).append(e)
    return into, later


def _tally_kind(by_kind: dict[str, dict], s: Strategy, trips: int) -> None:
    """Add one op's roofline seconds, flops and bytes to its kind's totals (``StepTime.by_kind``)."""
    k = by_kind.setdefault(s.work.kind, {"seconds": 0.0, "flops": 0.0, "bytes": 0.0, "ops": 0})
    k["seconds"] += s.compute * trips
    k["flops"] += s.work.flops * trips
    k["bytes"] += s.work.bytes * trips
    k["ops"] += 1


def simulate_step(graph: StrategyGraph, node_strategy, program: CapturedProgram, cost: CostModel) -> StepTime:
    """List-schedule one run of every op of a decoded plan (:func:`autoshard.perf.simulate`).

    Each op is a compute task (its strategy's roofline seconds times its trips), preceded by the
    collectives that reshard its operands and followed by its own collectives, each on the stream of the
    network tier its device group crosses (:meth:`~autoshard.cost.CostModel.stream`). A reshard XLA computes
    once for several readers is one task. Where the backend overlaps collectives (``cost.overlap``), a
    collective runs beside every op that does not need its result; otherwise every task is serial and the
    step is the sum of compute and communication, as before the performance model."""
    from autoshard.perf.schedule import COMPUTE, Task, simulate

    tasks: list[Task] = []
    ready: dict[int, tuple[int, ...]] = {}  # value id -> tasks that must finish before it can be read
    into, later = _forward_and_later_edges(graph)
    resharded: dict[tuple, tuple[int, ...]] = {}
    combined: dict[tuple, tuple] = {}  # terminal collectives XLA merges: (kind, axes) -> (stream, latency, tasks)
    flops = hbm = forward = 0.0
    by_kind: dict[str, dict] = {}
    from autoshard.work import backward_ops

    backward = backward_ops(program.graph)
    terminal, quiet = _terminal_ops(program), cost.without_latency()

    def reshard(e: _Edge, dst_spec) -> tuple[int, ...]:
        src_spec = node_strategy[e.src].out_specs[e.src_pos]
        deps = ready.get(e.value, ())
        if src_spec == dst_spec:
            return deps
        key = (e.value, e.scale, src_spec, dst_spec)
        if key in resharded:
            return resharded[key]
        aval = program.avals[e.value]
        _, colls = cost.reshard(_aval_shape(aval), _itemsize(aval), src_spec, dst_spec)
        for c in colls:
            tasks.append(Task(f"reshard {c.kind}", cost.stream(c), cost.collective_time(c) * e.scale, deps))
            deps = (len(tasks) - 1,)
        resharded[key] = deps
        return deps

    for i, (node, s) in enumerate(zip(graph.nodes, node_strategy, strict=True)):
        deps: set[int] = set()
        for e in into.get(i, ()):
            deps.update(reshard(e, s.in_specs[e.dst_pos]))
        final = tuple(sorted(deps))
        if s.compute > 0:
            tasks.append(Task(node.label, COMPUTE, s.compute * node.trips, final))
            final = (len(tasks) - 1,)
            if node.op is not None and node.op.index not in backward:
                forward += s.compute * node.trips
        if s.work is not None:
            flops += s.work.flops * node.trips
            hbm += s.work.bytes * node.trips
            _tally_kind(by_kind, s, node.trips)
        if s.collectives:  # its own collectives, at their price (the objective may have discounted them)
            is_terminal = node.op is not None and node.op.index in terminal
            model = quiet if is_terminal else cost
            seconds = sum(model.collective_time(c) for c in s.collectives) * node.trips
            if seconds > 0:
                tasks.append(Task(f"{node.label} {s.collectives[0].kind}", cost.stream(s.collectives[0]), seconds,
                                  final))
                final = (len(tasks) - 1,)
                if is_terminal:
                    _combine(combined, s.collectives, cost, quiet, final[0])
        elif s.comm > 0 and not node.fed:  # an input kept in host memory (offloaded): its transfer
            tasks.append(Task(f"{node.label} host transfer", "host", s.comm * node.trips, final))
            final = (len(tasks) - 1,)
        for v in node.outputs:
            ready[v] = final
        for e in later.get(i, ()):
            dst = node_strategy[e.dst]
            reshard(e, dst.out_specs[0] if e.dst_pos < 0 else dst.in_specs[e.dst_pos])
    for (kind, _), (stream, latency, deps) in combined.items():  # each combined collective's one latency
        tasks.append(Task(f"combined {kind} latency", stream, latency, tuple(deps)))
    sched = simulate(tasks, overlap=cost.overlap)
    compute = sched.busy.get(COMPUTE, 0.0)
    comm = sum(v for k, v in sched.busy.items() if k != COMPUTE)
    return StepTime(sched.makespan, compute, comm, sched.exposed, flops, hbm, dict(sched.busy), by_kind, forward)


def warn_dropped_pins(program, axis_names) -> None:
    """One warning for the sharding annotations that name axes the planning mesh lacks (they lay out nothing)."""
    from autoshard.explicit import dropped_pins

    message = dropped_pins(program, axis_names)
    if message is not None:
        warnings.warn(message, AutoshardWarning, stacklevel=3)


def warn_unsupported(names) -> None:
    for n in names:
        warnings.warn(
            f"autoshard has no sharding rule for primitive {n}; it runs replicated. "
            "Register one with autoshard.strategies.register_strategy to shard it (or, if replicated is "
            "right, autoshard.strategies.register_replicated(name, why=...)).",
            AutoshardWarning,
            stacklevel=3,
        )
