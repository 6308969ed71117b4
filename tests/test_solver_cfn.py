"""toulbar2 on memory-free cores (``autoshard.solver.cfn``), and the memory-penalty bisection built on it.

Exactness is checked against brute force; bounds are checked to stay below the optimum; time is
never asserted on the test's clock.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np
import pytest

pytest.importorskip("pytoulbar2")

from autoshard.solver import (  # noqa: E402
    ShardingProblem,
    cfn,  # noqa: E402
    solve,
)
from autoshard.solver.local import CoreState, FlatCosts  # noqa: E402
from autoshard.solver.memory import memory_rows  # noqa: E402
from autoshard.solver.penalty import plain_scale, soften, violations  # noqa: E402
from autoshard.solver.reduce import Reduction, reduce_problem  # noqa: E402
from tests.helpers import with_binding_limit  # noqa: E402


def _core(seed: int, n: int, s: int, *, scale: float = 10.0, negative: bool = False, forbid: float = 0.0
          ) -> Reduction:
    """A loopy core taken as it is (edges (i, i+1) and (i, i+2)), random costs, some pairs forbidden."""
    rng = np.random.default_rng(seed)
    edges = [(i, i + d) for d in (1, 2) for i in range(n - d)]
    shift = 0.5 * scale if negative else 0.0
    mats = []
    for _ in edges:
        m = rng.random((s, s)) * scale - shift
        m[rng.random((s, s)) < forbid] = np.inf
        m[0, 0] = min(m[0, 0], scale)  # every core keeps a finite choice: all first strategies
        mats.append(m)
    return Reduction(core_nodes=np.arange(n), alive=tuple(np.arange(s) for _ in range(n)),
                     node_costs=tuple(rng.random(s) * scale - shift for _ in range(n)),
                     edges=np.array(edges, dtype=np.int64), edge_costs=tuple(mats),
                     node_memory=(None,) * n, base_usage=np.zeros(n), records=(), stats={})


def _optimum(red: Reduction) -> float:
    flat = FlatCosts(red)
    return min(flat.cost(np.array(ch)) for ch in itertools.product(*(range(c.size) for c in red.node_costs)))


@pytest.mark.parametrize(("seed", "scale", "negative", "forbid"),
                         [(0, 10.0, False, 0.0), (1, 1e-3, False, 0.2), (2, 5.0, True, 0.3), (3, 3e9, False, 0.1)])
def test_minimise_matches_brute_force(seed, scale, negative, forbid):
    """Planner-sized (1e-3 s) and contest-sized (1e9) costs, negative entries, forbidden pairs."""
    red = _core(seed, n=7, s=3, scale=scale, negative=negative, forbid=forbid)
    best = _optimum(red)
    found = cfn.minimise(red, _far())
    assert found is not None and found.choice is not None and found.proven
    cost = FlatCosts(red).cost(found.choice)
    assert cost == pytest.approx(best, rel=1e-9, abs=1e-12 * scale)
    assert found.bound <= best + 1e-12 * abs(best)
    assert found.bound >= best - 1e-9 * max(abs(best), scale)


def test_minimise_runs_the_default_search_whatever_ran_before():
    """pytoulbar2's options are global to the process: a solve elsewhere built for VNS does not carry over."""
    import pytoulbar2

    pytoulbar2.CFN(verbose=-1, vns=0)  # sets the process's search to decomposition-guided VNS
    red = _core(5, n=7, s=3)
    found = cfn.minimise(red, _far())
    option = pytoulbar2.tb2.option
    assert (option.searchMethod, option.lds, option.restart) == (0, 0, -1)
    assert found.proven
    assert FlatCosts(red).cost(found.choice) == pytest.approx(_optimum(red), rel=1e-9)


def test_priced_forbidden_pairs_stay_forbidden():
    """A :func:`soften`-ed core's priced pairs are hard again for toulbar2."""
    red = _core(4, n=8, s=4, forbid=0.4)
    soft = soften(red)
    found = cfn.minimise(soft, _far())
    assert not len(violations(CoreState(soft, None, found.choice)))
    assert FlatCosts(red).cost(found.choice) == pytest.approx(_optimum(red), rel=1e-9)


def test_free_bound_is_below_the_optimum_with_memory():
    problem = _memory_problem(5)
    red = reduce_problem(problem, with_memory=True)
    exact = solve(problem, time_limit=60, workers=1)
    assert exact.optimal
    bound = cfn.free_bound(red, _far())
    # the core's bound plus what the reductions fixed is at most the full optimum
    constant = exact.cost - CoreState(red, None, _core_choice(red, exact.choice)).total_cost()
    assert np.isfinite(bound) and bound + constant <= exact.cost * (1 + 1e-9)


