"""Memory budget sweep: how the plan trades step time for memory, judged by what XLA compiled.

    python -m benchmarks.memory [--hidden 256] [--layers 4] [--batch 16] [--mesh 2,4] [--out memory.json]

For each budget, from generous to tight, it plans a GPT train step with
``memory_budget=...``, compiles it, and prints the predicted and compiled peak
memory per device (``memory_analysis``), their gap, and the estimated step time
(``autoshard.hlo.estimate_step_time`` under the same ClusterSpec). The first row
has no budget beyond the cluster's memory.
"""

from __future__ import annotations

import argparse
import json
import os


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--mesh", default="2,4")
    ap.add_argument("--cluster", default="h100-nvlink")
    ap.add_argument("--fractions", default="1.0,0.6,0.4,0.25,0.15,0.1",
                    help="budgets as fractions of the unconstrained plan's compiled peak")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shape = tuple(int(x) for x in args.mesh.split(","))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    import jax

    import autoshard
    from autoshard.hlo import estimate_step_time, memory_stats
    from benchmarks.models import gpt

    config = gpt.GPTConfig(vocab_size=1024, seq_len=128, hidden=args.hidden, num_layers=args.layers, num_heads=4)
    spec = gpt.build(config, args.batch)
    state, batch = spec.abstract_state(), spec.abstract_batch()
    mesh = autoshard.make_mesh(shape, ("data", "model")[-len(shape):])
    cluster = autoshard.cluster_preset(args.cluster)

    rows, base_peak = [], None
    for frac in [float(f) for f in args.fractions.split(",")]:
        budget = None if base_peak is None else frac * base_peak
        step = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=cluster, memory_budget=budget,
                                     donate_argnums=(0,), progress=None)
        row = {"budget": budget, "fraction": frac}
        try:
            plan = step.plan(state, batch)
            compiled = step.lower(state, batch).compile()
        except autoshard.InfeasibleError as e:
            row.update(status="infeasible", smallest=e.smallest_memory)
            rows.append(row)
            continue
        peak = memory_stats(compiled)["peak"]
        base_peak = peak if base_peak is None else base_peak
        row.update(status="ok", predicted_peak=plan.cost.peak_memory_bytes, compiled_peak=peak,
                   gap=plan.cost.peak_memory_bytes / peak - 1, fits=budget is None or peak <= budget,
                   step_time_s=estimate_step_time(compiled, cluster, mesh)["time_s"],
                   breakdown=plan.memory.breakdown)
        rows.append(row)

    print(f"GPT hidden {args.hidden}, {args.layers} layers, batch {args.batch}, mesh {args.mesh}, {args.cluster}\n")
    print("| budget (MB) | predicted peak (MB) | compiled peak (MB) | gap | fits | est. step (ms) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        b = "none" if r["budget"] is None else f"{r['budget'] / 1e6:.1f}"
        if r["status"] != "ok":
            print(f"| {b} | infeasible: smallest {r['smallest'] / 1e6:.1f} | | | | |")
            continue
        print(f"| {b} | {r['predicted_peak'] / 1e6:.1f} | {r['compiled_peak'] / 1e6:.1f} | {r['gap']:+.0%} | "
              f"{'yes' if r['fits'] else 'NO'} | {r['step_time_s'] * 1e3:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
