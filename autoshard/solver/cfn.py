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

toulbar2 works in integer costs: each function is shifted to a least entry
of 0 and scaled by one power of two so that the largest finite entry is near
2**40, then rounded down, so its bound (scaled back) stays a lower bound of
the real costs. Infinite entries (forbidden pairs) stay hard.

pytoulbar2 is imported only when a search needs it; without it
:func:`available` is False and the solver uses its other searches.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from autoshard.solver.local import CoreState, flat_costs
from autoshard.solver.memory import MemoryRows
from autoshard.solver.penalty import bracket_and_bisect, fitted, plain_scale, violations
from autoshard.solver.problem import ShardingProblem
from autoshard.solver.reduce import Reduction, reduce_problem

# Largest scaled finite entry of one function (toulbar2 costs are int64, its
# infinity is 5.1e17), and the cap on the sum of every function's largest entry.
_CELL_BITS = 40
_TOTAL_COST = 2.0**58
# toulbar2 takes whole seconds; a solve is not started with less than this left.
_MIN_SECONDS = 1.0
# The bisection: first exponent of the uniform price (times the plain cost/usage
# scale), first step, and the step at which it stops. The contest cores fit from
# 2**12 (A) and 2**16 (M) and overflow a little below.
_START_EXPONENT = 12.0
_START_STEP = 4.0
_BISECT_TOL = 1.0
# One attempt gets this share of the time left, or _FULL_ATTEMPT seconds when that is more; none starts
# with less than _MIN_ATTEMPT seconds left (toulbar2's preprocessing alone took 3-7 s on the contest
# cores, and an attempt stopped before it ends returns nothing).
_ATTEMPT_SHARE = 0.35
_FULL_ATTEMPT = 10.0
_MIN_ATTEMPT = 4.0


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
    if seconds < _MIN_SECONDS or not available():
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
    dual = float(cfn.GetDDualBound())
    bound = dual / scale + offset
    if found is None:
        return CfnAnswer(None, bound, False)
    return CfnAnswer(np.asarray(found[0], dtype=np.int64), bound, float(found[1]) <= dual)


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
    found = minimise(sub, deadline, seed=seed)
    if found is None or found.choice is None or not np.isfinite(found.bound):
        return -np.inf
    constant = flat_costs(red).cost(sub.expand(found.choice, red.num_core)) - flat_costs(sub).cost(found.choice)
    return found.bound + constant


def penalty_bisection(red: Reduction, rows: MemoryRows, deadline: float, seed: int, *, log, post=None,
                      start: float = _START_EXPONENT, stats: dict | None = None, give_up: float | None = None
                      ) -> CoreState | None:
    """The cheapest fitting choice from toulbar2's answers under memory prices; None if none fits.

    ``red`` is the :func:`~autoshard.solver.penalty.soften`-ed core. One price
    ``plain_scale(red) * 2**e`` for every node starts at ``e = start``, steps
    out in doubling steps until one answer fits and one does not, then bisects
    to ``_BISECT_TOL``. Then the prices go local: nodes live at a point where
    the last overflowing answer overflowed pay the fitting price, the others the
    overflowing one; each answer that still overflows adds its points, and each
    that fits lowers the others' price one doubling (memory is priced high only
    where it binds). An answer that overflows is repaired and cleared of the
    forbidden pairs the repair took, and kept when it then fits. ``post(state)``
    is called with each new best fit; ``stats["cfn_attempts"]`` counts the
    toulbar2 solves. While nothing fits, attempts may run on to ``give_up``
    (when later than ``deadline``): on contest A at a 15 s limit the first
    price (1.004x the best known) needs 8 s of toulbar2, and the bisection's
    share of a worker that started late left it 7.
    """
    stats = {} if stats is None else stats
    base = plain_scale(red)
    best: CoreState | None = None
    over: dict = {}  # the highest overflowing exponent's answer

    def attempt(lam, what: str) -> CoreState | None:
        """The answer under prices ``lam`` (None when toulbar2 found none in time); keeps it, or its repair, when
        it fits."""
        nonlocal best
        t0 = time.perf_counter()
        end = latest()
        until = min(end, t0 + max(_ATTEMPT_SHARE * (end - t0), _FULL_ATTEMPT))
        sub = penalised_core(red, lam, until)
        found = minimise(sub, until, seed=seed)
        stats["cfn_attempts"] = stats.get("cfn_attempts", 0) + 1
        if found is None or found.choice is None:
            log(f"cfn {what}: no answer in time ({time.perf_counter() - t0:.1f}s)")
            return None
        state = CoreState(red, rows, sub.expand(found.choice, red.num_core))
        kept = state
        said = f"cost {state.total_cost():.6g}, overflow {state.overflow():.3g}"
        if state.overflow() > 0:
            kept = fitted(state, deadline, seed)
            said += f", repaired: {'none' if kept is None else f'cost {kept.total_cost():.6g}'}"
        if kept is not None and not len(violations(kept)):
            if best is None or kept.total_cost() < best.total_cost():
                best = kept
                if post is not None:
                    post(best)
        log(f"cfn {what}: {said}{' (proven)' if found.proven else ''} ({time.perf_counter() - t0:.1f}s)")
        return state

    def uniform(e: float) -> bool:
        state = attempt(base * 2.0**e, f"penalty 2^{e:g}")
        fits = state is not None and state.overflow() <= 0
        if state is not None and not fits and e > over.get("e", -np.inf):
            over.update(e=e, state=state)
        if fits:
            over["fit"] = min(e, over.get("fit", np.inf))
        return fits

    def latest() -> float:
        return deadline if best is not None or give_up is None else max(deadline, give_up)

    def time_left() -> bool:
        return latest() - time.perf_counter() > _MIN_ATTEMPT

    bracket_and_bisect(uniform, time_left, start, _START_STEP, _BISECT_TOL)
    if "state" in over and "fit" in over:
        _local_prices(rows, over["state"], base=base, low=over["e"], high=over["fit"], attempt=attempt,
                      time_left=time_left)
    return best


def _local_prices(rows: MemoryRows, state: CoreState, *, base: float, low: float, high: float, attempt,
                  time_left) -> None:
    """Price ``base * 2**high`` on the nodes live where ``state`` (and each later answer that overflows)
    overflowed, ``base * 2**low`` elsewhere, lowered one doubling after each answer that fits; each price
    vector goes to ``attempt(lam, what)`` while ``time_left()``."""
    raised = np.zeros(rows.num_points, dtype=bool)
    while time_left():
        raised |= state.usage - rows.cap > rows.tol
        count = np.concatenate([[0], np.cumsum(raised)])
        hot = count[rows.hi] > count[rows.lo]
        found = attempt(np.where(hot, base * 2.0**high, base * 2.0**low),
                        f"local prices 2^{high:g} on {int(hot.sum())} nodes, 2^{low:g}")
        if found is None:
            return
        if found.overflow() <= 0:
            low -= 1.0
        else:
            state = found
