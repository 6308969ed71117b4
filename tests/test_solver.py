"""Solver tests: edge cases, typed errors, and brute force on small random problems."""

from __future__ import annotations

import gzip
import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoshard.errors import InfeasibleError, ProblemFormatError
from autoshard.solver import ShardingProblem, solve
from autoshard.solver.iopddl import read_iopddl
from autoshard.solver.reduce import reduce_problem


def brute_force(p: ShardingProblem):
    """(best feasible cost, least peak over finite-cost choices)."""
    best, least_peak = np.inf, np.inf
    for ch in itertools.product(*[range(c.size) for c in p.node_costs]):
        cost = p.cost(ch)
        if not np.isfinite(cost):
            continue
        least_peak = min(least_peak, p.peak_memory(ch))
        if p.is_feasible(ch):
            best = min(best, cost)
    return best, least_peak


@st.composite
def small_problems(draw, memory: bool):
    n = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    cost = st.sampled_from([0.0, 1.0, 2.0, 3.0, 5.0, 8.0, np.inf])
    node_costs = [np.array(draw(st.lists(cost, min_size=s, max_size=s))) for s in sizes]
    pairs = [(u, v) for u in range(n) for v in range(n) if u != v]
    edges = draw(st.lists(st.sampled_from(pairs), max_size=8)) if pairs else []
    edge_costs = [np.array(draw(st.lists(cost, min_size=sizes[u] * sizes[v], max_size=sizes[u] * sizes[v])))
                  .reshape(sizes[u], sizes[v]) for u, v in edges]
    kw = {}
    if memory:
        use = st.integers(0, 6).map(float)
        kw["node_memory"] = [np.array(draw(st.lists(use, min_size=s, max_size=s))) for s in sizes]
        starts = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
        lengths = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
        kw["intervals"] = np.array([[a, a + b] for a, b in zip(starts, lengths, strict=True)])
        kw["memory_limit"] = float(draw(st.integers(0, 20)))
    return ShardingProblem(node_costs=node_costs, edges=np.array(edges).reshape(-1, 2), edge_costs=edge_costs, **kw)


def check_against_brute_force(p: ShardingProblem) -> None:
    best, least_peak = brute_force(p)
    try:
        sol = solve(p, time_limit=20)
    except InfeasibleError as e:
        assert not np.isfinite(best)
        if np.isfinite(least_peak):  # finite-cost choices exist: memory is to blame
            assert e.smallest_memory == pytest.approx(least_peak)
        return
    assert sol.feasible and sol.optimal and sol.stats["stop"] in ("optimal", "gap")
    assert sol.cost == pytest.approx(best)
    assert sol.stats["bound"] <= sol.cost and sol.stats["gap"] <= 1e-6
    assert sol.cost == p.cost(sol.choice)
    assert sol.peak_memory == p.peak_memory(sol.choice)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_problems(memory=False))
def test_matches_brute_force(p):
    check_against_brute_force(p)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_problems(memory=True))
def test_matches_brute_force_with_memory(p):
    check_against_brute_force(p)


@pytest.mark.parametrize("stop", ["never", "at once"])
@settings(max_examples=100, deadline=None)
@given(small_problems(memory=True))
def test_reductions_keep_the_optimum(stop, p):
    """Expanding the reduced core's best choice gives the original optimum (also when stopped early)."""
    best, _ = brute_force(p)
    try:
        red = reduce_problem(p, with_memory=True, deadline=None if stop == "never" else 0.0)
    except InfeasibleError:
        assert not np.isfinite(best)
        return
    core_best = np.inf
    for core in itertools.product(*[range(a.size) for a in red.alive]):
        ch = red.expand(np.array(core, dtype=np.int64), p.num_nodes)
        if p.is_feasible(ch):
            core_best = min(core_best, p.cost(ch))
    assert core_best == pytest.approx(best) if np.isfinite(best) else not np.isfinite(core_best)


