"""Benchmark the strategy solver on the IOPDDL contest problems.

Usage::

    python -m benchmarks.solver [--iopddl-dir DIR] [--time-scale 0.1] [--only B,G] [--out results.json]

Each problem runs at its contest time limit times ``--time-scale``; reading the
file is not counted. Prints one table row per problem and writes all rows as
JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

from autoshard.solver import solve
from autoshard.solver.iopddl import read_iopddl

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "shared" / "iopddl"


def run(directory: Path, time_scale: float, only: set[str] | None, seed: int, workers: int | None = None) -> list[dict]:
    rows = []
    with open(directory / "best_known.csv") as f:
        entries = list(csv.DictReader(f))
    for e in entries:
        name = e["problem"]
        if only and name.rsplit("-", 1)[-1] not in only and name not in only:
            continue
        problem = read_iopddl(directory / f"{name}.json.gz")
        limit = float(e["timeout_s"]) * time_scale
        t0 = time.perf_counter()
        sol = solve(problem, time_limit=limit, seed=seed, workers=workers)
        seconds = time.perf_counter() - t0
        best = float(e["best_known_cost"])
        row = {
            "problem": name,
            "nodes": problem.num_nodes,
            "edges": problem.num_edges,
            "cost": sol.cost,
            "best_known": best,
            "ratio": sol.cost / best if sol.feasible else math.inf,
            "feasible": bool(sol.feasible),
            "seconds": round(seconds, 2),
            "time_limit": limit,
            "bound": sol.stats.get("bound", math.nan),
            "gap": sol.stats.get("gap", math.nan),
            "first_fit": sol.stats.get("first_fit", math.nan),
            "stop": sol.stats.get("stop"),
            "stats": {k: v for k, v in sol.stats.items() if isinstance(v, (int, float, str))},
        }
        rows.append(row)
        print(_fmt(row), flush=True)
    return rows


def _fmt(r: dict) -> str:
    return (
        f"{r['problem']:<24} {r['nodes']:>7} {r['edges']:>7} {r['cost']:>18.6g} {r['best_known']:>14.6g} "
        f"{r['ratio']:>8.4f} {r['feasible']!s:>8} {r['seconds']:>8.1f} {r['first_fit']:>8.2f} {r['gap']:>8.4f} "
        f"{r['stop']}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iopddl-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply each contest time limit")
    parser.add_argument("--only", default="", help="comma-separated problem letters or names")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None, help="solver processes (default: the available cores)")
    parser.add_argument("--out", type=Path, default=Path("solver_benchmark.json"))
    args = parser.parse_args(argv)
    only = {s.strip() for s in args.only.split(",") if s.strip()} or None
    print(f"{'problem':<24} {'nodes':>7} {'edges':>7} {'cost':>18} {'best known':>14} {'ratio':>8} "
          f"{'feasible':>8} {'seconds':>8} {'1st fit':>8} {'gap':>8} stop")
    rows = run(args.iopddl_dir, args.time_scale, only, args.seed, args.workers)
    ratios = [r["ratio"] for r in rows]
    geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios)) if ratios and all(map(math.isfinite, ratios)) else math.inf
    print(f"geometric mean ratio {geo:.4f}, worst {max(ratios, default=math.nan):.4f}, "
          f"all feasible {all(r['feasible'] for r in rows)}")
    args.out.write_text(json.dumps({"rows": rows, "geomean_ratio": geo, "time_scale": args.time_scale}, indent=1))


if __name__ == "__main__":
    main()
