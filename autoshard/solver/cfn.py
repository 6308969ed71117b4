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

from autoshard.solver.local import CoreState
from autoshard.solver.memory import MemoryRows
from autoshard.solver.penalty import bracket_and_bisect, clear_forbidden, plain_scale, violations
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
_BISECT_TOL = 0.25
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
    bound = float(cfn.GetDDualBound()) / scale + offset
    if found is None:
        return CfnAnswer(None, bound, False)
    choice = np.asarray(found[0], dtype=np.int64)
    proven = float(found[1]) <= float(cfn.GetDDualBound())
    return CfnAnswer(choice, bound, proven)


def _hard_tables(red: Reduction) -> tuple[np.ndarray, ...]:
    """``red``'s edge tables with its priced forbidden pairs infinite again."""
    if not np.isfinite(red.forbidden):
        return red.edge_costs
    return tuple(np.where(m == red.forbidden, np.inf, m) for m in red.edge_costs)


def penalised_core(red: Reduction, lam: float, deadline: float | None = None) -> Reduction:
    """``red``'s core with ``lam * usage`` added to each node's costs, reduced again (every node is memory-free)."""
    costs = tuple(c if m is None else c + lam * m for c, m in zip(red.node_costs, red.node_memory, strict=True))
    sub = ShardingProblem(node_costs=costs, edges=red.edges, edge_costs=_hard_tables(red))
    return reduce_problem(sub, with_memory=False, deadline=deadline)


def penalty_bisection(red: Reduction, rows: MemoryRows, deadline: float, seed: int, *, log, post=None,
                      start: float = _START_EXPONENT) -> CoreState | None:
    """The cheapest fitting choice from toulbar2's answers under uniform memory prices; None if none fits.

    ``red`` is the :func:`~autoshard.solver.penalty.soften`-ed core. The price
    ``plain_scale(red) * 2**e`` starts at ``e = start``, steps out in doubling
    steps until one answer fits and one does not, then bisects to
    ``_BISECT_TOL``. An answer that overflows is repaired and cleared of the
    forbidden pairs the repair took; it does not count as fitting for the
    bisection, but is kept when it fits after. ``post(state)`` is called with
    each new best fit.
    """
    base = plain_scale(red)
    best: CoreState | None = None

    def attempt(e: float) -> bool:
        nonlocal best
        t0 = time.perf_counter()
        until = min(deadline, t0 + max(_ATTEMPT_SHARE * (deadline - t0), _FULL_ATTEMPT))
        sub = penalised_core(red, base * 2.0**e, until)
        found = minimise(sub, until, seed=seed)
        if found is None or found.choice is None:
            log(f"cfn penalty 2^{e:g}: no answer in time ({time.perf_counter() - t0:.1f}s)")
            return False
        state = CoreState(red, rows, sub.expand(found.choice, red.num_core))
        fits = state.overflow() <= 0
        what = f"cost {state.total_cost():.6g}, overflow {state.overflow():.3g}"
        if not fits:
            fixed = CoreState(red, rows, state.choice)
            if fixed.repair(deadline):
                state = clear_forbidden(fixed, deadline, seed)
            what += f", repaired: cost {state.total_cost():.6g}"
        if state.overflow() <= 0 and not len(violations(state)):
            if best is None or state.total_cost() < best.total_cost():
                best = state
                if post is not None:
                    post(best)
        log(f"cfn penalty 2^{e:g}: {what}{' (proven)' if found.proven else ''} ({time.perf_counter() - t0:.1f}s)")
        return fits

    def time_left() -> bool:
        return deadline - time.perf_counter() > _MIN_ATTEMPT

    bracket_and_bisect(attempt, time_left, start, _START_STEP, _BISECT_TOL)
    return best