@pytest.mark.parametrize("seed", range(4))
def test_reductions_keep_the_optimum_of_a_large_star(seed):
    """A hub of 40 strategies, half of them no better than the other half, with 30 leaves of 3 strategies
    (large enough for the dominance check's filtered comparison): the expanded choice is optimal."""
    rng = np.random.default_rng(seed)
    hub, leaves, size = 40, 30, 3
    rows = rng.integers(0, 4, size=(hub // 2, leaves * size)).astype(float)
    rows[rng.random(rows.shape) < 0.2] = np.inf
    hub_rows = np.vstack([rows, rows + rng.integers(0, 2, size=rows.shape)])
    node_costs = [rng.integers(0, 3, size=hub).astype(float)]
    node_costs += [rng.integers(0, 3, size=size).astype(float) for _ in range(leaves)]
    edge_costs = [hub_rows[:, k * size:(k + 1) * size] for k in range(leaves)]
    p = ShardingProblem(node_costs=node_costs, edges=np.array([(0, 1 + k) for k in range(leaves)]), edge_costs=edge_costs)
    best = min(node_costs[0][h] + sum(np.min(node_costs[1 + k] + edge_costs[k][h]) for k in range(leaves))
               for h in range(hub))
    red = reduce_problem(p, with_memory=False)
    assert red.stats["dominated"] > 0 and red.stats["leaf"] == leaves
    core_best = min(p.cost(red.expand(np.array(core, dtype=np.int64), p.num_nodes))
                    for core in itertools.product(*[range(a.size) for a in red.alive]))
    assert core_best == best


def test_empty_problem():
    sol = solve(ShardingProblem(node_costs=(), edges=np.zeros((0, 2)), edge_costs=()))
    assert sol.choice.shape == (0,) and sol.cost == 0.0 and sol.feasible


def test_single_strategy_node():
    sol = solve(ShardingProblem(node_costs=(np.array([7.0]),), edges=np.zeros((0, 2)), edge_costs=()))
    assert sol.choice.tolist() == [0] and sol.cost == 7.0 and sol.optimal


def test_all_infinite_node_is_named():
    p = ShardingProblem(
        node_costs=(np.array([1.0, 2.0]), np.array([np.inf, np.inf])),
        edges=np.array([[0, 1]]),
        edge_costs=(np.zeros((2, 2)),),
        node_names=("matmul", "reshape"),
    )
    with pytest.raises(InfeasibleError, match=r"node 1 \(reshape\).*infinite cost"):
        solve(p)


def test_memory_limit_below_smallest_usage():
    p = ShardingProblem(
        node_costs=(np.array([1.0, 5.0]), np.array([1.0, 2.0])),
        edges=np.array([[0, 1]]),
        edge_costs=(np.array([[0.0, 1.0], [1.0, 0.0]]),),
        node_memory=(np.array([4.0, 3.0]), np.array([6.0, 2.0])),
        intervals=np.array([[0, 2], [1, 3]]),
        memory_limit=4.0,
    )
    with pytest.raises(InfeasibleError, match="peak usage 5") as info:
        solve(p)
    assert info.value.smallest_memory == 5.0


def test_a_limit_below_every_nodes_least_usage_is_refused_without_a_search(monkeypatch):
    """Usage adds up node by node: with each node at its least usage over the limit, no choice fits, and the
    solver says so at once with that peak (the least one: that choice's cost is finite), searching nothing."""
    solve_module = sys.modules["autoshard.solver.solve"]  # the package's ``solve`` names the function

    def no_search(*args, **kwargs):
        raise AssertionError("searched a problem that no choice fits")

    monkeypatch.setattr(solve_module, "search_core", no_search)
    monkeypatch.setattr(solve_module, "search_in_workers", no_search)
    rng = np.random.default_rng(1)
    n = 400
    p = ShardingProblem(
        node_costs=tuple(rng.random(3) for _ in range(n)),
        edges=np.array([[i, i + 1] for i in range(n - 1)]),
        edge_costs=tuple(rng.random((3, 3)) for _ in range(n - 1)),
        node_memory=tuple(np.array([5.0, 2.0, 3.0]) for _ in range(n)),
        intervals=np.array([[i, i + 3] for i in range(n)]),
        memory_limit=5.0,
    )
    least = p.peak_memory(np.ones(n, dtype=np.int64))
    assert least == 6.0
    with pytest.raises(InfeasibleError, match="below the smallest peak usage 6 ") as info:
        solve(p, time_limit=30)
    assert info.value.smallest_memory == least


def test_timeout_zero_gives_an_answer():
    rng = np.random.default_rng(0)
    n = 200
    p = ShardingProblem(
        node_costs=[rng.random(4) for _ in range(n)],
        edges=[(i, (i * 7 + 3) % n) for i in range(n) if i != (i * 7 + 3) % n],
        edge_costs=[rng.random((4, 4)) for i in range(n) if i != (i * 7 + 3) % n],
    )
    sol = solve(p, time_limit=0)
    assert sol.choice.shape == (n,) and sol.cost == p.cost(sol.choice) and sol.feasible


def _write_tiny(path, problem=None):
    data = problem or {
        "problem": {
            "name": "tiny",
            "nodes": {"costs": [[10, 1], [5, 5]], "usages": [[1, 2], [1, 1]], "intervals": [[0, 2], [1, 3]]},
            "edges": {"nodes": [[0, 1]], "costs": [[0, 1, 100, 1e18]]},
            "usage_limit": 5,
        }
    }
    with gzip.open(path, "wt") as f:
        json.dump(data, f)


def test_reads_contest_json(tmp_path):
    path = tmp_path / "tiny.json.gz"
    _write_tiny(path)
    p = read_iopddl(path)
    assert p.num_nodes == 2 and p.memory_limit == 5 and np.isinf(p.edge_costs[0][1, 1])
    sol = solve(p)
    assert sol.choice.tolist() == [0, 0] and sol.cost == 15.0


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["problem"].pop("edges"), r"problem\.edges"),
        (lambda d: d["problem"]["nodes"].pop("costs"), r"problem\.nodes\.costs"),
        (lambda d: d["problem"]["nodes"]["costs"].__setitem__(1, "x"), r"problem\.nodes\.costs\[1\]"),
        (lambda d: d["problem"]["edges"]["costs"].__setitem__(0, [1, 2, 3]), r"problem\.edges\.costs\[0\]"),
        (lambda d: d["problem"]["nodes"]["usages"].pop(), r"problem\.nodes\.usages"),
    ],
)
def test_malformed_json_names_the_field(tmp_path, mutate, field):
    data = {
        "problem": {
            "nodes": {"costs": [[1, 2], [3]], "usages": [[1, 1], [1]], "intervals": [[0, 1], [0, 1]]},
            "edges": {"nodes": [[0, 1]], "costs": [[0, 0]]},
            "usage_limit": 5,
        }
    }
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProblemFormatError, match=field):
        read_iopddl(path)


