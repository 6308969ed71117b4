"""Memory-free cores minimised by toulbar2, and the memory-penalty search built on it.

A core without memory rows is a pairwise cost function network: one variable
per node, a unary cost per strategy and a binary table per edge. toulbar2
(``pytoulbar2``, MIT) solves such networks by soft arc consistency,
variable elimination and hybrid best-first branch and bound, and reports a
dual bound as it goes. On the contest cores with memory priced into the node
costs (re-reduced to 1.9k-6.6k nodes) it proves the optimum in 3-8 s, where
forest descents stop 2-4x above it; on contest A without its limit it proves
the optimum (5.26e9) in 10 s.

* :func:`minimise`: the least-cost choice of a memory-free core by a deadline
  (anytime: the best choice found when time runs out) and a lower bound.
* :func:`penalty_bisection`: memory priced uniformly into node costs
  (``cost + lam * usage``), each price's core minimised by toulbar2, the price
  bracketed and bisected for the cheapest choice that fits; a choice that
  overflows a little is repaired (:meth:`CoreState.repair`) and kept when it
  then fits. This is the first-place contest team's scheme (memory limits as
  usage penalties, a cost function network solver for each penalty, greedy
  repair), with our own search around it.
* :func:`point_prices`: memory priced only at the few time points where
  answers overflowed most (the memory rows' Lagrangian on those rows), one
  exponent bisected; toulbar2's bound under them is a lower bound under the
  limit (:func:`priced_bound`).
* :func:`learned_prices`: from the highest price's overflowing answer, forest
  rounds with per-point multipliers alternate with toulbar2 under the node
  prices those multipliers learned (per-node penalties with adaptive weights).

toulbar2 works in integer costs: each function is shifted to a least entry
of 0 and scaled by one power of two so that the largest finite entry is near
2**40, then rounded down, so its bound (scaled back) stays a lower bound of
the real costs. Infinite entries (forbidden pairs) stay hard.

pytoulbar2 is imported only when a search needs it; without it
:func:`available` is False and the solver uses its other searches.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import numpy as np

from autoshard.solver.local import CoreState, flat_costs, min_memory_choice
from autoshard.solver.memory import MemoryRows
from autoshard.solver.penalty import (
    GENTLE_STEPS,
    bisect,
    bracket_and_bisect,
    fitted,
    lagrangian_fit,
    node_prices,
    plain_scale,
    priced_nodes,
    violations,
)
from autoshard.solver.problem import ShardingProblem
from autoshard.solver.reduce import Reduction, reduce_problem

# Largest scaled finite entry of one function (toulbar2 costs are int64, its
# infinity is 5.1e17), and the cap on the sum of every function's largest entry.
_CELL_BITS = 40
_TOTAL_COST = 2.0**58
# toulbar2 takes whole seconds; a solve is not started with less than this left.
MIN_SECONDS = 1.0
# The bisection: its first exponent (of the uniform price, times the plain cost/usage scale) is the
# _SLOPE_QUANTILE of the nodes' trade prices at the least-memory choice (:func:`start_exponent`), or
# _START_EXPONENT where no node trades; then its first step, and the step at which it stops. The contest
# cores fit from 2**12 (A) and 2**16 (M), the planner's GPT cores under a budget from 2**-22, and each
# overflows a little below. The quantile's exponent was within 4 of the fitting one where that is known
# (A 12 against 12, M 20 against 16, the GPT cores -23 to -19 against -24 to -20); on the planner's MoE it
# was -22, and the answer still fitted at -26 (so at least 4 above).
_SLOPE_QUANTILE = 0.25
_START_EXPONENT = 12.0
_START_STEP = 4.0
_BISECT_TOL = 1.0
# One attempt gets this share of the time left, or _FULL_ATTEMPT seconds when that is more. The next one
# starts only with _NEXT_ATTEMPT times the median attempt so far left (at least _FIRST_ATTEMPT: toulbar2's
# whole second after the core is reduced again), and with twice an attempt's time after one that found
# nothing: toulbar2's preprocessing alone took 3-7 s on the contest cores, and an attempt stopped before
# it ends returns nothing; on the planner's cores each attempt took 0.2-0.7 s, and a fixed 4 s minimum
# left none at a 5 s limit.
_ATTEMPT_SHARE = 0.35
_FULL_ATTEMPT = 10.0
_NEXT_ATTEMPT = 1.25
_FIRST_ATTEMPT = 1.5
# No attempt takes longer than this until one has found nothing in it (then twice that, and so on): on contest S
# at its full limit the first price's share was 74 s, unproven, for an answer that only brackets the price
# (overflowing 4.6e11); the answers at the next prices came within 10 s. A price whose attempt found nothing is
# asked again, with that longer time, while time is left (not when it was cut short as a slow price among quick
# ones, on purpose): it says nothing about the price.
_LONGEST_ATTEMPT = 30.0
# While the median attempt has taken at most this share of the time to ``give_up``, the bracket and bisection
# may run on to ``give_up``: on the planner's cores under a budget at a 5 s limit the bisection needed ten
# 0.3 s attempts (from 2^12 to 2^-22) and gave 1.006x the 30 s answer, where the other searches gave 1.42x;
# at 0.1, GPT-6.7B (8, 8)'s 0.5 s attempts were not quick in one process at 5 s (1.16x, against 1.0005x
# one attempt later).
_QUICK_ATTEMPT = 0.2
# Meanwhile an attempt gets at most this many times the median attempt (at least _SHORT_ATTEMPT): there the
# price 2^-48 (memory nearly free) took toulbar2 2.3 s, unproven, and left no time for the bisection.
_QUICK_CAP = 4.0
# The least time an attempt is cut to: toulbar2's whole second after the core is reduced again.
_SHORT_ATTEMPT = 2.0
# After an attempt that answered unproven, the next gets at most this share of its time (at least
# _SHORT_ATTEMPT): toulbar2 finds its answer early and spends the rest failing to prove it. On the planner's
# GPT-6.7B (2, 4) core under a budget, the answer at 2^-22 came 1.4 s into a 9 s attempt, and a 4 s attempt
# gave the same; the first attempt took 9.3 s of the bisection's 21 s and left no second one (30 s:
# 1.157x the best long run, against 0.99x with the cap). After one that found nothing, twice its time again.
# With ``probe`` and less than _FULL_ATTEMPT to its end, the first attempt starts with a short one (at most
# _ATTEMPT_SHARE of its time, at least _SHORT_ATTEMPT), then, when that found nothing, takes the rest at the
# same price. In one process at 5 s the first attempt took all of the bisection's time on the planner's
# cores, whose answers come in under a second (GPT-6.7B (2, 4) under a budget: 1.23x the best, 1.08x with
# the probe; MoE 1.07x, 1.01x). It is not for the parallel workers: contest A's cores answer only after 8 s
# of toulbar2's preprocessing, and at a quarter of A's limit its worker has 9.6 s, one full attempt (1.0038x
# the best known; 1.12x when a probe took 3 s of it).
_UNPROVEN_SHARE = 0.5
# The learned prices (:func:`learned_prices`) stop after this many of their rounds in a row without a cheaper fit.
_LEARNED_PATIENCE = 3
_LEARNED_TOL = 0.5
# ... and ask toulbar2 at most this many scales each: where the rounds had lowered the multipliers far (x0.9 a
# round where a point fits), no scale up to 2^15 fitted contest S (6.3e7 over at each), and the bracket spent
# 62 s on ten scales.
_LEARNED_ATTEMPTS = 4
# ... under multipliers at least this share of the first (uniform) one. The rounds lower a point's multiplier
# a tenth each round it fits, so after 200 rounds most were 1e-9 of it, and toulbar2 filled those points: on
# S no scale up to 2^15 fitted. From S's answer at 2^17, after 83 rounds (most points at 0.034 of it), scale 1
# overflowed by 1.25e9 and scale 2 fitted at 1.775e9; floored at a quarter, scale 1 gave 1.589e9, 4.1e7 over.
_LEARNED_FLOOR = 0.25
# The point prices (:func:`point_prices`) price at most this many points, and bisect their exponent to this.
_POINT_MOST = 32
_POINT_TOL = 0.25
# The node weights (:func:`node_weights`): toulbar2 answers under this many prices per node a round, spread
# over each node's bracket; the share of their time kept for the forest rounds at the end; the rounds' first
# multiplier, this
# many doublings below the highest uniform price that overflowed; and how far over the limit (overflow summed
# over the points, as a share of the limit) an answer may be for the rounds to start from it.
_WEIGHT_TASKS = 2
_WEIGHT_ATTEMPT = 8.0
_WEIGHT_ROUNDS_SHARE = 0.15
_WEIGHT_ROUNDS_BELOW = 4.0
_WEIGHT_NEAR = 1.0
# ... and they stop after this many rounds in a row without an answer, fitting or near, cheaper than any before.
_WEIGHT_PATIENCE = 3
# They run only with time for this many rounds (else the uniform bisection and learned prices do): contest S's
# answers came near enough for the forest rounds to pay after 4-9 rounds; at half its limit (3 rounds) they
# gave 1.600e9, against 1.568e9 from the learned prices.
_WEIGHT_MIN_ROUNDS = 6
# A node's bracket grows by these factors a round: its top when its highest price overflowed, its bottom (down)
# when no price did. After the first such round in a row the power grows with the streak (the bottom's by 1.25
# a round), less so as the rounds go on (_WEIGHT_FADE), at most the caps. The bottom of a node that no answer
# has overflowed at yet drops by the bottom's cap at once.
_WEIGHT_UP, _WEIGHT_UP_MOST = 1.35, 100.0
_WEIGHT_DOWN, _WEIGHT_DOWN_MOST = 1.5, 1000.0
_WEIGHT_FADE = 0.175


def available() -> bool:
    """Whether toulbar2 (``pytoulbar2``) can be imported."""
    try:
        import pytoulbar2  # noqa: F401
    except ImportError:
        return False
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class CfnAnswer:
    """toulbar2's answer on a memory-free core.

    ``choice`` is the best choice found (None when none was found in time),
    ``bound`` a lower bound on the core's least cost (``-inf`` when unknown),
    and ``proven`` whether toulbar2 closed the search (the choice is then
    optimal up to the rounding of the costs).
    """

    choice: np.ndarray | None
    bound: float
    proven: bool


def minimise(red: Reduction, deadline: float, *, seed: int = 0) -> CfnAnswer | None:
    """The least-cost choice of ``red``'s core with memory ignored, by ``deadline``.

    Returns None when toulbar2 is not installed or less than a second is left.
    Forbidden pairs (infinite entries, or entries priced ``red.forbidden``) are
    hard constraints.
    """
    n = red.num_core
    seconds = math.floor(deadline - time.perf_counter())
    if seconds < MIN_SECONDS or not available():
        return None
    if n == 0:
        return CfnAnswer(np.zeros(0, dtype=np.int64), 0.0, True)
    import pytoulbar2

    nodes = [np.asarray(c, dtype=np.float64) for c in red.node_costs]
    tables = _hard_tables(red)
    offset = 0.0
    shifted = []
    for arr in (*nodes, *tables):
        finite = arr[np.isfinite(arr)]
        low = float(finite.min()) if finite.size else 0.0
        offset += low
        shifted.append(arr - low)
    top = max((float(a[np.isfinite(a)].max(initial=0.0)) for a in shifted), default=0.0)
    bits = min(_CELL_BITS, math.log2(_TOTAL_COST / max(len(shifted), 1)))
    scale = 2.0 ** math.floor(bits - math.log2(top)) if top > 0 else 1.0

    _default_search(pytoulbar2.tb2.option)
    cfn = pytoulbar2.CFN(verbose=-1, seed=seed)
    wcsp = cfn.CFN.wcsp
    for k, c in enumerate(nodes):
        wcsp.makeEnumeratedVariable(f"x{k}", 0, c.size - 1)
    for k, arr in enumerate(shifted[:n]):
        if arr.size > 1 and arr.max() > 0:
            wcsp.postUnaryConstraint(k, np.floor(arr * scale).tolist(), False)
    for (u, v), arr in zip(red.edges, shifted[n:], strict=True):
        if arr.max() > 0:
            wcsp.postBinaryConstraint(int(u), int(v), np.floor(arr * scale).ravel().tolist(), False)
    try:
        found = cfn.Solve(timeLimit=int(seconds))
    except cfn.Contradiction:
        found = None
    finally:
        _disarm_timer()
    dual = float(cfn.GetDDualBound())
    bound = dual / scale + offset
    if found is None:
        return CfnAnswer(None, bound, False)
    return CfnAnswer(np.asarray(found[0], dtype=np.int64), bound, float(found[1]) <= dual)


def _disarm_timer() -> None:
    """Stop the CPU-time timer toulbar2 arms for its time limit (``ITIMER_VIRTUAL``, process-wide).

    A solve that returns before its limit leaves it armed, and its ``SIGVTALRM`` handler, which allocates,
    then fires during whatever runs that many CPU-seconds later: inside ``malloc`` in an XLA compile it
    deadlocked the process (a UNet planned on (2, 4) hung at 0% CPU). ``setitimer`` may be called from any
    thread."""
    import signal

    if hasattr(signal, "setitimer"):
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)


def _default_search(option) -> None:
    """Set toulbar2's default search (hybrid best-first branch and bound) in pytoulbar2's ``option``.

    pytoulbar2's options are global to the process, and ``CFN()`` does not reset them: a solve elsewhere in
    the process built with ``CFN(vns=...)`` would leave every later solve running its variable-neighbourhood
    search, with other answers and bounds. ``option.hbfs`` is left as it is: toulbar2 raises it during a
    search (from 1 to ``hbfsGlobalLimit``, 32768), and later solves start from there. Reset to 1 before each
    solve, contest M's priced cores lost their proofs (2^8: unproven after 11 s, against proven in 4.3 s)
    and M ended 0.25% dearer.
    """
    option.searchMethod, option.lds, option.restart, option.vnsInitSol = 0, 0, -1, -4


def _hard_tables(red: Reduction) -> tuple[np.ndarray, ...]:
    """``red``'s edge tables with its priced forbidden pairs infinite again."""
    if not np.isfinite(red.forbidden):
        return red.edge_costs
    return tuple(np.where(m == red.forbidden, np.inf, m) for m in red.edge_costs)


