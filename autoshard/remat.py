"""Automatic rematerialisation: recompute forward activations in the backward pass.

The captured program is the *whole* train step after ``jax.grad``: the forward
pass, then the backward pass, then the update. A *residual* is a value the forward
pass makes and the backward pass reads after the forward has finished; between
the two it occupies memory. Rematerialising it means recomputing it right before
its first backward read, from values that are kept anyway.

Passes (pure functions over :class:`~autoshard.capture.CapturedProgram`):

1. ``find_remat_units``: the forward ops (ancestors of the step's metrics, i.e. of
   the loss) are cut where a single activation crosses (the residual stream
   between two blocks, or between a block's attention and its MLP). Each segment
   between two cuts is a :class:`RematUnit`: its ops that produce residuals, the
   residuals, and the first backward position that reads one.
2. ``rematerialize``: a new program where each chosen unit's ops are duplicated
   right before that position and every later backward read points at the
   duplicates. The cut value that enters the unit lives until the recompute; the
   unit's residuals die in the forward. The rewritten program is planned like any
   other (the duplicates get strategies, costs and memory of their own), which is
   what makes remat and sharding one joint problem (see :func:`choose_remat`).
3. Lowering (:mod:`autoshard.lower`) routes each recompute group's outside inputs
   through ``jax.lax.optimization_barrier`` together with a backward value (the
   cotangent that the first recomputed read meets), as ``jax.checkpoint`` does:
   otherwise XLA's CSE would merge the duplicates back into the forward.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from autoshard.capture import CapturedProgram, Op, OpGraph
from autoshard.memory import value_bytes
from autoshard.strategies import op_flops, op_info


@dataclasses.dataclass(frozen=True, slots=True)
class RematUnit:
    """One segment of the forward pass that may be recomputed.

    Attributes:
      ops: top-level op indices (``Op.index``) to recompute, in program order.
      residuals: value ids they produce that the backward reads after the forward.
      inputs: value ids produced outside ``ops`` that the recompute reads (the cut
        value entering the segment, parameters, the batch).
      insert_at: the position in the top-level op list before which the recompute runs.
      anchor: a backward value available at ``insert_at`` that the recompute waits for.
      flops: the recomputed flops (unsharded; elementwise ops count one per element).
      matmul_flops: the part of ``flops`` in contractions (a lower bound on what the planner prices).
      source: ``file:line`` of the segment's first and last ops, for reports.
      residual_bytes: the residuals' bytes, unsharded (what recomputing the unit frees, before fusion and layout).
    """

    ops: tuple[int, ...]
    residuals: tuple[int, ...]
    inputs: tuple[int, ...]
    insert_at: int
    anchor: int | None
    flops: float
    matmul_flops: float
    source: str
    residual_bytes: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class RematGroup:
    """In a rematerialised program: one unit's fences and duplicated ops.

    Each value the recompute reads from outside (``RematUnit.inputs``) passes through a fence:
    an ``optimization_barrier`` op of its own, so the planner gives the recompute's inputs
    layouts and lifetimes of their own. Lowering evaluates a group's fences as one barrier
    together with ``anchor``."""

    fences: tuple[int, ...]  # op indices of the fences, one per outside input
    ops: tuple[int, ...]  # op indices of the duplicates
    anchor: int | None  # backward value the recompute must wait for


@dataclasses.dataclass(frozen=True, slots=True)
class RematChoice:
    """The rematerialisation a plan uses (``Plan.remat``).

    Attributes:
      units: how many forward segments are recomputed: the first ``units`` of
        :func:`find_remat_units` (``max_units``), in forward order.
      num_units: how many units the program offers.
      max_units: the ``max_units`` they were found with (to redo the rewrite at lowering).
      extra_flops: recomputed flops per step (unsharded).
      peak_without: the smallest predicted peak per device without remat (same budget search).
      candidates: ``(units, budget planned against, predicted objective or None when infeasible,
        predicted peak or None)`` for every candidate the search planned.
      sources: ``file:line`` span of each recomputed unit.
      planned_budget: the budget the chosen plan was solved against (below the user's when a
        compiled check asked for a margin).
      compiled_peak: XLA's peak per device for the chosen plan, when the search compiled it.
    """

    units: int
    num_units: int
    max_units: int
    extra_flops: float = 0.0
    peak_without: float | None = None
    candidates: tuple = ()
    sources: tuple[str, ...] = ()
    planned_budget: float | None = None
    compiled_peak: float | None = None

    def describe(self) -> str:
        if not self.units:
            return "no rematerialisation"
        return (f"rematerialise {self.units} of {self.num_units} forward segments "
                f"(+{self.extra_flops / 1e9:.3g} GFLOP recomputed per step)")


def _forward_ops(program: CapturedProgram, ties) -> set[int]:
    """Top-level ops the step's metrics (outputs that are not the next state) depend on."""
    tied = set((ties or {}).keys())
    want = {x for j, x in enumerate(program.graph.outvars) if isinstance(x, int) and j not in tied}
    position = {op.index: op for op in program.graph.ops}
    top_producer = {v: op.index for op in program.graph.ops for v in op.outputs}
    forward: set[int] = set()
    stack = [top_producer[v] for v in want if v in top_producer]
    while stack:
        i = stack.pop()
        if i in forward:
            continue
        forward.add(i)
        for x in position[i].inputs:
            if isinstance(x, int) and x in top_producer:
                stack.append(top_producer[x])
    return forward


