"""``PipelinedStep``: what ``parallelize(..., num_microbatches=k, pipeline=...)`` returns.

It takes the same :class:`~autoshard.Options` and the same calls as :class:`autoshard.Parallelized`
(static and donated arguments by position or name, keyword arguments, flax nnx objects updated in
place): the shared :class:`~autoshard.signature.StepSignature` binds each call, and the step runs as
the bound call's pure function. Options that these runtimes cannot honour are refused
(``Options.check_runtime("pipelined")``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Any

import jax

from autoshard.capture import capture_graph
from autoshard.cluster import device_ids, mesh_shape, require_devices
from autoshard.distributed import StepWatchdog
from autoshard.driver import PlanRequest, default_cluster
from autoshard.driver import plan as plan_request
from autoshard.errors import InputError, MeshError
from autoshard.options import Options
from autoshard.pipeline.accumulate import StepAnalysis, analyze_step, batch_leaf_positions
from autoshard.pipeline.partition import partition
from autoshard.pipeline.plan import PipelinePlan, StagePlan
from autoshard.pipeline.runtime import PipelineExecutable
from autoshard.pipeline.search import (
    plan_stages,
    plan_stages_everywhere,
    residual_bytes,
    stage_program,
    stage_seconds,
    state_ties,
)
from autoshard.pipeline.spmd import SpmdPipelineExecutable, spans_processes
from autoshard.report import planning_progress
from autoshard.signature import BoundCall, StepCache, StepSignature, output_ties


def _resolve_runtime(pipeline, mesh) -> str:
    """The runtime of ``pipeline`` (:class:`PipelineOptions`, or None: microbatches on one mesh, which may
    be None) on ``mesh``: ``"device_put"`` or ``"spmd"``; ``"none"`` on an ``AbstractMesh`` (planned, each
    stage with its intra-op plan, but not runnable)."""
    from autoshard.cluster import is_abstract

    if is_abstract(mesh):
        return "none"
    if pipeline is None:
        return "device_put"
    runtime = pipeline.runtime
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


@dataclasses.dataclass(frozen=True)
class PlannedOnly:
    """The "executable" of a step planned on an ``AbstractMesh``: the plan is a prediction, with no
    devices to run it on (running raises the :class:`~autoshard.MeshError` that says how to)."""

    mesh: Any

    def run(self, leaves):
        del leaves
        require_devices(self.mesh, "run")


@dataclasses.dataclass(frozen=True, eq=False)
class PipelinedProgram:
    """What one argument signature of a pipelined step runs.

    Attributes:
      analysis: the :class:`~autoshard.pipeline.accumulate.StepAnalysis` of the step.
      executable: a :class:`~autoshard.pipeline.runtime.PipelineExecutable` (``runtime="device_put"``)
        or a :class:`~autoshard.pipeline.spmd.SpmdPipelineExecutable`.
      plan: the :class:`~autoshard.pipeline.PipelinePlan`.
      out_tree: the pure step's output treedef.
      process_local: the :class:`~autoshard.distributed.ProcessLocalArgs` of a multi-process step whose
        processes pass their own rows of the batch, else None.
    """

    analysis: StepAnalysis
    executable: Any
    plan: PipelinePlan
    out_tree: Any
    process_local: Any = None

    def run(self, leaves):
        """One step on the flat argument leaves; the outputs in the step's structure."""
        if self.process_local is not None:
            leaves = self.process_local.make_global(leaves, self.executable.in_shardings)
        return jax.tree_util.tree_unflatten(self.out_tree, self.executable.run(leaves))


