"""Measured pipeline timelines (when each stage ran each microbatch) and stage memory.

``measure`` runs one step, records when each task was dispatched, and polls the outputs'
``is_ready()`` to see when it finished. A task starts when it was dispatched, its stage finished
the task before it, and its inputs were ready. No threads: the stages overlap through jax's
async dispatch, and the poll only watches.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np

from autoshard.pipeline.schedule import max_in_flight


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Events ``(label, stage, microbatch, start, end)`` in seconds from the step's start.

    ``label`` is ``"F"``/``"B"`` for a microbatch's forward/backward and ``"R"`` for the update.
    """

    events: tuple
    num_stages: int

    @property
    def makespan(self) -> float:
        return max((e[4] for e in self.events), default=0.0)

    @property
    def bubble_fraction(self) -> float:
        """1 − busy time / (stages × makespan) over the forward/backward events."""
        fb = [e for e in self.events if e[0] in ("F", "B")]
        if not fb:
            return 0.0
        span = max(e[4] for e in fb) - min(e[3] for e in fb)
        busy = sum(e[4] - e[3] for e in fb)
        return max(0.0, 1.0 - busy / (self.num_stages * span)) if span > 0 else 0.0

    def in_flight(self, stage: int) -> int:
        """Most microbatches whose forward had finished and whose backward had not, on ``stage``."""
        marks = []
        for ph, s, _m, _start, end in self.events:
            if s == stage and ph == "F":
                marks.append((end, 1))
            elif s == stage and ph == "B":
                marks.append((end, -1))
        live = peak = 0
        for _, d in sorted(marks):
            live += d
            peak = max(peak, live)
        return peak

    def save_png(self, path: str) -> str:
        """Draw a Gantt chart (one row per stage; forward light, backward dark, update grey)."""
        try:  # a bare Figure, not pyplot: no global backend switch (inline notebook plots keep working)
            from matplotlib.figure import Figure
        except ImportError as e:  # pragma: no cover - matplotlib is optional
            raise ImportError("Timeline.save_png needs matplotlib: pip install matplotlib") from e
        fig = Figure(figsize=(10, 0.6 * self.num_stages + 1.2))
        ax = fig.subplots()
        colors = {"F": "#8ecae6", "B": "#219ebc", "R": "#adb5bd"}
        for ph, s, m, start, end in self.events:
            ax.barh(s, (end - start) * 1e3, left=start * 1e3, color=colors[ph], edgecolor="black", linewidth=0.4)
            if m is not None:
                ax.text((start + end) / 2 * 1e3, s, f"{ph}{m}", ha="center", va="center", fontsize=7)
        ax.set_yticks(range(self.num_stages), [f"stage {s}" for s in range(self.num_stages)])
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        ax.set_title(f"pipeline timeline (bubble {self.bubble_fraction:.0%})")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        return path


def _ready(outs) -> bool:
    # A donated accumulator is deleted once the next microbatch took it: it was ready by then.
    return all(x.is_deleted() or x.is_ready() for x in jax.tree_util.tree_leaves(outs) if isinstance(x, jax.Array))


def measure(exe, flat) -> Timeline:
    """Run one step of a :class:`PipelineExecutable` and time its tasks."""
    trace: list = []
    t0 = time.perf_counter()
    exe.run(flat, trace=trace)
    done: dict[int, float] = {}
    while len(done) < len(trace):
        now = time.perf_counter()
        for i, (_, _, outs, _) in enumerate(trace):
            if i not in done and _ready(outs):
                done[i] = now
        if len(done) < len(trace):
            time.sleep(1e-4)
    stage_free: dict[int, float] = {}
    end_of: dict = {}
    events = []
    for i, (ev, t_dispatch, _, _) in enumerate(trace):
        label, s = ev[0], ev[1]
        m = ev[2] if label in ("F", "B") else None
        deps = exe.deps(ev) if m is not None else []
        start = max([t_dispatch, stage_free.get(s, t0), *(end_of.get(d, t0) for d in deps)])
        end = max(done[i], start)
        stage_free[s] = end
        end_of[ev] = end
        events.append((label, s, m, start - t0, end - t0))
    return Timeline(tuple(events), exe.part.num_stages)


def stage_memory(exe, flat) -> list[dict]:
    """Per stage: compiled memory of one microbatch's forward task and the schedule's in-flight count.

    ``residual_bytes`` (per device) is what the forward hands to its own backward and keeps alive until
    then; 1F1B keeps ``in_flight`` of them, not ``num_microbatches``.
    """
    trace: list = []
    exe.run(flat, trace=trace)
    first = {}
    for ev, _, outs, args in trace:
        if ev[0] == "F" and ev[1] not in first:
            first[ev[1]] = (outs, args)
    out = []
    for s in range(exe.part.num_stages):
        outs, args = first[s]
        task = exe.part.tasks[("F", s)]
        specs = [jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=getattr(a, "sharding", None)) for a in args]
        compiled = exe.jitted(("F", s), bool(task.frontier)).lower(*specs).compile()
        ma = compiled.memory_analysis()
        b_in = set(exe.part.tasks[("B", s)].invars) if ("B", s) in exe.part.tasks else set()
        residual = 0.0
        for v, o in zip(task.outvars, outs, strict=True):
            if v in b_in:
                shape = o.sharding.shard_shape(o.shape)
                residual += math.prod(shape) * o.dtype.itemsize
        live = max_in_flight(exe.orders[s])
        out.append({
            "stage": s,
            "output_bytes": float(ma.output_size_in_bytes),
            "temp_bytes": float(ma.temp_size_in_bytes),
            "residual_bytes": residual,
            "in_flight": live,
            "activation_peak_bytes": live * residual,
            "all_microbatches_bytes": exe.k * residual,
        })
    return out