def _balance(cuts: list[int], flops: list[float], max_units: int) -> list[int]:
    """Merge consecutive segments until each holds at least 1/max_units of the forward flops.

    A chain without skip connections cuts after every op; recomputing one op from the value
    before it saves nothing, since that value is kept. Merged segments recompute their inner
    cut values too."""
    total = sum(flops)
    target = total / max(max_units, 1)
    out, acc = [cuts[0]], 0.0
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        acc += sum(flops[a:b])
        if acc >= target or b == cuts[-1]:
            out.append(b)
            acc = 0.0
    return out


DEFAULT_MAX_UNITS = 8
"""How many forward segments :func:`find_remat_units` offers at most."""


def find_remat_units(program: CapturedProgram, ties=None, max_units: int = DEFAULT_MAX_UNITS
                     ) -> tuple[RematUnit, ...]:
    """Pass 1: the forward segments of a train step that can be recomputed, in forward order.

    Args:
      program: the captured step (forward, backward and update in one program).
      ties: flat output index -> flat input index (the carried state); the other outputs are
        metrics, and the forward pass is what they depend on.
      max_units: at most this many units; consecutive segments merge, balancing their flops.

    Returns:
      One unit per segment between single-activation cuts that has residuals. Empty when the
      program has no recognisable forward/backward split (no metrics, scans, ...).
    """
    ops = program.graph.ops
    forward = _forward_ops(program, ties)
    if not forward:
        return ()
    pos = {op.index: t for t, op in enumerate(ops)}
    turnaround = max(pos[i] for i in forward)
    # The forward region also holds the residual computations AD interleaves (``1 - tanh(x)**2``).
    fwd = _Forward(program, tuple(ops[:turnaround + 1]), pos)
    cuts, cut_value = fwd.cuts()
    cuts = _balance(cuts, [op_flops(op, program.avals) for op in fwd.ops], max_units)
    units = []
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        unit = fwd.unit(fwd.ops[a:b], cut_value.get(b))
        if unit is not None:
            units.append(unit)
    return tuple(units)


