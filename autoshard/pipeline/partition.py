"""Split an analysed step into tasks: per stage a forward, a backward and update waves.

``partition(analysis, fwd_stage, S)`` gives every top-level op of the step one or more tasks:

* ``("F", s)``: stage ``s``'s forward, once per microbatch. Forward ops are the
  per-example ops the returned loss/metrics depend on; ``fwd_stage(pos)`` cuts them.
* ``("B", s)``: stage ``s``'s backward, once per microbatch. A backward op runs on the lowest
  stage among its staged inputs: the stage whose forward made its residuals (mirroring the cut),
  so cotangents only ever flow to lower stages.
* ``("R", s, w)``: the update, once per step. An update op runs where its largest input lives
  (a parameter's gradient: its owner stage); ``w`` (the wave) grows whenever a value crosses
  stages, so the update tasks form a DAG even with a global gradient norm.

Ops that depend only on the state (and literals) are *replicable*: every task that needs one
recomputes it, so no cross-stage dependency is made for a cast or a broadcast constant. With one
stage, all per-example ops form one task ``("F", 0)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from autoshard.capture import Op
from autoshard.errors import InputError
from autoshard.pipeline.accumulate import StepAnalysis


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
    """A straight-line piece of the step that runs as one jitted program on one stage.

    Attributes:
      key: ``("F", s)``, ``("B", s)`` or ``("R", s, wave)``.
      ops: the ops, in program order.
      invars: values it reads from outside (other tasks, step inputs, constants).
      outvars: values other tasks or the step's outputs read.
      frontier: the outvars that are per-microbatch partial sums (accumulated).
    """

    key: tuple
    ops: tuple[Op, ...]
    invars: tuple[int, ...]
    outvars: tuple[int, ...]
    frontier: tuple[int, ...] = ()

    @property
    def stage(self) -> int:
        return self.key[1]

    @property
    def phase(self) -> str:
        return self.key[0]


@dataclasses.dataclass(frozen=True, eq=False)
class Partition:
    """Tasks of a step and where each value comes from."""

    num_stages: int
    tasks: dict                      # key -> Task
    producer_task: dict              # value id -> key of the (non-replicated) task producing it
    forward: frozenset               # top-level positions of forward ops
    op_tasks: tuple                  # position -> tuple of task keys

    @property
    def frontier_values(self) -> frozenset:
        return frozenset(v for t in self.tasks.values() for v in t.frontier)

    def micro_tasks(self, stage: int) -> tuple[Task, ...]:
        return tuple(self.tasks[k] for k in (("F", stage), ("B", stage)) if k in self.tasks)

    def update_tasks(self) -> list[Task]:
        return sorted((t for t in self.tasks.values() if t.phase == "R"), key=lambda t: (t.key[2], t.key[1]))

    def internal_values(self, stage: int, outputs) -> frozenset:
        """Values ``stage``'s forward task makes that only its backward task reads (the residuals kept from one
        to the other; ``outputs``: the step's output values, which are read elsewhere too)."""
        micro = self.micro_tasks(stage)
        if len(micro) != 2:
            return frozenset()
        f, b = micro
        read_elsewhere = {v for k, t in self.tasks.items() if k not in (f.key, b.key) for v in t.invars}
        outs = set(outputs)
        return frozenset(v for v in f.outvars if v in b.invars and v not in read_elsewhere and v not in outs)

    def task_deps(self, event) -> list:
        """The ``(phase, stage, microbatch)`` events whose outputs the task event ``event`` reads
        (the same microbatch; update tasks and the task itself excluded)."""
        ph, s, m = event
        out = set()
        for v in self.tasks[(ph, s)].invars:
            key = self.producer_task.get(v)
            if key is not None and key[0] != "R" and key != (ph, s):
                out.add((key[0], key[1], m))
        return sorted(out)


def forward_positions(analysis: StepAnalysis) -> frozenset:
    """Per-example (non-replicable) ops that a returned metric depends on: the forward pass."""
    full = analysis.full
    wanted = {full.graph.outvars[j] for j in analysis.metric_outputs if isinstance(full.graph.outvars[j], int)}
    forward = set()
    for p in range(len(full.graph.ops) - 1, -1, -1):
        op = full.graph.ops[p]
        if not any(v in wanted for v in op.outputs):
            continue
        if analysis.region[p] == "M":
            forward.add(p)
        wanted.update(x for x in op.inputs if isinstance(x, int))
    return frozenset(p for p in forward if _staged(analysis, p))


