"""Large memory-constrained cores: price memory into node costs, then search.

With memory priced into node costs (``cost + lam * usage``) the problem has no
memory constraint left, so every node becomes memory-free and the exact leaf and
series eliminations collapse the core far further; a greedy pass and forest
descents (:mod:`forest`) choose the rest (:func:`penalised_choice`).

* :func:`lagrangian_descent` starts from the choice of a small uniform ``lam``
  (cheap, far over the limit) and runs forest rounds under one multiplier per
  time point, doubled where the round overflowed and lowered where it had
  slack, keeping the cheapest fitting choice.
* :func:`penalty_search` searches one uniform ``lam`` geometrically, then by
  bisection, for the cheapest choice that fits (the fallback start).
* :func:`guarded_descent` improves a fitting choice by forest rounds that are
  kept only when they fit and cost less; :func:`clear_forbidden` runs them on the
  count of forbidden pairs first, for a quick first feasible answer.
* :func:`repaired_start` makes a cheap choice over the limit (belief
  propagation's, memory ignored) fit by greedy moves, then clears and descends.

Forbidden (infinite) edge entries are priced at ``FORBIDDEN`` (:func:`soften`),
so every search sees finite costs and drives them out.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from autoshard.solver.bp import MinSumBP
from autoshard.solver.forest import ForestSearch, min_cost_choice
from autoshard.solver.local import CoreState, flat_costs, flat_usage, greedy, recosted
from autoshard.solver.memory import MemoryRows, range_max
from autoshard.solver.problem import ShardingProblem
from autoshard.solver.reduce import Reduction, reduce_problem

FORBIDDEN = 1e12
FOREST_PATIENCE = 3
# guarded descent stops after this many rounds in a row without a kept choice
GUARDED_PATIENCE = 12
# lagrangian descent stops this many rounds after its best fit last improved
LAGRANGE_PATIENCE = 25


@dataclasses.dataclass(frozen=True, slots=True)
class LagrangeSteps:
    """How the lagrangian searches (:func:`lagrangian_descent`, :func:`lagrangian_bp`) move their per-point
    multipliers, and when they stop: points over capacity multiply theirs by ``raise_by``; points with at least
    ``slack`` of their capacity free multiply theirs by ``lower_by``; a search stops ``patience`` rounds after
    its best fit last improved by 0.01%, and after ``fit_within`` rounds without any fit (None: it runs to its
    deadline while nothing fits)."""

    raise_by: float = 2.0
    lower_by: float = 0.8
    slack: float = 0.02
    patience: int = LAGRANGE_PATIENCE
    fit_within: int | None = None

    def go_on(self, fitted: bool, stale: int) -> bool:
        """Whether another round is due, ``stale`` rounds after the best fit last improved (or after the start,
        while nothing has fitted)."""
        if fitted:
            return stale < self.patience
        return self.fit_within is None or stale < self.fit_within

    def follow(self, mult: np.ndarray, usage: np.ndarray, cap: np.ndarray, hot: np.ndarray) -> None:
        """Move the multipliers ``mult`` (in place) after a round with ``usage`` per point, ``hot`` where over."""
        mult[hot] *= self.raise_by
        mult[~hot & (usage < cap - self.slack * np.abs(cap))] *= self.lower_by


# The belief-propagation lagrangian's steps. With 2.0 and 0.8 (and 20 rounds) the multipliers swung past the
# fits: S's best fit was 1.6315e9, A's 7.387e9, M's 1.0145e11; with 1.5 and 0.9 (and 50 rounds: fewer stop at
# a first fit that still holds forbidden pairs) 1.6255e9, 7.248e9, 1.0101e11.
_BP_STEPS = LagrangeSteps(raise_by=1.5, lower_by=0.9, slack=0.02, patience=50)

# From an answer that is already cheap and only a little over the limit (toulbar2's under the highest
# uniform price that overflowed), gentler steps, lowered wherever a point fits: from contest S's answer at
# 2^16 (1.4865e9, 903 of 18,384 points up to 15% over) they reached 1.578e9, 1.633e9 and 1.594e9 in 30 s
# (seeds 0-2), the default steps 1.624e9, and a 2% slack 1.644e9, 1.655e9, 1.576e9; from the planner's
# GPT-6.7B (2, 4) answer at 2^-24 under a budget, 0.1265 in 2 s (the best of a 120 s solve was 0.1269).
# Their first fits came within 5-15 rounds; 50 rounds without one (multipliers 6e8 times higher where the
# answer overflowed) leave the time to the searches after them.
GENTLE_STEPS = LagrangeSteps(raise_by=1.5, lower_by=0.9, slack=0.0, patience=50, fit_within=50)
# clear_forbidden gives up after this many descents in a row that removed no forbidden pair
_CLEAR_PATIENCE = 3
# Cores up to this many nodes are searched as they are for each penalty.
_REREDUCE_NODES = 3000


def soften(red: Reduction) -> Reduction:
    """The same core with forbidden edge pairs priced at ``FORBIDDEN`` (``red.forbidden`` records it).

    Allowed entries can cost more (contest M has finite edge entries of 3e12), so
    a forbidden pair is one priced exactly ``red.forbidden`` (:func:`violations`).
    A higher price, above every allowed entry, made M's quarter-limit answer 1.13x
    the best known instead of 1.05x: the searches pass through forbidden pairs.
    """
    soft = tuple(np.where(np.isfinite(m), m, FORBIDDEN) for m in red.edge_costs)
    return dataclasses.replace(red, edge_costs=soft, forbidden=FORBIDDEN)


def violations(state: CoreState) -> np.ndarray:
    """Indices of core edges whose chosen pair is forbidden (infinite, or priced at ``red.forbidden``)."""
    return np.flatnonzero(state.edge_costs() == state.red.forbidden).astype(np.int64)


def penalised_choice(
    red: Reduction,
    rows: MemoryRows,
    lam: float | np.ndarray,
    deadline: float,
    seed: int,
    *,
    start: np.ndarray | None = None,
    forest_seconds: float = 0.0,
) -> np.ndarray:
    """Core choice minimising ``cost + lam * usage`` (memory limit ignored).

    ``lam`` is one multiplier, or one per core node.

    Large cores are reduced again first (with memory priced in, every node is
    memory-free, so the eliminations collapse them), get a greedy pass that is
    always finished, then forest descents for up to ``forest_seconds``; small ones
    are searched directly, from ``start`` when given.
    """
    lam = np.broadcast_to(np.asarray(lam, dtype=np.float64), (red.num_core,))
    costs = []
    for c, m, x in zip(red.node_costs, red.node_memory, lam, strict=True):
        costs.append(c if m is None or x == 0 else c + x * m)
    if red.num_core <= _REREDUCE_NODES:
        pen = dataclasses.replace(red, node_costs=tuple(costs))
        state = CoreState(pen, None, min_cost_choice(pen) if start is None else start)
        ForestSearch(state, seed).run(deadline, patience=FOREST_PATIENCE)
        return state.choice
    sub = ShardingProblem(node_costs=tuple(costs), edges=red.edges, edge_costs=red.edge_costs)
    sub_red = reduce_problem(sub, with_memory=False, deadline=deadline)
    state = greedy(sub_red, None, deadline, seed)
    if forest_seconds > 0:
        # Descents from the greedy choice roughly halve the penalised cost on the
        # contest cores (M: 1.8e11 -> 8.8e10 unpenalised) and clear the forbidden
        # pairs greedy leaves on A.
        ForestSearch(state, seed).run(min(deadline, time.perf_counter() + forest_seconds), patience=FOREST_PATIENCE)
    return sub_red.expand(state.choice, red.num_core)


def penalty_search(
    red: Reduction, rows: MemoryRows, deadline: float, seed: int, *, log, give_up: float | None = None
) -> CoreState | None:
    """The cheapest memory-feasible penalised choice found before ``deadline``, or None.

    While no penalty has given a feasible choice, the search goes on until
    ``give_up`` (when later than ``deadline``).

    ``red`` should be :func:`soften`-ed: the returned state may still use priced
    forbidden pairs, which the window search then removes.
    """
    base = plain_scale(red)
    best: CoreState | None = None
    give_up = deadline if give_up is None else give_up

    small = red.num_core <= _REREDUCE_NODES
    if not small:
        return _large_penalty_search(red, rows, base, deadline=deadline, give_up=give_up, seed=seed, log=log)

    last = 0.0  # seconds the last attempt took: no attempt starts that cannot finish
    # a bisection needs several attempts; none may eat the whole budget
    per_attempt = max(deadline - time.perf_counter(), 0.0) / 5

    def attempt(e: float) -> bool:
        nonlocal best, last
        t0 = time.perf_counter()
        start = None if best is None else best.choice
        choice = penalised_choice(red, rows, base * 2.0**e, min(deadline, t0 + per_attempt), seed, start=start)
        state, ok, last = _scored_attempt(red, rows, choice, e=e, t0=t0, log=log)
        if ok and (best is None or state.total_cost() < best.total_cost()):
            best = state
        return ok

    def time_left() -> bool:
        # until something fits, searching on beats handing back an infeasible start
        until = deadline if best is not None else max(deadline, give_up)
        return time.perf_counter() + 0.8 * last < until

    bracket_and_bisect(attempt, time_left, _node_only_exponent(red, rows, base), 2.0, 0.1)
    return best


def _large_penalty_search(
    red: Reduction, rows: MemoryRows, base: float, *, deadline: float, give_up: float, seed: int, log
) -> CoreState | None:
    """The penalty search of large cores.

    Each attempt re-reduces the penalised core, runs the greedy pass to the end
    and then forest descents for at most a quarter of the time left. The exponent
    starts at the plain cost/usage scale (the node-only guess fell 4 to 40
    doublings short on the contest cores) and grows by doubling steps until a
    choice fits, then bisects to 0.5. While nothing fits the search goes on
    until ``give_up``.
    """
    best: CoreState | None = None
    last = 0.0

    def attempt(e: float) -> bool:
        nonlocal best, last
        t0 = time.perf_counter()
        until = deadline if best is not None else max(deadline, give_up)
        forest = max(0.2 * (until - t0), 1.0)
        choice = penalised_choice(red, rows, base * 2.0**e, until, seed, forest_seconds=forest)
        state, ok, last = _scored_attempt(red, rows, choice, e=e, t0=t0, log=log)
        if ok and (best is None or state.total_cost() < best.total_cost()):
            best = state
        return ok

    def time_left() -> bool:
        until = deadline if best is not None else max(deadline, give_up)
        return time.perf_counter() + 0.5 * last < until

    bracket_and_bisect(attempt, time_left, 0.0, 4.0, 0.5)
    return best


def _scored_attempt(red: Reduction, rows: MemoryRows, choice: np.ndarray, *, e: float, t0: float, log):
    """A penalty attempt's choice as a state, whether it fits, and the attempt's seconds (logged)."""
    state = CoreState(red, rows, choice)
    ok = state.overflow() <= 0
    seconds = time.perf_counter() - t0
    log(f"penalty 2^{e:g}: cost {state.total_cost():.6g}, overflow {state.overflow():.3g} ({seconds:.1f}s)")
    return state, ok, seconds


# Penalty exponents beyond this make the penalty dominate every cost (or underflow to zero);
# 2.0**e overflows a float at 1024.
MAX_EXPONENT = 256.0


def bracket_and_bisect(attempt, time_left, e: float, step: float, tol: float) -> None:
    """Find the smallest penalty exponent whose attempt fits: step out in doubling steps
    from ``e`` until one attempt fits and one does not, then bisect down to ``tol``."""
    lo, hi = None, None
    while time_left() and abs(e) <= MAX_EXPONENT:  # beyond it memory alone decides (or 2**e overflows)
        if attempt(e):
            hi = e
            if lo is not None:
                break
            e -= step
        else:
            lo = e
            if hi is not None:
                break
            e += step
        step *= 2
    if lo is not None and hi is not None:
        bisect(attempt, time_left, lo, hi, tol)


def bisect(attempt, time_left, lo: float, hi: float, tol: float) -> None:
    """Bisect the exponents between ``lo`` (whose attempt overflowed) and ``hi`` (whose attempt fitted) down to
    ``tol``."""
    while hi - lo > tol and time_left():
        mid = 0.5 * (lo + hi)
        if attempt(mid):
            hi = mid
        else:
            lo = mid


class _PenalisedRounds:
    """One forest-DP round at a time for ``cost + w * usage`` with per-point multipliers.

    Node ``k`` pays ``w[k] * usage``, ``w[k]`` the largest multiplier of the
    time points it is live at. One penalised state is reused and its costs
    swapped each round (building a CoreState's adjacency took a third of a
    round). Rounds alternate random node orders with hub-first ones: hubs join
    a forest only before their neighbours link up (on contest A those rounds
    took 2.36e10 to 2.04e10 where random orders stalled).
    """

    def __init__(self, red: Reduction, rows: MemoryRows, choice: np.ndarray, seed: int):
        self.red, self.rows = red, rows
        self.n = red.num_core
        self.priced = priced_nodes(red, rows)
        self.cap = rows.cap
        self.tol = rows.tol
        self.flat = flat_costs(red)
        self.pen = CoreState(red, None, choice)
        self.rng = np.random.default_rng(seed)
        self.degree = np.bincount(red.edges.ravel(), minlength=self.n).astype(np.float64)
        self.rounds = 0

    def run(self, choice: np.ndarray, mult: np.ndarray, nodes: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
        """The round's new choice (from ``choice``; only ``nodes`` may change, when given) and its usage per point."""
        red, rng, n = self.red, self.rng, self.n
        w = node_prices(self.rows, mult, self.priced)
        self.pen.red = dataclasses.replace(
            red,
            node_costs=tuple(
                c if m is None or x == 0 else c + x * m
                for c, m, x in zip(red.node_costs, red.node_memory, w, strict=True)
            ),
        )
        self.pen.choice = choice.copy()
        search = ForestSearch(self.pen, int(rng.integers(2**31)))
        if nodes is None:
            nodes = np.arange(n)
        if self.rounds % 2:
            order = nodes[np.argsort(-self.degree[nodes] * rng.uniform(0.5, 1.5, nodes.size), kind="stable")]
        else:
            order = rng.permutation(nodes)
        self.rounds += 1
        search.solve_forest(search.forest(order))
        return self.pen.choice.copy(), self.rows.usage(red.node_memory, self.pen.choice)


