"""Memory budget sweep: how the plan trades step time for memory, judged by what XLA compiled.

    python -m benchmarks.memory [--hidden 256] [--layers 4] [--batch 32] [--mesh 8] [--out memory.json]
                                [--plot memory.png]

For each budget, from generous to tight, it plans a GPT train step with
``memory_budget=...``, compiles it, and records the predicted and compiled peak memory per
device (``memory_analysis``), the estimated step time (``autoshard.hlo_schedule.estimate_step_time``
under the same ClusterSpec), how the train state is sharded (read from the plan's
``in_specs``: replicated, ZeRO-1/2 = optimizer state split, ZeRO-3 = parameters split too) and
how many forward segments are rematerialised. The first row has no budget beyond the
cluster's memory.

The hand-written baselines of :mod:`benchmarks.baselines` (data parallel, ZeRO-2, FSDP) are
compiled on the same mesh; for every budget the table names the fastest baseline that fits
(acceptance 1 of issue 8: where data parallelism does not fit, autoshard's plan fits and is
within 1.1x of the best hand-written plan that fits, or better).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time


def state_sharding(plan) -> dict:
    """Fractions of parameter and optimizer-state bytes that are split across devices, and a label."""
    import numpy as np

    info = plan.mesh_info
    total = {"params": 0.0, "opt_state": 0.0}
    split = {"params": 0.0, "opt_state": 0.0}
    for path, (shape, dtype), spec in zip(plan.in_paths, plan.in_avals, plan.in_specs, strict=True):
        kind = "opt_state" if "opt_state" in path else "params" if "params" in path else None
        if kind is None or not shape:
            continue
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        total[kind] += nbytes
        if math.prod(spec.shard_shape(shape, info)) < math.prod(shape):
            split[kind] += nbytes
    frac = {k: split[k] / total[k] if total[k] else 0.0 for k in total}
    if frac["params"] > 0.5:
        label = "ZeRO-3"
    elif frac["opt_state"] > 0.5:
        label = "ZeRO-1/2"
    elif frac["params"] > 0 or frac["opt_state"] > 0:
        label = "partly split"
    else:
        label = "replicated"
    return {"label": label, "params_split": frac["params"], "opt_state_split": frac["opt_state"]}


def _plot(rows, baselines, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["compiled_peak"] / 1e6 for r in ok]
    ys = [r["step_time_s"] * 1e3 for r in ok]
    ax.plot(xs, ys, "o-", color="C0", label="autoshard (budget sweep)")
    for r, x, y in zip(ok, xs, ys, strict=True):
        tag = r["sharding"]["label"] + (f" + remat {r['remat_units']}" if r["remat_units"] else "")
        ax.annotate(tag, (x, y), textcoords="offset points", xytext=(4, 6), fontsize=7)
    for k, (name, b) in enumerate(baselines.items()):
        ax.plot([b["compiled_peak"] / 1e6], [b["step_time_s"] * 1e3], "s", color=f"C{k + 1}", label=name)
    for r in ok:
        if r["budget"] is not None:
            ax.axvline(r["budget"] / 1e6, color="0.85", lw=0.8, zorder=0)
    ax.set_xlabel("compiled peak memory per device (MB); grey lines: budgets")
    ax.set_ylabel("estimated step time (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--mesh", default="8")
    ap.add_argument("--cluster", default="h100-nvlink")
    ap.add_argument("--fractions", default="1.0,0.8,0.6,0.5,0.4",
                    help="budgets as fractions of the unconstrained plan's compiled peak")
    ap.add_argument("--no-remat", action="store_true", help="plan without rematerialisation")
    ap.add_argument("--solver-time", type=float, default=5.0, help="solver_time_limit per solve (s)")
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--plot", default=None, help="PNG of step time against compiled peak")
    args = ap.parse_args(argv)
    shape = tuple(int(x) for x in args.mesh.split(","))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    import jax

    import autoshard
    from autoshard.hlo import memory_stats
    from autoshard.hlo_schedule import estimate_step_time
    from benchmarks.baselines import compile_baseline
    from benchmarks.models import gpt

    config = gpt.GPTConfig(vocab_size=1024, seq_len=args.seq, hidden=args.hidden, num_layers=args.layers,
                           num_heads=4)
    spec = gpt.build(config, args.batch)
    state, batch = spec.abstract_state(), spec.abstract_batch()
    mesh = autoshard.make_mesh(shape, ("data", "model")[-len(shape):] if len(shape) > 1 else ("data",))
    cluster = autoshard.cluster_preset(args.cluster)

    baselines = {}
    for method in ("data_parallel", "zero2", "fsdp"):
        compiled = compile_baseline(spec.train_step, state, batch, mesh, method, donate=True)
        baselines[method] = {"compiled_peak": memory_stats(compiled)["peak"],
                             "step_time_s": estimate_step_time(compiled, cluster, mesh)["time_s"]}

    rows, base_peak = [], None
    for frac in [float(f) for f in args.fractions.split(",")]:
        budget = None if base_peak is None else frac * base_peak
        # the estimate is compared with XLA:CPU's compiled peak: the CPU backend's, also for the budget-free
        # row (whose simulated devices would otherwise stand in for the preset's chips)
        step = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=cluster, memory_budget=budget,
                                     donate_argnums=(0,), progress=None, remat=not args.no_remat,
                                     profile=autoshard.backends.CPU,
                                     solver_time_limit=args.solver_time,
                                     accumulate=False)  # one program per budget, measured by step.lower
        row = {"budget": budget, "fraction": frac}
        t0 = time.perf_counter()
        try:
            plan = step.plan(state, batch)
            compiled = step.lower(state, batch).compile()
        except autoshard.InfeasibleError as e:
            row.update(status="infeasible", smallest=e.smallest_memory, plan_s=time.perf_counter() - t0)
            rows.append(row)
            continue
        peak = memory_stats(compiled)["peak"]
        base_peak = peak if base_peak is None else base_peak
        fitting = {k: b for k, b in baselines.items() if budget is None or b["compiled_peak"] <= budget}
        best_name = min(fitting, key=lambda k: fitting[k]["step_time_s"]) if fitting else None
        remat = plan.remat
        row.update(status="ok", predicted_peak=plan.cost.peak_memory_bytes, compiled_peak=peak,
                   gap=plan.cost.peak_memory_bytes / peak - 1, fits=budget is None or peak <= budget,
                   step_time_s=estimate_step_time(compiled, cluster, mesh)["time_s"],
                   sharding=state_sharding(plan),
                   remat_units=remat.units if remat is not None else 0,
                   remat_of=remat.num_units if remat is not None else 0,
                   remat_flops=remat.extra_flops if remat is not None else 0.0,
                   remat_candidates=list(remat.candidates) if remat is not None else [],
                   best_fitting_baseline=best_name,
                   vs_best_baseline=(estimate_step_time(compiled, cluster, mesh)["time_s"]
                                     / fitting[best_name]["step_time_s"]) if best_name else None,
                   plan_s=time.perf_counter() - t0, breakdown=plan.memory.breakdown)
        rows.append(row)

    title = (f"GPT hidden {args.hidden}, {args.layers} layers, seq {args.seq}, batch {args.batch}, "
             f"mesh {args.mesh}, {args.cluster}")
    print(title + "\n")
    print("| baseline | compiled peak (MB) | est. step (ms) |")
    print("|---|---|---|")
    for k, b in baselines.items():
        print(f"| {k} | {b['compiled_peak'] / 1e6:.2f} | {b['step_time_s'] * 1e3:.3f} |")
    print()
    print("| budget (MB) | predicted peak (MB) | compiled peak (MB) | fits | est. step (ms) | state | remat | "
          "best baseline that fits | vs it | plan (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = "none" if r["budget"] is None else f"{r['budget'] / 1e6:.2f}"
        if r["status"] != "ok":
            print(f"| {b} | infeasible: smallest {r['smallest'] / 1e6:.2f} | | | | | | | | {r['plan_s']:.0f} |")
            continue
        remat = f"{r['remat_units']}/{r['remat_of']}" if r["remat_units"] else "-"
        vs = f"{r['vs_best_baseline']:.2f}x" if r["vs_best_baseline"] else "-"
        print(f"| {b} | {r['predicted_peak'] / 1e6:.2f} | {r['compiled_peak'] / 1e6:.2f} | "
              f"{'yes' if r['fits'] else 'NO'} | {r['step_time_s'] * 1e3:.3f} | {r['sharding']['label']} | {remat} | "
              f"{r['best_fitting_baseline'] or 'none'} | {vs} | {r['plan_s']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "title": title, "baselines": baselines, "rows": rows}, f, indent=2,
                      default=float)
    if args.plot:
        _plot(rows, baselines, args.plot, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
