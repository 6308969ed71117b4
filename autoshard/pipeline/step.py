"""``PipelinedStep``: what ``parallelize(..., num_microbatches=k, pipeline=...)`` returns."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import numpy as np

from autoshard.cluster import parse_bytes
from autoshard.driver import PlanRequest, default_cluster
from autoshard.driver import plan as plan_request
from autoshard.errors import InputError
from autoshard.pipeline.accumulate import StepAnalysis, analyze_step, batch_leaf_positions
from autoshard.pipeline.options import PipelineOptions
from autoshard.pipeline.partition import partition
from autoshard.pipeline.plan import PipelinePlan, StagePlan
from autoshard.pipeline.runtime import PipelineExecutable
from autoshard.pipeline.search import plan_stages, residual_bytes, stage_program
from autoshard.pipeline.spmd import SpmdPipelineExecutable, spans_processes
from autoshard.signature import abstract_leaf, check_leaf, output_ties


def _resolve_runtime(runtime: str, mesh) -> str:
    """``PipelineOptions.runtime`` made concrete for ``mesh``: ``"device_put"`` or ``"spmd"``."""
    multi = spans_processes([mesh])
    if runtime == "auto":
        return "spmd" if multi else "device_put"
    if runtime == "device_put" and multi:
        raise InputError(
            "PipelineOptions(runtime='device_put') cannot run on a mesh whose devices belong to several "
            "processes: jax.device_put between device sets of different processes is refused outside TPU. "
            "Fix: PipelineOptions(runtime='spmd') (or 'auto'), which moves activations with ppermute inside "
            "one program.")
    return runtime


@dataclasses.dataclass(frozen=True, eq=False)
class _Entry:
    analysis: StepAnalysis
    executable: PipelineExecutable
    plan: PipelinePlan
    out_tree: Any


class PipelinedStep:
    """A step run with gradient accumulation and, optionally, as a pipeline over sub-meshes.

    Same call interface as :class:`autoshard.Parallelized`; ``plan(...)`` returns a
    :class:`~autoshard.pipeline.PipelinePlan` and ``timeline(...)`` measures a step.
    """


    def __init__(self, fun, *, mesh=None, cluster=None, memory_budget=None, static_argnums=(), donate_argnums=(),
                 plan=None, hints=None, solver_time_limit=10.0, tie_layers="auto", num_microbatches=1,
                 pipeline=None):
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise InputError(f"num_microbatches={num_microbatches!r}; expected a positive int")
        if pipeline is not None and not isinstance(pipeline, PipelineOptions):
            raise InputError(f"pipeline={pipeline!r}; expected autoshard.PipelineOptions(...) or None")
        if plan is not None:
            raise InputError("plan= (a saved Plan) cannot be applied to a microbatched or pipelined step")
        self.fun = fun
        self.mesh = mesh
        self.cluster = cluster
        self.memory_budget = parse_bytes(memory_budget)
        self.static_argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        self.donate_argnums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        self.hints = dict(hints or {})
        self.solver_time_limit = solver_time_limit
        self.tie_layers = tie_layers
        self.num_microbatches = num_microbatches
        self.pipeline = pipeline
        self._cache: dict = {}
        functools.update_wrapper(self, fun)

    # ---- argument handling -------------------------------------------------------------------------
    def _split(self, args):
        n = len(args)
        for i in self.static_argnums:
            if not -n <= i < n:
                raise InputError(
                    f"static_argnums={self.static_argnums} names argument {i}, but {self.fun.__name__} was "
                    f"called with {n} positional arguments. Fix: pass static_argnums within range(0, {n})."
                )
        static = {i % n for i in self.static_argnums}
        dyn = tuple(a for i, a in enumerate(args) if i not in static)
        stat = tuple((i, args[i]) for i in sorted(static))
        dyn_index = [i for i in range(n) if i not in static]
        for i in self.donate_argnums:
            if i % n in static:
                raise InputError(f"argument {i} is both static and donated; donate only array arguments")
        return dyn, stat, dyn_index

    def _key(self, dyn, stat, dyn_index):
        leaves, tree = jax.tree_util.tree_flatten(dyn)
        for path, leaf in jax.tree_util.tree_flatten_with_path(dyn)[0]:
            # path[0] indexes the dynamic arguments; name the caller's positional argument.
            argnum = dyn_index[path[0].idx]
            check_leaf(jax.tree_util.keystr(path[1:]), leaf, argnum, tuple(i for i, _ in stat))
        try:
            hash(stat)
        except TypeError as e:
            raise InputError(f"static arguments must be hashable: {e}") from None
        return (tree, tuple((np.shape(x), str(abstract_leaf(x).dtype)) for x in leaves), stat)

    def _bound(self, stat, n_args, dyn_index):
        def bound(*dyn):
            args = [None] * n_args
            for i, v in stat:
                args[i] = v
            for i, v in zip(dyn_index, dyn, strict=True):
                args[i] = v
            return self.fun(*args)

        return bound

    # ---- planning ----------------------------------------------------------------------------------
    def _get(self, args) -> _Entry:
        from autoshard.signature import has_graph_nodes

        if has_graph_nodes(args):
            raise InputError(
                "a microbatched or pipelined step cannot take flax nnx objects (Module, Optimizer, Rngs) yet: "
                "their in-place update is not carried through the microbatches. Fix: pass their state, "
                "`graphdef, state = nnx.split(model)`, and return the new state (nnx.merge inside the step), "
                "or run without num_microbatches/pipeline.")
        dyn, stat, dyn_index = self._split(args)
        key = self._key(dyn, stat, dyn_index)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache[key] = self._build(dyn, stat, dyn_index, len(args))
        return entry

    def _build(self, dyn, stat, dyn_index, n_args) -> _Entry:
        t0 = time.perf_counter()
        mesh = self.mesh
        if self.pipeline is not None and mesh is None:
            from autoshard.cluster import make_mesh

            mesh = make_mesh((len(jax.devices()),), ("devices",))
        runtime = "device_put" if self.pipeline is None else _resolve_runtime(self.pipeline.runtime, mesh)
        abstract = jax.tree_util.tree_map(abstract_leaf, dyn)
        fun = self._bound(stat, n_args, dyn_index)
        out_shape = jax.eval_shape(fun, *abstract)
        ties = output_ties(abstract, out_shape)
        in_paths = tuple(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0])
        batch_dyn = self._batch_args(abstract, dyn_index, ties)
        positions, batch_size = batch_leaf_positions(abstract, batch_dyn, self.num_microbatches, in_paths)
        n_out = len(jax.tree_util.tree_leaves(out_shape))
        analysis = analyze_step(fun, abstract, batch_positions=positions, batch_size=batch_size,
                                num_microbatches=self.num_microbatches,
                                metric_outputs=[j for j in range(n_out) if j not in ties], in_paths=in_paths)
        capture_s = time.perf_counter() - t0
        if self.pipeline is None:
            part, meshes, plans, pplan = self._single_stage(analysis)
        else:
            cluster = default_cluster(mesh) if self.cluster is None else self.cluster
            # The spmd runtime replicates inside a stage: intra-op plans cannot price its cut.
            opts = self.pipeline if runtime != "spmd" else dataclasses.replace(self.pipeline, stage_cost="estimate")
            part, meshes, plans, pplan = plan_stages(analysis, mesh, cluster, opts, self.memory_budget)
        pplan = dataclasses.replace(pplan, stats={**pplan.stats, "capture_s": capture_s,
                                                  "plan_s": time.perf_counter() - t0, "runtime": runtime})
        schedule = "gpipe" if self.pipeline is None else self.pipeline.schedule
        if runtime == "spmd":
            # Data parallelism inside a stage captures the step again at microbatch / devices-per-stage.
            reanalyze = functools.partial(analyze_step, fun, abstract, batch_positions=positions,
                                          batch_size=batch_size, metric_outputs=analysis.metric_outputs,
                                          in_paths=in_paths)
            exe = SpmdPipelineExecutable(analysis, part, meshes, schedule, reanalyze=reanalyze)
        else:
            exe = PipelineExecutable(analysis, part, meshes, plans, schedule, ties)
        return _Entry(analysis, exe, pplan, analysis.full.out_tree)

    def _batch_args(self, abstract, dyn_index, ties) -> tuple[int, ...]:
        """Dynamic-argument positions holding the batch."""
        opts = self.pipeline
        if opts is not None and opts.batch_argnums is not None:
            wanted = set(opts.batch_argnums)
            return tuple(i for i, orig in enumerate(dyn_index) if orig in wanted)
        tied = set(ties.values())
        out, offset = [], 0
        for i, a in enumerate(abstract):
            n = len(jax.tree_util.tree_leaves(a))
            if n and not any(j in tied for j in range(offset, offset + n)):
                out.append(i)
            offset += n
        return tuple(out)

    def _single_stage(self, analysis: StepAnalysis):
        part = partition(analysis, lambda p: 0, 1)
        prog = stage_program(analysis, part, 0)
        t0 = time.perf_counter()
        if prog.graph.ops:
            plan = plan_request(PlanRequest(prog, mesh=self.mesh, cluster=self.cluster,
                                            memory_budget=self.memory_budget, time_limit=self.solver_time_limit,
                                            tie_layers=self.tie_layers))
            mesh = plan.mesh
        else:
            from autoshard.cluster import make_mesh

            plan, mesh = None, self.mesh or make_mesh((len(jax.devices()),), ("devices",))
        k = analysis.num_microbatches
        t = plan.cost.total_seconds if plan is not None else 0.0
        mem = plan.cost.peak_memory_bytes if plan is not None else 0.0
        stage = StagePlan(0, tuple(int(d.id) for d in mesh.devices.flat), tuple(mesh.devices.shape), (0, 1), plan,
                          t, mem, residual_bytes(analysis, part, 0), 1)
        pplan = PipelinePlan((stage,), "gpipe", k, (), k * t, k * t, 0.0, {"search_s": time.perf_counter() - t0})
        return part, [mesh], [plan], pplan

    # ---- public --------------------------------------------------------------------------------------
    def plan(self, *args) -> PipelinePlan:
        """Plan without running (arguments may be ``jax.ShapeDtypeStruct``s): the pipeline plan."""
        return self._get(args).plan

    def _flat(self, args):
        dyn, _, _ = self._split(args)
        leaves = jax.tree_util.tree_leaves(dyn)
        for x in leaves:
            if isinstance(x, jax.ShapeDtypeStruct):
                raise InputError("cannot run on jax.ShapeDtypeStruct arguments; use .plan() instead")
        return leaves

    def __call__(self, *args):
        entry = self._get(args)
        outs = entry.executable.run(self._flat(args))
        return jax.tree_util.tree_unflatten(entry.out_tree, outs)

    def timeline(self, *args, warmup: int = 1):
        """Run the step ``warmup`` times, then once more recording when each stage ran each microbatch.

        Returns:
          a :class:`~autoshard.pipeline.Timeline` (``.bubble_fraction``, ``.save_png(path)``).
        """
        from autoshard.pipeline.timeline import measure

        entry = self._get(args)
        self._need_device_put(entry, "timeline")
        flat = self._flat(args)
        for _ in range(warmup):
            jax.block_until_ready(entry.executable.run(flat))
        return measure(entry.executable, flat)

    def stage_memory(self, *args) -> list[dict]:
        """Per stage: compiled per-device bytes of one microbatch's forward task, its residual outputs, and
        the schedule's in-flight count (activation memory = residual bytes × in-flight)."""
        from autoshard.pipeline.timeline import stage_memory

        entry = self._get(args)
        self._need_device_put(entry, "stage_memory")
        return stage_memory(entry.executable, self._flat(args))

    @staticmethod
    def _need_device_put(entry: _Entry, what: str):
        if not isinstance(entry.executable, PipelineExecutable):
            raise InputError(f"step.{what}(...) measures the runtime='device_put' tasks one by one; this step runs "
                             "as one SPMD program (runtime='spmd'). Fix: PipelineOptions(runtime='device_put') "
                             "on one host.")