def penalised_core(red: Reduction, lam, deadline: float | None = None) -> Reduction:
    """``red``'s core with ``lam * usage`` added to each node's costs (``lam`` one price or one per core node),
    reduced again (every node is memory-free)."""
    lam = np.broadcast_to(np.asarray(lam, dtype=np.float64), (red.num_core,))
    costs = tuple(c if m is None else c + x * m for c, m, x in zip(red.node_costs, red.node_memory, lam, strict=True))
    sub = ShardingProblem(node_costs=costs, edges=red.edges, edge_costs=_hard_tables(red))
    return reduce_problem(sub, with_memory=False, deadline=deadline)


def free_bound(red: Reduction, deadline: float, *, seed: int = 0) -> float:
    """A lower bound on ``red``'s least cost with memory ignored (so also under its memory rows), or ``-inf``.

    toulbar2 runs on the core reduced again without its memory (exact reductions: a third to a tenth of
    the nodes on the contest cores, and a quicker preprocessing); the reductions add a constant to every
    choice's cost, read off toulbar2's choice. A solve stopped early still gives its dual bound.
    """
    sub = penalised_core(red, 0.0, deadline)
    return priced_bound(red, 0.0, sub, minimise(sub, deadline, seed=seed))


def priced_bound(red: Reduction, lam, sub: Reduction, found: CfnAnswer | None) -> float:
    """A lower bound on the least ``cost + lam * usage`` over ``red``'s choices (memory ignored), from toulbar2's
    answer ``found`` on ``sub = penalised_core(red, lam)``, or ``-inf``.

    toulbar2's bound is on ``sub``; the reductions add the same constant to every choice's cost, read off
    toulbar2's choice.
    """
    if found is None or found.choice is None or not np.isfinite(found.bound):
        return -np.inf
    choice = sub.expand(found.choice, red.num_core)
    lam = np.broadcast_to(np.asarray(lam, dtype=np.float64), (red.num_core,))
    priced = math.fsum(float(x * m[c]) for x, m, c in zip(lam, red.node_memory, choice, strict=True)
                       if m is not None and x)
    return found.bound + flat_costs(red).cost(choice) + priced - flat_costs(sub).cost(found.choice)


