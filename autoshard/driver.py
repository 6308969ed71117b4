"""The planning driver: a captured program and its options in, a plan out.

::

    plan(request)                                every candidate mesh; the cheapest plan
      plan_on_mesh(request, mesh)                the memory levers in order, checked against XLA
        fit_compiled(...)                        a plan near the budget is compiled; over it, re-plan
          LEVERS: shard -> remat -> offload      lever(request, on, limit, previous) -> Attempt
            solve_sharding(request, on, ...)     strategies, merge, tie, problem, solve, decode -> Plan

Gradient accumulation, the last lever, is another runtime (several programs): the front end
(:mod:`autoshard.api`) takes it when :func:`plan` raises :class:`InfeasibleError`.

Everything between the steps is a frozen value: :class:`PlanRequest` (what the user asked for),
:class:`MeshTarget` (the request made concrete on one mesh), :class:`Attempt` (a lever's plan or
its error, whether the budget bound, and the unconstrained optimum, a floor for the levers that
trade time for memory).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from autoshard.capture import CapturedProgram
from autoshard.errors import InfeasibleError, MeshError
from autoshard.spec import MeshInfo, ShardingSpec

TIE_LAYERS_ABOVE = 300
"""Merged-graph size above which ``tie_layers="auto"`` ties repeated layers."""

TIE_LAYERS_ABOVE_UNDER_BUDGET = 1500
"""The same, when a binding memory budget is searched with remat: a tied group's memory is charged
over the lifetimes of all its layers at once, which hides what recomputing a layer frees."""

MERGE_SHRINK = 8.0
"""Under a remat search, followers this much smaller than their main operand lead their own node."""

CHECK_ABOVE = 0.6
"""A sharding-only plan whose estimated peak is within this fraction of the budget is compiled once
to check XLA's peak. The estimate is within ~15% of it on the fp32 test models, but a bf16 GPT on
XLA:CPU compiles to 1.43x its estimate (f32 temporaries of bf16 elementwise work): at 0.85 a plan
over the budget was returned unchecked."""

ROW_SCALE_MIN = 1.02
"""When no lever fits and the memory model over-predicts XLA's peak by more than this factor (measured
on the unconstrained plan), the levers run again with the solver's memory row scaled by it."""


@dataclasses.dataclass(frozen=True, eq=False)
class PlanRequest:
    """What to plan, and how.

    Attributes:
      program: the captured step.
      mesh: the mesh (Auto axes); None: all devices, or an int: that many devices (``AbstractMesh`` es), with the
        shape chosen among :func:`autoshard.cluster.candidate_meshes`.
      cluster: the :class:`~autoshard.ClusterSpec`; None: the platform's preset.
      memory_budget: bytes per device; None: the cluster's memory.
      hints: ``{path regex: PartitionSpec}`` pinning argument leaves.
      pins: ``{flat argument index: ShardingSpec}``, typed pins on the request's mesh axes (a pipeline
        stage's boundary values in the exchange layout); applied after the hints.
      donated: flat argument indices whose buffers the step may reuse.
      ties: flat output index -> the argument it is the next version of (the carried state).
      time_limit: seconds each solve may take.
      tie_layers: solve repeated layers as one: True, False or ``"auto"`` (large graphs only).
      remat: whether recomputation is a lever when the budget binds.
      progress: ``callback(stage, done, total)`` or None.
      timings: seconds of the passes before planning (capture), copied into each plan's stats.
      profile: the :class:`~autoshard.backends.BackendProfile` of the backend that compiles the plan;
        None: the platform of the mesh's devices (:func:`autoshard.backends.profile_for_mesh`).
      axis_names: the two axis names of 2-D candidate meshes when ``mesh`` is None (the names of the
        Explicit mesh a model was written for, so its annotations apply: :mod:`autoshard.explicit`).
      memo: what the attempts of one planning share (the priced strategies of each cost model's op signatures:
        ``cache`` of :func:`autoshard.planner.enumerate_strategies`); a request made by ``dataclasses.replace``
        shares it, and it goes when the request does.
    """

    program: CapturedProgram
    mesh: Any = None
    cluster: Any = None
    memory_budget: float | None = None
    hints: Mapping = dataclasses.field(default_factory=dict)
    pins: Mapping[int, ShardingSpec] = dataclasses.field(default_factory=dict)
    donated: frozenset = frozenset()
    ties: Mapping[int, int] = dataclasses.field(default_factory=dict)
    time_limit: float = 10.0
    tie_layers: Any = "auto"
    remat: bool = False
    progress: Callable | None = None
    timings: Mapping[str, float] = dataclasses.field(default_factory=dict)
    profile: Any = None
    axis_names: tuple[str, str] = ("data", "model")
    memo: dict = dataclasses.field(default_factory=dict, repr=False)

    def meshes(self) -> list:
        """The candidate meshes: the request's, or :func:`autoshard.cluster.candidate_meshes` of all devices
        (``mesh=None``) or of a device count (``AbstractMesh`` es), for the request's cluster."""
        from autoshard.cluster import candidate_meshes, is_device_count

        if self.mesh is not None and not is_device_count(self.mesh):
            return [self.mesh]
        abstract = self.mesh is not None
        # the preset each candidate gets (default_cluster)
        cluster = self.cluster if self.cluster is not None else _preset_for(None if abstract else jax.devices()[:1])
        n = int(self.mesh) if abstract else len(jax.devices())
        return candidate_meshes(n, cluster, axis_names=self.axis_names, abstract=abstract)


