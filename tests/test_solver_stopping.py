"""The solver stops when it is done: on a proven optimum or a closed gap, else at its limit.

The searches' own stall rules (forest restarts, a full pass of MILP windows) are checked on the
searches themselves; ``solve`` goes on past them until its deadline. These tests check why and
after how much work the searches stop (``stats["stop"]``, counts of restarts and windows, the
solver's own ``stats["elapsed"]``), never the test's wall clock.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from autoshard.solver import ShardingProblem, solve
from autoshard.solver.bp import MinSumBP
from autoshard.solver.forest import forest_ils, min_cost_choice
from autoshard.solver.lns import WindowSearch
from autoshard.solver.local import CoreState, FlatCosts
from autoshard.solver.reduce import Reduction

STOPS = ("optimal", "gap", "time_limit")


def _core(rng, n, edges, s) -> Reduction:
    """A core that is the problem itself (no reductions), for testing a search alone."""
    return Reduction(
        core_nodes=np.arange(n),
        alive=tuple(np.arange(s) for _ in range(n)),
        node_costs=tuple(rng.random(s) * 10 for _ in range(n)),
        edges=np.array(edges, dtype=np.int64).reshape(-1, 2),
        edge_costs=tuple(rng.random((s, s)) * 5 for _ in edges),
        node_memory=(None,) * n,
        base_usage=np.zeros(n),
        records=(),
        stats={},
    )


def _tree(n):
    return [(i // 2, i) for i in range(1, n)]


def _ladder(n):
    """Edges (i, i+1) and (i, i+2)."""
    return [(i, i + d) for d in (1, 2) for i in range(n - d)]


def _brute_force(red) -> float:
    flat = FlatCosts(red)
    return min(flat.cost(np.array(ch)) for ch in itertools.product(*(range(c.size) for c in red.node_costs)))


def test_small_problem_stops_on_the_proven_optimum():
    rng = np.random.default_rng(0)
    n, s = 12, 4
    edges = _ladder(n)
    p = ShardingProblem(node_costs=[rng.random(s) for _ in range(n)], edges=np.array(edges),
                        edge_costs=[rng.random((s, s)) for _ in edges])
    sol = solve(p, time_limit=60)
    assert sol.optimal and sol.stats["stop"] == "optimal"
    assert sol.stats["gap"] == 0.0 and sol.stats["bound"] == pytest.approx(sol.cost, rel=1e-9)
    assert "lns_windows" not in sol.stats  # no window search after a proof


def test_every_stop_reason_is_named():
    rng = np.random.default_rng(1)
    for n in (0, 1, 5):
        p = ShardingProblem(node_costs=[rng.random(3) for _ in range(n)], edges=np.zeros((0, 2)), edge_costs=())
        sol = solve(p, time_limit=5)
        assert sol.stats["stop"] == "optimal" and sol.optimal and sol.stats["gap"] == 0.0
    # time 0: no search at all
    edges = _ladder(30)
    p = ShardingProblem(node_costs=[rng.random(4) for _ in range(30)], edges=np.array(edges),
                        edge_costs=[rng.random((4, 4)) for _ in edges])
    sol = solve(p, time_limit=0)
    assert sol.stats["stop"] in STOPS and sol.feasible


def _big_memory_free(seed: int, n: int = 40, s: int = 64) -> ShardingProblem:
    """Over the full-MILP cell limit (112 edges of 64 x 64), no memory: belief propagation + forests."""
    rng = np.random.default_rng(seed)
    edges = [(i, i + d) for d in (1, 2, 5) for i in range(n - d)]
    return ShardingProblem(node_costs=[rng.random(s) for _ in range(n)], edges=np.array(edges),
                           edge_costs=[rng.random((s, s)) for _ in edges])


def test_large_memory_free_search_uses_the_whole_limit():
    """The searches after belief propagation go on to the deadline: no proof, so no early stop. (Whether MILP
    windows follow the forest descents within the limit depends on the machine's load: not asserted.)"""
    p = _big_memory_free(0)
    limit = 2.0
    sol = solve(p, time_limit=limit, seed=3, workers=1)
    assert sol.stats["stop"] == "time_limit" and not sol.optimal
    assert sol.stats["core_cells"] > 400_000  # the large memory-free path
    assert sol.stats["forest_rounds"] >= 1
    # by the solver's own clock: the limit used, not overrun
    assert limit - 0.5 <= sol.stats["elapsed"] <= 2 * limit + 1.0  # generous above: load delays the last step
    # belief propagation's dual bound comes with the answer
    assert 0.0 <= sol.stats["bound"] <= sol.cost and 0.0 <= sol.stats["gap"] <= 1.0


def test_forest_restarts_on_a_tree_stop_after_the_stall_count():
    """On a tree the first descent is exact, so no restart can gain: exactly ``stall`` run."""
    rng = np.random.default_rng(2)
    red = _core(rng, 9, _tree(9), 3)
    start = CoreState(red, None, min_cost_choice(red))
    found = forest_ils(start, time.perf_counter() + 120, seed=0, stall=4)
    assert found.stalled and found.restarts == 4
    assert found.state.total_cost() == pytest.approx(_brute_force(red))


def test_forest_restarts_without_a_stall_rule_use_the_deadline():
    rng = np.random.default_rng(2)
    red = _core(rng, 9, _tree(9), 3)
    found = forest_ils(CoreState(red, None, min_cost_choice(red)), time.perf_counter() + 1.0, seed=0)
    assert not found.stalled and found.restarts > 4


def test_window_search_stops_after_a_full_pass_without_gain():
    rng = np.random.default_rng(4)
    n = 40
    red = _core(rng, n, _ladder(n), 4)
    state = CoreState(red, None, min_cost_choice(red))
    whole = WindowSearch(state, seed=0)
    whole.run(time.perf_counter() + 120, window_size=n, window_time=30)
    # one window is the whole core: solved to optimality, it proves the choice optimal
    assert whole.proven and whole.windows == 1
    best = state.total_cost()
    search = WindowSearch(state, seed=1)
    search.run(time.perf_counter() + 120, window_size=8, window_time=30)
    assert search.stalled and search.improved == 0
    assert search.windows <= 60  # covering 40 nodes with 8-node windows, not the 120 s deadline
    assert state.total_cost() == best


def test_window_search_result_matches_brute_force_on_a_small_core():
    rng = np.random.default_rng(5)
    red = _core(rng, 8, _ladder(8), 3)
    state = CoreState(red, None, min_cost_choice(red))
    search = WindowSearch(state, seed=0)
    search.run(time.perf_counter() + 120, window_size=8, window_time=30)
    assert search.proven  # the window held the whole core
    assert state.total_cost() == pytest.approx(_brute_force(red))


def test_belief_propagation_stops_once_its_messages_settle():
    rng = np.random.default_rng(6)
    red = _core(rng, 9, _tree(9), 3)
    bp = MinSumBP(red)
    _, cost = bp.run(time.perf_counter() + 120, max_rounds=500, tol=1e-4)
    assert bp.rounds < 500
    assert cost == pytest.approx(_brute_force(red))  # exact on trees


def test_planner_solve_stops_before_its_limit():
    """A small GPT's plan is solved to a stop of the solver's own, not to the time limit."""
    import autoshard
    from benchmarks.models import get_model

    spec = get_model("gpt", "tiny", 8)
    step = autoshard.parallelize(spec.train_step, mesh=autoshard.make_mesh((2, 4), ("data", "model")),
                                 solver_time_limit=120, progress=None)
    plan = step.plan(spec.abstract_state(), spec.abstract_batch())
    assert plan.stats["solver"]["stop"] in ("optimal", "gap")


@pytest.mark.parametrize("unit", [1e-9, 1e-4, 1e14])
def test_costs_of_any_magnitude_are_proven_optimal(unit):
    """Costs in seconds (a planner's, 1e-14 to 1e-3) sit below HiGHS's absolute tolerances; the solver
    scales them by a power of two first, so the answer is the brute-force optimum, proven, and its cost,
    bound and gap are in the problem's own units."""
    from autoshard.solver.solve import cost_scale

    rng = np.random.default_rng(7)
    n, s = 8, 4
    edges = [(i, i + d) for d in (1, 2, 3) for i in range(n - d)]  # dense enough that a core is left
    # log-uniform over four decades, as a planner's compute and resharding costs are
    node = [unit * 10.0 ** rng.uniform(-4, 0, s) for _ in range(n)]
    edge = [unit * 10.0 ** rng.uniform(-4, 0, (s, s)) for _ in edges]
    p = ShardingProblem(node_costs=node, edges=np.array(edges), edge_costs=edge)
    sol = solve(p, time_limit=60, workers=1)
    every = np.array(list(itertools.product(range(s), repeat=n)))
    costs = sum(c[every[:, i]] for i, c in enumerate(node))
    costs = costs + sum(m[every[:, u], every[:, v]] for (u, v), m in zip(edges, edge))
    assert sol.stats["core_nodes"] > 0  # the MILP ran, not the reductions alone
    assert sol.optimal and sol.stats["stop"] in ("optimal", "gap")
    assert sol.cost == pytest.approx(costs.min(), rel=1e-9)
    assert sol.stats["bound"] <= sol.cost * (1 + 1e-9) and sol.stats["gap"] <= 1e-6
    if unit != 1e14:
        assert sol.stats["cost_scale"] == cost_scale(p) > 1.0
