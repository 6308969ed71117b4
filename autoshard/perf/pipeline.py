"""Pipeline schedules: one step of ``m`` microbatches over ``p`` stages, from each stage's own times.

Each stage ``s`` (or each of its ``v`` model chunks, with interleaving) has a forward and a backward time
per microbatch, and a microbatch crosses each stage boundary as a point-to-point transfer (its activation
forward, its cotangent back) on the link between the two stages. The step is list-scheduled
(:func:`autoshard.perf.schedule.simulate`) with one compute stream per stage and one link stream per
boundary and direction, in the order each stage runs its tasks:

- ``"gpipe"``: every forward, then every backward.
- ``"1f1b"`` (PipeDream-flush): ``p - s - 1`` warm-up forwards, then one forward and one backward in turn,
  then the remaining backwards.
- interleaved (``virtual = v > 1``, Megatron-LM's schedule): each device holds ``v`` chunks of
  ``1/(p·v)`` of the layers, forwards advance in groups of ``p`` microbatches per chunk, and the warm-up is
  ``(p - s - 1)·2 + (v - 1)·p`` chunk forwards. The bubble shrinks by about ``v``.

Example:
    >>> from autoshard.perf.pipeline import pipeline_seconds
    >>> t = pipeline_seconds([1.0] * 4, [2.0] * 4, microbatches=8)
    >>> round(t.step, 6), round(t.bubble, 3)        # (m + p - 1)·(f + b) for equal stages
    (33.0, 0.273)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from autoshard.perf.schedule import Task, simulate

__all__ = ["PipelineTime", "pipeline_seconds"]


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineTime:
    """One pipelined step.

    Attributes:
      step: seconds from the first forward to the last backward.
      busy: the busiest device's compute seconds.
      bubble: the fraction of ``step`` that device idles.
    """

    step: float
    busy: float

    @property
    def bubble(self) -> float:
        return 0.0 if self.step <= 0 else max(0.0, 1.0 - self.busy / self.step)


def _order(schedule: str, p: int, v: int, m: int, s: int) -> list[tuple[str, int, int]]:
    """The (phase, chunk, microbatch) tasks device ``s`` runs, in its order."""
    if schedule == "gpipe":
        fwd = [("F", c, j) for c in range(v) for j in range(m)]
        return fwd + [("B", c, j) for c in reversed(range(v)) for j in range(m)]
    # forward chunk order: microbatches in groups of p per chunk (v = 1: plain microbatch order)
    group = p if v > 1 else m
    fwd = [("F", c, j) for g in range(0, m, group) for c in range(v) for j in range(g, min(g + group, m))]
    bwd = [("B", c, j) for g in range(0, m, group) for c in reversed(range(v)) for j in range(g, min(g + group, m))]
    warm = min(len(fwd), (p - s - 1) * 2 + (v - 1) * p if v > 1 else p - s - 1)
    out = fwd[:warm]
    rest_f, rest_b = fwd[warm:], list(bwd)
    while rest_f or rest_b:
        if rest_f:
            out.append(rest_f.pop(0))
        if rest_b:
            out.append(rest_b.pop(0))
    return out


def pipeline_seconds(forward: Sequence[float], backward: Sequence[float], *, microbatches: int,
                     schedule: str = "1f1b", virtual: int = 1, transfer: Sequence[float] | float = 0.0,
                     overlap: bool = True) -> PipelineTime:
    """One step of ``microbatches`` over ``len(forward)`` stages.

    Args:
      forward, backward: per stage, the seconds of one microbatch's forward and backward on that stage (all of
        its chunks together when ``virtual > 1``).
      microbatches: ``m``.
      schedule: ``"1f1b"`` or ``"gpipe"``.
      virtual: model chunks per device (interleaving); each chunk takes ``1/virtual`` of its stage's time.
      transfer: seconds of one point-to-point transfer across each boundary (one number for all), both ways.
      overlap: transfers run on their own link streams (async); False puts them on the sender's stream.

    Raises:
      ValueError: mismatched stage lists, or no microbatches.
    """
    p = len(forward)
    if p != len(backward) or p == 0 or microbatches < 1 or virtual < 1:
        raise ValueError(f"pipeline_seconds needs one forward and backward time per stage and microbatches >= 1, "
                         f"got {len(forward)} forward, {len(backward)} backward, {microbatches} microbatches, "
                         f"virtual={virtual}")
    m, v = microbatches, virtual
    xfer = [float(transfer)] * max(p * v - 1, 0) if isinstance(transfer, (int, float)) else list(transfer)
    chunks = p * v  # global chunk index g = c·p + s runs on device s
    tasks: list[Task] = []
    index: dict[tuple, int] = {}
    orders = [_order(schedule, p, v, m, s) for s in range(p)]
    cursor = [0] * p
    placed = 0
    total = sum(len(o) for o in orders)

    def deps_ready(s, phase, c, j) -> tuple | None:
        g = c * p + s
        need = []
        if phase == "F" and g > 0:
            need.append(("XF", g - 1, j))
        if phase == "B":
            need.append(("F", g, j))
            if g < chunks - 1:
                need.append(("XB", g + 1, j))
        if all(k in index for k in need):
            return tuple(index[k] for k in need)
        return None

    while placed < total:  # a dependency-respecting order: round-robin over devices, each in its own order
        progressed = False
        for s in range(p):
            while cursor[s] < len(orders[s]):
                phase, c, j = orders[s][cursor[s]]
                deps = deps_ready(s, phase, c, j)
                if deps is None:
                    break
                g = c * p + s
                seconds = (forward[s] if phase == "F" else backward[s]) / v
                index[(phase, g, j)] = len(tasks)
                tasks.append(Task(f"{phase}{g}.{j}", f"stage{s}", seconds, deps))
                t_x = xfer[g - (phase == "B")] if (phase == "F" and g < chunks - 1) or (phase == "B" and g > 0) else None
                if t_x is not None:
                    stream = (f"link{g}f" if phase == "F" else f"link{g - 1}b") if overlap else f"stage{s}"
                    index[("X" + phase, g, j)] = len(tasks)
                    tasks.append(Task(f"X{phase}{g}.{j}", stream, t_x, (len(tasks) - 1,)))
                cursor[s] += 1
                placed += 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked; this is a bug in autoshard.perf.pipeline")
    sched = simulate(tasks)
    busy = max(sched.busy.get(f"stage{s}", 0.0) for s in range(p))
    return PipelineTime(sched.makespan, busy)
