"""The alpha-beta cost model: collectives, resharding, compute.

Costs are seconds on one device. A collective is priced by
:func:`autoshard.collectives.collective_seconds` (Alpa, OSDI'22, §4.1), the same formula
:func:`autoshard.hlo_schedule.estimate_step_time` scores compiled programs with; see
:mod:`autoshard.collectives` for the formulas and what ``B`` is for each kind.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from autoshard.collectives import Collective, CollectiveKind, Link, collective_seconds
from autoshard.spec import MeshInfo, ShardingSpec

__all__ = ["Collective", "CostModel"]

ELEMENTWISE_FLOPS_PER_ELEMENT = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class CostModel:
    """Prices ops and collectives on one mesh.

    With a :class:`~autoshard.perf.Hardware` (every GPU and TPU preset), an op's :class:`~autoshard.perf.Work`
    is priced by the roofline of :mod:`autoshard.perf.compute` and a collective over mesh axes at the
    slowest network tier its device group crosses (:mod:`autoshard.perf.comm`). Without one (``cpu-sim``, a
    hand-written :class:`~autoshard.ClusterSpec`), compute is ``flops / cluster.flops`` and a collective
    Alpa's alpha-beta formula on the per-axis links (:func:`autoshard.collectives.collective_seconds`)."""

    mesh: MeshInfo
    flops: float
    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    reduce_scatter_as_all_reduce: bool = False
    """The backend emits a reduce-scatter as an all-reduce plus a slice (XLA:CPU); price it so."""
    widen_half_precision: bool = False
    """The backend moves 2-byte floats (bf16, f16) through collectives as f32 (XLA:CPU); price them so."""
    hardware: Any = None
    """The :class:`~autoshard.perf.Hardware`, or None (alpha-beta only)."""
    inner_span: int | None = None
    """Devices per group of the innermost tier (``ClusterSpec.nodes``); None: the hardware's."""
    overlap: bool = False
    """Asynchronous collectives overlap independent compute (XLA:GPU and XLA:TPU; not XLA:CPU)."""
    profile: Any = dataclasses.field(default=None, compare=False, hash=False)
    """The :class:`~autoshard.backends.BackendProfile` (which values XLA writes out, for the bytes ops move)."""
    _memo: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def create(cls, mesh: MeshInfo, cluster, *, profile=None, platform: str | None = None) -> CostModel:
        """Build from a ``ClusterSpec`` (scalar or per-axis bandwidth and latency, or a hardware model).

        ``profile``: the :class:`~autoshard.backends.BackendProfile` of the backend that compiles
        the plan (its reduce-scatter and half-precision collectives are priced as it emits them);
        ``platform`` names one instead; neither: the GPU profile. Collectives overlap compute when the
        cluster's hardware is a GPU or TPU (their XLA backends run them asynchronously), else when the
        profile says so."""
        from autoshard.backends import GPU, profile_for

        if profile is None:
            profile = GPU if platform is None else profile_for(platform)
        hardware = getattr(cluster, "hardware", None)
        if hardware is not None:
            shape = mesh.shape
            links = [cluster.axis_link(shape, (a,)) for a in range(mesh.ndim)]
            bw, lat = [b for b, _ in links], [a for _, a in links]
            overlap = hardware.accelerator.platform in ("gpu", "tpu")
            inner = cluster.inner_span(mesh.size)
        else:
            bw = _per_axis(cluster.bandwidth, mesh.ndim, "bandwidth")
            lat = _per_axis(cluster.latency, mesh.ndim, "latency")
            overlap, inner = bool(profile.async_collectives), None
        fields = (mesh, float(cluster.flops), tuple(lat), tuple(1.0 / b for b in bw),
                  profile.reduce_scatter_as_all_reduce, profile.widen_half_precision_collectives,
                  hardware, inner, overlap)
        return cls(*fields, profile=profile, _memo=_shared_memo((*fields, profile.platform)))

    def without_latency(self) -> CostModel:
        """The same model with zero alpha: for collectives that XLA will combine with others."""
        hit = self._memo.get("without_latency")
        if hit is None:
            hit = self._memo["without_latency"] = dataclasses.replace(
                self, alpha=(0.0,) * len(self.alpha), _memo={"latency": 0.0})
        return hit

    def links(self, axes) -> list[Link]:
        """One :class:`~autoshard.collectives.Link` per mesh axis in ``axes``, in mesh-axis order."""
        return [Link(self.mesh.shape[a], self.alpha[a], self.beta[a]) for a in sorted(axes)]

    def collective_time(self, c: Collective) -> float:
        """Seconds of one collective: on the hardware's tiers when there is a hardware model, else Alpa's
        alpha-beta formula (:func:`~autoshard.collectives.collective_seconds`)."""
        kind = c.kind
        if kind is CollectiveKind.REDUCE_SCATTER and self.reduce_scatter_as_all_reduce:
            kind = CollectiveKind.ALL_REDUCE
        if self.hardware is None:
            return collective_seconds(kind, c.bytes, self.links(c.axes))
        from autoshard.perf.comm import mesh_collective_seconds

        return mesh_collective_seconds(self.hardware, kind, c.bytes, self.mesh.shape, c.axes,
                                       inner_span=self.inner_span, latency=self._memo.get("latency"))

    def stream(self, c: Collective) -> str:
        """The communication stream (network tier) a collective runs on, for the step's schedule."""
        if self.hardware is None:
            return "comm"
        from autoshard.perf.comm import group_link
        from autoshard.perf.hardware import ring_span

        group = self.mesh.axes_size(c.axes)
        return group_link(self.hardware, group, ring_span(self.mesh.shape, c.axes), inner_span=self.inner_span).tier

    def compute_time(self, flops: float) -> float:
        """Seconds of ``flops`` at the cluster's flop/s: the rules' price when there is no hardware model."""
        return flops / self.flops

    def work_time(self, work) -> float:
        """Seconds of one op's :class:`~autoshard.perf.Work`: its roofline on the hardware, else its flops at
        the cluster's flop/s."""
        if self.hardware is None:
            return work.flops / self.flops
        from autoshard.perf.compute import seconds

        return seconds(work, self.hardware.accelerator)

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