def test_penalty_bisection_fits_and_posts_each_better_fit():
    problem = _memory_problem(6, n=60)
    red = reduce_problem(problem, with_memory=True)
    rows = memory_rows(problem.intervals, problem.memory_limit, red.core_nodes, red.base_usage, True)
    soft = soften(red)
    posted: list[float] = []
    stats: dict = {}
    best = cfn.penalty_bisection(soft, rows, _far(12.0), 0, log=lambda _: None,
                                 post=lambda st: posted.append(st.total_cost()), stats=stats)
    assert best is not None and best.overflow() <= 0 and not len(violations(best))
    assert posted and posted[-1] == best.total_cost() and posted == sorted(posted, reverse=True)
    assert stats["cfn_attempts"] >= 2
    choice = red.expand(best.choice, problem.num_nodes)
    assert problem.is_feasible(choice)
    exact = solve(problem, time_limit=60, workers=1)
    assert problem.cost(choice) >= exact.cost * (1 - 1e-9)


def test_solve_without_toulbar2_runs_the_other_searches(monkeypatch):
    """Without pytoulbar2 the memory-free large path starts from belief propagation, as before."""
    rng = np.random.default_rng(7)
    n, s = 40, 64
    edges = [(i, i + d) for d in (1, 2, 5) for i in range(n - d)]
    p = ShardingProblem(node_costs=[rng.random(s) for _ in range(n)], edges=np.array(edges),
                        edge_costs=[rng.random((s, s)) for _ in edges])
    monkeypatch.setattr(cfn, "available", lambda: False)
    sol = solve(p, time_limit=2.0, workers=1)
    assert sol.feasible and "bp_rounds" in sol.stats and "cfn_attempts" not in sol.stats


def test_a_toulbar2_that_answers_nothing_in_time_leaves_a_descended_answer(monkeypatch):
    """toulbar2 can take all of a short limit and more without a choice (Llama-3.1-70B's remat candidates, 8.9M
    cells: asked for 1 s, 1.5 s and nothing); the answer is then still a descent from the per-node argmins,
    not the argmins themselves (on this Potts-like grid they pay a mismatch on nearly every edge)."""
    rng = np.random.default_rng(3)
    rows, cols, s = 12, 12, 48
    at = {(r, c): r * cols + c for r in range(rows) for c in range(cols)}
    edges = [(at[r, c], at[r + dr, c + dc]) for (r, c) in at for dr, dc in ((0, 1), (1, 0))
             if (r + dr, c + dc) in at]
    mismatch = 100.0 * (1.0 - np.eye(s))
    p = ShardingProblem(node_costs=[rng.random(s) for _ in at], edges=np.array(edges),
                        edge_costs=[mismatch for _ in edges])
    argmins = np.array([int(np.argmin(c)) for c in p.node_costs])

    def nothing(red, deadline, *, seed=0):
        time.sleep(max(deadline - time.perf_counter(), 0.0) + 0.5)  # past its deadline, as it was seen to
        return cfn.CfnAnswer(None, -np.inf, False)

    monkeypatch.setattr(cfn, "minimise", nothing)
    # the descent stalls after ~20 rounds (~25 ms here); its share of the limit is ~0.55 s, so load does not cut it
    sol = solve(p, time_limit=2.0, workers=1)
    assert sol.stats["quick_rounds"] >= 1
    assert sol.cost < 0.5 * p.cost(argmins)


def _memory_problem(seed: int, n: int = 14) -> ShardingProblem:
    """A ladder with memory: cheap strategies use more, the limit binds."""
    rng = np.random.default_rng(seed)
    s = 4
    costs = [rng.random(s) * 10 for _ in range(n)]
    memory = [10.0 - c + rng.random(s) for c in costs]
    edges = [(i, i + d) for d in (1, 2) for i in range(n - d)]
    mats = [rng.random((s, s)) * 5 for _ in edges]
    intervals = np.stack([np.arange(n), np.arange(n) + rng.integers(2, 6, n)], axis=1)
    free = ShardingProblem(node_costs=costs, edges=np.array(edges), edge_costs=mats, node_memory=memory,
                           intervals=intervals)
    return with_binding_limit(free, 0.4)


def _core_choice(red: Reduction, choice: np.ndarray) -> np.ndarray:
    """The core-local indices of a full choice."""
    return np.array([int(np.searchsorted(red.alive[k], choice[i])) for k, i in enumerate(red.core_nodes)],
                    dtype=np.int64)


