"""``parallelize``: the user-facing decorator, its cache, and ``plan``/``lower``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from autoshard.errors import InfeasibleError, InputError, MeshError, PlanError
from autoshard.roles import program_roles, with_roles
from autoshard.signature import BoundCall, StepSignature, abstract_leaf, check_leaf
from autoshard.spec import MeshInfo, ShardingSpec

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(value) -> float | None:
    """``16e9``, ``"16GB"`` or ``"16 GiB"`` -> bytes; None stays None."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise InputError(f"memory_budget={value!r} is not a size; write bytes (16e9) or a string like '16GB'")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def _default_cluster(mesh):
    from autoshard.cluster import cluster_preset

    platform = mesh.devices.flat[0].platform
    return cluster_preset({"cpu": "cpu-sim", "tpu": "tpu-v5e"}.get(platform, "h100-nvlink"))


_abstract = abstract_leaf


def _mesh_context(mesh):
    """Trace and run under autoshard's Auto-axis mesh: the caller may be inside ``jax.set_mesh`` of an
    Explicit mesh, under which ``with_sharding_constraint`` (the plan's pins) is an assertion."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _ties(dyn_args, out_shape) -> dict[int, int]:
    """Output leaves that are the next version of an input leaf (same subtree, shapes and dtypes)."""
    in_leaves_offset, offset = [], 0
    for a in dyn_args:
        n = len(jax.tree_util.tree_leaves(a))
        in_leaves_offset.append((offset, jax.tree_util.tree_structure(a), jax.tree_util.tree_leaves(a)))
        offset += n
    candidates = [((), out_shape)]
    if isinstance(out_shape, (tuple, list)):
        candidates += [((j,), o) for j, o in enumerate(out_shape)]
    out_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
    ties = {}
    for prefix, sub in candidates:
        tree = jax.tree_util.tree_structure(sub)
        leaves = jax.tree_util.tree_leaves(sub)
        if not leaves:
            continue
        for start, in_tree, in_leaves in in_leaves_offset:
            if tree != in_tree:
                continue
            if any(tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype
                   for a, b in zip(leaves, in_leaves, strict=True)):
                continue
            first = next(k for k, p in enumerate(out_paths) if tuple(
                getattr(x, "idx", getattr(x, "key", None)) for x in p[:len(prefix)]) == prefix)
            for j in range(len(leaves)):
                ties.setdefault(first + j, start + j)
            break
    return ties


TIE_LAYERS_ABOVE = 300
"""Merged-graph size above which ``tie_layers="auto"`` ties repeated layers."""

TIE_LAYERS_ABOVE_UNDER_BUDGET = 1500
"""The same, when a binding memory budget is searched with remat: a tied group's memory is charged
over the lifetimes of all its layers at once, which hides what recomputing a layer frees."""

MERGE_SHRINK = 8.0
"""Under a remat search, followers this much smaller than their main operand lead their own node."""


def _factorizations(n: int):
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]


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
    def _bind(self, args, kwargs) -> tuple[BoundCall, Any]:
        """The call bound to the signature, and its abstract dynamic arguments (leaves checked)."""
        call = self.signature.bind(args, kwargs)
        for path, leaf in jax.tree_util.tree_flatten_with_path(call.dyn)[0]:
            check_leaf(jax.tree_util.keystr(path[1:]), leaf, call.labels[path[0].idx], [k for k, _ in call.static])
        return call, jax.tree_util.tree_map(_abstract, call.dyn)

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
        call, abstract = self._bind(args, kwargs)
        key = call.key(abstract)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache[key] = self._build(call, abstract)
        return entry, call

    def _build(self, call: BoundCall, abstract) -> _Compiled | _Accumulated:
        from autoshard.cluster import make_mesh, resolve_mesh
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
        if mesh is None and _program_mesh(program) is not None:  # a shard_map fixes the mesh
            mesh = resolve_mesh(_program_mesh(program))
        timings["capture"] = time.perf_counter() - t0
        donated = call.donated_leaves()
        out_shape = jax.tree_util.tree_unflatten(program.out_tree, [program.avals[v] if isinstance(v, int) else
                                                                    jax.ShapeDtypeStruct(np.shape(v.value),
                                                                                         np.asarray(v.value).dtype)
                                                                    for v in program.graph.outvars])
        ties = _ties(abstract, out_shape)
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
        flat = make_flat_function(program, plan.value_specs, plan.operand_specs, plan.mesh, plan.out_specs, groups,
                                  host_inputs=plan.host_inputs, host_outputs=plan.host_outputs)
        in_sh = tuple(plan._named(plan.in_specs, plan.host_inputs))
        # Outputs reuse the inputs' sharding objects, so the next call finds its arguments placed by identity.
        same = {s: s for s in in_sh}
        out_sh = tuple(same.get(s, s) for s in plan._named(plan.out_specs, plan.host_outputs))
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
        abstract = jax.tree_util.tree_map(_abstract, call.dyn)
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


def _pinned_from_hints(program, hints, info: MeshInfo) -> dict[int, ShardingSpec]:
    pinned, problems = {}, []
    for pattern, pspec in hints.items():
        if not isinstance(pspec, PartitionSpec):
            problems.append(f"hint {pattern!r}: expected a PartitionSpec, got {pspec!r}")
            continue
        try:
            rx = re.compile(pattern)
        except re.error as e:
            problems.append(f"hint {pattern!r} is not a regular expression: {e}")
            continue
        matched = [i for i, path in enumerate(program.in_paths) if rx.search(path)]
        if not matched:
            examples = ", ".join(program.in_paths[:3])
            problems.append(f"hint {pattern!r} matches no argument leaf (paths look like: {examples})")
        for i in matched:
            path = program.in_paths[i]
            shape = tuple(program.avals[program.graph.invars[i]].shape)
            try:
                spec = ShardingSpec.from_partition_spec(pspec, len(shape), info)
            except ValueError as e:
                problems.append(f"{path}: {e}")
                continue
            for d, (n, axes) in enumerate(zip(shape, spec.dims, strict=True)):
                k = info.axes_size(axes)
                if n % k:
                    names = "*".join(info.names[a] for a in axes)
                    problems.append(
                        f"{path} has shape {shape}; dimension {d} (size {n}) is pinned to mesh axes {names} of size "
                        f"{k}, which does not divide it. Fix: pin a dividing axis, or pad the dimension to a "
                        f"multiple of {k}.")
            pinned[i] = spec
    if problems:
        raise MeshError("cannot honour the sharding hints:\n  " + "\n  ".join(problems))
    return pinned


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


_PASSES = ("capture", "strategies", "problem", "solve")


def plan_program(program, *, mesh=None, cluster=None, memory_budget=None, hints=None, donated=(), ties=None,
                 time_limit=10.0, timings=None, tie_layers="auto", progress=None, remat=False):
    """Plan a captured program. With ``mesh=None``, try every 2-D factorization of all devices.

    ``remat=True``: when the budget binds, also consider recomputing forward segments
    (:mod:`autoshard.remat`); the plan's ``remat`` says which."""
    from autoshard.cluster import make_mesh
    from autoshard.planner import warn_unsupported

    timings = {} if timings is None else timings
    meshes = [None] if mesh is not None else _factorizations(len(jax.devices()))
    total, done = 1 + 3 * len(meshes), [1]

    def report(stage: str):
        if progress is not None:
            progress(stage, done[0], total)
            done[0] += 1

    report("captured")
    if mesh is None:
        best, infeasible = None, []
        for shape in meshes:
            m = make_mesh(shape, ("data", "model"))
            try:
                p = _plan_on_mesh(program, m, cluster, memory_budget, hints, donated, ties, time_limit,
                                  dict(timings), tie_layers, report, remat)
            except InfeasibleError as e:  # another factorization may fit the memory budget
                infeasible.append(e)
                continue
            if best is None or p.cost.objective < best.cost.objective:
                best = p
        if best is None:  # report the mesh that comes closest
            raise min(infeasible, key=lambda e: math.inf if e.smallest_memory is None else e.smallest_memory)
    else:
        best = _plan_on_mesh(program, mesh, cluster, memory_budget, hints, donated, ties, time_limit, timings,
                             tie_layers, report, remat)
    if progress is not None:
        progress("done", total, total)
    # Warn here, once per plan, not once per candidate mesh.
    warn_unsupported(best.warnings)
    from autoshard.planner import warn_indivisible_batch

    warn_indivisible_batch(program, ties, best.mesh_info)

    def replan(pins):  # for Plan.explain: the same planning on the chosen mesh, with more leaves pinned
        return plan_program(program, mesh=best.mesh, cluster=cluster, memory_budget=memory_budget,
                            hints={**(hints or {}), **pins}, donated=donated, ties=ties, time_limit=time_limit,
                            tie_layers=tie_layers, remat=remat)

    return dataclasses.replace(best, replan=replan)


