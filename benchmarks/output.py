"""What every benchmark ends with: its table printed, and its rows written as JSON with where they were measured."""

from __future__ import annotations

import json
import os
import subprocess


def finish(rows: list[dict], table, out: str | None) -> None:
    """Print ``table(rows)``; write ``out`` (if given) with the rows, jax's version, the commit, the CPU count
    and the load average (other work on the machine slows a timing row)."""
    import jax

    print()
    print(table(rows))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump({"jax": jax.__version__, "commit": commit, "cpus": os.cpu_count(),
                       "load_average": os.getloadavg(), "rows": rows}, f, indent=1)
        print(f"wrote {out}")