def test_not_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{nope")
    with pytest.raises(ProblemFormatError, match="not a JSON"):
        read_iopddl(path)


@pytest.mark.parametrize("timeout", ["0", "2"])
def test_command_line_prints_choice_last(tmp_path, timeout):
    path = tmp_path / "tiny.json.gz"
    _write_tiny(path)
    out = subprocess.run(
        [sys.executable, "-m", "autoshard.solver", str(path), timeout],
        capture_output=True, text=True, check=True, timeout=60,
    )
    assert out.stdout.strip().splitlines()[-1] == "[0, 0]"


@pytest.mark.slow
def test_contest_problem_b_reaches_best_known():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "shared" / "iopddl" / "asplos-2025-iopddl-B.json.gz"
    if not path.exists():
        pytest.skip(f"{path} not present")
    sol = solve(read_iopddl(path), time_limit=60)
    assert sol.feasible and sol.cost <= 532843 * 1.01


def test_windows_next_to_forbidden_pairs_at_a_short_limit():
    """Contest B at 5 s reaches the MILP windows with forbidden (infinite) pairs at fixed
    neighbours; HiGHS takes finite costs only (this used to raise ValueError)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "shared" / "iopddl" / "asplos-2025-iopddl-B.json.gz"
    if not path.exists():
        pytest.skip(f"{path} not present")
    p = read_iopddl(path)
    sol = solve(p, time_limit=5)
    assert sol.feasible and np.isfinite(sol.cost) and sol.cost == pytest.approx(p.cost(sol.choice))


def test_group_matrix_groups_identical_rows_and_columns_in_sorted_order():
    """The MILP's edge groups: ``m == r[rows][:, cols]``, numbered as ``np.unique`` numbers the distinct
    rows and columns (infinite cells included)."""
    from autoshard.solver.milp import group_matrix

    rng = np.random.default_rng(0)
    for _ in range(50):
        base = rng.integers(0, 3, size=(4, 4)).astype(float)
        base[0, 1] = np.inf
        m = base[np.ix_(rng.integers(0, 4, size=rng.integers(1, 12)), rng.integers(0, 4, size=rng.integers(1, 12)))]
        r, rows, cols = group_matrix(m)
        np.testing.assert_array_equal(r[np.ix_(rows, cols)], m)
        np.testing.assert_array_equal(rows, np.unique(m, axis=0, return_inverse=True)[1].reshape(-1))
        np.testing.assert_array_equal(cols, np.unique(m, axis=1, return_inverse=True)[1].reshape(-1))


def _clique(agree: bool) -> ShardingProblem:
    """Four nodes of two strategies, each pair joined by an edge that costs 1 unless its ends agree
    (``agree``) or unless they differ."""
    m = np.array([[0.0, 1.0], [1.0, 0.0]]) if agree else np.array([[1.0, 0.0], [0.0, 1.0]])
    edges = np.array([[u, v] for u in range(4) for v in range(u + 1, 4)])
    node_costs = (np.array([0.0, 0.1]), np.array([0.1, 0.0]), np.array([0.0, 0.3]), np.array([0.1, 0.0]))
    return ShardingProblem(node_costs, edges, (m,) * len(edges))


@pytest.mark.parametrize("agree", [True, False])
def test_milp_relaxation_first_answers_only_when_integral(agree):
    """Where neighbours want to agree the LP relaxation is integral and is the answer; where every pair wants
    to differ it is fractional (each node half and half), and the MILP finds the integral optimum."""
    from autoshard.solver.milp import solve_milp

    p = _clique(agree)
    red = reduce_problem(p, with_memory=False)
    assert red.num_core == 4
    best = min(p.cost(np.array(c)) for c in itertools.product(range(2), repeat=4))
    plain = solve_milp(red, None, time_limit=30)
    first = solve_milp(red, None, time_limit=30, relaxation_first=True)
    assert plain.status == first.status == "optimal"
    assert first.objective == pytest.approx(plain.objective) == pytest.approx(best)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_problems(memory=True))
def test_least_peak_relaxation_never_refuses_a_problem_that_fits(p):
    """The shortcut that calls a core infeasible from the least peak's LP relaxation is sound: whenever brute force
    finds a finite-cost choice within the limit, the relaxation's bound is within it too."""
    import time

    from autoshard.solver.solve import NoSharing, Search, core_memory_rows, peak_bound_over

    best, least_peak = brute_force(p)
    try:
        red = reduce_problem(p, with_memory=True, deadline=time.perf_counter() + 10)
    except InfeasibleError:  # no finite-cost choice at all
        return
    if not red.num_core:
        return
    search = Search(red, core_memory_rows(p, red), time.perf_counter() + 10, 0, lambda _: None, {}, NoSharing())
    if np.isfinite(best):
        assert not peak_bound_over(search)


def test_memory_limit_far_below_the_least_peak_is_refused_with_that_peak():
    """A chain whose every choice is over the limit: refused with the exact least peak (the relaxation's bound
    proves it; the least-peak MILP names it)."""
    n = 12
    p = ShardingProblem(
        node_costs=tuple(np.array([1.0, 3.0, 2.0]) for _ in range(n)),
        edges=np.array([[i, i + 1] for i in range(n - 1)]),
        edge_costs=tuple(np.array([[0.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]) for _ in range(n - 1)),
        node_memory=tuple(np.array([8.0, 2.0, 4.0]) for _ in range(n)),
        intervals=np.array([[i, i + 2] for i in range(n)]),
        memory_limit=3.0,
    )
    least = p.peak_memory(np.ones(n, dtype=np.int64))  # every node at its least memory
    assert least > p.memory_limit
    with pytest.raises(InfeasibleError, match=f"below the smallest peak usage {least:g}") as info:
        solve(p, time_limit=5, workers=1)
    assert info.value.smallest_memory == least
