"""Predicted vs compiled peak memory per device, across the model zoo.

    python -m benchmarks.memory_gap [--cases mlp,gpt] [--out benchmarks/results/memory_gap.json]
    python -m benchmarks.memory_gap --case gpt/125M/16/8x1/h100-nvlink [--case ...]   # full-size spot checks

For each test model and mesh, with and without donating the state, it plans the
train step, compiles it, and prints ``plan.memory.peak_bytes`` beside XLA's peak
(:func:`autoshard.hlo.memory_stats`: argument + output + temp − alias) and
their ratio. The planner runs on the ``cpu-sim`` cluster, as in the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import time

# (family, config, batch): the tiny models of the tests, and the MLP the memory tests use.
MODELS = (
    ("mlp", "h1024", 32),
    ("mlp", "tiny", 16),
    ("gpt", "tiny", 64),
    ("gpt_scan", "tiny", 8),
    ("convnet", "tiny", 16),
    ("moe", "tiny", 16),
    ("wresnet", "tiny", 16),
)
MESHES = ((8,), (2, 4))
# Budgeted plans (h100-nvlink cluster, donated state): the solver trades layouts for memory.
BUDGETED = (("gpt", "tiny", 8, (8,), 9e5), ("gpt", "tiny", 8, (8,), 7.2e5), ("mlp", "h1024", 32, (8,), 30e6))


def measure(family, config, batch, shape, donate, *, budget=None, cluster="cpu-sim") -> dict:
    """Plan and compile one case; returns the predicted and compiled peaks and the categories."""
    import autoshard
    from autoshard.hlo import memory_stats
    from benchmarks.models import get_model

    spec = get_model(family, config, batch)
    mesh = autoshard.make_mesh(shape, ("data", "model")[-len(shape):])
    step = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=autoshard.cluster_preset(cluster),
                                 donate_argnums=(0,) if donate else (), memory_budget=budget, progress=None)
    state, b = spec.abstract_state(), spec.abstract_batch()
    plan = step.plan(state, b)
    stats = memory_stats(step.lower(state, b).compile())
    return {"model": f"{family}/{config}/b{batch}", "mesh": "x".join(map(str, shape)), "donate": donate,
            "budget": budget, "predicted": plan.memory.peak_bytes, "compiled": stats["peak"],
            "ratio": plan.memory.peak_bytes / stats["peak"], "breakdown": plan.memory.breakdown,
            "xla": {k: stats[k] for k in ("argument", "output", "temp", "alias")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=None, help="comma-separated families (default: all)")
    ap.add_argument("--out", default="benchmarks/results/memory_gap.json")
    ap.add_argument("--case", action="append", default=[],
                    help="family/config/batch/mesh/cluster, e.g. wresnet/250M/32/8x1/h100-nvlink: plan and compile "
                         "just these (state donated, the cluster's memory as budget) and print the ratio")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    import jax

    if args.case:
        for case in args.case:
            family, config, batch, mesh, cluster = case.split("/")
            shape = tuple(int(d) for d in mesh.split("x"))
            r = measure(family, config, int(batch), shape, True, cluster=cluster)
            print(f"{case}: predicted {r['predicted'] / 2**30:.3f} GiB, compiled {r['compiled'] / 2**30:.3f} GiB, "
                  f"compiled / predicted {r['compiled'] / r['predicted']:.3f}", flush=True)
        return 0
    families = None if args.cases is None else set(args.cases.split(","))
    rows, refused = [], []
    print("| model | mesh | donate | predicted (MB) | compiled (MB) | ratio | XLA temp (MB) |")
    print("|---|---|---|---|---|---|---|")
    for family, config, batch in MODELS:
        if families is not None and family not in families:
            continue
        for shape in MESHES:
            for donate in (False, True):
                t0 = time.perf_counter()
                r = measure(family, config, batch, shape, donate)
                r["seconds"] = time.perf_counter() - t0
                rows.append(r)
                print(f"| {r['model']} | {r['mesh']} | {'yes' if donate else 'no'} | {r['predicted'] / 1e6:.3f} | "
                      f"{r['compiled'] / 1e6:.3f} | {r['ratio']:.2f} | {r['xla']['temp'] / 1e6:.3f} |", flush=True)
    from autoshard import InfeasibleError

    for family, config, batch, shape, budget in BUDGETED:
        if families is not None and family not in families:
            continue
        t0 = time.perf_counter()
        try:
            r = measure(family, config, batch, shape, True, budget=budget, cluster="h100-nvlink")
        except InfeasibleError as e:  # the planner refuses a budget no compiled plan met
            print(f"| {family}/{config}/b{batch} budget {budget:.3g} | {'x'.join(map(str, shape))} | yes | "
                  f"refused: lowest compiled peak {e.smallest_memory / 1e6:.3f} MB | | | |", flush=True)
            refused.append({"model": f"{family}/{config}/b{batch}", "budget": budget,
                            "smallest_memory": e.smallest_memory, "error": str(e).split(chr(10))[0]})
            continue
        r["seconds"] = time.perf_counter() - t0
        rows.append(r)
        print(f"| {r['model']} budget {budget:.3g} | {r['mesh']} | yes | {r['predicted'] / 1e6:.3f} | "
              f"{r['compiled'] / 1e6:.3f} | {r['ratio']:.2f} | {r['xla']['temp'] / 1e6:.3f} |", flush=True)
    ratios = [r["ratio"] for r in rows]
    within = sum(abs(x - 1) <= 0.15 for x in ratios)
    print(f"\n{within}/{len(rows)} within 15%; ratio range {min(ratios):.2f}..{max(ratios):.2f}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "rows": rows, "refused": refused}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
