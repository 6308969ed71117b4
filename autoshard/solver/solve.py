"""``solve``: the one entry point shared by the planner and the command-line solver.

Pipeline: exact reductions (:mod:`reduce`) -> memory rows on compressed time points
(:mod:`memory`) -> a fast greedy first solution (:mod:`local`), and with memory rows the
memory-free LP optimum repaired to fit (the answer itself when it fits as it is) -> the
grouped MILP (:mod:`milp`) with the remaining time -> expand the core choice back through
the reductions and recompute cost and peak memory on the original problem.

Cores too large for one MILP: without memory rows, toulbar2 (:mod:`cfn`), then
forest descents (:mod:`forest`) and MILP windows; with them, toulbar2's penalty
bisection (:func:`cfn.penalty_bisection`) and the memory-priced searches of
:mod:`penalty` (lagrangian descent, then guarded descents, then a second start
from the uniform penalty search), and MILP windows (:mod:`lns`) with the time left.
Mid-sized memory cores (few nodes, big matrices) get the penalty search, guarded
descents, one time-limited MILP over the whole core, then windows.

No search returns before the deadline unless its answer is proven optimal (by
the MILP, or by a window holding the whole core). With more than one worker,
large cores are searched in several processes (:mod:`parallel`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

import autoshard.solver.cfn as cfn
from autoshard.errors import InfeasibleError
from autoshard.solver.bp import MinSumBP, trivial_bound
from autoshard.solver.forest import ForestSearch, forest_ils, min_cost_choice
from autoshard.solver.lns import WindowSearch
from autoshard.solver.local import CoreState, greedy, min_memory_choice
from autoshard.solver.memory import MemoryRows, memory_rows
from autoshard.solver.milp import promising, restrict, solve_milp
from autoshard.solver.parallel import MIN_PARALLEL_SECONDS, default_workers, search_in_workers
from autoshard.solver.penalty import (
    GENTLE_STEPS,
    clear_forbidden,
    guarded_descent,
    lagrangian_bp,
    lagrangian_descent,
    lagrangian_fit,
    penalised_choice,
    penalty_search,
    plain_scale,
    repaired_start,
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
# Mid-sized memory cores (big matrices): smaller windows still (they grow on a stall).
_WINDOW_NODES_MID = 30
_WINDOW_SECONDS_MID = 0.5
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
# Memory-free large cores: the forest descent from belief propagation's choice stops after this
# many rounds without a gain; the MILP windows that follow start at this many nodes and seconds.
_FREE_PATIENCE = 5
# ... and a descent from the per-node argmins gets at most this share of the time before toulbar2 starts:
# on Llama-3.1-70B's remat candidates on (2, 16, 8) (293-node cores, 8.9M cells) toulbar2 asked for 1 s took
# 1.5 s and answered nothing (it needs ~5 s), leaving a 2 s solve the argmins (cost 1000x the best), where
# this descent reaches the best cost toulbar2 finds in 5 s (its bound within 0.2%) in 0.1 s.
_QUICK_SHARE = 0.3
_QUICK_MIN_S = 0.25
# Windows hold about this many cost cells (a 100-node window of the MoE core, 1.5k cells a node,
# took HiGHS ~1 s), within these node counts, and start with this many seconds.
_FREE_WINDOW_CELLS = 60_000
_FREE_WINDOW_NODES = (10, 100)
_FREE_WINDOW_SECONDS = 1.0
# ... and get this share of the time left; random-start forest descents the rest. Most windows start at
# the 1/_FREE_SEED_FRACTION of nodes whose edges cost most (MoE-1.3B at 5 s: 0.00968 / 0.00958 from
# random seeds, 0.00919 / 0.00938 from these; Wide-ResNet the same).
_FREE_WINDOW_SHARE = 0.7
_FREE_SEED_FRACTION = 10
# Large memory-constrained cores: belief propagation's dual bound (memory ignored) gets
# this share of the time at the end, at most this many seconds and rounds.
_BOUND_SHARE = 0.02
_BOUND_SECONDS = 3.0
_BOUND_ROUNDS = 60
# Large memory cores: the same belief propagation runs on to _REPAIR_BP_ROUNDS rounds (at most
# _REPAIR_BP_SHARE of the time left), its choice is repaired to fit and cleared of forbidden pairs
# (penalty.repaired_start: a few seconds, not time-shared), and guarded descents from there get up to
# _REPAIR_SHARE of the time, before the memory-priced searches start (contest A at 15 s: 1.2x the best
# known where those searches had no fit at all; the planner's GPT-1.3B (2, 4) under a budget at 5 s:
# 0.92x the old best, 1.10x without).
_REPAIR_BP_ROUNDS = 20
_REPAIR_BP_SHARE = 0.25
_REPAIR_SHARE = 0.1
# ... and the memory-priced searches run only with at least this share of the core search's time
# left (they need tens of seconds for a first fit on contest A, M and S); else the guarded descents
# from the repaired start get it.
_LAGRANGE_MIN_SHARE = 0.5
# Mid-sized memory cores (too many cells for the plain MILP path, at most _FULL_MILP_NODES
# nodes): guarded descents get this share of the time after the penalty search, then one
# MILP over the whole core this share of the rest, then MILP windows to the deadline.
_MID_DESCENT_SHARE = 0.15
# ... then MILPs over the most promising _RESTRICT_WIDTH, 2x, 4x, ... strategies per node, each
# with this share of the time left, up to the last one over all strategies; the windows
# keep _MID_WINDOW_SHARE of the time.
_RESTRICT_WIDTH = 4
_RESTRICT_SHARE = 0.3
# ... on cores of at most this many nodes: building the MILP of a 2,865-node planner core (GPT-1.3B on
# (2, 4) under a budget) over 4 strategies a node took 5 s, past a 5 s limit; windows do better there.
_RESTRICT_MAX_NODES = 1000
_MID_WINDOW_SHARE = 0.3
# Memory cores below _FULL_MILP_NODES: the uniform penalty search (bracket, then bisect) gets this share
# of the time left (at 0.3 it had no time to bisect at 5 s: GPT-1.3B on (2, 4) under a budget came out at
# 1.84x the best, at 0.6 1.03x).
_PENALTY_SHARE = 0.6
# Large memory cores: at most this share of the time goes to clearing the least-memory
# start's forbidden pairs (it stops when none is left: 1.5-3 s on contest A, M, S), but at
# least _CLEAR_FLOOR_SECONDS or _CLEAR_FLOOR_SHARE of it, whichever is less: nothing later
# fits without this start, and the clearing's set-up alone (1.3 s on S) took all of a quarter
# of 6 s, so at an 8 s limit S and A answered infeasible.
_CLEAR_SHARE = 0.25
_CLEAR_FLOOR_SECONDS = 3.0
_CLEAR_FLOOR_SHARE = 0.5
# Small memory cores (one MILP): the LP relaxation without the memory rows (dual simplex, at most this share
# of the time and this many seconds), rounded and repaired to fit, competes with the greedy start; when it is
# integral and fits as it is, it is the optimum under the limit too. The planner's stage cores are integral
# there (GPT-39B's on (8, 4) under the memory limit, 86-141 nodes, 7-27 memory points: 0.18 s).
_FREE_START_SHARE = 0.4
_FREE_START_SECONDS = 2.0
# The least peak's LP relaxation, asked when greedy does not fit (see peak_bound_over): its share of the time,
# its most seconds, and the relative margin over the limit its bound must clear (LP tolerances).
_PEAK_BOUND_SHARE = 0.2
_PEAK_BOUND_SECONDS = 2.0
_PEAK_BOUND_TOLERANCE = 1e-6
# Large memory cores, with toulbar2 installed: its penalty bisection (:func:`cfn.penalty_bisection`) gets
# this share of the time left in an odd parallel worker (guarded descents and windows the rest), and this
# share in one process, where the memory-priced searches follow when this share of the time is left.
_CFN_SHARE = 0.9
# Memory-free large cores: toulbar2 gets this share of the time; its answer, unless proven optimal, starts
# the forest descent and windows (belief propagation's does when toulbar2 is missing or found none).
_CFN_FREE_SHARE = 0.5
_CFN_SHARE_ALONE = 0.4
# ... or up to this share while none of its answers fits.
_CFN_GIVE_UP = 0.9
# ... then toulbar2's lower bound with memory ignored gets this share of the time, at most these seconds: it
# proves contest A's memory-free optimum in 8 s; on S its bound after 5 s (3.1418e8) was within 0.1% of its
# bound after 30 s, time its learned prices and windows use better.
_CFN_BOUND_SHARE = 0.2
_CFN_BOUND_SECONDS = 12.0
_LAGRANGE_AFTER_CFN = 0.3


def solve(
    problem: ShardingProblem,
    *,
    time_limit: float = 10.0,
    seed: int = 0,
    workers: int | None = None,
    verbose: bool = False,
) -> ShardingSolution:
    """Pick one strategy per node at least total cost under the memory limit.

    Args:
      problem: the problem.
      time_limit: wall-clock budget in seconds; 0 asks for an immediate
        best-effort answer (reductions plus a greedy pass).
      seed: seeds the randomised parts; with ``workers=1`` the result is
        deterministic for a given seed whenever the budget is not the binding stop.
      workers: processes searching at once (None: the cores this process may run
        on). Cores too large for one MILP, with at least a few seconds left, are
        searched by that many worker processes with different searches that share
        their incumbents; everything else runs in this process.
      verbose: print progress lines.

    Returns:
      The best solution found. ``feasible`` is False only when no feasible choice
      was found in time (none is proven impossible). The search returns before
      ``time_limit`` only when its answer is proven optimal; ``stats["stop"]``
      says why it stopped: ``"optimal"`` (proven, also when the reductions left
      no core), ``"gap"`` (the relative gap to the lower bound closed to within
      1e-6; also ``optimal``) or ``"time_limit"``. ``stats["bound"]`` (a lower
      bound on the cost: the MILP's, toulbar2's Lagrangian bound under its point
      prices, or toulbar2's or belief propagation's dual bound with memory ignored) and ``stats["gap"]`` (``(cost - bound) / cost``) come with
      every answer that has a finite cost; ``stats["elapsed"]`` (the solve's own
      clock), ``stats["time_limit"]`` and ``stats["first_fit"]`` (when a feasible
      choice was first held) are seconds.

    Raises:
      InfeasibleError: a node has no finite-cost strategy, the infinite edge
        costs forbid every assignment, or the memory limit is below the smallest
        achievable peak usage (given as ``smallest_memory``).

    Example:
      >>> import numpy as np
      >>> p = ShardingProblem(node_costs=(np.array([1.0, 2.0]), np.array([3.0, 0.0])),
      ...                     edges=np.array([[0, 1]]),
      ...                     edge_costs=(np.array([[0.0, 5.0], [0.0, 0.0]]),))
      >>> sol = solve(p, workers=1)
      >>> sol.choice.tolist(), sol.cost
      ([1, 1], 2.0)
    """
    scale = cost_scale(problem)
    if scale != 1.0:
        sol = _solve(scaled_costs(problem, scale), time_limit, seed, workers, verbose)
        return _unscaled(sol, problem, scale)
    return _solve(problem, time_limit, seed, workers, verbose)


def _solve(problem: ShardingProblem, time_limit: float, seed: int, workers: int | None,
           verbose: bool) -> ShardingSolution:
    """:func:`solve` on costs of the magnitude the searches are tuned for (see :func:`cost_scale`)."""
    start = time.perf_counter()
    # keep back time to expand the choice and recompute its cost (~1 s per 100k nodes+edges)
    deadline = start + max(float(time_limit) - 1e-5 * (problem.num_nodes + problem.num_edges), 0.0)
    log = _logger(verbose, start)
    n = problem.num_nodes
    if n == 0:
        return _empty_solution(time_limit)
    with_memory = _has_memory(problem)
    # no choice fits when the least usage does not: refused without a search (_least_usage_peak)
    least, choice = _least_usage_peak(problem) if with_memory else (0.0, None)
    refused = with_memory and least > problem.memory_limit * (1 + 1e-9)
    if refused and np.isfinite(problem.cost(choice)):  # that choice is the least peak itself
        raise _memory_error(problem, least, exact=True)
    red = reduce_problem(problem, with_memory=with_memory, deadline=deadline)
    if refused:  # the least-usage choice has an infinite cost: the least peak's MILP names the smallest
        _raise_infeasible(problem, red, time.perf_counter())
    rows = core_memory_rows(problem, red) if with_memory and red.num_core else None
    stats = dict(red.stats, core_nodes=red.num_core, core_edges=len(red.edges))
    if rows is not None:
        stats.update(memory_points=rows.num_points)
    log(f"reduced {n} nodes / {problem.num_edges} edges to a core of {red.num_core} / {len(red.edges)}")
    count = default_workers() if workers is None else max(int(workers), 1)
    core = _answer_core(red, rows, deadline, seed=seed, count=count, stats=stats, verbose=verbose, log=log)
    if core.infeasible:
        _raise_infeasible(problem, red, deadline)
    optimal = core.optimal
    choice = red.expand(core.choice, n)
    cost = problem.cost(choice)
    stats.update(_bound_stats(core, cost))
    peak = problem.peak_memory(choice)
    feasible = problem.is_feasible(choice)
    if with_memory and not feasible and red.num_core == 0 and np.isfinite(cost):
        # Every usage left is strategy-independent, so this peak is the least one.
        raise _memory_error(problem, peak, exact=True)
    log(f"cost {cost:.6g}, peak memory {peak:.6g}, feasible {feasible}, optimal {optimal and feasible}")
    seconds = _clock_stats(stats, start, time_limit, feasible and np.isfinite(cost))
    return ShardingSolution(choice=choice, cost=cost, peak_memory=peak, feasible=feasible,
                            optimal=bool(optimal and feasible), seconds=seconds, stats=stats)


# Costs are brought to the magnitude of the contest problems the searches were tuned on (largest finite
# cell near 2**_COST_BITS) when their largest cell lies outside 2**_COST_RANGE: the planner's costs are
# seconds, 1e-14 to 1e-3 on a small GPT priced for an H100, below HiGHS's absolute tolerances (1e-7 on
# reduced costs), where a MILP's bound stalls near 0 (4-layer GPT on (2, 4): 2.2 s to prove at seconds,
# 0.44 s at 2**10 times them). Powers of two scale exactly, so every comparison is unchanged.
_COST_BITS = 32
_COST_RANGE = (20, 52)
# solve()'s stats that are costs (scaled back); the others are counts, seconds, ratios or labels
_COST_STATS = ("bound", "milp_bound", "free_bound")


def cost_scale(problem: ShardingProblem) -> float:
    """The power of two that brings ``problem``'s largest finite cost near ``2**_COST_BITS``, or 1 when it is
    within ``2**_COST_RANGE`` (or no cost is finite and positive)."""
    top = 0.0
    for arrays in (problem.node_costs, problem.edge_costs):
        for a in arrays:
            if a.size:
                finite = np.abs(a[np.isfinite(a)])
                if finite.size:
                    top = max(top, float(finite.max()))
    if top <= 0.0:
        return 1.0
    bits = np.log2(top)
    if _COST_RANGE[0] <= bits <= _COST_RANGE[1]:
        return 1.0
    return float(2.0 ** (_COST_BITS - int(np.floor(bits))))


def scaled_costs(problem: ShardingProblem, scale: float) -> ShardingProblem:
    """``problem`` with every node and edge cost times ``scale`` (memory untouched)."""
    return dataclasses.replace(problem, node_costs=tuple(c * scale for c in problem.node_costs),
                               edge_costs=tuple(c * scale for c in problem.edge_costs))


def _unscaled(sol: ShardingSolution, problem: ShardingProblem, scale: float) -> ShardingSolution:
    """A solution of the problem scaled by ``scale``, as a solution of ``problem`` itself."""
    stats = dict(sol.stats, cost_scale=scale)
    for key in _COST_STATS:
        if key in stats and stats[key] is not None:
            stats[key] = float(stats[key]) / scale
    if "worker_costs" in stats:
        stats["worker_costs"] = [float(c) / scale for c in stats["worker_costs"]]
    cost = problem.cost(sol.choice) if np.isfinite(sol.cost) else sol.cost
    return dataclasses.replace(sol, cost=cost, stats=stats)


def _clock_stats(stats: dict, start: float, time_limit: float, feasible: bool) -> float:
    """Record ``elapsed``, ``time_limit`` and (feasible answers) ``first_fit``; the seconds since ``start``."""
    seconds = time.perf_counter() - start
    first = stats.pop("first_fit_at", None)
    if feasible:
        stats.update(first_fit=seconds if first is None else min(first - start, seconds))
    stats.update(elapsed=seconds, time_limit=float(time_limit))
    return seconds


def _empty_solution(time_limit: float) -> ShardingSolution:
    """The answer for a problem without nodes."""
    return ShardingSolution(np.zeros(0, dtype=np.int64), 0.0, 0.0, True, True, 0.0,
                            {"stop": "optimal", "bound": 0.0, "gap": 0.0, "elapsed": 0.0,
                             "time_limit": float(time_limit)})


def _has_memory(problem: ShardingProblem) -> bool:
    return problem.memory_limit is not None and problem.node_memory is not None and problem.intervals is not None


def core_memory_rows(problem: ShardingProblem, red: Reduction) -> MemoryRows:
    """The memory rows of ``red``'s core (``problem`` has a memory limit)."""
    nonneg = all((m >= 0).all() for m in problem.node_memory)
    return memory_rows(problem.intervals, problem.memory_limit, red.core_nodes, red.base_usage, nonneg)


