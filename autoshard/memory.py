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


def _fused_reads(graph: OpGraph, materialised: set) -> list[tuple[int, ...]]:
    """Per op, the materialised values it reads once fused producers are inlined into it.

    A value XLA fuses into its single reader has no buffer: the reader computes it from
    the fused producer's own operands, so those stay live until the reader runs."""
    made_here = {v for op in graph.ops for v in op.outputs}
    sources: dict[int, frozenset] = {}
    reads = []
    for op in graph.ops:
        eff: set = set()
        for x in op.inputs:
            if not isinstance(x, int):
                continue
            if x in materialised or x not in made_here:
                eff.add(x)
            else:
                eff |= sources.get(x, frozenset())
        frozen = frozenset(eff)
        for v in op.outputs:
            if v not in materialised:
                sources[v] = frozen
        reads.append(tuple(sorted(eff)))
    return reads


def _list_schedule(nodes, reads, made, size, kept) -> list[int]:
    """A greedy memory-minimising order, like XLA's list scheduler: of the ready ops, run the
    one that frees the most temporary bytes net of what it allocates (program order breaks ties)."""
    import heapq

    producer = {v: n for n in nodes for v in made[n]}
    consumers: dict[int, list[int]] = {}
    waiting: dict[int, int] = {}
    readers: dict[int, set] = {}
    for n in nodes:
        deps = {producer[v] for v in reads[n] if v in producer and producer[v] != n}
        waiting[n] = len(deps)
        for d in deps:
            consumers.setdefault(d, []).append(n)
        for v in reads[n]:
            if v in size and v not in kept:
                readers.setdefault(v, set()).add(n)
    remaining = {v: len(r) for v, r in readers.items()}
    done: set = set()

    def score(n):
        freed = sum(size[v] for v in reads[n] if v in remaining and remaining[v] == 1)
        return freed - sum(size.get(v, 0.0) for v in made[n])

    heap = [(-score(n), n) for n in nodes if waiting[n] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        s, n = heapq.heappop(heap)
        if n in done or -s != score(n):
            if n not in done:
                heapq.heappush(heap, (-score(n), n))
            continue
        done.add(n)
        order.append(n)
        for v in reads[n]:
            if v in remaining:
                remaining[v] -= 1
                if remaining[v] == 1:  # its last reader now frees it: that reader's score rises
                    last = next(iter(readers[v] - done))
                    if waiting[last] == 0:
                        heapq.heappush(heap, (-score(last), last))
        for c in consumers.get(n, ()):
            waiting[c] -= 1
            if waiting[c] == 0:
                heapq.heappush(heap, (-score(c), c))
    return order


def _sweep(order, reads, made, size, inplace, transient, alloc_at=(), kept=()) -> tuple[float, int, float]:
    """Peak of live temporaries over an order: (peak bytes, op at the peak, of which transient)."""
    last: dict[int, int] = {}
    for k, n in enumerate(order):
        for v in reads[n]:
            if v in size and v not in kept:
                last[v] = k
    first_read: dict[int, int] = {}
    if alloc_at:
        for k, n in enumerate(order):
            for v in reads[n]:
                if v in alloc_at:
                    first_read.setdefault(v, k)
    live, best, best_n, best_extra = 0.0, 0.0, -1, 0.0
    for k, n in enumerate(order):
        new = sum(size.get(v, 0.0) for v in made[n]) + sum(
            size[v] for v in reads[n] if first_read.get(v) == k)
        dying = [v for v in reads[n] if v in size and v not in kept and last.get(v) == k]
        # An elementwise fusion may write its result over an operand it is the last to read.
        reuse = min(new, sum(size[v] for v in dying)) if inplace[n] else 0.0
        total = live + new - reuse + transient.get(n, 0.0)
        if total > best:
            best, best_n, best_extra = total, n, transient.get(n, 0.0)
        live += new - sum(size[v] for v in dying)
        for v in made[n]:
            if v in size and v not in last and v not in kept:  # never read: freed at once
                live -= size[v]
    return best, best_n, best_extra


def estimate_memory(program: CapturedProgram, value_specs: dict, mesh: MeshInfo, *, donated=(),
                    out_specs=None, ties=None, offloaded=()) -> MemoryEstimate:
    """Per-device peak as XLA accounts it: arguments + outputs + the peak of live temporaries.

    XLA allocates the entry's arguments and results apart from its temporaries, for the whole
    step; a result aliased to a donated argument shares that argument's buffer. Temporaries
    are the materialised intermediates, live from the op that writes them to their last
    reader, in the lower-peak of two orders (XLA also keeps the best of several schedulers):
    program order, and a greedy order that runs first what frees the most bytes (it moves
    each optimizer update next to the gradient it consumes). Scan bodies add their own peak
    while the scan runs.

    Args:
      donated: flat input indices whose buffers are donated.
      out_specs: the layout of each flat output (defaults to the producer's).
      ties: flat output index -> flat input index it replaces (the carried state).
      offloaded: flat input indices kept in host memory; they and their replacements count on
        the device only while in use (:func:`autoshard.offload.device_intervals`).
    """
    graph = program.graph
    ops = graph.ops
    ties = ties or {}
    donated = set(donated)
    offloaded = set(offloaded)
    host_outputs = {o for o, i in ties.items() if i in offloaded}
    aliased_outputs = {o for o, i in ties.items() if i in donated} - host_outputs
    host_bytes = 0.0

    def category(i: int) -> str:
        if i not in ties.values():
            return "inputs"
        return "optimizer_state" if is_optimizer_state(program.in_paths[i]) else "parameters"

    fixed: dict[str, float] = {}
    size: dict[int, float] = {}  # temporaries: value id -> bytes
    alloc_at: set = set()  # offloaded inputs: copied in before their first reader
    kept: set = set()  # results: live from their op to the end
    for i, v in enumerate(graph.invars):
        b = _nbytes(program.avals[v], value_specs.get(v), mesh)
        if i in offloaded:  # a host buffer (two unless donated), and a device copy while in use
            host_bytes += b if i in donated else 2 * b
            size[v] = b
            alloc_at.add(v)
            continue
        fixed[category(i)] = fixed.get(category(i), 0.0) + b
    for v in program.consts:
        fixed["parameters"] = fixed.get("parameters", 0.0) + _nbytes(program.avals[v], value_specs.get(v), mesh)
    outputs = {x for x in graph.outvars if isinstance(x, int)}
    host_values = {graph.outvars[o] for o in host_outputs}
    out_bytes: dict[int, float] = {}  # result buffers not aliased to a donated argument
    for j, x in enumerate(graph.outvars):
        if j in aliased_outputs or j in host_outputs:
            continue
        if isinstance(x, int):
            spec = out_specs[j] if out_specs is not None else value_specs.get(x)
            b = _nbytes(program.avals[x], spec, mesh)
            fixed["outputs"] = fixed.get("outputs", 0.0) + b
            out_bytes[x] = out_bytes.get(x, 0.0) + b
        else:
            fixed["outputs"] = fixed.get("outputs", 0.0) + float(np.asarray(x.value).nbytes)

    uses: dict[int, int] = {}
    for op in ops:
        for x in op.inputs:
            if isinstance(x, int):
                uses[x] = uses.get(x, 0) + 1
    materialised = {v for op in ops for v in op.outputs
                    if v in outputs or not _fusible(op) or uses.get(v, 0) > 1}
    reads = _fused_reads(graph, materialised)
    nodes = [t for t, op in enumerate(ops) if not _fusible(op) or any(v in materialised for v in op.outputs)]
    made = {t: tuple(v for v in ops[t].outputs if v in materialised) for t in nodes}
    for t in nodes:
        for v in made[t]:
            if v not in outputs or v in host_values:
                size[v] = _nbytes(program.avals[v], value_specs.get(v), mesh)
            elif v in out_bytes:  # the result's buffer, which holds other temporaries before it is written
                size[v] = out_bytes[v]
                kept.add(v)
    inplace = {t: _fusible(ops[t]) for t in nodes}
    transient = {t: _graph_peak(ops[t].body, program, value_specs, mesh, 0.0) for t in nodes
                 if ops[t].body is not None}
    best = _sweep(nodes, reads, made, size, inplace, transient, alloc_at, kept)
    if not offloaded:  # offloaded copies follow program order (see autoshard.offload)
        order = _list_schedule(nodes, reads, made, size, kept)
        greedy = _sweep(order, reads, made, size, inplace, transient, (), kept)
        best = min(best, greedy, key=lambda r: r[0])
    live, at, _ = best
    # Results are allocated for the whole step, but hold temporaries before they are written.
    results = fixed.pop("outputs", 0.0)
    breakdown = {k: fixed.get(k, 0.0) for k in ("parameters", "optimizer_state", "inputs")}
    breakdown["outputs"] = results
    breakdown["intermediates"] = max(live - results, 0.0)
    return MemoryEstimate(sum(fixed.values()) + max(live, results), breakdown, at + 1, host_bytes)