def _staged(analysis: StepAnalysis, p: int) -> bool:
    """Runs in exactly one task: an update op, or a per-example op that reads batch data."""
    op = analysis.full.graph.ops[p]
    if analysis.region[p] == "R":
        return True
    return analysis.region[p] == "M" and any(isinstance(x, int) and x in analysis.dependent for x in op.inputs)


def _nbytes(aval) -> float:
    return float(np.prod(getattr(aval, "shape", ()), dtype=float) * aval.dtype.itemsize)


def partition(analysis: StepAnalysis, fwd_stage: Callable[[int], int], num_stages: int) -> Partition:
    """Assign every op to tasks (see the module docstring)."""
    full = analysis.full
    S = num_stages
    forward = forward_positions(analysis) if S > 1 else frozenset()
    if S > 1 and not forward:
        raise InputError(
            "cannot find the forward pass of the step: it returns nothing that depends on the batch except "
            "the new state. Pipelining runs each stage's forward before its backward, and autoshard tells them "
            "apart by what the returned loss depends on. Fix: return the loss, e.g. `return new_state, "
            "{'loss': loss}`.")
    pos_of = {op.index: p for p, op in enumerate(full.graph.ops)}

    def users(v):
        return [pos_of[i] for i, _ in full.uses.get(v, ()) if i in pos_of]

    op_task = _staged_tasks(analysis, forward, fwd_stage, S)
    task_sets = _with_replicated(analysis, op_task, users)
    ops = full.graph.ops
    members: dict[tuple, list[int]] = {}  # ops per task, in program order
    for p in range(len(ops)):
        for key in task_sets.get(p, ()):
            members.setdefault(key, []).append(p)
    producer_task = {v: op_task[p] for p in op_task for v in ops[p].outputs}
    tasks = {key: _task(analysis, key, positions, op_task=op_task, task_sets=task_sets, users=users,
                        producer_task=producer_task) for key, positions in members.items()}
    return Partition(S, tasks, producer_task, forward, tuple(tuple(sorted(task_sets.get(p, ()))) for p in range(len(ops))))


def _batch_owners(analysis: StepAnalysis, forward, fwd_stage) -> dict[int, int]:
    """A batch leaf belongs to the last forward stage that reads it: the backward of `x @ w0` (dw0 = x^T ct)
    then runs on w0's stage, while a mask read by every stage does not pull backward ops down to stage 0."""
    full = analysis.full
    batch_owner: dict[int, int] = {}
    batch_in = {full.graph.invars[p] for p in analysis.batch_inputs}
    for p in sorted(forward):
        for x in full.graph.ops[p].inputs:
            if isinstance(x, int) and x in batch_in:
                batch_owner[x] = max(batch_owner.get(x, 0), fwd_stage(p))
    return batch_owner


def _staged_tasks(analysis: StepAnalysis, forward, fwd_stage, S: int) -> dict[int, tuple]:
    """The one task of each staged op (position -> task key), in program order."""
    full = analysis.full
    batch_owner = _batch_owners(analysis, forward, fwd_stage)
    stage_of: dict[int, int] = {}      # value -> stage (non-replicated producers only)
    wave_of: dict[int, int] = {}
    op_task: dict[int, tuple] = {}
    for p, op in enumerate(full.graph.ops):
        if not _staged(analysis, p):
            continue
        staged_in = [x for x in op.inputs if isinstance(x, int) and x in stage_of]
        if analysis.region[p] == "M":
            if S == 1:
                s, phase = 0, "F"
            elif p in forward:
                s, phase = fwd_stage(p), "F"
                if staged_in and min(stage_of[x] for x in staged_in) > s:
                    raise InputError(f"internal: forward op {p} reads a later stage")
            else:
                phase = "B"
                owners = [batch_owner[x] for x in op.inputs if isinstance(x, int) and x in batch_owner]
                s = min([stage_of[x] for x in staged_in] + owners, default=S - 1)
            key = (phase, s)
        else:  # R
            if staged_in:
                biggest = max(_nbytes(full.avals[x]) for x in staged_in)
                s = min(stage_of[x] for x in staged_in if _nbytes(full.avals[x]) == biggest)
            else:
                s = 0
            w = max((wave_of.get(x, 0) + (stage_of[x] != s) for x in staged_in), default=0)
            key = ("R", s, w)
        op_task[p] = key
        for v in op.outputs:
            stage_of[v] = key[1]
            if key[0] == "R":
                wave_of[v] = key[2]
    return op_task