def _answer_core(red: Reduction, rows: MemoryRows | None, deadline: float, *, seed: int, count: int,
                 stats: dict, verbose: bool, log) -> CoreAnswer:
    """The core searched in ``count`` worker processes when it is big and time allows, else in this one."""
    if count > 1 and red.num_core and is_big(red) and deadline - time.perf_counter() > MIN_PARALLEL_SECONDS:
        # the workers' answer, or at worst the least-memory choice cleared of forbidden pairs (found
        # here first: the workers take seconds to start, and this is the first feasible answer)
        if rows is None:
            fallback = CoreState(red, None, min_cost_choice(red))
        else:
            fallback = _cleared_start(soften(red), rows, deadline, seed, log)
        return CoreAnswer(**search_in_workers(red, rows, deadline, seed=seed, count=count, stats=stats,
                                              fallback=fallback, verbose=verbose, log=log))
    return search_core(red, rows, deadline, seed=seed, log=log, stats=stats)


def _bound_stats(core: CoreAnswer, cost: float) -> dict:
    """``bound`` and ``gap`` of the full problem's answer (cost ``cost``) from the core's, when known."""
    optimal = core.optimal
    if np.isfinite(core.bound) and np.isfinite(cost):
        # the reductions are exact: the full cost is the core's plus a constant
        bound = min(core.bound + cost - core.cost, cost) if optimal else core.bound + cost - core.cost
        return {"bound": bound, "gap": relative_gap(cost, bound)}
    if optimal:
        return {"bound": cost, "gap": 0.0}
    return {}


