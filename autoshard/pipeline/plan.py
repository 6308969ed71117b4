"""``PipelinePlan``: the layer cut, each stage's sub-mesh and intra-op plan, and the schedule.

It has the report surface of every plan (:class:`autoshard.report.Report`): ``summary()``, the
notebook view, ``visualize``, ``to_json``/``from_json`` and ``verify``.
"""

from __future__ import annotations

import dataclasses
import html
import json
from typing import Any

from autoshard.errors import InputError, PlanError
from autoshard.report import COLORS, Report, bar_html, figure_class, format_bytes, format_ms

FORMAT = "autoshard-pipeline-plan/1"


def device_ranges(ids) -> str:
    """Device ids as comma-separated runs: ``(0, 1, 2, 3, 8, 9)`` -> ``"0-3,8-9"``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One pipeline stage.

    Attributes:
      index: stage number, 0 first.
      devices: device ids of its sub-mesh, in mesh order.
      mesh_shape: the sub-mesh's logical shape (``("data", "model")`` axes).
      layers: the ``[start, end)`` range of forward layers it owns.
      plan: its intra-op :class:`autoshard.Plan` (one microbatch's forward and backward).
      time_s: predicted seconds per microbatch: a k-th of the stage's step (k microbatches' forward and backward,
        its update and gradient reductions once; :func:`autoshard.pipeline.search.stage_seconds`).
      memory_bytes: predicted per-device peak, with ``in_flight`` microbatches' activations kept while the
        microbatches run (the update runs after the last).
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

    def compiled_peak(self, task_peaks: dict) -> float:
        """The stage's peak from its compiled tasks' (task key -> peak bytes per device): a microbatch's
        tasks (``"F"``, ``"B"``) run beside the other microbatches' activations in flight, the update and
        the reduction of the running sums (``"R"``) after the last microbatch."""
        micro = max((p for key, p in task_peaks.items() if key[0] != "R"), default=0.0)
        after = max((p for key, p in task_peaks.items() if key[0] == "R"), default=0.0)
        return max(micro + max(0, self.in_flight - 1) * self.activation_bytes, after)

    def to_dict(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
        return {**fields, "plan": None if self.plan is None else self.plan.to_json()}

    @classmethod
    def from_dict(cls, d: dict) -> StagePlan:
        plan = None if d["plan"] is None else _stage_plan_from(d["plan"], tuple(d["devices"]))
        return cls(int(d["index"]), tuple(d["devices"]), tuple(d["mesh_shape"]), tuple(d["layers"]), plan,
                   float(d["time_s"]), float(d["memory_bytes"]), float(d["activation_bytes"]), int(d["in_flight"]))


@dataclasses.dataclass(frozen=True)
class PipelinePlan(Report):
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

    def _accumulation_line(self) -> str | None:
        if "accumulated_because" not in self.stats:
            return None
        peaks = self.stats.get("task_peaks", {})
        return (f"gradient accumulation chosen by the planner: {self.num_microbatches} microbatches, "
                f"compiled task peaks <= {max(peaks.values(), default=0.0) / 1e6:.3f} MB "
                f"(the full batch: {self.stats['accumulated_because']})")

    def summary(self, max_rows: int = 40, *, rich: bool | None = None) -> str:
        """The stages as a text table (``max_rows`` and ``rich`` as in :meth:`autoshard.Plan.summary`;
        each stage's own plan: ``stage.plan.summary(...)``)."""
        lines = [f"pipeline: {self.num_stages} stage(s), {self.num_microbatches} microbatch(es), "
                 f"schedule {self.schedule}",
                 f"predicted step {self.step_time_s * 1e3:.3f} ms (simulated {self.simulated_step_s * 1e3:.3f} ms, "
                 f"bubble {self.bubble_fraction:.1%})",
                 f"{'stage':>5} {'layers':>9} {'devices':>18} {'mesh':>7} {'time/mb ms':>11} {'mem MB':>9} "
                 f"{'in-flight':>9}"]
        for s in self.stages[:max_rows]:
            devs = device_ranges(s.devices)
            lines.append(f"{s.index:>5} {str(s.layers[0]) + '-' + str(s.layers[1] - 1):>9} {devs:>18} "
                         f"{'x'.join(map(str, s.mesh_shape)):>7} {s.time_s * 1e3:>11.4f} "
                         f"{s.memory_bytes / 1e6:>9.2f} {s.in_flight:>9}")
        if self._accumulation_line() is not None:
            lines.append(self._accumulation_line())
        if self.cut_sources:
            lines.append("stage starts: " + "; ".join(f"{i}: {src}" for i, src in enumerate(self.cut_sources)))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def html(self) -> str:
        """The HTML report: the stages (time and memory bars), then each stage's intra-op plan report."""
        slowest = max((s.time_s for s in self.stages), default=0.0) or 1.0
        rows = "".join(
            f"<tr><td>{s.index}</td><td>{s.layers[0]}-{s.layers[1] - 1}</td><td>{'x'.join(map(str, s.mesh_shape))}"
            f"</td><td style='text-align: right'>{format_ms(s.time_s)}</td>"
            f"<td>{bar_html(s.time_s / slowest, COLORS['compute'], 'time per microbatch')}</td>"
            f"<td style='text-align: right'>{format_bytes(s.memory_bytes)}</td><td style='text-align: right'>"
            f"{s.in_flight}</td></tr>" for s in self.stages)
        parts = [
            '<div class="autoshard-plan" style="font-family: sans-serif; font-size: 13px; max-width: 60em">',
            f"<div><b>autoshard pipeline plan</b>: {self.num_stages} stage(s), {self.num_microbatches} "
            f"microbatch(es), schedule {html.escape(self.schedule)}</div>",
            f"<div>predicted step {format_ms(self.step_time_s)} (simulated {format_ms(self.simulated_step_s)}, "
            f"bubble {self.bubble_fraction:.1%})</div>",
            "<table><tr><th>stage</th><th>layers</th><th>mesh</th><th>time/microbatch</th><th></th>"
            f"<th>memory/device</th><th>in flight</th></tr>{rows}</table>",
        ]
        if self._accumulation_line() is not None:
            parts.append(f"<div>{html.escape(self._accumulation_line())}</div>")
        for s in self.stages:
            if s.plan is not None:
                parts.append(f"<details><summary>stage {s.index}: intra-op plan</summary>{s.plan.html()}</details>")
        parts.append("</div>")
        return "\n".join(parts)

    def figure(self, *, budget: float | None = None):
        """Two panels: each stage's predicted time per microbatch, and its memory per device."""
        fig = figure_class()(figsize=(10, 3.2), layout="constrained")
        ax_time, ax_mem = fig.subplots(1, 2)
        names = [f"stage {s.index}" for s in self.stages]
        ax_time.barh(names, [s.time_s * 1e3 for s in self.stages], color=COLORS["compute"])
        ax_time.set_xlabel("predicted ms per microbatch (forward + backward)")
        ax_mem.barh(names, [s.memory_bytes / 2**20 for s in self.stages], color=COLORS["activations"])
        if budget is None:
            budget = next((s.plan.stats.get("memory_budget") for s in self.stages if s.plan is not None), None)
        if budget is not None:
            ax_mem.axvline(budget / 2**20, color=COLORS["budget"], linestyle="--", label="budget")
            ax_mem.legend(fontsize=8)
        ax_mem.set_xlabel("MiB per device")
        for ax in (ax_time, ax_mem):
            ax.invert_yaxis()
        fig.suptitle(f"autoshard pipeline plan: {self.num_stages} stage(s), {self.num_microbatches} microbatch(es), "
                     f"{format_ms(self.step_time_s)} per step")
        return fig

    def verify(self, executable):
        """Compare each stage's predicted communication with what XLA compiled for its tasks.

        Args:
          executable: the step's executable, ``step.prepared(*args).executable`` (for an accumulated
            step, ``step.prepared(*args).program.executable``), which runs one task per program.

        Returns:
          A :class:`~autoshard.PlanCheck` over one microbatch's forward and backward of every stage:
          the stage plans' predicted bytes per collective kind, against the compiled F and B tasks' and
          the reduction of the gradients the runtime reduces once per step (which the plan prices with
          the microbatch).

        Raises:
          InputError: the executable is the SPMD runtime's one program, whose stages run as branches of one
            loop rather than as programs of their own.
        """
        from autoshard.plan import PlanCheck, compiled_bytes_by_kind

        compiled_tasks = getattr(executable, "compiled_tasks", None)
        if compiled_tasks is None:
            raise InputError("PipelinePlan.verify(...) compiles the runtime='device_put' tasks one by one; this step "
                             "runs as one SPMD program whose stages are branches of one loop. Fix: "
                             "PipelineOptions(runtime='device_put') on one host, with the same stage plans.")
        predicted: dict[str, float] = {}
        compiled: dict[str, float] = {}
        for stage in self.stages:
            if stage.plan is None:
                continue
            keys = executable.microbatch_keys(stage.index)
            got: dict[str, float] = {}
            for program in compiled_tasks(keys).values():
                for kind, nbytes in compiled_bytes_by_kind(program).items():
                    got[kind] = got.get(kind, 0.0) + nbytes
            check = stage.plan.check_against(got)
            for total, part in ((predicted, check.predicted), (compiled, check.compiled)):
                for kind, nbytes in part.items():
                    total[kind] = total.get(kind, 0.0) + nbytes
        return PlanCheck(predicted, compiled)

    def to_json(self) -> str:
        """Everything the report shows, each stage's intra-op plan included (``Plan.to_json``)."""
        stats = {k: v for k, v in self.stats.items() if _jsonable(v)}
        return json.dumps({"format": FORMAT, "stages": [s.to_dict() for s in self.stages], "schedule": self.schedule,
                           "num_microbatches": self.num_microbatches, "layer_flops": list(self.layer_flops),
                           "step_time_s": self.step_time_s, "simulated_step_s": self.simulated_step_s,
                           "bubble_fraction": self.bubble_fraction, "stats": stats,
                           "cut_sources": list(self.cut_sources)})

    @classmethod
    def from_json(cls, text: str) -> PipelinePlan:
        """Load a plan saved by :meth:`to_json`; stage plans get meshes of their saved devices."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"saved pipeline plan is not JSON ({e}). Fix: pass the text PipelinePlan.to_json() "
                            "returned.") from None
        fmt = d.get("format") if isinstance(d, dict) else None
        if fmt != FORMAT:
            raise PlanError(f"not an autoshard pipeline plan (format {fmt!r}; expected {FORMAT!r}). Fix: load a "
                            "single-program plan with autoshard.Plan.from_json.")
        try:
            return cls(tuple(StagePlan.from_dict(s) for s in d["stages"]), d["schedule"], int(d["num_microbatches"]),
                       tuple(d["layer_flops"]), float(d["step_time_s"]), float(d["simulated_step_s"]),
                       float(d["bubble_fraction"]), dict(d.get("stats", {})), tuple(d.get("cut_sources", ())))
        except KeyError as e:
            raise PlanError(f"saved pipeline plan is missing field {e.args[0]!r}. Fix: save it again with "
                            "PipelinePlan.to_json().") from None


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _stage_plan_from(text: str, device_ids: tuple[int, ...]):
    """A stage's saved :class:`~autoshard.Plan`, on a mesh of its saved devices."""
    import jax

    from autoshard.cluster import make_mesh
    from autoshard.plan import Plan

    d = json.loads(text)
    by_id = {dev.id: dev for dev in jax.devices()}
    missing = [i for i in device_ids if i not in by_id]
    if missing:
        raise PlanError(f"the saved stage plan runs on devices {missing}, which this process does not have. Fix: load "
                        "it where the plan was made.")
    mesh = make_mesh(tuple(d["mesh"]["shape"]), tuple(d["mesh"]["names"]), devices=[by_id[i] for i in device_ids])
    return Plan.from_json(text, mesh=mesh)
