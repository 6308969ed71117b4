"""Planning speed: capture + strategies + problem + solve for small and large GPTs and a DDPM UNet.

    python -m benchmarks.planning [--out benchmarks/results/planning.json]
    python -m benchmarks.planning --config 350M [--mesh 2,4] [--batch 8]

Without ``--config`` it plans the rows of issue 14 (a user's first experiment should plan in
about a second): the demo's GPT (``python -m benchmarks.demo``: 4 layers, width 128, batch 16,
``cpu-sim`` cluster), the same GPT on the default cluster on mesh (2, 4) and with
``mesh=None`` (every 2-D factorization of the 8 devices), and a 4-layer width-64 GPT (the size
of flax's nnx MiniGPT tutorial). Targets: the width-128 GPT under 2 s on (2, 4) and under 6 s
with ``mesh=None``, on a 2-core machine. Then the rows of issue 46: the width-128 GPT on (2, 4)
under the ``h100-nvlink`` and ``tpu-v5e`` presets (target: under 1.5 s on ``h100-nvlink``, proven
optimal), and the DDPM UNet of ``benchmarks/models/unet.py`` (denoising-diffusion-flax's
fashion_mnist config at width 16, dim_mults (1, 2), batch 16; its step takes a key) on (2, 4) and
with ``mesh=None`` (targets: under 5 s and under 15 s). ``--config NAME`` plans one GPT of that
config instead (issue 2's target: 350M under 10 s on (2, 4)).

Times are wall seconds from abstract shapes (building the abstract state is not counted).
The pass columns sum over every mesh planned; "solver" is why the solver of the chosen mesh
stopped (``optimal``, ``gap`` or ``time_limit``; see ``autoshard.solver.solve``) and "gap" its
relative gap to its lower bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

PASSES = ("capture", "strategies", "problem", "solve")
UNET = "DDPM UNet (fashion_mnist, dim 16, mults 1-2)"


@dataclasses.dataclass(frozen=True)
class Row:
    """One planning run: a model shape, a mesh (None: autoshard picks) and a cluster preset.

    ``model`` names a builder in ``BUILDERS``: for ``"gpt"``, ``hidden`` is the width and ``layers`` the
    depth; for ``"unet"``, ``hidden`` is the UNet's ``dim`` and ``layers`` its number of resolutions
    (``dim_mults`` 1, 2, 4, ...).
    """

    name: str
    hidden: int
    layers: int
    mesh: tuple[int, ...] | None
    batch: int = 16
    cluster: str | None = None  # None: autoshard's default for the mesh
    donate: bool = False
    config: str | None = None  # a benchmarks.models.gpt config name instead of the small shape
    model: str = "gpt"


ROWS = (
    Row("demo GPT (4 layers, d128)", 128, 4, (2, 4), cluster="cpu-sim", donate=True),
    Row("GPT 4 layers, d128", 128, 4, (2, 4)),
    Row("GPT 4 layers, d128", 128, 4, None),
    Row("GPT 4 layers, d64 (MiniGPT size)", 64, 4, (2, 4)),
    Row("GPT 4 layers, d64 (MiniGPT size)", 64, 4, None),
    Row("GPT 4 layers, d128", 128, 4, (2, 4), cluster="h100-nvlink"),
    Row("GPT 4 layers, d128", 128, 4, (2, 4), cluster="tpu-v5e"),
    Row(UNET, 16, 2, (2, 4), model="unet"),
    Row(UNET, 16, 2, None, model="unet"),
)
# (model, mesh, cluster preset or None for the default): seconds
TARGETS = {
    ("GPT 4 layers, d128", (2, 4), None): 2.0,
    ("GPT 4 layers, d128", None, None): 6.0,
    ("GPT 4 layers, d128", (2, 4), "h100-nvlink"): 1.5,
    (UNET, (2, 4), None): 5.0,
    (UNET, None, None): 15.0,
}


def gpt_parts(row: Row) -> tuple:
    """``(train_step, abstract args)`` of the row's GPT."""
    from benchmarks.models import get_model, gpt

    if row.config is not None:
        spec = get_model("gpt", row.config, row.batch)
    else:
        spec = gpt.build(gpt.GPTConfig(vocab_size=512, seq_len=64, hidden=row.hidden, num_layers=row.layers,
                                       num_heads=4), row.batch)
    return spec.train_step, (spec.abstract_state(), spec.abstract_batch())


def unet_parts(row: Row) -> tuple:
    """``(train_step, abstract args)`` of the row's DDPM UNet: ``(state, batch, key)``."""
    from benchmarks.models import unet

    cfg = unet.DDPMConfig(dim=row.hidden, dim_mults=tuple(2**i for i in range(row.layers)), batch=row.batch)
    return unet.abstract_parts(cfg)