@dataclasses.dataclass(frozen=True, slots=True)
class CoreAnswer:
    """The core search's answer: its choice, that choice's core cost, and a lower bound (or nan).

    ``infeasible`` is True when the core MILP proved that no choice exists (the
    caller then says why, on the original problem).
    """

    choice: np.ndarray
    cost: float
    optimal: bool
    bound: float = np.nan
    infeasible: bool = False


class NoSharing:
    """A search in one process: there is no other search to share incumbents with."""

    def post(self, state: CoreState) -> None:
        """Offer a feasible incumbent to the other searches."""

    def poll(self) -> np.ndarray | None:
        """The newest incumbent choice another search found, or None."""
        return None

    def offer(self, state: CoreState, mult: float) -> None:
        """Offer the other searches ``state`` as a start for forest rounds from multipliers ``mult``."""

    def take_start(self) -> tuple[np.ndarray, float] | None:
        """The newest start another search offered, with its multiplier, or None."""
        return None


def relative_gap(cost: float, bound: float) -> float:
    """``(cost - bound) / |cost|``, at least 0; inf without a finite cost and bound."""
    if not (np.isfinite(cost) and np.isfinite(bound)):
        return np.inf
    return max(cost - bound, 0.0) / max(abs(cost), 1e-300)


def is_big(red: Reduction) -> bool:
    """Whether the core is too large for one MILP over all of it (see ``_FULL_MILP_CELLS``)."""
    return red.num_core > _FULL_MILP_NODES or _cells(red) > _FULL_MILP_CELLS


