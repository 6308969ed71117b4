"""The step time of a compiled program: its HLO list-scheduled on the performance model.

:func:`estimate_step_time` is the one score the benchmarks give every method (autoshard and the hand-written
baselines alike), from what XLA compiled:

- **With a hardware model** (every GPU and TPU preset, :mod:`autoshard.perf`): each top-level instruction of
  the module, in XLA's own schedule, is a task. A fusion, custom call or other kernel is priced by its
  roofline (:func:`autoshard.perf.seconds`): the flops of the matmuls it contains (their local shapes give
  the quantization) and the bytes of its operands and result. A collective runs on the stream of the
  network tier its replica groups cross (:mod:`autoshard.perf.comm`), from its ``-start`` to its ``-done``
  where the backend emits async pairs; on XLA:CPU, which emits none, it starts as early as its operands
  allow. A ``while`` body is scheduled on its own and counted ``known_trip_count`` times. The score is the
  makespan (:func:`autoshard.perf.simulate`), with the communication it leaves exposed.
- **Without one** (``cpu-sim``, a hand-written :class:`~autoshard.ClusterSpec`), the alpha-beta score of
  before: ``compute_s + communication_s``, compute from ``cost_analysis()`` flops at the cluster's rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from autoshard.cluster import ClusterSpec, mesh_shape
from autoshard.collectives import CollectiveKind
from autoshard.hlo import (
    CompiledCollective,
    collective_record,
    collective_stats,
    dot_shape,
    flops,
    instruction_callees,
    parse_module,
    shape_bytes,
    trip_count,
)

__all__ = ["estimate_step_time"]

# Instructions that move no bytes and run no kernel.
_FREE = frozenset(("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                   "partition-id", "replica-id", "opt-barrier", "iota", "broadcast", "reshape"))
_DONE = ("-done",)


def _mesh_axes_of(groups: Sequence[Sequence[int]] | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Mesh axes along which the devices of a group differ."""
    if not groups or len(groups[0]) <= 1:
        return ()
    n = math.prod(shape)
    varying: set[int] = set()
    for g in groups:
        ids = [d for d in g if 0 <= d < n]
        if len(ids) < 2:
            continue
        coords = np.array(np.unravel_index(ids, shape)).T
        varying.update(int(a) for a in np.nonzero((coords != coords[0]).any(axis=0))[0])
    return tuple(sorted(varying))


def _collective_time(c: CompiledCollective, cluster: ClusterSpec, shape: tuple[int, ...]) -> tuple[float, float]:
    """(seconds, bytes/bandwidth seconds) of one execution of ``c``: on the hardware's tiers when the cluster
    has a hardware model, else alpha-beta on the per-axis links."""
    n = c.group_size or 1
    if n <= 1:
        return 0.0, 0.0
    axes = _mesh_axes_of(c.groups, shape)
    if not axes:  # groups unknown or outside the mesh: assume the slowest link
        axes = (min(range(len(shape)), key=cluster.axis_bandwidth),)
    slowest = min(cluster.axis_bandwidth(a) for a in axes)
    simple = c.bytes / slowest
    kind = CollectiveKind.parse(c.kind)
    # The per-device B of autoshard.collectives: c.bytes is the per-device result, and a
    # reduce-scatter's B is its input, n times that.
    nbytes = c.bytes * n if kind is CollectiveKind.REDUCE_SCATTER else c.bytes
    sizes = [shape[a] for a in axes]
    if math.prod(sizes) == n:
        return cluster.collective_cost(kind, nbytes, axes, sizes), simple
    # The group is not a whole set of mesh axes (a sub-axis, or an irregular
    # group): price it as one group of n devices on the slowest axis it spans.
    slow_axis = min(axes, key=cluster.axis_bandwidth)
    return cluster.collective_cost(kind, nbytes, (slow_axis,), (n,)), simple


def _stream(c: CompiledCollective, cluster: ClusterSpec, shape: tuple[int, ...]) -> str:
    """The network tier a compiled collective crosses (its communication stream)."""
    from autoshard.perf.comm import group_link
    from autoshard.perf.hardware import ring_span

    axes = _mesh_axes_of(c.groups, shape) or (0,)
    group = c.group_size or 1
    return group_link(cluster.hardware, group, ring_span(shape, axes),
                      inner_span=cluster.inner_span(math.prod(shape))).tier


