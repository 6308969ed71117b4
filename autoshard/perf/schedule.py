"""A list schedule of compute and communication: how much communication a step leaves exposed.

Tasks run on *streams*: ``"compute"`` and one stream per link tier (``"nvlink"``, ``"ib"``, ``"ici"``,
``"dcn"``), or one stream per pipeline stage. A stream runs its tasks one at a time in the order given
(program order, as XLA's schedule issues them); a task starts when its stream is free and every task it
depends on has finished. So an asynchronous collective runs beside whatever compute does not need its
result, and a collective whose result the next op reads waits in the open. With ``overlap=False`` (a
backend without async collectives, XLA:CPU) every task runs on one stream and the step is the plain sum.

Overlap can only shorten a step: a task's start never comes later than in the serial order, because the
streams are independent and each keeps the serial order of its own tasks (tests/test_perf.py).

Example:
    >>> from autoshard.perf.schedule import Task, simulate
    >>> tasks = [Task("matmul", "compute", 3.0), Task("all-gather", "nvlink", 2.0),
    ...          Task("next matmul", "compute", 3.0, deps=(1,))]
    >>> simulate(tasks).makespan, simulate(tasks, overlap=False).makespan
    (6.0, 8.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["COMPUTE", "Schedule", "Task", "simulate"]

COMPUTE = "compute"


@dataclasses.dataclass(frozen=True, slots=True)
class Task:
    """One kernel or collective.

    Attributes:
      name: a label for reports.
      stream: ``"compute"``, a tier name, or any stream label.
      seconds: how long it runs.
      deps: indices (into the task list) of the tasks that must finish before it starts.
    """

    name: str
    stream: str
    seconds: float
    deps: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
    """The result of :func:`simulate`.

    Attributes:
      makespan: seconds from the first start to the last finish.
      busy: stream -> seconds of work on it.
      start, finish: per task.
      exposed: seconds of the makespan during which the compute stream is idle (communication, or waits
        on it, not hidden behind compute); 0 when there is no compute stream.
    """

    makespan: float
    busy: dict
    start: tuple[float, ...]
    finish: tuple[float, ...]

    @property
    def exposed(self) -> float:
        return max(0.0, self.makespan - self.busy.get(COMPUTE, 0.0)) if COMPUTE in self.busy else 0.0


def simulate(tasks: Sequence[Task], *, overlap: bool = True) -> Schedule:
    """List-schedule ``tasks`` (see the module docstring); ``overlap=False`` runs them all on one stream.

    Raises:
      ValueError: a task depends on a later task (the list must be in a dependency-respecting order).
    """
    free: dict[str, float] = {}
    busy: dict[str, float] = {}
    start = [0.0] * len(tasks)
    finish = [0.0] * len(tasks)
    for i, t in enumerate(tasks):
        ready = 0.0
        for d in t.deps:
            if d >= i:
                raise ValueError(f"task {i} ({t.name}) depends on task {d}, which comes later; "
                                 "give the tasks in a dependency-respecting order")
            ready = max(ready, finish[d])
        stream = t.stream if overlap else COMPUTE
        s = max(ready, free.get(stream, 0.0))
        start[i], finish[i] = s, s + t.seconds
        free[stream] = finish[i]
        busy[t.stream] = busy.get(t.stream, 0.0) + t.seconds
    makespan = max(finish, default=0.0)
    return Schedule(makespan, busy, tuple(start), tuple(finish))