@dataclasses.dataclass(frozen=True, eq=False)
class MeshTarget:
    """A request made concrete on one mesh: its cluster, budget, cost model inputs and pins."""

    mesh: Any
    info: MeshInfo
    cluster: Any
    budget: float | None
    pinned: Mapping[int, ShardingSpec]
    report: Callable[[str], None]
    row_scale: float = 1.0
    """The solver's memory row holds predicted peaks to ``budget * row_scale``: the model's peak over
    XLA's compiled one on this mesh (:func:`calibrated_row_scale`); 1 until a lever chain fails. Every
    compiled check still compares with the budget itself."""
    incumbent: float | None = None
    """The objective of the best plan on another candidate mesh (:func:`plan`): the remat search plans no count
    whose floor reaches it (``choose_remat(incumbent=...)``). None: nothing to beat."""

    @classmethod
    def create(cls, request: PlanRequest, mesh, report=lambda stage: None) -> MeshTarget:
        info = MeshInfo.from_mesh(mesh)
        cluster = default_cluster(mesh) if request.cluster is None else request.cluster
        budget = request.memory_budget if request.memory_budget is not None else getattr(cluster, "memory", None)
        pinned = {**pinned_from_hints(request.program, request.hints, info), **request.pins}
        return cls(mesh, info, cluster, budget, pinned, report)

    @property
    def shape(self) -> dict:
        return dict(zip(self.info.names, self.info.shape, strict=True))

    @property
    def num_devices(self) -> int:
        return math.prod(self.info.shape)

    @property
    def abstract(self) -> bool:
        """An ``AbstractMesh``: planned from the model alone, never compiled (no devices to compile for)."""
        from autoshard.cluster import is_abstract

        return is_abstract(self.mesh)

    def stands_in(self, request: PlanRequest) -> bool:
        """Devices standing in for the cluster's chips: the budget is the cluster's (no ``memory_budget``), a
        chip of another platform than the mesh's devices (an H100 preset on simulated CPU devices). Compiling
        for these devices measures their backend, not that chip's memory, so plans are checked by their
        predicted peak, as on an ``AbstractMesh`` (``verify=True`` still compiles the chosen plan)."""
        from autoshard.backends import profile_for, profile_for_mesh

        hw = getattr(self.cluster, "hardware", None)
        if request.memory_budget is not None or hw is None or self.abstract:
            return False
        return profile_for(hw.accelerator.platform).platform != profile_for_mesh(self.mesh).platform

    def profile(self, request: PlanRequest):
        """The :class:`~autoshard.backends.BackendProfile` a plan on this mesh is estimated and priced with: the
        user's (``PlanRequest.profile``); the cluster's chip's when the devices stand in for it
        (:meth:`stands_in`: the budget is that chip's memory, so the estimate held to it is that chip's backend's,
        not the stand-ins'; GPT-39B on 64 simulated CPU devices for H100s was estimated as XLA:CPU builds it,
        scores written out and collectives in f32, 150 GB where the H100 estimate is 76); else the devices'
        platform's. The lowering still follows the devices that run it (:func:`autoshard.lower.make_flat_function`)."""
        from autoshard.backends import profile_for, resolve_profile

        if request.profile is None and self.stands_in(request):
            return profile_for(self.cluster.hardware.accelerator.platform)
        return resolve_profile(request.profile, self.mesh, self.cluster)


@dataclasses.dataclass(frozen=True, eq=False)
class Attempt:
    """One lever's result: a plan, or the :class:`InfeasibleError` saying why none fits.

    Attributes:
      plan: the plan, or None.
      error: why no plan fits, or None.
      budget_bound: the unconstrained optimum's peak exceeds the budget (a lever that trades time
        for memory may still find a cheaper plan).
      unconstrained_objective: the least predicted objective without the budget.
    """

    plan: Any = None
    error: InfeasibleError | None = None
    budget_bound: bool = False
    unconstrained_objective: float = 0.0

    @property
    def fits(self) -> bool:
        return self.plan is not None

    @property
    def out_of_memory(self) -> bool:
        """No plan fits the device (not: the constraints forbid every assignment)."""
        return self.error is not None and self.error.smallest_memory is not None


def default_cluster(mesh):
    """The :class:`~autoshard.ClusterSpec` preset for the mesh's devices: by ``device_kind`` (an H200 gets
    ``h200``), ``cpu-sim`` on CPU; an ``AbstractMesh`` has no devices to ask, so ``h100-nvlink``, as the GPU
    backend profile."""
    from autoshard.cluster import is_abstract

    return _preset_for(None if is_abstract(mesh) else mesh.devices.flat[:1])


def _preset_for(devices):
    """The preset of :func:`default_cluster` for ``devices``; None: no devices to ask (an ``AbstractMesh``)."""
    from autoshard.cluster import cluster_preset, preset_for_devices

    return cluster_preset("h100-nvlink") if devices is None else preset_for_devices(devices)


# ---- the passes ----------------------------------------------------------------------------------