def _far(seconds: float = 30.0) -> float:
    return time.perf_counter() + seconds


def test_penalty_bisection_runs_on_to_give_up_while_nothing_fits():
    """With its own share spent before it starts, the bisection still searches until ``give_up`` for a fit."""
    problem = _memory_problem(8, n=30)
    red = reduce_problem(problem, with_memory=True)
    rows = memory_rows(problem.intervals, problem.memory_limit, red.core_nodes, red.base_usage, True)
    soft = soften(red)
    now = time.perf_counter()
    assert cfn.penalty_bisection(soft, rows, now, 0, log=lambda _: None) is None
    stats: dict = {}
    best = cfn.penalty_bisection(soft, rows, now, 0, log=lambda _: None, give_up=_far(8.0), stats=stats)
    assert best is not None and best.overflow() <= 0 and not len(violations(best))
    assert stats["cfn_attempts"] >= 1


def test_bisection_takes_quick_attempts_past_its_deadline():
    """While its attempts are quick, the bracket and bisection run on to ``give_up`` after a first fit (without
    that, they stop at the first fit once the deadline has passed)."""
    problem = _memory_problem(8, n=30)
    red = reduce_problem(problem, with_memory=True)
    rows = memory_rows(problem.intervals, problem.memory_limit, red.core_nodes, red.base_usage, True)
    soft = soften(red)
    runs = {}
    for quick in (0.1, 0.0):
        stats: dict = {}
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cfn, "_QUICK_ATTEMPT", quick)
            best = cfn.penalty_bisection(soft, rows, time.perf_counter(), 0, log=lambda _: None, give_up=_far(30.0),
                                         stats=stats)
        assert best is not None and best.overflow() <= 0
        runs[quick] = (stats["cfn_attempts"], best.total_cost())
    assert runs[0.0][0] == 1 < runs[0.1][0]
    assert runs[0.1][1] <= runs[0.0][1]


@pytest.mark.parametrize("proven", [True, False])
def test_attempts_after_an_unproven_answer_are_shorter(monkeypatch, proven):
    """toulbar2 often finds its answer early and spends the rest of an attempt failing to prove it: after an
    unproven answer the next attempt gets at most half its time (at least 2 s); proven answers leave the
    attempts their share. The time each attempt was granted is read off the deadline it was given."""
    problem = _memory_problem(8, n=30)
    red = reduce_problem(problem, with_memory=True)
    rows = memory_rows(problem.intervals, problem.memory_limit, red.core_nodes, red.base_usage, True)
    granted = []
    real = cfn.minimise

    def minimise(sub, deadline, *, seed=0):
        granted.append(deadline - time.perf_counter())
        found = real(sub, deadline, seed=seed)
        return found if proven or found is None else dataclasses.replace(found, proven=False)

    monkeypatch.setattr("autoshard.solver.cfn.minimise", minimise)
    best = cfn.penalty_bisection(soften(red), rows, _far(60.0), 0, log=lambda _: None)
    assert best is not None and best.overflow() <= 0
    assert len(granted) >= 3 and granted[0] > 10.0
    if proven:
        assert min(granted) > 10.0
    else:
        assert max(granted[1:]) <= 2.0


@pytest.mark.parametrize("probe", [True, False])
def test_a_short_window_starts_with_a_short_attempt(monkeypatch, probe):
    """With ``probe`` and less than one full attempt's time to ``give_up`` (the planner's budget solves in one
    process), the first attempt starts with a short one; when that finds nothing, the rest of the attempt goes
    to the same priced core. Without ``probe`` the first attempt has the whole window (here it finds nothing). Times are the deadlines
    given."""
    problem = _memory_problem(8, n=30)
    red = reduce_problem(problem, with_memory=True)
    rows = memory_rows(problem.intervals, problem.memory_limit, red.core_nodes, red.base_usage, True)
    granted, cores = [], []
    real = cfn.minimise

    def minimise(sub, deadline, *, seed=0):
        granted.append(deadline - time.perf_counter())
        cores.append(sub)
        return None if len(granted) == 1 else real(sub, deadline, seed=seed)

    monkeypatch.setattr("autoshard.solver.cfn.minimise", minimise)
    best = cfn.penalty_bisection(soften(red), rows, time.perf_counter(), 0, log=lambda _: None, give_up=_far(6.0),
                                 probe=probe)
    if probe:
        assert best is not None and best.overflow() <= 0
        assert granted[0] <= 0.35 * 6.0 and granted[1] > 3.0 and cores[1] is cores[0]
    else:
        assert best is None and len(granted) == 1 and granted[0] > 3.0


