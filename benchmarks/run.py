"""Compare autoshard with hand-written shardings on Alpa's models, judged by what XLA compiled.

    python -m benchmarks.run --suite {gpt,moe,wresnet,all} --devices N [--quick] [--out results.json]

Every (model, method, preset) is compiled from ``jax.ShapeDtypeStruct``s on N simulated CPU
devices and scored by :func:`autoshard.hlo_schedule.estimate_step_time`; the tiny configs (``--quick``)
also run and are checked against a single-device ``jax.jit``. Prints markdown tables, writes JSON
with every field and, if matplotlib is installed, a PNG of the step times. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

MAX_DEVICES = 64


def _set_device_count(n: int) -> None:
    """Simulated CPU devices must be requested before jax starts its backend."""
    if "jax" in sys.modules:
        return  # already imported (e.g. under pytest): run_suite checks there are enough devices
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
    ]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])


def run_suite(
    suite: str = "all",
    devices: int = 8,
    *,
    quick: bool = False,
    configs=None,
    execute: bool = True,
    progress: bool = True,
    on_case=None,
    methods=None,
) -> dict:
    """Measure a suite in this process; returns the JSON-ready result (``meta``, ``rows``, ...).

    ``on_case(partial_result)`` is called after every model, e.g. to save partial results.
    ``methods``: measure only these (e.g. ``("autoshard",)`` after a planner change); None: all.
    """
    import jax

    from benchmarks.suite import cases, measure, report
    from benchmarks.suite import execute as execute_mod

    if len(jax.devices()) < devices:
        raise RuntimeError(
            f"--devices {devices} but jax has {len(jax.devices())} devices. The simulated device count is fixed "
            "when jax starts: run `python -m benchmarks.run` in a fresh process, or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} before importing jax."
        )
    selected = cases.select_cases(suite, quick=quick, configs=tuple(configs) if configs else None)
    # --quick: Megatron and autoshard on the one mesh (2, n/2) instead of sweeping every factorization.
    meshes = (cases.data_parallel_mesh(devices),) if quick else None

    def allowed(shapes):
        return [s for s in shapes if meshes is None or s in meshes]

    wanted = set(methods or cases.METHODS)
    units = 0
    for c in selected:
        units += len(cases.data_parallel_mesh_methods(wanted))
        if "megatron" in wanted:
            units += len({s for p in cases.PRESETS for s in allowed(cases.megatron_meshes(devices, p))})
        if "autoshard" in wanted:
            units += sum(len(allowed(cases.autoshard_meshes(devices, p))) + 1 for p in cases.PRESETS)
        units += 1 if c.tiny and execute else 0
    bar = report.Progress(units) if progress else None
    t0 = time.perf_counter()
    rows, executions, case_times = [], [], {}
    for c in selected:
        tc = time.perf_counter()
        res = measure.measure_case(c, devices, progress=bar, meshes=meshes, methods=methods)
        rows.extend(res.rows)
        if c.tiny and execute:
            if bar is not None:
                bar.update(f"{c.name}: execute")
            executions.extend(
                execute_mod.execute_case(c, devices, res.steps, res.megatron_mesh, res.executables)
            )
        case_times[c.name] = time.perf_counter() - tc
        jax.clear_caches()
        if on_case is not None:
            on_case(_result(suite, quick, devices, t0, case_times, rows, executions))
    if bar is not None:
        bar.close()
    return _result(suite, quick, devices, t0, case_times, rows, executions)


def _result(suite, quick, devices, t0, case_times, rows, executions) -> dict:
    import jax

    from benchmarks.suite import cases, report

    d = jax.devices()[0]
    return {
        "meta": {
            "suite": suite,
            "quick": quick,
            "devices": devices,
            "jax_version": jax.__version__,
            "jaxlib_version": getattr(__import__("jaxlib"), "__version__", None),
            "platform": d.platform,
            "device_kind": d.device_kind,
            "python": sys.version.split()[0],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "wall_s": time.perf_counter() - t0,
            "case_wall_s": dict(case_times),
            "presets": {
                p.name: __import__("autoshard").cluster_preset(p.name).to_dict() for p in cases.PRESETS
            },
            "step_time_formula": "autoshard.hlo_schedule.estimate_step_time(compiled, cluster, mesh)['time_s']",
        },
        "rows": list(rows),
        "comparisons": report.comparisons(rows),
        "executions": list(executions),
    }


def merge_results(results: list[dict]) -> dict:
    """One result from several runs (same devices): rows and executions concatenated, wall times summed.

    Where two results have a row for the same (model, method, preset), the later one's is kept."""
    from benchmarks.suite import report

    if len({r["meta"]["devices"] for r in results}) > 1:
        raise ValueError("cannot merge results measured on different device counts")
    meta = dict(results[0]["meta"])
    meta["suite"] = "+".join(r["meta"]["suite"] for r in results)
    meta["wall_s"] = sum(r["meta"]["wall_s"] for r in results)
    meta["case_wall_s"] = {k: v for r in results for k, v in r["meta"]["case_wall_s"].items()}
    # A later result's row replaces an earlier one of the same (model, method, preset): re-measure one
    # method (``--methods autoshard``) and merge it over a full run.
    by_key = {}
    for r in results:
        for row in r["rows"]:
            by_key[(row["model"], row["method"], row.get("preset"))] = row
    rows = list(by_key.values())
    return {
        "meta": meta,
        "rows": rows,
        "comparisons": report.comparisons(rows),
        "executions": [e for r in results for e in r["executions"]],
    }