# A sharding-only plan whose estimated peak is within this fraction of the budget is compiled
# once to check XLA's peak (the estimate is within ~15% of it on the test models).
CHECK_ABOVE = 0.85


def _plan_on_mesh(program, mesh, cluster, memory_budget, hints, donated, ties, time_limit, timings,
                  tie_layers="auto", report=lambda stage: None, remat=False):
    """Plan on one mesh: sharding alone; when the budget binds, also recomputation (remat.py);
    when nothing fits the device, optimizer state in host memory (offload.py).

    No plan whose compiled peak exceeds the budget is returned: remat and offload plans are
    compiled and checked by their searches; a sharding-only plan is compiled when its estimate
    comes within ``CHECK_ABOVE`` of the budget, and if XLA's peak is over, planning runs again
    under a budget shrunk by the ratio (at most twice) before giving up with InfeasibleError."""
    cluster = _default_cluster(mesh) if cluster is None else cluster
    budget = memory_budget if memory_budget is not None else cluster.memory
    from autoshard.remat import compiled_peak, fit_compiled

    def check(plan):
        if plan.remat is not None or plan.host_inputs or plan.memory.peak_bytes <= CHECK_ABOVE * budget:
            return None  # remat and offload plans were checked by their searches
        plan.stats["compiled_peak"] = compiled_peak(program, plan, (), donated)
        return plan.stats["compiled_peak"]

    def refuse(smallest):
        return InfeasibleError(
            f"no plan fits memory budget {budget:.4g} bytes per device on mesh "
            f"{dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))}: the planner's memory row says one "
            f"does, but XLA's compiled peak of each plan found is higher (the lowest, {smallest:.4g} bytes; "
            f"re-planned under a shrunk budget). Fix: raise memory_budget to about {smallest:.4g}, or use more "
            "devices.", smallest_memory=smallest)

    # limit None: the cluster's memory, named so in errors
    return fit_compiled(lambda limit: _plan_within(program, mesh, cluster, limit, hints, donated, ties, time_limit,
                                                   timings, tie_layers, report, remat),
                        check, budget, memory_budget, refuse)