def test_a_price_that_found_nothing_is_asked_again(monkeypatch):
    """An attempt that found nothing in time says nothing about its price: the same price is asked again, with
    twice the window (the first is ``_LONGEST_ATTEMPT`` under a far deadline), before the bisection moves
    on."""
    soft, rows = _bisection_setup()
    granted = []
    real = cfn.minimise

    def minimise(sub, deadline, *, seed=0):
        granted.append(deadline - time.perf_counter())
        return None if len(granted) == 1 else real(sub, deadline, seed=seed)

    monkeypatch.setattr("autoshard.solver.cfn.minimise", minimise)
    lines: list[str] = []
    best = cfn.penalty_bisection(soft, rows, _far(600.0), 0, log=lines.append)
    assert best is not None and best.overflow() <= 0
    first, second = lines[1], lines[2]  # after "starting at"
    price = first.split(":")[0]
    assert "no answer in time" in first and second.startswith(f"{price} again: cost "), lines
    assert granted[1] >= 1.5 * granted[0]  # 60 s against 30 s: far from what the clock moves between them


def test_no_attempt_is_longer_than_the_longest_until_one_found_nothing(monkeypatch):
    """Every attempt's window is at most ``_LONGEST_ATTEMPT`` while each finds an answer, however far the
    deadline (the first price's share of a long limit only brackets the price)."""
    soft, rows = _bisection_setup()
    granted = []
    real = cfn.minimise

    def minimise(sub, deadline, *, seed=0):
        granted.append(deadline - time.perf_counter())
        return real(sub, deadline, seed=seed)

    monkeypatch.setattr("autoshard.solver.cfn.minimise", minimise)
    monkeypatch.setattr("autoshard.solver.cfn._LONGEST_ATTEMPT", 5.0)
    best = cfn.penalty_bisection(soft, rows, _far(600.0), 0, log=lambda _: None)
    assert best is not None and granted and max(granted) <= 5.0 + 1e-6


def _bisection_setup(seed: int = 8):
    problem = _memory_problem(seed, n=30)
    red = reduce_problem(problem, with_memory=True)
    rows = memory_rows(problem.intervals, problem.memory_limit, red.core_nodes, red.base_usage, True)
    return soften(red), rows


def test_learned_prices_stop_after_rounds_without_a_cheaper_fit(monkeypatch):
    """Rounds that never fit end the learned prices after ``_LEARNED_PATIENCE`` of them, however far the
    deadline."""
    from autoshard.solver.penalty import LagrangeFit

    soft, rows = _bisection_setup()
    calls = []

    def never_fits(red_, rows_, start, *, mult, deadline, seed, log=None, steps):
        calls.append(mult)
        return LagrangeFit(None, np.array(mult))

    monkeypatch.setattr("autoshard.solver.cfn.lagrangian_fit", never_fits)
    monkeypatch.setattr("autoshard.solver.cfn._LEARNED_PATIENCE", 2)
    cfn.penalty_bisection(soft, rows, _far(600.0), 0, log=lambda _: None)
    assert len(calls) == 2


@pytest.mark.parametrize("unit", [1.0, 2.0**-30])
def test_start_exponent_is_near_the_fitting_price_in_any_units(unit):
    """The bisection's first price follows the costs' units (seconds in the planner, integers in the contest):
    it is within a few doublings of the least price whose answer fits, where a fixed exponent is not."""
    base_problem = _memory_problem(9, n=24)
    problem = dataclasses.replace(base_problem, node_costs=[c * unit for c in base_problem.node_costs],
                                  edge_costs=[m * unit for m in base_problem.edge_costs])
    red = reduce_problem(problem, with_memory=True)
    rows = memory_rows(problem.intervals, problem.memory_limit, red.core_nodes, red.base_usage, True)
    soft = soften(red)
    base = plain_scale(soft)

    def fits(e: int) -> bool:
        sub = cfn.penalised_core(soft, base * 2.0**e)
        found = cfn.minimise(sub, _far())
        return CoreState(soft, rows, sub.expand(found.choice, soft.num_core)).overflow() <= 0

    fit = next(e for e in range(-80, 80) if fits(e))
    start = cfn.start_exponent(soft, rows)
    assert abs(start - fit) <= 6
    if unit != 1.0:
        assert abs(12 - fit) > 6  # the fixed start the bisection had (fit for the contest cores)