def guarded_descent(state: CoreState, deadline: float, seed: int, log=None, *, enough: float = -np.inf,
                    focus=None) -> CoreState:
    """Forest descents on the memory-feasible ``state`` that keep it feasible.

    Runs until ``deadline``, ``GUARDED_PATIENCE`` rounds in a row keep nothing, or
    the cost is below ``enough``. ``focus(choice)``, when given, names the nodes a
    round may change (the others stay fixed), else all may.
    A round's choice is kept when it fits and is cheaper. A round that
    overflows raises the multipliers of the points it overflowed (x4, at least
    the plain cost/usage scale), so memory is priced only where it binds. On
    contest M this took a fitting choice from 1.97e11 to 8.97e10 in 60 s, where
    MILP windows gained ~5%.
    """
    red, rows = state.red, state.rows
    if red.num_core == 0 or state.overflow() > 0:
        return state
    base = None  # the plain scale, computed at the first overflow
    mult = np.zeros(rows.num_points)
    rounds = _PenalisedRounds(red, rows, state.choice, seed)
    cost = state.total_cost()
    cur = state.choice.copy()
    kept = over = stale = 0
    last = 0.0
    while time.perf_counter() + last < deadline and stale < GUARDED_PATIENCE and cost >= enough:
        t0 = time.perf_counter()
        stale += 1
        new, usage = rounds.run(cur, mult, None if focus is None else focus(cur))
        hot = usage - rounds.cap > rounds.tol
        if hot.any():
            over += 1
            base = plain_scale(red) if base is None else base
            mult[hot] = np.maximum(4 * mult[hot], base)
        else:
            c = rounds.flat.cost(new)
            if c < cost:
                cur, cost = new, c
                kept += 1
                stale = 0
        last = time.perf_counter() - t0
    if log is not None:
        log(f"guarded descent: {kept} rounds kept, {over} overflowed, cost {cost:.6g}")
    return CoreState(red, rows, cur)