def start_exponent(red: Reduction, rows: MemoryRows) -> float:
    """Where to start the bisection: the exponent (over ``plain_scale(red)``) of a typical price at which a node
    would trade memory for cost, rounded down.

    At the least-memory choice, each node's trade price is the most that one of its strategies saves in local
    cost (its neighbours fixed) per byte it adds; the start is the ``_SLOPE_QUANTILE`` of those prices.
    Unlike a fixed exponent this follows the units of the costs and usages (seconds and bytes in the
    planner's problems, integers in the contest's).
    """
    state = CoreState(red, rows, min_memory_choice(red))
    prices = []
    for k in np.flatnonzero(state.mem_nodes):
        local, mem, cur = state.local_cost(k), red.node_memory[k], state.choice[k]
        gain, extra = local[cur] - local, mem - mem[cur]
        trade = (extra > 0) & (gain > 0) & np.isfinite(gain)
        if trade.any():
            prices.append(float((gain[trade] / extra[trade]).max()))
    if not prices:
        return _START_EXPONENT
    return float(math.floor(math.log2(np.quantile(prices, _SLOPE_QUANTILE) / plain_scale(red))))


def penalty_bisection(red: Reduction, rows: MemoryRows, deadline: float, seed: int, *, log, post=None,
                      start: float | None = None, stats: dict | None = None, give_up: float | None = None,
                      probe: bool = False, offer=None) -> CoreState | None:
    """The cheapest fitting choice from toulbar2's answers under memory prices, and from the descent that
    starts at the highest overflowing one; None if none fits.

    ``red`` is the :func:`~autoshard.solver.penalty.soften`-ed core. One price
    ``plain_scale(red) * 2**e`` for every node starts at ``e = start``
    (:func:`start_exponent` when None), steps out in doubling steps until one
    answer fits and one does not (bisecting to ``_START_STEP`` apart).

    When toulbar2 proved nothing there and time is left for ``_WEIGHT_MIN_ROUNDS`` of its rounds,
    :func:`node_weights` follows: a price per node, bracketed by the answers, then forest rounds from the
    last answer near the limit (contest S at its full limit fitted at 1.5372e9, where the learned prices
    below gave 1.569e9). Otherwise, when toulbar2 proved some answer,
    :func:`point_prices`: memory priced only at the points where answers overflowed most, from the least
    fitting exponent (contest A fitted at 1.0003x the best known, M at 1.0000x, against 1.003x from the
    uniform and learned prices). Then the uniform price is bisected to ``_BISECT_TOL``, and
    :func:`learned_prices` starts from the answer at the highest price that overflowed, at that price:
    forest rounds with per-point multipliers that follow the overflow, then toulbar2 under the node prices
    those multipliers learned, then rounds from its answer, and so on. An answer that overflows is repaired
    (:func:`~autoshard.solver.penalty.fitted`) and kept when it then fits (not in the node weights, whose
    repairs never paid). ``post(state)`` is called with each new best fit; ``offer(state, mult)``, when
    given, with each round's nearest answer of the node weights (a start for another search's forest rounds
    from multipliers ``mult``); ``stats["cfn_attempts"]`` counts the toulbar2 solves.

    While nothing fits, or while the bracket and bisection go on with quick
    attempts (``_QUICK_ATTEMPT``), attempts may run on to ``give_up`` (when
    later than ``deadline``): on contest A at a 15 s limit the first price
    (1.004x the best known) needs 8 s of toulbar2, and the bisection's share
    of a worker that started late left it 7. An attempt after one answered
    unproven gets half its time, and none more than ``_LONGEST_ATTEMPT``
    until one found nothing; a price whose attempt found nothing is asked
    again, with twice the time; with ``probe`` and less than one full
    attempt's time, the first starts with a short one, then takes the rest at
    the same price when that found nothing (see ``_UNPROVEN_SHARE``).
    """
    run = _PricedAttempts(red, rows, deadline, give_up, seed=seed, log=log, post=post,
                          stats={} if stats is None else stats, probe=probe, offer=offer)
    base = plain_scale(red)
    uniform = _Scaled(run, base, "penalty 2^")
    start = start_exponent(red, rows) if start is None else start
    log(f"cfn penalty: starting at 2^{start:g}")
    bracket_and_bisect(uniform, uniform.time_left, start, _START_STEP, _START_STEP)
    bracketed = uniform.over is not None and np.isfinite(uniform.fit_e)
    if bracketed and not run.proven and _weights_have_time(run):
        run.bisecting = False
        node_weights(run, uniform.over, uniform.over_e, uniform.fit_e)
        return run.best
    if bracketed and run.proven:
        point_prices(run, uniform.over, uniform.fit_e)
    if bracketed:
        bisect(uniform, uniform.time_left, uniform.over_e, uniform.fit_e, _BISECT_TOL)
    run.bisecting = False
    if uniform.over is not None:
        learned_prices(run, uniform.over, base * 2.0**uniform.over_e)
    return run.best