def test_bisection_descends_from_its_highest_overflowing_answer(monkeypatch):
    """After the bracket and bisection, forest rounds with gentle per-point multipliers start from the answer at
    the highest price that overflowed, at that price; each later round starts from an overflowing answer of
    toulbar2 under the node prices of the last rounds' multipliers scaled by a power of two, with those
    multipliers so scaled. Every fit is kept when it is the cheapest."""
    from autoshard.solver.penalty import GENTLE_STEPS, lagrangian_fit, node_prices, priced_nodes

    soft, rows = _bisection_setup()
    base = plain_scale(soft)
    calls, lines = [], []
    asked, _ = _priced_attempts(monkeypatch)

    def rounds(red_, rows_, start, *, mult, deadline, seed, log=None, steps):
        found = lagrangian_fit(red_, rows_, start, mult=mult, deadline=deadline, seed=seed, steps=steps)
        calls.append((CoreState(red_, rows_, start).overflow(), np.array(mult), steps, found, len(asked)))
        return found

    monkeypatch.setattr("autoshard.solver.cfn.lagrangian_fit", rounds)
    monkeypatch.setattr("autoshard.solver.cfn._LEARNED_FLOOR", 0.25)
    best = cfn.penalty_bisection(soft, rows, _far(600.0), 0, log=lines.append)
    answers = [line for line in lines if line.startswith("cfn penalty 2^") and "overflow " in line]
    over = [float(line.split("2^")[1].split(":")[0]) for line in answers
            if float(line.split("overflow ")[1].split(",")[0].split(" ")[0]) > 0]
    assert over, lines
    assert len(calls) >= 2 and all(overflow > 0 and steps == GENTLE_STEPS for overflow, _, steps, _, _ in calls)
    first = base * 2.0 ** max(over)
    assert np.allclose(calls[0][1], first, rtol=1e-12)
    for (_, _, _, before, j), (_, mult, _, _, k) in zip(calls, calls[1:]):
        learned = np.maximum(before.mult, 0.25 * first)  # never below a quarter of the first price
        scale = mult / learned
        assert np.allclose(scale, scale[0]) and np.log2(scale[0]) % 0.5 == pytest.approx(0.0, abs=1e-9)
        expected = node_prices(rows, learned, priced_nodes(soft, rows)) * scale[0]
        assert any(np.allclose(lam, expected, rtol=1e-12) for lam in asked[j:k])
        assert len({line.split(":")[0] for line in lines if line.startswith(f"cfn learned prices {k} x2^")
                    and " again:" not in line}) <= 4  # at most _LEARNED_ATTEMPTS scales a round
    assert best is not None and best.overflow() <= 0
    for _, _, _, found, _ in calls:
        if found.state is not None and not len(violations(found.state)):
            assert best.total_cost() <= found.state.total_cost() + 1e-9


def _priced_attempts(monkeypatch):
    """Record every toulbar2 attempt's prices and answer (in order) while the bisection runs."""
    asked, answers = [], []
    real_core, real_min = cfn.penalised_core, cfn.minimise

    def priced(red_, lam, deadline=None):
        asked.append(np.broadcast_to(np.asarray(lam, dtype=np.float64), (red_.num_core,)).copy())
        sub = real_core(red_, lam, deadline)
        answers.append((red_, sub))
        return sub

    def minimise(sub, deadline, *, seed=0):
        found = real_min(sub, deadline, seed=seed)
        red_, _ = answers[-1]
        answers[-1] = None if found is None or found.choice is None else sub.expand(found.choice, red_.num_core)
        return found

    monkeypatch.setattr("autoshard.solver.cfn.penalised_core", priced)
    monkeypatch.setattr("autoshard.solver.cfn.minimise", minimise)
    return asked, answers