class _Scorer:
    """Prices a compiled module's computations on a cluster with a hardware model (memoised per computation)."""

    def __init__(self, comps: dict, num_devices, cluster: ClusterSpec, shape: tuple[int, ...]):
        from autoshard.perf.compute import Work

        self.Work = Work
        self.comps, self.num_devices, self.cluster, self.shape = comps, num_devices, cluster, shape
        self.acc = cluster.hardware.accelerator
        self.memo: dict[str, tuple] = {}
        self.scores = self.score_signatures() if self.acc.platform in ("gpu", "tpu") else frozenset()

    def score_signatures(self) -> frozenset:
        """The dimensions (sizes above 1, sorted) of attention score matrices: the result of a ``dot`` of small
        contraction (a head dim, at most 512) whose last two dimensions (queries, keys) both exceed it. A fused
        attention kernel keeps them on chip, as :func:`autoshard.attention.attention_scores` does for the plan."""
        out = set()
        for instrs in self.comps.values():
            shapes = {i.name: i.shape for i in instrs}
            for instr in instrs:
                if instr.opcode != "dot" or isinstance(instr.shape, list) or len(instr.shape[1]) < 3:
                    continue
                f, gemm = dot_shape(instr, shapes)
                dims = instr.shape[1]
                if gemm is not None and gemm[3] <= 512 and min(dims[-2:]) > gemm[3]:
                    out.add(tuple(sorted(d for d in dims if d > 1)))
        return frozenset(out)

    def is_score(self, shape) -> bool:
        if not self.scores or isinstance(shape, list):
            return False
        dims = shape[1]
        return (tuple(sorted(d for d in dims if d > 1)) in self.scores
                or (len(dims) > 1 and tuple(sorted(d for d in dims[1:] if d > 1)) in self.scores))

    def matmuls(self, name: str, seen: frozenset = frozenset()) -> list[tuple[float, Any]]:
        """``(flops, (b, m, n, k))`` of every dot in a fused computation (and what it calls)."""
        out = []
        instrs = self.comps.get(name, [])
        shapes = {i.name: i.shape for i in instrs}
        for instr in instrs:
            if instr.opcode == "dot":
                out.append(dot_shape(instr, shapes))
            for _, callee in instruction_callees(instr):
                if callee in self.comps and callee not in seen:
                    out.extend(self.matmuls(callee, seen | {name}))
        return out

    def kernel_seconds(self, instr, shapes: dict) -> tuple[float, float]:
        """``(seconds, flops)`` of one kernel: its matmuls' roofline, or its bytes on the HBM."""
        from autoshard.perf.compute import operand_class, seconds

        parts = [instr.shape, *(shapes[o] for o in instr.operands if o in shapes)]
        fused = [p for p in parts if self.is_score(p)]
        nbytes = sum(shape_bytes(p) for p in parts if not self.is_score(p))
        if instr.opcode == "dot":
            dots = [dot_shape(instr, shapes)]
        else:
            dots = [d for callee in (c for _, c in instruction_callees(instr)) for d in self.matmuls(callee)]
        dots = [d for d in dots if d[0] > 0]
        target = str(instr.attrs)
        if instr.opcode == "custom-call" and ("cudnn" in target and "fmha" in target or "flash" in target):
            kind = "attention_bwd" if "backward" in target or "bwd" in target else "attention_fwd"
            return seconds(self.Work(0.0, nbytes, kind), self.acc), 0.0
        if fused:  # part of a fused attention kernel: its scores stay on chip
            fl = sum(d[0] for d in dots)
            return seconds(self.Work(fl, nbytes, "attention_fwd"), self.acc), fl
        if not dots:
            return seconds(self.Work(0.0, nbytes, "vector"), self.acc), 0.0
        dtypes = [shapes[o][0] for o in instr.operands[:2] if o in shapes and not isinstance(shapes[o], list)]
        cls = operand_class([_np_dtype(d) for d in dtypes]) if dtypes else "bf16"
        total, fl = 0.0, 0.0
        for f, gemm in dots:
            total += seconds(self.Work(f, 0.0, "matmul", cls, gemm), self.acc)
            fl += f
        return max(total, nbytes / self.acc.stream_bandwidth), fl

    def computation(self, name: str) -> tuple[float, float, float, float]:
        """``(makespan, compute seconds, communication seconds, flops)`` of one run of computation ``name``."""
        if name in self.memo:
            return self.memo[name]
        from autoshard.perf.schedule import COMPUTE, Task, simulate

        instrs = self.comps.get(name, [])
        shapes = {i.name: i.shape for i in instrs}
        tasks: list[Task] = []
        ready: dict[str, tuple[int, ...]] = {}
        fl = 0.0
        for instr in instrs:
            deps = tuple(sorted({t for o in instr.operands for t in ready.get(o, ())}))
            op = instr.opcode
            if op in _FREE or op.endswith(_DONE):
                ready[instr.name] = deps
                continue
            record = collective_record(instr, name, shapes, self.num_devices)
            if record is not None:
                t, _ = _collective_time(record, self.cluster, self.shape)
                tasks.append(Task(instr.name, _stream(record, self.cluster, self.shape), t, deps))
                ready[instr.name] = (len(tasks) - 1,)
                continue
            if op == "while":
                body = dict(instruction_callees(instr)).get("body")
                trips = trip_count(instr) or 1
                span, _, _, f = self.computation(body) if body else (0.0, 0.0, 0.0, 0.0)
                seconds_, f = span * trips, f * trips
            elif op in ("conditional", "call") or (op.startswith("async") and instruction_callees(instr)):
                runs = [self.computation(c) for _, c in instruction_callees(instr) if c in self.comps]
                seconds_ = max((r[0] for r in runs), default=0.0)
                f = max((r[3] for r in runs), default=0.0)
            else:
                seconds_, f = self.kernel_seconds(instr, shapes)
            fl += f
            tasks.append(Task(instr.name, COMPUTE, seconds_, deps))
            ready[instr.name] = (len(tasks) - 1,)
        sched = simulate(tasks)
        compute = sched.busy.get(COMPUTE, 0.0)
        out = (sched.makespan, compute, sum(v for k, v in sched.busy.items() if k != COMPUTE), fl)
        self.memo[name] = out
        return out