class PipelinedStep:
    """A step run with gradient accumulation and, optionally, as a pipeline over sub-meshes.

    Same call interface and options as :class:`autoshard.Parallelized`; ``plan(...)`` returns a
    :class:`~autoshard.pipeline.PipelinePlan` and ``timeline(...)`` measures a step. Donated
    arguments are a permission, as in ``jax.jit``: the tasks reuse their own accumulators, not the
    caller's buffers. ``solver_time_limit`` bounds the plan of a microbatched step and each chosen pipeline
    stage's plan (or ``PipelineOptions.solver_time_limit`` when larger); each stage candidate of the search
    has ``PipelineOptions.solver_time_limit``.
    """

    def __init__(self, fun, options: Options | None = None, **kwargs):
        options = Options(**kwargs) if options is None else options.replace(**kwargs) if kwargs else options
        options.check_runtime("pipelined")
        wanted = options.pipeline.batch_argnums if options.pipeline is not None else None
        if wanted is not None and options.batch_argnums is not None and wanted != options.batch_argnums:
            raise InputError(f"batch_argnums={options.batch_argnums} and PipelineOptions(batch_argnums={wanted}) "
                             "name different batch arguments. Fix: give one of them.")
        self.fun = fun
        self.options = options
        self.num_microbatches = options.num_microbatches
        self.pipeline = options.pipeline
        self.signature = StepSignature.from_options(fun, options)
        self.cache = StepCache(self.signature, self.build)
        self._watchdog = StepWatchdog.for_step(options.step_timeout, fun)
        functools.update_wrapper(self, fun)

    # ---- planning ----------------------------------------------------------------------------------
    def bind(self, args: tuple, kwargs: dict | None = None) -> BoundCall:
        """One call's arguments, bound by the step's signature."""
        return self.signature.bind(tuple(args), dict(kwargs or {}))

    def batch_size(self, call: BoundCall) -> int:
        """The batch size of ``call`` (the leading axis of its batch arguments).

        Raises:
          InputError: the call has no batch to split, or its batch leaves disagree.
        """
        abstract = call.abstract()
        out_shape = jax.eval_shape(call.pure_function(), *abstract)
        batch = self._batch_args(call, abstract, out_shape)
        return batch_leaf_positions(abstract, batch, 1, call.in_paths(abstract))[1]

    def build(self, call: BoundCall, abstract=None) -> PipelinedProgram:
        """Analyse, partition, plan and compile the step for ``call``'s argument shapes (not cached)."""
        from autoshard.precision import with_precision

        o, t0 = self.options, time.perf_counter()
        mesh = self._mesh()
        runtime = _resolve_runtime(self.pipeline, mesh)
        if jax.process_count() > 1:
            o.check_runtime("multi-process pipelined")
        abstract = call.abstract() if abstract is None else abstract
        local = self._process_local(call, mesh, runtime, abstract)
        if local is not None:   # each process passes its rows of the batch: plan the global one
            abstract = local.global_abstract(abstract)
        fun = with_precision(call.pure_function(), o.precision, mesh)
        in_paths = call.in_paths(abstract)
        full = capture_graph(fun, abstract, in_paths=in_paths)  # the analysis takes it: one trace, not two
        out_shape = full.out_shape()
        ties = output_ties(abstract, out_shape)
        batch = self._batch_args(call, abstract, out_shape)
        positions, batch_size = batch_leaf_positions(abstract, batch, self.num_microbatches, in_paths)
        n_out = len(jax.tree_util.tree_leaves(out_shape))
        analysis = analyze_step(fun, abstract, num_microbatches=self.num_microbatches, batch_positions=positions,
                                batch_size=batch_size, metric_outputs=[j for j in range(n_out) if j not in ties],
                                in_paths=in_paths, full=full, ties=ties)
        capture_s = time.perf_counter() - t0
        progress = planning_progress(o.progress)
        if self.pipeline is None:
            part, meshes, plans, pplan = self._single_stage(analysis, progress)
        else:
            cluster = default_cluster(mesh) if o.cluster is None else o.cluster
            part, meshes, plans, pplan = self._stages(analysis, mesh, cluster, runtime, progress)
        pplan = dataclasses.replace(pplan, stats={**pplan.stats, "capture_s": capture_s,
                                                  "plan_s": time.perf_counter() - t0, "runtime": runtime})
        schedule = "gpipe" if self.pipeline is None else self.pipeline.schedule
        if runtime == "none":
            exe = PlannedOnly(mesh)
        elif runtime == "spmd":
            exe = SpmdPipelineExecutable(analysis, part, meshes, plans, schedule=schedule, out_ties=ties,
                                         process_local=() if local is None else local.leaves,
                                         reduce_gradients=self._reduce_gradients())
            pplan = _with_spmd_state(pplan, exe, self._memory_limit(meshes[0]))
        else:
            exe = PipelineExecutable(analysis, part, meshes, plans, schedule=schedule, out_ties=ties,
                                     reduce_gradients=self._reduce_gradients())
        if o.verify:
            pplan = _verified(pplan, exe, abstract)
        return PipelinedProgram(analysis, exe, pplan, analysis.full.out_tree, local)

    def _process_local(self, call: BoundCall, mesh, runtime: str, abstract):
        """The :class:`~autoshard.distributed.ProcessLocalArgs` of a multi-process call whose
        ``batch_argnums`` name process-local slices (runtime='spmd' only), else None."""
        if jax.process_count() == 1 or self.options.batch_argnums is None:
            return None
        if runtime != "spmd":
            raise InputError(
                f"batch_argnums={self.options.batch_argnums} names process-local batch slices, which only "
                f"runtime='spmd' assembles (this step runs {runtime!r}). Fix: PipelineOptions(runtime='spmd') "
                "(or 'auto'), or pass the global batch on every process and name it with "
                "PipelineOptions(batch_argnums=...).")
        from autoshard.distributed import ProcessLocalArgs

        return ProcessLocalArgs.for_call(mesh, self.options.batch_argnums, call, abstract)

    def _mesh(self):
        from autoshard.cluster import make_mesh, resolve_mesh

        mesh = self.options.mesh if self.options.mesh is None else resolve_mesh(self.options.mesh)
        if self.pipeline is not None and mesh is None:
            mesh = make_mesh((len(jax.devices()),), ("devices",))
        return mesh

    def _batch_args(self, call: BoundCall, abstract, out_shape) -> tuple[int, ...]:
        """Dynamic-argument positions holding the batch: the ones named (``batch_argnums`` here or in
        :class:`PipelineOptions`), else every argument with leaves that the step does not return updated."""
        wanted = self.pipeline.batch_argnums if self.pipeline is not None else None
        wanted = self.options.batch_argnums if wanted is None else wanted
        if wanted is not None:  # by position, or by name when passed by keyword (as jax.jit's argnums)
            names = self.signature.positional_names
            wanted = {*wanted, *(names[i] for i in wanted if 0 <= i < len(names))}
            return tuple(i for i, label in enumerate(call.labels) if label in wanted)
        state = call.state_arguments(abstract, out_shape)
        return tuple(i for i, a in enumerate(abstract) if i not in state and jax.tree_util.tree_leaves(a))

    def _stages(self, analysis: StepAnalysis, mesh, cluster, runtime: str, progress):
        """The stage search, with every stage recomputing its forward in its backward when ``remat=True``, or
        with ``remat="auto"`` when no pipeline fits the memory limit without it (and one does, or comes
        closer, with it). The warnings of the search that is kept are the ones shown."""
        o = self.options

        def search(recompute: bool):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = plan_stages_everywhere(
                    lambda: plan_stages(analysis, mesh, cluster, self.pipeline, o.memory_budget, progress=progress,
                                        tie_layers=o.tie_layers, profile=o.profile, uniform=runtime == "spmd",
                                        recompute=recompute,
                                        stage_time_limit=max(o.solver_time_limit, self.pipeline.solver_time_limit)),
                    analysis, mesh, self.pipeline)
            return got, caught

        def shown(result):
            got, caught = result
            for w in caught:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            return got

        if o.remat is True:
            return shown(search(True))
        try:
            first = search(False)
        except MeshError:
            if o.remat is False:
                raise
            return shown(search(True))
        limit = self._memory_limit(mesh)
        peak = max(st.memory_bytes for st in first[0][3].stages)
        if o.remat is False or not limit or peak <= limit:
            return shown(first)
        again = search(True)
        return shown(again if max(st.memory_bytes for st in again[0][3].stages) < peak else first)

    def _reduce_gradients(self) -> str:
        return "step" if self.pipeline is None else self.pipeline.reduce_gradients

    def _memory_limit(self, mesh) -> float | None:
        """Bytes per device the stages are planned within: ``memory_budget``, else the cluster's memory."""
        o = self.options
        if o.memory_budget is not None:
            return o.memory_budget
        return getattr(default_cluster(mesh) if o.cluster is None else o.cluster, "memory", None)

    def _single_stage(self, analysis: StepAnalysis, progress):
        o = self.options
        part = partition(analysis, lambda p: 0, 1)
        prog = stage_program(analysis, part, 0, reduce_gradients=self._reduce_gradients(), held=True)
        t0 = time.perf_counter()
        if prog.graph.ops:
            plan = plan_request(PlanRequest(prog, mesh=self._mesh(), cluster=o.cluster, ties=state_ties(prog, analysis),
                                            memory_budget=o.memory_budget, time_limit=o.solver_time_limit,
                                            tie_layers=o.tie_layers, progress=progress, profile=o.profile))
            mesh = plan.mesh
        else:
            from autoshard.cluster import make_mesh

            plan, mesh = None, self._mesh() or make_mesh((len(jax.devices()),), ("devices",))
        k = analysis.num_microbatches
        t = stage_seconds(plan, analysis)
        mem = plan.cost.peak_memory_bytes if plan is not None else 0.0
        stage = StagePlan(0, device_ids(mesh), mesh_shape(mesh), (0, 1), plan,
                          t, mem, residual_bytes(analysis, part, 0), 1)
        pplan = PipelinePlan((stage,), "gpipe", k, (), k * t, k * t, 0.0, {"search_s": time.perf_counter() - t0})
        return part, [mesh], [plan], pplan

    # ---- public --------------------------------------------------------------------------------------
    def prepared(self, *args, **kwargs) -> PipelinedProgram:
        """What a call with these arguments runs (built once per argument signature, cached)."""
        return self.cache.lookup(args, kwargs)[0]

    def plan(self, *args, **kwargs) -> PipelinePlan:
        """Plan without running (arguments may be ``jax.ShapeDtypeStruct``s): the pipeline plan."""
        return self.prepared(*args, **kwargs).plan

    def lower(self, *args, **kwargs):
        """Refused: a microbatched or pipelined step is several programs, not one to lower."""
        raise InputError("a microbatched or pipelined step runs several programs (one per task), not one to lower. "
                         "Fix: inspect step.plan(...), or step.timeline(...) to measure the tasks.")

    def __call__(self, *args, **kwargs):
        entry, call = self.cache.lookup(args, kwargs)
        outs = entry.run(call.leaves())
        if self._watchdog is not None:
            self._watchdog.watch(jax.tree_util.tree_leaves(outs))
        return call.finish(outs)

    def timeline(self, *args, warmup: int = 1, **kwargs):
        """Run the step ``warmup`` times, then once more recording when each stage ran each microbatch.

        Returns:
          a :class:`~autoshard.pipeline.Timeline` (``.bubble_fraction``, ``.save_png(path)``).
        """
        from autoshard.pipeline.timeline import measure

        entry, call = self.cache.lookup(args, kwargs)
        _need_device_put(entry, "timeline")
        flat = call.leaves()
        for _ in range(warmup):
            jax.block_until_ready(entry.executable.run(flat))
        return measure(entry.executable, flat)

    def stage_memory(self, *args, **kwargs) -> list[dict]:
        """Per stage: compiled per-device bytes of one microbatch's forward task, its residual outputs, and
        the schedule's in-flight count (activation memory = residual bytes × in-flight)."""
        from autoshard.pipeline.timeline import stage_memory

        entry, call = self.cache.lookup(args, kwargs)
        _need_device_put(entry, "stage_memory")
        return stage_memory(entry.executable, call.leaves())


