"""Exact reductions of a :class:`ShardingProblem` to a smaller core.

Every reduction keeps at least one optimal solution, and each is recorded so that
a choice for the core can be expanded back to a choice for the original problem:

* forbidden strategies (infinite node cost, or incompatible with every strategy of
  a neighbour) are dropped;
* dominated strategies are dropped: ``t`` dominates ``s`` when its node cost, its
  memory usage and every row of every incident edge matrix are no larger;
* parallel edges are summed, and an edge matrix that is a sum ``a[s] + b[t]`` is
  folded into the two node costs;
* a node with a single strategy is fixed and folded into its neighbours;
* a node whose memory usage does not depend on its strategy ("memory-free") of
  degree 0, 1 or 2 is eliminated by dynamic programming (leaf and series
  elimination), leaving an argmin table to undo it.

Constant memory usages move into a per-node ``base`` usage that later shrinks the
memory capacity at the time points where the node is live.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque

import numpy as np

from autoshard.errors import InfeasibleError
from autoshard.solver.problem import ShardingProblem

# Largest u*v*w table built by a series elimination, and largest S*S*columns
# comparison done by the dominance check; beyond these the node is left alone.
_SERIES_CELLS = 4_000_000
_DOMINANCE_CELLS = 20_000_000
# Up to this many cells the dominance check compares all columns at once: the
# filters of _no_worse only pay off once the full comparison costs more than the
# extra numpy calls they take (measured on the contest problems).
_DIRECT_CELLS = 16_384
# Largest matrix (in row-pair cells) whose rows _apart compares up front, and
# cells copied or compared at once when summarizing the starting edges (bounds
# the memory).
_APART_CELLS = 2048
_BATCH_CELLS = 1_000_000


@dataclasses.dataclass(frozen=True, slots=True)
class Reduction:
    """A reduced core problem plus what is needed to expand its solutions.

    Attributes:
      core_nodes: original index of each core node.
      alive: per core node, the original strategy index of each core strategy.
      node_costs: per core node, costs of its core strategies.
      edges: int64 ``(E, 2)`` core-local endpoints, ``u < v``.
      edge_costs: per core edge, the ``(S_u, S_v)`` matrix.
      node_memory: per core node, usages of its core strategies, or ``None`` when
        the node's usage does not depend on its strategy (it then sits in
        ``base_usage``).
      base_usage: per original node, usage already committed (constant usages).
      records: elimination records, undone in reverse order by :meth:`expand`.
      stats: counts of each reduction applied.
      forbidden: the price of a forbidden pair in ``edge_costs``: infinite, or the
        finite price :func:`autoshard.solver.penalty.soften` gave them.
    """

    core_nodes: np.ndarray
    alive: tuple[np.ndarray, ...]
    node_costs: tuple[np.ndarray, ...]
    edges: np.ndarray
    edge_costs: tuple[np.ndarray, ...]
    node_memory: tuple[np.ndarray | None, ...]
    base_usage: np.ndarray
    records: tuple
    stats: dict
    forbidden: float = np.inf

    @property
    def num_core(self) -> int:
        return len(self.core_nodes)

    def expand(self, core_choice, num_nodes: int) -> np.ndarray:
        """Map a core-local choice to an original-index choice for every node."""
        choice = np.full(num_nodes, -1, dtype=np.int64)
        for k, i in enumerate(self.core_nodes):
            choice[i] = self.alive[k][core_choice[k]]
        for rec in reversed(self.records):
            kind = rec[0]
            if kind == "fix":
                choice[rec[1]] = rec[2]
            elif kind == "leaf":
                _, u, v, alive_v, table = rec
                choice[u] = table[np.searchsorted(alive_v, choice[v])]
            else:
                _, u, v, w, alive_v, alive_w, table = rec
                choice[u] = table[np.searchsorted(alive_v, choice[v]), np.searchsorted(alive_w, choice[w])]
        return choice


def reduce_problem(problem: ShardingProblem, *, with_memory: bool, deadline: float | None = None) -> Reduction:
    """Apply the exact reductions to a fixpoint, or until ``deadline``.

    Args:
      problem: the problem to reduce.
      with_memory: whether the memory limit is active; when it is, only nodes
        whose usage is strategy-independent are eliminated.
      deadline: a ``time.perf_counter()`` value; past it the reductions stop
        early and leave a larger (still exact) core.

    Raises:
      InfeasibleError: a node is left without any allowed strategy.
    """
    return _Reducer(problem, with_memory).run(deadline)


class _Reducer:
    def __init__(self, problem: ShardingProblem, with_memory: bool):
        n = problem.num_nodes
        self.problem = problem
        self.alive = [_arange(c.size).copy() for c in problem.node_costs]
        self.cost = [c.copy() for c in problem.node_costs]
        self.adj: list[dict[int, np.ndarray]] = [{} for _ in range(n)]
        self.removed = [False] * n
        self.base = np.zeros(n)
        self.records: list = []
        self.stats = dict.fromkeys(("pruned", "dominated", "folded_edges", "fixed", "leaf", "series"), 0)
        self.mem: list[np.ndarray | None] = [None] * n
        # Nodes whose costs, usages or incident matrices changed since their last
        # dominance check, and per edge (keyed by endpoints) facts about the matrix
        # it had when last asked, among them whether it is additive (see _facts):
        # hubs are re-queued once per changed neighbour, and re-checking them from
        # scratch each time was quadratic.
        self.dirty = [True] * n
        self.facts: dict[tuple[int, int], tuple] = {}
        if with_memory:
            for i in np.flatnonzero(problem.intervals[:, 1] > problem.intervals[:, 0]).tolist():
                self.mem[i] = problem.node_memory[i].copy()
        adj = self.adj
        edges = []  # (lo, hi) of each edge, once
        # Endpoints as two flat lists: a list per edge (tolist of the (E, 2) array)
        # is tracked by the garbage collector and set off a full collection.
        ends = zip(problem.edges[:, 0].tolist(), problem.edges[:, 1].tolist(), strict=True)
        for (u, v), m in zip(ends, problem.edge_costs, strict=True):
            if u == v:
                self.cost[u] = self.cost[u] + np.diag(m)
            elif v in adj[u]:
                self.stats["folded_edges"] += 1
                m = adj[u][v] + m
                adj[u][v] = m
                adj[v][u] = m.T
            else:
                adj[u][v] = m
                adj[v][u] = m.T
                edges.append((u, v) if u < v else (v, u))
        # Per node, the neighbours whose edge matrix changed since the node's last
        # folding pass: every other edge was already found non-additive, and has a
        # finite entry in each row, so pruning and folding a hub look at these only.
        # At the start, only the edges _summarize_edges finds something to do with.
        # Dicts (used as ordered sets) of ints are not tracked by the garbage
        # collector; one set per node was, and cost a tenth of the run in full
        # collections.
        self.touched: list[dict[int, None]] = [{} for _ in range(n)]
        # Per node, the cost array last found all finite (or None): a node's costs
        # only become infinite through a new array, and most visits then skip the
        # pruning's own numpy calls.
        self.finite_cost: list[np.ndarray | None] = [
            c if ok else None for c, ok in zip(self.cost, _finite_each(self.cost), strict=True)
        ]
        self._summarize_edges(edges)

    def _summarize_edges(self, edges: list[tuple[int, int]]) -> None:
        """Fill the facts cache for every edge (``edges``: each ``(lo, hi)`` once) at
        once, and mark as touched the edges that pruning or folding will act on.

        Almost every edge keeps its matrix until both endpoints have looked at it,
        and one numpy call over all matrices of a shape costs about what one call
        per matrix does. The additivity verdict is the one :meth:`_prune_and_fold`
        reaches on ``adj[lo][hi]``: ``lo`` is visited first, so that is the
        orientation it first tests (and folds) this matrix in. An edge with a
        finite entry in each row at one end, and not additive, leaves that end
        nothing to do until its matrix changes.
        """
        groups: dict[tuple[int, int], tuple[list, list]] = {}
        for key in edges:
            m = self.adj[key[0]][key[1]]
            group = groups.get(m.shape)
            if group is None:
                group = groups[m.shape] = ([], [])
            group[0].append(key)
            group[1].append(m)
        for (a, b), (keys, mats) in groups.items():
            step = max(1, _BATCH_CELLS // (a * b))  # copies of at most this many cells at once
            for start in range(0, len(keys), step):
                self._summarize_stack(keys[start : start + step], mats[start : start + step])

    def _summarize_stack(self, keys: list[tuple[int, int]], mats: list[np.ndarray]) -> None:
        """:meth:`_summarize_edges` for edges ``keys`` whose matrices ``mats`` have one shape."""
        stack = np.array(mats)  # np.stack's checks per array cost more than the copy
        fin = np.isfinite(stack)
        lo, hi = fin.any(axis=2), fin.any(axis=1)
        lo_all, hi_all = lo.all(axis=1), hi.all(axis=1)
        lo_rows = [None if ok else rows for ok, rows in zip(lo_all.tolist(), lo, strict=True)]
        hi_rows = [None if ok else rows for ok, rows in zip(hi_all.tolist(), hi, strict=True)]
        all_finite = fin.all(axis=(1, 2))
        additive = np.zeros(len(keys), dtype=bool)
        if all_finite.any():
            additive[all_finite] = _additive(stack[all_finite])
        for j in np.flatnonzero(additive | ~lo_all).tolist():
            u, v = keys[j]
            self.touched[u][v] = None
        for j in np.flatnonzero(additive | ~hi_all).tolist():
            u, v = keys[j]
            self.touched[v][u] = None
        lo_apart, hi_apart = _apart(stack).tolist(), _apart(stack.transpose(0, 2, 1)).tolist()
        facts = zip(mats, all_finite.tolist(), lo_rows, hi_rows, lo_apart, hi_apart, additive.tolist(), strict=True)
        self.facts.update(zip(keys, facts, strict=True))

    # -- graph edits -------------------------------------------------------
    def _add_edge(self, u: int, v: int, m: np.ndarray) -> None:
        if v in self.adj[u]:
            m = self.adj[u][v] + m
            self.stats["folded_edges"] += 1
        self.adj[u][v] = m
        self.adj[v][u] = m.T
        self.touched[u][v] = None
        self.touched[v][u] = None
        self.dirty[u] = self.dirty[v] = True

    def _drop_edge(self, u: int, v: int) -> None:
        del self.adj[u][v]
        del self.adj[v][u]
        self.dirty[u] = self.dirty[v] = True

    def _restrict(self, i: int, keep: np.ndarray) -> int:
        """Keep only strategies ``keep`` (bool mask) of node ``i``; return how many were dropped."""
        # count_nonzero is several times cheaper than all()/any() on the tiny masks
        # that make up almost every call.
        kept = np.count_nonzero(keep)
        if kept == keep.size:
            return 0
        if kept == 0:
            self._raise_empty(i)
        idx = keep.nonzero()[0]
        self.alive[i] = self.alive[i][idx]
        self.cost[i] = self.cost[i][idx]
        if self.mem[i] is not None:
            self.mem[i] = self.mem[i][idx]
        for n, m in self.adj[i].items():
            m = m[idx]
            self.adj[i][n] = m
            self.adj[n][i] = m.T
            self.touched[n][i] = None
            self.dirty[n] = True
        self.touched[i].update(dict.fromkeys(self.adj[i]))
        self.dirty[i] = True
        return int(keep.size - kept)

    def _raise_empty(self, i: int) -> None:
        name = self.problem.name(i)
        if not np.isfinite(self.problem.node_costs[i]).any():
            raise InfeasibleError(
                f"node {name}: all {self.problem.node_costs[i].size} strategies have infinite cost; "
                "give the node at least one finite-cost strategy"
            )
        raise InfeasibleError(
            f"node {name}: every finite-cost strategy is forbidden (infinite edge cost) by the "
            f"strategies left to its neighbours; check the infinite entries of the edges at node {name}"
        )

    def _facts(self, key: tuple[int, int], canon: np.ndarray) -> tuple:
        """``(canon, all finite, lo_rows, hi_rows, lo_apart, hi_apart, additive)`` for edge ``key = (lo, hi)``.

        ``canon`` is the matrix ``adj[lo][hi]``; ``lo_rows`` marks the strategies of
        ``lo`` with a finite entry in their row (``hi_rows`` those of ``hi``, by
        column), ``None`` when all have one; ``lo_apart``: no row is no worse than
        another, so no strategy of ``lo`` is dominated while this edge is there
        (``hi_apart`` for columns). The apart flags are only known for the matrices
        :meth:`_summarize_edges` saw, and are False for the others; ``additive``
        is None until :meth:`_prune_and_fold` tests the matrix.
        """
        got = self.facts.get(key)
        if got is not None and got[0] is canon:
            return got
        f = np.isfinite(canon)
        if np.count_nonzero(f) == f.size:
            got = (canon, True, None, None, False, False, None)
        else:
            lo, hi = f.any(axis=1), f.any(axis=0)
            got = (
                canon,
                False,
                None if np.count_nonzero(lo) == lo.size else lo,
                None if np.count_nonzero(hi) == hi.size else hi,
                False,
                False,
                False,
            )
        self.facts[key] = got
        return got

    # -- reductions --------------------------------------------------------
    def _prune_and_fold(self, i: int) -> bool:
        """Drop the forbidden strategies of node ``i``, then fold its additive edges.

        Both look only at the edges touched since the node's last pass, in
        adjacency order (each fold adds to the node's costs), and share one
        lookup of their facts.
        """
        cost, touched, adj = self.cost[i], self.touched[i], self.adj[i]
        if not touched and self.finite_cost[i] is cost:
            return False
        self.touched[i] = {}
        seen = self._seen_facts(i, [n for n in adj if n in touched] if len(touched) > 1 else [n for n in touched if n in adj])
        changed = False
        keep = None if self.finite_cost[i] is cost else np.isfinite(cost)
        for n, _, facts in seen:
            rows = facts[2] if i < n else facts[3]
            if rows is not None:
                keep = rows if keep is None else keep & rows  # never in place: rows is cached
        if keep is not None:
            dropped = self._restrict(i, keep)
            self.finite_cost[i] = self.cost[i]
            if dropped:
                self.stats["pruned"] += dropped
                changed = True
                # Every matrix at this node is new: fold looks at them all.
                self.touched[i] = {}
                seen = self._seen_facts(i, list(adj))
        for n, key, facts in seen:
            m = adj[n]
            additive = facts[6]
            if additive is None:  # finite, and not tested yet
                additive = _is_additive(m)
                if not additive:
                    self.facts[key] = (*facts[:6], False)
            if not additive:
                continue
            self.cost[i] = self.cost[i] + m[:, 0]
            self.cost[n] = self.cost[n] + (m[0, :] - m[0, 0])
            self._drop_edge(i, n)
            self.stats["folded_edges"] += 1
            changed = True
        return changed

    def _seen_facts(self, i: int, nbrs: list[int]) -> list[tuple]:
        """``(n, key, facts)`` for the edges from node ``i`` to ``nbrs``."""
        adj, seen = self.adj, []
        for n in nbrs:
            key = (i, n) if i < n else (n, i)
            seen.append((n, key, self._facts(key, adj[key[0]][key[1]])))
        return seen

    def _dominate(self, i: int) -> bool:
        s = self.cost[i].size
        if s < 2 or not self.dirty[i]:
            return False
        self.dirty[i] = False
        # Settled by one edge whose rows alone leave no two strategies comparable:
        # one of the starting edges is, at nearly every node, on its first check.
        for n, m in self.adj[i].items():
            if i < n:
                got = self.facts.get((i, n))
                if got is not None and got[0] is m and got[4]:
                    return False
            else:
                got = self.facts.get((n, i))
                if got is not None and got[0] is self.adj[n][i] and got[5]:
                    return False
        cost, mem, mats = self.cost[i], self.mem[i], list(self.adj[i].values())
        width = 1 + (mem is not None) + sum(m.shape[1] for m in mats)
        if s * s * width > _DOMINANCE_CELLS:
            return False
        # le[t, s]: t no worse than s. The edge columns decide almost every check,
        # and always find no pair off the diagonal comparable: they go first, and
        # a leaf's one matrix is compared without copying it.
        if not mats:
            le = cost[:, None] <= cost[None, :]
        else:
            le = _no_worse(mats[0] if len(mats) == 1 else np.concatenate(mats, axis=1))
            if np.count_nonzero(le) == np.count_nonzero(le.diagonal()):
                return False
            le &= cost[:, None] <= cost[None, :]
        if mem is not None:
            le &= mem[:, None] <= mem[None, :]
        eq = le & le.T
        order = np.arange(s)
        dom = le & (~eq | (order[:, None] < order[None, :]))
        np.fill_diagonal(dom, False)
        keep = ~dom.any(axis=0)
        dropped = self._restrict(i, keep)
        self.stats["dominated"] += dropped
        return dropped > 0

    def _memory_free(self, i: int) -> bool:
        m = self.mem[i]
        if m is None:
            return True
        # As a list: on these few usages numpy's call overhead is most of the cost.
        usage = m.tolist()
        if usage.count(usage[0]) == len(usage):
            self.base[i] = m[0]
            self.mem[i] = None
            self.dirty[i] = True
            return True
        return False

    def _eliminate(self, i: int) -> list[int] | None:
        """Try to eliminate node ``i``; return its former neighbours if done."""
        if self.cost[i].size > 1 and not self._memory_free(i):
            return None
        nbrs = list(self.adj[i])
        if self.cost[i].size == 1:
            if self.mem[i] is not None:
                self.base[i] = self.mem[i][0]
                self.mem[i] = None
            for n in nbrs:
                self.cost[n] = self.cost[n] + self.adj[n][i][:, 0]
                self._drop_edge(i, n)
            self.records.append(("fix", i, int(self.alive[i][0])))
            self.stats["fixed"] += 1
        elif not nbrs:
            self.records.append(("fix", i, int(self.alive[i][np.argmin(self.cost[i])])))
            self.stats["fixed"] += 1
        elif len(nbrs) == 1:
            (v,) = nbrs
            t = self.cost[i][:, None] + self.adj[i][v]  # (S_i, S_v)
            best = t.argmin(axis=0)
            self.cost[v] = self.cost[v] + t[best, _arange(t.shape[1])]
            self.records.append(("leaf", i, v, self.alive[v].copy(), self.alive[i][best]))
            self._drop_edge(i, v)
            self.stats["leaf"] += 1
        elif len(nbrs) == 2:
            v, w = nbrs
            if v > w:
                v, w = w, v
            su, sv, sw = self.cost[i].size, self.cost[v].size, self.cost[w].size
            if su * sv * sw > _SERIES_CELLS:
                return None
            t = self.cost[i][:, None, None] + self.adj[i][v][:, :, None] + self.adj[i][w][:, None, :]
            best = t.argmin(axis=0)  # (S_v, S_w)
            m = t[best, _arange(sv)[:, None], _arange(sw)]
            self.records.append(("series", i, v, w, self.alive[v].copy(), self.alive[w].copy(), self.alive[i][best]))
            self._drop_edge(i, v)
            self._drop_edge(i, w)
            self._add_edge(v, w, m)
            self.stats["series"] += 1
        else:
            return None
        self.removed[i] = True
        return nbrs

    def run(self, deadline: float | None = None) -> Reduction:
        n = len(self.cost)
        queue = deque(range(n))
        queued = [True] * n

        def push(nodes):
            for x in nodes:
                if not queued[x] and not self.removed[x]:
                    queued[x] = True
                    queue.append(x)

        steps = 0
        while queue:
            steps += 1
            if deadline is not None and steps % 256 == 0 and time.perf_counter() > deadline:
                self.stats["stopped_early"] = 1
                break
            i = queue.popleft()
            queued[i] = False
            if self.removed[i]:
                continue
            changed = self._prune_and_fold(i)
            changed |= self._dominate(i)
            done = self._eliminate(i)
            if done is not None:
                push(done)
            elif changed:  # not eliminated: the edges are as they were
                push(self.adj[i])
        return self._result()

    def _result(self) -> Reduction:
        core = np.flatnonzero(np.logical_not(self.removed))
        local = dict(zip(core.tolist(), range(len(core))))
        edges, mats = [], []
        for i, li in local.items():
            for n, m in self.adj[i].items():
                if i < n:
                    edges.append((li, local[n]))
                    mats.append(m)
        return Reduction(
            core_nodes=core,
            alive=tuple(self.alive[i] for i in local),
            node_costs=tuple(self.cost[i] for i in local),
            edges=np.asarray(edges, dtype=np.int64).reshape(-1, 2),
            edge_costs=tuple(mats),
            node_memory=tuple(self.mem[i] for i in local),
            base_usage=self.base,
            records=tuple(self.records),
            stats=dict(self.stats),
        )


def _additive(m: np.ndarray) -> np.ndarray:
    """Whether the finite matrix ``m`` (or each of a stack of them) is ``a[s] + b[t]``.

    ``a`` is the first column, ``b`` the first row less its first entry; the
    residual is measured relative to the largest entry.
    """
    a = m[..., :, :1]
    b = m[..., :1, :] - m[..., :1, :1]
    resid = np.abs(m - a - b).max(axis=(-2, -1))
    return resid <= 1e-9 * (1 + np.abs(m).max(axis=(-2, -1)))


def _finite_each(arrays: list[np.ndarray]) -> list[bool]:
    """Per array, whether all its entries are finite; one numpy pass for all."""
    if not arrays:
        return []
    starts = np.cumsum([0, *(a.size for a in arrays[:-1])])
    return np.logical_and.reduceat(np.isfinite(np.concatenate(arrays)), starts).tolist()


def _apart(stack: np.ndarray) -> np.ndarray:
    """Per matrix of ``stack`` ``(k, a, b)``: no row is elementwise ``<=`` another.

    Only matrices of up to ``_APART_CELLS`` row-pair cells are compared (the
    others are False): on larger ones a dominance check's numpy overhead is small
    next to the comparison itself, which this would only repeat for both sides.
    """
    k, a, b = stack.shape
    out = np.zeros(k, dtype=bool)
    if a * a * b > _APART_CELLS:
        return out
    cols = np.ascontiguousarray(stack.transpose(2, 0, 1))  # as in _no_worse
    step = max(1, _BATCH_CELLS // (a * a * b))
    for start in range(0, k, step):
        part = cols[:, start : start + step]
        le = np.logical_and.reduce(part[:, :, :, None] <= part[:, :, None, :], axis=0)
        off = np.count_nonzero(le, axis=(1, 2)) - np.count_nonzero(le.diagonal(axis1=1, axis2=2), axis=1)
        out[start : start + step] = off == 0
    return out


def _is_additive(m: np.ndarray) -> bool:
    """:func:`_additive` for one matrix, most often settled by its first 2x2 minor.

    That minor's residual is one entry of the full residual, computed the same
    way, so one above the tolerance already decides.
    """
    if m.shape[0] > 1 and m.shape[1] > 1:
        tol = 1e-9 * (1 + np.abs(m).max())
        if abs((m[1, 1] - m[1, 0]) - (m[0, 1] - m[0, 0])) > tol:
            return False
    return bool(_additive(m))


def _no_worse(f: np.ndarray) -> np.ndarray:
    """``le[t, s]``: row ``t`` of ``f`` is elementwise ``<=`` row ``s``.

    The infinite entries, and a few spread columns, rule out most pairs cheaply;
    only the pairs left are compared in full.
    """
    s, w = f.shape
    if w <= 16 or s * s * w <= _DIRECT_CELLS:
        return (f[:, None, :] <= f[None, :, :]).all(axis=-1)
    # Row t can only be no worse than row s where s is infinite wherever t is.
    # Hubs are forbidden with most strategies of their neighbours, so this alone
    # leaves few pairs there; as bits, it compares 64 columns a word.
    le = None
    inf = f == np.inf
    if inf.any():
        packed = np.packbits(inf, axis=1)
        padded = np.zeros((s, -(-packed.shape[1] // 8) * 8), dtype=np.uint8)
        padded[:, : packed.shape[1]] = packed
        words = np.ascontiguousarray(padded.view(np.uint64).T)
        le = np.bitwise_or.reduce(words[:, :, None] & ~words[:, None, :], axis=0) == 0
    # Column-major and contiguous, so that each comparison reduces over its first
    # axis, whole (s, s) slices at a time: reducing a short last axis, and
    # broadcasting a strided view, were each several times slower.
    cols = None
    if le is None or np.count_nonzero(le) > s * s // 16:
        cols = np.ascontiguousarray(f.T)
        probe = _all_le(cols[_probe_columns(w)])
        le = probe if le is None else le & probe
    t_idx, s_idx = np.nonzero(le)
    if t_idx.size > s * s // 2:  # (so more than s * s // 16 were left, and cols was made)
        return _all_le(cols)
    le[t_idx, s_idx] = (f[t_idx] <= f[s_idx]).all(axis=1)
    return le


def _all_le(cols: np.ndarray) -> np.ndarray:
    """``le[t, s]``: ``cols[:, t] <= cols[:, s]`` in every row of ``cols``."""
    return np.logical_and.reduce(cols[:, :, None] <= cols[:, None, :], axis=0)


@functools.cache
def _arange(n: int) -> np.ndarray:
    """``np.arange(n)``, cached for indexing (read-only, as it is shared)."""
    a = np.arange(n)
    a.flags.writeable = False
    return a


@functools.cache
def _probe_columns(w: int) -> np.ndarray:
    """12 columns spread over ``w``; cached, as np.linspace costs more than the probe."""
    return np.linspace(0, w - 1, 12).astype(np.int64)
