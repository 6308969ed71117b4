"""Planning at scale: GPTs on 64 to 1,024 devices that this machine does not have (issue 16).

    python -m benchmarks.scale [--out benchmarks/results/scale.json] [--rows 39B-64,175B-1024]

Each row plans a GPT train step (AdamW, fp32) from ``ShapeDtypeStruct``s on a
``jax.sharding.AbstractMesh`` with ``num_stages="auto"``: the pipeline degree, each stage's
sub-mesh and its logical (data, model) shape are all searched, and every stage gets an intra-op
plan. Nothing is compiled. The table gives the wall time of each part of planning:

- ``capture``: tracing the step at the full batch and at the microbatch;
- ``layer plans``: the intra-op plans of every distinct layer on every sub-mesh option (repeated
  blocks are one program, planned once per option);
- ``stage DP``: Alpa's stage-mesh DP over the layer costs;
- ``stage plans``: the chosen stages' own intra-op plans;

then the plan: stages, their mesh shapes, the predicted step time and the largest predicted
per-device peak against the cluster's device memory (80 GiB on H100). A row whose stages do not
fit is reported with the planner's error (``fits: no``), never dropped.

Targets (issue 16): GPT-39B on 64 devices in <= 60 s (Alpa: 2,393 s, OSDI'22 Table 5); GPT-175B on
1,024 devices in <= 5 min under 80 GiB per device.
"""

from __future__ import annotations

import dataclasses
import os
import time

from benchmarks.output import chosen_rows, finish, row_arguments


@dataclasses.dataclass(frozen=True)
class Row:
    """One planning run: a GPT config, its global batch and microbatches, an abstract mesh and a preset."""

    name: str
    config: str
    batch: int
    microbatches: int
    mesh: tuple[int, int]
    cluster: str = "h100-nvlink"


ROWS = (
    Row("39B-64", "39B", 64, 8, (8, 8)),
    # GPT-3's batch (1536 x 2048 tokens) in microbatches of 2 sequences (Megatron-LM runs 175B at 1; this step
    # traces differently at batch 1, so 2 is the smallest that captures)
    Row("175B-1024", "175B", 1536, 768, (128, 8)),
)
TARGETS_S = {"39B-64": 60.0, "175B-1024": 300.0}


def plan_row(row: Row) -> dict:
    """Plan ``row`` once; returns its timings, the plan's stages and predictions (or the error)."""
    from jax.sharding import AbstractMesh

    import autoshard
    from autoshard.errors import InfeasibleError, MeshError
    from benchmarks.models import get_model

    spec = get_model("gpt", row.config, row.batch)
    state, batch = spec.abstract_state(), spec.abstract_batch()
    cluster = autoshard.cluster_preset(row.cluster)
    step = autoshard.parallelize(spec.train_step, mesh=AbstractMesh(row.mesh, ("data", "model")), cluster=cluster,
                                 num_microbatches=row.microbatches, progress=None,
                                 pipeline=autoshard.PipelineOptions(num_stages="auto"))
    t0 = time.perf_counter()
    try:
        plan = step.plan(state, batch)
        error = None
    except (InfeasibleError, MeshError) as e:
        plan, error = None, str(e).split("\n")[0]
    total = time.perf_counter() - t0
    out = {"row": row.name, "config": row.config, "batch": row.batch, "microbatches": row.microbatches,
           "mesh": list(row.mesh), "devices": row.mesh[0] * row.mesh[1], "cluster": row.cluster,
           "plan_s": total, "target_s": TARGETS_S.get(row.name), "memory_limit": cluster.memory, "error": error}
    if plan is None:
        return out
    st = plan.stats
    out.update(capture_s=st["capture_s"], layer_plans_s=st["layer_plans_s"],
               stage_dp_s=st["search_s"] - st["layer_plans_s"], stage_plans_s=st["total_s"] - st["search_s"],
               layer_plans=st["layer_plans"], distinct_layers=st["distinct_layers"],
               costed_layers=st["costed_layers"], dp_layers=st["num_layers"], stages=plan.num_stages,
               stage_meshes=[list(s.mesh_shape) for s in plan.stages],
               stage_layers=[list(s.layers) for s in plan.stages],
               step_ms=plan.step_time_s * 1e3, bubble=plan.bubble_fraction,
               peak_bytes=max(s.memory_bytes for s in plan.stages),
               rechecked=[{**r, "dp_ms": r.pop("dp_s") * 1e3, "planned_ms": r.pop("planned_s") * 1e3}
                          for r in map(dict, st.get("rechecked", []))])
    out["fits"] = out["peak_bytes"] <= cluster.memory
    return out


def table(rows: list[dict]) -> str:
    head = (f"{'row':<10} {'devices':>7} {'plan s':>7} {'target':>6} {'capture':>7} {'layers':>7} {'DP':>5} "
            f"{'stages':>6} {'plans':>5} {'stages x mesh':<22} {'step ms':>9} {'peak GiB':>8} fits")
    lines = [head]
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['row']:<10} {r['devices']:>7} {r['plan_s']:>7.1f} {r['target_s']:>6.0f}  no plan: "
                         f"{r['error'][:120]}")
            continue
        shapes = f"{r['stages']} x " + ",".join("x".join(map(str, m)) for m in dict.fromkeys(map(tuple, r["stage_meshes"])))
        lines.append(f"{r['row']:<10} {r['devices']:>7} {r['plan_s']:>7.1f} {r['target_s']:>6.0f} {r['capture_s']:>7.1f} "
                     f"{r['layer_plans_s']:>7.1f} {r['stage_dp_s']:>5.1f} {r['stage_plans_s']:>6.1f} "
                     f"{r['layer_plans']:>5} {shapes:<22} {r['step_ms']:>9.1f} {r['peak_bytes'] / 2**30:>8.1f} "
                     f"{'yes' if r['fits'] else 'no'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = row_arguments(__doc__, "benchmarks/results/scale.json", ROWS)
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    results = []
    for row in chosen_rows(ap, args.rows, ROWS):
        results.append(plan_row(row))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    finish(results, table, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
