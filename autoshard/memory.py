"""Predicted per-device memory of a plan: value liveness over the program order.

XLA fuses chains of elementwise and layout ops, so their intermediate results
never exist as buffers. The estimate therefore counts a value only when it is
materialised: a program input or output, the result of a non-fusible op (dots,
convolutions, reductions, gathers, scans, ...), or a value that several ops read.
Donated inputs share their buffer with the output that replaces them.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from autoshard.capture import CapturedProgram, OpGraph
from autoshard.spec import MeshInfo, ShardingSpec
from autoshard.strategies import lookup_rule


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Predicted memory per device.

    Attributes:
      peak_bytes: the largest total of live buffers.
      breakdown: at the peak, bytes per category: ``parameters`` (carried state that is not
        optimizer state), ``optimizer_state``, ``inputs`` (fresh inputs: the batch), ``outputs``
        (new values not aliased to a donated input), ``intermediates`` (activations, gradients,
        temporaries).
      peak_position: the op position (in program order) where the peak occurs.
      host_bytes: bytes per device kept in host memory (offloaded state, see
        :mod:`autoshard.offload`); not part of ``peak_bytes``.
    """

    peak_bytes: float
    breakdown: dict
    peak_position: int
    host_bytes: float = 0.0


def is_optimizer_state(path: str) -> bool:
    """Whether a carried leaf at this pytree path is optimizer state (optax's ``mu``/``nu``)."""
    return "opt_state" in path or ".mu" in path or ".nu" in path


def _nbytes(aval, spec: ShardingSpec | None, mesh: MeshInfo) -> float:
    shape = tuple(getattr(aval, "shape", ()))
    try:
        itemsize = np.dtype(aval.dtype).itemsize
    except TypeError:
        itemsize = 8
    if spec is None or not shape:
        return float(math.prod(shape) * itemsize)
    return float(math.prod(spec.shard_shape(shape, mesh)) * itemsize)


def _fusible(op) -> bool:
    entry = lookup_rule(op.name)
    return entry is not None and entry.follows and op.body is None


def _graph_peak(graph: OpGraph, program, value_specs, mesh, fixed_live: float) -> float:
    """Peak of a scan body's own buffers, evaluated once per iteration."""
    uses: dict[int, int] = {}
    last: dict[int, int] = {}
    for t, op in enumerate(graph.ops):
        for x in op.inputs:
            if isinstance(x, int):
                uses[x] = uses.get(x, 0) + 1
                last[x] = t
    outs = {x for x in graph.outvars if isinstance(x, int)}
    live = 0.0
    peak = 0.0
    ends: dict[int, list[float]] = {}
    for t, op in enumerate(graph.ops):
        extra = 0.0
        if op.body is not None:
            extra = _graph_peak(op.body, program, value_specs, mesh, 0.0)
        for v in op.outputs:
            if v in outs or not _fusible(op) or uses.get(v, 0) > 1:
                b = _nbytes(program.avals[v], value_specs.get(v), mesh)
                live += b
                ends.setdefault(last.get(v, len(graph.ops)), []).append(b)
        peak = max(peak, live + extra)
        for b in ends.pop(t, ()):
            live -= b
    return peak + fixed_live


def estimate_memory(program: CapturedProgram, value_specs: dict, mesh: MeshInfo, *, donated=(),
                    out_specs=None, ties=None, offloaded=()) -> MemoryEstimate:
    """Sweep the top-level program in order; scan bodies add their own peak at the scan.

    Args:
      donated: flat input indices whose buffers are donated.
      out_specs: the layout of each flat output (defaults to the producer's).
      ties: flat output index -> flat input index it replaces (the carried state).
      offloaded: flat input indices kept in host memory; they and their replacements count on
        the device only while in use (:func:`autoshard.offload.device_intervals`).
    """
    from autoshard.offload import device_intervals

    graph = program.graph
    ops = graph.ops
    end_t = len(ops) + 1
    ties = ties or {}
    donated = set(donated)
    offloaded = set(offloaded)
    host_outputs = {o for o, i in ties.items() if i in offloaded}
    aliased_outputs = {o for o, i in ties.items() if i in donated} - host_outputs
    on_device = device_intervals(program, offloaded, ties) if offloaded else {}
    host_bytes = 0.0
    uses: dict[int, int] = {}
    last: dict[int, int] = {}
    for t, op in enumerate(ops, start=1):
        for x in op.inputs:
            if isinstance(x, int):
                uses[x] = uses.get(x, 0) + 1
                last[x] = t
    out_pos: dict[int, list[int]] = {}
    for j, x in enumerate(graph.outvars):
        if isinstance(x, int):
            out_pos.setdefault(x, []).append(j)
            last[x] = end_t

    def category(i: int) -> str:
        path = program.in_paths[i]
        if i not in ties.values():
            return "inputs"
        if is_optimizer_state(path):
            return "optimizer_state"
        return "parameters"

    # (start, end, bytes, category)
    buffers: list[tuple[int, int, float, str]] = []
    for i, v in enumerate(graph.invars):
        b = _nbytes(program.avals[v], value_specs.get(v), mesh)
        if i in offloaded:  # a host buffer (two unless donated), and a device copy while in use
            host_bytes += b if i in donated else 2 * b
            buffers.append((*on_device[v], b, category(i)))
            continue
        end = last.get(v, 0) + 1 if i in donated and i in ties.values() else end_t
        # A donated, carried input keeps its buffer until its replacement is written at the end.
        buffers.append((0, end_t if i in donated and i in ties.values() else end, b, category(i)))
    for v, c in program.consts.items():
        buffers.append((0, end_t, _nbytes(program.avals[v], value_specs.get(v), mesh), "parameters"))
    body_peak: dict[int, float] = {}
    for t, op in enumerate(ops, start=1):
        if op.body is not None:
            body_peak[t] = _graph_peak(op.body, program, value_specs, mesh, 0.0)
        for v in op.outputs:
            js = out_pos.get(v, ())
            if js and all(j in aliased_outputs for j in js):
                continue  # written into a donated input's buffer
            if js or not _fusible(op) or uses.get(v, 0) > 1:
                spec = value_specs.get(v)
                if js and out_specs is not None:
                    spec = out_specs[js[0]]
                cat = "outputs" if js else "intermediates"
                start, end = on_device.get(v, (t, last.get(v, t) + 1 if not js else end_t))
                buffers.append((start, end, _nbytes(program.avals[v], spec, mesh), cat))
    events: dict[int, list] = {}
    for s, e, b, c in buffers:
        events.setdefault(s, []).append((b, c))
        events.setdefault(e, []).append((-b, c))
    live: dict[str, float] = {}
    best, best_t, best_breakdown = 0.0, 0, {}
    for t in sorted(events):
        for b, c in events[t]:
            live[c] = live.get(c, 0.0) + b
        total = sum(live.values()) + body_peak.get(t, 0.0)
        if total > best:
            best, best_t = total, t
            best_breakdown = {k: v for k, v in live.items() if v > 0}
            if body_peak.get(t):
                best_breakdown["intermediates"] = best_breakdown.get("intermediates", 0.0) + body_peak[t]
    for k in ("parameters", "optimizer_state", "inputs", "outputs", "intermediates"):
        best_breakdown.setdefault(k, 0.0)
    return MemoryEstimate(best, best_breakdown, best_t, host_bytes)



