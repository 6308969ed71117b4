"""Sharding specs: which mesh axes split each dimension of an array.

A :class:`ShardingSpec` is the planner's own, hashable form of a
``PartitionSpec``: for each array dimension, the tuple of mesh-axis indices that
split it, major to minor. ``MeshInfo`` is the static shape of a mesh; axes of
size 1 never shard anything, so they are not "active".
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import NamedTuple

import numpy as np
from jax.sharding import PartitionSpec


@dataclasses.dataclass(frozen=True, slots=True)
class MeshInfo:
    """The static shape of a device mesh: axis sizes and names."""

    shape: tuple[int, ...]
    names: tuple[str, ...]

    def __post_init__(self):
        if len(self.shape) != len(self.names):
            raise ValueError(f"mesh shape {self.shape} and axis names {self.names} differ in length")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def active_axes(self) -> tuple[int, ...]:
        return tuple(i for i, n in enumerate(self.shape) if n > 1)

    def axes_size(self, axes) -> int:
        return math.prod(self.shape[a] for a in axes)

    @classmethod
    def from_mesh(cls, mesh) -> MeshInfo:
        """The shape and names of a ``jax.sharding.Mesh`` or ``AbstractMesh``."""
        return cls(tuple(int(n) for n in mesh.axis_sizes), tuple(mesh.axis_names))


class ShardingSpec(NamedTuple):
    """Per array dimension, the mesh axes (by index) that split it.

    ``ShardingSpec(((0,), ()))`` shards dimension 0 of a matrix along mesh axis 0
    and replicates dimension 1. It is an immutable named tuple: hashing and
    comparing it is as cheap as for a tuple, which the planner does millions of
    times.
    """

    dims: tuple[tuple[int, ...], ...]

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def used_axes(self) -> frozenset[int]:
        return frozenset(a for d in self.dims for a in d)

    def without(self, axes) -> ShardingSpec:
        """This layout with mesh ``axes`` taken out of every dimension (what a sum over them leaves whole)."""
        drop = set(axes)
        return ShardingSpec(tuple(tuple(a for a in d if a not in drop) for d in self.dims))

    def dim_of(self, axis: int) -> int | None:
        """The dimension that ``axis`` splits, or None."""
        for i, d in enumerate(self.dims):
            if axis in d:
                return i
        return None

    def num_shards(self, mesh: MeshInfo) -> int:
        return math.prod(mesh.shape[a] for d in self.dims for a in d)

    def shard_shape(self, shape, mesh: MeshInfo) -> tuple[int, ...]:
        return tuple(-(-n // mesh.axes_size(d)) for n, d in zip(shape, self.dims, strict=True))

    def is_replicated(self) -> bool:
        return all(not d for d in self.dims)

    def to_partition_spec(self, mesh: MeshInfo) -> PartitionSpec:
        entries = []
        for d in self.dims:
            if not d:
                entries.append(None)
            elif len(d) == 1:
                entries.append(mesh.names[d[0]])
            else:
                entries.append(tuple(mesh.names[a] for a in d))
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    @classmethod
    def from_partition_spec(cls, pspec: PartitionSpec, rank: int, mesh: MeshInfo) -> ShardingSpec:
        """Convert a ``PartitionSpec``; raises ValueError on unknown axis names."""
        if len(pspec) > rank:
            raise ValueError(f"PartitionSpec {pspec} has {len(pspec)} entries for an array of rank {rank}")
        dims = []
        for entry in tuple(pspec) + (None,) * (rank - len(pspec)):
            if entry is None:
                dims.append(())
                continue
            names = (entry,) if isinstance(entry, str) else tuple(entry)
            for n in names:
                if n not in mesh.names:
                    raise ValueError(f"PartitionSpec {pspec} names axis {n!r}, not in mesh axes {mesh.names}")
            dims.append(tuple(mesh.names.index(n) for n in names))
        return cls(tuple(dims))

    def __str__(self) -> str:
        return "[" + ", ".join("R" if not d else "S" + "".join(str(a) for a in d) for d in self.dims) + "]"


def replicated(rank: int) -> ShardingSpec:
    return _replicated(rank)


@functools.cache
def _replicated(rank: int) -> ShardingSpec:
    return ShardingSpec(((),) * rank)


@functools.lru_cache(maxsize=4096)
def candidate_specs(shape: tuple[int, ...], mesh: MeshInfo) -> tuple[ShardingSpec, ...]:
    """Every spec that splits ``shape`` evenly: each active mesh axis picks one
    dimension or none. Axes on the same dimension go in increasing index order."""
    axes = mesh.active_axes
    rank = len(shape)
    out = []
    for choice in itertools.product(range(-1, rank), repeat=len(axes)):
        dims = [[] for _ in range(rank)]
        for a, d in zip(axes, choice, strict=True):
            if d >= 0:
                dims[d].append(a)
        if all(shape[i] % mesh.axes_size(dims[i]) == 0 for i in range(rank)):
            out.append(ShardingSpec(tuple(tuple(d) for d in dims)))
    return tuple(out)


def dtype_itemsize(dtype) -> int:
    """Bytes per element of ``dtype`` (a dtype or its name). An extended dtype, a typed PRNG key
    (``key<fry>``), counts its key data: 8 bytes for threefry, 16 for rbg."""
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 8 if "fry" in str(dtype) else 16
