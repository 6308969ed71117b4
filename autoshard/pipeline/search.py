"""Inter-operator search: layer cut, stage DP, sub-meshes and each stage's intra-op plan.

``plan_stages`` turns a :class:`StepAnalysis` into a :class:`Partition`, one mesh and one intra-op
plan per stage, and the :class:`PipelinePlan` report:

1. forward ops -> layers (``pipeline_boundary`` runs, or :func:`cluster_layers`);
2. each distinct layer (same ops and shapes: repeated blocks are planned once) is planned on every
   sub-mesh option, giving per-layer time, memory and residual bytes;
3. :func:`assign_stages` (or, with fixed ``submeshes``, a scan over the layer cuts) picks stages;
4. the final stages are planned with :func:`autoshard.driver.plan` on their sub-meshes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import time
import warnings

import jax
import numpy as np
from jax.sharding import PartitionSpec

from autoshard.capture import CapturedProgram, OpGraph
from autoshard.cluster import mesh_like, mesh_shape
from autoshard.errors import InfeasibleError, InputError, MeshError
from autoshard.pipeline.accumulate import StepAnalysis
from autoshard.pipeline.cluster_layers import boundary_layers, cluster_layers, op_flops, repeat_period
from autoshard.pipeline.options import PipelineOptions
from autoshard.pipeline.partition import Partition, forward_positions, partition
from autoshard.pipeline.plan import PipelinePlan, StagePlan
from autoshard.pipeline.recompute import recompute_forward
from autoshard.pipeline.schedule import chain_deps, max_in_flight, simulate, stage_orders
from autoshard.pipeline.stage_dp import StageProblem, assign_stages
from autoshard.pipeline.submesh import (
    SubmeshOption,
    allocate,
    check_submeshes,
    physical_grid,
    submesh_options,
)
from autoshard.spec import MeshInfo, ShardingSpec
from autoshard.strategies import op_info

AXES = ("data", "model")


def stage_program(analysis: StepAnalysis, part: Partition, stage: int, *,
                  reduce_gradients: str = "step", held: bool = False) -> CapturedProgram:
    """One microbatch's forward + backward of ``stage``, then the update of what the stage owns, as a program
    the intra-op planner takes.

    The update (the ``R`` tasks of the stage) is in it so that the stage's plan lays out its optimizer state
    and counts it: a stage holds its weights' optimizer state for the whole step. It reads one microbatch's
    gradients where the runtime reads their sum (the same shapes).

    The solver weighs the ops by how often they run in a step (``CapturedProgram.op_weights``): the
    microbatch's ops ``k`` times, the update once, and, with ``reduce_gradients="step"``, the reduction of the
    sums that make gradients once too (the runtime reduces their partials once per step,
    :mod:`autoshard.pipeline.deferred`).
    So a layout that gathers weights in every microbatch is not traded for a cheaper update.

    ``held`` (``CapturedProgram.held``): the running sums of the gradients are held for the whole step, as
    the runtime holds them, and one the plan reduce-scatters is either reduced every microbatch or held
    unreduced, as the plan chooses (``Plan.deferred``); a stage the runtime runs is planned so. Without
    it, a reduce-scatter is priced once at its reduced size, and the sums count while made and read: the
    least a stage can cost, which the layer costs of the stage search take."""
    micro = part.micro_tasks(stage)
    tasks = [*micro, *(t for t in part.update_tasks() if t.key[1] == stage)]
    ops, produced, invars = [], set(), []
    for t in tasks:
        for op in t.ops:
            if any(v in produced for v in op.outputs):  # a replicable op in both tasks
                continue
            ops.append(op)
            produced.update(op.outputs)
    for op in ops:
        for x in op.inputs:
            if isinstance(x, int) and x not in produced and x not in invars:
                invars.append(x)
    internal = part.internal_values(stage, analysis.full.graph.outvars)
    outvars = [v for t in tasks for v in t.outvars if v not in internal]
    full = analysis.full
    pos = {v: i for i, v in enumerate(full.graph.invars)}
    batch = {full.graph.invars[p] for p in analysis.batch_inputs}
    # Activations, cotangents and batch slices arrive from outside the stage: name them "<boundary>" so
    # that planning can pin them to the layout stages exchange.
    paths = tuple(f"<boundary {v}> {full.in_paths[pos[v]]}" if v in batch else full.in_paths[pos[v]] if v in pos
                  else f"<boundary {v}>" if v in part.producer_task else f"<value {v}>" for v in invars)
    # A part of the program: its ops keep the whole program's indices (its plan is applied to them).
    program = CapturedProgram.from_graph(OpGraph(tuple(invars), tuple(ops), tuple(dict.fromkeys(outvars))),
                                         analysis.micro.avals, in_tree=None, out_tree=None, in_paths=paths,
                                         out_paths=tuple(f"<value {v}>" for v in dict.fromkeys(outvars)), consts={})
    runs, reductions = _per_step_weights(analysis, micro, reduce_gradients)
    sums = frozenset(v for t in micro for v in t.frontier) if held and analysis.num_microbatches > 1 else frozenset()
    return dataclasses.replace(program, op_weights=runs, reduce_weights=reductions, held=sums)


def _per_step_weights(analysis: StepAnalysis, micro_tasks, reduce_gradients: str):
    """``(op index -> runs per step, op index -> reductions per step)`` of the microbatch tasks' ops (see
    :func:`stage_program`): every op runs ``k`` times; a sum that makes a gradient reduces once."""
    k = analysis.num_microbatches
    if k == 1:
        return {}, {}
    runs, reductions = {}, {}
    for task in micro_tasks:   # an op in both (state-only, or recomputed in the backward) runs in both
        frontier = set(task.frontier)
        for op in task.ops:
            runs[op.index] = runs.get(op.index, 0.0) + float(k)
            if (reduce_gradients == "step" and len(op.outputs) == 1 and op.outputs[0] in frontier
                    and op_info(op.name).summed_dims is not None):
                reductions[op.index] = 1.0
    return runs, reductions


BOUNDARY_LAYOUT = PartitionSpec("data")
"""Values crossing layers or stages: batch split over "data", replicated over "model" (Megatron + DP)."""


def is_boundary(path: str) -> bool:
    """Whether a stage program's argument path (see :func:`stage_program`) names a value from outside."""
    return path.startswith("<boundary")


