"""The strategy-selection problem and its solution, as plain immutable data.

A :class:`ShardingProblem` is the IOPDDL contest's problem: pick one strategy per
node so that the sum of node costs and edge costs is minimal, while the summed
memory usage of the chosen strategies stays under ``memory_limit`` at every time
point. Node ``i``'s usage counts at the time points of its half-open interval
``intervals[i] = [start, end)``.

The planner translates its op graph into this type, and the command-line solver
(``python -m autoshard.solver``) reads the contest's JSON into it, so both share
one solver.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ShardingProblem:
    """One strategy-selection problem.

    Attributes:
      node_costs: per node, a float64 array ``(S_i,)`` of strategy costs. ``inf``
        marks a forbidden strategy.
      edges: int64 array ``(E, 2)`` of ``(u, v)`` node pairs.
      edge_costs: per edge, a float64 array ``(S_u, S_v)``.
      node_memory: per node, a float64 array ``(S_i,)`` of memory usage, or
        ``None`` when the problem has no memory model.
      intervals: int64 array ``(N, 2)`` of half-open live intervals, or ``None``.
      memory_limit: the bound on summed usage at every time point, or ``None``.
      node_names: optional labels, used in error messages.
    """

    node_costs: tuple[np.ndarray, ...]
    edges: np.ndarray
    edge_costs: tuple[np.ndarray, ...]
    node_memory: tuple[np.ndarray, ...] | None = None
    intervals: np.ndarray | None = None
    memory_limit: float | None = None
    node_names: tuple[str, ...] | None = None

    def __post_init__(self):
        n = len(self.node_costs)
        edges = np.asarray(self.edges, dtype=np.int64).reshape(-1, 2)
        object.__setattr__(self, "edges", edges)
        object.__setattr__(
            self, "node_costs", tuple(np.asarray(c, dtype=np.float64).reshape(-1) for c in self.node_costs)
        )
        object.__setattr__(
            self, "edge_costs", tuple(np.asarray(c, dtype=np.float64) for c in self.edge_costs)
        )
        for i, c in enumerate(self.node_costs):
            if c.size == 0:
                raise ValueError(f"node {self.name(i)} has no strategies")
        if len(self.edge_costs) != len(edges):
            raise ValueError(f"{len(edges)} edges but {len(self.edge_costs)} edge cost matrices")
        if len(edges) and (edges.min() < 0 or edges.max() >= n):
            raise ValueError(f"edge endpoint out of range [0, {n})")
        for k, ((u, v), m) in enumerate(zip(edges, self.edge_costs, strict=True)):
            want = (self.node_costs[u].size, self.node_costs[v].size)
            if m.shape != want:
                raise ValueError(f"edge {k} ({u}->{v}) has a cost matrix of shape {m.shape}, expected {want}")
        if self.node_memory is not None:
            mem = tuple(np.asarray(m, dtype=np.float64).reshape(-1) for m in self.node_memory)
            object.__setattr__(self, "node_memory", mem)
            if len(mem) != n:
                raise ValueError(f"{n} nodes but {len(mem)} memory arrays")
            for i, (m, c) in enumerate(zip(mem, self.node_costs, strict=True)):
                if m.shape != c.shape:
                    raise ValueError(f"node {self.name(i)}: {m.size} usages for {c.size} strategies")
        if self.intervals is not None:
            iv = np.asarray(self.intervals, dtype=np.int64).reshape(-1, 2)
            object.__setattr__(self, "intervals", iv)
            if len(iv) != n:
                raise ValueError(f"{n} nodes but {len(iv)} intervals")

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    @property
    def num_edges(self) -> int:
        return len(self.edges)

    def name(self, i: int) -> str:
        if self.node_names is not None:
            return f"{i} ({self.node_names[i]})"
        return str(i)

    def cost(self, choice) -> float:
        """The objective of a full assignment ``choice`` (one index per node)."""
        choice = np.asarray(choice, dtype=np.int64)
        total = math.fsum(float(c[s]) for c, s in zip(self.node_costs, choice, strict=True))
        total += math.fsum(
            float(m[choice[u], choice[v]]) for (u, v), m in zip(self.edges, self.edge_costs, strict=True)
        )
        return total

    def peak_memory(self, choice) -> float:
        """The largest summed usage over all time points (0 without a memory model)."""
        if self.node_memory is None or self.intervals is None or self.num_nodes == 0:
            return 0.0
        choice = np.asarray(choice, dtype=np.int64)
        usage = np.array([m[s] for m, s in zip(self.node_memory, choice, strict=True)])
        starts, ends = self.intervals[:, 0], self.intervals[:, 1]
        if ends.max(initial=0) <= 0:
            return 0.0
        delta = np.zeros(int(max(ends.max(), starts.max())) + 2)
        live = ends > starts
        np.add.at(delta, starts[live], usage[live])
        np.add.at(delta, ends[live], -usage[live])
        return float(np.cumsum(delta).max(initial=0.0))

    def is_feasible(self, choice) -> bool:
        """True when every chosen cost is finite and memory stays under the limit."""
        choice = np.asarray(choice, dtype=np.int64)
        if not np.isfinite(self.cost(choice)):
            return False
        if self.memory_limit is None:
            return True
        return self.peak_memory(choice) <= self.memory_limit * (1 + 1e-9)

    def save(self, path) -> None:
        """Write the problem to ``path`` as a compressed ``.npz`` (:meth:`load` reads it back)."""
        arrays = {"sizes": np.array([c.size for c in self.node_costs], dtype=np.int64),
                  "node_costs": np.concatenate(self.node_costs), "edges": self.edges,
                  "edge_costs": (np.concatenate([m.reshape(-1) for m in self.edge_costs]) if self.num_edges
                                 else np.zeros(0))}
        if self.node_memory is not None:
            arrays["node_memory"] = np.concatenate(self.node_memory)
        if self.intervals is not None:
            arrays["intervals"] = self.intervals
        if self.memory_limit is not None:
            arrays["memory_limit"] = np.float64(self.memory_limit)
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path) -> ShardingProblem:
        """A problem written by :meth:`save`."""
        z = np.load(path)
        sizes = z["sizes"]
        cuts = np.cumsum(sizes)[:-1]
        edges = z["edges"].reshape(-1, 2)
        cells = np.array([sizes[u] * sizes[v] for u, v in edges], dtype=np.int64)
        flat = np.split(z["edge_costs"], np.cumsum(cells)[:-1]) if len(edges) else []
        return cls(node_costs=np.split(z["node_costs"], cuts), edges=edges,
                   edge_costs=[f.reshape(sizes[u], sizes[v]) for f, (u, v) in zip(flat, edges, strict=True)],
                   node_memory=np.split(z["node_memory"], cuts) if "node_memory" in z else None,
                   intervals=z["intervals"] if "intervals" in z else None,
                   memory_limit=float(z["memory_limit"]) if "memory_limit" in z else None)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardingSolution:
    """What :func:`autoshard.solver.solve` returns.

    Attributes:
      choice: int64 array ``(N,)``, one strategy index per node.
      cost: the objective of ``choice``, recomputed from the problem.
      peak_memory: the largest summed usage of ``choice``.
      feasible: whether ``choice`` has finite cost and respects the memory limit.
      optimal: whether the solver proved optimality.
      seconds: wall time spent solving.
      stats: diagnostics: the reductions applied, core size, ``stop`` (why the
        search stopped: "optimal", "gap", "stalled" or "time_limit"), and
        ``bound`` / ``gap`` where a lower bound is known.
    """

    choice: np.ndarray
    cost: float
    peak_memory: float
    feasible: bool
    optimal: bool = False
    seconds: float = 0.0
    stats: dict = dataclasses.field(default_factory=dict)