class _Forward:
    """The forward region of a step (ops up to the turnaround) and what the backward reads of it."""

    def __init__(self, program: CapturedProgram, fwd_ops: tuple, pos: dict):
        self.program, self.ops, self.pos = program, fwd_ops, pos
        self.index = {op.index for op in fwd_ops}
        ops = program.graph.ops
        self.produced_by = {v: op.index for op in ops for v in op.outputs}
        self.outputs = {x for x in program.graph.outvars if isinstance(x, int)}
        # Values that depend on no argument (iota, broadcast literals) are free to keep: they never cut.
        self.dynamic: set[int] = set(program.graph.invars)
        for op in ops:
            if op.body is not None or any(isinstance(x, int) and x in self.dynamic for x in op.inputs):
                self.dynamic.update(op.outputs)
        # Backward reads (after the turnaround) of forward values.
        self.late_reads: dict[int, list[int]] = {}
        for t in range(len(fwd_ops), len(ops)):
            for x in ops[t].inputs:
                if isinstance(x, int) and x in self.produced_by and self.produced_by[x] in self.index:
                    self.late_reads.setdefault(x, []).append(t)

    def cuts(self) -> tuple[list[int], dict]:
        """Positions where one activation crosses: a cut before forward op k is crossed by the
        forward-made, argument-dependent values made before k and read by a forward op at or after k."""
        avals, dynamic, produced_by = self.program.avals, self.dynamic, self.produced_by
        last_fwd_read: dict[int, int] = {}
        for k, op in enumerate(self.ops):
            for x in op.inputs:
                if isinstance(x, int) and x in produced_by and x in dynamic:
                    last_fwd_read[x] = k
        crossing: set[int] = set()
        cuts = [0]
        cut_value = {0: None}
        for k, op in enumerate(self.ops):
            crossing = {v for v in crossing if last_fwd_read.get(v, -1) >= k}
            if k and len(crossing) == 1:
                (v,) = crossing
                if math.prod(getattr(avals[v], "shape", ())) > 1 and cuts[-1] < k:
                    cuts.append(k)
                    cut_value[k] = v
            for v in op.outputs:
                if v in dynamic and last_fwd_read.get(v, -1) > k:
                    crossing.add(v)
        cuts.append(len(self.ops))
        return cuts, cut_value

    def unit(self, seg, keep_out) -> RematUnit | None:
        """The unit of one segment: the ops its residuals depend on, or None (no residuals, or a loop
        or an effect among them). ``keep_out``: the value crossing into the next segment (kept)."""
        program, produced_by, avals = self.program, self.produced_by, self.program.avals
        seg_ids = {op.index for op in seg}
        residuals = [v for op in seg for v in op.outputs
                     if v in self.late_reads and v != keep_out and v not in self.outputs and v in self.dynamic]
        if not residuals:
            return None
        need: set[int] = set()
        stack = [produced_by[v] for v in residuals]
        while stack:
            i = stack.pop()
            if i in need or i not in seg_ids:
                continue
            need.add(i)
            stack.extend(produced_by[x] for x in program.ops[i].inputs if isinstance(x, int) and x in produced_by)
        rec = [op for op in seg if op.index in need]
        if any(op.body is not None or not op_info(op.name).duplicable for op in rec):
            return None  # loops and effects are not duplicated
        made = {v for op in rec for v in op.outputs}
        inputs = []
        for op in rec:
            for x in op.inputs:
                if isinstance(x, int) and x not in made and x not in inputs:
                    inputs.append(x)
        insert_at = min(t for v in residuals for t in self.late_reads[v])
        anchor = _anchor(program.graph.ops[insert_at], produced_by, self.index, self.pos, insert_at)
        flops = sum(op_flops(op, avals) for op in rec)
        matmul = sum(op_flops(op, avals) for op in rec if op_info(op.name).contraction)
        source = f"{rec[0].source()}..{rec[-1].source()}"
        freed = sum(value_bytes(avals[v], None, None) for v in residuals)  # typed keys too (flax's dropout)
        return RematUnit(tuple(op.index for op in rec), tuple(residuals), tuple(inputs), insert_at, anchor,
                         flops, matmul, source, freed)


def _anchor(consumer: Op, produced_by, forward, pos, insert_at) -> int | None:
    """The backward value the first recomputed read meets (latest-made non-forward operand)."""
    best, best_t = None, -1
    for x in consumer.inputs:
        if isinstance(x, int) and x in produced_by and produced_by[x] not in forward:
            t = pos[produced_by[x]]
            if best_t < t < insert_at:
                best, best_t = x, t
    return best


def _barrier_primitive():
    import jax
    import jax.numpy as jnp

    return jax.make_jaxpr(jax.lax.optimization_barrier)(jnp.zeros((), jnp.float32)).jaxpr.eqns[0].primitive