def clear_forbidden(state: CoreState, deadline: float, seed: int, log=None) -> CoreState:
    """The fitting ``state`` with its forbidden pairs removed by forest rounds, if time allows.

    The rounds minimise the number of forbidden pairs, then usage, then cost
    (each term below one unit of the one before), and keep a round only when it
    fits: the least-memory start (which fits whenever anything does) becomes a
    first feasible answer within a few rounds. On the contest's A, M and S cores
    (2.5k-4.6k forbidden pairs at the start) this took 1.5-3 s, where the
    memory-priced searches needed tens of seconds for their first fit. Returns as
    soon as no forbidden pair is left, after ``_CLEAR_PATIENCE`` descents in a row
    that removed none, or at ``deadline``; ``state.red`` is :func:`soften`-ed.
    """
    red, rows = state.red, state.rows
    if red.num_core == 0 or state.overflow() > 0 or not len(violations(state)):
        return state
    n = red.num_core
    flat = state.flat
    nsz = flat.node_cells
    usage = flat_usage(red)
    costs = flat.values[:nsz]
    usage_scale = float(np.abs(usage).max(initial=0.0)) or 1.0
    cost_scale = float(np.abs(costs).max(initial=0.0)) or 1.0
    # below one pair in total: usage sums to at most 1/2, cost to at most 1/10
    values = np.empty(flat.values.size)
    values[:nsz] = 0.5 / n * usage / usage_scale + 0.1 / n * costs / cost_scale
    np.equal(flat.values[nsz:], red.forbidden, out=values[nsz:])
    pairs = recosted(red, values)
    target = CoreState(pairs, rows, state.choice)
    ends = red.edges
    neighbours = [np.array([x for x, _ in row], dtype=np.int64) for row in target.adj]

    def near_pairs(choice: np.ndarray) -> np.ndarray:
        hot = np.unique(ends[target.flat.edge_costs(choice) > 0].ravel())
        return np.unique(np.concatenate([hot, *(neighbours[k] for k in hot)])) if hot.size else hot

    attempt = stale = 0
    while time.perf_counter() < deadline and target.total_cost() >= 1.0 and stale < _CLEAR_PATIENCE:
        # rounds over the pairs' neighbourhoods first (fast), then over everything
        before = target.total_cost()
        target = guarded_descent(target, deadline, seed + attempt, enough=1.0, focus=near_pairs if attempt < 2 else None)
        attempt += 1
        stale = 0 if target.total_cost() <= before - 1.0 else stale + 1
    out = CoreState(red, rows, target.choice)
    if log is not None:
        log(f"clear forbidden pairs: {len(violations(state))} -> {len(violations(out))} "
            f"in {attempt} descents, cost {out.total_cost():.6g}")
    return out


