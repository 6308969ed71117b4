"""Command-line solver: ``python -m autoshard.solver PROBLEM.json[.gz] TIMEOUT_S``.

Prints progress lines, then as its last line the chosen strategy indices
``[i0, i1, ...]``. Exits with status 1 (and a message, no indices) when the
problem is malformed or proven infeasible.
"""

from __future__ import annotations

import argparse
import sys
import time

from autoshard.errors import InfeasibleError, ProblemFormatError
from autoshard.solver.iopddl import read_iopddl
from autoshard.solver.solve import solve


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    parser = argparse.ArgumentParser(prog="python -m autoshard.solver", description=__doc__.splitlines()[0])
    parser.add_argument("problem", help="contest problem file (.json or .json.gz)")
    parser.add_argument("timeout", type=float, help="wall-clock budget in seconds, reading included")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=None,
                        help="solver processes (default: the cores this process may run on)")
    parser.add_argument("--quiet", action="store_true", help="print only the answer")
    args = parser.parse_args(argv)
    if args.timeout < 0:
        parser.error(f"timeout must be >= 0, got {args.timeout}")
    try:
        problem = read_iopddl(args.problem)
    except (OSError, ProblemFormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    if not args.quiet:
        print(f"read {problem.num_nodes} nodes, {problem.num_edges} edges in {elapsed:.2f}s", flush=True)
    # the file's reading counts against the limit; keep back a little for printing the answer
    budget = max(args.timeout - elapsed - 0.3, 0.0)
    if args.timeout == 0 and not args.quiet:
        print("timeout 0: answering with reductions and one greedy pass only", flush=True)
    try:
        sol = solve(problem, time_limit=budget, seed=args.seed, workers=args.workers, verbose=not args.quiet)
    except InfeasibleError as e:
        print(f"infeasible: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"cost {sol.cost:.17g} feasible {sol.feasible} peak {sol.peak_memory:.17g} "
              f"in {time.perf_counter() - start:.2f}s", flush=True)
    print("[" + ", ".join(str(int(s)) for s in sol.choice) + "]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