def boundary_pins(program: CapturedProgram, mesh) -> dict[int, ShardingSpec]:
    """The exchange layout (:data:`BOUNDARY_LAYOUT`) of every boundary argument, as typed pins.

    Empty when some boundary value cannot take it (a scalar, or a leading axis that "data" does not
    divide, e.g. a microbatch smaller than the data axis), or when there is none: the layer or stage
    is then planned with its boundaries free."""
    info = MeshInfo.from_mesh(mesh)
    pins = {}
    for i, path in enumerate(program.in_paths):
        if not is_boundary(path):
            continue
        shape = tuple(program.avals[program.graph.invars[i]].shape)
        if len(shape) < len(BOUNDARY_LAYOUT):
            return {}
        spec = ShardingSpec.from_partition_spec(BOUNDARY_LAYOUT, len(shape), info)
        if any(n % info.axes_size(axes) for n, axes in zip(shape, spec.dims, strict=True)):
            return {}
        pins[i] = spec
    return pins


def boundary_ties(program: CapturedProgram, part: Partition) -> dict[int, int]:
    """Outputs sent to another layer keep the layout of a same-shaped boundary input (h_out like h_in).

    A layer planned alone would otherwise hand its successor any layout for free; tying prices the
    conversion back to the boundary layout inside the layer, so per-layer costs add up honestly."""
    free = [i for i, p in enumerate(program.in_paths) if is_boundary(p)]
    ties = {}
    for j, v in enumerate(program.graph.outvars):
        if not isinstance(v, int) or v in part.frontier_values or part.producer_task.get(v, ("R",))[0] == "R":
            continue
        a = program.avals[v]
        for i in free:
            b = program.avals[program.graph.invars[i]]
            if tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype:
                ties[j] = i
                free.remove(i)
                break
    return ties


def state_ties(program: CapturedProgram, analysis: StepAnalysis) -> dict[int, int]:
    """Outputs of a stage program that are the next version of one of its arguments (an updated weight, its
    optimizer state), by position: the runtime hands them back in the argument's layout, so the plan prices
    the reshard (the all-gather of a weight updated in shards)."""
    position = {v: i for i, v in enumerate(program.graph.invars)}
    return {j: position[analysis.carried[v]] for j, v in enumerate(program.graph.outvars)
            if isinstance(v, int) and analysis.carried.get(v) in position}


def plan_boundaries(program: CapturedProgram, part: Partition, mesh, cluster, time_limit, *, tie_layers="auto",
                    profile=None, memory_budget=None, carried=None):
    """The intra-op plan of a layer or stage with its boundary values pinned to the exchange layout
    (:func:`boundary_pins`) and its outputs tied to them (with neither when the layout does not fit), and
    ``carried`` (:func:`state_ties`): its next-state outputs tied to their arguments."""
    from autoshard.driver import PlanRequest, plan

    pins = boundary_pins(program, mesh)
    ties = {**(boundary_ties(program, part) if pins else {}), **(carried or {})}
    return plan(PlanRequest(program, mesh=mesh, cluster=cluster, time_limit=time_limit, pins=pins, ties=ties,
                            tie_layers=tie_layers, profile=profile, memory_budget=memory_budget))


def residual_bytes(analysis: StepAnalysis, part: Partition, stage: int) -> float:
    """Bytes per microbatch that ``stage`` keeps from its forward until its backward: what its backward reads of
    the forward passes (its own residuals, or with :mod:`~autoshard.pipeline.recompute` the stage's inputs)
    and of the batch."""
    tasks = {t.phase: t for t in part.micro_tasks(stage)}
    if "F" not in tasks or "B" not in tasks:
        return 0.0
    batch = {analysis.full.graph.invars[p] for p in analysis.batch_inputs}
    held = [v for v in tasks["B"].invars if v in batch or part.producer_task.get(v, ("",))[0] == "F"]
    return float(sum(_nbytes(analysis.avals[v]) for v in held))


def _nbytes(aval) -> float:
    return float(math.prod(getattr(aval, "shape", ())) * aval.dtype.itemsize)


def stage_seconds(plan, analysis: StepAnalysis) -> float:
    """Predicted seconds of one microbatch of a stage for the stage DP: a ``k``-th of what its plan's solver
    minimised, the stage's whole step (:func:`stage_program` weighs the microbatch's ops ``k`` times, the
    update and, with ``reduce_gradients="step"``, the gradients' reductions once)."""
    if plan is None:
        return 0.0
    k = analysis.num_microbatches
    return plan.cost.total_seconds if k == 1 else plan.cost.objective / k