def _verified(pplan: PipelinePlan, exe, abstract) -> PipelinePlan:
    """``pplan`` with ``stats["verify"]`` (``verify=True``): every program of the step compiled, each stage's
    compiled peak (its largest task, plus the microbatches it keeps in flight) against its predicted memory."""
    from autoshard.compile import sharded_structs, verify_report
    from autoshard.hlo import memory_stats

    if isinstance(exe, PlannedOnly):
        require_devices(exe.mesh, "verify the plan (verify=True)")
    t0 = time.perf_counter()
    if isinstance(exe, PipelineExecutable):
        peaks = [{} for _ in pplan.stages]
        for key, compiled in exe.compiled_tasks().items():
            peaks[key[1]][key] = memory_stats(compiled)["peak"]
        seconds = time.perf_counter() - t0
        stages = [{k: v for k, v in verify_report(st.compiled_peak(peak), st.memory_bytes, seconds).items()
                   if k != "compile_s"} for peak, st in zip(peaks, pplan.stages, strict=True)]
        report = {"compile_s": seconds, "stages": stages,
                  "memory_ratio": max(r["memory_ratio"] for r in stages)}
    else:   # one SPMD program: every device holds one stage's values and its share of the state
        peak = memory_stats(exe.lower(sharded_structs(abstract, exe.in_shardings)).compile())["peak"]
        report = verify_report(peak, max(st.memory_bytes for st in pplan.stages), time.perf_counter() - t0)
    return dataclasses.replace(pplan, stats={**pplan.stats, "verify": report})


