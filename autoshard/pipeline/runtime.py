"""Run a partitioned step: one jitted program per task on its stage's sub-mesh.

Values move between sub-meshes with ``jax.device_put`` onto the receiving stage's sharding (its
intra-op plan's layout for that value, else replicated). A forward task returns the residuals its
backward needs, so nothing is recomputed; one its forward already resharded for a reader is returned in
that layout where the backward reads it so too (:func:`~autoshard.pipeline.partition.handoff_layouts`).
Frontier values (weight gradients, the summed loss) are accumulated inside the task that makes them: the
task takes the running sum and returns it plus its partial, donating the old buffer. A gradient whose plan all-reduces a contraction's partial
sums is accumulated unreduced and all-reduced once per step, before the update
(:mod:`autoshard.pipeline.deferred`; ``PipelineOptions(reduce_gradients=...)``). Everything is dispatched from one Python loop in the
schedule's order; jax's async dispatch overlaps the stages.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.capture import OpGraph, graph_ops
from autoshard.lower import MICROBATCH, Evaluator
from autoshard.pipeline.deferred import partial_sums, reduce_partials
from autoshard.pipeline.partition import Partition, Task, handoff_layouts
from autoshard.pipeline.schedule import dispatch_order, stage_orders
from autoshard.spec import MeshInfo


@dataclasses.dataclass
class _Store:
    """Where each value currently lives: value -> {stage: array}."""

    arrays: dict = dataclasses.field(default_factory=dict)

    def get(self, v, stage):
        return self.arrays.get(v, {}).get(stage)

    def any(self, v):
        d = self.arrays.get(v)
        return next(iter(d.values())) if d else None

    def put(self, v, stage, x):
        self.arrays.setdefault(v, {})[stage] = x


@dataclasses.dataclass
class _Run:
    """One step's values: the flat arguments, per-step and per-microbatch stores, the running sums."""

    flat: list
    step: _Store
    micro: list
    acc: dict


