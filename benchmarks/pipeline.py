"""Inter-operator parallelism: the best plan without a pipeline vs the best pipelined plan.

    python -m benchmarks.pipeline [--config 1.3B] [--mesh 2,4] [--batch 32] [--microbatches 8]
                                  [--cluster h100-2node-ib] [--stage-cost planner] [--out pipeline.json]

Compile-only (abstract shapes; nothing is allocated or run). For the GPT at 1.3B shape on 8 devices
laid out as 2 hosts x 4 GPUs, under the "h100-2node-ib" cluster (slow InfiniBand across hosts):

* no pipeline: ``parallelize(train_step, mesh=(2, 4))`` — the intra-op planner's predicted step time;
* pipelined: ``parallelize(..., num_microbatches=k, pipeline=PipelineOptions(num_stages="auto"))`` —
  the stage DP's latency Σ t_s + (k − 1)·max t_s, the bubble fraction of the simulated schedule, and
  each stage's sub-mesh and intra-op plan.

Target (issue 5): the whole inter-op search under 60 s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="1.3B")
    ap.add_argument("--mesh", default="2,4")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--cluster", default="h100-2node-ib")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    ap.add_argument("--stage-cost", default="planner", choices=["planner", "estimate"])
    ap.add_argument("--solver-time", type=float, default=1.0, help="seconds per intra-op solve")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shape = tuple(int(x) for x in args.mesh.split(","))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={max(8, math.prod(shape))}").strip()
    import autoshard
    from benchmarks.models import get_model

    spec = get_model("gpt", args.config, args.batch)
    state, batch = spec.abstract_state(), spec.abstract_batch()
    mesh = autoshard.make_mesh(shape, ("data", "model"))
    cluster = autoshard.cluster_preset(args.cluster)
    result = {"model": spec.name, "params": spec.num_params(), "batch": args.batch, "mesh": list(shape),
              "cluster": args.cluster, "microbatches": args.microbatches}

    if not args.skip_baseline:
        t = time.perf_counter()
        plan = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=cluster,
                                     solver_time_limit=10.0).plan(state, batch)
        result["no_pipeline"] = {
            "step_time_s": plan.cost.total_seconds,
            "compute_s": plan.cost.compute_seconds,
            "communication_s": plan.cost.communication_seconds,
            "peak_memory_gb": plan.cost.peak_memory_bytes / 1e9,
            "bubble_fraction": 0.0,
            "planning_s": time.perf_counter() - t,
        }
        print(f"no pipeline: {plan.cost.total_seconds * 1e3:.2f} ms/step predicted "
              f"(compute {plan.cost.compute_seconds * 1e3:.2f}, comm {plan.cost.communication_seconds * 1e3:.2f}), "
              f"planned in {result['no_pipeline']['planning_s']:.1f} s")

    t = time.perf_counter()
    opts = autoshard.PipelineOptions(num_stages="auto", schedule=args.schedule, stage_cost=args.stage_cost,
                                     solver_time_limit=args.solver_time)
    pplan = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=cluster, num_microbatches=args.microbatches,
                                  pipeline=opts).plan(state, batch)
    total = time.perf_counter() - t
    result["pipelined"] = {
        "step_time_s": pplan.step_time_s,
        "simulated_step_s": pplan.simulated_step_s,
        "bubble_fraction": pplan.bubble_fraction,
        "num_stages": pplan.num_stages,
        "stages": [{"layers": list(s.layers), "devices": list(s.devices), "mesh": list(s.mesh_shape),
                    "time_per_microbatch_s": s.time_s, "memory_gb": s.memory_bytes / 1e9, "in_flight": s.in_flight}
                   for s in pplan.stages],
        "inter_op_search_s": pplan.stats["search_s"],
        "planning_s": total,
        "capture_s": pplan.stats.get("capture_s"),
        "layer_plans": pplan.stats.get("layer_plans"),
        "num_layers": pplan.stats.get("num_layers"),
    }
    print(pplan.summary())
    print(f"pipelined: planned in {total:.1f} s (capture {pplan.stats.get('capture_s', 0):.1f} s, "
          f"inter-op search {pplan.stats['search_s']:.1f} s, {pplan.stats.get('layer_plans')} layer plans)")
    if "no_pipeline" in result:
        r = result["no_pipeline"]["step_time_s"] / pplan.step_time_s
        print(f"no pipeline / pipelined predicted step time: {r:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
