"""``parallelize``: the user-facing decorator, its cache, and ``plan``/``lower``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import time
from typing import Any

import jax

from autoshard.distributed import StepWatchdog
from autoshard.errors import InfeasibleError, InputError, MeshError, PlanError
from autoshard.options import Options
from autoshard.report import planning_progress
from autoshard.roles import with_roles
from autoshard.signature import BoundCall, StepCache, StepSignature, abstract_leaf, output_ties
from autoshard.spec import MeshInfo


def _mesh_context(mesh):
    """Trace and run under autoshard's Auto-axis mesh: the caller may be inside ``jax.set_mesh`` of an
    Explicit mesh, under which ``with_sharding_constraint`` (the plan's pins) is an assertion."""
    from autoshard.cluster import is_device_count

    if mesh is None or is_device_count(mesh):  # no mesh yet, or a device count: the planner picks the shape
        return contextlib.nullcontext()
    if isinstance(mesh, jax.sharding.AbstractMesh):  # planning only: no devices to set
        return jax.sharding.use_abstract_mesh(mesh)
    return jax.set_mesh(mesh)


@dataclasses.dataclass(frozen=True, eq=False)
class CompiledStep:
    """What one call signature of a single-program step runs: its plan and the jitted program.

    Attributes:
      plan: the :class:`~autoshard.Plan`.
      jitted: the ``jax.jit`` of the sharded flat program.
      in_shardings: one ``NamedSharding`` per flat argument leaf.
      out_tree: the outputs' treedef.
      process_local: a :class:`~autoshard.distributed.ProcessLocalArgs` in multi-process runs, else None.
    """

    plan: Any
    jitted: Any
    in_shardings: tuple
    out_tree: Any
    process_local: Any = None


@dataclasses.dataclass(frozen=True, eq=False)
class AccumulatedStep:
    """A step that only fits its memory budget split into microbatches (see :mod:`autoshard.pipeline.auto`).

    Attributes:
      step: the :class:`~autoshard.pipeline.PipelinedStep` over the bound call's pure function.
      program: its :class:`~autoshard.pipeline.PipelinedProgram` for these argument shapes.
    """

    step: Any
    program: Any

    @property
    def plan(self):
        """The :class:`~autoshard.pipeline.PipelinePlan`; ``plan.num_microbatches`` is k."""
        return self.program.plan


# jax's messages for explicit-sharding annotations traced under autoshard's Auto-axis mesh (or none).
_NEEDS_A_MESH = ("Using PartitionSpec when you are not under a mesh context", "requires a non-empty mesh in context")
_ANNOTATION_ERRORS = (*_NEEDS_A_MESH, "cannot contain axis names that are of type Auto",
                      "Reshard should only be used with out_shardings")


def _program_mesh(program):
    """The mesh that a ``shard_map`` in the program fixes (its specs name that mesh's axes), or None.

    Raises:
      MeshError: two shard_maps run on different meshes.
    """
    meshes = {}
    for op in program.ops:
        m = op.params.get("mesh") if op.name == "shard_map" else None
        if isinstance(m, jax.sharding.Mesh):
            meshes.setdefault((m.axis_names, m.devices.shape, tuple(d.id for d in m.devices.flat)), (m, op))
    if len(meshes) > 1:
        where = "; ".join(f"{dict(zip(m.axis_names, m.devices.shape, strict=True))} at {op.source()}"
                          for m, op in meshes.values())
        raise MeshError(f"the step's shard_maps run on different meshes ({where}), and one plan runs on one mesh. "
                        "Fix: build every shard_map on the same mesh, and pass it as parallelize(mesh=...).")
    return next(iter(meshes.values()))[0] if meshes else None


def _capture(fun, abstract, in_paths, mesh, *, leaves=(), explicit=None):
    """``capture_graph`` under the planning mesh, with jax's tracing errors for code that autoshard cannot
    plan (pmap collectives, explicit-sharding annotations) turned into an :class:`InputError` that names
    the user's line and the fix.

    With no mesh yet (``mesh=None``), the step is traced without a mesh first (a ``shard_map`` in it
    brings its own), and again under one with the planner's axis names if it needs a mesh in context
    (``with_sharding_constraint(x, PartitionSpec("data"))``: a pin by name, on whichever mesh is chosen).

    Code written for Explicit mesh axes (``explicit``: the mesh :func:`autoshard.explicit.user_mesh` found, in
    context or the one the arguments ``leaves`` are placed on) is traced under that mesh, its arguments typed
    as placed, and read as the user's intent (:mod:`autoshard.explicit`)."""
    from autoshard.capture import capture_graph, exception_location
    from autoshard.cluster import is_device_count, make_mesh
    from autoshard.explicit import typed_arguments

    try:
        if explicit is not None:
            with jax.sharding.use_abstract_mesh(explicit):
                return capture_graph(fun, typed_arguments(abstract, leaves, explicit), in_paths=in_paths,
                                     explicit=True)
        try:
            with _mesh_context(mesh):
                return capture_graph(fun, abstract, in_paths=in_paths)
        except (ValueError, RuntimeError) as e:
            if (mesh is not None and not is_device_count(mesh)) or not any(m in str(e) for m in _NEEDS_A_MESH):
                raise
        with _mesh_context(make_mesh((len(jax.devices()), 1), ("data", "model"))):
            return capture_graph(fun, abstract, in_paths=in_paths)
    except NameError as e:
        if "unbound axis name" not in str(e):
            raise
        raise InputError(
            f"the step uses a collective over a named axis at {exception_location(e)} ({e}). That is pmap-style "
            "code: lax.psum, lax.pmean, lax.all_gather, lax.axis_index and the like need an axis bound by "
            "pmap or shard_map, and autoshard traces the step as one program over the global batch.\n"
            "Fix: drop the collective (the step already sees the whole batch, so jnp.mean over it is the "
            "global mean), or put the code that needs it inside jax.shard_map over the planning mesh.") from None
    except (ValueError, RuntimeError) as e:
        if not any(m in str(e) for m in _ANNOTATION_ERRORS):
            raise
        raise InputError(
            f"the step annotates a sharding at {exception_location(e)} that autoshard cannot trace ({e}). "
            "jax.sharding.reshard and out_sharding= need Explicit mesh axes, and autoshard plans over Auto "
            "axes (the layout of every value is what it chooses).\nFix: remove the annotation, or write it "
            "as jax.lax.with_sharding_constraint(x, PartitionSpec(...)), which autoshard keeps as a pin, and "
            "pin argument layouts with parallelize(..., hints={path_regex: PartitionSpec(...)}).") from None


def _candidate_axis_names(explicit) -> tuple[str, str]:
    """The axis names of the meshes ``mesh=None`` tries: those of ``explicit``, the 2-D Explicit mesh the step's
    code was written for, when it has one (its annotations name them: :mod:`autoshard.explicit`), else
    ("data", "model")."""
    if explicit is not None and len(explicit.axis_names) == 2:
        return tuple(explicit.axis_names)
    return ("data", "model")


class Parallelized:
    """A step function that plans, shards and runs itself as one program. Made by :func:`parallelize`.

    ``Parallelized(fun, options)`` takes an :class:`~autoshard.Options` (or its fields as keywords).
    Microbatched and pipelined steps are :class:`~autoshard.pipeline.PipelinedStep` objects, which
    :func:`parallelize` makes for ``num_microbatches > 1`` or ``pipeline=``.
    """

    def __init__(self, fun, options: Options | None = None, **kwargs):
        options = _options(options, kwargs)
        if options.runtime != "single":
            raise InputError("Parallelized runs one program, and these options ask for microbatches or a pipeline. "
                             "Fix: autoshard.parallelize(..., num_microbatches=..., pipeline=...), which makes a "
                             "PipelinedStep.")
        self.fun = fun
        self.options = options
        self.signature = StepSignature.from_options(fun, options)
        self.static_argnums = tuple(sorted(self.signature.static_argnums))
        self.donate_argnums = tuple(sorted(self.signature.donate_argnums))
        self.cache = StepCache(self.signature, self._build)
        self._watchdog = StepWatchdog.for_step(options.step_timeout, fun)
        functools.update_wrapper(self, fun)

    @property
    def memory_budget(self) -> float | None:
        """Bytes per device (``Options.memory_budget``)."""
        return self.options.memory_budget

    # ---- planning ----------------------------------------------------------------------------------
    def _build(self, call: BoundCall, abstract) -> CompiledStep | AccumulatedStep:
        from autoshard.cluster import is_abstract, is_device_count, make_mesh, resolve_mesh
        from autoshard.explicit import user_mesh
        from autoshard.precision import with_precision

        o = self.options
        timings = {}
        t0 = time.perf_counter()
        mesh, hints, local = resolve_mesh(o.mesh), o.hints, None
        chosen = mesh is None or is_device_count(mesh)  # the planner chooses the mesh's shape
        if jax.process_count() > 1:  # each process passes its slice of the batch: plan the global one
            from autoshard import distributed

            if is_device_count(mesh):
                raise MeshError(f"mesh={mesh} (a device count) plans on AbstractMeshes, which a multi-process job "
                                "cannot run. Fix: mesh=None (all processes' devices), or a concrete mesh.")
            if mesh is None:
                mesh = make_mesh((jax.process_count(), jax.local_device_count()), ("data", "model"))
            local = distributed.ProcessLocalArgs.for_call(mesh, o.batch_argnums, call, abstract)
            abstract, hints = local.global_abstract(abstract), local.hints(hints)
        leaves = jax.tree_util.tree_leaves(call.dyn)
        explicit = user_mesh(leaves)
        program = _capture(with_precision(call.pure_function(), o.precision, mesh), abstract,
                           call.in_paths(abstract), mesh, leaves=leaves, explicit=explicit)
        axis_names = _candidate_axis_names(explicit) if chosen else ("data", "model")
        fixed = _program_mesh(program) if chosen else None
        if fixed is not None:  # a shard_map fixes the mesh
            mesh = resolve_mesh(fixed)
        timings["capture"] = time.perf_counter() - t0
        donated = call.donated_leaves()
        ties = output_ties(abstract, program.out_shape())
        program = with_roles(program, abstract, ties, o.state_roles)

        def solve():
            return plan_program(program, mesh=mesh, cluster=o.cluster, memory_budget=o.memory_budget, hints=hints,
                                donated=donated, ties=ties, time_limit=o.solver_time_limit, timings=timings,
                                tie_layers=o.tie_layers, progress=planning_progress(o.progress),
                                remat=o.wants_remat, profile=o.profile, axis_names=axis_names)

        if o.plan is not None:
            plan = self._apply_saved(program)
        elif local is not None:  # process 0 plans, the others load its plan: one plan everywhere
            plan = distributed.broadcast_plan(solve, program, mesh)
        else:
            try:
                plan = solve()
            except InfeasibleError as e:
                # Hints pin the full-batch program only: a split step would silently drop them.
                if (e.smallest_memory is None or o.unsupported("accumulated") or is_abstract(mesh)
                        or is_device_count(mesh)):
                    raise  # (accumulation runs several programs, which an AbstractMesh cannot)
                return self._accumulated(call, e)
        plan = dataclasses.replace(plan, in_tree=jax.tree_util.tree_structure(abstract),
                                   out_tree=program.out_tree, in_roles=program.in_roles)
        step = _compiled(program, plan, ties, donated, local)
        return _verified(step, abstract) if o.verify else step

    def _accumulated(self, call: BoundCall, error) -> AccumulatedStep:
        """The last memory lever: gradient accumulation over the smallest number of microbatches that fits.

        The accumulated step runs the bound call's pure function (nnx objects split, keyword arguments
        placed), so its outputs go through :meth:`BoundCall.finish` like the single program's. Its
        programs are planned without remat and offload, which the full batch tried first."""
        from autoshard.cluster import resolve_mesh
        from autoshard.pipeline import PipelinedStep
        from autoshard.pipeline.auto import choose_microbatches

        o = self.options
        fun = call.pure_function()
        batch = None if o.batch_argnums is None else tuple(
            i for i, lab in enumerate(call.labels) if lab in set(o.batch_argnums))
        base = Options(mesh=resolve_mesh(o.mesh), cluster=o.cluster, memory_budget=o.memory_budget,
                       donate_argnums=tuple(i for i, d in enumerate(call.donated) if d), precision=o.precision,
                       solver_time_limit=o.solver_time_limit, tie_layers=o.tie_layers, progress=None,
                       batch_argnums=batch, verify=o.verify)

        def budget_of(pplan):
            stage_plan = pplan.stages[0].plan
            if stage_plan is not None and stage_plan.stats.get("memory_budget") is not None:
                return stage_plan.stats["memory_budget"]
            return o.memory_budget if o.memory_budget is not None else error.smallest_memory

        def make_step(k, limit):
            budget = base.memory_budget if limit is None else limit
            return PipelinedStep(fun, base.replace(num_microbatches=k, memory_budget=budget))

        step, program = choose_microbatches(make_step, call.dyn, budget_of, error)
        return AccumulatedStep(step, program)

    def _apply_saved(self, program):
        saved = self.options.plan
        if saved.fingerprint != program.fingerprint():
            raise PlanError(
                "the saved plan was made for a different program (fingerprint "
                f"{saved.fingerprint} != {program.fingerprint()}): the function or the argument shapes changed. "
                "Fix: re-plan with parallelize(...) without plan=, and save the new plan."
            )
        from autoshard.cluster import is_device_count, resolve_mesh

        mesh = resolve_mesh(self.options.mesh)
        if is_device_count(mesh):
            if mesh != saved.mesh_info.size:
                raise PlanError(f"the saved plan is for {saved.mesh_info.size} devices, and parallelize(mesh={mesh}) "
                                f"asks for {mesh}. Fix: mesh={saved.mesh_info.size}, or re-plan without plan=.")
        elif mesh is not None and MeshInfo.from_mesh(mesh) != saved.mesh_info:
            raise PlanError("the saved plan's mesh differs from parallelize(mesh=...)")
        return saved

    # ---- public --------------------------------------------------------------------------------------
    def prepared(self, *args, **kwargs) -> CompiledStep | AccumulatedStep:
        """What a call with these arguments runs (planned and jitted once per argument signature, cached):
        a :class:`CompiledStep`, or an :class:`AccumulatedStep` when only microbatches fit the budget."""
        return self.cache.lookup(args, kwargs)[0]

    def plan(self, *args, **kwargs):
        """Plan without running. Arguments may be ``jax.ShapeDtypeStruct``s.

        Returns:
          The :class:`~autoshard.Plan` for these argument shapes (cached); a
          :class:`~autoshard.pipeline.PipelinePlan` when the step runs accumulated.
        """
        return self.prepared(*args, **kwargs).plan

    def lower(self, *args, **kwargs):
        """``jax.stages.Lowered`` of the sharded step; ``.compile()`` gives the XLA executable."""
        entry, call = self.cache.lookup(args, kwargs)
        _require_devices(entry.plan, "lower")
        if isinstance(entry, AccumulatedStep):
            raise InputError(
                f"this step runs as {entry.plan.num_microbatches} accumulated microbatches (no full-batch plan "
                "fits the memory budget), which is several programs, not one to lower. Fix: inspect "
                "step.plan(...) (a PipelinePlan; stats['task_peaks'] has each program's compiled peak), or "
                "raise memory_budget.")
        abstract = jax.tree_util.tree_map(abstract_leaf, call.dyn)
        if entry.process_local is not None:
            abstract = entry.process_local.global_abstract(abstract)
        from autoshard.compile import sharded_structs

        with _mesh_context(entry.plan.mesh):
            return entry.jitted.lower(*sharded_structs(abstract, entry.in_shardings))

    def __call__(self, *args, **kwargs):
        entry, call = self.cache.lookup(args, kwargs)
        _require_devices(entry.plan, "run")
        if isinstance(entry, AccumulatedStep):
            outs = entry.program.run(call.leaves())
            if self._watchdog is not None:
                self._watchdog.watch(jax.tree_util.tree_leaves(outs))
            return call.finish(outs)
        leaves = call.leaves()
        if entry.process_local is not None:
            leaves = entry.process_local.make_global(leaves, entry.in_shardings)
        placed = [x if isinstance(x, jax.Array) and (x.sharding is s or x.sharding == s) else jax.device_put(x, s)
                  for x, s in zip(leaves, entry.in_shardings, strict=True)]
        with _mesh_context(entry.plan.mesh):
            outs = entry.jitted(*placed)
        if self._watchdog is not None:
            self._watchdog.watch(outs)
        return call.finish(jax.tree_util.tree_unflatten(entry.out_tree, outs))


def _require_devices(plan, what: str) -> None:
    """A plan made on an ``AbstractMesh`` is a prediction: there are no devices to lower or run it on."""
    from autoshard.cluster import require_devices

    require_devices(getattr(plan, "mesh", None), what)  # an accumulated step's PipelinePlan has stage meshes


def _options(options: Options | None, kwargs: dict) -> Options:
    if options is None:
        return Options(**kwargs)
    if not isinstance(options, Options):
        raise InputError(f"options={options!r}: expected autoshard.Options(...). Fix: options=autoshard.Options().")
    return options.replace(**kwargs) if kwargs else options


def _compiled(program, plan, ties, donated, local) -> CompiledStep:
    """The plan applied: remat rewritten in, the program lowered under the plan's specs, and jitted."""
    from autoshard.compile import named_shardings
    from autoshard.lower import make_flat_function
    from autoshard.remat import apply_remat

    program, groups = apply_remat(program, plan.remat, ties)
    flat = make_flat_function(program, plan.value_specs, plan.operand_specs, plan.mesh, plan.out_specs,
                              remat_groups=groups, host_inputs=plan.host_inputs, host_outputs=plan.host_outputs)
    in_sh = tuple(named_shardings(plan, plan.in_specs, plan.host_inputs))
    # Outputs reuse the inputs' sharding objects, so the next call finds its arguments placed by identity.
    same = {s: s for s in in_sh}
    out_sh = tuple(same.get(s, s) for s in named_shardings(plan, plan.out_specs, plan.host_outputs))
    jitted = jax.jit(flat, in_shardings=in_sh, out_shardings=list(out_sh), donate_argnums=tuple(sorted(donated)))
    return CompiledStep(plan, jitted, in_sh, program.out_tree, local)


def _verified(step: CompiledStep, abstract) -> CompiledStep:
    """``step`` whose plan carries ``stats["verify"]`` (``parallelize(verify=True)``): the whole step compiled
    once, its peak memory and communication against the plan's prediction, and the compile's seconds."""
    from autoshard.compile import sharded_structs, verify_report
    from autoshard.hlo import memory_stats

    plan = step.plan
    _require_devices(plan, "verify the plan (verify=True)")
    t0 = time.perf_counter()
    with _mesh_context(plan.mesh):
        compiled = step.jitted.lower(*sharded_structs(abstract, step.in_shardings)).compile()
    seconds = time.perf_counter() - t0
    check = plan.verify(compiled)
    report = verify_report(memory_stats(compiled)["peak"], plan.cost.peak_memory_bytes, seconds)
    report.update(communication_ratio=check.ratio, predicted_bytes=dict(check.predicted),
                  compiled_bytes=dict(check.compiled))
    return dataclasses.replace(step, plan=dataclasses.replace(plan, stats={**plan.stats, "verify": report}))


def parallelize(fun=None, *, options=None, mesh=None, cluster=None, memory_budget=None, static_argnums=(),
                donate_argnums=(), static_argnames=(), donate_argnames=(), plan=None, hints=None,
                solver_time_limit=10.0, tie_layers="auto", num_microbatches=1, pipeline=None, progress="auto",
                batch_argnums=None, step_timeout=None, precision=None, remat="auto", accumulate=True,
                state_roles=None, profile=None, verify=False, filter=None):
    """Plan and run a single-device step function sharded over a device mesh.

    Works bare (``@parallelize``) and with arguments (``@parallelize(mesh=...)``). The keyword
    options make one validated :class:`autoshard.Options` (its docstring says what each one
    does); or pass ``options=autoshard.Options(...)``, and keywords given beside it replace its fields.

    Args:
      fun: the step, e.g. ``train_step(state, batch) -> (state, metrics)``. flax nnx objects
        (``nnx.Module``, ``nnx.Optimizer``, ``nnx.Rngs``) may be passed as arguments with ``nnx.jit``'s
        semantics: they are updated in place after the call. Equinox modules (``eqx.Module``, an
        ``eqx.nn.State``) and optax optimizers may be passed with ``eqx.filter_jit``'s semantics
        (``filter``, below): on by default when an argument holds an ``eqx.Module``.
      filter: True: trace only the array leaves of the arguments and keep every other leaf (Python ints,
        functions, strings) static, as ``eqx.filter_jit`` does; the step may return them too. None (the
        default): True when a dynamic argument holds an ``eqx.Module``. False: trace every leaf, as
        ``jax.jit`` does. See :class:`autoshard.Options`.
      options: an :class:`autoshard.Options`, instead of (or under) the keyword options.

    Returns:
      A :class:`Parallelized` step, or with ``num_microbatches > 1`` or ``pipeline=`` a
      :class:`~autoshard.pipeline.PipelinedStep`. Both take the same calls, ``plan(...)`` and options;
      an option a runtime cannot honour is an :class:`~autoshard.errors.InputError`, never dropped.

    Example:
      >>> import autoshard, jax.numpy as jnp
      >>> @autoshard.parallelize
      ... def step(w, x):
      ...     return jnp.tanh(x @ w).sum()
      >>> float(step(jnp.ones((8, 8)), jnp.ones((16, 8)))) > 0
      True
    """
    given = dict(mesh=mesh, cluster=cluster, memory_budget=memory_budget, static_argnums=static_argnums,
                 donate_argnums=donate_argnums, static_argnames=static_argnames, donate_argnames=donate_argnames,
                 plan=plan, hints=hints, solver_time_limit=solver_time_limit, tie_layers=tie_layers,
                 num_microbatches=num_microbatches, pipeline=pipeline, progress=progress,
                 batch_argnums=batch_argnums, step_timeout=step_timeout, precision=precision, remat=remat,
                 accumulate=accumulate, state_roles=state_roles, profile=profile, verify=verify, filter=filter)
    if options is not None:  # the keywords given beside options= replace its fields
        defaults = inspect.signature(parallelize).parameters
        options = _options(options, {k: v for k, v in given.items() if v is not defaults[k].default})
    else:
        options = Options(**given)
    if fun is None:
        return lambda f: make_step(f, options)
    return make_step(fun, options)


def make_step(fun, options: Options):
    """The runtime for ``options``: a :class:`Parallelized` step, or a pipelined one."""
    if options.runtime == "pipelined":
        from autoshard.pipeline import PipelinedStep

        return PipelinedStep(fun, options)
    return Parallelized(fun, options)


def plan_program(program, *, mesh=None, cluster=None, memory_budget=None, hints=None, donated=(), ties=None,
                 time_limit=10.0, timings=None, tie_layers="auto", progress=None, remat=False, profile=None,
                 axis_names=("data", "model")):
    """Plan a captured program: :func:`autoshard.driver.plan` of a :class:`~autoshard.driver.PlanRequest`
    made of these options. With ``mesh=None`` (all devices) or a device count (``mesh=256``: ``AbstractMesh`` es),
    the shapes of :func:`autoshard.cluster.candidate_meshes` are tried."""
    from autoshard.driver import PlanRequest, plan

    return plan(PlanRequest(program, mesh=mesh, cluster=cluster, memory_budget=memory_budget, hints=dict(hints or {}),
                            donated=frozenset(donated), ties=dict(ties or {}), time_limit=time_limit,
                            tie_layers=tie_layers, remat=remat, progress=progress, timings=dict(timings or {}),
                            profile=profile, axis_names=tuple(axis_names)))
