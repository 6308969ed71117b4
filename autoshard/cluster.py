"""What the hardware can do: a cluster description, collective costs and meshes.

A :class:`ClusterSpec` holds per-device compute throughput, per-mesh-axis link
bandwidth and latency, and per-device memory. The cost model prices
collectives with Alpa's alpha-beta model (Zheng et al., OSDI 2022, §4.1), on one
mesh axis of ``n`` devices moving a buffer of ``B`` bytes::

    all-gather      α + β·(n−1)/n·B          B = the gathered (result) buffer
    reduce-scatter  α + β·(n−1)/n·B          B = the unscattered (input) buffer
    all-reduce      α + 2β·(n−1)/n·B         B = the buffer
    all-to-all      α + β·(n−1)/n²·B·p       B = n × the per-device buffer
    permute         α + β·B                  B = the per-device buffer

with ``β = 1/bandwidth`` and ``p = ALL_TO_ALL_PENALTY``. Every cost is 0 when
``n == 1``.

Numbers come from a preset (:func:`cluster_preset`), from your own
``ClusterSpec(...)``, or from measuring the devices at hand
(:func:`profile_cluster`). Nothing here touches a device at import time.

Example:
    >>> spec = cluster_preset("h100-2node-ib").for_mesh((2, 8))
    >>> spec.all_reduce_cost(2**30, axis=1, n=8) < spec.all_reduce_cost(2**30, axis=0, n=2)
    True
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from autoshard.collectives import ALL_TO_ALL_PENALTY, CollectiveKind, Link, collective_seconds
from autoshard.errors import InputError, MeshError

__all__ = [
    "ALL_TO_ALL_PENALTY",
    "PRESETS",
    "ClusterSpec",
    "SEARCH_AXES",
    "candidate_meshes",
    "cluster_preset",
    "ensure_auto_mesh",
    "is_abstract",
    "make_mesh",
    "mesh_shape",
    "profile_cluster",
]

def _as_positive(field: str, value: Any) -> float | tuple[float, ...]:
    """Checks that ``value`` is a positive number or a non-empty tuple of them."""
    if isinstance(value, (list, tuple, np.ndarray)):
        out = tuple(float(v) for v in value)
        if not out:
            raise ValueError(f"ClusterSpec.{field} is an empty sequence; give a number or one per mesh axis")
        for i, v in enumerate(out):
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"ClusterSpec.{field}[{i}] must be a positive finite number, got {v!r}")
        return out
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"ClusterSpec.{field} must be a number, got {value!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"ClusterSpec.{field} must be a positive finite number, got {value!r}")
    return v


def mesh_shape(mesh_or_shape: Any) -> tuple[int, ...]:
    """The axis sizes of a ``Mesh``, an ``AbstractMesh``, a shape tuple or a device count."""
    if hasattr(mesh_or_shape, "axis_sizes"):
        return tuple(int(s) for s in mesh_or_shape.axis_sizes)
    if hasattr(mesh_or_shape, "devices") and hasattr(mesh_or_shape.devices, "shape"):
        return tuple(int(s) for s in mesh_or_shape.devices.shape)
    if isinstance(mesh_or_shape, int):
        return (mesh_or_shape,)
    return tuple(int(s) for s in mesh_or_shape)


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterSpec:
    """Per-device compute, per-axis links and per-device memory of a cluster.

    Attributes:
      flops: achievable matmul throughput of one device, in flop/s.
      bandwidth: link bandwidth in bytes/s per mesh axis, as a tuple in mesh-axis
        order, or one number for every axis.
      latency: the fixed cost α of one collective in seconds, per mesh axis or one
        number for every axis.
      memory: device memory in bytes.
      host_bandwidth: device <-> host copy bandwidth in bytes/s.
      name: a label, kept through :meth:`for_mesh` and JSON.
      hardware: the :class:`~autoshard.perf.Hardware` (chip and network tiers) the performance model
        prices with (:mod:`autoshard.perf`): a roofline per op, collectives at their device group's slowest
        tier, async collectives overlapping compute. None (a hand-written spec, ``cpu-sim``): ``flops`` and
        the per-axis alpha-beta links alone, no overlap. With hardware, ``flops``, ``bandwidth`` and
        ``latency`` are its summary (the sustained bf16 matmul rate, the innermost tier) for code that reads
        them, and the tiers decide.
      nodes: how many groups of the innermost tier (nodes, TPU slices) the mesh's devices are spread over;
        None: as many as the hardware's node size makes (8 GPUs a node). ``h100-2node-ib`` is ``nodes=2``:
        a mesh ``(2, k)`` then has its first axis across the two nodes whatever ``k`` is.
      mesh_shape: set by :meth:`for_mesh` on a spec with hardware: the mesh whose device groups
        :meth:`collective_cost` prices.

    Example:
        >>> spec = ClusterSpec(flops=1e12, bandwidth=1e10, latency=1e-5, memory=2**32)
        >>> spec.for_mesh((2, 4)).bandwidth
        (10000000000.0, 10000000000.0)
    """

    flops: float
    bandwidth: float | tuple[float, ...]
    latency: float | tuple[float, ...]
    memory: float
    host_bandwidth: float = 25e9
    name: str = "custom"
    hardware: Any = None
    nodes: int | None = None
    mesh_shape: tuple[int, ...] | None = None

    def __post_init__(self):
        for field in ("flops", "memory", "host_bandwidth"):
            value = getattr(self, field)
            if isinstance(value, (list, tuple)):
                raise ValueError(f"ClusterSpec.{field} must be a single number, got {value!r}")
            object.__setattr__(self, field, _as_positive(field, value))
        object.__setattr__(self, "bandwidth", _as_positive("bandwidth", self.bandwidth))
        object.__setattr__(self, "latency", _as_positive("latency", self.latency))
        if not isinstance(self.name, str):
            raise ValueError(f"ClusterSpec.name must be a string, got {self.name!r}")
        if isinstance(self.hardware, str):
            from autoshard.perf.hardware import hardware_preset

            object.__setattr__(self, "hardware", hardware_preset(self.hardware))
        if self.nodes is not None and (not isinstance(self.nodes, int) or self.nodes < 1):
            raise ValueError(f"ClusterSpec.nodes must be a positive int or None, got {self.nodes!r}")
        bw, lat = self.bandwidth, self.latency
        if isinstance(bw, tuple) and isinstance(lat, tuple) and len(bw) != len(lat):
            raise ValueError(
                f"ClusterSpec.bandwidth has {len(bw)} mesh axes but ClusterSpec.latency has {len(lat)}"
            )

    # -- per-axis numbers ---------------------------------------------------------

    @property
    def ndim(self) -> int | None:
        """The number of mesh axes the per-axis numbers describe, or None if scalar."""
        for v in (self.bandwidth, self.latency):
            if isinstance(v, tuple):
                return len(v)
        return None

    @classmethod
    def from_hardware(cls, hardware, *, name: str | None = None, nodes: int | None = None,
                      memory: float | None = None) -> ClusterSpec:
        """The cluster of :class:`~autoshard.perf.Hardware` ``hardware`` (or a preset's name, ``"h200"``) over
        ``nodes`` nodes or slices (None: as many as the mesh's devices fill); ``memory`` overrides the
        chip's bytes per device. See :func:`from_hardware`."""
        return from_hardware(hardware, name=name, nodes=nodes, memory=memory)

    def for_mesh(self, mesh_or_shape: Any) -> ClusterSpec:
        """Returns this spec with one bandwidth and latency per mesh axis.

        Args:
          mesh_or_shape: a ``jax.sharding.Mesh`` or a mesh shape like ``(2, 4)``.

        Raises:
          MeshError: a per-axis tuple has a different length than the mesh.
        """
        shape = mesh_shape(mesh_or_shape)
        nd = len(shape)
        if self.hardware is not None:
            links = [self.axis_link(shape, (a,)) for a in range(nd)]
            return dataclasses.replace(self, bandwidth=tuple(b for b, _ in links) or self.bandwidth,
                                       latency=tuple(lat for _, lat in links) or self.latency,
                                       mesh_shape=tuple(int(n) for n in shape))
        out = {}
        for field in ("bandwidth", "latency"):
            v = getattr(self, field)
            if isinstance(v, tuple):
                if len(v) != nd:
                    raise MeshError(
                        f"ClusterSpec {self.name!r} gives {field} for {len(v)} mesh axes {v}, but the mesh "
                        f"has {nd} axes (shape {shape}). Give one {field} per mesh axis, e.g. "
                        f"dataclasses.replace(spec, {field}=({', '.join(['...'] * nd)})), or a single number."
                    )
                out[field] = v
            else:
                out[field] = (v,) * nd
        return dataclasses.replace(self, **out)

    def inner_span(self, num_devices: int) -> int | None:
        """Devices in one group of the innermost tier for a mesh of ``num_devices`` (None: the hardware's)."""
        if self.nodes is None:
            return None
        return max(1, num_devices // self.nodes)

    def axis_link(self, shape: Sequence[int], axes: Sequence[int]) -> tuple[float, float]:
        """``(bytes/s per device, latency)`` of a collective over mesh ``axes`` of a mesh ``shape``, from the
        hardware's tiers (:func:`autoshard.perf.comm.group_link`)."""
        from autoshard.perf.comm import group_link
        from autoshard.perf.hardware import ring_span

        shape = tuple(int(n) for n in shape)
        group = math.prod(shape[a] for a in axes)
        link = group_link(self.hardware, group, ring_span(shape, axes), inner_span=self.inner_span(math.prod(shape)))
        return link.bandwidth, link.latency

    def _axis_value(self, field: str, axis: int) -> float:
        v = getattr(self, field)
        if not isinstance(v, tuple):
            return v
        if not -len(v) <= axis < len(v):
            raise MeshError(f"ClusterSpec {self.name!r} has {field} for {len(v)} mesh axes; axis {axis} is out of range")
        return v[axis]

    def axis_bandwidth(self, axis: int) -> float:
        """Bandwidth in bytes/s of mesh axis ``axis``."""
        return self._axis_value("bandwidth", axis)

    def axis_latency(self, axis: int) -> float:
        """Latency α in seconds of one collective on mesh axis ``axis``."""
        return self._axis_value("latency", axis)

    # -- alpha-beta costs on one axis (Alpa §4.1) -----------------------------------

    def link(self, axis: int, n: int) -> Link:
        """The :class:`~autoshard.collectives.Link` of ``n`` devices along mesh axis ``axis``."""
        return Link(int(n), self.axis_latency(axis), 1.0 / self.axis_bandwidth(axis))

    def all_gather_cost(self, nbytes: float, axis: int, n: int) -> float:
        """α + β·(n−1)/n·B seconds; ``nbytes`` is the gathered buffer."""
        return collective_seconds(CollectiveKind.ALL_GATHER, nbytes, [self.link(axis, n)])

    def reduce_scatter_cost(self, nbytes: float, axis: int, n: int) -> float:
        """α + β·(n−1)/n·B seconds; ``nbytes`` is the buffer before scattering."""
        return collective_seconds(CollectiveKind.REDUCE_SCATTER, nbytes, [self.link(axis, n)])

    def all_reduce_cost(self, nbytes: float, axis: int, n: int) -> float:
        """α + 2β·(n−1)/n·B seconds; ``nbytes`` is the reduced buffer."""
        return collective_seconds(CollectiveKind.ALL_REDUCE, nbytes, [self.link(axis, n)])

    def all_to_all_cost(self, nbytes: float, axis: int, n: int) -> float:
        """α + β·(n−1)/n·B·ALL_TO_ALL_PENALTY seconds; ``nbytes`` is the per-device buffer."""
        return collective_seconds(CollectiveKind.ALL_TO_ALL, nbytes, [self.link(axis, n)])

    def permute_cost(self, nbytes: float, axis: int, n: int = 2) -> float:
        """α + β·B seconds: every device sends and receives its ``nbytes`` buffer once."""
        return collective_seconds(CollectiveKind.COLLECTIVE_PERMUTE, nbytes, [self.link(axis, n)])

    def collective_cost(
        self, kind: str, nbytes: float, axes: int | Sequence[int], sizes: int | Sequence[int]
    ) -> float:
        """Seconds for one collective over one or several mesh axes at once.

        Priced by :func:`autoshard.collectives.collective_seconds`: all-gather, reduce-scatter
        and all-reduce run hierarchically, fastest axis first, so slow links carry the least
        data; all-to-all and permute are one group of ``n_0···n_m`` devices on the slowest axis,
        with its latency.

        Args:
          kind: a :class:`~autoshard.collectives.CollectiveKind` or its name (``"all-gather"``,
            ``"all_reduce"``, ``"collective-permute"``, ...).
          nbytes: the per-device buffer ``B`` as the module docstring defines it for ``kind``.
          axes: mesh-axis indices.
          sizes: the number of devices along each of ``axes``.

        Raises:
          ValueError: an unknown kind, or ``axes`` and ``sizes`` of different lengths.
        """
        kind = CollectiveKind.parse(kind)
        axes = (axes,) if isinstance(axes, (int, np.integer)) else tuple(axes)
        sizes = (sizes,) if isinstance(sizes, (int, np.integer)) else tuple(sizes)
        if len(axes) != len(sizes):
            raise ValueError(f"{len(axes)} axes {axes} but {len(sizes)} sizes {sizes}")
        if self.hardware is not None:
            from autoshard.perf.comm import mesh_collective_seconds

            shape = self.mesh_shape if self.mesh_shape is not None else tuple(int(s) for s in sizes)
            axes = axes if self.mesh_shape is not None else tuple(range(len(sizes)))
            return mesh_collective_seconds(self.hardware, kind, nbytes, shape, axes,
                                           inner_span=self.inner_span(math.prod(shape)))
        links = [self.link(a, s) for a, s in sorted(zip(axes, sizes, strict=True))]
        return collective_seconds(kind, nbytes, links)

    # -- serialization ---------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; tuples become lists."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k in ("bandwidth", "latency"):
            if isinstance(d[k], tuple):
                d[k] = list(d[k])
        if d["hardware"] is not None:
            d["hardware"] = d["hardware"].name  # a preset of autoshard.perf.HARDWARE
        if d["mesh_shape"] is not None:
            d["mesh_shape"] = list(d["mesh_shape"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClusterSpec:
        """Inverse of :meth:`to_dict`; unknown keys raise ValueError."""
        names = {f.name for f in dataclasses.fields(cls)}
        extra = set(d) - names
        if extra:
            raise ValueError(f"unknown ClusterSpec fields {sorted(extra)}; expected {sorted(names)}")
        return cls(**d)

    def to_json(self) -> str:
        """Serializes to a JSON string."""
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ClusterSpec:
        """Parses :meth:`to_json` output."""
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        """Writes :meth:`to_json` to ``path``."""
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> ClusterSpec:
        """Reads a spec written by :meth:`save`."""
        with open(path) as f:
            return cls.from_json(f.read())


# ---------------------------------------------------------------------------------
# Presets. Each GPU and TPU preset is a chip and its network from autoshard.perf.hardware, where every
# number has its source; ``flops`` is its sustained bf16 matmul rate and ``bandwidth``/``latency`` its
# innermost tier, a summary for code that reads them (the performance model prices with the tiers).

_GiB = 2**30


def from_hardware(hardware, *, name: str | None = None, nodes: int | None = None,
                  memory: float | None = None) -> ClusterSpec:
    """A :class:`ClusterSpec` for :class:`~autoshard.perf.Hardware` ``hardware`` (or a preset's name).

    Example:
        >>> from_hardware("h200").memory == 141e9
        True
    """
    from autoshard.perf.hardware import hardware_preset

    hw = hardware_preset(hardware) if isinstance(hardware, str) else hardware
    inner = hw.tiers[0]
    return ClusterSpec(flops=hw.accelerator.matmul_rate("bf16"), bandwidth=inner.bandwidth * inner.efficiency,
                       latency=max(inner.latency, 1e-9), memory=hw.memory if memory is None else memory,
                       host_bandwidth=hw.host_bandwidth, name=name or hw.name, hardware=hw, nodes=nodes)


def _presets() -> dict[str, ClusterSpec]:
    presets = {name: from_hardware(name) for name in ("a100-40", "a100-80", "h100", "h200", "b200",
                                                      "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e")}
    presets.update({
        # The names autoshard had before the performance model; the same hardware.
        "h100-nvlink": from_hardware("h100", name="h100-nvlink"),
        "h200-nvlink": from_hardware("h200", name="h200-nvlink"),
        "a100": from_hardware("a100-80", name="a100"),
        # Two (four) H100 nodes: the mesh's devices are split into that many nodes, joined by one 400 Gb/s
        # NDR NIC per GPU; a mesh (2, k) has its first axis across the nodes.
        "h100-2node-ib": from_hardware("h100", name="h100-2node-ib", nodes=2),
        "h100-4node-ib": from_hardware("h100", name="h100-4node-ib", nodes=4),
        # The simulated CPU devices of the tests (--xla_force_host_platform_device_count): no hardware model,
        # flops and alpha-beta links alone.
        "cpu-sim": ClusterSpec(flops=1e11, bandwidth=1e10, latency=1e-5, memory=4 * _GiB, host_bandwidth=1e10,
                               name="cpu-sim"),
    })
    return presets


class _Presets(dict):
    """``PRESETS``, built on first use (the hardware module is not imported with autoshard)."""

    def _fill(self):
        if not dict.__len__(self):
            dict.update(self, _presets())

    def __getitem__(self, k):
        self._fill()
        return dict.__getitem__(self, k)

    def __iter__(self):
        self._fill()
        return dict.__iter__(self)

    def __len__(self):
        self._fill()
        return dict.__len__(self)

    def __contains__(self, k):
        self._fill()
        return dict.__contains__(self, k)

    def keys(self):
        self._fill()
        return dict.keys(self)

    def items(self):
        self._fill()
        return dict.items(self)

    def values(self):
        self._fill()
        return dict.values(self)


PRESETS: dict[str, ClusterSpec] = _Presets()


def preset_for_devices(devices) -> ClusterSpec:
    """The preset for these devices: by ``device_kind`` (an H200 gets ``h200`` and its 141 GB), else by
    platform (``cpu-sim`` on CPU; ``h100`` for an unknown GPU, ``tpu-v5e`` for an unknown TPU).

    Example:
        >>> preset_for_devices([]).name
        'h100'
    """
    from autoshard.perf.hardware import hardware_for_device_kind

    devices = list(devices)
    if not devices:
        return PRESETS["h100"]
    d = devices[0]
    if d.platform == "cpu":
        return PRESETS["cpu-sim"]
    hw = hardware_for_device_kind(str(getattr(d, "device_kind", "")))
    if hw is not None:
        return PRESETS[hw.name]
    return PRESETS["tpu-v5e" if d.platform == "tpu" else "h100"]


def cluster_preset(name: str) -> ClusterSpec:
    """Returns the named preset (see ``PRESETS``).

    Example:
        >>> cluster_preset("a100").memory == 80 * 2**30
        True
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown cluster preset {name!r}; choose one of {sorted(PRESETS)}") from None


# ---------------------------------------------------------------------------------
# Meshes.


def make_mesh(shape: Sequence[int], names: Sequence[str], *, devices: Sequence[Any] | None = None):
    """Builds a ``jax.sharding.Mesh`` whose axes are all ``AxisType.Auto``.

    autoshard pins its plan with ``with_sharding_constraint``, which Explicit axes
    (the default of ``jax.make_mesh``) refuse.

    Args:
      shape: devices along each axis, e.g. ``(2, 4)``.
      names: one unique name per axis, e.g. ``("data", "model")``.
      devices: the devices to lay out, all of them used; default the first
        ``prod(shape)`` of ``jax.devices()``.

    Raises:
      MeshError: the shape does not use exactly the given devices, or the names
        are not unique or not one per axis.

    Example:
        >>> mesh = make_mesh((2, 4), ("data", "model"))  # doctest: +SKIP
    """
    import jax

    shape = tuple(int(s) for s in shape)
    names = (names,) if isinstance(names, str) else tuple(names)
    problems = []
    if len(names) != len(shape):
        problems.append(f"{len(shape)} axes in shape {shape} but {len(names)} names {names}")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        problems.append(f"axis names must be unique, {dup} repeat")
    if any(s < 1 for s in shape):
        problems.append(f"every axis needs at least one device, got shape {shape}")
    devs = list(jax.devices() if devices is None else devices)
    if devices is None and math.prod(shape) < len(devs):
        devs = devs[: math.prod(shape)]
    if math.prod(shape) != len(devs):
        problems.append(
            f"shape {shape} holds {math.prod(shape)} devices but {len(devs)} devices were given"
            + (" (all of jax.devices())" if devices is None else "")
        )
    if problems:
        raise MeshError("cannot build mesh: " + "; ".join(problems))
    axis_types = (jax.sharding.AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, names, axis_types=axis_types, devices=devs)


def ensure_auto_mesh(mesh):
    """Returns ``mesh`` if every axis is ``AxisType.Auto``, else raises MeshError.

    Raises:
      MeshError: some axis is Explicit or Manual; the message shows the fix.
    """
    import jax

    types = tuple(getattr(mesh, "axis_types", ()) or ())
    names = tuple(mesh.axis_names)
    bad = [(n, t) for n, t in zip(names, types, strict=False) if t != jax.sharding.AxisType.Auto]
    if bad:
        shape = mesh_shape(mesh)
        listing = ", ".join(f"{n!r}: {getattr(t, 'name', t)}" for n, t in bad)
        raise MeshError(
            f"autoshard needs a mesh whose axes are all AxisType.Auto; this mesh has {listing}. "
            "jax.make_mesh(...) makes Explicit axes by default, and under Explicit or Manual axes "
            "with_sharding_constraint cannot pin autoshard's plan. Build the mesh with\n"
            f"    autoshard.make_mesh({shape}, {names})\n"
            "or pass axis_types=(jax.sharding.AxisType.Auto,) * ndim to jax.make_mesh."
        )
    return mesh


def resolve_mesh(mesh):
    """The mesh autoshard plans on, from what the user gave.

    - A mesh whose axes are all ``AxisType.Auto``: itself.
    - A mesh with Explicit axes (``jax.make_mesh``'s default): the Auto view of the same devices and
      names. autoshard pins its plan with ``with_sharding_constraint``, which Explicit axes refuse.
    - An ``AbstractMesh`` (device counts this machine need not have): its Auto view. Plans made on
      one are predictions; running them needs a concrete mesh of that shape.
    - None: the ambient mesh of ``with jax.set_mesh(mesh):`` (its Auto view), or None when there is
      none (then the planner chooses a mesh over all devices).
    - An int: a device count, returned as it is: the planner chooses the mesh's shape among
      :func:`candidate_meshes` of that many devices, as ``AbstractMesh`` es (planning only).

    Raises:
      MeshError: an axis is Manual (inside ``shard_map``), or ``mesh`` is not a mesh.
    """
    import jax

    if mesh is None:
        ambient = jax.sharding.get_mesh()
        if ambient is None or getattr(ambient, "empty", False) or not getattr(ambient, "axis_names", ()):
            return None
        mesh = ambient
    if is_device_count(mesh):
        if mesh < 1:
            raise MeshError(f"mesh={mesh!r}: a device count must be positive. Fix: mesh=256 plans for 256 devices.")
        return int(mesh)
    if not isinstance(mesh, jax.sharding.Mesh | jax.sharding.AbstractMesh):
        raise MeshError(f"mesh={mesh!r} is not a jax.sharding.Mesh. Fix: pass autoshard.make_mesh(shape, names), "
                        "a jax.make_mesh(...) mesh, a jax.sharding.AbstractMesh to plan without devices, or a "
                        "device count (mesh=256) to have the planner choose the shape.")
    auto = jax.sharding.AxisType.Auto
    types = tuple(getattr(mesh, "axis_types", ()) or ())
    if all(t == auto for t in types):
        return mesh
    manual = [n for n, t in zip(mesh.axis_names, types, strict=True) if t == jax.sharding.AxisType.Manual]
    if manual:
        raise MeshError(
            f"the mesh's axes {manual} are Manual (this is the mesh inside a shard_map body), and autoshard "
            "plans over Auto axes. Fix: parallelize the function that calls shard_map, on the outer mesh.")
    if is_abstract(mesh):
        return jax.sharding.AbstractMesh(tuple(mesh.axis_sizes), tuple(mesh.axis_names),
                                         axis_types=(auto,) * len(mesh.axis_names))
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(mesh.axis_names))


def is_device_count(mesh) -> bool:
    """Whether ``mesh`` is a device count (an int, not a bool): the planner chooses the shape
    (:func:`candidate_meshes`) and plans on ``AbstractMesh`` es of that many devices."""
    return isinstance(mesh, int | np.integer) and not isinstance(mesh, bool)


SEARCH_AXES = ("data", "fsdp", "tensor")
"""The axis names of the 3-D meshes :func:`candidate_meshes` tries over several nodes (MaxText's names)."""

SEARCH_TENSOR_MAX = 16
"""The largest tensor-parallel degree :func:`candidate_meshes` tries (a TPU slice's span may be thousands)."""


def candidate_meshes(num_devices: int, cluster=None, *, axis_names: Sequence[str] = ("data", "model"),
                     abstract: bool = False) -> list:
    """The meshes the planner tries when it chooses the shape (``mesh=None``, or a device count).

    Over several nodes (more devices than the innermost link tier's group: an 8-GPU NVLink node, or
    ``ClusterSpec.nodes``), the shapes a practitioner tries: ``(nodes, node / t, t)`` over
    :data:`SEARCH_AXES`, for every power-of-two tensor degree ``t`` up to the node (and
    :data:`SEARCH_TENSOR_MAX`). The planner picks every array's layout over any subset of the axes, so each
    of these covers data parallelism, ZeRO-3 over all devices (``data`` and ``fsdp`` together), hybrid
    sharding (``fsdp`` within a node, replicated across nodes) and tensor parallelism within the node:
    every 2-D ``(data, model)`` shape with the model axis inside a node, and the 3-D ones MaxText and
    Megatron-LM configure. Within one node, or on a cluster without link tiers (``cpu-sim``): every 2-D
    factorization over ``axis_names``.

    Args:
      num_devices: the devices to factor.
      cluster: the :class:`ClusterSpec` whose hardware names the node size; None: one node.
      axis_names: the two names of the 2-D candidates (a model written for an Explicit mesh keeps its
        names, and then only 2-D shapes are tried).
      abstract: ``AbstractMesh`` es (planning only) instead of meshes over ``jax.devices()``.

    Example:
        >>> [m.axis_sizes for m in candidate_meshes(64, cluster_preset("h100-nvlink"), abstract=True)]
        [(8, 8, 1), (8, 4, 2), (8, 2, 4), (8, 1, 8)]
    """
    import jax

    n = int(num_devices)
    span = _node_span(cluster, n)
    if span is not None and 1 < span < n and n % span == 0 and tuple(axis_names) == ("data", "model"):
        tensor = [t for t in (2 ** k for k in range(n.bit_length())) if span % t == 0 and t <= SEARCH_TENSOR_MAX]
        shapes, names = [(n // span, span // t, t) for t in tensor], SEARCH_AXES
    else:
        shapes, names = [(a, n // a) for a in range(1, n + 1) if n % a == 0], tuple(axis_names)
    if abstract:
        auto = (jax.sharding.AxisType.Auto,) * len(names)
        return [jax.sharding.AbstractMesh(s, names, axis_types=auto) for s in shapes]
    return [make_mesh(s, names) for s in shapes]


def _node_span(cluster, num_devices: int) -> int | None:
    """Devices in one group of ``cluster``'s innermost link tier for ``num_devices``, or None (one tier)."""
    if cluster is None:
        return None
    if cluster.nodes is not None:
        return cluster.inner_span(num_devices)
    tiers = getattr(cluster.hardware, "tiers", ())
    return tiers[0].span if len(tiers) > 1 else None


def is_abstract(mesh) -> bool:
    """Whether ``mesh`` is a ``jax.sharding.AbstractMesh``: shapes and names, no devices. autoshard plans
    on one (``plan.memory`` and ``plan.cost`` are predictions for that many devices) but cannot run it."""
    import jax

    return isinstance(mesh, jax.sharding.AbstractMesh)


def mesh_like(like, shape: Sequence[int], names: Sequence[str], devices: Sequence[Any] | None = None):
    """A mesh of ``shape`` over ``devices`` (see :func:`make_mesh`), or an ``AbstractMesh`` of that shape
    when ``like`` is one: a pipeline stage of an abstract mesh is abstract too (``devices`` are ignored)."""
    import jax

    if is_abstract(like):
        auto = jax.sharding.AxisType.Auto
        return jax.sharding.AbstractMesh(tuple(int(s) for s in shape), tuple(names), axis_types=(auto,) * len(shape))
    return make_mesh(shape, names, devices=devices)


def device_ids(mesh) -> tuple[int, ...]:
    """The ids of ``mesh``'s devices in mesh order; an ``AbstractMesh``'s are its positions ``0..size-1``."""
    if is_abstract(mesh):
        return tuple(range(int(mesh.size)))
    return tuple(int(d.id) for d in np.asarray(mesh.devices).flat)


def require_devices(mesh, what: str) -> None:
    """Raise :class:`MeshError` when ``mesh`` is an ``AbstractMesh``: a plan made on one is a prediction,
    with no devices to ``what`` (lower, run) it on."""
    if is_abstract(mesh):
        shape = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        raise MeshError(
            f"this step was planned on an AbstractMesh {shape}, which has no devices to {what} it on "
            f"(plan.memory and plan.cost are its predictions). Fix: on a machine with {mesh.size} devices, "
            f"parallelize(..., mesh=autoshard.make_mesh({tuple(mesh.axis_sizes)}, "
            f"{tuple(mesh.axis_names)})), optionally with plan=autoshard.Plan.from_json(saved_json).")


# ---------------------------------------------------------------------------------
# Profiling.


def _best_time(fn, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def _fit_alpha_beta(volumes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of t = α + β·v, kept positive."""
    v = np.asarray(volumes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    a = np.stack([np.ones_like(v), v], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a, t, rcond=None)
    if beta <= 0:  # noise swamped the size dependence: bound β by the largest transfer
        i = int(np.argmax(v))
        beta = t[i] / v[i]
        alpha = float(np.min(t)) / 2
    alpha = max(float(alpha), 1e-9)
    return alpha, float(beta)


def _device_memory(device) -> float:
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    try:
        import jax

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return float(total) / max(1, jax.local_device_count())
    except (ValueError, OSError, AttributeError):
        return float(PRESETS["cpu-sim"].memory)


def profile_cluster(
    mesh,
    *,
    sizes: Sequence[int] = (2**12, 2**16, 2**19),
    matmul_size: int = 512,
    repeats: int = 5,
    name: str = "profiled",
) -> ClusterSpec:
    """Measures the devices of ``mesh`` and returns a fitted ClusterSpec.

    Compute: the best time of a jitted ``matmul_size``² float32 matmul on one
    device. Links: for every mesh axis of size > 1, all-reduce and all-gather of
    buffers of ``sizes`` bytes over that axis (``jax.shard_map`` with ``psum`` /
    ``all_gather``), fitted by least squares to ``t = α + β·v``, where ``v`` is
    the volume factor of the alpha-beta model (``2(n−1)/n·B`` and ``(n−1)/n·B``).
    Axes of size 1 get the best fitted axis's numbers. Memory comes from
    ``device.memory_stats()["bytes_limit"]``, else host RAM divided by the local
    device count. Host bandwidth is timed with ``device_put``.

    The times include dispatch overhead, which lands in α. On 8 simulated CPU
    devices the default sizes take about a second.

    Args:
      mesh: a ``jax.sharding.Mesh``.
      sizes: buffer sizes in bytes, at least two distinct ones.
      matmul_size: side of the square matmul.
      repeats: timed runs per measurement; the best is kept.
      name: the returned spec's name.
    """
    import jax
    import jax.numpy as jnp

    if len(set(sizes)) < 2:
        raise ValueError(f"profile_cluster needs at least two distinct sizes to fit α and β, got {sizes}")
    device = mesh.devices.flat[0]

    k = int(matmul_size)
    x = jax.device_put(jnp.ones((k, k), jnp.float32), device)
    flops = 2.0 * k**3 / _best_time(jax.jit(lambda a: a @ a), (x,), repeats)

    shape = mesh_shape(mesh)
    fitted = {i: _fit_axis(mesh, axis, n, sizes, repeats)
              for i, (axis, n) in enumerate(zip(mesh.axis_names, shape, strict=True)) if n > 1}
    if fitted:
        best = min(fitted.values(), key=lambda ab: ab[1])
    else:
        best = (PRESETS["cpu-sim"].latency, 1.0 / PRESETS["cpu-sim"].bandwidth)
    alphas = tuple(fitted.get(i, best)[0] for i in range(len(shape)))
    bandwidths = tuple(1.0 / fitted.get(i, best)[1] for i in range(len(shape)))

    host = np.ones((max(sizes) // 4,), np.float32)
    t_put = _best_time(lambda h: jax.device_put(h, device), (host,), repeats)
    return ClusterSpec(flops=flops, bandwidth=bandwidths, latency=alphas, memory=_device_memory(device),
                       host_bandwidth=host.nbytes / max(t_put, 1e-9), name=name)


def _fit_axis(mesh, axis: str, n: int, sizes: Sequence[int], repeats: int) -> tuple[float, float]:
    """(α, β) of mesh axis ``axis`` (``n`` devices), fitted to timed all-reduces and all-gathers."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    reduce = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, axis), mesh=mesh, in_specs=P(axis),
                                   out_specs=P(axis)))
    gather = jax.jit(jax.shard_map(lambda v: jax.lax.all_gather(v, axis, tiled=True), mesh=mesh,
                                   in_specs=P(axis), out_specs=P(), check_vma=False))
    volumes, times = [], []
    for nbytes in sorted(set(int(s) for s in sizes)):
        elems = max(1, nbytes // 4)
        # Every device holds `elems` floats; the leading dimension carries the shards along
        # `axis`, so each device's block is the B-byte buffer.
        buf = jax.device_put(jnp.ones((n * elems,), jnp.float32), NamedSharding(mesh, P(axis)))
        b = 4.0 * elems
        volumes.append(2 * (n - 1) / n * b)
        times.append(_best_time(reduce, (buf,), repeats))
        volumes.append((n - 1) / n * (n * b))  # all-gather's B is the gathered buffer
        times.append(_best_time(gather, (buf,), repeats))
    return _fit_alpha_beta(volumes, times)


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(value) -> float | None:
    """``16e9``, ``"16GB"`` or ``"16 GiB"`` -> bytes; None stays None."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise InputError(f"memory_budget={value!r} is not a size; write bytes (16e9) or a string like '16GB'")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]