def rematerialize(program: CapturedProgram, units) -> tuple[CapturedProgram, tuple[RematGroup, ...]]:
    """Pass 2: duplicate each unit's ops before its first backward read; point later reads at them.

    Before the duplicates, each outside input gets a fence (an ``optimization_barrier`` op).
    Deterministic: the same program and units give the same value ids and op indices, so a plan
    made on the rewritten program applies to a rewrite made again at lowering.

    Returns:
      The rewritten program (its ``ops`` extended by fences and duplicates, new value ids
      appended to ``avals``) and one :class:`RematGroup` per unit for lowering.
    """
    if not units:
        return program, ()
    barrier = _barrier_primitive()
    avals = list(program.avals)
    all_ops = list(program.ops)
    inserts: dict[int, list[Op]] = {}
    groups = []
    redirect_from: dict[int, dict[int, int]] = {}  # insert position -> {old value: new value}
    refetch_from: dict[int, dict[int, int]] = {}  # insert position -> {argument: its fenced copy}
    invars = set(program.graph.invars)

    def new_value(v):
        avals.append(avals[v])
        return len(avals) - 1

    for u in sorted(units, key=lambda u: u.insert_at):
        first = program.ops[u.ops[0]]
        rename: dict[int, int] = {}
        fences = []
        for x in u.inputs:
            rename[x] = new_value(x)
            fence = Op(index=len(all_ops), primitive=barrier, params={}, inputs=(x,), outputs=(rename[x],),
                       ctx=first.ctx, source_info=first.source_info)
            all_ops.append(fence)
            fences.append(fence)
        dups = []
        for i in u.ops:
            op = program.ops[i]
            outs = []
            for v in op.outputs:
                rename[v] = new_value(v)
                outs.append(rename[v])
            new = dataclasses.replace(op, index=len(all_ops), outputs=tuple(outs),
                                      inputs=tuple(rename.get(x, x) if isinstance(x, int) else x
                                                   for x in op.inputs))
            all_ops.append(new)
            dups.append(new)
        inserts.setdefault(u.insert_at, []).extend(fences + dups)
        redirect_from[u.insert_at] = {**redirect_from.get(u.insert_at, {}),
                                      **{v: rename[v] for v in u.residuals}}
        refetch_from[u.insert_at] = {**refetch_from.get(u.insert_at, {}),
                                     **{x: rename[x] for x in u.inputs if x in invars}}
        groups.append(RematGroup(tuple(f.index for f in fences), tuple(d.index for d in dups), u.anchor))
    backward_end = _last_residual_read(program, units)
    # Later backward reads of a residual use its recomputed copy. Until the last read of a residual (the end of
    # the backward), reads of a step argument (a weight) use its latest fenced copy too: sharded state is then
    # gathered again for the backward, as jax.checkpoint re-gathers it, instead of one gathered copy kept from the
    # forward to the backward (XLA merges identical gathers of one value).
    # (a residual is made by a unit, never a step argument: the two kinds of redirect share one map)
    view: dict[int, int] = {}
    new_top = []
    for t, op in enumerate(program.graph.ops):
        if t in inserts:
            new_top.extend(inserts[t])
            view.update(redirect_from[t])
            view.update(refetch_from[t])
        if t == backward_end + 1:  # no recompute is inserted after the backward's end
            for x in invars:
                view.pop(x, None)
        if view and any(isinstance(x, int) and x in view for x in op.inputs):
            op = dataclasses.replace(op, inputs=tuple(view.get(x, x) if isinstance(x, int) else x
                                                      for x in op.inputs))
            all_ops[op.index] = op
        new_top.append(op)
    graph = OpGraph(program.graph.invars, tuple(new_top), program.graph.outvars)  # residuals are never outputs
    out = CapturedProgram.from_graph(graph, avals, in_tree=program.in_tree, out_tree=program.out_tree,
                                     in_paths=program.in_paths, out_paths=program.out_paths, consts=program.consts,
                                     in_roles=program.in_roles)
    return out, tuple(groups)


def _last_residual_read(program: CapturedProgram, units) -> int:
    """The position of the last top-level op that reads a residual of ``units`` (where the backward ends)."""
    residuals = {v for u in units for v in u.residuals}
    return max((t for t, op in enumerate(program.graph.ops)
                if any(isinstance(x, int) and x in residuals for x in op.inputs)), default=-1)


def recompute_flops(units) -> float:
    return float(np.sum([u.flops for u in units])) if units else 0.0


def apply_remat(program: CapturedProgram, choice: RematChoice | None, ties=None):
    """The rewritten program and recompute groups a plan's ``remat`` asks for (lowering)."""
    if choice is None or not choice.units:
        return program, ()
    units = find_remat_units(program, ties, choice.max_units)
    if len(units) != choice.num_units:
        from autoshard.errors import PlanError

        raise PlanError(f"the plan rematerialises {choice.units} of {choice.num_units} forward segments, but this "
                        f"program has {len(units)}: it is not the program the plan was made for. Fix: re-plan.")
    return rematerialize(program, units[:choice.units])


