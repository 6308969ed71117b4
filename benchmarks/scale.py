"""Planning at scale: GPTs and Llamas on 8 to 1,024 devices that this machine does not have (issues 16, 45).

    python -m benchmarks.scale [--out benchmarks/results/scale.json] [--rows 39B-64,175B-1024]

Each pipelined row plans a GPT train step (AdamW, fp32) from ``ShapeDtypeStruct``s on a
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

Host memory (issue 45): each row plans in a process of its own, and a second process traces and lowers the
same step with ``jax.jit(step).trace(state, batch).lower()`` (what any jax user pays for the step, with
nothing sharded). The table gives both processes' peak resident memory (``ru_maxrss``, Python and jax
included) and their ratio; the goal is planner RSS <= max(8 GB, 1.3 x jax.jit's).

Rows whose name ends in ``-flat`` plan without pipeline options (one program, the memory levers alone:
sharding, remat, offload), as a user who passes only a mesh does. The ``-concrete`` row plans the same step
on a concrete mesh of that many simulated CPU devices (its process gets ``XLA_FLAGS`` for them), which stand in
for the preset's chips: nothing is compiled, and the plan is estimated for the chip's backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import subprocess
import sys
import time

from benchmarks.output import chosen_rows, finish, row_arguments


@dataclasses.dataclass(frozen=True)
class Row:
    """One planning run: a GPT config, its global batch and microbatches, an abstract mesh and a preset."""

    name: str
    config: str
    batch: int
    microbatches: int
    mesh: tuple[int, ...]
    cluster: str = "h100-nvlink"
    pipeline: bool = True  # num_stages="auto"; False: one program, the memory levers alone
    family: str = "gpt"  # benchmarks.models family
    axes: tuple[str, ...] = ("data", "model")  # the mesh's axis names, as the row's users name them
    seq: int | None = None  # the sequence length, when not the config's
    choose_shape: bool = False  # mesh=<device count>: the planner chooses the shape (candidate_meshes)
    concrete: bool = False  # a concrete mesh of that many simulated CPU devices (standing in for the preset's chips)

    @property
    def devices(self) -> int:
        return math.prod(self.mesh)


ROWS = (
    Row("39B-64", "39B", 64, 8, (8, 8)),
    # issue 45's one-click case: the same model and mesh with no pipeline options
    Row("39B-64-flat", "39B", 64, 1, (8, 8), pipeline=False),
    # and its second case: the same step on 64 concrete simulated CPU devices, which stand in for the H100s
    Row("39B-64-concrete", "39B", 64, 1, (8, 8), pipeline=False, concrete=True),
    # issue 45: Llama-3-8B as EasyLM writes it (bf16 compute, fp32 AdamW), batch 8 x 4,096, on EasyLM's mesh names
    Row("llama3-8B-8", "llama3-8b", 8, 1, (1, 8, 1), pipeline=False, family="llama", axes=("dp", "fsdp", "mp"),
        seq=4096),
    # issue 45: Llama-3.1-70B as EasyLM writes it, MaxText's 256-GPU shape: batch 512 x 8,192 on (2, 16, 8)
    Row("llama3-70B-256", "llama3-70b", 512, 1, (2, 16, 8), pipeline=False, family="llama",
        axes=("data", "fsdp", "tensor")),
    # the same step with mesh=256: the planner chooses the shape among autoshard.cluster.candidate_meshes
    Row("llama3-70B-256-any", "llama3-70b", 512, 1, (256,), pipeline=False, family="llama", choose_shape=True),
    # GPT-3's batch (1536 x 2048 tokens) in microbatches of 2 sequences (Megatron-LM runs 175B at 1; this step
    # traces differently at batch 1, so 2 is the smallest that captures)
    Row("175B-1024", "175B", 1536, 768, (128, 8)),
)
TARGETS_S = {"39B-64": 60.0, "39B-64-flat": 60.0, "39B-64-concrete": 60.0, "llama3-8B-8": 30.0, "llama3-70B-256": 60.0, "175B-1024": 300.0,
             "llama3-70B-256-any": 300.0}
RSS_FLOOR_GB, RSS_RATIO = 8.0, 1.3  # issue 45: planner RSS <= max(8 GB, 1.3 x jax.jit's trace-and-lower RSS)


def row_model(row: Row):
    """The row's :class:`~benchmarks.models.ModelSpec` (its config, with the row's sequence length if it has one)."""
    from benchmarks.models import get_model, gpt, llama

    if row.seq is None:
        return get_model(row.family, row.config, row.batch)
    module = {"gpt": gpt, "llama": llama}[row.family]
    return module.build(dataclasses.replace(module.CONFIGS[row.config], seq_len=row.seq), row.batch)


def plan_row(row: Row) -> dict:
    """Plan ``row`` once; returns its timings, the plan's stages and predictions (or the error)."""
    from jax.sharding import AbstractMesh

    import autoshard
    from autoshard.errors import InfeasibleError, MeshError
    spec = row_model(row)
    state, batch = spec.abstract_state(), spec.abstract_batch()
    cluster = autoshard.cluster_preset(row.cluster)
    options = dict(num_microbatches=row.microbatches, pipeline=autoshard.PipelineOptions(num_stages="auto")) \
        if row.pipeline else {}
    if row.concrete:
        mesh = autoshard.make_mesh(row.mesh, row.axes)
    else:
        mesh = row.devices if row.choose_shape else AbstractMesh(row.mesh, row.axes)
    step = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=cluster,
                                 progress=None, donate_argnums=(0,), **options)
    t0 = time.perf_counter()
    try:
        plan = step.plan(state, batch)
        error = None
    except (InfeasibleError, MeshError) as e:
        plan, error = None, str(e).split("\n")[0]
    total = time.perf_counter() - t0
    out = {"row": row.name, "config": row.config, "batch": row.batch, "microbatches": row.microbatches,
           "mesh": list(row.mesh), "devices": row.devices, "cluster": row.cluster,
           "plan_s": total, "target_s": TARGETS_S.get(row.name), "memory_limit": cluster.memory, "error": error}
    if plan is None:
        return out
    if not row.pipeline:
        st = plan.stats
        out.update(capture_s=st.get("timings", {}).get("capture", 0.0), stages=1,
                   stage_meshes=[list(plan.mesh_info.shape)], mesh_names=list(plan.mesh_info.names),
                   meshes_tried=st.get("meshes_tried"), meshes_pruned=st.get("meshes_pruned"),
                   step_ms=plan.cost.total_seconds * 1e3, peak_bytes=plan.memory.peak_bytes,
                   remat=None if plan.remat is None else f"{plan.remat.units}/{plan.remat.num_units}",
                   offloaded=len(plan.offloaded))
        out["fits"] = out["peak_bytes"] <= cluster.memory
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