_MEMOS: dict = {}
_MAX_MEMOS = 256


def _shared_memo(fields: tuple) -> dict:
    """The reshard memo of every cost model with these fields: a reshard's price depends on nothing else,
    so the plans of many programs on one mesh (a pipeline's layers on each sub-mesh) price each once."""
    return recent_dict(_MEMOS, fields, _MAX_MEMOS)


def recent_dict(table: dict, key, most: int) -> dict:
    """The dict ``table`` keeps under ``key`` (a new one when absent), ``table`` holding the ``most`` most
    recently asked for (in insertion order: the least recently used goes first)."""
    memo = table.pop(key, None)
    if memo is None:
        memo = {}
        while len(table) >= most:
            table.pop(next(iter(table)))  # the least recently used
    table[key] = memo
    return memo


def _per_axis(value, ndim: int, field: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * ndim
    value = [float(v) for v in value]
    if len(value) != ndim:
        from autoshard.errors import MeshError

        raise MeshError(f"ClusterSpec.{field} has {len(value)} entries but the mesh has {ndim} axes")
    return value


def _reshard(model: CostModel, shape, itemsize, src: ShardingSpec, dst: ShardingSpec):
    """The collectives XLA's SPMD partitioner emits to move an array from ``src`` to ``dst``.

    Alpa prices a reshard per mesh axis (gather what ``dst`` drops, all-to-all
    what moves, slice what it adds). XLA's partitioner also depends on how the
    tiles of each dimension nest, and this follows what it compiles for a
    ``with_sharding_constraint`` (checked on every pair of layouts of a matrix on
    2×4 and 4×2 meshes and of a rank-3 array on 2×4, see tests/test_cost.py):

    1. ``dst`` refines ``src`` on every dimension: a slice, free where every
       device's new tile lies in its old one, else one collective-permute of
       the new shards (``(b,) -> (a, b)``, axes reordered, ``(a,) -> (b,)``).
    2. ``src`` refines ``dst``: an all-gather per dimension, last dimension
       first, each moving the buffer it produces; first a permute of the old
       shards where they are not nested in the new tiles (``(a, b) -> (b,)``).
    3. Otherwise, in XLA's order: gather what ``dst`` drops (dimensions no axis
       leaves), slice what it adds (except onto a dimension an axis leaves: that
       slice comes after), one all-to-all per pair of dimensions an axis moves
       between, and a permute where the axis order of a dimension still differs
       (or a kept axis sits minor to a moving one). XLA replicates the whole
       array and slices instead when an axis is dropped while another is added,
       or dropped from a dimension another axis leaves, or when axes leave one
       dimension for two or join one from two.
    """
    mesh = model.mesh
    active = set(mesh.active_axes)
    s = tuple(tuple(a for a in d if a in active) for d in src.dims)
    d = tuple(tuple(a for a in x if a in active) for x in dst.dims)
    if s == d:
        return 0.0, ()
    total = math.prod(shape) * itemsize

    def shard(dims) -> float:
        return total / math.prod(mesh.axes_size(x) for x in dims)

    ns, nd = [mesh.axes_size(x) for x in s], [mesh.axes_size(x) for x in d]
    colls: list[Collective] = []
    if all(b % a == 0 for a, b in zip(ns, nd, strict=True)):
        if not _nested(d, s, mesh.shape):
            colls.append(Collective("collective-permute", _axes_of(s, d), shard(d)))
    elif all(a % b == 0 for a, b in zip(ns, nd, strict=True)):
        colls.extend(_gather(s, d, mesh.shape, shard))
    else:
        colls.extend(_mixed(s, d, mesh.shape, shard))
    return sum(model.collective_time(c) for c in colls), tuple(colls)


def _axes_of(*specs) -> tuple[int, ...]:
    """The mesh axes that any of these per-dimension axis tuples use, sorted."""
    return tuple(sorted({a for dims in specs for x in dims for a in x}))


def _tiles(dims, shape) -> list:
    """Per dimension, the tile index of every device (devices in mesh order)."""
    coords = np.indices(shape).reshape(len(shape), -1)
    out = []
    for axes in dims:
        idx = np.zeros(coords.shape[1], dtype=np.int64)
        for a in axes:
            idx = idx * shape[a] + coords[a]
        out.append(idx)
    return out


@functools.lru_cache(maxsize=1 << 16)
def _nested(fine, coarse, shape) -> bool:
    """Whether every device's tile under ``fine`` lies inside its own tile under ``coarse`` (per-dimension axis
    tuples and the mesh's shape, all tuples). Memoised: a layout pair recurs for every array shape that moves
    between them (Llama-3.1-70B planned on (2, 16, 8) asks it 52,000 times, of 4,100 pairs)."""
    for f, c, nf, nc in zip(_tiles(fine, shape), _tiles(coarse, shape),
                            [math.prod(shape[a] for a in x) for x in fine],
                            [math.prod(shape[a] for a in x) for x in coarse], strict=True):
        if not np.array_equal(f // (nf // nc), c):
            return False
    return True


def _gather(cur, dst, shape, shard) -> list[Collective]:
    """Coarsen ``cur`` to ``dst`` (which it refines): a permute where the tiles do not nest,
    then one all-gather per dimension, last first, of the buffer each produces."""
    colls = []
    if not _nested(cur, dst, shape):
        colls.append(Collective("collective-permute", _axes_of(cur, dst), shard(cur)))
    cur = list(cur)
    for i in reversed(range(len(cur))):
        if cur[i] != dst[i]:
            axes = tuple(sorted(set(cur[i]) - set(dst[i]))) or cur[i]
            cur[i] = dst[i]
            colls.append(Collective("all-gather", axes, shard(cur)))
    return colls


def _mixed(s, d, shape, shard) -> list[Collective]:
    """Gather, slice, all-to-all, permute: case 3 of :func:`_reshard`."""
    dim_in = {a: i for i, x in enumerate(d) for a in x}
    used = {a for x in s for a in x}
    moving = [(i, a) for i, x in enumerate(s) for a in x if dim_in.get(a, i) != i]
    sources = {i for i, _ in moving}
    gathered = {i for i, x in enumerate(s) for a in x if a not in dim_in}
    fresh = any(a not in used for x in d for a in x)

    def replicate_then_slice():
        return _gather(s, tuple(() for _ in s), shape, shard)

    pairs = {(i, dim_in[a]) for i, a in moving}
    if gathered and (fresh or gathered & sources):
        return replicate_then_slice()
    if len({i for i, _ in pairs}) < len(pairs) or len({j for _, j in pairs}) < len(pairs):
        return replicate_then_slice()  # axes leaving one dimension for two, or joining one from two
    reorder = False
    for i in sources:
        after = s[i][min(s[i].index(a) for j, a in moving if j == i):]
        reorder |= any(dim_in.get(a, i) == i for a in after)  # a kept axis minor to a moving one
    colls = []
    cur = [list(x) for x in s]
    if gathered:  # on other dimensions than the moving axes: gathered first
        now = tuple(s)
        keep = tuple(tuple(a for a in x if a in dim_in) for x in now)
        colls.extend(_gather(now, keep, shape, shard))
        cur = [list(x) for x in keep]

    def slice_onto(dims):
        for i in dims:
            cur[i].extend(a for a in d[i] if a not in used and a not in cur[i])

    slice_onto(i for i in range(len(d)) if i not in sources)  # XLA slices first, but where an axis leaves
    for i, a in moving:
        cur[i].remove(a)
        cur[dim_in[a]].append(a)
    for i, _ in sorted(pairs):  # one all-to-all per pair of dimensions
        colls.append(Collective("all-to-all", tuple(sorted(a for k, a in moving if k == i)), shard(cur)))
    if reorder:
        colls.append(Collective("collective-permute", tuple(sorted(a for _, a in moving)), shard(cur)))
    slice_onto(range(len(d)))
    if tuple(tuple(x) for x in cur) != d and not (colls and colls[-1].kind == "collective-permute"):
        colls.append(Collective("collective-permute", _axes_of(cur, d), shard(d)))
    return colls
