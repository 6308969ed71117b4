"""The alpha-beta cost model: collectives, resharding, compute.

Costs are seconds on one device. Collective formulas follow Alpa (OSDI'22, §4.1):
on one mesh axis with ``n`` devices, ``B`` bytes and link cost ``α + β·bytes``,

- all-gather     = α + β·(n−1)/n·B      (B: the gathered buffer per device)
- all-reduce     = α + 2β·(n−1)/n·B     (B: the buffer per device)
- reduce-scatter = α + β·(n−1)/n·B      (B: the buffer before scattering)
- all-to-all     = α + β·(n−1)/n·B·p    (B: the buffer per device; p the penalty)

A collective over several axes runs hierarchically, fastest axis first (see
``CostModel.collective_time``); an all-to-all over several axes is one ring at the
slowest axis's bandwidth and the summed latency.
"""

from __future__ import annotations

import dataclasses
import math

from autoshard.spec import MeshInfo, ShardingSpec

ALL_TO_ALL_PENALTY = 1.5
"""All-to-all moves less data than an all-gather but is harder on the network (Alpa uses a penalty too)."""

ELEMENTWISE_FLOPS_PER_ELEMENT = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class Collective:
    """One collective a strategy or a reshard performs: for reports and fidelity checks."""

    kind: str  # "all-reduce" | "all-gather" | "reduce-scatter" | "all-to-all"
    axes: tuple[int, ...]
    bytes: float  # per-device bytes as the formulas above define B


@dataclasses.dataclass(frozen=True, slots=True)
class CostModel:
    """Per-axis alpha and beta plus device flop/s, for one mesh."""

    mesh: MeshInfo
    flops: float
    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    reduce_scatter_as_all_reduce: bool = False
    """XLA's CPU backend emits a reduce-scatter as an all-reduce plus a slice; price it so there."""
    widen_half_precision: bool = False
    """XLA's CPU backend moves 2-byte floats (bf16, f16) through collectives as f32; price them so there."""
    _memo: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def create(cls, mesh: MeshInfo, cluster, *, platform: str = "gpu") -> CostModel:
        """Build from a ``ClusterSpec`` (scalar or per-axis bandwidth and latency)."""
        bw = _per_axis(cluster.bandwidth, mesh.ndim, "bandwidth")
        lat = _per_axis(cluster.latency, mesh.ndim, "latency")
        return cls(mesh, float(cluster.flops), tuple(lat), tuple(1.0 / b for b in bw),
                   reduce_scatter_as_all_reduce=platform == "cpu", widen_half_precision=platform == "cpu")

    def without_latency(self) -> CostModel:
        """The same model with zero alpha: for collectives that XLA will combine with others."""
        hit = self._memo.get("without_latency")
        if hit is None:
            hit = self._memo["without_latency"] = dataclasses.replace(
                self, alpha=(0.0,) * len(self.alpha), _memo={})
        return hit

    def _ring(self, axes) -> tuple[int, float, float]:
        axes = tuple(a for a in axes if self.mesh.shape[a] > 1)
        if not axes:
            return 1, 0.0, 0.0
        n = self.mesh.axes_size(axes)
        return n, sum(self.alpha[a] for a in axes), max(self.beta[a] for a in axes)

    def collective_time(self, c: Collective) -> float:
        """Alpha-beta seconds of one collective.

        Over several mesh axes, all-gather, reduce-scatter and all-reduce run
        hierarchically, fastest axis first: axis ``k`` moves ``B / (n_0···n_{k−1})``
        bytes, so slow links carry the least (as NCCL and XLA do across nodes, and as
        :meth:`autoshard.ClusterSpec.collective_cost` scores them). An all-reduce pays
        ``2α`` on every axis but the last. All-to-all is one ring on the slowest axis."""
        axes = [a for a in c.axes if self.mesh.shape[a] > 1]
        if not axes:
            return 0.0
        kind = c.kind
        if kind == "reduce-scatter" and self.reduce_scatter_as_all_reduce:
            kind = "all-reduce"
        if kind == "all-to-all":
            n, alpha, beta = self._ring(axes)
            return alpha + beta * (n - 1) / n * c.bytes * ALL_TO_ALL_PENALTY
        if kind not in ("all-reduce", "all-gather", "reduce-scatter"):
            raise ValueError(f"unknown collective kind {c.kind!r}")
        axes.sort(key=lambda a: (self.beta[a], a))
        total, chunk = 0.0, float(c.bytes)
        for k, a in enumerate(axes):
            n = self.mesh.shape[a]
            if kind == "all-reduce":
                total += self.alpha[a] * (1 if k == len(axes) - 1 else 2) + 2 * self.beta[a] * (n - 1) / n * chunk
            else:
                total += self.alpha[a] + self.beta[a] * (n - 1) / n * chunk
            chunk /= n
        return total

    def compute_time(self, flops: float) -> float:
        return flops / self.flops

    def reshard(self, shape: tuple[int, ...], itemsize: int, src: ShardingSpec, dst: ShardingSpec):
        """(seconds, collectives) to move an array from ``src`` to ``dst`` layout."""
        if src == dst:
            return 0.0, ()
        if itemsize == 2 and self.widen_half_precision:
            itemsize = 4
        key = (shape, itemsize, src, dst)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = _reshard(self, tuple(shape), itemsize, src, dst)
        return hit

    def reshard_time(self, shape, itemsize, src, dst) -> float:
        return self.reshard(shape, itemsize, src, dst)[0]


def _per_axis(value, ndim: int, field: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * ndim
    value = [float(v) for v in value]
    if len(value) != ndim:
        from autoshard.errors import MeshError

        raise MeshError(f"ClusterSpec.{field} has {len(value)} entries but the mesh has {ndim} axes")
    return value


def _reshard(model: CostModel, shape, itemsize, src: ShardingSpec, dst: ShardingSpec):
    """Alpa-style resharding: per mesh axis, gather what ``dst`` does not shard,
    all-to-all what moves to another dimension, slice (free) what ``dst`` adds.

    A move that also changes the order of axes on one dimension is priced as a
    full gather followed by a free slice, which is what XLA falls back to."""
    if src == dst:
        return 0.0, ()
    mesh = model.mesh
    total = math.prod(shape) * itemsize
    gathers, moves = [], []
    for a in mesh.active_axes:
        s, d = src.dim_of(a), dst.dim_of(a)
        if s == d:
            continue
        if s is not None and d is None:
            gathers.append(a)
        elif s is not None:
            moves.append(a)
    # Axis order within one dimension must agree for the kept axes; otherwise gather them too.
    for i, (sd, dd) in enumerate(zip(src.dims, dst.dims, strict=True)):
        kept_s = [a for a in sd if a not in gathers and a not in moves]
        kept_d = [a for a in dd if a in kept_s]
        if kept_s != kept_d or dd[: len(kept_s)] != tuple(kept_s):
            gathers.extend(a for a in kept_s if a not in gathers)
            moves = [a for a in moves if a not in sd]
    collectives = []
    sharded = set(src.used_axes)
    if gathers:
        sharded -= set(gathers)
        collectives.append(Collective("all-gather", tuple(sorted(gathers)), total / mesh.axes_size(sharded)))
    if moves:
        collectives.append(Collective("all-to-all", tuple(sorted(moves)), total / mesh.axes_size(sharded)))
    return sum(model.collective_time(c) for c in collectives), tuple(collectives)
