"""What every benchmark ends with: its table printed, and its rows written as JSON with where they were measured."""

from __future__ import annotations

import argparse
import json
import os
import subprocess


def commit() -> str:
    """The checkout's short commit hash, or ``"unknown"`` outside a git checkout (or without git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def finish(rows: list[dict], table, out: str | None) -> None:
    """Print ``table(rows)``; write ``out`` (if given) with the rows, jax's version, the commit, the CPU count
    and the load average (other work on the machine slows a timing row). Each row records the commit it was
    measured at; the rows of an earlier ``out`` that were not run again (``--rows``) are kept."""
    import jax

    print()
    print(table(rows))
    measured_at = commit()
    rows = [{**r, "commit": measured_at} for r in rows]
    if out and os.path.exists(out):
        with open(out) as f:
            earlier = json.load(f)
        ran = {r.get("row") for r in rows}
        kept = [{"commit": earlier.get("commit"), **r} for r in earlier.get("rows", []) if r.get("row") not in ran]
        rows = kept + rows
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump({"jax": jax.__version__, "commit": measured_at, "cpus": os.cpu_count(),
                       "load_average": os.getloadavg(), "rows": rows}, f, indent=1)
        print(f"wrote {out}")


def row_arguments(doc: str, default_out: str, rows) -> argparse.ArgumentParser:
    """A parser with ``--out`` (the JSON path) and ``--rows`` (comma-separated names of ``rows``, default all)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=default_out)
    ap.add_argument("--rows", default=",".join(r.name for r in rows), help="comma-separated row names")
    return ap


def chosen_rows(ap: argparse.ArgumentParser, names: str, rows) -> list:
    """The rows ``names`` picks, in ``rows`` order; a parser error names the unknown ones."""
    wanted = names.split(",")
    unknown = sorted(set(wanted) - {r.name for r in rows})
    if unknown:
        ap.error(f"unknown rows {unknown}; expected some of {[r.name for r in rows]}")
    return [r for r in rows if r.name in wanted]