def _np_dtype(hlo_dtype: str):
    return {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64",
            "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2"}.get(hlo_dtype, "float32")


def estimate_step_time(compiled: Any, cluster: ClusterSpec, mesh: Any) -> dict[str, Any]:
    """Score a compiled program: the predicted seconds of one step per device (see the module docstring).

    Args:
      compiled: a ``jax.stages.Compiled`` (or its ``as_text()``; the alpha-beta score also needs
        ``cost_analysis()``).
      cluster: the hardware (a preset or your own ``ClusterSpec``).
      mesh: the mesh the program was compiled for (or its shape).

    Returns:
      A dict: ``time_s`` (the step), ``compute_s``, ``communication_s``, ``exposed_s`` (communication not
      hidden behind compute), ``simple_s`` (compute plus every collective's bytes over its slowest link,
      no latency, no overlap), ``flops``, ``collective_bytes`` and ``per_kind`` (kind -> count, bytes,
      seconds).
    """
    shape = mesh_shape(mesh)
    cluster = cluster.for_mesh(shape)
    stats = collective_stats(compiled)
    simple_comm = sum(_collective_time(c, cluster, shape)[1] * c.multiplicity for c in stats.collectives)
    if cluster.hardware is None:
        total_flops = flops(compiled) + max(0.0, stats.dot_flops - stats.dot_flops_once)
        compute_s = total_flops / cluster.flops
        comm_s = 0.0
        per_kind: dict[str, dict[str, float]] = {}
        for c in stats.collectives:
            t, _ = _collective_time(c, cluster, shape)
            comm_s += t * c.multiplicity
            d = per_kind.setdefault(c.kind, {"count": 0, "bytes": 0.0, "seconds": 0.0})
            d["count"] += c.multiplicity
            d["bytes"] += c.bytes * c.multiplicity
            d["seconds"] += t * c.multiplicity
        return {"time_s": compute_s + comm_s, "compute_s": compute_s, "communication_s": comm_s,
                "exposed_s": comm_s, "simple_s": compute_s + simple_comm, "flops": total_flops,
                "collective_bytes": stats.bytes(), "per_kind": per_kind}
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    comps, entry, header = parse_module(text)
    num_devices = header.get("num_partitions", 1) * header.get("replica_count", 1) if header else None
    scorer = _Scorer(comps, num_devices, cluster, shape)
    makespan, compute_s, comm_s, total_flops = scorer.computation(entry)
    per_kind = {}
    for c in stats.collectives:
        d = per_kind.setdefault(c.kind, {"count": 0, "bytes": 0.0, "seconds": 0.0})
        d["count"] += c.multiplicity
        d["bytes"] += c.bytes * c.multiplicity
        d["seconds"] += _collective_time(c, cluster, shape)[0] * c.multiplicity
    return {"time_s": makespan, "compute_s": compute_s, "communication_s": comm_s,
            "exposed_s": max(0.0, makespan - compute_s), "simple_s": compute_s + simple_comm,
            "flops": total_flops, "collective_bytes": stats.bytes(), "per_kind": per_kind}
