"""Fast first solutions and local improvement on the reduced core.

The core is kept as adjacency lists of edge matrices. A move changes one node's
strategy; its cost change is read off the node's "local cost vector" (node cost
plus the edge columns selected by the neighbours' strategies). Memory rows are
tracked incrementally so that a move is only taken when every row it touches
stays under capacity (or, while repairing, when it lowers the overflow).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import time

import numpy as np

from autoshard.solver.memory import MemoryRows, range_max
from autoshard.solver.reduce import Reduction

# What states derive from a core's arrays (adjacency lists, flat costs), kept for the last few
# cores: the searches make many states of one core, and on contest A's core (23k nodes, 41k edges)
# each took 0.25 s to build them, 4 s of a 15 s solve.
_MEMO: collections.OrderedDict = collections.OrderedDict()
_MEMO_SIZE = 6


def _memo(kind: str, parts: tuple, build):
    """``build()``, or its value from the last call with the same ``kind`` and the same objects ``parts``."""
    key = (kind, *(id(p) for p in parts))
    hit = _MEMO.get(key)
    if hit is not None:
        _MEMO.move_to_end(key)
        return hit[1]
    value = build()
    _MEMO[key] = (parts, value)  # holding the parts keeps their ids theirs
    while len(_MEMO) > _MEMO_SIZE:
        _MEMO.popitem(last=False)
    return value


def _adjacency(red: Reduction) -> list[list[tuple[int, np.ndarray]]]:
    """Per core node, ``(neighbour, matrix indexed [own strategy, neighbour's])`` for each edge (shared: read only)."""

    def build():
        adj: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(red.num_core)]
        for (u, v), m in zip(red.edges, red.edge_costs, strict=True):
            adj[u].append((int(v), m))
            adj[v].append((int(u), m.T))
        return adj

    return _memo("adjacency", (red.edges, red.edge_costs), build)


class CoreState:
    """A mutable core choice with incremental cost and memory bookkeeping."""

    def __init__(self, red: Reduction, rows: MemoryRows | None, choice: np.ndarray):
        n = red.num_core
        self.red = red
        self.rows = rows
        self.adj = _adjacency(red)
        self.choice = np.array(choice, dtype=np.int64)
        self._flat = None
        has_rows = rows is not None and rows.num_points > 0
        self.mem_nodes = np.zeros(n, dtype=bool)
        self.tol = rows.tol if rows is not None else 0.0
        if has_rows:
            for k in range(n):
                self.mem_nodes[k] = red.node_memory[k] is not None and rows.hi[k] > rows.lo[k]
            self.cap = rows.cap.copy()
            self.usage = rows.usage(red.node_memory, self.choice)
        else:
            self.cap = np.zeros(0)
            self.usage = np.zeros(0)

    def local_cost(self, k: int) -> np.ndarray:
        """Cost of each strategy of core node ``k`` given its neighbours."""
        vec = self.red.node_costs[k].copy()
        for n, m in self.adj[k]:
            vec += m[:, self.choice[n]]
        return vec

    @property
    def flat(self) -> FlatCosts:
        """The core's costs as one flat array (built on first use)."""
        if self._flat is None:
            self._flat = flat_costs(self.red)
        return self._flat

    def total_cost(self) -> float:
        return self.flat.cost(self.choice)

    def edge_costs(self) -> np.ndarray:
        """Each core edge's cost under the current choice."""
        return self.flat.edge_costs(self.choice)

    def overflow(self) -> float:
        return float(np.maximum(self.usage - self.cap, 0).sum())

    def move(self, k: int, s: int) -> None:
        old = self.choice[k]
        if old == s:
            return
        if self.mem_nodes[k]:
            m = self.red.node_memory[k]
            self.usage[self.rows.lo[k] : self.rows.hi[k]] += m[s] - m[old]
        self.choice[k] = s

    def fits(self, k: int) -> np.ndarray:
        """Bool mask of the strategies of ``k`` that keep all its rows under capacity."""
        if not self.mem_nodes[k]:
            return np.ones(self.red.node_costs[k].size, dtype=bool)
        m = self.red.node_memory[k]
        a, b = self.rows.lo[k], self.rows.hi[k]
        room = (self.cap[a:b] - self.usage[a:b]).min() + m[self.choice[k]]
        return m <= room + self.tol

    def sweep(self, order: np.ndarray, deadline: float) -> float:
        """One pass of best-improving single-node moves; returns the total gain."""
        gain = 0.0
        for k in order:
            vec = self.local_cost(k)
            ok = self.fits(k)
            vec[~ok] = np.inf
            cur = vec[self.choice[k]] if ok[self.choice[k]] else np.inf
            s = int(np.argmin(vec))
            if vec[s] < cur and (cur == np.inf or vec[s] < cur - 1e-12 * (1 + abs(cur))):
                gain += cur - vec[s]
                self.move(k, s)
            if time.perf_counter() > deadline:
                break
        return gain

    def improve(self, deadline: float, rng: np.random.Generator) -> None:
        """Sweep until no move improves or the deadline passes."""
        n = self.red.num_core
        while time.perf_counter() < deadline:
            if self.sweep(rng.permutation(n), deadline) <= 0:
                break

    def repair(self, deadline: float) -> bool:
        """Lower memory overflow by cheapest-per-byte moves, many per pass; True once feasible.

        Each pass prices, for every node live at an overflowing point, its move
        of least ``cost increase / usage saved`` (the saving counted up to the
        largest overflow in the node's range, the cost read off its local cost
        vector), then takes those moves in that order while the node's range
        still overflows. Local costs go stale within a pass (a neighbour may
        move too); the next pass re-prices. On contest A's core this takes
        belief propagation's memory-free choice (every one of its 19,779 points
        over the limit) to a fitting one in one pass, 0.3 s; the moves may use
        forbidden pairs, which the searches then price out.
        """
        red, rows, tol = self.red, self.rows, self.tol
        while time.perf_counter() < deadline:
            over = np.maximum(self.usage - self.cap, 0.0)
            if not (over > tol).any():
                return True
            need = range_max(over, rows.lo, rows.hi)
            cand = np.flatnonzero(self.mem_nodes & (need > tol))
            score = np.full(cand.size, np.inf)
            target = np.zeros(cand.size, dtype=np.int64)
            for j, k in enumerate(cand):
                if j % 256 == 0 and time.perf_counter() > deadline:
                    return False  # pricing a pass of every live node took seconds on contest S's core
                m = red.node_memory[k]
                cur = self.choice[k]
                saved = m[cur] - m
                if not (saved > 0).any():
                    continue
                vec = self.local_cost(k)
                with np.errstate(divide="ignore", invalid="ignore"):
                    delta = np.nan_to_num(vec - vec[cur], nan=np.inf)
                    ratio = np.where(saved > 0, np.maximum(delta, 0) / np.minimum(saved, need[k]), np.inf)
                target[j] = int(np.argmin(ratio))
                score[j] = ratio[target[j]]
            moved = 0
            for j in np.argsort(score, kind="stable"):
                if not np.isfinite(score[j]) or time.perf_counter() > deadline:
                    break
                k = cand[j]
                a, b = rows.lo[k], rows.hi[k]
                if (self.usage[a:b] - self.cap[a:b]).max() > tol:
                    self.move(k, target[j])
                    moved += 1
            if not moved:
                return False
        return False


class FlatCosts:
    """Every node cost vector and edge matrix in one flat array, for vectorised totals."""

    def __init__(self, red: Reduction):
        sizes = np.array([c.size for c in red.node_costs], dtype=np.int64)
        self.node_off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        nsz = self.node_cells = int(sizes.sum())
        cells = np.array([m.size for m in red.edge_costs], dtype=np.int64)
        self.edge_off = nsz + np.concatenate([[0], np.cumsum(cells)[:-1]]).astype(np.int64)
        self.u, self.v = red.edges[:, 0], red.edges[:, 1]
        self.width = sizes[self.v] if len(red.edges) else np.zeros(0, dtype=np.int64)
        parts = [np.asarray(c, dtype=np.float64).ravel() for c in red.node_costs]
        parts += [np.asarray(m, dtype=np.float64).ravel() for m in red.edge_costs]
        self.values = np.concatenate(parts) if parts else np.zeros(0)

    def cost(self, ch: np.ndarray) -> float:
        if not ch.size:
            return 0.0
        idx = self.node_off + ch
        if self.u.size:
            idx = np.concatenate([idx, self._edge_index(ch)])
        return float(np.sum(self.values[idx]))

    def edge_costs(self, ch: np.ndarray) -> np.ndarray:
        """Each edge's cost under choice ``ch``."""
        return self.values[self._edge_index(ch)] if self.u.size else np.zeros(0)

    def _edge_index(self, ch: np.ndarray) -> np.ndarray:
        return self.edge_off + ch[self.u] * self.width + ch[self.v]


def flat_costs(red: Reduction) -> FlatCosts:
    """``red``'s :class:`FlatCosts` (shared with every other user of the same cost arrays: read only)."""
    return _memo("flat", (red.node_costs, red.edges, red.edge_costs), lambda: FlatCosts(red))


def recosted(red: Reduction, values: np.ndarray) -> Reduction:
    """``red`` with new costs ``values``, given flat in :class:`FlatCosts` order (node vectors, then the
    matrices row-major).

    The new node vectors and matrices are views of ``values``, which also becomes the
    new core's :class:`FlatCosts` (read only from here on): a whole-core re-pricing
    costs a few vectorised passes, where building the arrays one by one and then
    flattening them took 0.5 s on contest S's core (33k matrices, 4.5M cells).
    """
    base = flat_costs(red)
    if values.shape != base.values.shape or values.dtype != np.float64:
        raise ValueError(f"expected {base.values.size} float64 values, got {values.shape} {values.dtype}")
    nsz = base.node_cells
    node_costs = tuple(np.split(values[:nsz], base.node_off[1:])) if red.num_core else ()
    edge_costs = tuple(part.reshape(m.shape) for part, m in
                       zip(np.split(values[nsz:], base.edge_off[1:] - nsz), red.edge_costs, strict=True)
                       ) if len(red.edge_costs) else ()
    out = dataclasses.replace(red, node_costs=node_costs, edge_costs=edge_costs)
    flat = copy.copy(base)
    flat.values = values
    _memo("flat", (out.node_costs, out.edges, out.edge_costs), lambda: flat)
    return out


def flat_usage(red: Reduction) -> np.ndarray:
    """Every node's memory usage vector in one flat array, in :class:`FlatCosts` order (zeros for nodes without)."""
    return np.concatenate([np.zeros(c.size) if m is None else m
                           for c, m in zip(red.node_costs, red.node_memory, strict=True)])


def min_memory_choice(red: Reduction) -> np.ndarray:
    """Per core node, the cheapest strategy among those of least usage (the first, on ties)."""
    if not red.num_core:
        return np.zeros(0, dtype=np.int64)
    sizes = np.array([c.size for c in red.node_costs], dtype=np.int64)
    node = np.repeat(np.arange(red.num_core), sizes)
    # lexsort is stable: equal keys keep the lower strategy first
    order = np.lexsort((np.concatenate(red.node_costs), flat_usage(red), node))
    start = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return order[start] - start


def greedy(red: Reduction, rows: MemoryRows | None, deadline: float, seed: int = 0) -> CoreState:
    """A quick feasible-if-possible core choice: cheapest nodes, repair, improve."""
    rng = np.random.default_rng(seed)
    state = CoreState(red, rows, np.array([int(np.argmin(c)) for c in red.node_costs], dtype=np.int64))
    state.improve(deadline, rng)
    if state.usage.size and state.overflow() > 0 and not state.repair(deadline):
        state = CoreState(red, rows, min_memory_choice(red))
    state.improve(deadline, rng)
    return state
