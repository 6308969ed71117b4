"""Block coordinate descent over random induced forests, solved exactly by DP.

Fix every node outside a set ``F`` whose induced subgraph is a forest; then the
best strategies for ``F`` follow from one min-sum pass up each tree and one
argmin pass down (edges to fixed nodes become node costs). The result is never
worse than the current choice, so repeating with fresh random forests is a
monotone local search whose moves change hundreds of nodes at once: it finds
coordinated switches (a whole layer changing its sharding) that single-node
moves cannot, because every intermediate step of such a switch pays resharding.

The DP ignores memory. It is used on problems without a memory limit, and on
the memory-penalised problems of :mod:`penalty`.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from autoshard.solver.local import CoreState


class ForestSearch:
    """Re-optimises random induced forests of a :class:`CoreState` in place."""

    def __init__(self, state: CoreState, seed: int):
        self.state = state
        self.rng = np.random.default_rng(seed)
        self.rounds = 0
        self.improved = 0

    def forest(self, order: np.ndarray) -> np.ndarray:
        """Grow an induced forest in ``order``; returns its member mask.

        A node joins when its neighbours already in the forest lie in distinct
        trees, so the induced subgraph stays acyclic.
        """
        adj = self.state.adj
        n = len(adj)
        root = np.arange(n)

        def find(x: int) -> int:
            while root[x] != x:
                root[x] = root[root[x]]
                x = root[x]
            return int(x)

        member = np.zeros(n, dtype=bool)
        for k in order:
            k = int(k)
            seen = set()
            ok = True
            for x, _ in adj[k]:
                if member[x]:
                    r = find(x)
                    if r in seen:
                        ok = False
                        break
                    seen.add(r)
            if ok:
                member[k] = True
                for r in seen:
                    root[r] = k
        return member

    def solve_forest(self, member: np.ndarray) -> None:
        """Set the members to their best strategies given the rest."""
        state = self.state
        red, adj, choice = state.red, state.adj, state.choice
        n = red.num_core
        unary: list[np.ndarray | None] = [None] * n
        for k in np.flatnonzero(member):
            vec = red.node_costs[k].copy()
            for x, m in adj[k]:
                if not member[x]:
                    vec += m[:, choice[x]]
            unary[k] = vec
        # BFS order per tree, parents first
        parent = np.full(n, -1, dtype=np.int64)
        pmat: list[np.ndarray | None] = [None] * n
        visited = ~member
        order: list[int] = []
        for r in np.flatnonzero(member):
            if visited[r]:
                continue
            visited[r] = True
            head = len(order)
            order.append(int(r))
            while head < len(order):
                k = order[head]
                head += 1
                for x, m in adj[k]:
                    if not visited[x]:
                        visited[x] = True
                        parent[x] = k
                        pmat[x] = m.T  # (S_x, S_k)
                        order.append(x)
        best: list[np.ndarray | None] = [None] * n
        for k in reversed(order):
            p = parent[k]
            if p < 0:
                continue
            t = unary[k][:, None] + pmat[k]
            b = np.argmin(t, axis=0)
            best[k] = b
            unary[p] = unary[p] + t[b, np.arange(t.shape[1])]
        new = np.empty(n, dtype=np.int64)
        for k in order:
            p = parent[k]
            new[k] = int(np.argmin(unary[k])) if p < 0 else int(best[k][new[p]])
        for k in order:
            state.move(k, int(new[k]))

    def run(self, deadline: float, max_rounds: int | None = None, patience: int = 30) -> None:
        """Solve random forests until ``deadline``, ``max_rounds``, or ``patience`` rounds without gain."""
        state = self.state
        n = state.red.num_core
        if n == 0:
            return
        cost = state.total_cost()
        stale = 0
        while time.perf_counter() < deadline and (max_rounds is None or self.rounds < max_rounds):
            member = self.forest(self.rng.permutation(n))
            self.solve_forest(member)
            self.rounds += 1
            new = state.total_cost()
            if new < cost - 1e-12 * max(1.0, abs(cost)):
                self.improved += 1
                cost, stale = new, 0
            else:
                stale += 1
                if stale >= patience:
                    break


def min_cost_choice(red) -> np.ndarray:
    """Per core node, its cheapest strategy ignoring edges."""
    return np.array([int(np.argmin(c)) for c in red.node_costs], dtype=np.int64)


@dataclasses.dataclass(frozen=True, slots=True)
class ForestResult:
    """What :func:`forest_ils` found.

    Attributes:
      state: the best state found.
      restarts: random restarts run after the descent from the given start.
      stalled: True when the stall rule stopped the search, False when the deadline did.
    """

    state: CoreState
    restarts: int
    stalled: bool


def forest_ils(
    state: CoreState,
    deadline: float,
    seed: int,
    *,
    patience: int = 5,
    stall: int | None = None,
    log=None,
) -> ForestResult:
    """Multi-start forest descent: descend from ``state``, then from random choices.

    Descents from different starts end in very different local optima on
    resharding-dominated problems (a greedy start is often among the worst, and
    kicks of the best choice did worse than fresh random starts on a GPT
    training step), so the time goes into many short descents.

    With ``stall``, the restarts stop once the last ``max(stall, r)`` of them
    found nothing cheaper, where ``r`` is the restart that found the best: the
    search has then spent at least as long failing as it took to succeed, so
    the budget goes on only while restarts keep paying off.
    """
    rng = np.random.default_rng(seed)
    red = state.red
    n = red.num_core
    ForestSearch(state, seed).run(deadline, patience=patience)
    best_choice, best_cost = state.choice.copy(), state.total_cost()
    sizes = np.array([c.size for c in red.node_costs])
    restarts, last_gain = 0, 0
    stalled = n <= 1
    while time.perf_counter() < deadline and not stalled:
        restarts += 1
        cand = CoreState(red, state.rows, rng.integers(0, sizes))
        ForestSearch(cand, int(rng.integers(2**31))).run(deadline, patience=patience)
        cost = cand.total_cost()
        if cost < best_cost - 1e-12 * max(1.0, abs(best_cost)):
            best_choice, best_cost, last_gain = cand.choice.copy(), cost, restarts
            if log is not None:
                log(f"forest: restart {restarts} cost {cost:.6g}")
        stalled = stall is not None and restarts - last_gain >= max(stall, last_gain)
    if log is not None:
        log(f"forest: {restarts} restarts, best {best_cost:.6g}{', stalled' if stalled else ''}")
    return ForestResult(CoreState(red, state.rows, best_choice), restarts, stalled)