def trace_and_lower(row: Row) -> dict:
    """What ``jax.jit`` itself needs for the row's step: ``jax.jit(step).trace(state, batch).lower()`` from
    ``ShapeDtypeStruct``s, nothing sharded; its wall time."""
    import jax

    spec = row_model(row)
    state, batch = spec.abstract_state(), spec.abstract_batch()
    t0 = time.perf_counter()
    jax.jit(spec.train_step).trace(state, batch).lower()
    return {"jit_lower_s": time.perf_counter() - t0}


def _peak_rss_gb() -> float:
    """This process's peak resident memory in GB (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9


def in_process(kind: str, row: Row) -> dict:
    """Run :func:`plan_row` (``kind="plan"``) or :func:`trace_and_lower` (``"jit"``) for ``row`` in a fresh Python
    process, so that its peak RSS is its own; the result gains ``{kind}_rss_gb``. A process that dies (killed
    for memory, say) gives ``{kind}_error`` with its exit status and last lines."""
    flags = (f"--xla_force_host_platform_device_count={row.devices}" if row.concrete
             else os.environ.get("XLA_FLAGS", "--xla_force_host_platform_device_count=8"))
    env = {**os.environ, "XLA_FLAGS": flags}
    done = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--child", kind, "--rows", row.name],
                          env=env, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        return {f"{kind}_error": f"exit status {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def _child(kind: str, row: Row) -> None:
    result = plan_row(row) if kind == "plan" else trace_and_lower(row)
    print(json.dumps({**result, f"{kind}_rss_gb": _peak_rss_gb()}), flush=True)


def measure_row(row: Row) -> dict:
    """The row planned, then its step traced and lowered by ``jax.jit``, each in its own process; with the
    planner's RSS over jax.jit's and whether it meets issue 45's bound."""
    out = {"row": row.name, "config": row.config, "devices": row.devices,
           "target_s": TARGETS_S.get(row.name), **in_process("plan", row)}
    out.update(in_process("jit", row))
    if "plan_rss_gb" in out and "jit_rss_gb" in out:
        bound = max(RSS_FLOOR_GB, RSS_RATIO * out["jit_rss_gb"])
        out.update(rss_ratio=out["plan_rss_gb"] / out["jit_rss_gb"], rss_bound_gb=bound,
                   rss_within=out["plan_rss_gb"] <= bound)
    return out


