"""Memory-penalised search: guarded descents stay feasible and never get worse."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from autoshard.solver.local import CoreState, FlatCosts, min_memory_choice, recosted
from autoshard.solver.memory import MemoryRows, range_max
from autoshard.solver.penalty import guarded_descent
from autoshard.solver.reduce import Reduction


def _memory_core(rng, n=60, s=4, points=30):
    """A random core with memory rows whose least-memory choice fits."""
    node_costs = tuple(rng.random(s) * 10 for _ in range(n))
    edges = [(int(rng.integers(i)), i) for i in range(1, n)] + [(0, n - 1), (3, n // 2)]
    mats = tuple(rng.random((s, s)) * 5 for _ in edges)
    memory = tuple(rng.integers(1, 10, s).astype(np.float64) for _ in range(n))
    lo = rng.integers(0, points - 1, n)
    hi = np.minimum(lo + rng.integers(1, 8, n), points)
    red = Reduction(
        core_nodes=np.arange(n),
        alive=tuple(np.arange(s) for _ in range(n)),
        node_costs=node_costs,
        edges=np.array(edges, dtype=np.int64),
        edge_costs=mats,
        node_memory=memory,
        base_usage=np.zeros(n),
        records=(),
        stats={},
    )
    rows = MemoryRows(base=np.zeros(points), limit=0.0, lo=lo, hi=hi)
    least = rows.usage(memory, min_memory_choice(red))
    rows = dataclasses.replace(rows, limit=float(least.max()) * 1.3)
    return red, rows


@pytest.mark.parametrize("seed", range(4))
def test_guarded_descent_stays_feasible_and_never_worse(seed):
    red, rows = _memory_core(np.random.default_rng(seed))
    start = CoreState(red, rows, min_memory_choice(red))
    assert start.overflow() <= 0
    before = start.total_cost()
    out = guarded_descent(start, time.perf_counter() + 2.0, seed)
    assert out.overflow() <= 0
    assert out.total_cost() <= before
    assert out.total_cost() == pytest.approx(CoreState(red, rows, out.choice).total_cost())


def test_guarded_descent_returns_an_infeasible_start_unchanged():
    red, rows = _memory_core(np.random.default_rng(0))
    rows = dataclasses.replace(rows, limit=0.0)
    start = CoreState(red, rows, min_memory_choice(red))
    assert guarded_descent(start, time.perf_counter() + 1.0, 0) is start


def test_range_max_matches_slices():
    rng = np.random.default_rng(0)
    values = rng.random(257)
    lo = rng.integers(0, 257, 400)
    hi = np.minimum(lo + rng.integers(0, 100, 400), 257)
    want = [values[a:b].max() if b > a else 0.0 for a, b in zip(lo, hi, strict=True)]
    np.testing.assert_allclose(range_max(values, lo, hi), want)


def test_bracketing_stops_before_the_penalty_overflows():
    """An attempt that never fits used to double the exponent until 2.0**e raised OverflowError."""
    from autoshard.solver.penalty import MAX_EXPONENT, bracket_and_bisect

    tried = []

    def attempt(e):
        tried.append(e)
        2.0**e  # what the real attempts compute
        return False

    bracket_and_bisect(attempt, lambda: True, 0.0, 2.0, 0.1)
    assert tried and max(abs(e) for e in tried) <= MAX_EXPONENT


@pytest.mark.parametrize("seed", range(3))
def test_repair_makes_the_cheapest_choice_fit(seed):
    """Every node at its cheapest strategy overflows the limit; the repair moves nodes until it fits."""
    red, rows = _memory_core(np.random.default_rng(seed))
    state = CoreState(red, rows, np.array([int(np.argmin(c)) for c in red.node_costs]))
    assert state.overflow() > 0
    assert state.repair(time.perf_counter() + 60)
    assert state.overflow() <= 0
    np.testing.assert_allclose(state.usage, rows.usage(red.node_memory, state.choice))


def test_repair_saves_memory_where_it_costs_least():
    """Two nodes live at one point over the limit: the one whose byte costs less moves."""
    red = Reduction(core_nodes=np.arange(2), alive=(np.arange(2), np.arange(2)),
                    node_costs=(np.array([0.0, 10.0]), np.array([0.0, 1.0])), edges=np.zeros((0, 2), np.int64),
                    edge_costs=(), node_memory=(np.array([5.0, 1.0]), np.array([5.0, 1.0])),
                    base_usage=np.zeros(2), records=(), stats={})
    rows = MemoryRows(base=np.zeros(1), limit=6.0, lo=np.zeros(2, np.int64), hi=np.ones(2, np.int64))
    state = CoreState(red, rows, np.zeros(2, np.int64))
    assert state.repair(time.perf_counter() + 10)
    assert state.choice.tolist() == [0, 1]


def test_a_repaired_start_fits_without_forbidden_pairs():
    from autoshard.solver.penalty import repaired_start, soften, violations

    red, rows = _memory_core(np.random.default_rng(5))
    # neighbours must agree on layouts {0, 1} or {2, 3}: forbidden pairs the repair may take
    group = np.arange(4) < 2
    mats = tuple(np.where(np.equal.outer(group, group), m, np.inf) for m in red.edge_costs)
    red = soften(dataclasses.replace(red, edge_costs=mats))
    # room for the least memory within {0, 1}, so that something without forbidden pairs fits
    agreeing = np.array([int(np.argmin(np.where(group, m, np.inf))) for m in red.node_memory])
    rows = dataclasses.replace(rows, limit=1.05 * float(rows.usage(red.node_memory, agreeing).max()))
    cheapest = CoreState(red, rows, np.array([int(np.argmin(c)) for c in red.node_costs]))
    assert cheapest.overflow() > 0 and len(violations(cheapest))
    out = repaired_start(cheapest, time.perf_counter() + 60, 0)
    assert out is not None and out.overflow() <= 0 and not len(violations(out))
    assert out.total_cost() == pytest.approx(CoreState(red, rows, out.choice).total_cost())


@pytest.mark.parametrize("seed", range(3))
def test_least_memory_choice_takes_least_usage_then_cost_then_index(seed):
    rng = np.random.default_rng(50 + seed)
    red, _ = _memory_core(rng, n=40, s=5)
    # integer-valued usage and cost, so that ties are common; a third of the nodes without memory
    memory = tuple(None if k % 3 == 0 else rng.integers(0, 3, 5).astype(np.float64) for k in range(40))
    costs = tuple(rng.integers(0, 3, 5).astype(np.float64) for _ in range(40))
    red = dataclasses.replace(red, node_memory=memory, node_costs=costs)
    expected = []
    for c, m in zip(costs, memory, strict=True):
        key = [(0.0 if m is None else m[s], c[s], s) for s in range(5)]
        expected.append(min(key)[2])
    assert min_memory_choice(red).tolist() == expected


def test_recosted_core_prices_every_choice_like_a_core_built_from_arrays():
    rng = np.random.default_rng(9)
    red, rows = _memory_core(rng)
    flat = FlatCosts(red)
    values = rng.random(flat.values.size)
    new = recosted(red, values)
    sizes = [c.size for c in red.node_costs]
    built = dataclasses.replace(
        red,
        node_costs=tuple(np.array(c) for c in new.node_costs),
        edge_costs=tuple(np.array(m) for m in new.edge_costs),
    )
    assert [c.size for c in new.node_costs] == sizes
    assert [m.shape for m in new.edge_costs] == [m.shape for m in red.edge_costs]
    for _ in range(20):
        choice = np.array([rng.integers(s) for s in sizes])
        assert CoreState(new, rows, choice).total_cost() == pytest.approx(FlatCosts(built).cost(choice), rel=1e-12)
    with pytest.raises(ValueError, match="float64 values"):
        recosted(red, values[:-1])


@pytest.mark.parametrize("seed", range(4))
def test_a_fitted_choice_has_no_single_move_that_fits_and_saves(seed):
    """:func:`fitted` repairs (many moves a pass, priced before any is made), clears forbidden pairs, then
    takes single-node moves that keep the fit: no node can then move to a fitting strategy that costs less,
    and the answer is never costlier than the repair's own."""
    from autoshard.solver.penalty import clear_forbidden, fitted, violations

    red, rows = _memory_core(np.random.default_rng(seed), n=80, s=6)
    cheapest = CoreState(red, rows, np.array([int(np.argmin(c)) for c in red.node_costs]))
    assert cheapest.overflow() > 0
    out = fitted(cheapest, time.perf_counter() + 60, seed)
    assert out is not None and out.overflow() <= 0 and not len(violations(out))
    for k in range(red.num_core):
        local, ok = out.local_cost(k), out.fits(k)
        assert local[ok].min() >= local[out.choice[k]] - 1e-9 * (1 + abs(local[out.choice[k]]))
    repaired = CoreState(red, rows, cheapest.choice)
    assert repaired.repair(time.perf_counter() + 60)
    repaired = clear_forbidden(repaired, time.perf_counter() + 60, seed)
    assert out.total_cost() <= repaired.total_cost() + 1e-9


def test_gentle_descent_gives_up_when_nothing_fits():
    """With the gentle steps, forest rounds that find no fit stop after ``fit_within`` rounds (the time goes to
    the searches after them); with the default steps they run on to the deadline while nothing fits."""
    from autoshard.solver.penalty import GENTLE_STEPS, lagrangian_descent

    red, rows = _memory_core(np.random.default_rng(0))
    rows = dataclasses.replace(rows, limit=0.0)  # nothing fits
    start = np.array([int(np.argmin(c)) for c in red.node_costs])
    lines: list[str] = []
    found = lagrangian_descent(red, rows, start, lam=1.0, deadline=time.perf_counter() + 600, seed=0,
                               log=lines.append, steps=GENTLE_STEPS)
    assert found is None
    assert lines == [f"lagrangian descent: {GENTLE_STEPS.fit_within} rounds, best fit inf"]