def _fingerprint(program: CapturedProgram) -> str:
    h = hashlib.sha256()
    for op in program.graph.ops:
        h.update(op.name.encode())
        h.update(str([program.avals[v] for v in op.outputs]).encode())
        h.update(str(sorted((k, str(v)) for k, v in op.params.items() if k != "jaxpr")).encode())
    for v in program.graph.invars:
        h.update(str(program.avals[v]).encode())
    return h.hexdigest()


def cluster_for(cluster, option: SubmeshOption, grid_shape):
    """The sub-mesh's per-axis links: within a row (host), the row's; across rows, the slower axis. With a
    hardware model the sub-mesh's devices are spread over its rows (``ClusterSpec.nodes``) and its tiers
    price the links."""
    rows, per_row = option.physical
    if getattr(cluster, "hardware", None) is not None:
        # A stage's inputs are its parameters (resident) and other stages' activations (device to device):
        # none is fed from the host each microbatch, which the planner would otherwise charge for.
        return dataclasses.replace(cluster, nodes=rows if rows > 1 else None, mesh_shape=None, host_bandwidth=1e30)
    c = cluster.for_mesh(grid_shape if len(grid_shape) == 2 else (1, grid_shape[0]))
    bw, lat = c.bandwidth, c.latency
    inner, slow = (bw[-1], lat[-1]), (bw[0], lat[0])
    a, b = option.logical
    # Devices are laid out row-major: the minor axis leaves a row once it is longer than one; the major
    # axis crosses rows whenever the sub-mesh has several.
    inner_axis = slow if (rows > 1 and b > per_row) else inner
    outer = slow if (rows > 1 and a > 1) else inner
    inner = inner_axis
    # A stage's inputs are its parameters (resident) and other stages' activations (device to device):
    # none is fed from the host each microbatch, which the planner would otherwise charge for.
    return dataclasses.replace(c, bandwidth=(outer[0], inner[0]), latency=(outer[1], inner[1]), host_bandwidth=1e30)