def choose_remat(plan_fn, program: CapturedProgram, ties=None, *, budget: float, flops_per_second: float,
                 max_units: int = DEFAULT_MAX_UNITS, check=None, check_rounds: int = 2, base=None,
                 checked_by: str = "XLA's memory_analysis", incumbent: float | None = None):
    """Pass 3: the remat set and sharding plan of least predicted step time within the budget.

    ``plan_fn(program, budget) -> Attempt`` (:class:`autoshard.driver.Attempt`) plans a program
    under a memory budget: its plan, or the :class:`~autoshard.errors.InfeasibleError` when nothing
    fits, whether the budget bound and the unconstrained optimum. Remat is only considered when
    the plan without it is bound by the budget. ``base``: that Attempt for the program itself
    under ``budget``, when the caller has it already.

    Candidates are the prefixes of the forward segments: recompute the first ``k``. Each
    candidate program is planned whole, so the sharding of every op, recomputed ones
    included, is chosen with the memory the recompute frees; the best ``k`` is the joint
    optimum over (remat set, sharding) restricted to prefixes. Why prefixes: recomputing
    segment ``i`` frees its residuals from the end of the forward until segment ``i``'s
    backward. At the turnaround (the usual peak) every choice of ``k`` segments frees the
    same bytes when segments are alike (repeated layers), and the recompute costs the same;
    but during the backward, a segment's recompute lands on top of the residuals of the
    segments before it that were kept. Choosing the earliest ``k`` leaves none kept below
    any recompute, so its peak is the smallest among all ``k``-subsets: for ``L`` identical
    layers, the prefixes contain an optimum of every size ``k``, and the search over ``k``
    is exact. ``tests/test_remat.py`` checks this against brute force over every subset.

    The search tries ``k = 1, 2, ...`` in turn (the peak is not monotone in ``k``: recomputing
    the last segments lands right at the turnaround, on top of everything kept), and stops
    once a floor (the unconstrained optimum without remat, plus the first ``k`` segments'
    matmuls on all devices at full speed) reaches the best plan found, or once the best count's plan is its
    unconstrained optimum (not budget-bound: recomputing more only adds work). The floor is exact
    for the recompute's compute time; it treats the reshards the redirected backward reads
    pay as free, so it prunes, it does not prove. Once consecutive candidates are planned, the
    cost per recomputed flop they show tightens it (``RematSearch.observed_floor``).

    When no count fits, the search runs again over finer segments (``FINE_MAX_UNITS``, when that at least
    doubles them), bisecting for the fewest that fit (:meth:`RematSearch._bisect`): an 80-layer model cut in 8
    recomputes 10 layers at once, which alone can be over the device. Where finer segments exist and the first
    coarse one does not fit, the finer search runs first and the other coarse counts only when it finds nothing:
    Llama-3.1-70B on 256 planned all 8 coarse counts, about 20 s each, for nothing.

    ``check(plan, program, groups) -> bytes``, when given, compiles the chosen candidate and
    returns XLA's peak per device. When that exceeds ``budget`` (XLA's schedule keeps more
    alive than the predicted order), the search runs again against a budget shrunk by the
    ratio, at most ``check_rounds`` times. ``checked_by`` says what ``check`` measures, for the error (the
    predicted peak where there is nothing to compile: an AbstractMesh).

    ``incumbent``: the objective of a plan found elsewhere (another candidate mesh). Counts whose floor reaches
    it are not planned; when no smaller count fits, the search ends with an
    :class:`~autoshard.errors.InfeasibleError` that names no memory (``smallest_memory`` None: no other lever
    should try). Llama-3.1-70B on 256 devices: a second mesh's search of 10 whole-step solves ends after one.

    Returns:
      ``(plan, choice)``; ``choice`` is None when remat was not considered.
    """
    from autoshard.errors import InfeasibleError

    search = RematSearch(plan_fn, program, budget, base, incumbent)
    first = search.attempt(0, budget, program)
    if first is not None and not search.attempts[(0, budget)].budget_bound:
        return first, None
    search.units = find_remat_units(program, ties, max_units)
    if not search.units:
        if first is None:
            raise search.errors[(0, budget)]
        return first, None
    rounds = check_rounds if check is not None else 0
    queue, fine = _search_order(search, program, ties, max_units, flops_per_second)
    errors = {}
    while queue:
        s, most = queue.pop(0)
        try:
            chosen, compiled = s.run(flops_per_second, check, rounds, checked_by)
        except InfeasibleError as e:
            errors[s] = e
            if fine is None and s is search:  # the first coarse segment fitted, but no count passed the check
                fine = _finer_search(search, program, ties, max_units)
                queue += [] if fine is None else [(fine, FINE_MAX_UNITS)]
            continue
        return s.result(chosen, compiled, first, most)
    # the finer search's error where it ran (it came closest: smaller segments recomputed)
    raise errors.get(fine) or errors[search]