def _plan_within(program, mesh, cluster, memory_budget, hints, donated, ties, time_limit, timings, tie_layers,
                 report, remat):
    """One round of :func:`_plan_on_mesh`: the levers in order under ``memory_budget``."""
    from autoshard.remat import choose_remat, compiled_peak

    budget = memory_budget if memory_budget is not None else cluster.memory
    try:
        if not remat:
            return _solve_on_mesh(program, mesh, cluster, memory_budget, hints, donated, ties, time_limit, timings,
                                  tie_layers, report)
        plan, choice = choose_remat(
            lambda prog, limit: _solve_on_mesh(prog, mesh, cluster, limit, hints, donated, ties, time_limit,
                                               dict(timings), tie_layers, report, remat_split=True),
            program, ties, budget=budget, flops_per_second=cluster.flops * mesh.devices.size,
            check=lambda p, prog, groups: compiled_peak(prog, p, groups, donated))
        return plan if choice is None else dataclasses.replace(plan, fingerprint=program.fingerprint(), remat=choice)
    except InfeasibleError as e:
        if e.smallest_memory is None:
            raise
        # No sharding (nor recomputation) fits the device: keep optimizer state in host memory.
        from autoshard.offload import plan_with_offload

        return plan_with_offload(
            lambda offloaded, limit: _solve_on_mesh(program, mesh, cluster, limit, hints, donated, ties, time_limit,
                                                    timings, tie_layers, report, offloaded=offloaded),
            program, ties or {}, e, budget=budget, num_devices=mesh.devices.size,
            check=lambda p: compiled_peak(program, p, (), donated))