class _PricedAttempts:
    """toulbar2's answers under memory prices, the best fit among them, and the time each may take."""

    def __init__(self, red: Reduction, rows: MemoryRows, deadline: float, give_up: float | None, *, seed: int,
                 log, post, stats: dict, probe: bool = False, offer=None):
        self.red, self.rows, self.deadline, self.give_up = red, rows, deadline, give_up
        self.seed, self.log, self.post, self.stats = seed, log, post, stats
        self.best: CoreState | None = None
        self.began = time.perf_counter()
        self.took: list[float] = []  # the seconds of each attempt that answered
        self.need = _FIRST_ATTEMPT  # the least time left to start an attempt with
        self.cap = _LONGEST_ATTEMPT  # the most time the next attempt may take
        self.floor = _SHORT_ATTEMPT  # the least the cap is cut to
        self.cut_short = False  # whether the last attempt was cut short as a slow price among quick ones
        self.probe = probe  # whether the first attempt may start with a short probe
        self.bisecting = True
        self.proven = False  # whether some attempt was proven optimal
        self.last: tuple | None = None  # the last attempt's prices, priced core and answer
        self.offer = offer  # offer(state, mult): sends a start for forest rounds to the other searches

    def quick(self) -> bool:
        """Whether the bracket and bisection go on with quick attempts (they may then run on to ``give_up``): each
        takes at most ``_QUICK_ATTEMPT`` of the time to ``give_up``, or that time is short of one full attempt."""
        if self.give_up is None or not self.bisecting or not self.took:
            return False
        span = self.give_up - self.began
        return bool(np.median(self.took) <= _QUICK_ATTEMPT * span or span < _FULL_ATTEMPT)

    def final(self) -> float:
        """The latest any of the bisection's searches may run: ``give_up`` when that is later than ``deadline``."""
        return self.deadline if self.give_up is None else max(self.deadline, self.give_up)

    def latest(self) -> float:
        """The end of the next attempt's window: :meth:`final` while nothing fits or the attempts are quick."""
        return self.final() if self.best is None or self.quick() else self.deadline

    def time_left(self) -> bool:
        return self.latest() - time.perf_counter() > self.need

    def attempt(self, lam, what: str, repair: bool = True) -> CoreState | None:
        """The answer under prices ``lam`` (None when toulbar2 found none in time); keeps it, or (with ``repair``)
        its repair, when it fits."""
        t0 = time.perf_counter()
        end = self.latest()
        until = min(end, t0 + max(_ATTEMPT_SHARE * (end - t0), _FULL_ATTEMPT), t0 + self.cap)
        self.cut_short = False
        if self.quick():  # a slow price among quick ones (memory nearly free) is cut short; it only brackets
            short = t0 + max(_SHORT_ATTEMPT, _QUICK_CAP * float(np.median(self.took)))
            self.cut_short = short < until
            until = min(until, short)
        sub, found = self._solved(lam, until, what)
        self.last = (lam, sub, found)
        if found is None or found.choice is None:
            self.need = max(self.need, 2.0 * (until - t0))
            self.cap = max(self.cap, self.need)
            self.log(f"cfn {what}: no answer in time ({time.perf_counter() - t0:.1f}s)")
            return None
        self.took.append(time.perf_counter() - t0)
        self.proven |= found.proven
        self.need = max(self.need, _NEXT_ATTEMPT * float(np.median(self.took)))
        if not found.proven:
            self.cap = max(_UNPROVEN_SHARE * self.took[-1], self.floor)
            self.need = max(_FIRST_ATTEMPT, min(self.need, _NEXT_ATTEMPT * self.cap))
        state = CoreState(self.red, self.rows, sub.expand(found.choice, self.red.num_core))
        kept = state
        said = f"cost {state.total_cost():.6g}, overflow {state.overflow():.3g}"
        if state.overflow() > 0 and not repair:
            kept = None
        elif state.overflow() > 0:
            kept = fitted(state, end, self.seed)
            said += f", repaired: {'none' if kept is None else f'cost {kept.total_cost():.6g}'}"
        if kept is not None:
            self.keep(kept)
        self.log(f"cfn {what}: {said}{' (proven)' if found.proven else ''} ({time.perf_counter() - t0:.1f}s)")
        return state

    def hold_quickest(self) -> None:
        """From now on no attempt is cut below ``_NEXT_ATTEMPT`` times the quickest one that answered: halved
        attempts answered late or not at all (contest S's learned prices, at 2 s; contest A's point prices at
        3.9 s and again at 8.1 s, where its attempts had answered in 7.3-8.0 s)."""
        self.floor = max(self.floor, _NEXT_ATTEMPT * min(self.took, default=0.0))
        self.cap = max(self.cap, self.floor)

    def hold(self, seconds: float) -> None:
        """From now on each attempt takes ``seconds`` (longer after one that found nothing)."""
        self.floor = self.cap = max(self.floor, seconds)

    def last_bound(self) -> float:
        """The last attempt's lower bound on its priced cost (:func:`priced_bound`; ``-inf`` when none), computed
        when asked: only the point prices turn it into a bound under the limit."""
        return -np.inf if self.last is None else priced_bound(self.red, *self.last)

    def best_cost(self) -> float:
        """The cost of the best fit so far (``inf`` while none)."""
        return np.inf if self.best is None else self.best.total_cost()

    def keep(self, state: CoreState) -> None:
        """Hold the fitting ``state`` (and post it) when it is free of forbidden pairs and the cheapest yet."""
        if state.overflow() <= 0 and not len(violations(state)) and (
                self.best is None or state.total_cost() < self.best.total_cost()):
            self.best = state
            if self.post is not None:
                self.post(state)

    def _solved(self, lam, until: float, what: str) -> tuple[Reduction, CfnAnswer | None]:
        """The core priced by ``lam`` and toulbar2's answer on it by ``until``: first by a short probe, when this is
        the first attempt of a bisection that may probe and there is no time for a full one."""
        t0 = time.perf_counter()
        probe, self.probe = self.probe and until - t0 < _FULL_ATTEMPT, False
        short = min(until, t0 + max(_ATTEMPT_SHARE * (until - t0), _SHORT_ATTEMPT)) if probe else until
        sub = penalised_core(self.red, lam, short)
        found = minimise(sub, short, seed=self.seed)
        self.stats["cfn_attempts"] = self.stats.get("cfn_attempts", 0) + 1
        if short < until and (found is None or found.choice is None):
            self.log(f"cfn {what}: nothing in a short first attempt ({time.perf_counter() - t0:.1f}s); the rest")
            found = minimise(sub, until, seed=self.seed)
            self.stats["cfn_attempts"] += 1
        return sub, found