@dataclasses.dataclass(frozen=True)
class StageSearch:
    """What the inter-operator search needs besides the step: where, how, and under what budget.

    Attributes:
      mesh: the whole mesh; its devices are cut into stage sub-meshes.
      cluster: its :class:`~autoshard.ClusterSpec`.
      options: the :class:`PipelineOptions`.
      memory_budget: bytes per device a stage may hold, or None.
      tie_layers: ``parallelize(tie_layers=...)`` for every intra-op plan.
      progress: ``callback(stage, done, total)`` or None.
      profile: the :class:`~autoshard.BackendProfile` every intra-op plan is for (None: the mesh's).
      stage_time_limit: seconds the solver may spend on each chosen stage's own plan (None: the candidates'
        ``options.solver_time_limit``). Those plans are few (one per stage, and per near-tie rival) and they
        are what runs, so they get the step's intra-op limit: GPT-39B's stages on (8, 4) under the memory
        limit came out 6% to 36% above their optimum at the candidates' 2 s, which the solver proves in 2-3 s.
    """

    mesh: object
    cluster: object
    options: PipelineOptions
    memory_budget: float | None = None
    tie_layers: object = "auto"
    progress: object = None
    profile: object = None
    stage_time_limit: float | None = None

    def report(self, stage: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(stage, done, total)


@dataclasses.dataclass
class _LayerCost:
    time: float
    memory: float
    activation: float


class _CostTable:
    """Per-layer, per-option costs, planned once per distinct layer program.

    The costed layers are finer than the stage DP's when the model repeats a block (one block each):
    ``group[i]`` is the DP layer of costed layer ``i``, and a DP layer costs the sum of its members
    (their times and memories add; the memory sum counts each member's temporaries, so it errs high)."""

    def __init__(self, analysis, part, search: StageSearch, grid_shape, group):
        self.analysis, self.part, self.search, self.grid_shape = analysis, part, search, grid_shape
        self.members: dict = {}
        for i, g in enumerate(group):
            self.members.setdefault(g, []).append(i)
        self.cache: dict = {}
        self.programs: dict = {}
        self.fingerprints: dict = {}
        self.plans_made = 0
        self.plan_seconds = 0.0  # spent in the layer plans

    def cost(self, layer: int, option: SubmeshOption) -> _LayerCost:
        parts = [self.layer_cost(i, option) for i in self.members[layer]]
        return _LayerCost(sum(c.time for c in parts), sum(c.memory for c in parts), sum(c.activation for c in parts))

    def layer_cost(self, layer: int, option: SubmeshOption) -> _LayerCost:
        prog = self.programs.get(layer)
        if prog is None:
            prog = self.programs[layer] = stage_program(self.analysis, self.part, layer,
                                                        reduce_gradients=self.search.options.reduce_gradients)
            self.fingerprints[layer] = _fingerprint(prog)
        key = (self.fingerprints[layer], option)
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = self._cost(prog, layer, option)
        return hit

    def _cost(self, prog, layer: int, option: SubmeshOption) -> _LayerCost:
        n = option.size
        act = residual_bytes(self.analysis, self.part, layer) / n
        sub_cluster = cluster_for(self.search.cluster, option, self.grid_shape)
        options = self.search.options
        if options.stage_cost == "estimate" or not prog.graph.ops:
            flops = sum(op_flops(op, self.analysis.avals) for op in prog.graph.ops)
            params = sum(_nbytes(self.analysis.avals[v]) for v in prog.graph.invars
                         if v in set(self.analysis.full.graph.invars) and v not in self.analysis.dependent)
            d = option.logical[0]
            shaped = sub_cluster.for_mesh(option.logical)
            allreduce = shaped.collective_cost("all-reduce", params, (0,), (d,)) if d > 1 else 0.0
            return _LayerCost(flops / (n * sub_cluster.flops) + allreduce, params * 4 / n + act, act)
        mesh = mesh_like(self.search.mesh, option.logical, AXES)
        t0 = time.perf_counter()
        try:
            # Free of the state ties (:func:`state_ties`): a layer's optimizer state and weights may stay in
            # shards at no charge, the least memory a stage of it can reach, so the DP sees every assignment
            # that can fit. Each chosen stage is planned with its ties under its memory limit
            # (:func:`_plan_stage`), where the solver weighs the shards' all-gathers against the memory.
            plan = plan_boundaries(prog, self.part, mesh, sub_cluster, options.solver_time_limit,
                                   tie_layers=self.search.tie_layers, profile=self.search.profile)
        except (InfeasibleError, MeshError):  # no plan of this layer fits this option (bugs propagate)
            return _LayerCost(math.inf, math.inf, act)
        finally:
            self.plan_seconds += time.perf_counter() - t0
        self.plans_made += 1
        return _LayerCost(stage_seconds(plan, self.analysis),
                          plan.cost.peak_memory_bytes, act)


MAX_COST_LAYERS = 128
"""At most this many layers are costed (one repeated block each); the stage DP takes fewer, grouped."""


def _cost_layer_count(fops, avals, num_layers: int) -> int:
    """How many layers to cost: one per repeat of the model's repeated block when it repeats more often
    than ``num_layers`` (a small program costed once per sub-mesh stands for every repeat), else
    ``num_layers``."""
    rep = repeat_period(fops, avals)
    repeats = 0 if rep is None else (rep[2] - rep[1]) // rep[0]
    return int(min(max(num_layers, repeats), MAX_COST_LAYERS, len(fops)))


_GROUP_SLACK = 1e-3
"""Groupings whose largest group is within this fraction of the least maximum count as least."""


def group_layers(flops, num_groups: int) -> list[int]:
    """Cut the sequence ``flops`` into ``num_groups`` contiguous non-empty groups of least maximum sum
    (within ``_GROUP_SLACK``);
    returns the group of each item.

    Among the groupings of least maximum (there are usually many), the one whose group ends lie closest
    to the even shares ``g / num_groups`` of the total: the stage DP cuts only at group ends, so every
    coarser cut (half of the groups for 2 stages, a quarter for 4) then splits the flops evenly too. On
    GPT-6.7B's 32 cost layers cut into 8, the first least-maximum grouping put the half-way end after 15
    of 33 block-equivalents, and 2 stages came out 5% slower than a cut after 16 or 17."""
    n = len(flops)
    G = max(1, min(num_groups, n))
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    best = np.full((G + 1, n + 1), np.inf)   # best[g, j]: the least max over g groups of items[:j]
    best[0, 0] = 0.0
    for g in range(1, G + 1):
        for j in range(g, n - (G - g) + 1):
            i = np.arange(g - 1, j)
            best[g, j] = np.min(np.maximum(best[g - 1, i], prefix[j] - prefix[i]))
    # equal blocks' flops differ in the last digits (6.879e12 for two of GPT-6.7B's blocks, 3.439e12 for one)
    cap = best[G, n] * (1 + _GROUP_SLACK) + 1e-300
    # second pass: least summed distance of the group ends to the even shares, every group within cap
    off = np.full((G + 1, n + 1), np.inf)
    back = np.zeros((G + 1, n + 1), dtype=int)
    off[0, 0] = 0.0
    for g in range(1, G + 1):
        for j in range(g, n - (G - g) + 1):
            i = np.arange(g - 1, j)
            val = np.where(prefix[j] - prefix[i] <= cap, off[g - 1, i], np.inf) + abs(prefix[j] - g * prefix[n] / G)
            k = int(np.argmin(val))
            off[g, j], back[g, j] = val[k], i[k]
    group, j = [0] * n, n
    for g in range(G, 0, -1):
        i = back[g, j]
        group[i:j] = [g - 1] * (j - i)
        j = i
    return group


def auto_layer_count(num_devices: int) -> int:
    """How many layers the stage DP cuts the forward pass into with ``num_stages="auto"`` (the most stages it
    can make): 8 up to 256 devices, then half the square root of the device count (16 at 1,024, 32 at 4,096),
    so that a stage's weights shrink as the mesh grows while the DP stays small."""
    return max(8, min(32, math.isqrt(max(num_devices, 1)) // 2))


def _layer_bounds(analysis, options: PipelineOptions, num_devices: int):
    """``(op position -> cost layer, cost layer -> DP layer, DP layer flops, manual)``: the forward ops cut
    into layers that are costed one by one, and grouped into the layers the stage DP cuts."""
    fwd = sorted(forward_positions(analysis))
    fops = [analysis.op(p) for p in fwd]
    if not fops:
        raise InputError("the step has no forward pass to pipeline (nothing the loss depends on reads the batch)")
    manual = boundary_layers(fops)
    if manual is not None:
        cuts = manual
        if isinstance(options.num_stages, int) and options.num_stages != len(cuts) + 1:
            raise InputError(f"num_stages={options.num_stages}, but the step's pipeline_boundary calls make "
                             f"{len(cuts) + 1} stages. Fix: drop num_stages or match it.")
    else:
        S = options.num_stages
        if options.layers == "auto":
            L = min(len(fops), auto_layer_count(num_devices) if S == "auto" else max(S, min(16, 2 * S)))
        else:
            L = options.layers
        if isinstance(S, int) and S > L:
            raise InputError(
                f"num_stages={S} is more than the {L} layers the forward pass is cut into"
                + (f" (layers={options.layers})" if options.layers != "auto" else f" (it has {len(fops)} ops)")
                + f": every stage needs at least one layer. Fix: num_stages <= {L}, or layers >= {S}.")
        if L > len(fops):
            raise InputError(f"layers={L} is more than the {len(fops)} ops of the forward pass")
        fine = _cost_layer_count(fops, analysis.avals, L) if options.stage_cost == "planner" else L
        cuts = cluster_layers(fops, analysis.avals, fine)
    bounds = [0, *cuts, len(fops)]
    layer_of = {}
    for layer in range(len(bounds) - 1):
        for i in range(bounds[layer], bounds[layer + 1]):
            layer_of[fwd[i]] = layer
    fine_flops = [float(sum(op_flops(fops[i], analysis.avals) for i in range(bounds[j], bounds[j + 1])))
                  for j in range(len(bounds) - 1)]
    group = list(range(len(fine_flops))) if manual is not None else \
        group_layers(fine_flops, L)
    flops = [0.0] * (max(group) + 1)
    for j, g in enumerate(group):
        flops[g] += fine_flops[j]
    return layer_of, tuple(group), tuple(flops), manual is not None


@dataclasses.dataclass(frozen=True)
class _Stages:
    """The chosen stages: ``(first layer, end layer, option)`` each, their options and device sets."""

    bounds: tuple
    chosen: tuple
    devices: tuple
    latency: float = math.nan   # the DP's estimate from the layer costs (s)

    def stage_of_layer(self) -> dict[int, int]:
        """Each DP layer's stage."""
        return {layer: s for s, (i, j, _) in enumerate(self.bounds) for layer in range(i, j)}


def _fixed_submesh_stages(table: _CostTable, grid, num_layers: int, manual: bool) -> _Stages:
    """With ``PipelineOptions.submeshes`` fixed: the layer cut of least latency (a scan over the cuts)."""
    L, k, submeshes = num_layers, table.analysis.num_microbatches, table.search.options.submeshes
    opts = [SubmeshOption((1, math.prod(s)) if math.prod(s) <= grid.shape[1] else
                          (math.prod(s) // grid.shape[1], grid.shape[1]), tuple(s)) for s in submeshes]
    S = len(opts)
    if S > L:
        raise InputError(f"{S} submeshes (stages) but only {L} layers; every stage needs at least one layer")
    if S == L:  # nothing to choose: skip planning the layers
        costs = [[_LayerCost(0.0, 0.0, 0.0)] * S for _ in range(L)]
    else:
        costs = [[table.cost(layer, o) for o in opts] for layer in range(L)]
    best = None
    cut_choices = [tuple(range(1, L))] if manual and S == L else itertools.combinations(range(1, L), S - 1)
    for cuts in cut_choices:
        b = (0, *cuts, L)
        ts = [sum(costs[layer][s].time for layer in range(b[s], b[s + 1])) for s in range(S)]
        t = sum(ts) + (k - 1) * max(ts)
        if best is None or t < best[0]:
            best = (t, b)
    bounds = best[1]
    flat, devices, off = grid.reshape(-1), [], 0
    for o in opts:
        devices.append(flat[off:off + o.size])
        off += o.size
    return _Stages(tuple((bounds[s], bounds[s + 1], s) for s in range(S)), tuple(opts), tuple(devices))


def _dp_stages(table: _CostTable, grid, num_layers: int, fixed_count: int | None, *, uniform: bool = False) -> _Stages:
    """Alpa's stage-mesh DP (:func:`assign_stages`) over every sub-mesh option and layer range; ``uniform``:
    every stage on the same sub-mesh shape (the best such assignment over the shapes that tile the mesh)."""
    L, N, k, memory_budget = num_layers, grid.size, table.analysis.num_microbatches, table.search.memory_budget
    opts = [o for o in submesh_options(grid.shape) if o.size <= N]
    limit = math.inf if memory_budget is None else float(memory_budget)
    if uniform:
        sol, best_opts = None, opts
        for o in opts:
            count = N // o.size
            if N % o.size or count > L or (fixed_count is not None and count != fixed_count):
                continue
            got = _assign(table, [o], L=L, N=N, k=k, limit=limit, fixed_count=count)
            if got is not None and (sol is None or got.latency < sol.latency):
                sol, best_opts = got, [o]
        opts = best_opts
    else:
        sol = _assign(table, opts, L=L, N=N, k=k, limit=limit, fixed_count=fixed_count)
    if sol is None:
        raise MeshError(f"no pipeline of {L} layers fits the {N}-device mesh"
                        + (f" within memory_budget={memory_budget:.4g} bytes" if memory_budget else "")
                        + ". Fix: more microbatches (smaller activations per stage), a larger memory_budget, "
                          "or more devices.")
    chosen = tuple(opts[m] for _, _, m in sol.stages)
    devices = tuple(d.reshape(-1) for d in allocate(grid, [o.physical for o in chosen]))
    return _Stages(tuple(sol.stages), chosen, devices, float(sol.latency))


def _assign(table: _CostTable, opts, *, L: int, N: int, k: int, limit: float, fixed_count: int | None):
    """:func:`assign_stages` over the table's current layer costs."""
    M = len(opts)
    T = np.full((L, L + 1, M), np.inf)
    W = np.zeros((L, L + 1, M))
    A = np.zeros((L, L + 1, M))
    per = [[table.cost(layer, o) for o in opts] for layer in range(L)]
    for i in range(L):
        for m in range(M):
            tt = ww = aa = 0.0
            for j in range(i + 1, L + 1):
                c = per[j - 1][m]
                tt, ww, aa = tt + c.time, ww + c.memory - c.activation, aa + c.activation
                T[i, j, m], W[i, j, m], A[i, j, m] = tt, ww, aa
    return assign_stages(StageProblem(T, tuple(o.size for o in opts), N, k, W, A, limit, fixed_count))


def _plan_stage(prog, part, mesh, cluster, search: StageSearch, *, keep: float, carried=None):
    """A stage's intra-op plan of one microbatch, within what the memory limit leaves beside the ``keep``
    bytes of other microbatches' activations the schedule holds (those ``prog.in_flight_bytes`` does not
    place while the microbatches run), its next-state outputs tied to their
    arguments (``carried``). When no tied plan fits, the untied one (the runtime then gathers a weight
    updated in shards without the plan pricing it, as the layer costs assumed); when none fits at all, the
    whole device (its predicted memory then says by how much it is over)."""
    limit = search.options.solver_time_limit if search.stage_time_limit is None else search.stage_time_limit

    def planned(budget=None, ties=None):
        return plan_boundaries(prog, part, mesh, cluster, limit,
                               tie_layers=search.tie_layers, profile=search.profile, memory_budget=budget,
                               carried=ties)

    budget = None if search.memory_budget is None else float(search.memory_budget) - keep
    if budget is None or budget <= 0:
        return planned(ties=carried)
    try:
        return planned(budget, carried)
    except InfeasibleError as e:
        smallest = e.smallest_memory
    if carried:
        try:
            return planned(budget)
        except InfeasibleError as e:
            smallest = e.smallest_memory
    warnings.warn(f"a pipeline stage on sub-mesh {mesh_shape(mesh)} has no plan within the "
                  f"{search.memory_budget:.4g} bytes per device together with its in-flight activations "
                  f"({keep + prog.in_flight_bytes:.4g} bytes; {(smallest or 0) + keep:.4g} is the least found); "
                  "it is planned for the whole device, and plan.stages[...].memory_bytes "
                  "says how far over the limit it is. Fix: more microbatches, or a larger memory_budget.",
                  stacklevel=2)
    return planned()


def _plan_each_stage(analysis, part, stages: _Stages, search: StageSearch, grid_shape):
    """Each stage's intra-op plan on its sub-mesh: ``(meshes, plans, StagePlans)``."""
    options, S = search.options, len(stages.bounds)
    orders = stage_orders(S, analysis.num_microbatches, options.schedule)
    meshes, plans, stage_plans = [], [], []
    for s, o in enumerate(stages.chosen):
        mesh = mesh_like(search.mesh, o.logical, AXES, devices=list(stages.devices[s]))
        prog = stage_program(analysis, part, s, reduce_gradients=options.reduce_gradients, held=True)
        act = residual_bytes(analysis, part, s) / o.size
        live = max_in_flight(orders[s])
        keep = max(0, live - 1) * act
        if prog.held:   # the plan counts them while the microbatches run, not during the update
            prog, keep = dataclasses.replace(prog, in_flight_bytes=keep), 0.0
        plan = _plan_stage(prog, part, mesh, cluster_for(search.cluster, o, grid_shape), search,
                           keep=keep, carried=state_ties(prog, analysis)) if prog.graph.ops else None
        search.report(f"stage {s} planned", 2 + s + 1, 2 + S)
        t = stage_seconds(plan, analysis)
        mem = (plan.cost.peak_memory_bytes if plan is not None else 0.0) + keep
        meshes.append(mesh)
        plans.append(plan)
        # an AbstractMesh's grid holds device positions (ints), a concrete mesh's grid devices
        ids = tuple(int(d) if isinstance(d, int | np.integer) else int(d.id) for d in stages.devices[s])
        stage_plans.append(StagePlan(s, ids, o.logical,
                                     stages.bounds[s][:2], plan, t, mem, act, live))
    return meshes, plans, stage_plans


def plan_stages(analysis: StepAnalysis, mesh, cluster, options: PipelineOptions, memory_budget=None, *,
                tie_layers="auto", progress=None, profile=None, uniform=False, recompute=False,
                stage_time_limit=None):
    """Search the pipeline; returns ``(partition, meshes, plans, PipelinePlan)``.

    ``progress``: ``callback(stage, done, total)`` after the layer costs, the stage search and each
    stage's plan. ``uniform``: every stage on one sub-mesh shape (what ``runtime="spmd"`` runs).
    ``recompute``: every stage's backward recomputes its forward (:mod:`autoshard.pipeline.recompute`).
    ``stage_time_limit``: the solver's seconds for each chosen stage's plan (:class:`StageSearch`)."""
    t0 = time.perf_counter()
    # a stage holds its layers' weights and in-flight activations: no more than a device has (as intra-op plans)
    budget = memory_budget if memory_budget is not None else getattr(cluster, "memory", None)
    search = StageSearch(mesh, cluster, options, budget, tie_layers, progress, profile, stage_time_limit)
    k = analysis.num_microbatches
    grid = physical_grid(mesh)
    N = grid.size
    if isinstance(options.num_stages, int) and options.num_stages > N:
        raise InputError(f"num_stages={options.num_stages} is more than the {N} devices of the mesh")
    if options.submeshes is not None:
        check_submeshes(grid.shape, options.submeshes)
    cost_layer_of, group, layer_flops, manual = _layer_bounds(analysis, options, N)
    layer_of = {p: group[i] for p, i in cost_layer_of.items()}
    L = len(layer_flops)
    table = _CostTable(analysis, _partition(analysis, lambda p: cost_layer_of[p], len(group), recompute), search,
                       grid.shape, group)
    search.report("layers cut", 1, 3)
    if options.submeshes is not None:
        stages = _fixed_submesh_stages(table, grid, L, manual)
    else:
        fixed = L if manual else (options.num_stages if isinstance(options.num_stages, int) else None)
        stages = _dp_stages(table, grid, L, fixed, uniform=uniform)
    rivals = _near_ties(table, grid, L, stages, uniform) if options.num_stages == "auto" and not manual \
        and options.submeshes is None else []
    search_s = time.perf_counter() - t0
    S = len(stages.bounds)
    search.report(f"{S} stages chosen", 2, 2 + S)
    part, meshes, plans, stage_plans = _realise(analysis, layer_of, stages, search, grid.shape, recompute=recompute)
    rechecked = [{"stages": S, "dp_s": stages.latency, "planned_s": _step_s(stage_plans, k)}] if rivals else []
    for rival in rivals:
        # the DP cannot tell these apart: plan the rival's stages too and keep the faster plan
        got = _realise(analysis, layer_of, rival, search, grid.shape, recompute=recompute)
        rechecked.append({"stages": len(rival.bounds), "dp_s": rival.latency, "planned_s": _step_s(got[3], k)})
        if rechecked[-1]["planned_s"] < _step_s(stage_plans, k):
            stages, (part, meshes, plans, stage_plans) = rival, got
    S = len(stages.bounds)
    stage_of_layer = stages.stage_of_layer()
    times = [sp.time_s for sp in stage_plans]
    first = {}   # each stage's first op with a known source line (the first op may be a jax internal)
    for p_ in sorted(layer_of):
        where = analysis.full.graph.ops[p_].source()
        if where != "<unknown>":
            first.setdefault(stage_of_layer[layer_of[p_]], where)
    orders = stage_orders(S, k, options.schedule)
    # each stage's microbatch time split by its own plan's forward and backward compute, and the activations
    # crossing each stage boundary at the link between the two stages' devices
    shares = [sp.plan.stats.get("perf", {}).get("forward_share", 1 / 3) for sp in stage_plans]
    fwd = [t * f for t, f in zip(times, shares, strict=True)]
    bwd = [t * (1 - f) for t, f in zip(times, shares, strict=True)]
    transfers = _transfers(stage_plans, search.cluster, search.mesh)
    sim = simulate(orders, fwd, bwd, chain_deps(S), transfer=transfers)
    pplan = PipelinePlan(
        stages=tuple(stage_plans), schedule=options.schedule, num_microbatches=k, layer_flops=layer_flops,
        step_time_s=_step_s(stage_plans, k), simulated_step_s=sim.makespan,
        bubble_fraction=sim.bubble_fraction,
        stats={"search_s": search_s, "total_s": time.perf_counter() - t0, "layer_plans": table.plans_made,
               "layer_plans_s": table.plan_seconds,
               "num_layers": L, "costed_layers": len(group), "manual_cut": manual, "recompute": recompute,
               "distinct_layers": len(set(table.fingerprints.values())), "rechecked": rechecked,
               # what the simulated timeline ran: each stage's microbatch forward and backward, each boundary's
               # transfer (pipeline.schedule.simulate(orders, forward, backward, chain_deps(S), transfer=...))
               "timeline_inputs": {"forward_s": fwd, "backward_s": bwd, "transfer_s": transfers}},
        cut_sources=tuple(first.get(s, "<none>") for s in range(S)))
    return part, meshes, plans, pplan


_TIE = 0.01
"""Stage assignments whose DP latencies are within this fraction of the chosen one's are near ties: the layer
costs the DP sums (each layer planned alone) cannot rank them, so ``num_stages="auto"`` plans their stages as
well and keeps the plan of least step time. On GPT-2.6B, 16 devices, 4 microbatches, the DP put 1 stage at
90.28 ms and 2 at 90.83 ms; their stage plans came out at 94.61 and 91.29 ms."""


def _near_ties(table: _CostTable, grid, num_layers: int, chosen: _Stages, uniform: bool) -> list[_Stages]:
    """The best assignments of half and of twice as many stages as ``chosen``, those within ``_TIE`` of its
    DP latency (at most two; none when the DP's choice is clear)."""
    S, out = len(chosen.bounds), []
    for count in (S // 2, 2 * S):
        if not 1 <= count <= min(num_layers, grid.size) or count == S:
            continue
        try:
            got = _dp_stages(table, grid, num_layers, count, uniform=uniform)
        except MeshError:   # nothing of that many stages fits
            continue
        if got.latency <= chosen.latency * (1 + _TIE):
            out.append(got)
    return out


def _transfers(stage_plans, cluster, mesh) -> list[float]:
    """Seconds to move one microbatch's activation across each stage boundary: the next stage's boundary
    arguments, one device's share of them, at the link between the two stages' devices (the slowest tier
    spanning both; the slower mesh axis without a hardware model)."""
    from autoshard.perf.comm import collective_seconds_on

    out = []
    for a, b in itertools.pairwise(stage_plans):
        plan = b.plan
        info = MeshInfo(tuple(plan.mesh.axis_sizes), tuple(plan.mesh.axis_names))
        nbytes = 0.0
        for path, (shape, dtype), spec in zip(plan.in_paths, plan.in_avals, plan.in_specs, strict=True):
            if is_boundary(path):
                local = math.prod(n // info.axes_size(ax) for n, ax in zip(shape, spec.dims, strict=True))
                nbytes += local * np.dtype(dtype).itemsize
        devices = (*a.devices, *b.devices)
        span = max(devices) - min(devices) + 1
        if getattr(cluster, "hardware", None) is not None:
            out.append(collective_seconds_on(cluster.hardware, "collective-permute", nbytes, group=2, span=span,
                                             inner_span=cluster.inner_span(int(np.prod(mesh_shape(mesh))))))
        else:
            lat, bw = cluster.latency, cluster.bandwidth
            out.append(max(lat if isinstance(lat, tuple) else (lat,)) + nbytes / min(bw if isinstance(bw, tuple)
                                                                                     else (bw,)))
    return out


def _step_s(stage_plans, k: int) -> float:
    """The pipeline's step time from its stage plans: every stage once, the slowest ``k - 1`` more times."""
    times = [sp.time_s for sp in stage_plans]
    return float(sum(times) + (k - 1) * max(times))


def _realise(analysis, layer_of, stages: _Stages, search: StageSearch, grid_shape, *, recompute: bool):
    """``(partition, meshes, plans, StagePlans)`` of ``stages``: the ops cut into them and each planned."""
    stage_of_layer = stages.stage_of_layer()
    part = _partition(analysis, lambda p: stage_of_layer[layer_of[p]], len(stages.bounds), recompute)
    return (part, *_plan_each_stage(analysis, part, stages, search, grid_shape))


def _partition(analysis: StepAnalysis, stage_of, num_stages: int, recompute: bool) -> Partition:
    part = partition(analysis, stage_of, num_stages)
    if not recompute:
        return part
    return recompute_forward(part, outputs=frozenset(v for v in analysis.full.graph.outvars if isinstance(v, int)))


def restore_stages(analysis: StepAnalysis, mesh, options: PipelineOptions, pplan: PipelinePlan):
    """``(partition, meshes, plans, pplan)`` of ``pplan``, a plan :func:`plan_stages` made for this step on
    another process: the layer cut is recomputed (it is deterministic), the stages and their intra-op plans
    are the saved ones.

    Raises:
      PlanError: a stage plan was made for another program than this process captured."""
    from autoshard.distributed import different_program

    cost_layer_of, group, _, _ = _layer_bounds(analysis, options, physical_grid(mesh).size)
    stage_of_layer = {layer: st.index for st in pplan.stages for layer in range(*st.layers)}
    part = _partition(analysis, lambda p: stage_of_layer[group[cost_layer_of[p]]], len(pplan.stages),
                      bool(pplan.stats.get("recompute")))
    by_id = {d.id: d for d in jax.devices()}
    meshes = []
    for st in pplan.stages:
        if st.plan is None:
            meshes.append(mesh_like(mesh, st.mesh_shape, AXES, devices=[by_id[i] for i in st.devices]))
            continue
        captured = stage_program(analysis, part, st.index, reduce_gradients=options.reduce_gradients).fingerprint()
        if st.plan.fingerprint != captured:
            raise different_program(st.plan.fingerprint, captured)
        meshes.append(st.plan.mesh)
    return part, meshes, [st.plan for st in pplan.stages], pplan


def plan_stages_everywhere(make, analysis: StepAnalysis, mesh, options: PipelineOptions):
    """``make()`` (a :func:`plan_stages` call) on process 0, and the same stages on every process: the others
    receive process 0's ``PipelinePlan`` and :func:`restore_stages` it, so a search that is not
    bit-deterministic (time-limited solves) cannot give two processes two programs."""
    from autoshard.distributed import broadcast_from_first

    if jax.process_count() == 1:
        return make()
    got = broadcast_from_first(make, lambda made: made[3].to_json(), PipelinePlan.from_json)
    return got if isinstance(got, tuple) else restore_stages(analysis, mesh, options, got)
