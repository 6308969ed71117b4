"""A solver worker process: ``python -m autoshard.solver.worker`` (started by :mod:`parallel`).

Reads one job from stdin, searches its core with :func:`search_core`, writes its
incumbents and answer to stdout (see :mod:`autoshard.solver.parallel`). Progress
lines, when asked for, go to stderr.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from autoshard.solver.parallel import Frames, PipeSharing, encode
from autoshard.solver.solve import search_core


def main() -> int:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, not into the message stream
    inbox = sys.stdin.fileno()
    frames = Frames()
    msgs: list = []
    while not msgs:
        data = os.read(inbox, 1 << 20)
        if not data:
            return 1
        msgs = frames.feed(data)
    job = msgs.pop(0)
    if job.get("first") is not None:  # the parent's first incumbent, for the search's first look
        msgs.insert(0, job["first"])
    k = job["variant"]
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        if job["verbose"]:
            print(f"[worker {k} {time.perf_counter() - t0:7.2f}s] {msg}", file=sys.stderr, flush=True)

    deadline = time.perf_counter() + (job["end"] - time.monotonic())
    share = PipeSharing(inbox, out, frames, pending=msgs)
    stats: dict = {}
    try:
        ans = search_core(job["red"], job["rows"], deadline, seed=job["seed"], log=log, stats=stats, variant=k,
                          share=share)
    except Exception:  # noqa: BLE001 - reported to the parent, which decides
        out.write(encode(("error", traceback.format_exc())))
        out.flush()
        return 1
    out.write(encode(("answer", {"choice": ans.choice, "cost": ans.cost, "optimal": ans.optimal,
                                 "bound": ans.bound, "infeasible": ans.infeasible, "stats": stats})))
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