def learned_prices(run: _PricedAttempts, over: CoreState, lam: float) -> None:
    """Forest rounds from the overflowing ``over`` under per-point multipliers (all ``lam`` at first) that follow
    the overflow; then toulbar2 under the node prices (:func:`~autoshard.solver.penalty.node_prices`) the
    multipliers had at the rounds' best fit (floored at ``_LEARNED_FLOOR * lam``), scaled by a power of two
    bracketed and bisected to ``_LEARNED_TOL`` for the least that fits (at most ``_LEARNED_ATTEMPTS``
    scales); then rounds from the answer at the highest scale that overflowed, under those multipliers so
    scaled; and so on. Each fit goes to ``run.keep``; toulbar2's attempts here are never cut below the
    quickest one that answered.

    The rounds are a local search, so toulbar2's least-cost choice under their prices overflows far more than
    their own (contest M: by 3.4e14 where they fitted); the scale brings its answer back to a little over the
    limit. The rounds run to ``run.final()`` (they stop themselves when their fits stop improving,
    ``GENTLE_STEPS``), toulbar2's attempts while ``run.time_left()``; the whole stops after
    ``_LEARNED_PATIENCE`` rounds in a row without a cheaper fit, or when no scaled answer overflowed.
    """
    red, rows = run.red, run.rows
    priced = priced_nodes(red, rows)
    mult = np.full(rows.num_points, float(lam))
    stale, best = 0, run.best_cost()
    run.hold_quickest()
    for k in itertools.count():
        fit = lagrangian_fit(red, rows, over.choice, mult=mult, deadline=run.final(), seed=run.seed + k,
                             log=lambda m: run.log(f"cfn {m}"), steps=GENTLE_STEPS)
        if fit.state is not None:
            run.keep(fit.state)
        stale, best = (0 if run.best_cost() < best else stale + 1), run.best_cost()
        if stale >= _LEARNED_PATIENCE or not run.time_left():
            return
        learned = np.maximum(fit.mult, _LEARNED_FLOOR * lam)
        scaled = _Scaled(run, node_prices(rows, learned, priced), f"learned prices {k + 1} x2^",
                         most=_LEARNED_ATTEMPTS)
        bracket_and_bisect(scaled, scaled.time_left, 0.0, 1.0, _LEARNED_TOL)
        if scaled.over is None:
            return
        over, mult = scaled.over, learned * 2.0**scaled.over_e


