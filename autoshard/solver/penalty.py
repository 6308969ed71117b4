"""A first feasible solution for large memory-constrained cores, by penalising memory.

With memory priced into node costs (``cost + lam * usage``) the problem has no
memory constraint left, so every node becomes memory-free and the exact leaf and
series eliminations collapse the core far further; a greedy pass finishes the
rest. The multiplier ``lam`` is searched geometrically and then by bisection for
the cheapest choice that still fits the memory limit. Forbidden (infinite) edge
entries are honoured by the eliminations, which is what makes this start finite
where per-node greedy starts are not.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from autoshard.solver.local import CoreState, greedy
from autoshard.solver.memory import MemoryRows
from autoshard.solver.problem import ShardingProblem
from autoshard.solver.reduce import Reduction, reduce_problem

_FORBIDDEN = 1e12


def soften(red: Reduction) -> Reduction:
    """The same core with forbidden edge pairs priced at a huge finite cost."""
    soft = tuple(np.where(np.isfinite(m), m, _FORBIDDEN) for m in red.edge_costs)
    return dataclasses.replace(red, edge_costs=soft)


def violations(state: CoreState) -> np.ndarray:
    """Indices of core edges whose chosen pair is forbidden (or priced as such)."""
    red, ch = state.red, state.choice
    return np.array(
        [k for k, ((u, v), m) in enumerate(zip(red.edges, red.edge_costs, strict=True)) if m[ch[u], ch[v]] >= _FORBIDDEN],
        dtype=np.int64,
    )


def penalised_choice(red: Reduction, rows: MemoryRows, lam: float, deadline: float, seed: int) -> np.ndarray:
    """Core choice minimising ``cost + lam * usage`` (memory limit ignored)."""
    costs = []
    for c, m in zip(red.node_costs, red.node_memory, strict=True):
        costs.append(c if m is None else c + lam * m)
    sub = ShardingProblem(node_costs=tuple(costs), edges=red.edges, edge_costs=red.edge_costs)
    sub_red = reduce_problem(sub, with_memory=False)
    state = greedy(sub_red, None, deadline, seed)
    return sub_red.expand(state.choice, red.num_core)


def penalty_search(
    red: Reduction, rows: MemoryRows, deadline: float, seed: int, log
) -> CoreState | None:
    """The cheapest memory-feasible penalised choice found before ``deadline``, or None.

    ``red`` should be :func:`soften`-ed: the returned state may still use priced
    forbidden pairs, which the window search then removes.
    """
    usage_scale = np.median([m.mean() for m in red.node_memory if m is not None] or [1.0])
    cost_scale = np.median([np.abs(c[np.isfinite(c)]).mean() + 1.0 for c in red.node_costs])
    base = cost_scale / max(usage_scale, 1e-30)
    best: CoreState | None = None
    lo, hi = None, None  # largest infeasible lam, smallest feasible lam (log2 scale)

    def attempt(e: float) -> bool:
        nonlocal best
        t0 = time.perf_counter()
        choice = penalised_choice(red, rows, base * 2.0**e, deadline, seed)
        state = CoreState(red, rows, choice)
        cost, ok = state.total_cost(), state.overflow() <= 0
        log(f"penalty 2^{e:g}: cost {cost:.6g}, overflow {state.overflow():.3g} ({time.perf_counter() - t0:.1f}s)")
        if ok and (best is None or cost < best.total_cost()):
            best = state
        return ok

    e = 0.0
    step = 4.0
    while time.perf_counter() < deadline:
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
    while lo is not None and hi is not None and hi - lo > 0.5 and time.perf_counter() < deadline:
        mid = 0.5 * (lo + hi)
        if attempt(mid):
            hi = mid
        else:
            lo = mid
    return best