def plan(request: PlanRequest):
    """The plan of least predicted step time over the request's candidate meshes.

    Raises:
      InfeasibleError: no mesh fits the budget (the one that came closest is reported).
    """
    from autoshard.planner import warn_dropped_pins, warn_indivisible_batch, warn_unsupported

    meshes = request.meshes()
    total, done = 1 + 3 * len(meshes), [1]

    def report(stage: str):
        if request.progress is not None:
            request.progress(stage, done[0], total)
            done[0] += 1

    report("captured")
    targets = [MeshTarget.create(request, mesh, report) for mesh in meshes]
    firsts, infeasible = screen_meshes(request, targets) if len(targets) > 1 else ({}, [])
    best, skipped = None, 0
    for on in sorted(firsts, key=lambda t: firsts[t].unconstrained_objective) if firsts else targets:
        if best is not None and needs_levers(firsts[on]) and firsts[on].unconstrained_objective >= best.cost.objective:
            skipped += 1  # its remat search could not beat the best plan: it costs at least this objective
            continue
        try:
            target = on if best is None else dataclasses.replace(on, incumbent=best.cost.objective)
            p = plan_on_mesh(request, target, first=firsts.get(on))
        except InfeasibleError as e:  # another factorization may fit the memory budget
            if len(meshes) == 1:
                raise
            infeasible.append(e)
            continue
        if best is None or p.cost.total_seconds < best.cost.total_seconds:  # the simulated step ranks meshes
            best = p
    if best is not None and len(meshes) > 1:
        best = dataclasses.replace(best, stats={**best.stats, "meshes_tried": len(meshes),
                                                "meshes_pruned": skipped})
    if best is None:  # report the mesh that comes closest
        raise min(infeasible, key=lambda e: math.inf if e.smallest_memory is None else e.smallest_memory)
    if request.progress is not None:
        request.progress("done", total, total)
    # Warn here, once per plan, not once per candidate mesh.
    warn_unsupported(best.warnings)
    warn_dropped_pins(request.program, best.mesh_info.names)
    warn_indivisible_batch(request.program, request.ties, best.mesh_info)

    def replan(pins):  # for Plan.explain: the same planning on the chosen mesh, with more leaves pinned
        return plan(dataclasses.replace(request, mesh=best.mesh, hints={**request.hints, **pins}, progress=None))

    return dataclasses.replace(best, replan=replan)


def screen_meshes(request: PlanRequest, targets: list) -> tuple[dict, list]:
    """Each candidate mesh's first sharding attempt (the sharding lever's, under the budget), before any mesh
    runs its other levers: ``({target: Attempt}, [InfeasibleError])``, the errors of meshes whose constraints
    admit no plan at all.

    :func:`plan` runs the levers on the meshes in the order of these attempts' objectives without a budget, and
    skips a mesh whose attempt leaves the other levers work (:func:`needs_levers`) when its objective without a
    budget is no less than the best plan's (a plan under the budget, remat included, costs at least that: the
    same floor as the remat search's, which prunes but does not prove, the solves being time-limited). A model
    that fits unbound everywhere is planned once per mesh, as before; one that needs remat runs the remat
    search only on the meshes that may still win."""
    firsts, infeasible = {}, []
    for on in targets:
        try:
            firsts[on] = attempt_sharding(request, on, request.memory_budget, remat_split=request.remat)
        except InfeasibleError as e:
            infeasible.append(e)
    return firsts, infeasible


def needs_levers(first: Attempt) -> bool:
    """Whether a mesh's first sharding attempt leaves the other levers work: nothing fits, or the budget bound."""
    return not first.fits or first.budget_bound


def plan_on_mesh(request: PlanRequest, on: MeshTarget, *, first: Attempt | None = None):
    """Plan on one mesh: the levers in order, and no plan whose compiled peak exceeds the budget.

    Each lever checks its own plans (:func:`shard_lever`, :mod:`autoshard.remat`, :mod:`autoshard.offload`):
    a plan the check finds over the budget is re-planned under a shrunk one, and when that fails too the
    next lever tries. When none fits and the memory row over-predicts (:func:`calibrated_row_scale`), the
    levers run once more with the row scaled. ``first``: the sharding lever's first attempt on ``on``, when
    :func:`screen_meshes` made it already."""

    def levers(target, given=None):  # limit None: the cluster's memory, named so in errors
        return run_levers(request, target, request.memory_budget, first=given)

    try:
        return levers(on, first)
    except InfeasibleError as failed:
        scale = None if failed.smallest_memory is None else calibrated_row_scale(request, on)
        if scale is None or scale <= ROW_SCALE_MIN:
            raise
        try:
            return levers(dataclasses.replace(on, row_scale=scale))
        except InfeasibleError as again:
            raise closest_error([failed, again], fallback=again) from None


def calibrated_row_scale(request: PlanRequest, on: MeshTarget) -> float | None:
    """The memory model's predicted peak over XLA's compiled one, for the plan without a budget on ``on``'s mesh
    (one solve and one compile); None on an AbstractMesh or without a budget.

    The model is fitted to XLA's buffer assignment, but a backend can keep less alive than it predicts (XLA:GPU
    with cuDNN attention: GPT-1.3B in bf16 on one H200, 42.9 GB predicted, 37.2 GB compiled). A budget between
    the two is then refused by every lever's solver row although the plans would compile within it."""
    if predicted_only(request, on) or on.budget is None:
        return None
    from autoshard.compile import compiled_peak

    free = attempt_sharding(request, dataclasses.replace(on, budget=None), None)
    if free.plan is None:
        return None
    compiled = compiled_peak(request.program, free.plan, (), request.donated)
    return free.plan.memory.peak_bytes / compiled if compiled > 0 else None


def predicted_only(request: PlanRequest, on: MeshTarget) -> bool:
    """Whether a plan's memory is checked by its predicted peak, not by compiling its program: on an
    AbstractMesh (no devices to compile for), and for a microbatched pipeline stage (``CapturedProgram.held``),
    which runs as several programs (its microbatch's tasks beside the activations in flight, then its
    update) whose peaks the prediction models and its one program's compile does not; and on devices that
    stand in for the cluster's chips (:meth:`MeshTarget.stands_in`)."""
    return on.abstract or bool(request.program.held) or on.stands_in(request)


def run_levers(request: PlanRequest, on: MeshTarget, limit: float | None, *, first: Attempt | None = None):
    """The memory levers in order under ``limit``: each sees the previous one's :class:`Attempt`.

    When none fits, the error raised is, among those whose peak a plan's check measured
    (``InfeasibleError.checked``), the one that came closest: a later lever's failure does not hide an
    earlier lever that nearly fit (remat compiled at 4.60 MB against a 4.59 MB budget, offload at
    5.88 MB), so the fix it names is the smallest budget known to work. A solver-row bound is not
    compared with a compiled peak; without a checked one the last lever's error stands."""
    attempt, errors = first, []  # the sharding lever's own first attempt, when made already
    for lever in LEVERS:
        attempt = lever(request, on, limit, attempt)
        if attempt.error is not None and attempt.error not in errors:
            errors.append(attempt.error)
    if attempt.fits:
        return attempt.plan
    raise closest_error(errors, fallback=attempt.error)


