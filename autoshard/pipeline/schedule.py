"""Pipeline schedules: the order each stage runs its microbatches, and a simulated timeline.

A schedule is, per stage, a list of ``(phase, microbatch)`` with phase ``"F"`` or ``"B"``.

* GPipe: every forward, then every backward. Stage ``s`` keeps ``k`` microbatches' activations.
* 1F1B (PipeDream-flush): ``S - s`` warm-up forwards, then one backward per forward. Stage ``s``
  keeps at most ``min(S - s, k)`` microbatches alive.

The runtime dispatches the events in one global order consistent with every stage's list and
with the data dependencies (``dispatch_order``); async dispatch then overlaps the stages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from autoshard.errors import InputError

Event = tuple  # (phase, stage, microbatch)


def stage_orders(num_stages: int, num_microbatches: int, schedule: str) -> list[list[tuple[str, int]]]:
    """Per stage, the ``(phase, microbatch)`` sequence it runs."""
    S, k = num_stages, num_microbatches
    orders = []
    for s in range(S):
        if schedule == "gpipe":
            orders.append([("F", m) for m in range(k)] + [("B", m) for m in range(k)])
            continue
        warm = min(S - s, k)
        order = [("F", m) for m in range(warm)]
        for m in range(k - warm):
            order += [("B", m), ("F", warm + m)]
        order += [("B", m) for m in range(k - warm, k)]
        orders.append(order)
    return orders


def max_in_flight(order: list[tuple[str, int]]) -> int:
    """The most microbatches whose forward ran and whose backward has not, along ``order``."""
    live = peak = 0
    for phase, _ in order:
        live += 1 if phase == "F" else -1
        peak = max(peak, live)
    return peak


def dispatch_order(orders, deps: Callable[[Event], list[Event]], present: Callable[[Event], bool]) -> list[Event]:
    """One global order: round-robin over stages, each taking its next event once its inputs exist.

    ``present(event)``: whether the stage has that task at all (a stage may have no backward).
    """
    queues = [[(ph, s, m) for ph, m in order if present((ph, s, m))] for s, order in enumerate(orders)]
    done: set = set()
    out = []
    heads = [0] * len(queues)
    while any(h < len(q) for h, q in zip(heads, queues, strict=True)):
        progressed = False
        for s, q in enumerate(queues):
            if heads[s] < len(q) and all(d in done for d in deps(q[heads[s]])):
                done.add(q[heads[s]])
                out.append(q[heads[s]])
                heads[s] += 1
                progressed = True
        if not progressed:
            stuck = [q[h] for h, q in zip(heads, queues, strict=True) if h < len(q)]
            raise InputError(f"internal: the pipeline schedule deadlocks at {stuck}")
    return out


@dataclasses.dataclass(frozen=True)
class SimulatedTimeline:
    """Start and end of every event, from per-stage durations (seconds)."""

    events: tuple  # (phase, stage, microbatch, start, end)
    makespan: float

    @property
    def bubble_fraction(self) -> float:
        stages = {e[1] for e in self.events}
        busy = sum(e[4] - e[3] for e in self.events)
        return 0.0 if not self.makespan else 1.0 - busy / (len(stages) * self.makespan)


def simulate(orders, fwd_time, bwd_time, deps: Callable[[Event], list[Event]], transfer=None) -> SimulatedTimeline:
    """List-schedule each stage's order (:func:`autoshard.perf.simulate`): an event starts when its stage is
    free and its inputs exist. ``transfer[s]``: seconds to move one microbatch's activation from stage ``s`` to
    ``s + 1`` (and its cotangent back), on a link stream of its own per boundary and direction; None: free."""
    from autoshard.perf.schedule import Task
    from autoshard.perf.schedule import simulate as list_schedule

    tasks: list = []
    index: dict = {}
    heads = [0] * len(orders)
    events = []
    while any(h < len(o) for h, o in zip(heads, orders, strict=True)):
        progressed = False
        for s, order in enumerate(orders):
            if heads[s] >= len(order):
                continue
            ph, m = order[heads[s]]
            ev = (ph, s, m)
            ds = deps(ev)
            if not all(d in index for d in ds):
                continue
            need = []
            for d in ds:
                t_x = _crossing(transfer, d, ev)
                if t_x:  # the activation (cotangent) crosses the boundary between d's stage and ev's
                    key = ("X", d, s)
                    if key not in index:
                        index[key] = len(tasks)
                        tasks.append(Task(f"X{d}", f"link{min(d[1], s)}{'f' if d[1] < s else 'b'}", t_x,
                                          (index[d],)))
                    need.append(index[key])
                else:
                    need.append(index[d])
            index[ev] = len(tasks)
            tasks.append(Task(f"{ph}{s}.{m}", f"stage{s}", fwd_time[s] if ph == "F" else bwd_time[s], tuple(need)))
            events.append(ev)
            heads[s] += 1
            progressed = True
        if not progressed:
            raise InputError("internal: the simulated schedule deadlocks")
    sched = list_schedule(tasks)
    out = tuple((ph, s, m, sched.start[index[(ph, s, m)]], sched.finish[index[(ph, s, m)]]) for ph, s, m in events)
    return SimulatedTimeline(out, max((e[4] for e in out), default=0.0))


def _crossing(transfer, dep: Event, ev: Event) -> float:
    """Seconds to move ``dep``'s result to ``ev``'s stage (0 on the same stage or without transfers)."""
    if transfer is None or dep[1] == ev[1]:
        return 0.0
    return float(transfer[min(dep[1], ev[1])])


def chain_deps(num_stages: int):
    """The dependencies of a plain layer chain: F(s) after F(s-1); B(s) after B(s+1) and F(s)."""
    S = num_stages

    def deps(ev):
        ph, s, m = ev
        if ph == "F":
            return [("F", s - 1, m)] if s > 0 else []
        return [("B", s + 1, m)] if s < S - 1 else [("F", s, m)]

    return deps
