"""One core searched by several worker processes that share their incumbents.

Each worker is a fresh interpreter (``python -m autoshard.solver.worker``), not a
fork: the planner's process has JAX loaded, and forking after JAX starts its
threads is unsafe; a fresh interpreter also never re-runs the caller's main
script, as ``multiprocessing``'s spawn would. The solver is JAX-free, so a
worker imports only numpy, scipy and pytoulbar2.

Parent and workers talk over the workers' stdin and stdout in length-prefixed
pickles. The parent sends the job (the core, its memory rows, the deadline, a
seed and the worker's index, which picks its share of the searches) and later
any cheaper incumbent another worker found; a worker sends each feasible
incumbent it finds, then its answer. A worker may also offer a start for
forest rounds (an answer near the memory limit, ``PipeSharing.offer``),
which the parent passes to the other workers. At the deadline the
parent stops waiting, ends the workers still running and answers with the
cheapest incumbent it holds, so a worker that overruns cannot make the solve late.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from autoshard.solver.bp import trivial_bound
from autoshard.solver.local import CoreState, FlatCosts
from autoshard.solver.memory import MemoryRows
from autoshard.solver.reduce import Reduction

# Below this many seconds left, starting interpreters costs more than a second search gains (GPT-1.3B on
# (2, 4) under a memory budget at 5 s: 2.09x the best with two workers, 1.03x in one process).
MIN_PARALLEL_SECONDS = 8.0
# Seconds before the deadline the workers stop, for their answers to reach the parent.
# (a MILP window can run past its time limit while HiGHS builds its model).
_GRACE = 0.3
_GRACE_SHARE = 0.03
_GRACE_MAX = 3.0
_HEADER = struct.Struct("<Q")
# Seconds a worker waits for the rest of a message it has begun to read.
_REST_WAIT = 0.5


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not on Linux
        return max(os.cpu_count() or 1, 1)


def encode(message) -> bytes:
    """One framed message."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


class Frames:
    """Splits a byte stream into the messages of :func:`encode`."""

    def __init__(self):
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list:
        self.buffer += data
        out = []
        while len(self.buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self.buffer)
            if len(self.buffer) < _HEADER.size + size:
                break
            out.append(pickle.loads(bytes(self.buffer[_HEADER.size : _HEADER.size + size])))
            del self.buffer[: _HEADER.size + size]
        return out


class PipeSharing:
    """A worker's side of the incumbent exchange: posts to ``out``, polls ``inbox`` without blocking."""

    def __init__(self, inbox_fd: int, out, frames: Frames, pending: list | None = None):
        self.inbox_fd = inbox_fd
        self.out = out
        self.frames = frames
        self.pending = list(pending or ())  # messages already read from the inbox
        self.best = np.inf
        self.closed = False
        self.start: tuple[np.ndarray, float] | None = None  # the newest start offered, not yet taken

    def post(self, state: CoreState) -> None:
        cost = state.total_cost()
        if state.overflow() <= 0 and cost < self.best:
            self.best = cost
            self.out.write(encode(("incumbent", cost, state.choice.astype(np.int32))))
            self.out.flush()

    def offer(self, state: CoreState, mult: float) -> None:
        """Offer the other workers ``state`` (over the limit, near it) as a start for forest rounds whose
        multipliers start at ``mult``."""
        self.out.write(encode(("start", mult, state.choice.astype(np.int32))))
        self.out.flush()

    def poll(self) -> np.ndarray | None:
        newest = None
        for kind, cost, choice in self._read():
            if kind == "incumbent" and cost < self.best:
                newest, self.best = choice.astype(np.int64), cost
        return newest

    def take_start(self) -> tuple[np.ndarray, float] | None:
        """The newest start another worker offered and none took yet (older ones are dropped), or None. Cheaper
        incumbents read on the way wait for :meth:`poll`."""
        self.pending = self._read()
        start, self.start = self.start, None
        return start

    def _read(self) -> list:
        """The messages pending and those in the inbox now, but starts: the newest of those goes to ``start``."""
        msgs, self.pending = self.pending, []
        # an incumbent is larger than a pipe's buffer (contest A: 93 KB), so the parent's writer may
        # still be sending the rest of one: wait a little for a message begun (else it came a poll late)
        while not self.closed and select.select([self.inbox_fd], [], [], _REST_WAIT if self.frames.buffer else 0)[0]:
            data = os.read(self.inbox_fd, 1 << 20)
            if not data:
                self.closed = True
                break
            msgs += self.frames.feed(data)
        for kind, mult, choice in msgs:
            if kind == "start":
                self.start = (choice.astype(np.int64), mult)
        return [m for m in msgs if m[0] != "start"]


