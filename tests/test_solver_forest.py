"""Forest-DP search: exact on trees, monotone, within the time limit on planner-sized cores."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from autoshard.solver import ShardingProblem, solve
from autoshard.solver.forest import ForestSearch, forest_ils, min_cost_choice
from autoshard.solver.local import CoreState
from autoshard.solver.reduce import Reduction


def _core(node_costs, edges, edge_costs) -> Reduction:
    """A core that is the problem itself (no reductions), for testing the search alone."""
    n = len(node_costs)
    return Reduction(
        core_nodes=np.arange(n),
        alive=tuple(np.arange(c.size) for c in node_costs),
        node_costs=tuple(node_costs),
        edges=np.asarray(edges, dtype=np.int64).reshape(-1, 2),
        edge_costs=tuple(edge_costs),
        node_memory=(None,) * n,
        base_usage=np.zeros(n),
        records=(),
        stats={},
    )


def _random_tree(rng, n, s, extra_edges=0):
    node_costs = [rng.random(s) for _ in range(n)]
    edges = [(int(rng.integers(i)), i) for i in range(1, n)]
    while extra_edges:
        u, v = sorted(rng.choice(n, 2, replace=False).tolist())
        if (u, v) not in edges:
            edges.append((u, v))
            extra_edges -= 1
    mats = [rng.random((s, s)) * 2 for _ in edges]
    for m in mats[:3]:
        m[0, 1] = np.inf  # forbidden pairs are honoured
    return node_costs, edges, mats


def _brute(red: Reduction) -> float:
    best = np.inf
    for ch in itertools.product(*[range(c.size) for c in red.node_costs]):
        best = min(best, CoreState(red, None, np.array(ch)).total_cost())
    return best


@pytest.mark.parametrize("seed", range(5))
def test_one_forest_round_solves_a_tree_exactly(seed):
    rng = np.random.default_rng(seed)
    red = _core(*_random_tree(rng, 7, 3))
    state = CoreState(red, None, np.zeros(7, dtype=np.int64))
    search = ForestSearch(state, seed)
    search.solve_forest(search.forest(np.arange(7)))  # a tree: every node joins
    assert state.total_cost() == pytest.approx(_brute(red))


@pytest.mark.parametrize("seed", range(5))
def test_forest_descent_is_monotone_with_cycles(seed):
    rng = np.random.default_rng(seed)
    red = _core(*_random_tree(rng, 30, 4, extra_edges=25))
    state = CoreState(red, None, min_cost_choice(red))
    search = ForestSearch(state, seed)
    cost = state.total_cost()
    for _ in range(10):
        member = search.forest(search.rng.permutation(30))
        # the induced subgraph of the members has no cycle: edges < members
        inside = member[red.edges[:, 0]] & member[red.edges[:, 1]]
        assert inside.sum() < member.sum()
        search.solve_forest(member)
        new = state.total_cost()
        assert new <= cost + 1e-12
        cost = new


def test_forest_ils_never_ends_above_its_start():
    rng = np.random.default_rng(3)
    red = _core(*_random_tree(rng, 40, 4, extra_edges=40))
    start = CoreState(red, None, min_cost_choice(red))
    before = start.total_cost()
    best = forest_ils(start, time.perf_counter() + 0.3, seed=1).state
    assert best.total_cost() <= before and np.isfinite(best.total_cost())


def _planner_like(seed: int, n: int = 400, s: int = 30) -> ShardingProblem:
    """Dense resharding-style costs on a layered graph, too big for one MILP."""
    rng = np.random.default_rng(seed)
    edges = [(i, i + d) for d in (1, 2, 5) for i in range(n - d)]
    return ShardingProblem(
        node_costs=[rng.random(s) for _ in range(n)],
        edges=np.array(edges),
        edge_costs=[rng.random((s, s)) for _ in edges],
    )


@pytest.mark.parametrize("limit", [2.0, 3.0])
def test_stops_within_the_time_limit(limit):
    p = _planner_like(0)
    sol = solve(p, time_limit=limit, workers=1)
    # the solver's own deadline bookkeeping, not the test's wall clock (a loaded machine slows both)
    assert sol.stats["time_limit"] == limit and sol.stats["elapsed"] <= 2 * limit + 1.0  # not ignored
    assert sol.stats["stop"] == "time_limit" and sol.stats["elapsed"] >= limit - 0.5
    assert sol.feasible and sol.cost == pytest.approx(p.cost(sol.choice))
