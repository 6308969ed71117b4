"""``parallelize``: the user-facing decorator, its cache, and ``plan``/``lower``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any

import jax
import numpy as np

from autoshard.cluster import parse_bytes
from autoshard.errors import InfeasibleError, InputError, MeshError, PlanError
from autoshard.roles import with_roles
from autoshard.signature import BoundCall, StepSignature, abstract_leaf, check_leaf, output_ties
from autoshard.spec import MeshInfo


def _mesh_context(mesh):
    """Trace and run under autoshard's Auto-axis mesh: the caller may be inside ``jax.set_mesh`` of an
    Explicit mesh, under which ``with_sharding_constraint`` (the plan's pins) is an assertion."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


@dataclasses.dataclass(frozen=True, eq=False)
class _Accumulated:
    """A step that only fits its memory budget split into microbatches (see autoshard/pipeline/auto.py)."""

    step: Any  # a PipelinedStep whose cache holds the entry for these argument shapes
    plan: Any  # its PipelinePlan; plan.stats["num_microbatches"] is k


@dataclasses.dataclass(frozen=True, eq=False)
class _Compiled:
    plan: Any
    jitted: Any
    in_shardings: tuple
    out_tree: Any
    process_local: Any = None  # distributed.ProcessLocalArgs in multi-process runs


# jax's messages for explicit-sharding annotations traced under autoshard's Auto-axis mesh (or none).
_NEEDS_A_MESH = ("Using PartitionSpec when you are not under a mesh context", "requires a non-empty mesh in context")
_ANNOTATION_ERRORS = (*_NEEDS_A_MESH, "cannot contain axis names that are of type Auto")


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


def _capture(fun, abstract, in_paths, mesh):
    """``capture_graph`` under the planning mesh, with jax's tracing errors for code that autoshard cannot
    plan (pmap collectives, explicit-sharding annotations) turned into an :class:`InputError` that names
    the user's line and the fix.

    With no mesh yet (``mesh=None``), the step is traced without a mesh first (a ``shard_map`` in it
    brings its own), and again under one with the planner's axis names if it needs a mesh in context
    (``with_sharding_constraint(x, PartitionSpec("data"))``: a pin by name, on whichever mesh is chosen)."""
    from autoshard.capture import capture_graph, exception_location
    from autoshard.cluster import make_mesh

    try:
        try:
            with _mesh_context(mesh):
                return capture_graph(fun, abstract, in_paths=in_paths)
        except (ValueError, RuntimeError) as e:
            if mesh is not None or not any(m in str(e) for m in _NEEDS_A_MESH):
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


class Parallelized:
    """A step function that plans, shards and runs itself. Made by :func:`parallelize`."""

    def __new__(cls, fun=None, *args, num_microbatches=1, pipeline=None, **kwargs):
        # Microbatching or pipelining: a different runtime (autoshard/pipeline/), same call interface.
        if num_microbatches != 1 or pipeline is not None:
            from autoshard.pipeline import PipelinedStep

            kwargs.pop("progress", None)  # the pipeline planner reports no progress yet
            if kwargs.pop("precision", None) not in (None, "fp32"):
                raise InputError("precision= is not supported with num_microbatches or pipeline yet. "
                                 "Fix: drop precision=, or run without a pipeline.")
            kwargs.pop("remat", None)  # nor rematerialises
            kwargs.pop("accumulate", None)  # the number of microbatches is given
            if kwargs.pop("state_roles", None):
                raise InputError("state_roles= is not supported with num_microbatches or pipeline yet (stage plans "
                                 "offload nothing). Fix: drop state_roles=, or run without a pipeline.")
            for name in ("static_argnames", "donate_argnames"):
                if kwargs.pop(name, ()):
                    raise InputError(f"{name}= is not supported with num_microbatches or pipeline yet. Fix: "
                                     "name the arguments by position (static_argnums / donate_argnums).")
            return PipelinedStep(fun, *args, num_microbatches=num_microbatches, pipeline=pipeline, **kwargs)
        return super().__new__(cls)

    def __init__(self, fun, *, mesh=None, cluster=None, memory_budget=None, static_argnums=(),
                 donate_argnums=(), static_argnames=(), donate_argnames=(), plan=None, hints=None, solver_time_limit=10.0, tie_layers="auto",
                 num_microbatches=1, pipeline=None, progress="auto", batch_argnums=None, step_timeout=None,
                 precision=None, remat=True, accumulate=True, state_roles=None):
        from autoshard.precision import compute_dtype

        self.fun = fun
        self.remat = remat
        self.accumulate = accumulate
        self.compute_dtype = compute_dtype(precision)
        self.batch_argnums = batch_argnums
        self._watchdog = None
        if step_timeout is not None:
            from autoshard.distributed import StepWatchdog

            self._watchdog = StepWatchdog(step_timeout, name=f"{getattr(fun, '__name__', 'step')} call")
        self.progress = progress
        self.tie_layers = tie_layers
        self.mesh = mesh
        self.cluster = cluster
        self.memory_budget = parse_bytes(memory_budget)
        self.signature = StepSignature.create(fun, static_argnums, static_argnames, donate_argnums, donate_argnames)
        self.static_argnums = tuple(sorted(self.signature.static_argnums))
        self.donate_argnums = tuple(sorted(self.signature.donate_argnums))
        self.saved_plan = plan
        self.hints = dict(hints or {})
        self.state_roles = dict(state_roles or {})
        self.solver_time_limit = solver_time_limit
        self._cache: dict = {}
        functools.update_wrapper(self, fun)
        if mesh is not None:
            from autoshard.cluster import resolve_mesh

            resolve_mesh(mesh)  # refuse a Manual-axis mesh now, not at the first call

    # ---- argument handling -------------------------------------------------------------------------
    @staticmethod
    def _checked_abstract(call: BoundCall):
        """The call's dynamic arguments as ``ShapeDtypeStruct``s, every leaf checked to be an array."""
        for path, leaf in jax.tree_util.tree_flatten_with_path(call.dyn)[0]:
            check_leaf(jax.tree_util.keystr(path[1:]), leaf, call.labels[path[0].idx], [k for k, _ in call.static])
        return jax.tree_util.tree_map(abstract_leaf, call.dyn)

    # ---- planning ----------------------------------------------------------------------------------
    def _get(self, args, kwargs=None) -> _Compiled | _Accumulated:
        return self._lookup(args, kwargs or {})[0]

    def _lookup(self, args, kwargs) -> tuple[_Compiled | _Accumulated, BoundCall]:
        call = self.signature.bind(args, kwargs)
        leaves, tree = jax.tree_util.tree_flatten(call.dyn)
        if all(isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) for x in leaves):  # the usual call: a cache hit
            entry = self._cache.get(call.key_of(leaves, tree))
            if entry is not None:
                return entry, call
        abstract = self._checked_abstract(call)
        key = call.key(abstract)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache[key] = self._build(call, abstract)
        return entry, call

    def _build(self, call: BoundCall, abstract) -> _Compiled | _Accumulated:
        from autoshard.cluster import make_mesh, resolve_mesh
        from autoshard.compile import named_shardings
        from autoshard.lower import make_flat_function

        timings = {}
        t0 = time.perf_counter()
        mesh, hints, local = resolve_mesh(self.mesh), self.hints, None
        if jax.process_count() > 1:  # each process passes its slice of the batch: plan the global one
            from autoshard import distributed

            if mesh is None:
                mesh = make_mesh((jax.process_count(), jax.local_device_count()), ("data", "model"))
            labels = call.positional_labels
            local = distributed.ProcessLocalArgs.create(mesh, self.batch_argnums, call.dyn, labels, len(labels))
            local.check_same_everywhere(call.key(abstract))
            abstract, hints = local.global_abstract(abstract), local.hints(hints)
        fun = call.pure_function()
        if self.compute_dtype is not None:
            from autoshard.precision import cast_matmuls, widen_operands

            device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
            fun = cast_matmuls(fun, self.compute_dtype, widen=widen_operands(device.platform))
        program = _capture(fun, abstract, call.in_paths(abstract), mesh)
        fixed = _program_mesh(program) if mesh is None else None
        if fixed is not None:  # a shard_map fixes the mesh
            mesh = resolve_mesh(fixed)
        timings["capture"] = time.perf_counter() - t0
        donated = call.donated_leaves()
        out_shape = jax.tree_util.tree_unflatten(program.out_tree, [program.avals[v] if isinstance(v, int) else
                                                                    jax.ShapeDtypeStruct(np.shape(v.value),
                                                                                         np.asarray(v.value).dtype)
                                                                    for v in program.graph.outvars])
        ties = output_ties(abstract, out_shape)
        program = with_roles(program, abstract, ties, self.state_roles)

        def solve():
            return plan_program(program, mesh=mesh, cluster=self.cluster, memory_budget=self.memory_budget,
                                hints=hints, donated=donated, ties=ties, time_limit=self.solver_time_limit,
                                timings=timings, tie_layers=self.tie_layers,
                                progress=_progress_callback(self.progress), remat=self.remat)

        if self.saved_plan is not None:
            plan = self._apply_saved(program)
        elif local is not None:  # process 0 plans, the others load its plan: one plan everywhere
            plan = distributed.broadcast_plan(solve, program, mesh)
        else:
            try:
                plan = solve()
            except InfeasibleError as e:
                # bf16 casts and hints live in this runtime only: a split step would silently drop them.
                if not self.accumulate or e.smallest_memory is None or self.compute_dtype is not None or hints:
                    raise
                return self._accumulated(call, e)
        plan = dataclasses.replace(plan, in_tree=jax.tree_util.tree_structure(abstract),
                                   out_tree=program.out_tree, in_roles=program.in_roles)
        from autoshard.remat import apply_remat

        program, groups = apply_remat(program, plan.remat, ties)
        flat = make_flat_function(program, plan.value_specs, plan.operand_specs, plan.mesh, plan.out_specs,
                                  remat_groups=groups, host_inputs=plan.host_inputs, host_outputs=plan.host_outputs)
        in_sh = tuple(named_shardings(plan, plan.in_specs, plan.host_inputs))
        # Outputs reuse the inputs' sharding objects, so the next call finds its arguments placed by identity.
        same = {s: s for s in in_sh}
        out_sh = tuple(same.get(s, s) for s in named_shardings(plan, plan.out_specs, plan.host_outputs))
        jitted = jax.jit(flat, in_shardings=in_sh, out_shardings=list(out_sh), donate_argnums=tuple(sorted(donated)))
        return _Compiled(plan, jitted, in_sh, program.out_tree, local)

    def _accumulated(self, call: BoundCall, error) -> _Accumulated:
        """The last memory lever: gradient accumulation over the smallest number of microbatches that fits.

        The accumulated step runs the bound call's pure function (nnx objects split, keyword arguments
        placed), so its outputs go through :meth:`BoundCall.finish` like the single program's."""
        from autoshard.pipeline import PipelinedStep
        from autoshard.pipeline.auto import choose_microbatches

        fun = call.pure_function()
        from autoshard.cluster import resolve_mesh

        mesh = resolve_mesh(self.mesh)
        donate = tuple(i for i, d in enumerate(call.donated) if d)

        def make_step(k):
            return PipelinedStep(fun, mesh=mesh, cluster=self.cluster, memory_budget=self.memory_budget,
                                 donate_argnums=donate, hints=self.hints, solver_time_limit=self.solver_time_limit,
                                 tie_layers=self.tie_layers, num_microbatches=k)

        def budget_of(pplan):
            stage_plan = pplan.stages[0].plan
            if stage_plan is not None and stage_plan.stats.get("memory_budget") is not None:
                return stage_plan.stats["memory_budget"]
            return self.memory_budget if self.memory_budget is not None else error.smallest_memory

        n = len(call.dyn)
        args = (call.dyn, (), list(range(n)), n)
        step, entry = choose_microbatches(make_step, args, budget_of, error)
        step._cache[step._key(call.dyn, (), list(range(n)))] = entry
        return _Accumulated(step, entry.plan)

    def _apply_saved(self, program):
        saved = self.saved_plan
        if saved.fingerprint != program.fingerprint():
            raise PlanError(
                "the saved plan was made for a different program (fingerprint "
                f"{saved.fingerprint} != {program.fingerprint()}): the function or the argument shapes changed. "
                "Fix: re-plan with parallelize(...) without plan=, and save the new plan."
            )
        from autoshard.cluster import resolve_mesh

        mesh = resolve_mesh(self.mesh)
        if mesh is not None and MeshInfo.from_mesh(mesh) != saved.mesh_info:
            raise PlanError("the saved plan's mesh differs from parallelize(mesh=...)")
        return saved

    # ---- public --------------------------------------------------------------------------------------
    def plan(self, *args, **kwargs):
        """Plan without running. Arguments may be ``jax.ShapeDtypeStruct``s.

        Returns:
          The :class:`~autoshard.Plan` for these argument shapes (cached).
        """
        return self._lookup(args, kwargs)[0].plan

    def lower(self, *args, **kwargs):
        """``jax.stages.Lowered`` of the sharded step; ``.compile()`` gives the XLA executable."""
        entry, call = self._lookup(args, kwargs)
        if isinstance(entry, _Accumulated):
            raise InputError(
                f"this step runs as {entry.plan.num_microbatches} accumulated microbatches (no full-batch plan "
                "fits the memory budget), which is several programs, not one to lower. Fix: inspect "
                "step.plan(...) (a PipelinePlan; stats['task_peaks'] has each program's compiled peak), or "
                "raise memory_budget.")
        abstract = jax.tree_util.tree_map(abstract_leaf, call.dyn)
        if entry.process_local is not None:
            abstract = entry.process_local.global_abstract(abstract)
        flat = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                for a, s in zip(jax.tree_util.tree_leaves(abstract),
                                entry.in_shardings, strict=True)]
        with _mesh_context(entry.plan.mesh):
            return entry.jitted.lower(*flat)

    def __call__(self, *args, **kwargs):
        entry, call = self._lookup(args, kwargs)
        if isinstance(entry, _Accumulated):
            outs = entry.step(*call.dyn)
            if self._watchdog is not None:
                self._watchdog.watch(jax.tree_util.tree_leaves(outs))
            return call.finish(outs)
        leaves = jax.tree_util.tree_leaves(call.dyn)
        if entry.process_local is not None:
            leaves = entry.process_local.make_global(leaves, entry.in_shardings)
        placed = []
        for x, s in zip(leaves, entry.in_shardings, strict=True):
            if isinstance(x, jax.ShapeDtypeStruct):
                raise InputError("cannot run on jax.ShapeDtypeStruct arguments; use .plan() or .lower() instead")
            if not (isinstance(x, jax.Array) and (x.sharding is s or x.sharding == s)):
                x = jax.device_put(x, s)
            placed.append(x)
        with _mesh_context(entry.plan.mesh):
            outs = entry.jitted(*placed)
        if self._watchdog is not None:
            self._watchdog.watch(outs)
        return call.finish(jax.tree_util.tree_unflatten(entry.out_tree, outs))