def search_in_workers(
    red: Reduction, rows: MemoryRows | None, deadline: float, *, seed: int, count: int, stats: dict,
    fallback: CoreState | None = None, verbose: bool = False, log=None,
) -> dict:
    """Search the core in ``count`` worker processes; the fields of the solver's core answer.

    ``fallback`` (sent to the workers as their first incumbent when it is feasible)
    is the answer when no worker has a cheaper one by the deadline.

    Worker ``k`` runs with seed ``seed + k`` and variant ``k``. The answer is the
    cheapest any worker found; its ``stats`` go into ``stats``, with ``workers``
    and each worker's final cost (``worker_costs``).
    """
    hard = FlatCosts(red)  # forbidden pairs infinite (the workers' costs price them)
    best_cost, best_choice, answers, errors = np.inf, None, {}, []
    first = None
    if fallback is not None:
        best_cost, best_choice = fallback.total_cost(), fallback.choice.copy()
        if np.isfinite(hard.cost(best_choice)) and (rows is None or fallback.overflow() <= 0):
            stats.setdefault("first_fit_at", time.perf_counter())
            first = ("incumbent", best_cost, best_choice.astype(np.int32))
    workers = _start_workers(red, rows, deadline, seed=seed, count=count, verbose=verbose, first=first)
    try:
        while len(answers) + len(errors) < count and time.perf_counter() < deadline:
            live = {w[0].stdout.fileno(): k for k, w in enumerate(workers) if k not in answers}
            ready = select.select(list(live), [], [], max(min(deadline - time.perf_counter(), 0.5), 0))[0]
            for fd in ready:
                k = live[fd]
                data = os.read(fd, 1 << 20)
                if not data:
                    answers.setdefault(k, None)
                    continue
                for msg in workers[k][2].feed(data):
                    if msg[0] == "incumbent" and msg[1] < best_cost:
                        best_cost, best_choice = msg[1], msg[2].astype(np.int64)
                        if np.isfinite(hard.cost(best_choice)):
                            stats.setdefault("first_fit_at", time.perf_counter())
                        _relay(msg, workers, k, answers)
                    elif msg[0] == "start":  # a start for the other workers' forest rounds
                        _relay(msg, workers, k, answers)
                    elif msg[0] == "answer":
                        answers[k] = msg[1]
                    elif msg[0] == "error":
                        errors.append(msg[1])
                        if log is not None:
                            log(f"worker {k} failed: {msg[1]}")
                        answers[k] = None
            if any(a is not None and a["optimal"] for a in answers.values()):
                break
    finally:
        for proc, box, _ in workers:
            box.put(None)
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    done = [a for a in answers.values() if a is not None]
    return _combined_answer(done, errors, best_cost=best_cost, best_choice=best_choice, count=count, stats=stats,
                            floor=trivial_bound(red),
                            log=log)


def _relay(msg, workers: list, sender: int, answers: dict) -> None:
    """Send ``msg`` from worker ``sender`` to every other worker that has not answered yet."""
    for j, (_, box, _) in enumerate(workers):
        if j != sender and j not in answers:
            box.put(encode(msg))


def _start_workers(red: Reduction, rows: MemoryRows | None, deadline: float, *, seed: int, count: int,
                   verbose: bool, first: tuple | None = None) -> list:
    """Start ``count`` worker interpreters and send each its job: ``(process, outbox, frames)`` per worker.

    ``first``, an incumbent message, travels inside the job: sent after it, it could arrive after the
    worker's first look for one (which then redid the parent's work)."""
    job_red = dataclasses.replace(red, records=())  # the workers never expand a choice
    # deadlines travel as seconds on the shared monotonic clock; the workers stop a little
    # early so that their answers arrive by the deadline
    rest = deadline - time.perf_counter()
    end = time.monotonic() + rest - min(_GRACE + _GRACE_SHARE * rest, _GRACE_MAX)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    workers = []
    for k in range(count):
        proc = subprocess.Popen([sys.executable, "-m", "autoshard.solver.worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env)
        outbox: queue.Queue = queue.Queue()
        threading.Thread(target=_writer, args=(proc, outbox), daemon=True).start()
        outbox.put(encode({"red": job_red, "rows": rows, "end": end, "seed": seed + k, "variant": k,
                           "verbose": verbose, "first": first}))
        workers.append((proc, outbox, Frames()))
    return workers


def _combined_answer(done: list, errors: list, *, best_cost: float, best_choice, count: int, stats: dict, floor: float,
                     log) -> dict:
    """The core answer from the workers' answers (``done``) and the cheapest incumbent any posted.

    ``floor`` is the core's trivial lower bound, the answer's bound when no worker's answer has a finite one."""
    if any(a["infeasible"] for a in done):
        return {"choice": done[0]["choice"], "cost": np.inf, "optimal": False, "bound": np.nan, "infeasible": True}
    bounds = [a["bound"] for a in done if np.isfinite(a["bound"])]
    # with no worker's answer in time (a loaded machine), the cheapest entries' sum still bounds the cost
    bound = max(bounds, default=floor)
    win = min(done, key=lambda a: a["cost"]) if done else None
    if win is not None and win["cost"] <= best_cost:
        best_cost, best_choice = win["cost"], win["choice"]
        stats.update({k: v for k, v in win["stats"].items() if k != "first_fit_at"})  # another process's clock
    if best_choice is None:
        detail = errors[0] if errors else "no worker answered before the deadline"
        raise RuntimeError(f"every solver worker failed: {detail}. Fix: pass workers=1 to search in this process")
    if not done and log is not None:
        log("workers: none answered by the deadline; the best incumbent they posted stands")
    stats.setdefault("stop", "time_limit")
    stats.update(workers=count, worker_costs=[a["cost"] for a in done])
    optimal = any(a["optimal"] and a["cost"] <= best_cost for a in done)
    if log is not None:
        log(f"workers: {len(done)} of {count} answered, best {best_cost:.6g}")
    return {"choice": np.asarray(best_choice, dtype=np.int64), "cost": float(best_cost), "optimal": optimal,
            "bound": bound, "infeasible": False}


def _writer(proc: subprocess.Popen, outbox: queue.Queue) -> None:
    """Feeds one worker's stdin from ``outbox`` until a None (or the worker has gone)."""
    try:
        while (data := outbox.get()) is not None:
            proc.stdin.write(data)
            proc.stdin.flush()
        proc.stdin.close()
    except (BrokenPipeError, OSError, ValueError):
        pass
