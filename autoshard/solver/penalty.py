"""A first feasible solution for large memory-constrained cores, by penalising memory.

With memory priced into node costs (``cost + lam * usage``) the problem has no
memory constraint left, so every node becomes memory-free and the exact leaf and
series eliminations collapse the core far further; forest descents
(:mod:`forest`) then choose the rest. The multiplier ``lam`` is searched geometrically and then by bisection for
the cheapest choice that still fits the memory limit. Forbidden (infinite) edge
entries are honoured by the eliminations, which is what makes this start finite
where per-node greedy starts are not.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from autoshard.solver.forest import ForestSearch, min_cost_choice
from autoshard.solver.local import CoreState, greedy
from autoshard.solver.memory import MemoryRows
from autoshard.solver.problem import ShardingProblem
from autoshard.solver.reduce import Reduction, reduce_problem

_FORBIDDEN = 1e12
FOREST_PATIENCE = 3
# Cores up to this many nodes are searched as they are for each penalty.
_REREDUCE_NODES = 3000


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


def penalised_choice(
    red: Reduction,
    rows: MemoryRows,
    lam: float,
    deadline: float,
    seed: int,
    start: np.ndarray | None = None,
    *,
    forest_deadline: float | None = None,
) -> np.ndarray:
    """Core choice minimising ``cost + lam * usage`` (memory limit ignored).

    Large cores are reduced again first (with memory priced in, every node is
    memory-free, so the eliminations collapse them), get a greedy pass that is
    always finished, then forest descents until ``forest_deadline``; small ones
    are searched directly, from ``start`` when given.
    """
    costs = []
    for c, m in zip(red.node_costs, red.node_memory, strict=True):
        costs.append(c if m is None else c + lam * m)
    if red.num_core <= _REREDUCE_NODES:
        pen = dataclasses.replace(red, node_costs=tuple(costs))
        state = CoreState(pen, None, min_cost_choice(pen) if start is None else start)
        ForestSearch(state, seed).run(deadline, patience=FOREST_PATIENCE)
        return state.choice
    sub = ShardingProblem(node_costs=tuple(costs), edges=red.edges, edge_costs=red.edge_costs)
    sub_red = reduce_problem(sub, with_memory=False)
    state = greedy(sub_red, None, deadline, seed)
    if forest_deadline is not None:
        # Descents from the greedy choice roughly halve the penalised cost on the
        # contest cores (M: 1.8e11 -> 8.8e10 unpenalised) and clear the forbidden
        # pairs greedy leaves on A.
        ForestSearch(state, seed).run(forest_deadline, patience=FOREST_PATIENCE)
    return sub_red.expand(state.choice, red.num_core)


def penalty_search(
    red: Reduction, rows: MemoryRows, deadline: float, seed: int, log, give_up: float | None = None
) -> CoreState | None:
    """The cheapest memory-feasible penalised choice found before ``deadline``, or None.

    While no penalty has given a feasible choice, the search goes on until
    ``give_up`` (when later than ``deadline``).

    ``red`` should be :func:`soften`-ed: the returned state may still use priced
    forbidden pairs, which the window search then removes.
    """
    usage_scale = np.median([m.mean() for m in red.node_memory if m is not None] or [1.0])
    cost_scale = np.median([np.abs(c[np.isfinite(c)]).mean() + 1.0 for c in red.node_costs])
    base = cost_scale / max(usage_scale, 1e-30)
    best: CoreState | None = None
    give_up = deadline if give_up is None else give_up
    lo, hi = None, None  # largest infeasible lam, smallest feasible lam (log2 scale)

    small = red.num_core <= _REREDUCE_NODES
    if not small:
        return _large_penalty_search(red, rows, base, deadline, give_up, seed, log)

    last = 0.0  # seconds the last attempt took: no attempt starts that cannot finish
    # a bisection needs several attempts; none may eat the whole budget
    per_attempt = max(deadline - time.perf_counter(), 0.0) / 5

    def attempt(e: float) -> bool:
        nonlocal best, last
        t0 = time.perf_counter()
        start = None if best is None else best.choice
        choice = penalised_choice(red, rows, base * 2.0**e, min(deadline, t0 + per_attempt), seed, start)
        state = CoreState(red, rows, choice)
        cost, ok = state.total_cost(), state.overflow() <= 0
        last = time.perf_counter() - t0
        log(f"penalty 2^{e:g}: cost {cost:.6g}, overflow {state.overflow():.3g} ({last:.1f}s)")
        if ok and (best is None or cost < best.total_cost()):
            best = state
        return ok

    def time_left() -> bool:
        # until something fits, searching on beats handing back an infeasible start
        until = deadline if best is not None else max(deadline, give_up)
        return time.perf_counter() + 0.8 * last < until

    e = _node_only_exponent(red, rows, base)
    step = 2.0
    while time_left():
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
    while lo is not None and hi is not None and hi - lo > 0.1 and time_left():
        mid = 0.5 * (lo + hi)
        if attempt(mid):
            hi = mid
        else:
            lo = mid
    return best


def _large_penalty_search(
    red: Reduction, rows: MemoryRows, base: float, deadline: float, give_up: float, seed: int, log
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
    lo, hi = None, None
    last = 0.0

    def attempt(e: float) -> bool:
        nonlocal best, last
        t0 = time.perf_counter()
        until = deadline if best is not None else max(deadline, give_up)
        cap = t0 + max(0.25 * (until - t0), 1.0)
        choice = penalised_choice(red, rows, base * 2.0**e, until, seed, forest_deadline=min(until, cap))
        state = CoreState(red, rows, choice)
        cost, ok = state.total_cost(), state.overflow() <= 0
        last = time.perf_counter() - t0
        log(f"penalty 2^{e:g}: cost {cost:.6g}, overflow {state.overflow():.3g} ({last:.1f}s)")
        if ok and (best is None or cost < best.total_cost()):
            best = state
        return ok

    def time_left() -> bool:
        until = deadline if best is not None else max(deadline, give_up)
        return time.perf_counter() + 0.5 * last < until

    e, step = 0.0, 4.0
    while time_left():
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
    while lo is not None and hi is not None and hi - lo > 0.5 and time_left():
        mid = 0.5 * (lo + hi)
        if attempt(mid):
            hi = mid
        else:
            lo = mid
    return best


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
