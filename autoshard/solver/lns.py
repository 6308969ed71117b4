"""Large-neighbourhood search: re-solve windows of the core as small MILPs.

A window is a connected set of core nodes grown by breadth-first search from a
random seed node. Every other node keeps its strategy, so edges to the outside
become node costs and each memory row becomes a capacity on the window's nodes
live there. Rows with the same set of live window nodes collapse into one with
the smallest capacity, which keeps a window's MILP small even when the whole
problem has tens of thousands of time points. A window's answer replaces the
current one only when it is strictly cheaper, so the search is monotone and
always feasible once started feasible.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

import numpy as np
import scipy.optimize
import scipy.sparse

from autoshard.solver.local import CoreState
from autoshard.solver.milp import group_matrix


@dataclasses.dataclass(frozen=True, slots=True)
class _WindowModel:
    """One window's MILP: variables ``[x of the free nodes (nx), edge cells]``, and the window's cost now."""

    fidx: np.ndarray  # the free core nodes
    off: np.ndarray  # first x variable of each free node (-1 elsewhere)
    c: np.ndarray  # objective (fixed neighbours' edge costs folded into x's costs; may hold inf)
    constraints: tuple
    nx: int
    nvar: int
    old: float  # the current choice's cost of everything the window touches


class WindowSearch:
    """Repeatedly re-optimises windows of a :class:`CoreState` in place."""

    def __init__(self, state: CoreState, seed: int):
        red = state.red
        self.state = state
        self.rng = np.random.default_rng(seed)
        n = red.num_core
        self.incident: list[list[int]] = [[] for _ in range(n)]
        for k, (u, v) in enumerate(red.edges):
            self.incident[u].append(k)
            self.incident[v].append(k)
        self.groups: dict[int, tuple] = {}
        self.sizes = np.array([c.size for c in red.node_costs], dtype=np.int64)
        # random 64-bit keys: a row's set of window nodes hashes to the sum of keys
        self.keys = self.rng.integers(1, 2**62, size=n, dtype=np.int64)
        self.hot: np.ndarray | None = None  # preferred window seeds
        self.windows = 0
        self.improved = 0
        # nodes inside a window solved to optimality, without a gain, since the last gain
        self.settled = np.zeros(n, dtype=bool)
        # a window holding every core node was solved to optimality: the choice is optimal
        self.proven = False

    def _group(self, k: int) -> tuple:
        g = self.groups.get(k)
        if g is None:
            g = self.groups[k] = group_matrix(self.state.red.edge_costs[k])
        return g

    def window(self, size: int) -> np.ndarray:
        """A BFS-grown window of about ``size`` nodes (bool mask)."""
        state = self.state
        n = state.red.num_core
        free = np.zeros(n, dtype=bool)
        start = int(self.rng.integers(n))
        if self.hot is not None and self.hot.size and self.rng.random() < 0.8:
            start = int(self.hot[self.rng.integers(self.hot.size)])
        queue = deque([start])
        free[start] = True
        count, budget = 1, size
        while queue and count < budget:
            u = queue.popleft()
            nbrs = [x for x, _ in state.adj[u]]
            self.rng.shuffle(nbrs)
            for x in nbrs:
                if not free[x]:
                    free[x] = True
                    count += 1
                    queue.append(x)
                    if count >= budget:
                        break
            if not queue and count < budget:
                rest = np.flatnonzero(~free)
                if rest.size == 0:
                    break
                nxt = int(rest[self.rng.integers(rest.size)])
                free[nxt] = True
                count += 1
                queue.append(nxt)
        return free

    def solve_window(self, free: np.ndarray, time_limit: float) -> bool:
        """Re-solve the nodes in ``free``; True when the choice got cheaper."""
        state = self.state
        model = self._window_model(free)
        fidx, off = model.fidx, model.off
        before = state.choice[fidx].copy()
        over = state.overflow()
        integrality = np.zeros(model.nvar)
        integrality[: model.nx] = 1
        # A strategy priced infinite by a fixed neighbour's forbidden pair is excluded by its bound:
        # HiGHS takes finite costs only.
        allowed = np.isfinite(model.c)
        c = np.where(allowed, model.c, 0.0)
        res = scipy.optimize.milp(
            c,
            integrality=integrality,
            bounds=scipy.optimize.Bounds(0, allowed.astype(np.float64)),
            constraints=model.constraints,
            options={"time_limit": max(time_limit, 0.05), "mip_rel_gap": 1e-7},
        )
        self.windows += 1
        if res.status == 0 and free.all():
            self.proven = True  # the whole core in one window, solved to optimality
        old = model.old
        if res.x is None or res.fun >= old - 1e-9 * max(1.0, abs(old)):
            if res.status == 0:  # proven: no cheaper choice for these nodes given the rest
                self.settled |= free
            return False
        new = [int(np.argmax(res.x[off[k] : off[k] + self.sizes[k]])) for k in fidx]
        for k, s in zip(fidx, new, strict=True):
            state.move(int(k), s)
        if state.overflow() > over + state.tol:
            # numerical slack in HiGHS let a row overflow: undo
            for k, s in zip(fidx, before, strict=True):
                state.move(int(k), s)
            return False
        self.improved += 1
        self.settled[:] = False
        return True

    def _window_model(self, free: np.ndarray) -> _WindowModel:
        """The window's MILP: assignment and edge-marginal rows, memory rows, and its current cost."""
        state, red = self.state, self.state.red
        fidx = np.flatnonzero(free)
        sizes = self.sizes[fidx]
        off = np.full(red.num_core, -1, dtype=np.int64)
        off[fidx] = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        nx = int(sizes.sum())
        c = np.concatenate([red.node_costs[k] for k in fidx])
        choice = state.choice
        old = float(sum(red.node_costs[k][choice[k]] for k in fidx))
        rr, cc, vv, rhs, ecost = [np.repeat(np.arange(fidx.size), sizes)], [np.arange(nx)], [np.ones(nx)], [], []
        rhs.append(np.ones(fidx.size))
        nrow, nvar = fidx.size, nx
        seen = set()
        for u in fidx:
            for k in self.incident[u]:
                if k in seen:
                    continue
                seen.add(k)
                a, b = red.edges[k]
                m = red.edge_costs[k]
                if not free[b]:
                    c[off[a] : off[a] + self.sizes[a]] += m[:, choice[b]]
                    old += float(m[choice[a], choice[b]])
                    continue
                if not free[a]:
                    c[off[b] : off[b] + self.sizes[b]] += m[choice[a], :]
                    old += float(m[choice[a], choice[b]])
                    continue
                old += float(m[choice[a], choice[b]])
                r, gr, gc = self._group(k)
                gi, hi = np.nonzero(np.isfinite(r))
                ev = nvar + np.arange(gi.size)
                ecost.append(r[gi, hi])
                nvar += gi.size
                rr += [nrow + gi, nrow + gr, nrow + r.shape[0] + hi, nrow + r.shape[0] + gc]
                cc += [ev, off[a] + np.arange(self.sizes[a]), ev, off[b] + np.arange(self.sizes[b])]
                vv += [np.ones(gi.size), -np.ones(self.sizes[a]), np.ones(gi.size), -np.ones(self.sizes[b])]
                nrow += r.shape[0] + r.shape[1]
                rhs.append(np.zeros(r.shape[0] + r.shape[1]))
        eq = scipy.sparse.csr_matrix((np.concatenate(vv), (np.concatenate(rr), np.concatenate(cc))), shape=(nrow, nvar))
        cons = [scipy.optimize.LinearConstraint(eq, np.concatenate(rhs), np.concatenate(rhs))]
        mem = self._memory_rows(fidx, off, nvar)
        if mem is not None:
            cons.append(mem)
        return _WindowModel(fidx, off, np.concatenate([c, *ecost]), tuple(cons), nx, nvar, old)

    @property
    def stalled(self) -> bool:
        """Every node has sat in a window proven to have no cheaper choice since the last gain."""
        return bool(self.settled.all())

    def _memory_rows(self, fidx: np.ndarray, off: np.ndarray, nvar: int):
        state = self.state
        if not state.usage.size:
            return None
        red, rows = state.red, state.rows
        mem_f = fidx[state.mem_nodes[fidx]]
        if not mem_f.size:
            return None
        a = int(rows.lo[mem_f].min())
        lo, hi = rows.lo[mem_f] - a, rows.hi[mem_f] - a
        span = int(hi.max())

        def profile(vals, dtype=np.float64):
            d = np.zeros(span + 1, dtype=dtype)
            np.add.at(d, lo, vals)
            np.add.at(d, hi, -vals)
            return np.cumsum(d)[:-1]

        cur = np.array([red.node_memory[k][state.choice[k]] for k in mem_f])
        mx = np.array([red.node_memory[k].max() for k in mem_f])
        resid = state.cap[a : a + span] - state.usage[a : a + span] + profile(cur)
        h = profile(self.keys[mem_f], np.int64)
        pts = np.flatnonzero((profile(mx) > resid + state.tol) & (h != 0))
        if not pts.size:
            return None
        order = np.lexsort((resid[pts], h[pts]))
        hp = h[pts][order]
        first = np.ones(hp.size, dtype=bool)
        first[1:] = hp[1:] != hp[:-1]
        rep = pts[order][first]  # one point per distinct live set, the tightest
        srt = np.argsort(rep)
        rep, cap = rep[srt], resid[rep[srt]]
        mr, mc, mv = [], [], []
        for k, x, y in zip(mem_f, np.searchsorted(rep, lo), np.searchsorted(rep, hi), strict=True):
            if y <= x:
                continue
            m = red.node_memory[k]
            mr.append(np.repeat(np.arange(x, y), m.size))
            mc.append(np.tile(off[k] + np.arange(m.size), y - x))
            mv.append(np.tile(m, y - x))
        mat = scipy.sparse.csr_matrix(
            (np.concatenate(mv), (np.concatenate(mr), np.concatenate(mc))), shape=(rep.size, nvar)
        )
        return scipy.optimize.LinearConstraint(mat, -np.inf, cap)

    def run(self, deadline: float, *, window_size: int, window_time: float, log=None, hot=None,
            grow: bool = False, adopt=None) -> None:
        """Re-solve windows until ``deadline``, or until the search has stalled.

        Stalled (:attr:`stalled`): since the last gain, every node has been in a
        window that HiGHS solved to optimality without finding a cheaper choice,
        so a full pass over the core improved nothing. Windows cut short by their
        time limit prove nothing and do not count.

        ``hot``, when given, returns nodes to seed windows at (refreshed every
        few windows), e.g. the endpoints of forbidden pairs still in use.

        With ``grow``, a stall doubles the window size and time and the search goes
        on until ``deadline``; it ends early only once a window holding the whole
        core was solved to optimality (:attr:`proven`). ``adopt``, when given, is
        called every few windows and may replace ``self.state`` by a cheaper one
        (an incumbent shared by another worker).
        """
        n = self.state.red.num_core
        # seconds a window spends outside HiGHS's time limit (building the
        # model, reading the answer): on a loaded machine, large cores ran a
        # full second past the deadline without this
        overhead = 0.05
        while time.perf_counter() + 2 * overhead + 0.05 < deadline and not self.proven:
            if self.stalled:
                if not grow or window_size >= n:
                    break
                window_size, window_time = min(2 * window_size, n), 2 * window_time
                self.settled[:] = False
                if log is not None:
                    log(f"lns: stalled, windows of {window_size} nodes from now on")
            if adopt is not None and self.windows % 10 == 0:
                adopt(self)
            t0 = time.perf_counter()
            if hot is not None and self.windows % 5 == 0:
                self.hot = hot()
            free = self.window(window_size)
            limit = min(window_time, deadline - time.perf_counter() - 1.5 * overhead)
            if limit <= 0.05:
                break
            self.solve_window(free, limit)
            spent = time.perf_counter() - t0
            overhead = max(overhead, 0.5 * overhead + 0.5 * max(spent - limit, 0.0))
            if log is not None and self.windows % 20 == 0:
                log(f"lns: {self.windows} windows, {self.improved} improved, cost {self.state.total_cost():.6g}")