def _merge(args) -> int:
    from benchmarks.suite import report

    results = []
    for path in args.merge:
        with open(path) as f:
            results.append(json.load(f))
    result = merge_results(results)
    print(report.markdown(result))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=float)
    if not args.no_plot and report.plot(result["rows"], os.path.splitext(args.out)[0] + ".png") is None:
        print("matplotlib is not installed: skipping the plot", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="all", choices=("gpt", "moe", "wresnet", "all"))
    ap.add_argument("--devices", type=int, default=8, help=f"simulated CPU devices (2..{MAX_DEVICES})")
    ap.add_argument("--quick", action="store_true", help="tiny configs only (executed and checked); < 3 min")
    ap.add_argument("--configs", default=None, help="comma-separated config names, e.g. 125M,350M")
    ap.add_argument("--out", default="results.json", help="JSON output path (the PNG goes beside it)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--no-execute", action="store_true", help="skip running the tiny configs")
    ap.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods to measure (autoshard, data_parallel, zero2, fsdp, megatron); "
        "default all. E.g. --methods autoshard after a planner change, then --merge over a full run",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="merge earlier results (e.g. one run per suite) "
        "into --out and print their tables; measures nothing",
    )
    args = ap.parse_args(argv)
    if args.merge:
        return _merge(args)
    if not 2 <= args.devices <= MAX_DEVICES:
        ap.error(f"--devices must be between 2 and {MAX_DEVICES}, got {args.devices}")
    _set_device_count(args.devices)

    from benchmarks.suite import report

    configs = [c for c in args.configs.split(",") if c] if args.configs else None

    def save(result):
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=float)

    methods = tuple(m for m in args.methods.split(",") if m) if args.methods else None
    if methods:
        from benchmarks.suite import cases

        unknown = sorted(set(methods) - set(cases.METHODS))
        if unknown:
            ap.error(f"--methods: unknown {', '.join(unknown)}; expected some of {', '.join(cases.METHODS)}")

    result = run_suite(
        args.suite, args.devices, quick=args.quick, configs=configs, execute=not args.no_execute, on_case=save,
        methods=methods,
    )
    print(report.markdown(result))
    save(result)
    print(f"\nwrote {args.out}", file=sys.stderr)
    if not args.no_plot:
        png = os.path.splitext(args.out)[0] + ".png"
        if report.plot(result["rows"], png) is None:
            print("matplotlib is not installed: skipping the plot (pip install matplotlib)", file=sys.stderr)
        else:
            print(f"wrote {png}", file=sys.stderr)
    bad = [e for e in result["executions"] if not e["ok"]]
    if bad:
        print(f"{len(bad)} executions do not match the single-device reference", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