BUILDERS = {"gpt": gpt_parts, "unet": unet_parts}


def plan_row(row: Row) -> dict:
    """Plan ``row`` once; wall time per pass (summed over meshes), solver stop, problem size."""
    import autoshard

    train_step, args = BUILDERS[row.model](row)
    mesh = None if row.mesh is None else autoshard.make_mesh(row.mesh, ("data", "model")[-len(row.mesh):])
    cluster = None if row.cluster is None else autoshard.cluster_preset(row.cluster)
    passes = dict.fromkeys(PASSES, 0.0)
    last = [0.0]

    def progress(stage: str, done: int, total: int) -> None:
        # stages: "captured", then per mesh "strategies ...", "problem ...", "solved ...", then "done"
        now = time.perf_counter()
        for name, prefix in (("capture", "captured"), ("strategies", "strategies"), ("problem", "problem"),
                             ("solve", "solved")):
            if stage.startswith(prefix):
                passes[name] += now - last[0]
        last[0] = now

    step = autoshard.parallelize(train_step, mesh=mesh, cluster=cluster, progress=progress,
                                 donate_argnums=(0,) if row.donate else ())
    t = last[0] = time.perf_counter()
    plan = step.plan(*args)
    total = time.perf_counter() - t
    solver = plan.stats["solver"]
    return {
        "model": row.name,
        "mesh": "None" if row.mesh is None else ",".join(map(str, row.mesh)),
        "chosen_mesh": list(plan.mesh.devices.shape),
        "cluster": row.cluster or "default",
        "batch": row.batch,
        "eqns": plan.stats["eqns"],
        "problem_nodes": plan.stats["nodes"],
        "problem_edges": plan.stats["edges"],
        "core_nodes": solver.get("core_nodes"),
        "solver_optimal": bool(plan.stats["optimal"]),
        "solver_stop": solver.get("stop"),
        "solver_gap": solver.get("gap"),
        "objective_s": plan.cost.objective,
        "passes_s": passes,
        "chosen_mesh_timings_s": plan.stats["timings"],
        "total_s": total,
    }


def print_table(results: list[dict]) -> None:
    print(f"| model | mesh | cluster | problem nodes (core) | {' | '.join(PASSES)} | total | solver | gap | objective |")
    print("|---" * (8 + len(PASSES)) + "|")
    for r in results:
        passes = " | ".join(f"{r['passes_s'][p]:.2f}s" for p in PASSES)
        stop = r["solver_stop"] or ("optimal" if r["solver_optimal"] else "?")
        solver = stop + (" (optimal)" if r["solver_optimal"] and stop != "optimal" else "")
        gap = "-" if r["solver_gap"] is None else f"{r['solver_gap']:.2g}"
        print(f"| {r['model']} | {r['mesh']} | {r['cluster']} | {r['problem_nodes']} ({r['core_nodes']}) | {passes} | "
              f"**{r['total_s']:.2f}s** | {solver} | {gap} | {r['objective_s'] * 1e3:.4f} ms |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="plan one GPT config (e.g. 350M) instead of the small rows")
    ap.add_argument("--mesh", default="2,4", help="with --config: the mesh shape, or 'none'")
    ap.add_argument("--batch", type=int, default=8, help="with --config: the batch size")
    ap.add_argument("--cluster", default="h100-nvlink", help="with --config: the cluster preset")
    ap.add_argument("--out", default="benchmarks/results/planning.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    import jax

    if args.config is not None:
        mesh = None if args.mesh.lower() == "none" else tuple(int(x) for x in args.mesh.split(","))
        rows = (Row(f"gpt-{args.config}", 0, 0, mesh, batch=args.batch, cluster=args.cluster, config=args.config),)
    else:
        rows = ROWS
    plan_row(Row("warm-up", 32, 1, (2, 4), batch=4))  # jax's first trace pays one-off costs
    results = [plan_row(row) for row in rows]
    print_table(results)
    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (other processes distort wall times)")
    for r in results:
        mesh = None if r["mesh"] == "None" else tuple(map(int, r["mesh"].split(",")))
        target = TARGETS.get((r["model"], mesh, None if r["cluster"] == "default" else r["cluster"]))
        if target is not None:
            print(f"target: {r['model']} on mesh {r['mesh']} ({r['cluster']}) under {target:g} s -> "
                  f"{'met' if r['total_s'] < target else 'NOT met'} ({r['total_s']:.2f} s, solver {r['solver_stop']})")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            # the load average says how far other processes distorted these wall times
            json.dump({"jax": jax.__version__, "cpus": os.cpu_count(), "load_average": os.getloadavg(),
                       "rows": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