class PipelineExecutable:
    """Jitted tasks plus the dispatch loop for one argument structure.

    ``reduce_gradients``: ``"step"`` keeps the stages' partial gradient sums unreduced over the microbatches
    (:mod:`autoshard.pipeline.deferred`): those it all-reduces, and those it reduce-scatters that its plan holds
    unreduced (``Plan.deferred``)."""

    def __init__(self, analysis, part: Partition, meshes, plans, *, schedule: str, out_ties: dict,
                 reduce_gradients: str = "step"):
        self.analysis = analysis
        self.part = part
        self.meshes = list(meshes)
        self.plans = list(plans)
        self.k = analysis.num_microbatches
        self.schedule = schedule
        S = part.num_stages
        self.orders = stage_orders(S, self.k, schedule)
        self._devsets = [frozenset(m.devices.flat) for m in self.meshes]
        self._evals = []
        self.partials = []   # per stage: value -> PartialSum (gradients reduced once per step)
        for s, mesh in enumerate(self.meshes):
            plan = self.plans[s]
            vs = {} if plan is None else plan.value_specs
            os_ = {} if plan is None else plan.operand_specs
            partials = (partial_sums(part.micro_tasks(s), plan, analysis.avals)
                        if reduce_gradients == "step" and self.k > 1 else {})
            self.partials.append(partials)
            self._evals.append(Evaluator(analysis.micro, vs, os_, mesh, MeshInfo.from_mesh(mesh),
                                         partials={ps.op_index: ps for ps in partials.values()},
                                         draws=analysis.draws))
        full = analysis.full
        # residuals a backward task reads in the layout its forward already resharded them to
        self.handoff = [handoff_layouts(part, s, plan, full.graph.outvars) for s, plan in enumerate(self.plans)]
        self.batch_values = {full.graph.invars[p]: p for p in analysis.batch_inputs}
        self.invar_pos = {v: i for i, v in enumerate(full.graph.invars)}
        # Outputs that are the next state keep the layout their input has on that stage.
        self._out_spec = {}
        for j, i in out_ties.items():
            v_out, v_in = full.graph.outvars[j], full.graph.invars[i]
            if isinstance(v_out, int):
                self._out_spec[v_out] = v_in
        self._jits: dict = {}
        # tasks that draw random bits per example (they take the microbatch index, last)
        self.drawing = frozenset(key for key, t in part.tasks.items() if t.phase != "R" and any(
            op.outputs and op.outputs[0] in analysis.draws for op in graph_ops(OpGraph((), t.ops, ()))))
        present = set(part.tasks)
        self.deps = part.task_deps
        self.events = dispatch_order(self.orders, part.task_deps, lambda ev: (ev[0], ev[1]) in present)

    # ---- jitted tasks --------------------------------------------------------------------------------
    def _task_fn(self, task: Task, accumulate: bool):
        ev = self._evals[task.stage]
        graph = OpGraph(task.invars, task.ops, task.outvars)
        n = len(task.invars)
        frontier = {v: i for i, v in enumerate(task.frontier)}
        handoff = self.handoff[task.stage]
        out_spec = {v: handoff[v] for v in task.outvars if v in handoff}
        if task.phase == "R":
            for v in task.outvars:
                src = self._out_spec.get(v)
                if src is not None and ev.value_specs.get(src) is not None:
                    out_spec[v] = ev.value_specs[src]

        def fn(*args):
            env = {v: ev.constrain(x, handoff.get(v, ev.value_specs.get(v))) for v, x in zip(task.invars, args[:n],
                                                                                            strict=True)}
            if task.key in self.drawing:   # the microbatch index comes last
                *args, env[MICROBATCH] = args
            outs = ev.run(graph, env)
            if accumulate:
                accs = args[n:]
                outs = [o + accs[frontier[v]] if v in frontier else o for v, o in zip(task.outvars, outs,
                                                                                        strict=True)]
            return [ev.constrain(o, out_spec.get(v)) for v, o in zip(task.outvars, outs, strict=True)]

        donate = tuple(range(n, n + len(task.frontier))) if accumulate else ()
        return jax.jit(fn, donate_argnums=donate)

    def jitted(self, key, accumulate=False):
        hit = self._jits.get((key, accumulate))
        if hit is None:
            hit = self._jits[(key, accumulate)] = self._task_fn(self.part.tasks[key], accumulate)
        return hit

    def compiled_tasks(self, keys=None) -> dict:
        """XLA's executable of each task (``keys``; None: all), as one step runs it: a task that makes
        frontier values in the variant that adds them to the running sums."""
        out = {}
        for key in self.part.tasks if keys is None else keys:
            if key[0] == "R" and key[2:] == ("reduce",):
                s = key[1]
                out[key] = self._reducer(s).lower(*(self._acc_struct(v, s) for v in self.partials[s])).compile()
                continue
            task = self.part.tasks[key]
            avals = self.analysis.avals
            specs = [jax.ShapeDtypeStruct(avals[v].shape, avals[v].dtype, sharding=self.sharding(v, task.stage))
                     for v in task.invars] + [self._acc_struct(v, task.stage) for v in task.frontier]
            if task.key in self.drawing:
                specs.append(jax.ShapeDtypeStruct((), np.int32))
            out[key] = self.jitted(key, bool(task.frontier)).lower(*specs).compile()
        if keys is None:
            out.update(self.compiled_tasks([("R", s, "reduce") for s, p in enumerate(self.partials) if p]))
        return out

    def microbatch_keys(self, stage: int) -> list:
        """The programs of one microbatch of ``stage`` as its plan prices it: its forward and backward tasks, and the
        once-per-step reduction of the gradients they leave unreduced."""
        keys = [key for key in (("F", stage), ("B", stage)) if key in self.part.tasks]
        return keys + ([("R", stage, "reduce")] if self.partials[stage] else [])

    def _acc_struct(self, v, stage) -> jax.ShapeDtypeStruct:
        """The running sum of frontier value ``v`` on ``stage``: as the value, or its partial sums stacked."""
        aval, ps = self.analysis.avals[v], self.partials[stage].get(v)
        if ps is None:
            return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=self.sharding(v, stage))
        mesh = self.meshes[stage]
        info = MeshInfo.from_mesh(mesh)
        return jax.ShapeDtypeStruct(ps.acc_shape(aval.shape, info), aval.dtype,
                                    sharding=NamedSharding(mesh, ps.acc_spec.to_partition_spec(info)))

    def _reducer(self, stage):
        """One program per stage: its unreduced running sums, each summed into its planned layout (the step's one
        all-reduce of those gradients)."""
        hit = self._jits.get((stage, "reduce"))
        if hit is None:
            partials = list(self.partials[stage].values())
            ev = self._evals[stage]
            hit = self._jits[(stage, "reduce")] = jax.jit(lambda *accs: reduce_partials(ev, partials, accs),
                                                          donate_argnums=tuple(range(len(partials))))
        return hit

    def _zeros(self, key):
        hit = self._jits.get((key, "zeros"))
        if hit is None:
            task = self.part.tasks[key]
            structs = [self._acc_struct(v, task.stage) for v in task.frontier]
            hit = self._jits[(key, "zeros")] = jax.jit(
                lambda: [jnp.zeros(a.shape, a.dtype) for a in structs], out_shardings=[a.sharding for a in structs])
        return hit

    # ---- placement ----------------------------------------------------------------------------------
    def sharding(self, v, stage) -> NamedSharding:
        spec = self.handoff[stage].get(v)
        if spec is None and self.plans[stage] is not None:
            spec = self.plans[stage].value_specs.get(v)
        mesh = self.meshes[stage]
        if spec is None or len(spec.dims) != np.ndim(self.analysis.avals[v]):
            return NamedSharding(mesh, PartitionSpec())
        return NamedSharding(mesh, spec.to_partition_spec(MeshInfo.from_mesh(mesh)))

    def _place(self, x, v, stage):
        target = self.sharding(v, stage)
        if isinstance(x, jax.Array) and x.sharding.device_set == self._devsets[stage]:
            # Same devices: keep it unless the layout differs (a new layout would recompile the task).
            if x.sharding.is_equivalent_to(target, x.ndim):
                return x
        return jax.device_put(x, target)

    def _fetch(self, v, stage, m, run: _Run):
        """Value ``v`` on ``stage`` for microbatch ``m`` (None: once per step), placed there once."""
        flat, step, micro, acc = run.flat, run.step, run.micro, run.acc
        if m is not None:
            if v in self.batch_values:
                x = micro[m].get(v, stage)
                if x is None:
                    b = self.analysis.avals[v].shape[0]
                    x = self._place(flat[self.batch_values[v]][m * b:(m + 1) * b], v, stage)
                    micro[m].put(v, stage, x)
                return x
            x = micro[m].get(v, stage)
            if x is not None:
                return x
            src = micro[m].any(v)
            if src is not None:
                x = self._place(src, v, stage)
                micro[m].put(v, stage, x)
                return x
        x = step.get(v, stage)
        if x is not None:
            return x
        src = step.any(v)
        if src is None:
            if v in acc:
                src = acc[v]
            elif v in self.invar_pos:
                src = flat[self.invar_pos[v]]
            else:
                consts = self.analysis.micro.consts if m is not None else self.analysis.full.consts
                src = consts[v]
        x = self._place(src, v, stage)
        step.put(v, stage, x)
        return x

    # ---- one step -----------------------------------------------------------------------------------
    def run(self, flat, trace: list | None = None):
        """Run the step on flat arguments; ``trace`` collects ``(event, t_dispatch, outputs)``."""
        run = _Run(flat, _Store(), [_Store() for _ in range(self.k)], {})
        step, micro, acc = run.step, run.micro, run.acc
        per_mb_out: dict = {}
        full = self.analysis.full
        batched_outputs = {v for v in full.graph.outvars if isinstance(v, int) and v in self.analysis.batched}

        def launch(key, m):
            task = self.part.tasks[key]
            s = task.stage
            ins = [self._fetch(v, s, m, run) for v in task.invars]
            have_acc = bool(task.frontier)
            if have_acc and not all(v in acc for v in task.frontier):
                # One compiled variant per task: the first microbatch adds its partials to zeros.
                acc.update(zip(task.frontier, self._zeros(key)(), strict=True))
            args = ins + ([acc[v] for v in task.frontier] if have_acc else [])
            if task.key in self.drawing:
                args.append(np.int32(m))
            t0 = time.perf_counter()
            outs = self.jitted(key, have_acc)(*args)
            if trace is not None:
                trace.append(((key[0], s, m) if m is not None else key, t0, outs, args))
            frontier = set(task.frontier)
            for v, o in zip(task.outvars, outs, strict=True):
                if v in frontier:
                    acc[v] = o
                elif m is not None:
                    micro[m].put(v, s, o)
                    if v in batched_outputs:
                        per_mb_out.setdefault(v, [None] * self.k)[m] = o
                else:
                    step.put(v, s, o)

        for ph, s, m in self.events:
            launch((ph, s), m)
        for s, partials in enumerate(self.partials):
            if partials:
                acc.update(zip(partials, self._reducer(s)(*(acc[v] for v in partials)), strict=True))
        for task in self.part.update_tasks():
            launch(task.key, None)
        outs = []
        for v in full.graph.outvars:
            if not isinstance(v, int):
                outs.append(jnp.asarray(v.value))
            elif v in per_mb_out:
                outs.append(jnp.concatenate(per_mb_out[v], axis=self.analysis.batch_axis[v]))
            elif v in acc:
                outs.append(acc[v])
            elif step.any(v) is not None:
                outs.append(step.any(v))
            elif v in self.invar_pos:
                outs.append(flat[self.invar_pos[v]])
            else:
                outs.append(full.consts[v])
        return outs