def repaired_start(state: CoreState, deadline: float, seed: int, log=None, *,
                   improve_until: float | None = None) -> CoreState | None:
    """A fitting choice near ``state``, a cheap choice over the limit; None when none is found by ``deadline``.

    :meth:`CoreState.repair` moves nodes to less memory, cheapest per byte
    saved, until everything fits; :func:`clear_forbidden` then removes the
    forbidden pairs those moves took (keeping the fit), and guarded descents
    improve the result until ``improve_until`` (default ``deadline``). From belief propagation's
    memory-free choice on contest A (0.85x the best known, every point over
    the limit) this fitted at 1.12-1.18x within 13 s, where the memory-priced
    searches had no fit after 15 s.
    """
    fixed = fitted(state, deadline, seed, log)
    if fixed is None:
        return None
    return guarded_descent(fixed, deadline if improve_until is None else min(improve_until, deadline), seed, log)


def fitted(state: CoreState, deadline: float, seed: int, log=None) -> CoreState | None:
    """A copy of ``state`` made to fit by :meth:`CoreState.repair`, cleared of the forbidden pairs its moves
    took (:func:`clear_forbidden`), then improved by single-node moves that keep it fitting
    (:meth:`CoreState.improve`); None when it does not fit free of forbidden pairs by ``deadline``.

    The repair takes many moves a pass, priced before any is made, so it gives back more cost than the fit
    needs: on the planner's GPT-6.7B (2, 4) core under a budget, toulbar2's answer at 2^-24 (cost 0.1230,
    over the limit) was repaired to 0.1387, and the single-node moves took it to 0.1291 in 0.1 s. The
    moves' sweeps took 0.7-1.2 s to settle on contest A, M and S.
    """
    fixed = CoreState(state.red, state.rows, state.choice)
    if not fixed.repair(deadline):
        return None
    fixed = clear_forbidden(fixed, deadline, seed, log)
    if len(violations(fixed)) or fixed.overflow() > 0:
        return None
    improved = CoreState(fixed.red, fixed.rows, fixed.choice)
    improved.improve(deadline, np.random.default_rng(seed))
    if len(violations(improved)) or improved.overflow() > 0 or improved.total_cost() > fixed.total_cost():
        return fixed
    return improved


