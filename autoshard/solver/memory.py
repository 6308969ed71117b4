"""Memory constraints on the reduced core: compressed time points and capacities.

Usage only counts at time points, and summed usage can only peak where the set
of live nodes is maximal. With non-negative usages it is enough to check the
start points ``p`` after which some interval ends before the next start: the
live set at any other time point is a subset of the live set at one of these.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryRows:
    """Capacity constraints ``sum_i usage_i[x_i] <= cap[p]`` over core nodes.

    Attributes:
      nodes: per constraint row, core-local indices of the live memory nodes.
      base: per row, the strategy-independent usage live there.
      limit: the memory limit.
      node_rows: per core node, the rows it appears in (int arrays).
      num_points: time points kept after compression (before dropping rows that
        can never bind).
    """

    nodes: tuple[np.ndarray, ...]
    base: np.ndarray
    limit: float
    node_rows: tuple[np.ndarray, ...]
    num_points: int

    @property
    def num_rows(self) -> int:
        return len(self.base)

    @property
    def cap(self) -> np.ndarray:
        """Per row, the usage left to the core nodes."""
        return self.limit - self.base

    def usage(self, core_memory, core_choice) -> np.ndarray:
        """Summed usage of ``core_choice`` at each row."""
        out = np.zeros(self.num_rows)
        for r, nodes in enumerate(self.nodes):
            out[r] = sum(core_memory[k][core_choice[k]] for k in nodes)
        return out


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
    core_memory: tuple,
    base_usage: np.ndarray,
    nonnegative: bool = True,
    keep_all: bool = False,
) -> MemoryRows:
    """Build the constraint rows for the core.

    Args:
      intervals: ``(N, 2)`` original half-open intervals.
      memory_limit: the limit.
      core_nodes: original index of each core node.
      core_memory: per core node, its usage vector or ``None`` (constant usage).
      base_usage: per original node, its strategy-independent usage.
      nonnegative: whether every usage is >= 0 (enables compression).
      keep_all: keep rows that cannot bind (to minimise the peak instead).
    """
    points = peak_points(intervals, nonnegative)
    live = intervals[:, 1] > intervals[:, 0]
    lo = np.searchsorted(points, intervals[:, 0], side="left")
    hi = np.searchsorted(points, intervals[:, 1], side="left")
    delta = np.zeros(points.size + 1)
    has_base = live & (base_usage != 0)
    np.add.at(delta, lo[has_base], base_usage[has_base])
    np.add.at(delta, hi[has_base], -base_usage[has_base])
    base = np.cumsum(delta)[: points.size]
    cap = memory_limit - base

    rows_nodes: list[list[int]] = [[] for _ in range(points.size)]
    max_use = np.zeros(points.size + 1)
    for k, (i, m) in enumerate(zip(core_nodes, core_memory, strict=True)):
        if m is None or not live[i]:
            continue
        a, b = lo[i], hi[i]
        for r in range(a, b):
            rows_nodes[r].append(k)
        max_use[a] += m.max()
        max_use[b] -= m.max()
    max_use = np.cumsum(max_use)[: points.size]
    # a row binds only if its largest possible usage exceeds its capacity;
    # identical node sets keep only the tightest capacity.
    best: dict[tuple, float] = {}
    for r in range(points.size):
        if keep_all or max_use[r] > cap[r] + 1e-9 * max(1.0, abs(memory_limit)):
            key = tuple(rows_nodes[r])
            if key not in best or cap[r] < best[key]:
                best[key] = cap[r]
    keys = sorted(best, key=lambda k: (len(k), k))
    nodes = tuple(np.asarray(k, dtype=np.int64) for k in keys)
    bases = memory_limit - np.array([best[k] for k in keys], dtype=np.float64)
    node_rows: list[list[int]] = [[] for _ in range(len(core_nodes))]
    for r, ns in enumerate(nodes):
        for k in ns:
            node_rows[k].append(r)
    return MemoryRows(
        nodes=nodes,
        base=bases.reshape(-1),
        limit=float(memory_limit),
        node_rows=tuple(np.asarray(x, dtype=np.int64) for x in node_rows),
        num_points=int(points.size),
    )