def _cells(red: Reduction) -> int:
    return sum(c.size for c in red.node_costs) + sum(m.size for m in red.edge_costs)


def search_core(
    red: Reduction,
    rows: MemoryRows | None,
    deadline: float,
    *,
    seed: int,
    log,
    stats: dict,
    variant: int | None = None,
    share=None,
) -> CoreAnswer:
    """Search the reduced core until ``deadline`` or a proof of optimality.

    Records in ``stats["stop"]`` why the search stopped ("optimal", "gap" or
    "time_limit"). ``variant`` is None for the one search of a single process;
    parallel workers pass their index and split the searches between them
    (:mod:`autoshard.solver.parallel`), offering and taking incumbents through
    ``share`` (see :class:`NoSharing`).
    """
    share = NoSharing() if share is None else share
    if red.num_core == 0:
        stats.update(stop="optimal")
        return CoreAnswer(np.zeros(0, dtype=np.int64), 0.0, True, 0.0)
    start_time = time.perf_counter()
    search = Search(red, rows, deadline, seed, log, stats, share, variant)
    big = is_big(red)
    stats.update(core_cells=_cells(red))
    if rows is None and big:
        answer = _memory_free_large(search)
    else:
        answer = _memory_core(search, start_time)
        lb = stats.pop("free_bound", np.nan)
        if np.isfinite(lb) and not answer.optimal and not answer.infeasible:
            if not np.isfinite(answer.bound) or lb > answer.bound:
                answer = dataclasses.replace(answer, bound=lb)
    if not answer.optimal and not answer.infeasible and relative_gap(answer.cost, answer.bound) <= _GAP:
        stats.update(stop="gap")
        answer = dataclasses.replace(answer, optimal=True)
    stats.setdefault("stop", "time_limit")
    return answer


@dataclasses.dataclass(frozen=True, slots=True)
class Search:
    """What the steps of one core search share: the core, its memory rows, the clock, and where to report.

    ``stats`` is the solve's stats dict (the steps record into it); ``share``
    offers and takes incumbents (:class:`NoSharing` in one process);
    ``variant`` is the parallel worker's index (None in one process).
    """

    red: Reduction
    rows: MemoryRows | None
    deadline: float
    seed: int
    log: Callable[[str], None]
    stats: dict
    share: NoSharing
    variant: int | None = None


def _bp_bound(red: Reduction, deadline: float) -> tuple[float, MinSumBP]:
    """The best belief-propagation dual bound (memory ignored) reached by ``deadline``, and the propagation."""
    bp = MinSumBP(red)
    best = bp.lower_bound()
    while time.perf_counter() < deadline and bp.rounds < _BOUND_ROUNDS:
        for _ in range(3):
            bp.step(bp.beliefs())
        best = max(best, bp.lower_bound())
    return best, bp


def _memory_free_large(s: Search) -> CoreAnswer:
    """No memory limit: toulbar2, a forest descent from its choice, then MILP windows to the deadline.

    toulbar2 (half the time) proves the optimum of contest A without its limit (5.26e9) in 10 s;
    when its bound meets its answer that is the answer. Without it (or without its answer in
    time) belief propagation gives the start, far better than the per-node argmins (contest A
    without its limit: 5.5e9 vs 7.8e10 after 40 s), and its messages give the lower bound. On the planner's untied problems (``benchmarks.solver --planner``) the forest
    descent rarely improves on it and random-start descents never did (GPT-1.3B/6.7B,
    MoE, Wide-ResNet, 5 s and 30 s), while MILP windows went on finding cheaper choices
    (MoE-1.3B on (2, 4): 0.00978 -> 0.00938 in 30 s), so the windows get the time.

    A descent from the per-node argmins runs first (see ``_QUICK_SHARE``): toulbar2 can use all of a short
    limit and more without an answer, and the search then returned the argmins themselves.
    """
    red = soften(s.red)
    quick = _quick_start(red, s)
    now = time.perf_counter()
    rest = max(s.deadline - now, 0.0)
    # toulbar2 counts whole seconds: it gets at least one where the limit leaves one (a 2 s probe: 0.9 s was
    # none, and the DDPM UNet's core, which it proves in 0.3 s, went to the time limit at gap 0.018)
    found = cfn.minimise(s.red, now + max(_CFN_FREE_SHARE * rest, min(cfn.MIN_SECONDS + 0.01, rest)),
                         seed=s.seed)
    # toulbar2's dual bound holds whether or not it found a choice in time
    bound = max(found.bound, trivial_bound(red)) if found is not None else trivial_bound(red)
    if found is not None and found.choice is not None:
        state = CoreState(red, None, found.choice)
        s.log(f"toulbar2: cost {state.total_cost():.6g}, bound {bound:.6g}")
        s.stats.update(cfn_attempts=1)
        if relative_gap(state.total_cost(), bound) <= _GAP:
            s.stats.update(stop="optimal")
            return CoreAnswer(state.choice, state.total_cost(), True, bound)
    else:
        bp = MinSumBP(red)
        bp_choice, bp_cost = bp.run(now + _BP_SHARE * max(s.deadline - now, 0.0), max_rounds=_BP_ROUNDS, tol=_BP_TOL)
        bound = max(bp.lower_bound(), bound)
        s.log(f"belief propagation: {bp.rounds} rounds, cost {bp_cost:.6g}, bound {bound:.6g}")
        s.stats.update(bp_rounds=bp.rounds)
        state = CoreState(red, None, bp_choice)
    if quick.total_cost() < state.total_cost():
        state = quick
    if relative_gap(state.total_cost(), bound) <= _GAP:
        s.stats.update(stop="optimal")
        return CoreAnswer(state.choice, state.total_cost(), True, bound)
    descent = ForestSearch(state, s.seed)
    descent.run(s.deadline - _MARGIN, patience=_FREE_PATIENCE)
    s.log(f"forest descent: {descent.rounds} rounds, cost {state.total_cost():.6g}")
    s.stats.update(forest_rounds=descent.rounds)
    if s.deadline - time.perf_counter() > _MARGIN:
        per_node = _cells(red) / max(red.num_core, 1)
        nodes = int(np.clip(_FREE_WINDOW_CELLS / per_node, *_FREE_WINDOW_NODES))
        now = time.perf_counter()
        until = now + _FREE_WINDOW_SHARE * max(s.deadline - now, 0.0)
        state = _windows(dataclasses.replace(s, red=red, deadline=until), state, False,
                         (nodes, _FREE_WINDOW_SECONDS), seeds=_costly_nodes)
        if s.stats.get("stop") == "optimal":
            return CoreAnswer(state.choice, state.total_cost(), True, state.total_cost())
    if s.deadline - time.perf_counter() > _MARGIN:
        # random-start descents: on dense random cores they gain where windows do not
        found = forest_ils(state, s.deadline - _MARGIN, s.seed, log=s.log)
        state = found.state
        s.stats.update(forest_restarts=found.restarts)
    return CoreAnswer(state.choice, state.total_cost(), False, bound)