def _search_order(search: RematSearch, program: CapturedProgram, ties, max_units: int, flops_per_second: float):
    """``([(search, most units)], finer search or None)``: the searches :func:`choose_remat` runs, in order. When
    the first coarse segment does not fit (or cannot beat the incumbent) and finer ones exist, the finer search
    goes first; the coarse counts run only when it finds nothing."""
    budget, queue = search.budget, [(search, max_units)]
    coarse = search.useful(1, budget, flops_per_second)
    fine = (_finer_search(search, program, ties, max_units)
            if not coarse or search.attempt(1, budget) is None else None)
    if fine is not None:
        queue.insert(0, (fine, FINE_MAX_UNITS))
    return queue, fine


def _finer_search(search: RematSearch, program: CapturedProgram, ties, max_units: int) -> RematSearch | None:
    """A search over finer segments (``FINE_MAX_UNITS``) sharing ``search``'s plan without remat, or None when that
    does not give ``FINER_AT_LEAST`` times as many segments."""
    finer = find_remat_units(program, ties, FINE_MAX_UNITS) if max_units < FINE_MAX_UNITS else ()
    if len(finer) < FINER_AT_LEAST * len(search.units):
        return None
    fine = RematSearch(search.plan_fn, program, search.budget, search.attempts[(0, search.budget)], search.incumbent)
    fine.units = finer
    return fine


def _nearest(sorted_values, x: float) -> int:
    """The index of the value of ``sorted_values`` (ascending) nearest ``x`` (the lower one on a tie)."""
    k = int(np.searchsorted(sorted_values, x))
    if k == len(sorted_values) or (k > 0 and x - sorted_values[k - 1] <= sorted_values[k] - x):
        return k - 1
    return k


FINE_MAX_UNITS = 64
"""When no count of the default segments (``DEFAULT_MAX_UNITS``) fits, :func:`choose_remat` searches again over at
most this many (one per layer for most models up to 64 layers)."""

FINER_AT_LEAST = 2
"""... when that gives at least this many times as many segments (else the finer search changes too little)."""

BISECT_ABOVE = DEFAULT_MAX_UNITS
"""Over more segments than this, the fewest that fit are found by bisection (:meth:`RematSearch._bisect`)."""

SLOW_STEPS = 3
"""Interpolated steps in a row that may each leave more than half of the bracket before
:meth:`RematSearch._bisect` halves it (at most this many plus one steps per halving)."""

OBSERVED_FLOOR_SHARE = 0.9
"""The share of the recompute cost per flop seen between planned candidates that :meth:`RematSearch.observed_floor`
counts on for the next one (a margin for unequal segments and solves stopped by their time limit)."""


