"""Collectives on real networks: which tier a device group crosses, and what a collective over it costs.

A collective runs over one *group* of devices (a ``replica_groups`` entry of the compiled program, or the
devices along some mesh axes). Devices are numbered row-major over the mesh and filled into the network's
tiers in that order (:class:`~autoshard.perf.hardware.Hardware`), so a group over mesh axes ``A`` stretches
over ``prod(mesh.shape[min(A):])`` consecutive devices: inside one node when that fits the node, across
nodes otherwise.

**A group runs at its slowest tier.** NCCL runs one ring (or tree) over the whole group: every device's
share passes the ring's slowest hop, so an all-gather over 16 GPUs in two nodes moves ``(n-1)/n · B`` per
GPU through each GPU's own NIC, at the NIC's bandwidth. That is also what XLA emits for a collective whose
replica groups span several mesh axes: one collective, one communicator, not a hierarchy of collectives.
On a TPU slice, a group spanning ``k`` dimensions of the ICI torus runs rings on all ``k`` at once, both
directions of each (:func:`group_link`). Across slices (DCN) each chip has its host's bandwidth divided
by the host's chips.

The bytes moved per device, with ``B`` the per-device buffer named in :mod:`autoshard.collectives`::

    all-gather, reduce-scatter   (n-1)/n · B
    all-reduce                   2 (n-1)/n · B
    all-to-all                   (n-1)/n · B · ALL_TO_ALL_PENALTY
    permute                      B

Example:
    >>> from autoshard.perf.hardware import hardware_preset
    >>> from autoshard.perf.comm import collective_seconds_on
    >>> hw = hardware_preset("h100")
    >>> inside = collective_seconds_on(hw, "all-gather", 1e9, group=8, span=8)
    >>> across = collective_seconds_on(hw, "all-gather", 1e9, group=16, span=16)
    >>> across > 5 * inside
    True
"""

from __future__ import annotations

import dataclasses
import math

from autoshard.collectives import ALL_TO_ALL_PENALTY, CollectiveKind
from autoshard.perf.hardware import Hardware

__all__ = ["GroupLink", "collective_seconds_on", "group_link", "mesh_collective_seconds", "moved_bytes"]


@dataclasses.dataclass(frozen=True, slots=True)
class GroupLink:
    """How one device group communicates: its slowest tier, bytes/s per device and fixed latency."""

    tier: str
    bandwidth: float
    latency: float


def group_link(hw: Hardware, group: int, span: int, *, inner_span: int | None = None) -> GroupLink:
    """The link a collective over ``group`` devices stretching over ``span`` consecutive devices uses.

    Args:
      hw: the hardware.
      group: devices in the group.
      span: consecutive devices (row-major) the group stretches over (:func:`~autoshard.perf.hardware.ring_span`).
      inner_span: devices per group of the innermost tier, when the cluster says so
        (:attr:`autoshard.ClusterSpec.nodes`); None: the hardware's own.
    """
    k = hw.tier_of(span, inner_span)
    tier = hw.tiers[k]
    bandwidth = tier.bandwidth * tier.efficiency
    if tier.torus:  # ICI: rings on every torus dimension the group spans, both directions
        dims = max(1, math.ceil(math.log(max(group, 2)) / math.log(tier.torus) - 1e-9))
        bandwidth *= 2 * dims
    latency = sum(t.latency for t in hw.tiers[: k + 1]) if k else tier.latency
    return GroupLink(tier.name, bandwidth, latency)


def moved_bytes(kind: CollectiveKind | str, nbytes: float, group: int) -> float:
    """Bytes one device sends for a collective of ``kind`` over ``group`` devices (``nbytes``: the
    per-device buffer of :mod:`autoshard.collectives`)."""
    kind = kind if isinstance(kind, CollectiveKind) else CollectiveKind.parse(kind)
    if group <= 1:
        return 0.0
    frac = (group - 1) / group
    if kind is CollectiveKind.ALL_REDUCE:
        return 2 * frac * nbytes
    if kind is CollectiveKind.COLLECTIVE_PERMUTE:
        return float(nbytes)
    if kind is CollectiveKind.ALL_TO_ALL:
        return frac * nbytes * ALL_TO_ALL_PENALTY
    return frac * nbytes


def collective_seconds_on(hw: Hardware, kind: CollectiveKind | str, nbytes: float, *, group: int,
                          span: int, inner_span: int | None = None) -> float:
    """Seconds of one collective over a group of ``group`` devices stretching over ``span`` devices.

    ``latency + moved_bytes / bandwidth`` on the group's slowest tier (:func:`group_link`)."""
    if group <= 1:
        return 0.0
    link = group_link(hw, group, span, inner_span=inner_span)
    return link.latency + moved_bytes(kind, nbytes, group) / link.bandwidth


def tier_names(hw: Hardware) -> tuple[str, ...]:
    """The tiers' names, innermost first (the communication streams of a schedule)."""
    return tuple(t.name for t in hw.tiers)


def mesh_collective_seconds(hw: Hardware, kind, nbytes: float, shape, axes, *, inner_span: int | None = None,
                            latency: float | None = None) -> float:
    """Seconds of one collective over mesh ``axes`` of a mesh ``shape`` (devices row-major over it): its device
    group's slowest tier (:func:`group_link`), :func:`moved_bytes` per device; ``latency`` replaces the tier's
    (0: a collective XLA combines with others)."""
    from autoshard.perf.hardware import ring_span

    group = math.prod(shape[a] for a in axes)
    if group <= 1:
        return 0.0
    link = group_link(hw, group, ring_span(shape, axes), inner_span=inner_span)
    return (link.latency if latency is None else latency) + moved_bytes(kind, nbytes, group) / link.bandwidth