@dataclasses.dataclass(frozen=True, slots=True)
class LagrangeFit:
    """A lagrangian search's cheapest fit (None when nothing fitted) and its per-point multipliers at that fit
    (the last ones when nothing fitted): memory's price where it binds, to hand to another search."""

    state: CoreState | None
    mult: np.ndarray


def lagrangian_descent(
    red: Reduction, rows: MemoryRows, start: np.ndarray, *, lam: float, deadline: float, seed: int,
    log=None, steps: LagrangeSteps = LagrangeSteps(),
) -> CoreState | None:
    """Forest rounds under per-point multipliers that follow the overflow, all starting at ``lam`` (the uniform
    multiplier ``start`` was chosen under); the cheapest fit seen (:func:`lagrangian_fit`).

    From the choice of a small uniform multiplier (cheap but far over the
    limit) this reached 1.006x the best known on contest M in 60 s, where the
    cheapest fitting uniform multiplier plus guarded descents stopped at 1.77x.
    """
    mult = np.full(rows.num_points, float(lam))
    return lagrangian_fit(red, rows, start, mult=mult, deadline=deadline, seed=seed, log=log, steps=steps).state


def lagrangian_fit(
    red: Reduction, rows: MemoryRows, start: np.ndarray, *, mult: np.ndarray, deadline: float, seed: int,
    log=None, steps: LagrangeSteps = LagrangeSteps(),
) -> LagrangeFit:
    """Forest rounds from ``start`` under per-point multipliers (from ``mult``, not changed) that follow the
    overflow; the cheapest fit seen, and the multipliers it was found under.

    Every round is taken (each is a descent for the current multipliers). By
    default points over capacity double their multiplier and points with 2%
    slack or more lose a fifth of it (``steps``). Stops at ``deadline``, or
    ``steps.patience`` rounds after the best fit last improved by 0.01% (or
    ``steps.fit_within`` rounds without any fit).
    """
    mult = np.array(mult, dtype=np.float64)
    if red.num_core == 0:
        return LagrangeFit(None, mult)
    rounds = _PenalisedRounds(red, rows, start, seed)
    cur = np.asarray(start, dtype=np.int64).copy()
    best, best_cost, best_mult = None, np.inf, None
    stale = 0
    last = 0.0
    while time.perf_counter() + last < deadline and steps.go_on(best is not None, stale):
        t0 = time.perf_counter()
        cur, usage = rounds.run(cur, mult)
        hot = usage - rounds.cap > rounds.tol
        stale += 1
        if not hot.any():
            c = rounds.flat.cost(cur)
            if not np.isfinite(best_cost) or c < best_cost - 1e-4 * abs(best_cost):
                stale = 0
            if c < best_cost:
                best, best_cost, best_mult = cur.copy(), c, mult.copy()
        steps.follow(mult, usage, rounds.cap, hot)
        last = time.perf_counter() - t0
    if log is not None:
        log(f"lagrangian descent: {rounds.rounds} rounds, best fit {best_cost:.6g}")
    if best is None:
        return LagrangeFit(None, mult)
    return LagrangeFit(CoreState(red, rows, best), best_mult)