def test_point_prices_price_the_fullest_points_from_the_least_fitting_price(monkeypatch):
    """After the uniform bracket, memory is priced only at the points where answers overflowed most: the first
    is where the highest overflowing uniform answer overflows most, each answer that overflows most at a point
    not yet priced adds it, and a node pays ``plain_scale * 2**e`` per byte for each priced point it is live
    at, from ``e`` the least uniform exponent that fitted. Every fit is kept when it is the cheapest."""
    soft, rows = _bisection_setup()
    base = plain_scale(soft)
    asked, answers = _priced_attempts(monkeypatch)
    lines: list[str] = []
    best = cfn.penalty_bisection(soft, rows, _far(600.0), 0, log=lines.append)
    tried = [line for line in lines if line.startswith(("cfn penalty 2^", "cfn point prices", "cfn learned"))]
    assert len(tried) == len(asked) == len(answers)
    first = next(i for i, line in enumerate(tried) if line.startswith("cfn point prices"))
    uniform = [(float(line.split("2^")[1].split(":")[0]), CoreState(soft, rows, answers[i]))
               for i, line in enumerate(tried[:first])]
    fit_e = min(e for e, st in uniform if st.overflow() <= 0)
    over = max(((e, st) for e, st in uniform if st.overflow() > 0), key=lambda x: x[0])[1]
    points = [int(np.argmax(over.usage - over.cap))]
    assert float(tried[first].split("2^")[1].split(":")[0]) == fit_e
    for i in range(first, len(tried)):
        if not tried[i].startswith("cfn point prices"):
            break
        e = float(tried[i].split("2^")[1].split(":")[0])
        assert tried[i].startswith(f"cfn point prices ({len(points)}) 2^")
        live = sum(((rows.lo <= p) & (rows.hi > p)).astype(np.float64) for p in points)
        assert np.allclose(asked[i], base * 2.0**e * live, rtol=1e-12)
        state = CoreState(soft, rows, answers[i])
        fullest = int(np.argmax(state.usage - state.cap))
        if state.overflow() > 0 and fullest not in points:
            points.append(fullest)
        if state.overflow() <= 0 and not len(violations(state)):
            assert best.total_cost() <= state.total_cost() + 1e-9


def test_no_point_prices_while_toulbar2_proves_nothing(monkeypatch):
    """Unproven answers need not follow their prices (contest S), so the point prices run only once some answer
    was proven; the node weights run instead, and stop by themselves (the deadline is 600 s away)."""
    soft, rows = _bisection_setup()
    real = cfn.minimise

    def unproven(sub, deadline, *, seed=0):
        found = real(sub, deadline, seed=seed)
        return found if found is None else dataclasses.replace(found, proven=False)

    monkeypatch.setattr("autoshard.solver.cfn.minimise", unproven)
    lines: list[str] = []
    best = cfn.penalty_bisection(soft, rows, _far(600.0), 0, log=lines.append)
    assert best is not None and best.overflow() <= 0
    assert any(line.startswith("cfn penalty 2^") for line in lines)
    assert not any(line.startswith("cfn point prices") for line in lines)
    assert any(line.startswith("cfn node weights 1.1") for line in lines)


@pytest.mark.parametrize("seed", [6, 8, 10])
def test_point_prices_bound_the_optimum_under_the_limit(seed):
    """toulbar2's bound under point prices, less the multipliers times the priced points' capacities, is a
    Lagrangian bound: at most the exact optimum under the memory limit."""
    problem = _memory_problem(seed, n=30)
    red = reduce_problem(problem, with_memory=True)
    rows = memory_rows(problem.intervals, problem.memory_limit, red.core_nodes, red.base_usage, True)
    stats: dict = {}
    lines: list[str] = []
    cfn.penalty_bisection(soften(red), rows, _far(600.0), 0, log=lines.append, stats=stats)
    assert any(line.startswith("cfn point prices") for line in lines), lines
    exact = solve(problem, time_limit=60, workers=1)
    assert exact.optimal
    core_optimum = CoreState(red, rows, _core_choice(red, exact.choice)).total_cost()
    assert np.isfinite(stats["free_bound"])
    assert stats["free_bound"] <= core_optimum * (1 + 1e-9) + 1e-9


def _unproven(monkeypatch):
    """Make every toulbar2 answer unproven (contest S's priced cores), keeping the recording of
    :func:`_priced_attempts`."""
    asked, answers = _priced_attempts(monkeypatch)
    recorded = cfn.minimise

    def minimise(sub, deadline, *, seed=0):
        found = recorded(sub, deadline, seed=seed)
        return found if found is None else dataclasses.replace(found, proven=False)

    monkeypatch.setattr("autoshard.solver.cfn.minimise", minimise)
    return asked, answers


def _live_over(state: CoreState) -> np.ndarray:
    hot = np.concatenate([[0], np.cumsum(state.usage > state.cap + state.tol)])
    return hot[state.rows.hi] > hot[state.rows.lo]