_OUT_KEY = ("R", 0, 0)
"""The task that returns the step's replicable outputs."""


def _with_replicated(analysis: StepAnalysis, op_task: dict, users) -> dict[int, set]:
    """Every op's tasks: a staged op's one, and each replicable op in every task that reads it (a
    reverse pass over consumers)."""
    full = analysis.full
    outputs = {v for v in full.graph.outvars if isinstance(v, int)}
    task_sets: dict[int, set] = {p: {k} for p, k in op_task.items()}
    for p in range(len(full.graph.ops) - 1, -1, -1):
        if p in op_task:
            continue
        keys = set()
        for v in full.graph.ops[p].outputs:
            for q in users(v):
                keys |= task_sets.get(q, set())
            if v in outputs:
                keys.add(_OUT_KEY)
        task_sets[p] = keys
    return task_sets


def _task(analysis: StepAnalysis, key, positions, *, op_task, task_sets, users, producer_task) -> Task:
    """The task ``key`` of the ops at ``positions``: what it reads from outside, what others read from it.
    Records in ``producer_task`` the replicable step outputs it returns."""
    full = analysis.full
    ops, frontier = full.graph.ops, set(analysis.frontier)
    outputs = {v for v in full.graph.outvars if isinstance(v, int)}
    produced = {v for p in positions for v in ops[p].outputs}
    task_ops = tuple(analysis.op(p) for p in positions)
    invars = []
    for op in task_ops:
        for x in op.inputs:
            if isinstance(x, int) and x not in produced and x not in invars:
                invars.append(x)
    outvars = []
    for p in positions:
        if p not in op_task:
            if key == _OUT_KEY:  # replicable values the step returns
                outvars += [v for v in ops[p].outputs if v in outputs]
                producer_task.update({v: key for v in ops[p].outputs if v in outputs})
            continue
        for v in ops[p].outputs:
            used_elsewhere = any(task_sets.get(q, set()) - {key} for q in users(v))
            if used_elsewhere or v in outputs:
                outvars.append(v)
    return Task(key, task_ops, tuple(invars), tuple(outvars), tuple(v for v in outvars if v in frontier))


def handoff_layouts(part: Partition, stage: int, plan, outputs) -> dict:
    """The layout each residual of ``stage`` passes from its forward task to its backward task in, where it is
    not the layout its producer writes (``plan.value_specs``).

    A plan prices the reshard of a value into a layout once for all of its readers: in one program XLA merges
    the identical collectives, and the memory estimate keeps the one resharded buffer from its first reader to
    its last. A stage runs as two programs, so a residual that both tasks read gathered would be gathered twice:
    once in the forward, again in the backward from the layout the forward handed over (a GPT block on a
    ``(data, model)`` sub-mesh re-gathered its layer-norm outputs, 0.6 GB per microbatch at 6.7B). Such a
    residual is handed over in the layout the forward already made, when every backward reader's layout is a
    slice of it (so the backward reads it without a collective). ``outputs``: the step's output values.
    """
    if plan is None:
        return {}
    internal = part.internal_values(stage, outputs)
    if not internal:
        return {}
    f, b = part.micro_tasks(stage)

    def read_as(task):
        layouts: dict = {}
        for op in task.ops:
            for i, x in enumerate(op.inputs):
                if isinstance(x, int) and x in internal:
                    layouts.setdefault(x, set()).add(plan.operand_specs.get((op.index, i), plan.value_specs.get(x)))
        return layouts

    forward, backward = read_as(f), read_as(b)
    out = {}
    for v, wanted in backward.items():
        made = plan.value_specs.get(v)
        if made is None or None in wanted:
            continue
        for spec in forward.get(v, set()) & wanted:
            if spec != made and all(_slices_to(spec, w) for w in wanted):
                out[v] = spec
    return out


def _slices_to(src, dst) -> bool:
    """Whether every device's block of layout ``dst`` is a slice of its block of ``src`` (each dimension of
    ``dst`` splits over the axes of ``src``'s, then maybe more)."""
    return len(src.dims) == len(dst.dims) and all(d[:len(s)] == s for s, d in zip(src.dims, dst.dims, strict=True))