def priced_nodes(red: Reduction, rows: MemoryRows) -> np.ndarray:
    """Per core node, whether its usage is counted at some point (it has usage and a live range): the nodes
    :func:`node_prices` prices."""
    return np.array([m is not None for m in red.node_memory], dtype=bool) & (rows.hi > rows.lo)


def node_prices(rows: MemoryRows, mult: np.ndarray, priced: np.ndarray) -> np.ndarray:
    """Per core node, the price of a byte of its usage under per-point multipliers ``mult``: the largest
    multiplier of the points it is live at, 0 where not ``priced`` (:func:`priced_nodes`, computed once by
    the searches that price every round)."""
    return np.where(priced, range_max(mult, rows.lo, rows.hi), 0.0)


def plain_scale(red: Reduction) -> float:
    """Typical node cost over typical usage: the penalty that makes them comparable."""
    mems = [m for m in red.node_memory if m is not None]
    usage_scale = np.median(_means(mems, magnitude=False)) if mems else 1.0
    cost_scale = np.median(_means(red.node_costs) + 1.0)
    return cost_scale / max(usage_scale, 1e-30)


def _means(arrays, magnitude: bool = True) -> np.ndarray:
    """The mean of each array's finite entries (their magnitudes), nan when it has none, in one pass."""
    flat = np.concatenate(arrays)
    ok = np.isfinite(flat)
    starts = np.concatenate([[0], np.cumsum([a.size for a in arrays])[:-1]])
    sums = np.add.reduceat(np.where(ok, np.abs(flat) if magnitude else flat, 0.0), starts)
    counts = np.add.reduceat(ok.astype(np.float64), starts)
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums / counts


