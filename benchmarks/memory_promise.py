"""The memory promise, swept: no plan compiles over ``memory_budget``, whatever plan the solver returns.

    python -m benchmarks.memory_promise [--points 6] [--solver-time 10] [--out benchmarks/results/memory_promise.json]

The case is issue 46's: a GPT with 4 layers, width 512, vocabulary 8,192, sequence 256, batch 16, 8 heads
and Adam, on mesh (2, 4) with ``ClusterSpec(flops=1e14, bandwidth=(1e11, 1e11), latency=(5e-6, 5e-6))`` and
``donate_argnums=(0, 1)``. Budgets run from the unconstrained plan's compiled peak down to the smallest the
levers reach (found by the sweep itself: the first budget refused ends it), through the compiled peak of
hand-written FSDP (:mod:`benchmarks.baselines`). For each budget it plans, compiles ``step.lower(...)``
and records XLA's peak (argument + output + temp - alias, :func:`autoshard.hlo.memory_stats`), whether it
fits, the levers the plan used, why the solver stopped and its gap. Short ``--solver-time`` values make
the solves stop at their limit with a gap, which is where the plan returned depends on load: the promise
must hold for each of them.

Every row with a plan must fit; the script exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=6, help="budgets between the FSDP peak and the smallest")
    ap.add_argument("--solver-time", type=float, default=10.0, help="solver_time_limit per solve (s)")
    ap.add_argument("--low", type=float, default=0.6, help="the lowest budget, as a fraction of FSDP's peak")
    ap.add_argument("--out", default=None, help="JSON results")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    import warnings

    import jax

    import autoshard
    from autoshard.hlo import memory_stats
    from benchmarks.baselines import compile_baseline
    from benchmarks.models import gpt
    from benchmarks.output import commit

    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    config = gpt.GPTConfig(vocab_size=8192, seq_len=256, hidden=512, num_layers=4, num_heads=8)
    spec = gpt.build(config, 16)
    state, batch = spec.abstract_state(), spec.abstract_batch()
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    cluster = autoshard.ClusterSpec(flops=1e14, bandwidth=(1e11, 1e11), latency=(5e-6, 5e-6), memory=80e9,
                                    name="issue-46")
    fsdp = memory_stats(compile_baseline(spec.train_step, state, batch, mesh, "fsdp", donate=True))["peak"]

    def run(budget):
        step = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=cluster, memory_budget=budget,
                                     donate_argnums=(0, 1), solver_time_limit=args.solver_time,
                                     accumulate=False)  # one program, measured by step.lower
        row = {"budget": budget}
        t0 = time.perf_counter()
        try:
            plan = step.plan(state, batch)
        except autoshard.InfeasibleError as e:
            row.update(status="infeasible", smallest=e.smallest_memory, plan_s=time.perf_counter() - t0)
            return row
        plan_s = time.perf_counter() - t0
        peak = memory_stats(step.lower(state, batch).compile())["peak"]
        solver = plan.stats["solver"]
        row.update(status="ok", plan_s=plan_s, compiled_peak=peak, predicted_peak=plan.memory.peak_bytes,
                   checked_peak=plan.stats.get("compiled_peak"),
                   fits=budget is None or peak <= budget, objective_s=plan.cost.objective,
                   remat=f"{plan.remat.units}/{plan.remat.num_units}" if plan.remat is not None and plan.remat.units
                   else "-", offloaded=len(plan.offloaded), solver_stop=solver.get("stop"),
                   solver_gap=solver.get("gap"))
        return row

    rows = [run(None)]
    top = rows[0]["compiled_peak"]
    low = args.low * fsdp
    budgets = [fsdp] + [top - (top - low) * (k + 1) / args.points for k in range(args.points)]
    for budget in sorted(set(budgets), reverse=True):
        rows.append(run(budget))
        if rows[-1]["status"] != "ok":
            break
    title = (f"GPT 4 layers, d512, vocab 8192, seq 256, batch 16 on (2, 4); issue-46 cluster; solver_time_limit "
             f"{args.solver_time:g} s; hand-written FSDP compiles at {fsdp / 1e6:.1f} MB")
    print(title + "\n")
    print("| budget (MB) | compiled peak (MB) | fits | predicted (MB) | remat | offloaded | solver | gap | "
          "objective (ms) | plan (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = "none" if r["budget"] is None else f"{r['budget'] / 1e6:.1f}"
        if r["status"] != "ok":
            print(f"| {b} | refused: smallest {r['smallest'] / 1e6:.1f} | | | | | | | | {r['plan_s']:.0f} |")
            continue
        gap = "-" if r["solver_gap"] is None else f"{r['solver_gap']:.3g}"
        print(f"| {b} | {r['compiled_peak'] / 1e6:.1f} | {'yes' if r['fits'] else '**NO**'} | "
              f"{r['predicted_peak'] / 1e6:.1f} | {r['remat']} | {r['offloaded']} | {r['solver_stop']} | {gap} | "
              f"{r['objective_s'] * 1e3:.3f} | {r['plan_s']:.0f} |")
    broken = [r for r in rows if r["status"] == "ok" and not r["fits"]]
    print(f"\n{len(broken)} of {sum(r['status'] == 'ok' for r in rows)} plans compile over their budget "
          f"(commit {commit()}, jax {jax.__version__})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"commit": commit(), "jax": jax.__version__, "title": title, "fsdp_peak": fsdp,
                       "solver_time_limit": args.solver_time, "rows": rows}, f, indent=2, default=float)
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