def closest_error(errors, *, fallback: InfeasibleError) -> InfeasibleError:
    """Of ``errors`` (in the order they were raised), the checked one (``InfeasibleError.checked``) with the least
    peak, the later on a tie; ``fallback`` when none is checked (a solver-row bound is never compared with a
    compiled peak)."""
    checked = [e for e in reversed(errors) if e.checked and e.smallest_memory is not None]
    return min(checked, key=lambda e: e.smallest_memory) if checked else fallback


def shard_lever(request: PlanRequest, on: MeshTarget, limit, previous: Attempt | None) -> Attempt:
    """Sharding alone (merged as the remat search merges, when remat is a lever: see MERGE_SHRINK).

    The plan is checked (:func:`checked_peak`); one over the budget is planned again under a budget shrunk
    by the ratio, at most twice (:func:`autoshard.compile.fit_compiled`). When none fits, the Attempt holds
    the checked error, and the next levers (remat, offload) try under the same budget. ``previous``, the first
    lever's, is this lever's own first attempt when :func:`screen_meshes` made it (else None)."""
    from autoshard.compile import fit_compiled

    first = previous if previous is not None else attempt_sharding(request, on, limit, remat_split=request.remat)
    budget = limit if limit is not None else on.budget
    if not first.fits or budget is None:
        return first

    def search(lim):
        got = attempt_sharding(request, on, lim, remat_split=request.remat)
        if not got.fits:
            raise got.error
        return got.plan

    def refuse(smallest):
        measured = ("the predicted peak (an AbstractMesh: no compile)" if on.abstract else
                    "the predicted peak (a pipeline stage's programs)" if request.program.held else
                    "the predicted peak (devices standing in for the cluster's chips: no compile)"
                    if on.stands_in(request) else "XLA's compiled peak")
        return InfeasibleError(
            f"no sharding plan fits memory budget {budget:.4g} bytes per device on mesh {on.shape}: the planner's "
            f"memory model says one does, but {measured} of each plan found is higher (the lowest, "
            f"{smallest:.4g} bytes; re-planned under a shrunk budget). Fix: raise memory_budget to about "
            f"{smallest:.4g}, or use more devices.", smallest_memory=smallest, checked=True)

    try:
        plan_ = fit_compiled(search, lambda p: checked_peak(request, on, p, budget), budget, limit=limit,
                             refuse=refuse, planned=first.plan)
    except InfeasibleError as e:
        return Attempt(None, e, True, first.unconstrained_objective)
    return dataclasses.replace(first, plan=plan_)


def checked_peak(request: PlanRequest, on: MeshTarget, plan_, budget: float) -> float | None:
    """The peak a sharding-only plan is checked by: XLA's compiled one when the estimate comes within
    ``CHECK_ABOVE`` of ``budget`` (recorded in ``plan.stats["compiled_peak"]``), else None (no compile);
    the estimate itself where nothing is compiled (:func:`predicted_only`)."""
    from autoshard.compile import compiled_peak

    if predicted_only(request, on):
        return plan_.memory.peak_bytes
    if plan_.memory.peak_bytes <= CHECK_ABOVE * budget:
        return None
    plan_.stats["compiled_peak"] = compiled_peak(request.program, plan_, (), request.donated)
    return plan_.stats["compiled_peak"]


def remat_lever(request: PlanRequest, on: MeshTarget, limit, previous: Attempt) -> Attempt:
    """When the budget binds (or nothing fits), recompute forward segments too (:mod:`autoshard.remat`)."""
    if not request.remat or not (previous.budget_bound or previous.out_of_memory):
        return previous
    from autoshard.compile import compiled_peak
    from autoshard.remat import choose_remat

    program = request.program
    budget = limit if limit is not None else on.budget
    try:
        plan_, choice = choose_remat(
            lambda prog, lim: remat_candidate(request, on, prog, lim),
            program, request.ties, budget=budget, flops_per_second=on.cluster.flops * on.num_devices,
            check=(lambda p, prog, groups: p.memory.peak_bytes) if predicted_only(request, on) else (
                lambda p, prog, groups: compiled_peak(prog, p, groups, request.donated)),
            base=previous, incumbent=on.incumbent, checked_by="the planner's memory estimate (nothing is compiled for an AbstractMesh, a "
                                      "pipeline stage's programs or devices standing in for the cluster's chips)" if predicted_only(request, on) else
                                      "XLA's memory_analysis")
    except InfeasibleError as e:
        return dataclasses.replace(previous, plan=None, error=e)
    if choice is not None:
        plan_ = dataclasses.replace(plan_, fingerprint=program.fingerprint(), remat=choice)
    return dataclasses.replace(previous, plan=plan_, error=None)


