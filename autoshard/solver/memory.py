"""Memory constraints on the reduced core: compressed time points and capacities.

Usage only counts at time points, and summed usage can only peak where the set
of live nodes is maximal. With non-negative usages it is enough to check the
start points ``p`` after which some interval ends before the next start: the
live set at any other time point is a subset of the live set at one of these.

Each core node is live on a contiguous range ``[lo, hi)`` of the kept points, so
usage profiles are difference arrays and a move updates one slice.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryRows:
    """Capacity constraints ``base[p] + sum_{i live at p} usage_i[x_i] <= limit``.

    Attributes:
      base: per kept time point, the strategy-independent usage live there.
      limit: the memory limit.
      lo: per core node, first kept point where it is live.
      hi: per core node, one past the last (``lo == hi``: never counted).
      num_points: time points kept after compression.
    """

    base: np.ndarray
    limit: float
    lo: np.ndarray
    hi: np.ndarray

    @property
    def num_points(self) -> int:
        return len(self.base)

    @property
    def cap(self) -> np.ndarray:
        """Per point, the usage left to the core nodes."""
        return self.limit - self.base

    @property
    def tol(self) -> float:
        return 1e-9 * max(1.0, abs(self.limit))

    def profile(self, values: np.ndarray) -> np.ndarray:
        """Per point, the sum of ``values[k]`` over the core nodes live there."""
        delta = np.zeros(self.num_points + 1)
        np.add.at(delta, self.lo, values)
        np.add.at(delta, self.hi, -values)
        return np.cumsum(delta)[:-1]

    def usage(self, core_memory, core_choice) -> np.ndarray:
        """Summed core usage of ``core_choice`` at each point."""
        vals = np.array(
            [0.0 if m is None else float(m[s]) for m, s in zip(core_memory, core_choice, strict=True)]
        )
        return self.profile(vals)

    def binding(self, core_memory, keep_all: bool = False) -> tuple[list[np.ndarray], np.ndarray]:
        """Rows that can bind: per row its live core nodes and capacity.

        Points whose largest possible usage fits are dropped (unless ``keep_all``),
        and points with the same live set keep only the smallest capacity.
        """
        mx = np.array([0.0 if m is None else float(m.max()) for m in core_memory])
        cap = self.cap
        if keep_all:
            hot = np.arange(self.num_points)
        else:
            hot = np.flatnonzero(self.profile(mx) > cap + self.tol)
        members: list[list[int]] = [[] for _ in hot]
        for k, m in enumerate(core_memory):
            if m is None:
                continue
            for j in range(np.searchsorted(hot, self.lo[k]), np.searchsorted(hot, self.hi[k])):
                members[j].append(k)
        best: dict[tuple, float] = {}
        for j, p in enumerate(hot):
            key = tuple(members[j])
            if key not in best or cap[p] < best[key]:
                best[key] = float(cap[p])
        keys = sorted(best, key=lambda k: (len(k), k))
        return [np.asarray(k, dtype=np.int64) for k in keys], np.array([best[k] for k in keys])


def peak_points(intervals: np.ndarray, nonnegative: bool = True) -> np.ndarray:
    """The time points where a maximal live set occurs (sorted)."""
    live = intervals[:, 1] > intervals[:, 0]
    starts = np.unique(intervals[live, 0])
    if not nonnegative or starts.size == 0:
        return starts
    ends = np.sort(intervals[live, 1])
    nxt = np.append(starts[1:], np.iinfo(np.int64).max)
    # keep p_j iff some interval ends in (p_j, p_{j+1}]
    lo = np.searchsorted(ends, starts, side="right")
    hi = np.searchsorted(ends, nxt, side="right")
    return starts[hi > lo]


def memory_rows(
    intervals: np.ndarray,
    memory_limit: float,
    core_nodes: np.ndarray,
    base_usage: np.ndarray,
    nonnegative: bool = True,
) -> MemoryRows:
    """Build the point-indexed memory model of the core.

    Args:
      intervals: ``(N, 2)`` original half-open intervals.
      memory_limit: the limit.
      core_nodes: original index of each core node.
      base_usage: per original node, its strategy-independent usage.
      nonnegative: whether every usage is >= 0 (enables compression).
    """
    points = peak_points(intervals, nonnegative)
    live = intervals[:, 1] > intervals[:, 0]
    lo = np.searchsorted(points, intervals[:, 0], side="left")
    hi = np.searchsorted(points, intervals[:, 1], side="left")
    lo = np.where(live, lo, 0)
    hi = np.where(live, hi, 0)
    delta = np.zeros(points.size + 1)
    np.add.at(delta, lo, base_usage)
    np.add.at(delta, hi, -base_usage)
    base = np.cumsum(delta)[:-1]
    return MemoryRows(base=base, limit=float(memory_limit), lo=lo[core_nodes], hi=hi[core_nodes])


def range_max(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``max(values[lo[k]:hi[k]])`` per k (0 for empty ranges), by a sparse table."""
    n = values.size
    out = np.zeros(lo.size)
    ok = hi > lo
    if not n or not ok.any():
        return out
    table = [values]
    while 2 * len(table[-1]) > 0 and (1 << len(table)) <= n:
        prev, half = table[-1], 1 << (len(table) - 1)
        table.append(np.maximum(prev[:-half], prev[half:]))
    a, b = lo[ok], hi[ok]
    level = np.floor(np.log2(b - a)).astype(np.int64)
    res = np.empty(a.size)
    for j in np.unique(level):
        sel = level == j
        t = table[j]
        res[sel] = np.maximum(t[a[sel]], t[b[sel] - (1 << j)])
    out[ok] = res
    return out