def _quick_start(red: Reduction, s: Search) -> CoreState:
    """The per-node argmins of the memory-free core ``red``, descended by forest rounds to a stall, for at most
    ``_QUICK_SHARE`` of the time left (or ``_QUICK_MIN_S``, within half of it): an answer that does not wait on
    toulbar2."""
    state = CoreState(red, None, min_cost_choice(red))
    descent = ForestSearch(state, s.seed)
    rest = max(s.deadline - time.perf_counter(), 0.0)
    descent.run(time.perf_counter() + max(_QUICK_SHARE * rest, min(_QUICK_MIN_S, rest / 2)), patience=_FREE_PATIENCE)
    s.log(f"quick descent: {descent.rounds} rounds, cost {state.total_cost():.6g}")
    s.stats.update(quick_rounds=descent.rounds)
    return state


def _costly_nodes(state: CoreState) -> np.ndarray:
    """The 1/_FREE_SEED_FRACTION of the core's nodes whose edges cost most under the choice (where resharding
    is paid)."""
    red = state.red
    paid = state.edge_costs()
    per_node = np.zeros(red.num_core)
    if paid.size:
        np.add.at(per_node, red.edges[:, 0], paid)
        np.add.at(per_node, red.edges[:, 1], paid)
    return np.argsort(-per_node, kind="stable")[: max(red.num_core // _FREE_SEED_FRACTION, 1)]


def _memory_core(s: Search, start_time: float) -> CoreAnswer:
    """Cores with memory rows, and cores small enough for one MILP."""
    now = time.perf_counter()
    big = is_big(s.red)
    large = s.rows is not None and big
    hard = s.red  # the MILP takes forbidden pairs as missing variables, not as priced ones
    if large:
        # Start memory-feasible and let the searches price out forbidden pairs.
        s = dataclasses.replace(s, red=soften(s.red))
        shared = s.share.poll()  # the parent's first answer, when it has sent one yet
        cand = None if shared is None else CoreState(s.red, s.rows, shared)
        if cand is not None and not len(violations(cand)) and cand.overflow() <= 0:
            state = cand
        elif not s.variant:  # worker 0 (or the one process) holds the first answer; the others search
            state = _cleared_start(s.red, s.rows, s.deadline, s.seed, s.log)
        else:
            state = CoreState(s.red, s.rows, min_memory_choice(s.red))
    else:
        state = greedy(s.red, s.rows, now + 0.1 * max(s.deadline - now, 0.0), s.seed)
        if s.rows is not None and s.rows.num_points and state.overflow() > 0 and peak_bound_over(s):
            s.log("the least peak's relaxation is over the limit: infeasible")
            return CoreAnswer(state.choice, np.inf, False, np.nan, infeasible=True)
        if s.rows is not None and s.rows.num_points:
            if state.overflow() <= 0 and np.isfinite(state.total_cost()):
                _post(s, state)  # the first fit is greedy's
            state, proven = _free_start(s, state)
            if proven:
                s.log(f"the memory-free optimum fits: cost {state.total_cost():.6g}, optimal")
                s.stats.update(stop="optimal")
                return CoreAnswer(state.choice, state.total_cost(), True, state.total_cost())
    feasible = state.overflow() <= 0 and np.isfinite(state.total_cost())
    s.log(f"{'least memory' if large else 'greedy'}: cost {state.total_cost():.6g}, feasible {feasible}")
    if large:
        if state.overflow() <= 0:
            _post(s, state)  # something to answer with, should this worker be cut off
        bp = None
        if not s.variant:
            # the bound next, after the first answer (building it takes a while on big
            # matrices; at the end it could overrun the deadline)
            now = time.perf_counter()
            s.stats["free_bound"], bp = _bp_bound(s.red, now + min(_BOUND_SHARE * max(s.deadline - now, 0.0),
                                                                    _BOUND_SECONDS))
        state = _large_start(s, state, start_time, bp)
        feasible = state.overflow() <= 0
    if feasible:
        _post(s, state)
    bound = np.nan
    mid = large and s.red.num_core <= _FULL_MILP_NODES
    if mid and feasible:
        # A mid-sized memory core (hundreds of nodes, big matrices): MILPs over the most
        # promising few strategies per node, twice as many each time, the last one
        # (when time allows) over all of them. Odd parallel workers skip to the windows.
        if (s.variant or 0) % 2 == 0 and s.red.num_core <= _RESTRICT_MAX_NODES:
            state = _restricted_milps(s, hard, state)
            if s.stats.get("stop") == "optimal":
                return CoreAnswer(state.choice, state.total_cost(), True, s.stats["milp_bound"])
            bound = s.stats.get("milp_bound", np.nan)
    elif not big and s.deadline - time.perf_counter() > _MARGIN:
        answer, state, feasible, bound = _full_milp(s, state, feasible)
        if answer is not None:
            return answer
    if feasible and s.deadline - time.perf_counter() > _MARGIN:
        state = _windows(s, state, large)
        if s.stats.get("stop") == "optimal":
            return CoreAnswer(state.choice, state.total_cost(), True, state.total_cost())
    return CoreAnswer(state.choice, state.total_cost(), False, bound)


def peak_bound_over(s: Search) -> bool:
    """Whether the LP relaxation of the least peak (in at most ``_PEAK_BOUND_SHARE`` of the time) is over the
    memory limit, which proves that no choice fits: the caller is spared the memory-constrained MILP's proof of
    it (Llama-3-8B's remat candidates on 8: 0.6 s against 3.8 s). Asked only once greedy did not fit."""
    now = time.perf_counter()
    limit = min(_PEAK_BOUND_SHARE * max(s.deadline - _MARGIN - now, 0.0), _PEAK_BOUND_SECONDS)
    if limit < 0.05:
        return False
    res = solve_milp(s.red, s.rows, time_limit=limit, objective="peak", relaxation_only=True)
    return res.status in ("relaxed", "optimal") and res.bound > s.rows.limit * (1.0 + _PEAK_BOUND_TOLERANCE)


def _free_start(s: Search, state: CoreState) -> tuple[CoreState, bool]:
    """The cheaper fit of ``state`` and the core's memory-free LP optimum (rounded, and repaired to fit when it
    does not), in at most ``_FREE_START_SHARE`` of the time; True when that optimum is integral and fits as it
    is (it is then the optimum under the memory rows too)."""
    now = time.perf_counter()
    limit = min(_FREE_START_SHARE * max(s.deadline - _MARGIN - now, 0.0), _FREE_START_SECONDS)
    if limit < 0.05:
        return state, False
    res = solve_milp(s.red, None, time_limit=limit, relaxation_only=True)
    if np.isfinite(res.bound):  # a lower bound under the memory rows too (search_core keeps the best)
        s.stats["free_bound"] = max(res.bound, s.stats.get("free_bound", -np.inf))
    if res.choice is None:
        return state, False
    cand = CoreState(s.red, s.rows, res.choice)
    if cand.overflow() <= 0 and res.status == "optimal" and np.isfinite(cand.total_cost()):
        return cand, True
    until = time.perf_counter() + 0.5 * limit
    if cand.overflow() > 0 and not cand.repair(until):
        return state, False
    cand.improve(until, np.random.default_rng(s.seed))
    s.log(f"memory-free relaxation ({res.status}), repaired: cost {cand.total_cost():.6g}")
    better = cand.overflow() <= 0 and cand.total_cost() < state.total_cost()
    return (cand if better else state), False


def _cleared_start(soft: Reduction, rows: MemoryRows, deadline: float, seed: int, log) -> CoreState:
    """The :func:`soften`-ed core's least-memory choice, cleared of forbidden pairs in ``_CLEAR_SHARE`` of the time
    (at least the floor)."""
    now = time.perf_counter()
    rest = max(deadline - now, 0.0)
    share = max(_CLEAR_SHARE * rest, min(_CLEAR_FLOOR_SECONDS, _CLEAR_FLOOR_SHARE * rest))
    return clear_forbidden(CoreState(soft, rows, min_memory_choice(soft)), now + share, seed, log)


def _post(s: Search, state: CoreState) -> None:
    """Offer the fitting ``state`` to the other searches; the first one free of forbidden pairs is timed."""
    s.share.post(state)
    if not len(violations(state)):
        s.stats.setdefault("first_fit_at", time.perf_counter())


def _full_milp(s: Search, state: CoreState, feasible: bool):
    """One MILP over the whole (small) core with most of the time left.

    Returns ``(answer, state, feasible, bound)``: ``answer`` is the search's
    final answer when the MILP settled it (infeasible, optimal, or within the
    gap), else None and the search goes on from ``state``.
    """
    remaining = s.deadline - time.perf_counter() - _MARGIN
    share_of_rest = 0.6 if feasible else 1.0
    # Without memory rows the relaxation is often integral (the planner's layer cores always were); a
    # binding memory row makes its optimum split a node between two strategies, so the MILP goes first.
    free = s.rows is None or not s.rows.num_points
    res = solve_milp(s.red, s.rows, time_limit=share_of_rest * remaining, relaxation_first=free)
    s.stats.update(milp_status=res.status, milp_bound=res.bound)
    s.log(f"milp: {res.status}, objective {res.objective:.6g}, bound {res.bound:.6g}")
    bound = np.nan
    if res.status == "infeasible":
        return CoreAnswer(state.choice, np.inf, False, np.nan, infeasible=True), state, feasible, bound
    if np.isfinite(res.bound):
        bound = res.bound
    if res.choice is not None:
        cand = CoreState(s.red, s.rows, res.choice)
        if not feasible or cand.total_cost() <= state.total_cost():
            state, feasible = cand, True
            _post(s, state)
        if res.status == "optimal":
            s.stats.update(stop="optimal")
            return CoreAnswer(state.choice, state.total_cost(), True, bound), state, feasible, bound
    if feasible and relative_gap(state.total_cost(), bound) <= _GAP:
        return CoreAnswer(state.choice, state.total_cost(), False, bound), state, feasible, bound
    return None, state, feasible, bound


def _restricted_milps(s: Search, hard: Reduction, state: CoreState) -> CoreState:
    """MILPs over the ``_RESTRICT_WIDTH``, then twice as many, ... most promising strategies per node.

    Each gets ``_RESTRICT_SHARE`` of the time left before the windows' share;
    a cheaper answer replaces ``state``. The ladder ends with the full core (its
    bound is then the MILP's; ``stats["stop"]`` is "optimal" when it was solved)
    or when the time is spent. ``hard`` is the core with its forbidden pairs
    infinite (``s.red`` prices them).
    """
    widest = max(c.size for c in hard.node_costs)
    width = _RESTRICT_WIDTH
    start = time.perf_counter()
    until = start + (1.0 - _MID_WINDOW_SHARE) * max(s.deadline - _MARGIN - start, 0.0)
    while time.perf_counter() + 0.2 < until:
        full = width >= widest
        rest = until - time.perf_counter()
        if full:
            sub, keep = hard, None
        else:
            local = [state.local_cost(k) for k in range(s.red.num_core)]
            keep = promising(hard, state.choice, local, width)
            sub = restrict(hard, keep)
        res = solve_milp(sub, s.rows, time_limit=rest if full else _RESTRICT_SHARE * rest)
        choice = res.choice if keep is None or res.choice is None else \
            np.array([kp[c] for kp, c in zip(keep, res.choice, strict=True)], dtype=np.int64)
        s.log(f"restricted milp ({'all' if full else width} strategies): {res.status}, "
              f"objective {res.objective:.6g}")
        if choice is not None:
            cand = CoreState(s.red, s.rows, choice)
            if cand.overflow() <= 0 and cand.total_cost() < state.total_cost():
                state = cand
                _post(s, state)
        if full:
            s.stats.update(milp_status=res.status, milp_bound=res.bound)
            if res.status == "optimal" and res.choice is not None:
                s.stats.update(stop="optimal")
            break
        width *= 2
    return state


def _windows(s: Search, state: CoreState, large: bool, window=None, seeds=None) -> CoreState:
    """MILP windows until the deadline, growing on a stall; adopts cheaper shared incumbents.

    ``window``: the first windows' ``(nodes, seconds)``; None picks them by the core's kind. Most windows
    start at the ends of forbidden pairs in use (``large`` memory cores), else at ``seeds(state)`` when
    given, else anywhere."""
    red, rows, share, log = s.red, s.rows, s.share, s.log
    search = WindowSearch(state, s.seed)
    hot = None
    if large:

        def hot():
            return np.unique(red.edges[violations(search.state)].ravel())
    elif seeds is not None:

        def hot():
            return seeds(search.state)

    posted = [search.state.total_cost()]

    def adopt(ws: WindowSearch) -> None:
        cost = ws.state.total_cost()
        if cost < posted[0]:
            share.post(ws.state)
            posted[0] = cost
        drawn = _drawn(s, share.take_start())
        if drawn is not None:
            share.post(drawn)
        choice = share.poll()
        cand = drawn if choice is None else CoreState(red, rows, choice)
        if drawn is not None and drawn.total_cost() < cand.total_cost():
            cand = drawn
        if cand is None:
            return
        if cand.overflow() <= 0 and cand.total_cost() < cost - 1e-12 * max(1.0, abs(cost)):
            ws.state = cand
            ws.settled[:] = False
            posted[0] = cand.total_cost()
            log(f"lns: took a shared incumbent, cost {cand.total_cost():.6g}")

    size, seconds = (_WINDOW_NODES_LARGE, _WINDOW_SECONDS_LARGE) if large else (_WINDOW_NODES, _WINDOW_SECONDS)
    if large and red.num_core <= _FULL_MILP_NODES:
        size, seconds = _WINDOW_NODES_MID, _WINDOW_SECONDS_MID
    if window is not None:
        size, seconds = window
    search.run(s.deadline - _MARGIN, window_size=size, window_time=seconds, log=log, hot=hot, grow=True,
               adopt=adopt)
    s.stats.update(lns_windows=search.windows, lns_improved=search.improved)
    log(f"lns: {search.windows} windows, {search.improved} improved, cost {search.state.total_cost():.6g}"
        f"{', proven optimal' if search.proven else ''}")
    if search.proven:
        s.stats.update(stop="optimal")
    return search.state


def _drawn(s: Search, start: tuple[np.ndarray, float] | None) -> CoreState | None:
    """Forest rounds from a start another search offered (``(choice, mult)``, or None): their fit, or None."""
    if start is None:
        return None
    choice, mult = start
    fit = lagrangian_fit(s.red, s.rows, choice, mult=np.full(s.rows.num_points, mult), deadline=s.deadline - _MARGIN,
                         seed=s.seed, log=lambda m: s.log(f"offered start: {m}"), steps=GENTLE_STEPS)
    return fit.state


def _large_start(s: Search, state: CoreState, start_time: float, bp: MinSumBP | None) -> CoreState:
    """A first fitting choice of a large memory-constrained core (``state`` when none is found).

    ``bp`` is the bound's belief propagation (memory ignored), when this search computed it.
    """
    red, rows, deadline, seed, log = s.red, s.rows, s.deadline, s.seed, s.log
    now = time.perf_counter()
    huge = red.num_core > _FULL_MILP_NODES
    cands = [] if bp is None else [_repaired(s, bp, now)]
    # toulbar2's penalty bisection: the odd parallel workers, or first in one process; the even workers
    # keep the searches below (each wins on some contest cores: the bisection on A and M, them on S)
    priced = cfn.available() and (s.variant is None or s.variant % 2 == 1)
    if priced:
        now = time.perf_counter()
        share = _CFN_SHARE if s.variant is not None else _CFN_SHARE_ALONE
        rest = max(deadline - _MARGIN - now, 0.0)
        cands.append(cfn.penalty_bisection(red, rows, now + share * rest, seed, log=log, post=lambda st: _post(s, st),
                                           stats=s.stats, give_up=now + _CFN_GIVE_UP * rest, probe=s.variant is None,
                                           offer=s.share.offer))
        _cfn_bound(s, start_time)
    if huge and (not priced or s.variant is None):
        rest = deadline - time.perf_counter()
        if cands == [] or rest > _LAGRANGE_MIN_SHARE * (deadline - start_time) or \
                (priced and rest > _LAGRANGE_AFTER_CFN * (deadline - start_time)):
            cands.append(_two_lagrangian_starts(s, time.perf_counter()))
    if huge or priced:
        shared = s.share.poll()  # another worker's fit, when cheaper: the descents below start from it
        if shared is not None:
            cands.append(CoreState(red, rows, shared))
    cands = [c for c in cands if c is not None and c.overflow() <= 0 and not len(violations(c))]
    cand = min(cands, key=lambda st: st.total_cost()) if cands else None
    if cand is None or not (huge or priced):
        # The uniform search: on huge cores only while nothing fits; mid-sized ones always get it
        # too (its answer and the repaired start's each win on some of the planner's problems)
        now = time.perf_counter()
        rest = max(deadline - now, 0.0)
        found = penalty_search(red, rows, now + _PENALTY_SHARE * rest, seed, log=log, give_up=now + 0.8 * rest)
        if found is not None and (cand is None or found.total_cost() < cand.total_cost()):
            cand = found
    if cand is not None and cand.total_cost() < state.total_cost():
        state = cand
    if state.overflow() > 0:
        return state
    now = time.perf_counter()
    if not huge:
        # Guarded forest descents (they stop themselves) before the MILP and windows.
        return guarded_descent(state, now + _MID_DESCENT_SHARE * max(deadline - _MARGIN - now, 0.0), seed, log)
    # Guarded forest descents gain far more than MILP windows on these
    # cores; the windows get the last sixth (they clear forbidden pairs
    # the descents leave around hot spots).
    state = guarded_descent(state, now + 0.85 * max(deadline - _MARGIN - now, 0.0), seed, log)
    now = time.perf_counter()
    rest = deadline - _MARGIN - now
    if rest > 0.25 * (deadline - start_time) and not priced:
        # A second, different start: the cheapest fitting uniform
        # multiplier plus guarded descents (better than the lagrangian
        # path on contest S, 1.19x vs 1.33x, worse on M).
        found = penalty_search(red, rows, now + 0.3 * rest, seed, log=log, give_up=now + 0.6 * rest)
        if found is not None:
            now = time.perf_counter()
            found = guarded_descent(found, now + 0.85 * max(deadline - _MARGIN - now, 0.0), seed, log)
            if found.total_cost() < state.total_cost():
                state = found
    return state


def _cfn_bound(s: Search, start_time: float) -> None:
    """toulbar2's lower bound on the core with memory ignored (so under the memory rows too) into
    ``stats["free_bound"]``, in ``_CFN_BOUND_SHARE`` of the search's time (at most ``_CFN_BOUND_SECONDS``).

    A stopped solve's dual bound is still a bound; on contest A it proves the memory-free optimum (0.80x the
    best known) in 10 s, where belief propagation's bound was 1e-6 of it."""
    now = time.perf_counter()
    seconds = min(_CFN_BOUND_SHARE * (s.deadline - start_time), _CFN_BOUND_SECONDS, s.deadline - _MARGIN - now)
    bound = cfn.free_bound(s.red, now + seconds, seed=s.seed)
    if np.isfinite(bound):
        s.stats["free_bound"] = max(bound, s.stats.get("free_bound", -np.inf))
        s.log(f"toulbar2 bound, memory ignored: {bound:.6g}")


def _repaired(s: Search, bp: MinSumBP, now: float) -> CoreState | None:
    """Belief propagation's memory-free choice made to fit (:func:`repaired_start`), in ``_REPAIR_SHARE``
    of the time left; posted when it fits without forbidden pairs."""
    rest = max(s.deadline - now, 0.0)
    choice, _ = bp.run(now + _REPAIR_BP_SHARE * rest, max_rounds=max(_REPAIR_BP_ROUNDS - bp.rounds, 0))
    found = repaired_start(CoreState(s.red, s.rows, choice), s.deadline - _MARGIN, s.seed, s.log,
                           improve_until=now + _REPAIR_SHARE * rest)
    s.log(f"repaired start ({bp.rounds} rounds of belief propagation): "
          f"{'none' if found is None else f'cost {found.total_cost():.6g}'}")
    if found is not None:
        _post(s, found)
    return found


def _two_lagrangian_starts(s: Search, now: float) -> CoreState | None:
    """The cheaper fit of two memory-priced searches (the caller then descends from it).

    Both start from a small uniform multiplier (cheap, far over the limit) and let
    per-point multipliers follow the overflow. Forest rounds (:func:`lagrangian_descent`)
    win on contest M (1.045x vs 2x); belief propagation (:func:`lagrangian_bp`) on A
    (1.15x vs 2.9x) and, after guarded descents, on S. Neither dominates, so in one
    process both run: belief propagation first (it stops a few rounds after its fits
    stop improving), then the forest rounds with the time up to three quarters of
    ``rest``. Parallel worker 0 does the same; the others take one each (odd ones
    the forest rounds, even ones belief propagation), so that the best answer is
    never worse than one process's.
    """
    red, rows, deadline, seed, log, variant = s.red, s.rows, s.deadline, s.seed, s.log, s.variant
    rest = max(deadline - now, 0.0)
    lam = plain_scale(red) * 2.0**_LAGRANGE_START
    cands = []
    both = variant is None or variant == 0
    if both or variant % 2 == 0:
        # belief propagation first: it stops itself soon after its first fit
        until = 0.6 if both else 0.65
        found = lagrangian_bp(red, rows, plain_scale(red) * 2.0**_BP_START, now + until * rest, log=log)
        if found is not None:
            # its fits may keep a few forbidden pairs (contest S: 9), which a guarded descent
            # removes only when a round happens to fit; clearing them first is quick and sure
            found = clear_forbidden(found, time.perf_counter() + 0.1 * rest, seed, log)
            cands.append(guarded_descent(found, time.perf_counter() + 0.1 * rest, seed, log))
    if both or variant % 2 == 1:
        start = penalised_choice(red, rows, lam, deadline, seed, forest_seconds=max(0.05 * rest, 1.0))
        found = lagrangian_descent(red, rows, start, lam=lam, deadline=now + 0.75 * rest, seed=seed, log=log)
        if found is not None:
            cands.append(found)
    if not cands:
        return None
    return min(cands, key=lambda st: st.total_cost())


def _raise_infeasible(problem: ShardingProblem, red: Reduction, deadline: float) -> None:
    """The core MILP has no solution: say whether edges or memory are to blame."""
    rows = core_memory_rows(problem, red) if _has_memory(problem) else None
    if rows is None:
        raise InfeasibleError(
            "no assignment avoids every infinite edge cost; the forbidden strategy pairs "
            "(infinite edge entries) leave no consistent choice"
        )
    res = solve_milp(red, rows, time_limit=max(deadline - time.perf_counter(), 1.0), objective="peak")
    if res.choice is None and res.status == "infeasible":
        raise InfeasibleError(
            "no assignment avoids every infinite edge cost; the forbidden strategy pairs "
            "(infinite edge entries) leave no consistent choice"
        )
    # no proof in time (a large core): the least-memory choice bounds the smallest peak from above
    core = res.choice if res.choice is not None else min_memory_choice(red)
    choice = red.expand(core, problem.num_nodes)
    smallest = problem.peak_memory(choice)
    raise _memory_error(problem, smallest, exact=res.status == "optimal")


def least_peak(problem: ShardingProblem) -> float:
    """A lower bound on the memory row's peak of any choice of ``problem`` (every node at its least usage): a
    ``memory_limit`` below it is refused by :func:`solve` without a search. ``problem`` needs its memory rows."""
    return float(_least_usage_peak(problem)[0])


def _least_usage_peak(problem: ShardingProblem) -> tuple[float, np.ndarray]:
    """The peak with every node at its least usage, and that choice.

    Usage adds up node by node (``ShardingProblem.peak_memory``), so no choice uses less than that one at any
    point: a limit below it admits no choice, and no search is needed (the remat search's candidates far over
    the device, Llama-3.1-70B on 256 at four times the budget, were searched for the whole time limit). The
    peak is the smallest one when the choice's cost is finite, else a lower bound (:func:`_raise_infeasible`
    names the smallest)."""
    least = np.array([int(np.argmin(m)) if m.size else 0 for m in problem.node_memory], dtype=np.int64)
    return problem.peak_memory(least), least


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