def remat_candidate(request: PlanRequest, on: MeshTarget, program: CapturedProgram, limit: float) -> Attempt:
    """The plan of one program of the remat search (:func:`remat_lever`) under ``limit``.

    A candidate (not the request's program itself, whose unconstrained objective floors the others) far from
    fitting is refused without its probe (``refuse_early`` of :func:`attempt_sharding`), and one whose probe fits
    keeps the probe's answer (``screen``): the candidates are compared at the probe's effort. Where a plan's memory is
    checked by its predicted peak (:func:`predicted_only`), a plan predicted over ``limit`` does not fit: the
    check after the search would refuse it, and the search must not take it for a count that fits. A
    time-limited solve can answer with such a plan where the memory row says it fits: Llama-3.1-70B on
    (32, 2, 4) with 50 of 55 segments recomputed, objective 90 times the best and 195 GB against 86, which led the
    bisection (:meth:`autoshard.remat.RematSearch._bisect`) down through six counts that cannot fit, 45 s."""
    candidate = program is not request.program
    got = attempt_sharding(request, on, limit, program=program, remat_split=True, refuse_early=candidate,
                           screen=candidate)
    peak = None if got.plan is None else got.plan.memory.peak_bytes
    if peak is None or peak <= limit or not predicted_only(request, on):
        return got
    return dataclasses.replace(got, plan=None, budget_bound=True, error=InfeasibleError(
        f"the plan found under {limit:.4g} bytes per device on mesh {on.shape} is predicted at {peak:.4g} bytes "
        f"(a solve stopped by its time limit may answer over the budget its memory row admits). Fix: raise "
        f"memory_budget or solver_time_limit.", smallest_memory=peak))


def offload_lever(request: PlanRequest, on: MeshTarget, limit, previous: Attempt) -> Attempt:
    """When nothing fits the device, keep optimizer state in host memory (:mod:`autoshard.offload`)."""
    if previous.fits or not previous.out_of_memory:
        return previous
    from autoshard.compile import compiled_peak
    from autoshard.offload import plan_with_offload

    program = request.program
    budget = limit if limit is not None else on.budget

    def solve_with(offloaded, lim):
        got = attempt_sharding(request, on, lim, offloaded=offloaded)
        if not got.fits:
            raise got.error
        return got.plan

    try:
        plan_ = plan_with_offload(solve_with, program, dict(request.ties), previous.error, budget=budget,
                                  num_devices=on.num_devices,
                                  check=(lambda p: p.memory.peak_bytes) if predicted_only(request, on) else (
                                      lambda p: compiled_peak(program, p, (), request.donated)))
    except InfeasibleError as e:
        return dataclasses.replace(previous, error=e)
    return dataclasses.replace(previous, plan=plan_, error=None)


LEVERS = (shard_lever, remat_lever, offload_lever)
"""The memory levers of one program, in order. Accumulation comes after them, in the front end."""


def attempt_sharding(request: PlanRequest, on: MeshTarget, limit, *, program=None, offloaded=(),
                     remat_split=False, refuse_early=False, screen=False) -> Attempt:
    """One sharding plan: strategies, follower merging, layer tying, the problem, the solve, the decode.

    ``program`` (default the request's) may be a rewritten one (remat candidates); ``offloaded``
    lists argument leaves kept in host memory; ``limit`` overrides the budget (None: the target's);
    ``remat_split`` merges and ties as the remat search needs (see ``MERGE_SHRINK``); ``refuse_early``: a
    budget the memory row cannot reach is refused before the unconstrained probe, whose objective the attempt
    then does not have (``unconstrained_objective`` is NaN; see :func:`solve_under_budget`); ``screen``: a probe
    whose answer fits is the answer (no second unconstrained solve; see :func:`solve_under_budget`).

    Returns:
      An :class:`Attempt`: the plan, or the :class:`InfeasibleError` of a budget no plan meets.

    Raises:
      InfeasibleError: the constraints (pins, forbidden strategies) admit no plan at all.
    """
    from autoshard.cost import CostModel
    from autoshard.planner import build_problem, enumerate_strategies, merge_followers

    program = request.program if program is None else program
    budget = limit if limit is not None else on.budget
    row = None if budget is None else budget * on.row_scale
    profile = on.profile(request)
    cost = CostModel.create(on.info, on.cluster, profile=profile)
    run = _Passes(dict(request.timings), on)
    sgraph = run("strategies", enumerate_strategies, program, cost, pinned=on.pinned, donated=request.donated,
                 tie_outputs=request.ties, host_bandwidth=getattr(on.cluster, "host_bandwidth", None),
                 offloaded=offloaded, cache=_strategy_cache(request, cost, profile))
    merged = run("merge", merge_followers, sgraph, cost, program.avals, shrink=MERGE_SHRINK if remat_split else None)
    ties = run("tie", _layer_ties, merged, program, request.tie_layers, remat_split)
    built = run("problem", build_problem, merged, program, cost, memory_limit=row, ties=ties,
                donated_inputs=request.donated, carried=request.ties, offloaded=offloaded)
    solved = _Solved(program, sgraph, built, cost, None, tuple(offloaded))
    # id(solution) -> (the solution, kept alive so that its id stays its own; its _decoded_memory): the plan
    # reuses its fit check's decode
    decoded = {}

    def decode(s):
        if id(s) not in decoded:
            decoded[id(s)] = (s, _decoded_memory(request, on, dataclasses.replace(solved, sol=s)))
        return decoded[id(s)][1]

    def peak_of(s):  # the model's estimate of a solution's peak
        return decode(s)[2].peak_bytes

    sol, free_objective, budget_bound, error, calibration = run(
        "solve", solve_under_budget, request, on, built, row, limit, peak_of=peak_of if profile.calibrate_row else None,
        refuse_early=refuse_early, screen=screen)
    if error is not None:
        return Attempt(error=error, budget_bound=True, unconstrained_objective=free_objective)
    plan_ = run("decode", _decoded_plan, request, on, dataclasses.replace(solved, sol=sol),
                decoded=decoded.get(id(sol), (None, None))[1],
                stats={"timings": run.timings, "nodes": built.problem.num_nodes, "edges": built.problem.num_edges,
                       "graph_nodes": len(sgraph.nodes), "eqns": program.num_eqns, "solver": dict(sol.stats),
                       "optimal": sol.optimal, "memory_budget": budget, "budget_bound": budget_bound,
                       "unconstrained_objective": free_objective, "row_calibration": calibration,
                       # in the budget's units, as fit_compiled compares it
                       "solver_peak": float(sol.peak_memory) / (calibration * on.row_scale)})
    return Attempt(plan_, None, budget_bound, free_objective)