def parallelize(fun=None, *, mesh=None, cluster=None, memory_budget=None, static_argnums=(), donate_argnums=(),
                static_argnames=(), donate_argnames=(), plan=None, hints=None, solver_time_limit=10.0, tie_layers="auto", num_microbatches=1, pipeline=None,
                progress="auto", batch_argnums=None, step_timeout=None, precision=None, remat=True,
                accumulate=True, state_roles=None):
    """Plan and run a single-device step function sharded over a device mesh.

    Works bare (``@parallelize``) and with arguments (``@parallelize(mesh=...)``).

    Args:
      fun: the step, e.g. ``train_step(state, batch) -> (state, metrics)``. flax nnx objects
        (``nnx.Module``, ``nnx.Optimizer``, ``nnx.Rngs``) may be passed as arguments with ``nnx.jit``'s
        semantics: ``train_step(model, optimizer, batch)`` that calls ``optimizer.update(model, grads)``
        updates ``model`` and ``optimizer`` in place after the call (parameters, optimizer state and
        step count, BatchNorm statistics, RNG counters).
      mesh: a ``jax.sharding.Mesh`` with Auto axes (see :func:`autoshard.make_mesh`). None: all devices,
        and the planner picks the 2-D shape among the factorizations of the device count.
        In a multi-process job, None is ``(jax.process_count(), jax.local_device_count())`` over
        ``("data", "model")``.
      cluster: an :class:`autoshard.ClusterSpec`; None picks a preset for the devices' platform.
      memory_budget: bytes per device (or a string like ``"16GB"``); None: the ClusterSpec's memory.
        When no sharding fits it, the planner keeps optimizer state in host memory
        (``pinned_host``; see :mod:`autoshard.offload` and ``Plan.offloaded``).
      static_argnums, donate_argnums, static_argnames, donate_argnames: as in ``jax.jit`` (a parameter
        named by position is also named by name, and the other way round). Keyword arguments at call
        time are dynamic unless named static.
      plan: a saved :class:`autoshard.Plan` to apply without solving.
      hints: ``{pytree-path regex: PartitionSpec}`` pinning matching argument leaves.
      solver_time_limit: seconds the solver may spend.
      tie_layers: solve structurally identical nodes (repeated layers) as one: much faster on deep
        unrolled models, and exact whenever identical layers want identical layouts (not so for
        patterns that alternate across layers). ``"auto"``: only for graphs of more than
        ``TIE_LAYERS_ABOVE`` nodes after follower merging.
      num_microbatches: split the batch arguments on their leading axis into this many microbatches,
        accumulate the gradients, and apply the update once (see :mod:`autoshard.pipeline`).
      progress: planning progress bar: ``"auto"`` (tqdm or rich, in a terminal or notebook), ``"tqdm"``,
        ``"rich"``, a ``callback(stage, done, total)``, or None to silence it.
      pipeline: an :class:`autoshard.PipelineOptions`: run the step as a pipeline of stages on
        sub-meshes (inter-operator parallelism). None: no pipeline.
      batch_argnums: in a multi-process job (``jax.distributed``), the positional arguments of which
        each process passes only its own slice (rows along the leading axis). autoshard plans for
        the global batch (local leading dim times ``jax.process_count()``), splits it over the mesh
        axes that span processes, and joins the slices with ``jax.make_array_from_process_local_data``.
        None: the last dynamic argument, unless its leaves are already global ``jax.Array``s;
        ``()``: none. Ignored in single-process runs. See :mod:`autoshard.distributed`.
      step_timeout: seconds. When set, a step that fails in a multi-process job (a peer process
        died) or runs longer than this prints a clear message and ends the process with status
        ``autoshard.distributed.STEP_FAILED_EXIT_CODE`` instead of hanging in a collective. The clock
        starts when the step is dispatched (after planning and compiling), so it must exceed the
        slowest healthy step's run time. None: no watchdog.
      precision: ``"bf16"``: every fp32 matmul and convolution reads bf16 copies of its operands and
        accumulates in fp32; parameters, optimizer state and the update stay fp32 (master weights).
        None or ``"fp32"``: the step's own dtypes. See :mod:`autoshard.precision`.
      remat: when the memory budget binds, let the planner also consider recomputing
        forward segments in the backward pass (chosen jointly with the sharding; see
        :mod:`autoshard.remat`). ``plan.remat`` reports the choice.
      accumulate: when no plan of the full batch fits the memory budget (sharding, ``remat`` and host
        offload all tried), split the batch arguments into the smallest number ``k`` of
        microbatches dividing the batch size whose programs fit (XLA's compiled peaks), and
        accumulate the gradients, as ``num_microbatches=k`` would. Results equal the full step up
        to float reordering; a step whose batch reductions are not sums (a max over the batch,
        BatchNorm) is never split and keeps the InfeasibleError. Then ``step.plan(...)`` is a
        :class:`~autoshard.pipeline.PipelinePlan` with ``num_microbatches == k`` (also
        ``plan.stats["num_microbatches"]``). A budget that the full batch meets is planned as
        without it. Not with ``precision=`` or ``hints=``. False: raise the InfeasibleError instead.
      state_roles: ``{pytree-path regex: role}`` overriding what an argument leaf is (``"parameter"``,
        ``"optimizer_state"``, ...; see :mod:`autoshard.roles`), e.g. ``{"momentum":
        "optimizer_state"}`` for an optimizer that is not optax. Roles decide what host offload may
        move (optimizer state only) and label the report. None: optax's state types, nnx variable
        types and PRNG key dtypes decide.

    Example:
      >>> import autoshard, jax.numpy as jnp
      >>> @autoshard.parallelize
      ... def step(w, x):
      ...     return jnp.tanh(x @ w).sum()
      >>> float(step(jnp.ones((8, 8)), jnp.ones((16, 8)))) > 0
      True
    """
    kw = dict(mesh=mesh, cluster=cluster, memory_budget=memory_budget, static_argnums=static_argnums,
              donate_argnums=donate_argnums, plan=plan, hints=hints, solver_time_limit=solver_time_limit,
              tie_layers=tie_layers, num_microbatches=num_microbatches, pipeline=pipeline, progress=progress,
              remat=remat)
    if accumulate is not True:
        kw["accumulate"] = accumulate
    if batch_argnums is not None:
        kw["batch_argnums"] = batch_argnums
    if step_timeout is not None:
        kw["step_timeout"] = step_timeout
    if precision is not None:
        kw["precision"] = precision
    if static_argnames:
        kw["static_argnames"] = static_argnames
    if donate_argnames:
        kw["donate_argnames"] = donate_argnames
    if state_roles:
        kw["state_roles"] = state_roles
    if fun is None:
        return lambda f: Parallelized(f, **kw)
    return Parallelized(fun, **kw)


def _progress_callback(progress):
    """Resolve ``parallelize(progress=...)`` to a ``callback(stage, done, total)`` or None."""
    if progress is None or progress is False or callable(progress):
        return progress or None
    if progress == "auto":
        import sys

        interactive = "ipykernel" in sys.modules or (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
        if not interactive:
            return None
    from autoshard.report import progress_callback

    return progress_callback(progress)


def plan_program(program, *, mesh=None, cluster=None, memory_budget=None, hints=None, donated=(), ties=None,
                 time_limit=10.0, timings=None, tie_layers="auto", progress=None, remat=False):
    """Plan a captured program: :func:`autoshard.driver.plan` of a :class:`~autoshard.driver.PlanRequest`
    made of these options. With ``mesh=None``, every 2-D factorization of all devices is tried."""
    from autoshard.driver import PlanRequest, plan

    return plan(PlanRequest(program, mesh=mesh, cluster=cluster, memory_budget=memory_budget, hints=dict(hints or {}),
                            donated=frozenset(donated), ties=dict(ties or {}), time_limit=time_limit,
                            tie_layers=tie_layers, remat=remat, progress=progress, timings=dict(timings or {})))