def _num(r: dict, key: str, fmt: str) -> str:
    """``r[key]`` formatted, or a dash as wide when the row has none."""
    return format(r[key], fmt) if r.get(key) is not None else "-".rjust(int(fmt.split(".")[0].rstrip("d")))


def table(rows: list[dict]) -> str:
    head = (f"{'row':<15} {'devices':>7} {'plan s':>7} {'target':>6} {'capture':>7} {'layers':>7} {'DP':>5} "
            f"{'stages':>6} {'plans':>5} {'stages x mesh':<22} {'step ms':>9} {'peak GiB':>8} {'fits':<4} "
            f"{'plan RSS':>8} {'jit RSS':>7} {'ratio':>5} {'RSS ok':<6}")
    lines = [head]
    for r in rows:
        rss = (f"{_num(r, 'plan_rss_gb', '8.2f')} {_num(r, 'jit_rss_gb', '7.2f')} {_num(r, 'rss_ratio', '5.2f')} "
               f"{'-' if r.get('rss_within') is None else 'yes' if r['rss_within'] else 'no':<6}")
        failed = r.get("error") or r.get("plan_error")
        if failed:
            lines.append(f"{r['row']:<15} {r['devices']:>7} {_num(r, 'plan_s', '7.1f')} {_num(r, 'target_s', '6.0f')} "
                         f"{'':>7} {'':>7} {'':>5} {'':>6} {'':>5} {'no plan':<22} {'':>9} {'':>8} {'no':<4} {rss}  "
                         f"{failed[:160]}")
            continue
        shapes = f"{r['stages']} x " + ",".join("x".join(map(str, m)) for m in dict.fromkeys(map(tuple, r["stage_meshes"])))
        if r.get("remat"):
            shapes += f" remat {r['remat']}"
        lines.append(f"{r['row']:<15} {r['devices']:>7} {r['plan_s']:>7.1f} {_num(r, 'target_s', '6.0f')} "
                     f"{r['capture_s']:>7.1f} {_num(r, 'layer_plans_s', '7.1f')} {_num(r, 'stage_dp_s', '5.1f')} "
                     f"{_num(r, 'stage_plans_s', '6.1f')} {_num(r, 'layer_plans', '5d')} {shapes:<22} "
                     f"{r['step_ms']:>9.1f} {r['peak_bytes'] / 2**30:>8.1f} {'yes' if r['fits'] else 'no':<4} {rss}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = row_arguments(__doc__, "benchmarks/results/scale.json", ROWS)
    ap.add_argument("--child", choices=("plan", "jit"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    rows = chosen_rows(ap, args.rows, ROWS)
    if args.child:
        _child(args.child, rows[0])
        return 0
    results = []
    for row in rows:
        results.append(measure_row(row))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    finish(results, table, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