STRATEGY_CACHES = 2
"""How many cost models' strategy caches (one per mesh planned) a planning keeps (the most recently used): the
remat search's candidates on one mesh share one; the screening of many candidate meshes does not hold them all."""


def _strategy_cache(request: PlanRequest, cost, profile) -> dict:
    """The strategy cache of ``request``'s planning for ``cost`` under ``profile`` (see ``PlanRequest.memo``)."""
    from autoshard.cost import recent_dict

    return recent_dict(request.memo.setdefault("strategies", {}), (cost, profile), STRATEGY_CACHES)


class _Passes:
    """Runs the passes of :func:`attempt_sharding` one per line: times each (``plan.stats["timings"]``)
    and reports the ones the progress callback counts."""

    REPORTS = {
        "strategies": lambda shape, out: f"strategies {shape}",
        "problem": lambda shape, out: f"problem {shape}: {out.problem.num_nodes} nodes",
        "solve": lambda shape, out: f"solved {shape}",
    }

    def __init__(self, timings: dict, on: MeshTarget):
        self.timings, self.on = timings, on

    def __call__(self, name: str, fn: Callable, *args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        self.timings[name] = time.perf_counter() - t
        if name in self.REPORTS and not (name == "solve" and out[3] is not None):
            self.on.report(self.REPORTS[name](self.on.info.shape, out))
        return out


def _layer_ties(merged, program: CapturedProgram, tie_layers, remat_split: bool):
    """The repeated-layer groups to solve as one (``tie_layers``: True, False or ``"auto"``), or None."""
    from autoshard.planner import tie_repeated_layers

    if tie_layers == "auto":
        tie_layers = len(merged.roots) > (TIE_LAYERS_ABOVE_UNDER_BUDGET if remat_split else TIE_LAYERS_ABOVE)
    return tie_repeated_layers(merged, program.avals) if tie_layers else None


# The solve without the memory row first runs as a probe for this share of the time limit (at least
# PROBE_MIN_S): when its answer fits, a second free solve gets the rest, else the solve under the budget.
PROBE_SHARE = 0.2
PROBE_MIN_S = 1.0

ROW_CALIBRATION = 1.5
"""The most the memory row's limit is raised by a probe's row over its estimate (1.1x to 1.3x measured): a
larger ratio means a program the estimate does not schedule as the row does, and is not trusted."""


def solve_under_budget(request: PlanRequest, on: MeshTarget, built, budget, limit, *, peak_of=None,
                       refuse_early=False, screen=False):
    """Solve without the memory row first: it is much faster, and when its answer fits the budget it is
    also the constrained optimum. Only otherwise solve again with the budget (see ``PROBE_SHARE``).

    ``peak_of(solution)``, when given, is the memory model's estimate of a solution's peak (the one a plan
    reports and its checks compare). The row prices live values in the program's own order of ops, the
    estimate in the order its list schedule finds, so the row says more: 1.1x to 1.3x on the benchmark
    models, 1.24x for GPT-1.3B on one device. A probe over the row but within the budget by its estimate
    fits; one over both calibrates the row: the budgeted solve holds the row to ``budget`` times the
    probe's row over its estimate (see ``ROW_CALIBRATION``; a row that refuses short of that ceiling: :func:`_rescued`).

    The budget binds when the probe is over it, and also when a longer free solve finds a cheaper plan over it
    (then the budgeted search runs with the probe's time again; the probe's plan stays when it finds nothing
    cheaper that fits: Llama-3.1-70B on (32, 4, 2) with 52 of 55 segments recomputed, a probe at objective 1,747
    under the budget, the longer solve's 19.3 over it, the budgeted search's 19.2 under it).
    ``refuse_early``: a budget out of the row's reach (:func:`_out_of_reach`) is refused before the probe.
    ``screen``: a probe whose answer fits is the answer, with no second unconstrained solve, unless it is far from
    its bound (``SCREEN_GAP``): the remat search's candidates (:func:`remat_candidate`) are compared so.

    Returns ``(solution, unconstrained objective, whether the budget bound, error, calibration)``; the error (and
    no solution) when the memory row admits no plan; ``calibration``: the row limit's factor (1 when none)."""
    from autoshard.solver import solve

    t = time.perf_counter()
    free = dataclasses.replace(built.problem, memory_limit=None)
    if budget is None:
        sol = solve(free, time_limit=request.time_limit)
        return sol, float(sol.cost), False, None, 1.0
    least = _out_of_reach(built.problem, budget, calibrated=peak_of is not None) if refuse_early else None
    if least is not None:
        return None, math.nan, True, _refused(on, budget, limit, least), 1.0

    def fits(s):
        return s.peak_memory <= budget or (peak_of is not None and peak_of(s) <= budget)

    # A probe without the row tells whether the budget binds (the free answers' peaks barely move with more time), so
    # a binding budget leaves the search under it most of the time: memory-priced searches are slow to fit (GPT-1.3B
    # on (2, 4) under 1.5x its least-memory peak: 1.76x the best at 5 s, 1.01x at 30 s).
    sol = solve(free, time_limit=min(request.time_limit, max(PROBE_SHARE * request.time_limit, PROBE_MIN_S)))
    # the probe's estimate, wanted only where its row is over the budget
    estimate = peak_of(sol) if peak_of is not None and sol.peak_memory > budget else None
    free_objective = float(sol.cost)
    budget_bound = sol.peak_memory > budget and (estimate is None or estimate > budget)
    left = request.time_limit - (time.perf_counter() - t)
    if not budget_bound:
        if not sol.optimal and left > PROBE_MIN_S and not (screen and _credible(sol)):
            more = solve(free, time_limit=left, seed=1)
            free_objective = min(free_objective, float(more.cost))
            if more.cost < sol.cost and fits(more):
                sol = more
            elif more.cost < sol.cost:
                # A cheaper unconstrained plan over the budget: it binds after all. The probe's plan fits, but
                # may be far from the best that does; the budgeted search gets the probe's time after it, its
                # plan kept when it fits by the estimate as well (the calibrated row may admit more).
                over = peak_of(more) if peak_of is not None else None
                bound = _budgeted(built.problem, budget, _calibration(more, over), max(left, 1.0))
                sol = bound if bound is not None and bound.feasible and fits(bound) and bound.cost < sol.cost else sol
                return sol, free_objective, True, None, 1.0
        return sol, free_objective, False, None, 1.0
    calibration = _calibration(sol, estimate)
    problem = built.problem if calibration == 1.0 else dataclasses.replace(built.problem,
                                                                           memory_limit=budget * calibration)
    try:
        sol = solve(problem, time_limit=max(left, 1.0))
    except InfeasibleError as e:
        if e.smallest_memory is None:
            raise
        rescued = _rescued(built.problem, e.smallest_memory, budget, peak_of, max(left, 1.0)) if _rescuable(
            calibration, screen) else None
        if rescued is not None:
            return rescued, free_objective, budget_bound, None, calibration
        return None, free_objective, budget_bound, _refused(on, budget, limit, e.smallest_memory / calibration), \
            calibration
    if not sol.feasible:
        return None, free_objective, budget_bound, InfeasibleError(
            f"the solver found no plan under {budget:.4g} bytes per device within {request.time_limit:g} s "
            f"(best peak {sol.peak_memory / calibration:.4g}). Fix: raise memory_budget or solver_time_limit.",
            smallest_memory=sol.peak_memory / calibration), calibration
    return sol, free_objective, budget_bound, None, calibration


SCREEN_GAP = 0.5
"""A screened probe's answer (``screen`` of :func:`solve_under_budget`) stands when its relative gap to the solve's
lower bound is at most this; a larger one gets the second solve. Llama-3.1-70B's remat candidates on (2, 16, 8)
(cores of 300-500 nodes, millions of cost cells) probed at 0.16-0.19 against toulbar2's early bound, yet within 0.6%
of the bound the second solve then proved, and that solve (7-8 s a candidate) answered the same or worse in five of
five. A probe cut short before any search answers the per-node argmins, at 0.999 (objective 1,747 against 19.3 on
(32, 2, 4))."""


def _credible(sol) -> bool:
    """Whether a probe's answer is close enough to its bound to stand without a second solve (``SCREEN_GAP``)."""
    gap = sol.stats.get("gap")
    return gap is not None and gap <= SCREEN_GAP


def _rescuable(calibration: float, screen: bool) -> bool:
    """Whether a budget the calibrated row refuses is tried again under raised row limits (:func:`_rescued`): where the
    probe calibrated the row short of ``ROW_CALIBRATION``, but not for a remat candidate whose probe calibrated it at
    all (``screen``): the remat search answers its refusal with more recomputation, and rescuing each candidate would
    spend its solve's time again."""
    return calibration < ROW_CALIBRATION and not (screen and calibration > 1.0)


def _rescued(problem, smallest: float, budget: float, peak_of, time_limit: float):
    """Where the estimate is the one trusted (``peak_of`` given), the probe calibrated the row less than it can be
    (``ROW_CALIBRATION``) and the row refuses ``budget`` (its least peak ``smallest`` over the limit): a plan solved
    under a raised row limit whose estimate is within ``budget``, else None. The limits tried, in turn:
    ``ROW_CALIBRATION`` times the budget (the most a calibration raises it to), then halfway down to ``smallest``, then
    an eighth of the way; none when ``smallest`` is over the first. A solve fills its row to its limit, so the lower
    rungs find the plans whose row is over their estimate by more than the probe's.

    The calibration comes from the unconstrained probe, whose row over its estimate can be less than a low-memory
    plan's, or under it (gathered copies are not in the row): MaxText-52B's stage on 192 TPU v4 with FSDP 192, its row
    38.7 GB and its estimate 24.9 GB for the published layout, the probe's 104 and 153 GB, so a 31.1 GB budget was
    refused (least row peak 35.5 GB) though the published layout fits it by the estimate; MaxText-scale32's on 64 v5p
    with (16, 1, 4), the published layout's row 98.5 GB over its estimate 88.6 (1.11x), the probe's less, so 95.9 GB
    was refused (least row peak 97.3 GB)."""
    from autoshard.solver import solve

    ceiling = ROW_CALIBRATION * budget
    if peak_of is None or smallest > ceiling:
        return None
    rungs = (ceiling, (smallest + ceiling) / 2, smallest + (ceiling - smallest) / 8)
    for row in rungs:
        try:
            sol = solve(dataclasses.replace(problem, memory_limit=row), time_limit=time_limit / len(rungs))
        except InfeasibleError:
            continue
        if sol.feasible and peak_of(sol) <= budget:
            return sol
    return None


def _out_of_reach(problem, budget: float, *, calibrated: bool) -> float | None:
    """The memory row's least peak (:func:`autoshard.solver.least_peak`) when it is over the most the row's limit
    can be raised to (``ROW_CALIBRATION`` times ``budget`` where a probe calibrates the row, else ``budget``), so
    that no plan fits whatever a probe says; else None. The remat search's candidates far from fitting cost a
    probe and its estimate each otherwise (2-4 s of 7-8 s for Llama-3.1-70B on 256, whose first coarse segment
    leaves 535 GB against 86). Such a refusal has no unconstrained objective (NaN)."""
    from autoshard.solver import least_peak

    least = least_peak(problem)
    return least if least > budget * (ROW_CALIBRATION if calibrated else 1.0) * (1 + 1e-9) else None


def _refused(on: MeshTarget, budget: float, limit, smallest: float) -> InfeasibleError:
    """The error of a budget the memory row admits no plan under; ``smallest`` is the least peak it reaches."""
    origin = "memory_budget" if limit is not None else f"the memory of ClusterSpec {on.cluster.name!r}"
    return InfeasibleError(
        f"no plan fits {origin}={budget:.4g} bytes per device on mesh {on.shape}; the smallest peak the "
        f"solver found is {smallest:.4g} bytes. Fix: raise memory_budget to at least "
        f"{smallest:.4g}, or use more devices.", smallest_memory=smallest)


def _calibration(sol, estimate) -> float:
    """The factor the memory row's limit is raised by for a solution whose row is over the budget but whose
    estimate is ``estimate`` (None: not estimated): its row over its estimate, within ``[1, ROW_CALIBRATION]``."""
    return 1.0 if estimate is None else min(max(sol.peak_memory / estimate, 1.0), ROW_CALIBRATION)


def _budgeted(problem, budget: float, calibration: float, time_limit: float):
    """The budgeted solve of ``problem`` (row limit ``budget`` times ``calibration``), or None when it is refused."""
    from autoshard.solver import solve

    try:
        return solve(dataclasses.replace(problem, memory_limit=budget * calibration), time_limit=time_limit)
    except InfeasibleError:
        return None


@dataclasses.dataclass(frozen=True, eq=False)
class _Solved:
    """A solved sharding problem and what it was built from."""

    program: CapturedProgram
    sgraph: Any  # planner.StrategyGraph
    built: Any  # planner.BuiltProblem
    cost: Any  # cost.CostModel
    sol: Any  # solver.ShardingSolution
    offloaded: tuple


def _decoded_memory(request: PlanRequest, on: MeshTarget, solved: _Solved):
    """``(decoded, out_specs, MemoryEstimate)`` of a solved problem: the model's peak is what a plan reports."""
    from autoshard.memory import estimate_memory
    from autoshard.planner import decode

    program, sgraph, built = solved.program, solved.sgraph, solved.built
    dec = decode(built, solved.sol.choice, program, solved.cost)
    out_specs = []
    for j, v in enumerate(program.graph.outvars):
        if j in sgraph.output_ties:
            out_specs.append(dec.node_strategy[sgraph.output_ties[j]].out_specs[0])
        elif isinstance(v, int):
            out_specs.append(dec.value_specs[v])
        else:
            out_specs.append(ShardingSpec(((),) * np.ndim(v.value)))
    reduced = frozenset(v for node, s in zip(built.merged.graph.nodes, dec.node_strategy, strict=True)
                        if node.kind == "op" and node.trips == 1
                        and any(c.kind == "all-reduce" for c in s.collectives) for v in node.outputs)
    # a gradient kept unreduced over a pipeline's microbatches holds its partial sums' size (Plan.deferred)
    memory = estimate_memory(program, dec.value_specs, on.info, donated=request.donated, out_specs=out_specs,
                             ties=request.ties, offloaded=solved.offloaded, operand_specs=dec.operand_specs,
                             reduced=reduced, profile=on.profile(request),
                             held_specs=dec.deferred)
    return dec, out_specs, memory


def _decoded_plan(request: PlanRequest, on: MeshTarget, solved: _Solved, *, stats: dict, decoded=None):
    """The :class:`~autoshard.Plan` of a solved problem: specs, collectives, predicted cost and memory.
    ``decoded``: the solution's :func:`_decoded_memory`, when made already (a fit check estimated it)."""
    from autoshard.plan import Plan, PlanCost
    from autoshard.roles import program_roles

    program, sgraph, sol, offloaded = solved.program, solved.sgraph, solved.sol, solved.offloaded
    dec, out_specs, memory = _decoded_memory(request, on, solved) if decoded is None else decoded
    in_specs = tuple(dec.value_specs[v] for v in program.graph.invars)
    ties = request.ties
    comm_bytes = sum(c.bytes * k for c, k in dec.collectives)
    from autoshard.planner import simulate_step

    t = simulate_step(sgraph, dec.node_strategy, program, solved.cost)
    stats["perf"] = {"streams": t.busy, "by_kind": t.by_kind,
                     "forward_share": t.forward_seconds / t.compute_seconds if t.compute_seconds else 1 / 3}
    pcost = PlanCost(t.compute_seconds, t.communication_seconds, comm_bytes, memory.peak_bytes, float(sol.cost),
                     step_seconds=t.step_seconds, exposed_communication_seconds=t.exposed_seconds, flops=t.flops,
                     hbm_bytes=t.hbm_bytes)
    if offloaded:
        from autoshard.offload import transfer_seconds

        stats["host_transfer_seconds"] = transfer_seconds(program, in_specs, on.info, offloaded,
                                                          on.cluster.host_bandwidth)
    return Plan(
        mesh=on.mesh, in_specs=in_specs, out_specs=tuple(out_specs), in_paths=program.in_paths,
        in_roles=program_roles(program, ties), out_paths=program.out_paths,
        in_avals=tuple((tuple(program.avals[v].shape), str(program.avals[v].dtype)) for v in program.graph.invars),
        cost=pcost, collectives=dec.collectives, value_specs=dec.value_specs, operand_specs=dec.operand_specs,
        fingerprint=program.fingerprint(), stats=stats, warnings=sgraph.unsupported, memory=memory,
        host_inputs=tuple(sorted(offloaded)),
        host_outputs=tuple(sorted(o for o, i in ties.items() if i in set(offloaded))),
        deferred=frozenset(dec.deferred),
    )


def pinned_from_hints(program, hints, info: MeshInfo) -> dict[int, ShardingSpec]:
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