def _with_spmd_state(pplan: PipelinePlan, exe: SpmdPipelineExecutable, limit) -> PipelinePlan:
    """``pplan`` with ``stats["spmd_state_bytes"]``: what the spmd runtime's train state takes per device between
    steps (split over ``"stage"`` where a dimension allows, :meth:`SpmdPipelineExecutable.state_bytes`), which
    the stage plans (one stage's weights each) do not count; a warning says when that alone is over
    ``limit``."""
    state = exe.state_bytes()
    if limit and state > float(limit):
        warnings.warn(
            f"runtime='spmd' holds {state / 2**30:.3g} GiB of train state per device between steps, more than the "
            f"{float(limit) / 2**30:.3g} GiB memory limit the stage plans were made for (they count only their "
            "own stage's weights; the state is split over the stages only along dimensions the stage count "
            "divides). Fix: more devices, fewer stages, or a larger memory_budget.", stacklevel=3)
    return dataclasses.replace(pplan, stats={**pplan.stats, "spmd_state_bytes": state})


def _need_device_put(entry: PipelinedProgram, what: str):
    if isinstance(entry.executable, PlannedOnly):
        require_devices(entry.executable.mesh, f"measure step.{what}(...)")
    if not isinstance(entry.executable, PipelineExecutable):
        raise InputError(f"step.{what}(...) measures the runtime='device_put' tasks one by one; this step runs "
                         "as one SPMD program (runtime='spmd'). Fix: PipelineOptions(runtime='device_put') "
                         "on one host.")