def point_prices(run: _PricedAttempts, over: CoreState, e: float) -> None:
    """toulbar2 under memory priced only at the points where answers overflowed most: per-point multipliers
    ``plain_scale * 2**e`` at those points and 0 elsewhere, so a node pays that price per byte once for each of
    them it is live at (the memory rows' Lagrangian with its multipliers on a few rows).

    The points start with the one where ``over`` (the uniform price's highest overflowing answer) overflows
    most. An answer that overflows most at a point not yet priced adds that point and is asked again at the
    same ``e`` (at most ``_POINT_MOST`` points); one that overflows most at a priced point raises ``e``; one
    that fits lowers it; ``e`` steps by ``_START_STEP / 4`` until it is bracketed, then bisects to
    ``_POINT_TOL``. The first ``e`` is the least uniform exponent that fitted. Each fit, or repair of
    an overflowing answer that fits, goes to ``run.keep``.

    These prices are the memory rows' Lagrangian relaxation, so toulbar2's bound under them, less the
    multipliers times the priced points' capacities, is a lower bound under the memory limit; the best of
    them goes to ``run.stats["free_bound"]``.

    A uniform price charges every byte at every point, and on the contest cores memory binds at a few points
    only: contest A's uniform answers fitted at 6.570e9 at best (2^11.5, 8.6% under the limit at its fullest
    point) and overflowed by 5% at 2^11; priced at the point where that answer overflowed most, and then at a
    second, A fitted at 6.5503e9 (1.0003x the best known) in two attempts, 16 s. Contest M fitted at 4.9937e10
    (1.0002x) in eight attempts, 64 s, against 5.01e10 from its uniform and learned prices.
    """
    rows, base = run.rows, plain_scale(run.red)
    run.hold_quickest()
    points = [_fullest(over)]
    lo, hi, step = -np.inf, np.inf, _START_STEP / 4
    while run.time_left():
        live = sum(((rows.lo <= p) & (rows.hi > p)).astype(np.float64) for p in points)
        scaled = _Scaled(run, base * live, f"point prices ({len(points)}) 2^")
        fits = scaled(e)
        bound = run.last_bound() - base * 2.0**e * float(rows.cap[points].sum())
        if bound > run.stats.get("free_bound", -np.inf):
            run.stats["free_bound"] = bound
        worst = None if fits or scaled.over is None else _fullest(scaled.over)
        if fits:
            hi = e
        elif worst is None:  # no answer in the time left
            return
        elif worst not in points and len(points) < _POINT_MOST:
            points.append(worst)
            continue
        else:
            lo = e
        if hi - lo <= _POINT_TOL:
            return
        if np.isfinite(lo) and np.isfinite(hi):
            e = 0.5 * (lo + hi)
        else:
            e = e - step if np.isfinite(hi) else e + step


