"""Min-sum belief propagation: exact on trees, and the memory-priced search it drives."""

from __future__ import annotations

import itertools
import time
import tracemalloc

import numpy as np
import pytest

from autoshard.solver.bp import MinSumBP
from autoshard.solver.local import CoreState, FlatCosts
from autoshard.solver.penalty import lagrangian_bp
from autoshard.solver.reduce import Reduction
from tests.test_solver_penalty import _memory_core


def _core(rng, n, edges, sizes):
    return Reduction(
        core_nodes=np.arange(n),
        alive=tuple(np.arange(s) for s in sizes),
        node_costs=tuple(rng.random(s) * 10 for s in sizes),
        edges=np.array(edges, dtype=np.int64).reshape(-1, 2),
        edge_costs=tuple(rng.random((sizes[u], sizes[v])) * 5 for u, v in edges),
        node_memory=(None,) * n,
        base_usage=np.zeros(n),
        records=(),
        stats={},
    )


def _brute_force(red):
    flat = FlatCosts(red)
    sizes = [c.size for c in red.node_costs]
    return min(flat.cost(np.array(ch)) for ch in itertools.product(*(range(s) for s in sizes)))


@pytest.mark.parametrize("seed", range(6))
def test_exact_on_trees(seed):
    rng = np.random.default_rng(seed)
    n = 7
    sizes = [int(s) for s in rng.integers(2, 5, n)]
    edges = [(int(rng.integers(i)), i) for i in range(1, n)]
    red = _core(rng, n, edges, sizes)
    choice, cost = MinSumBP(red, damping=0.0).run(time.perf_counter() + 10, max_rounds=2 * n)
    assert cost == pytest.approx(_brute_force(red))
    assert cost == pytest.approx(FlatCosts(red).cost(choice))


def test_one_wide_node_does_not_pad_every_node():
    """A core of small nodes and one very wide one (contest S: 25,872 nodes, one of 853
    strategies) costs memory by the cells it has: padding every node to the widest made
    the bound's set-up and belief passes take longer than an 8 s limit on S."""
    rng = np.random.default_rng(7)
    n, wide = 4000, 1000
    sizes = [2] * n
    sizes[n // 2] = wide
    edges = [(i, i + 1) for i in range(n - 1)]
    red = _core(rng, n, edges, sizes)
    cells = sum(sizes) + sum(m.size for m in red.edge_costs)
    tracemalloc.start()
    try:
        bp = MinSumBP(red)
        for _ in range(2):
            bp.step(bp.beliefs())
        bound = bp.lower_bound()
        choice = bp.decode()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    padded = n * wide * 8
    assert peak < padded / 4, (peak, padded)
    assert peak < 40 * cells * 8, (peak, cells)
    assert bound <= FlatCosts(red).cost(choice)
    assert [int(c) < s for c, s in zip(choice, sizes, strict=True)] == [True] * n


@pytest.mark.parametrize("seed", range(4))
def test_close_to_optimal_on_small_loopy_graphs(seed):
    rng = np.random.default_rng(100 + seed)
    n = 8
    sizes = [3] * n
    edges = [(i, i + 1) for i in range(n - 1)] + [(0, n - 1), (1, 5)]
    red = _core(rng, n, edges, sizes)
    _, cost = MinSumBP(red).run(time.perf_counter() + 10, max_rounds=50)
    best = _brute_force(red)
    assert best <= cost <= 1.25 * best


def test_lagrangian_bp_returns_a_fitting_choice():
    red, rows = _memory_core(np.random.default_rng(3))
    state = lagrangian_bp(red, rows, 1e-3, time.perf_counter() + 2.0)
    assert state is not None
    assert state.overflow() <= 0
    assert np.isfinite(state.total_cost())
    assert state.total_cost() == pytest.approx(CoreState(red, rows, state.choice).total_cost())