def _node_only_exponent(red: Reduction, rows: MemoryRows, base: float) -> float:
    """The least ``e`` (to 1/2) at which per-node argmins of ``cost + base * 2**e * usage`` fit.

    Edges are ignored, so this is only a cheap first guess of the penalty's scale.
    """
    mem_nodes = [k for k, m in enumerate(red.node_memory) if m is not None]
    choice = np.zeros(red.num_core, dtype=np.int64)

    def fits(e: float) -> bool:
        lam = base * 2.0**e
        for k in mem_nodes:
            c = red.node_costs[k] + lam * red.node_memory[k]
            choice[k] = int(np.argmin(c))
        return bool((rows.usage(red.node_memory, choice) <= rows.cap + rows.tol).all())

    lo, hi = -40.0, 80.0
    if not fits(hi):
        return 0.0
    while hi - lo > 0.5:
        mid = 0.5 * (lo + hi)
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def lagrangian_bp(
    red: Reduction, rows: MemoryRows, lam: float, deadline: float, *, inner: int = 3, log=None
) -> CoreState | None:
    """Min-sum belief propagation under per-point memory multipliers; the cheapest fit seen.

    The multipliers follow the overflow (raised by half where a round's decoded
    choice overflows, cut by a tenth where it has 2% slack). The messages are
    kept from round to round, so each round is only ``inner`` message-passing
    steps for the new prices. Stops at ``deadline``, or
    50 rounds after the best fit last improved by 0.01% (``_BP_STEPS``). On contest A this found a
    fitting 7.56e9 (1.15x the best known) in 30 s where the forest rounds ended
    at 1.87e10 (with today's gentler steps, from the multiplier 1: 7.25e9 in
    34 s); on M and S its fits are worse than the forest's, but a guarded
    descent from S's fit reached 1.09x. Returns None when no round fitted.
    """
    if red.num_core == 0:
        return None
    bp = MinSumBP(red)
    priced = priced_nodes(red, rows)
    mult = np.full(rows.num_points, lam)
    cap = rows.cap
    best, best_cost = None, np.inf
    stale = 0
    while time.perf_counter() < deadline and _BP_STEPS.go_on(best is not None, stale):
        stale += 1
        w = node_prices(rows, mult, priced)
        bp.set_node_costs(
            [c if m is None or x == 0 else c + x * m for c, m, x in zip(red.node_costs, red.node_memory, w,
                                                                         strict=True)]
        )
        for _ in range(inner):
            bp.step(bp.beliefs())
        choice = bp.decode()
        usage = rows.usage(red.node_memory, choice)
        hot = usage - cap > rows.tol
        if not hot.any():
            c = bp.flat.cost(choice)
            if not np.isfinite(best_cost) or c < best_cost - 1e-4 * abs(best_cost):
                stale = 0
            if c < best_cost:
                best, best_cost = choice, c
        _BP_STEPS.follow(mult, usage, cap, hot)
    if log is not None:
        log(f"lagrangian bp: {bp.rounds} steps, best fit {best_cost:.6g}")
    return None if best is None else CoreState(red, rows, best)