def node_weights(run: _PricedAttempts, over: CoreState, over_e: float, fit_e: float) -> None:
    """toulbar2 under a price per node, each bracketed by the answers (:class:`_NodeBrackets`), and forest rounds
    from the answers that come near the limit.

    Each round asks ``_WEIGHT_TASKS`` prices per node, spread over its bracket, which starts between the uniform
    prices ``plain_scale * 2**over_e`` (overflowed) and ``2**fit_e`` (fitted): a node live at a point where an
    answer overflowed needs a higher price, one live only where answers fitted may have a lower one. Each
    attempt takes the median attempt so far, at most ``_WEIGHT_ATTEMPT`` seconds (at least ``_SHORT_ATTEMPT``).
    An answer is near when it overflows by at most ``_WEIGHT_NEAR`` of the limit. Forest rounds
    (:func:`~autoshard.solver.penalty.lagrangian_fit`) from a near answer, their multipliers starting
    ``_WEIGHT_ROUNDS_BELOW`` doublings under ``2**over_e`` (so they are raised only where it overflows), are
    a draw: on contest S about one near answer in three is a start whose rounds fit below 1.54e9, and
    nothing in the answer tells which. So with another search to send them to (``run.offer``, the parallel
    workers), each round's cheapest near answer is offered as a start (the other worker draws its forest
    rounds, :func:`~autoshard.solver.solve.search_core`'s windows), and the rounds of prices go on until
    ``_WEIGHT_ROUNDS_SHARE`` of their time is left; alone, they stop ``_WEIGHT_PATIENCE`` rounds after the
    last one with an answer, fitting or near, cheaper than every one before. Either way the rest of the
    time goes to forest rounds from the last near answer (``over`` when none came). Fits go to
    ``run.keep``.

    This is for cores where toulbar2 proves nothing, so that its answers need not follow their prices:
    contest S's answers under the uniform and learned prices came no nearer than 1.575e9 (1.9e7 over), and
    forest rounds from them fitted at 1.58-1.64e9. Under node prices, near answers come every two or three
    rounds. With both workers, S at its full limit fitted at 1.5370e9, 1.5482e9 and 1.5431e9 with 8, 6 and
    10 s attempts, against 1.5466-1.5564e9 from the learned prices (one worker alone: 1.5369e9 at 8 s, but
    1.6086e9 and 1.6036e9 at 6 and 10 s, from one draw each).
    """
    red, rows = run.red, run.rows
    base = plain_scale(red)
    priced = priced_nodes(red, rows)
    brackets = _NodeBrackets(priced, base * 2.0**over_e, base * 2.0**fit_e, over)
    run.hold(_weight_seconds(run))
    start, keep = over, _WEIGHT_ROUNDS_SHARE * max(run.latest() - time.perf_counter(), 0.0)
    cheapest, stale = np.inf, 0  # the cheapest answer that fitted or came near, and the rounds since it fell
    mult = np.full(rows.num_points, base * 2.0**(over_e - _WEIGHT_ROUNDS_BELOW))
    for k in itertools.count(1):
        asked = []
        for j in range(_WEIGHT_TASKS):
            prices, state = brackets.prices(j, _WEIGHT_TASKS), None
            while state is None and run.latest() - time.perf_counter() > run.need + keep:
                state = run.attempt(prices, f"node weights {k}.{j + 1}", repair=False)
            if state is None:
                break
            asked.append((prices, state))
            if state.overflow() <= _WEIGHT_NEAR * rows.limit and state.total_cost() < cheapest:
                cheapest, stale = state.total_cost(), -1
        near = [st for _, st in asked if 0 < st.overflow() <= _WEIGHT_NEAR * rows.limit]
        if near:
            start = near[-1]
            if run.offer is not None:
                run.offer(min(near, key=lambda st: st.total_cost()), float(mult[0]))
        stale += 1
        if len(asked) < _WEIGHT_TASKS or (stale >= _WEIGHT_PATIENCE and run.offer is None):
            break
        brackets.update(asked)
    fit = lagrangian_fit(red, rows, start.choice, mult=mult, deadline=run.final(), seed=run.seed,
                         log=lambda m: run.log(f"cfn node weights: {m}"), steps=GENTLE_STEPS)
    if fit.state is not None:
        run.keep(fit.state)


def _weight_seconds(run: _PricedAttempts) -> float:
    """The time each of :func:`node_weights`' attempts takes: the median attempt so far, at least
    ``_SHORT_ATTEMPT`` and at most ``_WEIGHT_ATTEMPT``."""
    median = float(np.median(run.took)) if run.took else _WEIGHT_ATTEMPT
    return max(_SHORT_ATTEMPT, min(_WEIGHT_ATTEMPT, median))