def test_node_weights_bracket_a_price_per_node(monkeypatch):
    """Where toulbar2 proves nothing, each node gets its own price, bracketed between the highest uniform price
    that overflowed and the lowest that fitted: each round asks half way up every bracket and at its top, the
    first round from the uniform prices. A node live where both of a round's answers overflowed is asked more
    the next round; one live only where both fitted is asked less. Every fit is kept when cheapest."""
    soft, rows = _bisection_setup()
    base = plain_scale(soft)
    asked, answers = _unproven(monkeypatch)
    lines: list[str] = []
    best = cfn.penalty_bisection(soft, rows, _far(600.0), 0, log=lines.append)
    tried = [line for line in lines if line.startswith(("cfn penalty 2^", "cfn node weights "))]
    assert len(tried) == len(asked) == len(answers)
    assert not any(line.startswith(("cfn learned", "cfn point prices")) for line in lines)
    first = next(i for i, line in enumerate(tried) if line.startswith("cfn node weights"))
    rounds = (len(tried) - first) // 2
    assert rounds >= 3 and [line.split(":")[0] for line in tried[first:]] == [
        f"cfn node weights {k}.{j}" for k in range(1, rounds + 1) for j in (1, 2)]
    uniform = [(float(line.split("2^")[1].split(":")[0]), CoreState(soft, rows, answers[i]))
               for i, line in enumerate(tried[:first])]
    fit_e = min(e for e, st in uniform if st.overflow() <= 0)
    over_e = max(e for e, st in uniform if st.overflow() > 0)
    priced = np.array([m is not None for m in soft.node_memory]) & (rows.hi > rows.lo)
    lo, hi = base * 2.0**over_e, base * 2.0**fit_e
    assert np.allclose(asked[first], np.where(priced, 0.5 * (lo + hi), 0.0), rtol=1e-12)
    assert np.allclose(asked[first + 1], np.where(priced, hi, 0.0), rtol=1e-12)
    seen_over = seen_fit = False
    for k in range(rounds - 1):
        i = first + 2 * k
        hot = [_live_over(CoreState(soft, rows, answers[i + j])) for j in (0, 1)]
        both_over, both_fit = priced & hot[0] & hot[1], priced & ~hot[0] & ~hot[1]
        assert (asked[i + 2][both_over] > asked[i][both_over]).all()
        assert (asked[i + 2][both_fit] < asked[i][both_fit]).all()
        seen_over, seen_fit = seen_over or both_over.any(), seen_fit or both_fit.any()
    assert seen_over and seen_fit
    for choice in answers:
        state = CoreState(soft, rows, choice)
        if state.overflow() <= 0 and not len(violations(state)):
            assert best.total_cost() <= state.total_cost() + 1e-9


def test_node_weights_stop_after_rounds_without_a_cheaper_answer(monkeypatch):
    """The node weights end ``_WEIGHT_PATIENCE`` rounds after the last round with an answer, fitting or over the
    limit by at most ``_WEIGHT_NEAR`` of it, cheaper than every one before, however far the deadline; then one
    run of forest rounds starts from the last such near answer that overflowed."""
    soft, rows = _bisection_setup()
    _, answers = _unproven(monkeypatch)
    monkeypatch.setattr("autoshard.solver.cfn._WEIGHT_PATIENCE", 2)
    monkeypatch.setattr("autoshard.solver.cfn._WEIGHT_NEAR", 1.0)
    starts = []
    real_fit = cfn.lagrangian_fit

    def fit(red_, rows_, start, **kw):
        starts.append(np.array(start))
        return real_fit(red_, rows_, start, **kw)

    monkeypatch.setattr("autoshard.solver.cfn.lagrangian_fit", fit)
    lines: list[str] = []
    cfn.penalty_bisection(soft, rows, _far(600.0), 0, log=lines.append)
    tried = [line for line in lines if line.startswith(("cfn penalty 2^", "cfn node weights "))]
    first = next(i for i, line in enumerate(tried) if line.startswith("cfn node weights"))
    cheapest, last_better, near = np.inf, 0, None
    for i in range(first, len(tried)):
        state = CoreState(soft, rows, answers[i])
        if state.overflow() <= rows.limit and state.total_cost() < cheapest:
            cheapest, last_better = state.total_cost(), (i - first) // 2
        if 0 < state.overflow() <= rows.limit:
            near = answers[i]
    assert (len(tried) - first) // 2 == last_better + 1 + 2
    assert len(starts) == 1 and near is not None and np.array_equal(starts[0], near)


