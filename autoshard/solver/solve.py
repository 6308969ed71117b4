"""``solve``: the one entry point shared by the planner and the command-line solver.

Pipeline: exact reductions (:mod:`reduce`) -> memory rows on compressed time points
(:mod:`memory`) -> a fast greedy first solution (:mod:`local`) -> the grouped MILP
(:mod:`milp`) with the remaining time -> expand the core choice back through the
reductions and recompute cost and peak memory on the original problem.

Cores too large for one MILP: without memory rows, multi-start forest descents
(:mod:`forest`); with them, the memory-priced searches of :mod:`penalty`
(lagrangian descent, then guarded descents, then a second start from the
uniform penalty search), and MILP windows (:mod:`lns`) with the time left.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from autoshard.errors import InfeasibleError
from autoshard.solver.bp import MinSumBP
from autoshard.solver.forest import forest_ils
from autoshard.solver.lns import WindowSearch
from autoshard.solver.local import CoreState, greedy, min_memory_choice
from autoshard.solver.memory import MemoryRows, memory_rows
from autoshard.solver.milp import solve_milp
from autoshard.solver.penalty import (
    FORBIDDEN,
    guarded_descent,
    lagrangian_bp,
    lagrangian_descent,
    penalised_choice,
    penalty_search,
    plain_scale,
    soften,
    violations,
)
from autoshard.solver.problem import ShardingProblem, ShardingSolution
from autoshard.solver.reduce import Reduction, reduce_problem

# Cores up to this many nodes, and this many cost cells (strategies plus edge
# matrix entries), first get one MILP over the whole core. Beyond that HiGHS's
# root LP alone can outlast the budget (a GPT-350M training step has 1.7M cells).
_FULL_MILP_NODES = 3000
_FULL_MILP_CELLS = 400_000
# Seconds kept back for expanding the choice and recomputing its cost.
_MARGIN = 0.2
_WINDOW_NODES = 250
_WINDOW_SECONDS = 2.0
# Large memory-constrained cores: smaller, quicker windows (more of them per second).
_WINDOW_NODES_LARGE = 100
_WINDOW_SECONDS_LARGE = 1.0
# Large memory-constrained cores start from the choice under the uniform memory
# multiplier plain_scale * 2**this (contest M: cost 5.5e10, far over the limit).
_LAGRANGE_START = 4.0
# Memory-free large cores: belief propagation gets this share of the time (at
# most this many rounds) to find the start of the forest descents.
_BP_SHARE = 0.25
# ... and the memory-priced belief propagation starts from a smaller multiplier than the
# forest rounds: slower to its first fit, cheaper fits (contest A 7.25e9 vs 7.56e9 at 2^4).
_BP_START = 0.0
_BP_ROUNDS = 60
# Stopping when done. A MILP whose relative gap (incumbent - bound) / incumbent is at
# most _GAP counts as solved: planner costs are seconds from an analytic model good to
# a few percent, and contest costs are integers near 1e9-1e11, so a millionth is far
# below anything either can tell apart (the brute-force tests' costs differ by >= 1).
_GAP = 1e-6
# Belief propagation stops once its messages settle to this relative change a round
# with the decode unchanged (about 20 rounds on the planner's GPT cores, whose best
# decode came within 7; on random dense cores they never settle, and its best decode
# still improved after 30-40 rounds without gain, so "no gain for k rounds" would not do).
_BP_TOL = 1e-4
# Forest restarts stop once the last max(this, r) of them found nothing, r being the
# restart that found the best (see forest_ils).
_FOREST_STALL = 5


def solve(
    problem: ShardingProblem,
    *,
    time_limit: float = 10.0,
    seed: int = 0,
    verbose: bool = False,
) -> ShardingSolution:
    """Pick one strategy per node at least total cost under the memory limit.

    Args:
      problem: the problem.
      time_limit: wall-clock budget in seconds; 0 asks for an immediate
        best-effort answer (reductions plus a greedy pass).
      seed: seeds the randomised parts; the result is deterministic for a given
        seed whenever the budget is not the binding stop.
      verbose: print progress lines.

    Returns:
      The best solution found. ``feasible`` is False only when no feasible choice
      was found in time (none is proven impossible). The search returns before
      ``time_limit`` when it is done; ``stats["stop"]`` says why it stopped:
      ``"optimal"`` (proven, also when the reductions left no core), ``"gap"``
      (the MILP's relative gap closed to within 1e-6; also ``optimal``),
      ``"stalled"`` (the searches stopped improving: forest restarts or a full
      pass of MILP windows found nothing cheaper) or ``"time_limit"``.
      ``stats["bound"]`` (a lower bound on the cost) and ``stats["gap"]``
      (``(cost - bound) / cost``) are there when a MILP gave a bound.

    Raises:
      InfeasibleError: a node has no finite-cost strategy, the infinite edge
        costs forbid every assignment, or the memory limit is below the smallest
        achievable peak usage (given as ``smallest_memory``).

    Example:
      >>> import numpy as np
      >>> p = ShardingProblem(node_costs=(np.array([1.0, 2.0]), np.array([3.0, 0.0])),
      ...                     edges=np.array([[0, 1]]),
      ...                     edge_costs=(np.array([[0.0, 5.0], [0.0, 0.0]]),))
      >>> sol = solve(p)
      >>> sol.choice.tolist(), sol.cost
      ([1, 1], 2.0)
    """
    start = time.perf_counter()
    # keep back time to expand the choice and recompute its cost (~1 s per 100k nodes+edges)
    deadline = start + max(float(time_limit) - 1e-5 * (problem.num_nodes + problem.num_edges), 0.0)
    log = _logger(verbose, start)
    n = problem.num_nodes
    if n == 0:
        return ShardingSolution(np.zeros(0, dtype=np.int64), 0.0, 0.0, True, True, 0.0,
                                {"stop": "optimal", "bound": 0.0, "gap": 0.0})
    with_memory = (
        problem.memory_limit is not None and problem.node_memory is not None and problem.intervals is not None
    )
    red = reduce_problem(problem, with_memory=with_memory, deadline=deadline)
    rows = None
    if with_memory and red.num_core:
        nonneg = all((m >= 0).all() for m in problem.node_memory)
        rows = memory_rows(problem.intervals, problem.memory_limit, red.core_nodes, red.base_usage, nonneg)
    stats = dict(red.stats, core_nodes=red.num_core, core_edges=len(red.edges))
    if rows is not None:
        stats.update(memory_points=rows.num_points)
    log(f"reduced {n} nodes / {problem.num_edges} edges to a core of {red.num_core} / {len(red.edges)}")

    core = _solve_core(problem, red, rows, deadline, seed, log, stats)
    optimal = core.optimal
    choice = red.expand(core.choice, n)
    cost = problem.cost(choice)
    if np.isfinite(core.bound) and np.isfinite(cost):
        # the reductions are exact: the full cost is the core's plus a constant
        bound = min(core.bound + cost - core.cost, cost) if optimal else core.bound + cost - core.cost
        stats.update(bound=bound, gap=_relative_gap(cost, bound))
    elif optimal:
        stats.update(bound=cost, gap=0.0)
    peak = problem.peak_memory(choice)
    feasible = problem.is_feasible(choice)
    if with_memory and not feasible and red.num_core == 0 and np.isfinite(cost):
        # Every usage left is strategy-independent, so this peak is the least one.
        raise _memory_error(problem, peak, exact=True)
    log(f"cost {cost:.6g}, peak memory {peak:.6g}, feasible {feasible}, optimal {optimal and feasible}")
    return ShardingSolution(
        choice=choice,
        cost=cost,
        peak_memory=peak,
        feasible=feasible,
        optimal=bool(optimal and feasible),
        seconds=time.perf_counter() - start,
        stats=stats,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _CoreAnswer:
    """The core search's answer: its choice, that choice's core cost, and a lower bound (or nan)."""

    choice: np.ndarray
    cost: float
    optimal: bool
    bound: float = np.nan


def _relative_gap(cost: float, bound: float) -> float:
    """``(cost - bound) / |cost|``, at least 0; inf without a finite cost and bound."""
    if not (np.isfinite(cost) and np.isfinite(bound)):
        return np.inf
    return max(cost - bound, 0.0) / max(abs(cost), 1e-300)


def _solve_core(
    problem: ShardingProblem,
    red: Reduction,
    rows: MemoryRows | None,
    deadline: float,
    seed: int,
    log,
    stats: dict,
) -> _CoreAnswer:
    """Search the reduced core; records in ``stats["stop"]`` why the search stopped."""
    if red.num_core == 0:
        stats.update(stop="optimal")
        return _CoreAnswer(np.zeros(0, dtype=np.int64), 0.0, True, 0.0)
    now = start_time = time.perf_counter()
    bound = np.nan  # a lower bound on the core's cost, once a MILP gives one
    cells = sum(c.size for c in red.node_costs) + sum(m.size for m in red.edge_costs)
    big = red.num_core > _FULL_MILP_NODES or cells > _FULL_MILP_CELLS
    stats.update(core_cells=cells)
    if rows is None and big:
        # No memory limit: many short forest descents (exact DP over random
        # induced forests) from random starts beat MILP windows by far here.
        # Belief propagation gives the first descent a far better start than the
        # per-node argmins (contest A without its limit: 5.5e9 vs 7.8e10 after 40 s).
        red = soften(red)
        bp = MinSumBP(red)
        bp_choice, bp_cost = bp.run(now + _BP_SHARE * max(deadline - now, 0.0), max_rounds=_BP_ROUNDS,
                                    tol=_BP_TOL)
        log(f"belief propagation: {bp.rounds} rounds, cost {bp_cost:.6g}")
        found = forest_ils(CoreState(red, None, bp_choice), deadline - _MARGIN, seed, stall=_FOREST_STALL, log=log)
        stats.update(bp_rounds=bp.rounds, forest_restarts=found.restarts,
                     stop="stalled" if found.stalled else "time_limit")
        return _CoreAnswer(found.state.choice, found.state.total_cost(), False)
    large = rows is not None and big
    if large:
        # Start memory-feasible and let the window search price out forbidden pairs.
        red = soften(red)
        state = CoreState(red, rows, min_memory_choice(red))
    else:
        state = greedy(red, rows, now + 0.1 * max(deadline - now, 0.0), seed)
    feasible = state.overflow() <= 0 and np.isfinite(state.total_cost())
    log(f"greedy: cost {state.total_cost():.6g}, feasible {feasible}")
    if large:
        now = time.perf_counter()
        # Window MILPs are what improve a large core; a small core with big edge
        # matrices (a planner's) gains more from a finer penalty search.
        rest = max(deadline - now, 0.0)
        cand = None
        if red.num_core > _FULL_MILP_NODES:
            cand = _two_lagrangian_starts(red, rows, now, deadline, seed, log)
        if cand is None or cand.total_cost() >= FORBIDDEN:
            # nothing fits yet, or only with forbidden pairs: the uniform search
            # goes on until something fits
            now = time.perf_counter()
            rest = max(deadline - now, 0.0)
            share = 0.3 if red.num_core > _FULL_MILP_NODES else 1.0
            found = penalty_search(red, rows, now + share * rest, seed, log, give_up=now + 0.8 * rest)
            if found is not None and (cand is None or found.total_cost() < cand.total_cost()):
                cand = found
        if cand is not None and cand.total_cost() < state.total_cost():
            state = cand
        feasible = state.overflow() <= 0
        if feasible and red.num_core > _FULL_MILP_NODES:
            # Guarded forest descents gain far more than MILP windows on these
            # cores; the windows get the last sixth (they clear forbidden pairs
            # the descents leave around hot spots).
            now = time.perf_counter()
            state = guarded_descent(state, now + 0.85 * max(deadline - _MARGIN - now, 0.0), seed, log)
            now = time.perf_counter()
            rest = deadline - _MARGIN - now
            if rest > 0.25 * (deadline - start_time):
                # A second, different start: the cheapest fitting uniform
                # multiplier plus guarded descents (better than the lagrangian
                # path on contest S, 1.19x vs 1.33x, worse on M).
                found = penalty_search(red, rows, now + 0.3 * rest, seed, log, give_up=now + 0.6 * rest)
                if found is not None:
                    now = time.perf_counter()
                    found = guarded_descent(found, now + 0.85 * max(deadline - _MARGIN - now, 0.0), seed, log)
                    if found.total_cost() < state.total_cost():
                        state = found
    if not big and deadline - time.perf_counter() > _MARGIN:
        remaining = deadline - time.perf_counter() - _MARGIN
        res = solve_milp(red, rows, time_limit=0.6 * remaining if feasible else remaining)
        stats.update(milp_status=res.status, milp_bound=res.bound)
        log(f"milp: {res.status}, objective {res.objective:.6g}, bound {res.bound:.6g}")
        if res.status == "infeasible":
            _raise_infeasible(problem, red, deadline)
        if np.isfinite(res.bound):
            bound = res.bound
        if res.choice is not None:
            cand = CoreState(red, rows, res.choice)
            if not feasible or cand.total_cost() <= state.total_cost():
                state, feasible = cand, True
            if res.status == "optimal":
                stats.update(stop="optimal")
                return _CoreAnswer(state.choice, state.total_cost(), True, bound)
        if feasible and _relative_gap(state.total_cost(), bound) <= _GAP:
            stats.update(stop="gap")
            return _CoreAnswer(state.choice, state.total_cost(), True, bound)
    windows_help = red.num_core > _FULL_MILP_NODES or not big
    if feasible and windows_help and deadline - time.perf_counter() > _MARGIN:
        search = WindowSearch(state, seed)
        hot = None
        if large:

            def hot():
                return np.unique(red.edges[violations(state)].ravel())

        size, seconds = (_WINDOW_NODES_LARGE, _WINDOW_SECONDS_LARGE) if large else (_WINDOW_NODES, _WINDOW_SECONDS)
        search.run(deadline - _MARGIN, window_size=size, window_time=seconds, log=log, hot=hot)
        stats.update(lns_windows=search.windows, lns_improved=search.improved)
        log(f"lns: {search.windows} windows, {search.improved} improved, cost {state.total_cost():.6g}"
            f"{', stalled' if search.stalled else ''}")
        if _relative_gap(state.total_cost(), bound) <= _GAP:
            stats.update(stop="gap")
            return _CoreAnswer(state.choice, state.total_cost(), True, bound)
        if search.stalled:
            stats.update(stop="stalled")
    # otherwise the searches ended by their own rules (the penalty bisection), or time ran out
    stats.setdefault("stop", "time_limit" if time.perf_counter() >= deadline - 2 * _MARGIN else "stalled")
    return _CoreAnswer(state.choice, state.total_cost(), False, bound)


def _two_lagrangian_starts(red, rows, now: float, deadline: float, seed: int, log) -> CoreState | None:
    """The cheaper fit of two memory-priced searches (the caller then descends from it).

    Both start from a small uniform multiplier (cheap, far over the limit) and let
    per-point multipliers follow the overflow. Forest rounds (:func:`lagrangian_descent`)
    win on contest M (1.045x vs 2x); belief propagation (:func:`lagrangian_bp`) on A
    (1.15x vs 2.9x) and, after guarded descents, on S. Neither dominates, so both run:
    belief propagation first (it stops a few rounds after its fits stop improving),
    then the forest rounds with the time up to three quarters of ``rest``.
    """
    rest = max(deadline - now, 0.0)
    lam = plain_scale(red) * 2.0**_LAGRANGE_START
    cands = []
    # belief propagation first: it stops itself soon after its first fit
    found = lagrangian_bp(red, rows, plain_scale(red) * 2.0**_BP_START, now + 0.6 * rest, log=log)
    if found is not None:
        cands.append(guarded_descent(found, time.perf_counter() + 0.1 * rest, seed, log))
    start = penalised_choice(red, rows, lam, deadline, seed, forest_seconds=max(0.05 * rest, 1.0))
    found = lagrangian_descent(red, rows, start, lam, now + 0.75 * rest, seed, log)
    if found is not None:
        cands.append(found)
    if not cands:
        return None
    return min(cands, key=lambda st: st.total_cost())


def _raise_infeasible(problem: ShardingProblem, red: Reduction, deadline: float) -> None:
    """The core MILP has no solution: say whether edges or memory are to blame."""
    rows = None
    if problem.memory_limit is not None and problem.node_memory is not None and problem.intervals is not None:
        nonneg = all((m >= 0).all() for m in problem.node_memory)
        rows = memory_rows(problem.intervals, problem.memory_limit, red.core_nodes, red.base_usage, nonneg)
    if rows is None:
        raise InfeasibleError(
            "no assignment avoids every infinite edge cost; the forbidden strategy pairs "
            "(infinite edge entries) leave no consistent choice"
        )
    res = solve_milp(red, rows, time_limit=max(deadline - time.perf_counter(), 1.0), objective="peak")
    if res.choice is None:
        raise InfeasibleError(
            "no assignment avoids every infinite edge cost; the forbidden strategy pairs "
            "(infinite edge entries) leave no consistent choice"
        )
    core = res.choice
    choice = red.expand(core, problem.num_nodes)
    smallest = problem.peak_memory(choice)
    raise _memory_error(problem, smallest, exact=res.status == "optimal")


def _memory_error(problem: ShardingProblem, smallest: float, *, exact: bool) -> InfeasibleError:
    what = "the smallest" if exact else "the smallest found"
    return InfeasibleError(
        f"memory limit {problem.memory_limit:.6g} is below {what} peak usage {smallest:.6g} of any "
        f"assignment; raise the limit to at least {smallest:.6g}, or add strategies that use less memory",
        smallest_memory=smallest,
    )


def _logger(verbose: bool, start: float):
    def log(msg: str) -> None:
        if verbose:
            print(f"[{time.perf_counter() - start:7.2f}s] {msg}", flush=True)

    return log