class RematSearch:
    """The state of :func:`choose_remat`: every (units, limit) planned, its plan and its error."""

    def __init__(self, plan_fn, program: CapturedProgram, budget: float, base=None, incumbent: float | None = None):
        self.plan_fn, self.program, self.budget, self.incumbent = plan_fn, program, budget, incumbent
        self.attempts: dict[tuple, object] = {} if base is None else {(0, budget): base}
        self.plans: dict[tuple, object] = {}
        self.errors: dict[tuple, object] = {}
        self.units: tuple[RematUnit, ...] = ()

    def floor(self, k: int, limit: float, flops_per_second: float) -> float:
        """No plan of the first ``k`` units recomputed costs less: the plan without remat and without a budget,
        plus their matmuls on all devices at full speed (see :func:`choose_remat`)."""
        return (self.attempts[(0, limit)].unconstrained_objective
                + sum(u.matmul_flops for u in self.units[:k]) / flops_per_second)

    def useful(self, k: int, limit: float, flops_per_second: float) -> bool:
        """Whether candidate ``k`` may beat the incumbent (always, without one)."""
        return self.incumbent is None or self.floor(k, limit, flops_per_second) < self.incumbent

    def beaten(self, limit: float):
        """The error of a search that the incumbent ended: no count that may beat it fits."""
        from autoshard.errors import InfeasibleError

        return InfeasibleError(
            f"rematerialisation cannot beat the plan found on another mesh (objective {self.incumbent:.4g}): "
            f"every count that might fits no plan under {limit:.4g} bytes per device, or costs more by its "
            "floor.")

    def attempt(self, k: int, limit: float, prog=None):
        """The plan of the first ``k`` units recomputed, under ``limit`` (None when nothing fits)."""
        key = (k, limit)
        if key not in self.attempts:
            self.attempts[key] = self.plan_fn(prog if prog is not None else self.candidate(k), limit)
        got = self.attempts[key]
        self.plans[key] = got.plan
        if got.error is not None:
            self.errors[key] = got.error
        return got.plan

    def search(self, limit: float, flops_per_second: float) -> int | None:
        """The best ``k`` under ``limit``, or None when no candidate fits: the fastest plan (``total_seconds``)
        of every count planned that fits, the bisection's included."""
        plans = self.plans
        first = self.attempt(0, limit, self.program)
        # The floor: no candidate beats the plan without remat and without a budget, plus its
        # recomputed matmuls at full speed on every device.
        best_k = 0 if first is not None else None
        start = 1
        if best_k is None and len(self.units) > BISECT_ABOVE:
            useful = [k for k in range(1, len(self.units) + 1) if self.useful(k, limit, flops_per_second)]
            best_k = self._bisect(limit, useful[-1]) if useful else None
            if best_k is None:
                return None
            start = best_k + 1
        for k in range(start, len(self.units) + 1):
            if best_k is not None and not self.attempts[(best_k, limit)].budget_bound:
                break  # the best count's plan is its unconstrained optimum: more recompute only adds cost
            bound = max(self.floor(k, limit, flops_per_second), self.observed_floor(k, limit))
            if self.incumbent is not None and bound >= self.incumbent:
                break
            if best_k is not None and bound >= plans[(best_k, limit)].cost.objective:
                break
            p = self.attempt(k, limit)
            # candidates are ranked by their decoded plans' simulated steps (PlanCost.total_seconds)
            if p is not None and (best_k is None or p.cost.total_seconds < plans[(best_k, limit)].cost.total_seconds):
                best_k = k
        # the bisection's larger fitting counts too: a time-limited solve may have found a faster plan there
        fitting = [j for (j, lim), p in plans.items() if lim == limit and p is not None]
        return min(fitting, key=lambda j: (plans[(j, limit)].cost.total_seconds, j), default=best_k)

    def candidate(self, k: int) -> CapturedProgram:
        """The program with the first ``k`` units recomputed (what ``plan_fn`` plans for ``k``)."""
        return rematerialize(self.program, self.units[:k])[0]

    def _bisect(self, limit: float, most: int) -> int | None:
        """The fewest segments whose recompute fits ``limit``, by bisection over ``1..most`` (None when ``most``
        does not fit: the count that may still beat the incumbent, else all of them).

        Over many segments (``BISECT_ABOVE``), planning every count in turn costs a plan of the whole program
        each (20-25 s for Llama-3.1-70B on 256): bisection plans ``log2`` of them, taking fitting to grow
        with the count. Where it does not (recomputing the last segments lands at the turnaround) the count
        found fits but a smaller one might too; the search upward from it goes on as for few segments.

        Each step plans the count where the peaks of the two ends, joined by a line over the residual bytes
        the counts free (``RematUnit.residual_bytes``; over the count where no unit has them), cross ``limit``,
        the middle one when a peak is unknown or the ``SLOW_STEPS`` steps before did not halve the bracket.
        Peaks fall with the bytes freed, not the count: Llama-3.1-70B's segments alternate between freeing
        29 and 17 TB and its last two (the final norm, the logits) free a few, so a line over the count misplaces
        steps. On (2, 16, 8) the bisection plans 55, 49, 50 (over the count: 55, 51, 50, 49). It halves where the
        fitting end's estimate is over ``limit`` (a plan the row admits, where XLA's compile is the check; where the
        estimate is the check, such a plan is refused: :func:`autoshard.driver.remat_candidate`)."""
        lo, hi = 0, most
        if self.attempt(hi, limit) is None:
            return None
        weights = [getattr(u, "residual_bytes", 0.0) for u in self.units]
        freed = np.concatenate([[0.0], np.cumsum(weights if min(weights, default=0.0) > 0 else
                                                 np.ones(len(weights)))])  # freed[k]: what the first k units free
        slow = 0  # steps in a row that did not halve the bracket: at SLOW_STEPS, the next one halves it
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ends = self._peak(lo, limit), self._peak(hi, limit)
            if slow < SLOW_STEPS and None not in ends and ends[0] > limit >= ends[1]:
                target = freed[lo] + (ends[0] - limit) / (ends[0] - ends[1]) * (freed[hi] - freed[lo])
                mid = min(max(_nearest(freed, target), lo + 1), hi - 1)
            width = hi - lo
            if self.attempt(mid, limit) is None:
                lo = mid
            else:
                hi = mid
            slow = 0 if 2 * (hi - lo) <= width + 1 else slow + 1
        return hi

    def _peak(self, k: int, limit: float) -> float | None:
        """Candidate ``k``'s peak under ``limit``: its plan's, or the smallest its error names (None: unknown)."""
        got = self.attempts.get((k, limit))
        plan = getattr(got, "plan", None)
        if plan is not None:
            return getattr(getattr(plan, "cost", None), "peak_memory_bytes", None)
        return getattr(getattr(got, "error", None), "smallest_memory", None)

    def observed_floor(self, k: int, limit: float) -> float:
        """A tighter floor for candidate ``k`` once ``k - 1`` and two consecutive candidates before it are
        planned under ``limit``: the unconstrained objective of ``k - 1`` plus unit ``k``'s matmul flops at the
        least cost per recomputed flop seen so far between consecutive candidates, times ``OBSERVED_FLOOR_SHARE``.

        The full-speed floor prices recompute at the cluster's peak rate on every device; the step pays
        more (a recomputed segment is its ops at the plan's sharding, at the rate its shapes get), so at
        scale that floor never pruned (Llama-3-8B on 8: every candidate after the first that fit was planned,
        three solves more for nothing). The rate seen between candidates is what recompute cost there."""
        free = {j: a.unconstrained_objective for (j, lim), a in self.attempts.items()
                if lim == limit and math.isfinite(a.unconstrained_objective)}  # NaN: refused without a probe
        rates = [(free[j] - free[j - 1]) / self.units[j - 1].matmul_flops
                 for j in range(1, k) if j in free and j - 1 in free and self.units[j - 1].matmul_flops > 0]
        if k - 1 not in free or not rates or min(rates) <= 0:
            return -math.inf
        return free[k - 1] + OBSERVED_FLOOR_SHARE * min(rates) * self.units[k - 1].matmul_flops

    def run(self, flops_per_second: float, check, rounds: int, checked_by: str = "XLA's memory_analysis"):
        """Search, and while the compiled peak (``check``) is over the budget, search again under a
        budget shrunk by the ratio and 3% more, at most ``rounds`` times (:func:`autoshard.compile.fit_compiled`).
        Returns ``(chosen key, compiled peak or None)``."""
        from autoshard.compile import fit_compiled
        from autoshard.errors import InfeasibleError

        budget, n = self.budget, len(self.units)
        last: dict = {}

        def search(limit):
            k = self.search(limit, flops_per_second)
            if k is None and self.incumbent is not None:
                raise self.beaten(limit)
            if k is None:
                errors = self.errors
                smallest = min(e.smallest_memory for e in errors.values() if e.smallest_memory is not None)
                # this round's limit: the first round's (the budget) may have had plans that compiled over it
                raise InfeasibleError(f"{errors[(0, limit)]} Rematerialising the first 1..{n} forward segments "
                                      f"does not fit either; the smallest peak the solver found is {smallest:.4g} "
                                      f"bytes.", smallest_memory=smallest) from None
            last["chosen"], last["compiled"] = (k, limit), None
            return self.plans[(k, limit)]

        def compiled_peak(plan):
            if check is None:
                return None
            k = last["chosen"][0]
            last["compiled"] = check(plan, *rematerialize(self.program, self.units[:k]))
            return last["compiled"]

        def refuse(lowest):
            # Every round's choice compiled over the budget: report it, never hand back a plan that
            # does not fit (the caller may still try host offload or gradient accumulation).
            return InfeasibleError(
                f"no plan fits {budget:.4g} bytes per device: the best rematerialised plan ({last['chosen'][0]} of "
                f"{n} forward segments) peaks at {lowest:.4g} bytes by {checked_by}. Fix: raise "
                f"memory_budget to at least {lowest:.4g}, or use more devices.", smallest_memory=lowest, checked=True)

        # XLA kept more alive than predicted (its schedule is not ours): each round plans against less.
        fit_compiled(search, compiled_peak, budget, limit=budget, refuse=refuse, rounds=rounds, margin=0.97)
        return last["chosen"], last["compiled"]

    def result(self, chosen, compiled, base, max_units: int):
        """``(plan, RematChoice)`` of the chosen candidate."""
        best_k, units = chosen[0], self.units
        peak_without = base.cost.peak_memory_bytes if base is not None else self.errors[(0, self.budget)].smallest_memory
        choice = RematChoice(best_k, len(units), max_units, recompute_flops(units[:best_k]), peak_without,
                             tuple((k, lim, None if p is None else p.cost.objective,
                                    None if p is None else p.cost.peak_memory_bytes)
                                   for (k, lim), p in sorted(self.plans.items())),
                             tuple(u.source for u in units[:best_k]), chosen[1], compiled)
        return self.plans[chosen], choice