def test_node_weights_offer_each_rounds_nearest_answer(monkeypatch):
    """With another search to send them to, the node weights offer each round's cheapest answer over the limit
    by at most ``_WEIGHT_NEAR`` of it, with the forest rounds' first multiplier, and their rounds go on past
    ``_WEIGHT_PATIENCE`` (the other search draws forest rounds from the answers as they come)."""
    soft, rows = _bisection_setup()
    _, answers = _unproven(monkeypatch)
    monkeypatch.setattr("autoshard.solver.cfn._WEIGHT_PATIENCE", 1)
    monkeypatch.setattr("autoshard.solver.cfn._WEIGHT_MIN_ROUNDS", 1)
    monkeypatch.setattr("autoshard.solver.cfn._WEIGHT_NEAR", 1.0)
    monkeypatch.setattr("autoshard.solver.cfn._WEIGHT_ROUNDS_BELOW", 3.0)
    offered = []
    lines: list[str] = []
    cfn.penalty_bisection(soft, rows, _far(8.0), 0, log=lines.append,
                          offer=lambda state, mult: offered.append((state.choice.copy(), mult)))
    tried = [line for line in lines if line.startswith(("cfn penalty 2^", "cfn node weights "))]
    first = next(i for i, line in enumerate(tried) if line.startswith("cfn node weights"))
    uniform = [(float(line.split("2^")[1].split(":")[0]), CoreState(soft, rows, answers[i]))
               for i, line in enumerate(tried[:first]) if answers[i] is not None]
    over_e = max(e for e, st in uniform if st.overflow() > 0)
    rounds: dict[int, list[CoreState]] = {}  # the last round may have only its first answer
    for i in range(first, len(tried)):
        k = int(tried[i].split("node weights ")[1].split(".")[0])
        got = rounds.setdefault(k, [])
        if answers[i] is not None:  # an attempt that found nothing in time is asked again
            got.append(CoreState(soft, rows, answers[i]))
    expected, stale = [], []  # the offers due, and the rounds without a cheaper answer fitting or near
    cheapest = np.inf
    for k, states in enumerate(rounds.values()):
        near = [st for st in states if 0 < st.overflow() <= rows.limit]
        if near:
            expected.append(min(near, key=lambda st: st.total_cost()).choice)
        better = [st.total_cost() for st in states if st.overflow() <= rows.limit and st.total_cost() < cheapest]
        cheapest = min(better, default=cheapest)
        if not better:
            stale.append(k)
    assert expected and len(offered) == len(expected)
    for (choice, mult), want in zip(offered, expected, strict=True):
        assert np.array_equal(choice, want)
        assert mult == pytest.approx(plain_scale(soft) * 2.0 ** (over_e - 3.0), rel=1e-12)
    # alone, the rounds would have ended at the first round without a cheaper answer (patience 1)
    assert stale and stale[0] < len(rounds) - 1


def test_node_weights_need_time_for_their_rounds(monkeypatch):
    """Without time for ``_WEIGHT_MIN_ROUNDS`` rounds the node weights do not start; the uniform bisection and
    the learned prices run instead, as before they were built (and no point prices: nothing was proven)."""
    soft, rows = _bisection_setup()
    _unproven(monkeypatch)
    monkeypatch.setattr("autoshard.solver.cfn._WEIGHT_MIN_ROUNDS", 10**9)
    lines: list[str] = []
    best = cfn.penalty_bisection(soft, rows, _far(600.0), 0, log=lines.append)
    assert best is not None and best.overflow() <= 0
    assert not any(line.startswith(("cfn node weights", "cfn point prices")) for line in lines)
    assert any(line.startswith("cfn learned prices") for line in lines)


def test_a_solve_leaves_no_cpu_timer_armed():
    """toulbar2 arms a process-wide CPU-time timer for its limit and leaves it armed when it returns early; its
    signal handler then fired seconds later inside an XLA compile's malloc and deadlocked the process."""
    import signal
    import time

    from autoshard.solver.cfn import minimise
    from autoshard.solver.problem import ShardingProblem
    from autoshard.solver.reduce import reduce_problem

    rng = np.random.default_rng(0)  # a 6 x 6 grid of 4-way choices: the reductions leave a core
    edges = np.array([(6 * i + j, 6 * i + j + 1) for i in range(6) for j in range(5)]
                     + [(6 * i + j, 6 * i + j + 6) for i in range(5) for j in range(6)])
    p = ShardingProblem(node_costs=tuple(rng.random(4) for _ in range(36)), edges=edges,
                        edge_costs=tuple(rng.random((4, 4)) for _ in edges))
    found = minimise(reduce_problem(p, with_memory=False), time.perf_counter() + 5.5)
    assert found is not None and found.proven
    assert signal.getitimer(signal.ITIMER_VIRTUAL) == (0.0, 0.0)
