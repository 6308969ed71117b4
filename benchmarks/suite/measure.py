"""Compile every method on one model and read what XLA compiled.

Everything is compile-only from ``jax.ShapeDtypeStruct``s. One row per (model, method, preset):

- baselines are compiled once per mesh and scored under every preset whose topology allows the mesh;
- ``megatron`` is the best (lowest estimated step time, fitting in memory) of its 2-D sweep, with
  ``tp = 1`` standing for data parallelism;
- ``autoshard`` plans once per preset on every mesh the preset allows (with that preset's
  ``ClusterSpec`` and its memory as the budget), keeps the plan the planner itself predicts to be
  fastest, and compiles that one.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

import jax

import autoshard
from autoshard.hlo import collective_stats, memory_stats
from autoshard.hlo_schedule import estimate_step_time
from benchmarks import baselines
from benchmarks.models import get_model
from benchmarks.suite.cases import (
    BASELINES,
    METHODS,
    PRESETS,
    Case,
    Preset,
    autoshard_meshes,
    data_parallel_mesh,
    data_parallel_mesh_methods,
    megatron_meshes,
)

MESH_AXES = ("data", "model")


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """The rows of one model, and what the execution check needs afterwards."""

    rows: tuple[dict, ...]
    steps: dict  # preset -> (Parallelized, Plan, Compiled) that autoshard was measured with (tiny cases only)
    megatron_mesh: tuple[int, int] | None  # the best Megatron mesh under the first preset
    executables: (
        dict  # (method, mesh) -> the baseline's Compiled (tiny cases only), run by the execution check
    )


def make_mesh(shape: tuple[int, int], devices) -> jax.sharding.Mesh:
    return autoshard.make_mesh(shape, MESH_AXES, devices=devices[: shape[0] * shape[1]])


def read_compiled(compiled) -> dict[str, Any]:
    """Collectives per kind (loop bodies × trip count) and memory per device, from the executable."""
    stats = collective_stats(compiled)
    mem = memory_stats(compiled)
    return {
        "collectives": {
            k: {"count": int(v["count"]), "bytes": float(v["bytes"])} for k, v in stats.by_kind().items()
        },
        "collective_bytes": stats.bytes(),
        "memory": mem,
        "peak_bytes": mem["peak"],
    }


def score(compiled, cluster: autoshard.ClusterSpec, shape: tuple[int, int]) -> dict[str, Any]:
    """The one step-time formula every method gets: :func:`autoshard.hlo_schedule.estimate_step_time`."""
    est = estimate_step_time(compiled, cluster, shape)
    return {
        "step_time_s": est["time_s"],
        "compute_s": est["compute_s"],
        "communication_s": est["communication_s"],
        "simple_s": est["simple_s"],
        "flops_per_device": est["flops"],
        "seconds_by_kind": {k: v["seconds"] for k, v in est["per_kind"].items()},
    }


def _compile(lower_fn) -> tuple[Any, float, float]:
    t = time.perf_counter()
    lowered = lower_fn()
    lower_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = lowered.compile()
    return compiled, lower_s, time.perf_counter() - t


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def measure_case(
    case: Case,
    num_devices: int,
    *,
    presets=PRESETS,
    progress=None,
    meshes: tuple[tuple[int, int], ...] | None = None,
    methods: tuple[str, ...] | None = None,
) -> CaseResult:
    """Every method of ``case`` on ``num_devices`` simulated devices, under every preset.

    ``meshes`` restricts the Megatron sweep and autoshard's planning to those 2-D meshes (``--quick``).
    ``methods`` measures only those (``"autoshard"`` and the names in ``BASELINES``); None: all.
    """
    wanted = set(methods or METHODS)

    def allowed(shapes):
        return [s for s in shapes if meshes is None or tuple(s) in meshes]

    devices = jax.devices()[:num_devices]
    batch_size = case.batch_size(num_devices)
    spec = get_model(case.family, case.config, batch_size)
    state, batch = spec.abstract_state(), spec.abstract_batch()
    clusters = {p.name: autoshard.cluster_preset(p.name) for p in presets}
    base = {
        "suite": case.family,
        "model": case.name,
        "family": case.family,
        "config": case.config,
        "params": spec.num_params(),
        "batch": batch_size,
        "devices": num_devices,
    }
    rules = baselines.MEGATRON_RULES_BY_FAMILY.get(case.family, baselines.MEGATRON_RULES)

    def tick(label):
        if progress is not None:
            progress.update(f"{case.name}: {label}")

    # ---- baselines: one compile per (method, mesh) --------------------------------------------------
    compiled_runs: dict[tuple[str, tuple[int, int]], dict] = {}
    executables: dict[tuple[str, tuple[int, int]], Any] = {}

    def run_baseline(method, shape, **kw):
        mesh = make_mesh(shape, devices)
        try:
            compiled, lower_s, compile_s = _compile(
                lambda: baselines.lower_baseline(
                    spec.train_step, state, batch, mesh, method, donate=True, **kw
                )
            )
            run = {
                "lower_s": lower_s,
                "compile_s": compile_s,
                **read_compiled(compiled),
                "scores": {
                    p.name: score(compiled, clusters[p.name], shape) for p in presets if p.valid(shape)
                },
            }
            if case.tiny:
                executables[(method, shape)] = compiled
            del compiled
        except Exception as e:  # noqa: BLE001 - a failed compile is a result, not a crash
            run = {"error": _error(e)}
        compiled_runs[(method, shape)] = run
        gc.collect()

    dp_shape = data_parallel_mesh(num_devices)
    for method in data_parallel_mesh_methods(wanted):
        tick(f"{method} {dp_shape[0]}x{dp_shape[1]}")
        run_baseline(method, dp_shape)
    mega_shapes = sorted(
        {s for p in presets for s in allowed(megatron_meshes(num_devices, p))}, key=lambda s: s[1]
    ) if "megatron" in wanted else []
    for shape in mega_shapes:
        tick(f"megatron {shape[0]}x{shape[1]}")
        run_baseline("megatron", shape, rules=rules)

    rows = []
    megatron_best_mesh = None
    for preset in presets:
        mem_limit = clusters[preset.name].memory
        for method in BASELINES:
            if method not in wanted:
                continue
            if method == "megatron":
                # tp = 1 is data parallelism: the sweep includes it without a second compile.
                cands = [((num_devices, 1), compiled_runs[("data_parallel", dp_shape)])]
                cands += [
                    (s, compiled_runs[("megatron", s)]) for s in allowed(megatron_meshes(num_devices, preset))
                ]
            else:
                cands = [(dp_shape, compiled_runs[(method, dp_shape)])]
            summary = [_candidate(s, r, preset, mem_limit) for s, r in cands]
            ok = [c for c in summary if c["step_time_s"] is not None]
            fits = [c for c in ok if not c["oom"]]
            best = min(fits or ok, key=lambda c: c["step_time_s"], default=None)
            shape = tuple(best["mesh"]) if best else cands[0][0]
            run = dict(zip([tuple(s) for s, _ in cands], [r for _, r in cands], strict=True))[shape]
            row = _row(base, method, preset, shape, run, mem_limit)
            if method == "megatron":
                row["candidates"] = summary
                if megatron_best_mesh is None:
                    megatron_best_mesh = shape
            rows.append(row)

    # ---- autoshard: plan on every allowed mesh, compile the predicted best -------------------------
    steps = {}
    for preset in presets if "autoshard" in wanted else ():
        cluster = clusters[preset.name]
        plans = []
        for shape in allowed(autoshard_meshes(num_devices, preset)):
            tick(f"autoshard plan {preset.name} {shape[0]}x{shape[1]}")
            mesh = make_mesh(shape, devices)
            step = autoshard.parallelize(
                spec.train_step, mesh=mesh, cluster=cluster, donate_argnums=(0,), memory_budget=cluster.memory
            )
            t = time.perf_counter()
            try:
                plan = step.plan(state, batch)
                plans.append((shape, step, plan, time.perf_counter() - t))
            except Exception as e:  # noqa: BLE001 - e.g. InfeasibleError on a mesh that cannot fit
                plans.append((shape, None, _error(e), time.perf_counter() - t))
            gc.collect()
        tick(f"autoshard compile {preset.name}")
        rows.append(_autoshard_row(base, preset, plans, state, batch, cluster, steps))
        gc.collect()
    if not case.tiny:
        steps = {}
    return CaseResult(tuple(rows), steps, megatron_best_mesh, executables)


def _candidate(shape, run, preset: Preset, mem_limit) -> dict:
    sc = run.get("scores", {}).get(preset.name)
    return {
        "mesh": list(shape),
        "step_time_s": None if sc is None else sc["step_time_s"],
        "peak_bytes": run.get("peak_bytes"),
        "oom": run.get("peak_bytes", 0) > mem_limit,
        "error": run.get("error"),
    }


def _row(base, method, preset: Preset, shape, run, mem_limit) -> dict:
    row = {**base, "method": method, "preset": preset.name, "mesh": list(shape), "memory_limit": mem_limit}
    if "error" in run:
        return {**row, "status": "error", "error": run["error"], "oom": False, "step_time_s": None}
    oom = run["peak_bytes"] > mem_limit
    sc = run["scores"][preset.name]
    return {
        **row,
        "status": "oom" if oom else "ok",
        "error": None,
        "oom": oom,
        **sc,
        **{
            k: run[k]
            for k in ("collectives", "collective_bytes", "memory", "peak_bytes", "lower_s", "compile_s")
        },
    }


def _autoshard_row(base, preset: Preset, plans, state, batch, cluster, steps) -> dict:
    by_mesh = []
    for shape, _, plan, seconds in plans:
        entry = {"mesh": list(shape), "planning_s": seconds}
        if isinstance(plan, str):
            entry["error"] = plan
        else:
            entry.update(
                objective_s=plan.cost.objective,
                timings=dict(plan.stats.get("timings", {})),
                predicted_peak_bytes=plan.cost.peak_memory_bytes,
                optimal=plan.stats.get("optimal"),
                nodes=plan.stats.get("nodes"),
            )
        by_mesh.append(entry)
    feasible = [(s, st, p) for s, st, p, _ in plans if not isinstance(p, str)]
    info = {"planning_s": sum(p[3] for p in plans), "planning_by_mesh": by_mesh}
    if not feasible:
        row = {
            **base,
            "method": "autoshard",
            "preset": preset.name,
            "mesh": None,
            "memory_limit": cluster.memory,
            "autoshard": info,
        }
        return {
            **row,
            "status": "error",
            "error": "; ".join(e["error"] for e in by_mesh),
            "oom": False,
            "step_time_s": None,
        }
    shape, step, plan = min(feasible, key=lambda f: f[2].cost.objective)
    try:
        compiled, lower_s, compile_s = _compile(lambda: step.lower(state, batch))
    except Exception as e:  # noqa: BLE001
        row = {
            **base,
            "method": "autoshard",
            "preset": preset.name,
            "mesh": list(shape),
            "memory_limit": cluster.memory,
            "autoshard": info,
        }
        return {**row, "status": "error", "error": _error(e), "oom": False, "step_time_s": None}
    run = {
        "lower_s": lower_s,
        "compile_s": compile_s,
        **read_compiled(compiled),
        "scores": {preset.name: score(compiled, cluster, shape)},
    }
    check = plan.verify(compiled)
    c = plan.cost
    info.update(
        timings=dict(plan.stats.get("timings", {})),
        solver_optimal=plan.stats.get("optimal"),
        problem_nodes=plan.stats.get("nodes"),
        eqns=plan.stats.get("eqns"),
        predicted={
            "compute_s": c.compute_seconds,
            "communication_s": c.communication_seconds,
            "communication_bytes": c.communication_bytes,
            "peak_memory_bytes": c.peak_memory_bytes,
            "objective_s": c.objective,
        },
        verify={
            "predicted": dict(check.predicted),
            "compiled": dict(check.compiled),
            "predicted_bytes": check.predicted_bytes,
            "compiled_bytes": check.compiled_bytes,
            "ratio": check.ratio,
        },
        memory_ratio=run["peak_bytes"] / c.peak_memory_bytes if c.peak_memory_bytes else None,
        warnings=list(plan.warnings),
    )
    steps[preset.name] = (step, plan, compiled)
    del compiled
    row = _row(base, "autoshard", preset, shape, run, cluster.memory)
    row["autoshard"] = info
    return row