def _weights_have_time(run: _PricedAttempts) -> bool:
    """Whether the time to ``run.deadline`` holds ``_WEIGHT_MIN_ROUNDS`` rounds of node weights besides the
    forest rounds' share."""
    left = (1.0 - _WEIGHT_ROUNDS_SHARE) * (run.deadline - time.perf_counter())
    return left >= _WEIGHT_MIN_ROUNDS * _WEIGHT_TASKS * _weight_seconds(run)


class _NodeBrackets:
    """A bracket of prices per priced node, moved by the answers under prices inside it (:func:`node_weights`)."""

    def __init__(self, priced: np.ndarray, lo: float, hi: float, over: CoreState):
        self.priced = priced
        self.lo = np.where(priced, lo, 0.0)
        self.hi = np.where(priced, hi, 0.0)
        # whether some answer overflowed where the node is live (``over``, the answer at ``lo``, did)
        self.ever_over = _live_over(over) & priced
        self.streak = np.zeros(priced.size)  # rounds in a row the bracket grew the same way (+ up, - down)
        self.rounds = 0

    def prices(self, j: int, tasks: int) -> np.ndarray:
        """The ``j``-th of ``tasks`` prices: ``(j + 1) / tasks`` of the way up each bracket."""
        return self.lo + (j + 1) / tasks * (self.hi - self.lo)

    def update(self, asked: list[tuple[np.ndarray, CoreState]]) -> None:
        """Move the brackets after one round's ``(prices, answer)`` pairs, the prices in rising order.

        Per node, the bottom rises to the price of an answer that overflowed where it is live while no lower
        price's answer fitted there, and the top falls to the price of the cheapest answer that fitted there
        above every one that overflowed. When its highest price overflowed, the top grows; when none did,
        the bottom drops."""
        n = self.priced.size
        fit_seen = np.zeros(n, dtype=bool)
        over_seen = np.zeros(n, dtype=bool)
        over_after_fit = np.zeros(n, dtype=bool)
        best = np.full(n, np.inf)
        for prices, state in asked:
            over = self.priced & _live_over(state)
            fit = self.priced & ~over
            cost = state.total_cost()
            self.lo = np.where(over & ~fit_seen, prices, self.lo)
            take = fit & (~fit_seen | over_after_fit | (cost < best))
            self.hi = np.where(take, prices, self.hi)
            best = np.where(take, cost, best)
            over_seen |= over
            over_after_fit = (over_after_fit | over) & ~fit
            fit_seen |= fit
        fit_seen &= ~over_after_fit
        up = self.priced & ~fit_seen
        down = self.priced & ~over_seen
        self.rounds += 1
        self.streak = np.where(up, np.maximum(self.streak, 0) + 1,
                               np.where(down, np.minimum(self.streak, 0) - 1, self.streak))
        fade = math.exp(-_WEIGHT_FADE * (self.rounds - 1))  # a streak's growth fades with the rounds
        grow = np.minimum(_WEIGHT_UP ** (1.0 + (self.streak - 1.0) * fade), _WEIGHT_UP_MOST)
        self.hi = np.where(up, self.hi * np.where(self.streak > 1, grow, _WEIGHT_UP), self.hi)
        first = np.where(self.ever_over, _WEIGHT_DOWN, _WEIGHT_DOWN_MOST)
        drop = np.minimum(_WEIGHT_DOWN ** (1.0 + (-1.25 * self.streak - 1.0) * fade), _WEIGHT_DOWN_MOST)
        self.lo = np.minimum(np.where(down, self.lo / np.where(self.streak < -1, drop, first), self.lo), self.hi)
        self.ever_over |= over_seen


def _live_over(state: CoreState) -> np.ndarray:
    """Per core node, whether ``state`` overflows at some point the node is live at."""
    hot = np.concatenate([[0], np.cumsum(state.usage > state.cap + state.tol)])
    return hot[state.rows.hi] > hot[state.rows.lo]


def _fullest(state: CoreState) -> int:
    """The memory point where ``state`` overflows most (or is nearest its capacity)."""
    return int(np.argmax(state.usage - state.cap))


class _Scaled:
    """toulbar2's answers under ``prices * 2**e`` (called with ``e``: whether the answer fits), and the answer at
    the highest ``e`` that overflowed (``over``, at ``over_e``)."""

    def __init__(self, run: _PricedAttempts, prices, what: str, most: int | None = None):
        self.run, self.prices, self.what, self.most = run, prices, what, most
        self.over: CoreState | None = None
        self.over_e = -np.inf
        self.fit_e = np.inf  # the lowest ``e`` whose answer fitted
        self.asked = 0  # scales asked (each once, however many attempts it took)

    def time_left(self) -> bool:
        """Whether another scale may be asked: at most ``most`` of them, while the attempts have time."""
        return (self.most is None or self.asked < self.most) and self.run.time_left()

    def __call__(self, e: float) -> bool:
        self.asked += 1
        state = self.run.attempt(self.prices * 2.0**e, f"{self.what}{e:g}")
        while state is None and not self.run.cut_short and self.run.time_left():
            state = self.run.attempt(self.prices * 2.0**e, f"{self.what}{e:g} again")
        fits = state is not None and state.overflow() <= 0
        if state is not None and not fits and e > self.over_e:
            self.over, self.over_e = state, e
        if fits:
            self.fit_e = min(self.fit_e, e)
        return fits