def _solve_on_mesh(program, mesh, cluster, memory_budget, hints, donated, ties, time_limit, timings,
                   tie_layers="auto", report=lambda stage: None, offloaded=(), remat_split=False):
    from autoshard.cost import CostModel
    from autoshard.memory import estimate_memory
    from autoshard.plan import Plan, PlanCost
    from autoshard.planner import (
        build_problem,
        decode,
        enumerate_strategies,
        merge_followers,
        tie_repeated_layers,
    )
    from autoshard.solver import solve

    info = MeshInfo.from_mesh(mesh)
    cluster = _default_cluster(mesh) if cluster is None else cluster
    platform = mesh.devices.flat[0].platform
    cost = CostModel.create(info, cluster, platform=platform)
    pinned = _pinned_from_hints(program, hints or {}, info)
    t = time.perf_counter()
    sgraph = enumerate_strategies(program, cost, pinned=pinned, donated=donated, tie_outputs=ties,
                                  host_bandwidth=getattr(cluster, "host_bandwidth", None), offloaded=offloaded)
    timings["strategies"] = time.perf_counter() - t
    report(f"strategies {info.shape}")
    t = time.perf_counter()
    merged = merge_followers(sgraph, cost, program.avals, shrink=MERGE_SHRINK if remat_split else None)
    if tie_layers == "auto":
        tie_layers = len(merged.roots) > (TIE_LAYERS_ABOVE_UNDER_BUDGET if remat_split else TIE_LAYERS_ABOVE)
    layer_ties = tie_repeated_layers(merged, program.avals) if tie_layers else None
    budget = memory_budget if memory_budget is not None else getattr(cluster, "memory", None)
    built = build_problem(merged, program, cost, memory_limit=budget, donated_inputs=donated,
                          ties=layer_ties, carried=ties, offloaded=offloaded)
    timings["problem"] = time.perf_counter() - t
    report(f"problem {info.shape}: {built.problem.num_nodes} nodes")
    t = time.perf_counter()
    # Solve without the memory row first: it is much faster, and when its answer fits the budget
    # it is also the constrained optimum. Only otherwise solve again with the budget.
    unconstrained = dataclasses.replace(built.problem, memory_limit=None)
    sol = solve(unconstrained, time_limit=time_limit)
    free_objective, budget_bound = float(sol.cost), budget is not None and sol.peak_memory > budget
    if budget_bound:
        try:
            sol = solve(built.problem, time_limit=max(time_limit - (time.perf_counter() - t), 1.0))
        except InfeasibleError as e:
            if e.smallest_memory is None:
                raise
            origin = "memory_budget" if memory_budget is not None else f"the memory of ClusterSpec {cluster.name!r}"
            err = InfeasibleError(
                f"no plan fits {origin}={budget:.4g} bytes per device on mesh "
                f"{dict(zip(info.names, info.shape, strict=True))}; the smallest peak the solver found is "
                f"{e.smallest_memory:.4g} bytes. Fix: raise memory_budget to at least {e.smallest_memory:.4g}, "
                "or use more devices.", smallest_memory=e.smallest_memory)
            err.unconstrained_objective = free_objective  # a floor for the remat search
            raise err from None
        if not sol.feasible:
            err = InfeasibleError(
                f"the solver found no plan under {budget:.4g} bytes per device within {time_limit:g} s "
                f"(best peak {sol.peak_memory:.4g}). Fix: raise memory_budget or solver_time_limit.",
                smallest_memory=sol.peak_memory)
            err.unconstrained_objective = free_objective
            raise err
    timings["solve"] = time.perf_counter() - t
    report(f"solved {info.shape}")
    dec = decode(built, sol.choice, program, cost)
    in_specs = tuple(dec.value_specs[v] for v in program.graph.invars)
    out_specs = []
    for j, v in enumerate(program.graph.outvars):
        if j in sgraph.output_ties:
            out_specs.append(dec.node_strategy[sgraph.output_ties[j]].out_specs[0])
        elif isinstance(v, int):
            out_specs.append(dec.value_specs[v])
        else:
            out_specs.append(ShardingSpec(((),) * np.ndim(v.value)))
    comm_bytes = sum(c.bytes * k for c, k in dec.collectives)
    reduced = frozenset(v for node, s in zip(built.merged.graph.nodes, dec.node_strategy, strict=True)
                        if node.kind == "op" and node.trips == 1
                        and any(c.kind == "all-reduce" for c in s.collectives) for v in node.outputs)
    memory = estimate_memory(program, dec.value_specs, info, donated=donated, out_specs=out_specs, ties=ties,
                             offloaded=offloaded, operand_specs=dec.operand_specs, reduced=reduced)
    pcost = PlanCost(dec.compute_seconds, dec.comm_seconds, comm_bytes, memory.peak_bytes, float(sol.cost))
    stats = {"timings": dict(timings), "nodes": built.problem.num_nodes, "edges": built.problem.num_edges,
             "graph_nodes": len(sgraph.nodes), "eqns": program.num_eqns, "solver": dict(sol.stats),
             "optimal": sol.optimal, "memory_budget": budget, "budget_bound": budget_bound,
             "unconstrained_objective": free_objective, "solver_peak": float(sol.peak_memory)}
    if offloaded:
        from autoshard.offload import transfer_seconds

        stats["host_transfer_seconds"] = transfer_seconds(program, in_specs, info, offloaded, cluster.host_bandwidth)
    return Plan(
        mesh=mesh,
        in_specs=in_specs,
        out_specs=tuple(out_specs),
        in_paths=program.in_paths,
        in_roles=program_roles(program, ties),
        out_paths=program.out_paths,
        in_avals=tuple((tuple(program.avals[v].shape), str(program.avals[v].dtype)) for v in program.graph.invars),
        cost=pcost,
        collectives=dec.collectives,
        value_specs=dec.value_specs,
        operand_specs=dec.operand_specs,
        fingerprint=program.fingerprint(),
        stats=stats,
        warnings=sgraph.unsupported,
        memory=memory,
        host_inputs=tuple(sorted(offloaded)),
        host_outputs=tuple(sorted(o for o, i in (ties or {}).items() if i in set(offloaded))),
    )


