"""``PipelinePlan``: the layer cut, each stage's sub-mesh and intra-op plan, and the schedule."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One pipeline stage.

    Attributes:
      index: stage number, 0 first.
      devices: device ids of its sub-mesh, in mesh order.
      mesh_shape: the sub-mesh's logical shape (``("data", "model")`` axes).
      layers: the ``[start, end)`` range of forward layers it owns.
      plan: its intra-op :class:`autoshard.Plan` (one microbatch's forward and backward).
      time_s: predicted seconds of one microbatch's forward + backward.
      memory_bytes: predicted per-device peak with ``in_flight`` microbatches' activations kept.
      activation_bytes: per-device bytes of one microbatch's residuals (forward -> backward).
      in_flight: the most microbatches the schedule keeps alive on this stage.
    """

    index: int
    devices: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    layers: tuple[int, int]
    plan: Any
    time_s: float
    memory_bytes: float
    activation_bytes: float
    in_flight: int


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """The inter-operator plan of a pipelined (or microbatched) step.

    Attributes:
      stages: one :class:`StagePlan` per stage.
      schedule: ``"1f1b"`` or ``"gpipe"``.
      num_microbatches: k.
      layer_flops: forward flops of each clustered layer.
      step_time_s: predicted step latency, Σ stage times + (k − 1) × the slowest (Alpa eq. 2).
      simulated_step_s, bubble_fraction: from list-scheduling the schedule with the stage times.
      stats: search timings and sizes.
      cut_sources: for each stage, the user source line of its first forward op (where the cut is).
    """

    stages: tuple[StagePlan, ...]
    schedule: str
    num_microbatches: int
    layer_flops: tuple[float, ...]
    step_time_s: float
    simulated_step_s: float
    bubble_fraction: float
    stats: dict = dataclasses.field(default_factory=dict)
    cut_sources: tuple[str, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def pipeline(self) -> PipelinePlan:
        return self

    def stage_time_imbalance(self) -> float:
        """max / min predicted stage time − 1 (0 is perfectly balanced)."""
        ts = [s.time_s for s in self.stages]
        return max(ts) / max(min(ts), 1e-30) - 1.0

    def summary(self) -> str:
        lines = [f"pipeline: {self.num_stages} stage(s), {self.num_microbatches} microbatch(es), "
                 f"schedule {self.schedule}",
                 f"predicted step {self.step_time_s * 1e3:.3f} ms (simulated {self.simulated_step_s * 1e3:.3f} ms, "
                 f"bubble {self.bubble_fraction:.1%})",
                 f"{'stage':>5} {'layers':>9} {'devices':>18} {'mesh':>7} {'time/mb ms':>11} {'mem MB':>9} "
                 f"{'in-flight':>9}"]
        for s in self.stages:
            devs = ",".join(map(str, s.devices))
            lines.append(f"{s.index:>5} {str(s.layers[0]) + '-' + str(s.layers[1] - 1):>9} {devs:>18} "
                         f"{'x'.join(map(str, s.mesh_shape)):>7} {s.time_s * 1e3:>11.4f} "
                         f"{s.memory_bytes / 1e6:>9.2f} {s.in_flight:>9}")
        if "accumulated_because" in self.stats:
            peaks = self.stats.get("task_peaks", {})
            lines.append(f"gradient accumulation chosen by the planner: {self.num_microbatches} microbatches, "
                         f"compiled task peaks <= {max(peaks.values(), default=0.0) / 1e6:.3f} MB "
                         f"(the full batch: {self.stats['accumulated_because']})")
        if self.cut_sources:
            lines.append("stage starts: " + "; ".join(f"{i}: {src}" for i, src in enumerate(self.cut_sources)))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()
