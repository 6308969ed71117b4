"""Run a partitioned step as ONE SPMD program: stages on a ``"stage"`` mesh axis, each under its intra-op plan.

``jax.device_put`` between device sets of different processes is refused outside TPU, so the
single-controller runtime (``runtime.py``) cannot span hosts. This runtime compiles the whole
pipeline into one ``jax.jit`` over a global mesh of shape ``(S, *sub)`` (axes ``"stage"`` and the
stage sub-mesh's own axes, e.g. ``("stage", "data", "model")``; stage ``s`` owns slice ``s``),
which every process calls. A ``shard_map`` makes only ``"stage"`` manual: inside it, the
sub-mesh axes stay automatic, so each stage's ops run under the stage's intra-op plan (its
``with_sharding_constraint`` s name the sub-mesh axes) and XLA partitions them over the stage's
devices, with the plan's collectives inside the stage.

* The schedule (GPipe or 1F1B, ``schedule.stage_orders``) is list-scheduled with unit task
  times into *ticks*. A ``lax.scan`` runs the ticks; at each a ``lax.switch`` on
  ``lax.axis_index("stage")`` runs that stage's task (``F(s, m)``, ``B(s, m)`` or nothing),
  then one ``ppermute`` per stage offset carries what was produced to the stages that read it.
* Stages run different code and hold different values, but ``switch`` branches must agree on
  types. Every device therefore keeps one buffer per dtype (its *memory*), of shape
  ``(R, length)`` with ``R`` the devices of a stage and row ``r`` on the stage's ``r``-th device,
  and each stage has its own static layout in it: received activations, residuals stashed from
  ``F`` for ``B`` (no recompute), and the gradient accumulators. A value is stored as each
  device's own shard, in the layout its producing stage's plan gives it (*its storage layout*):
  a nested ``shard_map`` over the sub-mesh axes turns the sharded value into rows and back
  without moving data. A reader whose plan wants another layout reshards it inside its own
  branch. Slots are reused once dead (interval allocation over ticks), so 1F1B keeps fewer
  microbatches alive than GPipe. Messages are packed the same way, padded to the largest sender.
* Between steps the train state is split over ``"stage"`` as well as over a stage's devices: each
  weight in the layout its first reader stage plans over the sub-mesh axes, and along one more
  dimension (one that layout leaves whole and the stage count divides) over ``"stage"``; optimizer
  state takes the layout of the weight of its shape. At the start of the program one
  ``all_to_all`` over ``"stage"`` gives every stage the weights it reads, whole over ``"stage"``
  (:meth:`SpmdPipelineExecutable._gather_weights`): during the pipeline a device holds its own
  stage's weights and 1/S of the rest of the state.
* After the last tick the accumulators (weight gradients, summed loss) leave ``shard_map``
  stacked over ``"stage"``; the update tasks (``R``) then run in the same jit on the whole mesh,
  on the state in its between-steps layout (so the update is split over every device). Metrics
  come out replicated; the new state keeps its input's sharding, so the next call takes it
  without a copy.

* A summed gradient goes to the update as its weight is split: one more ``all_to_all`` hands each
  stage its 1/S part (:meth:`SpmdPipelineExecutable._scatter_sums`).

Limits: all stages need the same sub-mesh shape; a state leaf with no dimension to split over
``"stage"`` (or a typed PRNG key) stays whole over it, and a gradient with no such weight reaches the
update whole over ``"stage"``; the stage plans cover the update, but the update here runs unconstrained
on the split state; every stage's backward all-reduces its own microbatch's gradients (once per
microbatch); the batch enters replicated, or, where each process passes its own rows
(``batch_argnums``), split over the mesh axes that span processes; a step returning per-example values
is refused.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.capture import OpGraph
from autoshard.errors import InputError, MeshError
from autoshard.hlo import permutes_in_branches
from autoshard.lower import MICROBATCH, Evaluator
from autoshard.pipeline.deferred import partial_sums, reduce_partials
from autoshard.pipeline.partition import Partition, handoff_layouts
from autoshard.pipeline.schedule import simulate, stage_orders
from autoshard.spec import MeshInfo, ShardingSpec

STAGE_AXIS = "stage"


def spans_processes(meshes) -> bool:
    """Whether the stages' devices belong to more than one process (``device_put`` cannot span them)."""
    return len({d.process_index for m in meshes for d in np.asarray(m.devices).flat}) > 1


def stage_mesh(meshes):
    """The global ``(S, *sub)`` mesh whose slice ``s`` is stage ``s``'s sub-mesh (axes ``"stage"``, then the
    sub-mesh's own)."""
    from autoshard.cluster import make_mesh

    shapes = [tuple(np.asarray(m.devices).shape) for m in meshes]
    names = {tuple(m.axis_names) for m in meshes}
    if len(set(shapes)) != 1 or len(names) != 1:
        raise MeshError(
            f"runtime='spmd' needs the same sub-mesh shape on every stage, got {shapes} (stage -> sub-mesh). "
            "All stages are slices of one (stages, *sub-mesh) mesh. Fix: equal sub-meshes, e.g. "
            f"PipelineOptions(submeshes=[{shapes[-1]}] * {len(shapes)}), or runtime='device_put' on one host.")
    (axes,) = names
    if STAGE_AXIS in axes:
        raise MeshError(f"a stage sub-mesh has an axis named {STAGE_AXIS!r}, the name runtime='spmd' gives the "
                        "stage axis. Fix: rename that mesh axis.")
    devices = np.stack([np.asarray(m.devices) for m in meshes])
    return make_mesh(devices.shape, (STAGE_AXIS, *axes), devices=list(devices.flat))


def local_shape(shape, pspec: PartitionSpec, axis_sizes: dict) -> tuple[int, ...] | None:
    """The shape of one device's shard of an array of ``shape`` laid out as ``pspec`` (None: a
    dimension that does not divide evenly, which a ``shard_map`` cannot take)."""
    entries = tuple(pspec) + (None,) * (len(shape) - len(pspec))
    out = []
    for n, e in zip(shape, entries, strict=True):
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        k = math.prod(axis_sizes[a] for a in axes)
        if n % k:
            return None
        out.append(n // k)
    return tuple(out)


def _dtype(aval) -> str:
    return np.dtype(aval.dtype).name


def allocate(items) -> tuple[dict, dict]:
    """First-fit interval allocation: ``items`` are ``(key, dtype, size, first_tick, last_tick)``.

    Two items share addresses only if their tick intervals (inclusive) are disjoint.
    Returns ``(key -> offset, dtype -> buffer length)``."""
    placed: dict = {}
    length: dict = {}
    done = []
    for key, dt, n, a, b in sorted(items, key=lambda it: (it[3], -it[2], str(it[0]))):
        live = sorted((placed[k2], n2) for k2, dt2, n2, a2, b2 in done if dt2 == dt and not (b2 < a or b < a2))
        off = 0
        for o2, n2 in live:
            if off + n <= o2:
                break
            off = max(off, o2 + n2)
        placed[key] = off
        length[dt] = max(length.get(dt, 0), off + n)
        done.append((key, dt, n, a, b))
    return placed, length


def schedule_ticks(part: Partition, num_microbatches: int, schedule: str) -> dict:
    """``(phase, stage, microbatch) -> tick``: each stage's GPipe or 1F1B order, list-scheduled with unit
    task times, so a task's inputs always come from earlier ticks."""
    S = part.num_stages
    orders = [[(ph, m) for ph, m in order if (ph, s) in part.tasks]
              for s, order in enumerate(stage_orders(S, num_microbatches, schedule))]
    sim = simulate(orders, [1.0] * S, [1.0] * S, part.task_deps)
    return {(ph, s, m): int(round(start)) for ph, s, m, start, _ in sim.events}


class _Rows:
    """Values as rows of a stage's buffers and back: row ``r`` is the ``r``-th device of the stage's shard.

    Both directions are a ``shard_map`` over the sub-mesh axes whose body only reshapes the local
    block, so no data moves. ``mesh``: the global mesh, or None inside the stage ``shard_map`` (which
    then takes the context's mesh, where ``"stage"`` is manual)."""

    def __init__(self, mesh, sub_axes: tuple[str, ...]):
        self.sizes = dict(mesh.shape)
        self.axes = frozenset(sub_axes)
        self.rows = math.prod(self.sizes[a] for a in sub_axes)
        self.spec = PartitionSpec(tuple(sub_axes))

    def pack(self, x, pspec: PartitionSpec, mesh=None):
        """``x`` (laid out as ``pspec``) as ``(rows, local size)``."""
        return jax.shard_map(lambda xl: xl.reshape(1, -1), mesh=mesh, in_specs=(pspec,), out_specs=self.spec,
                             axis_names=self.axes, check_vma=False)(x)

    def unpack(self, rows, pspec: PartitionSpec, shape, mesh=None):
        """The value of global ``shape`` laid out as ``pspec`` whose shards are the rows of ``rows``."""
        block = local_shape(shape, pspec, self.sizes)
        return jax.shard_map(lambda r: r.reshape(block), mesh=mesh, in_specs=(self.spec,), out_specs=pspec,
                             axis_names=self.axes, check_vma=False)(rows)


class SpmdPipelineExecutable:
    """The pipelined step as one jitted SPMD program over a ``("stage", *sub-mesh)`` mesh (module docstring).

    Args:
      analysis, part: the step's :class:`~autoshard.pipeline.accumulate.StepAnalysis` and partition.
      meshes: each stage's sub-mesh (all of one shape and axis names).
      plans: each stage's intra-op :class:`~autoshard.Plan` of one microbatch (None: replicated).
      schedule: ``"gpipe"`` or ``"1f1b"``.
      out_ties: output position -> the input position whose next value it is (it keeps that layout).
      process_local: flat positions of batch leaves that each process passes its own rows of (they enter split
        over the mesh axes that span processes, :func:`autoshard.distributed.process_axes`).
      reduce_gradients: ``"step"``: the gradients a stage's plan reduces are summed unreduced over the
        microbatches and reduced once, after the last tick (:mod:`autoshard.pipeline.deferred`): those it
        all-reduces, and those it reduce-scatters that its plan holds unreduced (``Plan.deferred``).
    """

    def __init__(self, analysis, part: Partition, meshes, plans, *, schedule: str, out_ties: dict | None = None,
                 process_local=(), reduce_gradients: str = "step"):
        self.k = k = analysis.num_microbatches
        self.schedule = schedule
        self.S = S = part.num_stages
        self.mesh = stage_mesh(meshes)
        self.sub_info = MeshInfo.from_mesh(meshes[0])
        self.rows = _Rows(self.mesh, tuple(meshes[0].axis_names))
        self.analysis = analysis
        self.part = part
        full, micro = analysis.full, analysis.micro
        self.batch_values = {full.graph.invars[p]: p for p in analysis.batch_inputs}
        self.batch_positions = frozenset(analysis.batch_inputs)
        self.invar_pos = {v: i for i, v in enumerate(full.graph.invars)}
        frontier = part.frontier_values
        self._check_outputs(frontier)
        # Gradients each stage's plan all-reduces, or holds unreduced, are accumulated unreduced and reduced
        # after the last tick (autoshard.pipeline.deferred).
        self.partials = [partial_sums(part.micro_tasks(s), p, micro.avals)
                         if reduce_gradients == "step" and k > 1 else {} for s, p in enumerate(plans)]
        # Each stage's ops run under its plan, named on the global mesh by the sub-mesh's axis names.
        self._evals = [Evaluator(micro, {} if p is None else p.value_specs, {} if p is None else p.operand_specs,
                                 self.mesh, self.sub_info,
                                 partials={ps.op_index: ps for ps in self.partials[s].values()},
                                 gather_then_slice=True, draws=analysis.draws)
                       for s, p in enumerate(plans)]
        self._full_ev = Evaluator(full, {}, {}, self.mesh, MeshInfo.from_mesh(self.mesh))
        # residuals a backward task reads in the layout its forward already resharded them to
        self.handoff = [handoff_layouts(part, s, p, full.graph.outvars) for s, p in enumerate(plans)]

        # Branch 0 of the task switch idles; branch i > 0 runs self.tasks[i - 1] (on its own stage only).
        self.tasks = sorted(key for key in part.tasks if key[0] in ("F", "B"))
        self.tick = schedule_ticks(part, k, schedule)
        self.num_ticks = T = 1 + max(self.tick.values(), default=-1)
        self.task_table = np.zeros((T, S), np.int32)   # tick, stage -> branch of the task switch
        self.mb_table = np.zeros((T, S), np.int32)     # tick, stage -> microbatch
        for (ph, s, m), t in self.tick.items():
            self.task_table[t, s] = 1 + self.tasks.index((ph, s))
            self.mb_table[t, s] = m

        self._storage_layouts()
        self._plan_memory(frontier)
        self._plan_messages()
        self._state_layouts()
        self._scatter_layouts()
        self._io_shardings(out_ties or {}, process_local)
        self._jit = jax.jit(self._program, out_shardings=self.out_shardings)
        self._compiled: dict = {}

    # ---- layouts ---------------------------------------------------------------------------------------
    def _pspec(self, stage: int, v) -> PartitionSpec:
        """Stage ``stage``'s plan's layout of ``v`` as a PartitionSpec, replicated where it has none or
        the value does not split evenly."""
        spec = self.handoff[stage].get(v)
        if spec is None:
            spec = self._evals[stage].value_specs.get(v)
        shape = getattr(self.analysis.avals[v], "shape", ())
        if spec is None or len(spec.dims) != len(shape):
            return PartitionSpec()
        pspec = spec.to_partition_spec(self.sub_info)
        return pspec if local_shape(shape, pspec, self.rows.sizes) is not None else PartitionSpec()

    def _storage_layouts(self):
        """Every task output is stored in the layout its producer's plan writes (a residual: the one its backward
        reads, :func:`~autoshard.pipeline.partition.handoff_layouts`)."""
        self.store = {}
        self.local = {}
        self.acc_store = {}   # a gradient summed unreduced: its running sum's layout
        self.acc_local = {}   # and its elements per device (the reduced value's, or |A| times as many)
        for key in self.tasks:
            s = key[1]
            for v in self.part.tasks[key].outvars:
                self.store[v] = pspec = self._pspec(s, v)
                shape = self.analysis.micro.avals[v].shape
                self.local[v] = math.prod(local_shape(shape, pspec, self.rows.sizes))
                ps = self.partials[s].get(v)
                if ps is None:
                    continue
                acc = ps.acc_spec.to_partition_spec(self.sub_info)
                block = local_shape(ps.acc_shape(shape, self.sub_info), acc, self.rows.sizes)
                if pspec != ps.spec.to_partition_spec(self.sub_info) or block is None:
                    del self.partials[s][v]   # the plan's layout does not split evenly: reduce as planned
                    self._evals[s].partials.pop(ps.op_index)
                    continue
                self.acc_store[v], self.acc_local[v] = acc, math.prod(block)

    def _state_layouts(self):
        """Where the train state lives between steps: split over ``"stage"`` as well as over a stage's devices.

        A weight keeps the layout its first reader stage plans for it over the sub-mesh axes and is also
        split over ``"stage"`` along its first dimension that layout leaves whole and ``S`` divides; an input
        only the update reads (optimizer state) takes the layout its stage's plan gives it (the plan covers the
        update), else that of the first weight of its shape and dtype. Inside
        the program every stage gathers the weights it reads with one ``all_to_all`` over ``"stage"``
        (:meth:`_gather_weights`): each device holds 1/S of the state and, during the pipeline, its own
        stage's weights. An input with no such dimension stays whole over ``"stage"``."""
        full, S = self.analysis.full, self.S
        readers: dict = {}
        for key in self.tasks:
            for v in self.part.tasks[key].invars:
                if v in self.invar_pos and v not in self.batch_values:
                    readers.setdefault(v, set()).add(key[1])
        self.state_readers = {v: sorted(st) for v, st in readers.items()}
        updated = {}   # state the update alone reads (optimizer state): its stage plans it with the update
        for task in self.part.update_tasks():
            for v in task.invars:
                if v in self.invar_pos and v not in self.batch_values and v not in readers:
                    updated.setdefault(v, task.key[1])
        by_shape = {}
        self.state_pspec, self.split_dim = {}, {}
        for v, st in self.state_readers.items():
            self.state_pspec[v] = self._pspec(st[0], v)
            aval = full.avals[v]
            by_shape.setdefault((tuple(aval.shape), str(aval.dtype)), self.state_pspec[v])
        for v, st in updated.items():
            if self._evals[st].value_specs.get(v) is not None:
                self.state_pspec[v] = self._pspec(st, v)
        for i, v in enumerate(full.graph.invars):
            if i in self.batch_positions:
                continue
            aval = full.avals[v]
            shape = tuple(getattr(aval, "shape", ()))
            pspec = self.state_pspec.setdefault(v, by_shape.get((shape, str(aval.dtype)), PartitionSpec()))
            entries = tuple(pspec) + (None,) * (len(shape) - len(pspec))
            # a typed PRNG key has no numeric buffer to exchange: it stays whole over "stage"
            splittable = S > 1 and not jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)
            self.split_dim[v] = next((d for d, (n, e) in enumerate(zip(shape, entries, strict=True))
                                      if e is None and n % S == 0 and n >= S), None) if splittable else None
        # Per destination stage, the packing of what every stage sends it (each sends its 1/S of each weight
        # the destination reads), and each stage's layout of its gathered weights.
        self.gather_layout = [[] for _ in range(S)]   # stage -> [(value, dtype, offset in the packet)]
        self.gather_len: dict = {}
        self.weight_layout = [{} for _ in range(S)]   # stage -> value -> offset in its weight buffer
        self.weight_len: dict = {}
        for s in range(S):
            used, wused = {}, {}
            for v, st in self.state_readers.items():
                if s not in st or self.split_dim[v] is None:
                    continue
                dt, n = _dtype(full.avals[v]), self._local_size(v)
                self.gather_layout[s].append((v, dt, used.get(dt, 0)))
                used[dt] = used.get(dt, 0) + n // S
                self.weight_layout[s][v] = wused.get(dt, 0)
                wused[dt] = wused.get(dt, 0) + n
            for dt, n in used.items():
                self.gather_len[dt] = max(self.gather_len.get(dt, 0), n)
            for dt, n in wused.items():
                self.weight_len[dt] = max(self.weight_len.get(dt, 0), n)

    def _local_size(self, v) -> int:
        """One device's elements of state input ``v`` in its sub-mesh layout (whole over ``"stage"``)."""
        return math.prod(local_shape(self.analysis.full.avals[v].shape, self.state_pspec[v], self.rows.sizes))

    def _state_spec(self, v) -> PartitionSpec:
        """``v``'s layout between steps: its sub-mesh layout, and ``"stage"`` on its split dimension."""
        pspec, d = self.state_pspec[v], self.split_dim[v]
        if d is None:
            return pspec
        entries = list(tuple(pspec) + (None,) * (d + 1 - len(pspec)))
        entries[d] = STAGE_AXIS
        return PartitionSpec(*entries)

    def _io_shardings(self, out_ties: dict, process_local):
        """The state enters (and its next value leaves) in its :meth:`_state_layouts` layout; the batch enters
        replicated, or split over the process axes where each process passes its rows; metrics leave
        replicated."""
        full = self.analysis.full
        rep = NamedSharding(self.mesh, PartitionSpec())
        self.in_shardings = [rep if i in self.batch_positions else NamedSharding(self.mesh, self._state_spec(v))
                             for i, v in enumerate(full.graph.invars)]
        if process_local:
            from autoshard.distributed import process_axes

            rows = NamedSharding(self.mesh, PartitionSpec(process_axes(self.mesh)))
            for i in process_local:
                self.in_shardings[i] = rows
        self.out_shardings = [self.in_shardings[out_ties[j]] if j in out_ties else rep
                              for j in range(len(full.graph.outvars))]

    def _plan_memory(self, frontier):
        """Each stage's layout of its buffers: gradient accumulators, then per-microbatch values it
        keeps (stashed residuals, received activations), reused once dead; and what each task sends."""
        part, micro, k, S, T = self.part, self.analysis.micro, self.k, self.S, self.num_ticks
        # Who reads each task output: F/B tasks on this stage (stash) or on others (a message).
        readers: dict = {}
        for key in self.tasks:
            for v in part.tasks[key].invars:
                if v in part.producer_task and part.producer_task[v] != key:
                    readers.setdefault(v, []).append(key)
        self.sends = {key: [] for key in self.tasks}   # task -> [(value, destination stage)]
        items = [[] for _ in range(S)]
        for key in self.tasks:
            ph, s = key
            for v in part.tasks[key].outvars:
                dt, n = _dtype(micro.avals[v]), self.local[v]
                if v in frontier:
                    items[s].append((("acc", v), dt, self.acc_local.get(v, n), -1, T))
                    continue
                dests = sorted({rs for _, rs in readers.get(v, ())})
                self.sends[key] += [(v, rs) for rs in dests if rs != s]
                for m in range(k):
                    t = self.tick[(ph, s, m)]
                    for rs in dests:
                        last = max(self.tick[(rph, rs2, m)] for rph, rs2 in readers[v] if rs2 == rs)
                        items[rs].append(((v, m), dt, n, t, last))
        self.layout, self.mem_len = [], {}
        for s in range(S):
            placed, length = allocate(items[s])
            self.layout.append(placed)
            for dt, n in length.items():
                self.mem_len[dt] = max(self.mem_len.get(dt, 0), n)
        # Accumulators are allocated first (their interval starts at -1): they sit at the front.
        self.acc_len: dict = {}
        self.acc_of: dict = {}   # frontier value -> (stage, offset)
        for s in range(S):
            for key, off in self.layout[s].items():
                if key[0] == "acc":
                    v = key[1]
                    dt = _dtype(micro.avals[v])
                    self.acc_of[v] = (s, off)
                    self.acc_len[dt] = max(self.acc_len.get(dt, 0), off + self.acc_local.get(v, self.local[v]))

    def _plan_messages(self):
        """Per stage offset: the packet length per dtype, and the receive switch's branches and tables."""
        T, S = self.num_ticks, self.S
        # Messages: one ppermute per stage offset and dtype, as long as the largest sender needs.
        self.offsets = sorted({rs - key[1] for key, sent in self.sends.items() for _, rs in sent})
        self.packet_len = {d: {} for d in self.offsets}
        for key in self.tasks:
            for d in self.offsets:
                for dt, n in self._packet_layout(key, d)[1].items():
                    self.packet_len[d][dt] = max(self.packet_len[d].get(dt, 0), n)
        # Receive switch per offset d: branch 0 ignores the message, branch i > 0 stores what
        # self.receivers[d][i - 1] sent; the microbatch is the sender's.
        self.receivers = {d: [key for key in self.tasks if self._packet_layout(key, d)[0]] for d in self.offsets}
        self.recv_table = {d: np.zeros((T, S), np.int32) for d in self.offsets}
        self.recv_mb = {d: np.zeros((T, S), np.int32) for d in self.offsets}
        for (ph, s, m), t in self.tick.items():
            for d in self.offsets:
                if (ph, s) in self.receivers[d]:
                    self.recv_table[d][t, s + d] = 1 + self.receivers[d].index((ph, s))
                    self.recv_mb[d][t, s + d] = m

    def _check_outputs(self, frontier):
        full, part = self.analysis.full, self.part
        problems = []
        for j, v in enumerate(full.graph.outvars):
            key = part.producer_task.get(v) if isinstance(v, int) else None
            if key is not None and key[0] != "R" and v not in frontier:
                problems.append(f"output {full.out_paths[j]} is computed per microbatch")
        for t in part.update_tasks():
            for v in t.invars:
                key = part.producer_task.get(v)
                if key is not None and key[0] != "R" and v not in frontier:
                    problems.append(f"the update reads value {v} ({full.avals[v]}), computed per microbatch")
        if problems:
            raise InputError(
                "runtime='spmd' only returns batch sums (the loss, gradients) and the updated state from the "
                "pipelined part of the step:\n  " + "\n  ".join(problems) +
                "\nFix: return only reduced metrics (e.g. a mean loss), or use runtime='device_put' on one host.")

    def _packet_layout(self, key, delta):
        """``([(value, dtype, offset)], dtype -> length)`` of what task ``key`` sends ``delta`` stages on."""
        out, used = [], {}
        for v, rs in self.sends[key]:
            if rs - key[1] != delta:
                continue
            dt = _dtype(self.analysis.micro.avals[v])
            out.append((v, dt, used.get(dt, 0)))
            used[dt] = used.get(dt, 0) + self.local[v]
        return out, used

    # ---- the traced program --------------------------------------------------------------------------
    def _slot(self, s, v, m):
        """The offset of microbatch ``m``'s ``v`` in stage ``s``'s memory (``m`` is traced)."""
        return jnp.asarray([self.layout[s][(v, mm)] for mm in range(self.k)], jnp.int32)[m]

    def _zeros(self, n, dt):
        """A ``(rows, n)`` buffer, row ``r`` on the stage's ``r``-th device."""
        return jax.lax.with_sharding_constraint(jnp.zeros((self.rows.rows, n), dt), self.rows.spec)

    def _padded(self, parts, n, dt):
        """``parts`` (rows) side by side, padded with zeros to ``n`` columns: one packet or buffer of a layout."""
        return jnp.concatenate([*parts, self._zeros(n - sum(p.shape[1] for p in parts), dt)], axis=1)

    def _load(self, mem, v, off):
        """Value ``v`` from its rows at ``off`` (traced) of this stage's memory, in its storage layout."""
        aval = self.analysis.micro.avals[v]
        rows = jax.lax.dynamic_slice_in_dim(mem[_dtype(aval)], off, self.local[v], axis=1)
        return self.rows.unpack(rows, self.store[v], aval.shape).astype(aval.dtype)

    def _idle(self, mem, m):
        del m
        return mem, {d: {dt: self._zeros(n, dt) for dt, n in per.items()} for d, per in self.packet_len.items()}

    def _exchange(self, packets):
        """``all_to_all`` over ``"stage"`` of ``(S, rows, length)`` packets (packet ``j`` goes to stage ``j``), each
        device keeping its own row: the rows stay split over the sub-mesh axes, before and after."""
        # Manual over the sub-mesh axes too: with them automatic, the partitioner gathers the rows first.
        rows = PartitionSpec(None, *self.rows.spec)
        return jax.shard_map(lambda p: jax.lax.all_to_all(p, STAGE_AXIS, 0, 0), in_specs=(rows,), out_specs=rows,
                             axis_names=self.rows.axes, check_vma=False)(packets)

    def _gather_weights(self, args) -> dict:
        """Inside the stage ``shard_map``: each stage's weights, whole over ``"stage"`` in their sub-mesh layout,
        as ``dtype -> (rows, length)`` buffers laid out by ``weight_layout[stage]``. Every stage packs its 1/S of
        the weights each stage reads into that stage's row of a packet; one ``all_to_all`` over ``"stage"`` hands
        every stage its rows, and each stage joins the parts of its own weights."""
        if not self.gather_len:
            return {}
        full, S = self.analysis.full, self.S
        packets = {}
        for dt, n in sorted(self.gather_len.items()):
            rows = []
            for s in range(S):
                rows.append(self._padded([self.rows.pack(args[self.invar_pos[v]], self.state_pspec[v]).astype(dt)
                                          for v, vdt, _ in self.gather_layout[s] if vdt == dt], n, dt))
            packets[dt] = self._exchange(jnp.stack(rows))

        def join(s):
            def run(got):
                out = {}
                for dt, n in sorted(self.weight_len.items()):
                    pieces = []
                    for v, vdt, off in self.gather_layout[s]:
                        if vdt != dt:
                            continue
                        aval, d = full.avals[v], self.split_dim[v]
                        block = local_shape(aval.shape, self.state_pspec[v], self.rows.sizes)
                        part = (*block[:d], block[d] // S, *block[d + 1:])
                        m = math.prod(part)
                        shards = [got[dt][j, :, off:off + m].reshape(self.rows.rows, *part) for j in range(S)]
                        pieces.append(jnp.concatenate(shards, axis=1 + d).reshape(self.rows.rows, -1))
                    out[dt] = self._padded(pieces, n, dt)
                return out
            return run

        return jax.lax.switch(jax.lax.axis_index(STAGE_AXIS), [join(s) for s in range(S)], packets)

    def _task_branch(self, key, args, weights):
        ph, s = key
        micro, ev = self.analysis.micro, self._evals[s]
        task = self.part.tasks[key]
        graph = OpGraph(task.invars, task.ops, task.outvars)
        frontier = set(task.frontier)

        def run(mem, m):
            env = {MICROBATCH: m}
            for v in task.invars:
                stored = None   # the layout x is in, where this runtime chose it
                if v in self.batch_values:   # (k, b, ...): microbatch m
                    x = jax.lax.dynamic_index_in_dim(args[self.batch_values[v]], m, 0, keepdims=False)
                elif v in self.part.producer_task:
                    x, stored = self._load(mem, v, self._slot(s, v, m)), self.store[v]
                elif v in self.weight_layout[s]:   # gathered for this stage (split over "stage" between steps)
                    aval = self.analysis.full.avals[v]
                    rows = jax.lax.slice_in_dim(weights[_dtype(aval)], self.weight_layout[s][v],
                                                self.weight_layout[s][v] + self._local_size(v), axis=1)
                    x, stored = self.rows.unpack(rows, self.state_pspec[v], aval.shape), self.state_pspec[v]
                elif v in self.invar_pos:
                    x = args[self.invar_pos[v]]
                else:
                    x = jnp.asarray(micro.consts[v])
                src = None if stored is None else ShardingSpec.from_partition_spec(stored, np.ndim(x), self.sub_info)
                env[v] = ev.constrain(x, self.handoff[s].get(v, ev.value_specs.get(v)), src)
            outs = dict(zip(task.outvars, ev.run(graph, env), strict=True))
            mem = dict(mem)
            packed = {}
            for v, o in outs.items():
                dt = _dtype(micro.avals[v])
                packed[v] = rows = self.rows.pack(o, self.acc_store.get(v, self.store[v])).astype(dt)
                if v in frontier:
                    off = self.layout[s][("acc", v)]
                    acc = jax.lax.slice_in_dim(mem[dt], off, off + rows.shape[1], axis=1)
                    mem[dt] = jax.lax.dynamic_update_slice_in_dim(mem[dt], acc + rows, off, axis=1)
                elif (v, 0) in self.layout[s]:
                    mem[dt] = jax.lax.dynamic_update_slice_in_dim(mem[dt], rows, self._slot(s, v, m), axis=1)
            packets = {}
            for d, per in self.packet_len.items():
                layout, _ = self._packet_layout(key, d)
                packets[d] = {}
                for dt, n in per.items():
                    packets[d][dt] = self._padded([packed[v] for v, vdt, _ in layout if vdt == dt], n, dt)
            return mem, packets

        return run

    def _reduce_branch(self, s):
        """After the last tick, on stage ``s``: each running sum of partials summed into its planned layout, written
        at the front of its slot (the step's one all-reduce or reduce-scatter of those gradients, over the stage's
        devices)."""
        micro, ev = self.analysis.micro, self._evals[s]

        def run(mem):
            mem = dict(mem)
            for v, ps in self.partials[s].items():
                aval, dt = micro.avals[v], _dtype(micro.avals[v])
                off = self.layout[s][("acc", v)]
                rows = jax.lax.slice_in_dim(mem[dt], off, off + self.acc_local[v], axis=1)
                acc = self.rows.unpack(rows, self.acc_store[v], ps.acc_shape(aval.shape, self.sub_info))
                (summed,) = reduce_partials(ev, [ps], [acc.astype(aval.dtype)])
                mem[dt] = jax.lax.dynamic_update_slice_in_dim(mem[dt], self.rows.pack(summed, self.store[v]).astype(dt),
                                                              off, axis=1)
            return mem

        return run

    def _receive_branch(self, key, d):
        layout, _ = self._packet_layout(key, d)
        r = key[1] + d

        def run(mem, packet, m):
            mem = dict(mem)
            for v, dt, off in layout:
                rows = packet[dt][:, off:off + self.local[v]]
                mem[dt] = jax.lax.dynamic_update_slice_in_dim(mem[dt], rows, self._slot(r, v, m), axis=1)
            return mem

        return run

    def _pipeline(self, *args):
        """The ``shard_map`` body (manual over ``"stage"`` only): a scan over ticks; returns the summed gradients
        (and loss): ``(value -> its owner's rows, stacked over "stage"; value -> its 1/S part)``."""
        stage = jax.lax.axis_index(STAGE_AXIS)
        weights = self._gather_weights(args)
        tasks = [self._idle] + [self._task_branch(key, args, weights) for key in self.tasks]
        receive = {d: [lambda mem, packet, m: mem] + [self._receive_branch(key, d) for key in self.receivers[d]]
                   for d in self.offsets}

        def tick(mem, row):
            mem, packets = jax.lax.switch(row["task"][stage], tasks, mem, row["mb"][stage])
            for d in self.offsets:
                perm = [(s, s + d) for s in range(self.S) if 0 <= s + d < self.S]
                got = {dt: jax.lax.ppermute(x, STAGE_AXIS, perm) for dt, x in packets[d].items()}
                mem = jax.lax.switch(row["recv"][d][stage], receive[d], mem, got, row["recv_mb"][d][stage])
            return mem, None

        rows = {"task": jnp.asarray(self.task_table), "mb": jnp.asarray(self.mb_table),
                "recv": {d: jnp.asarray(self.recv_table[d]) for d in self.offsets},
                "recv_mb": {d: jnp.asarray(self.recv_mb[d]) for d in self.offsets}}
        mem = {dt: self._zeros(n, dt) for dt, n in sorted(self.mem_len.items())}
        mem, _ = jax.lax.scan(tick, mem, rows)
        if any(self.partials):
            mem = jax.lax.switch(stage, [self._reduce_branch(s) for s in range(self.S)], mem)
        # A sum not scattered leaves as its owner's rows (stacked over "stage": the other stages' rows are unused).
        whole = {}
        for v, (_, off) in self.acc_of.items():
            if v not in self.sum_split:
                whole[v] = mem[_dtype(self.analysis.micro.avals[v])][None, :, off:off + self.local[v]]
        return whole, self._scatter_sums(mem)

    def _program(self, *flat):
        # Batch leaves enter as (k, b, ...): microbatch, then its examples.
        args = [x.reshape(self.k, x.shape[0] // self.k, *x.shape[1:]) if i in self.batch_positions else x
                for i, x in enumerate(flat)]
        specs = []   # over "stage" only (the manual axis): a state input split over it arrives as its 1/S part
        for i, v in enumerate(self.analysis.full.graph.invars):
            d = None if i in self.batch_positions else self.split_dim[v]
            specs.append(PartitionSpec() if d is None else PartitionSpec(*([None] * d), STAGE_AXIS))
        split_specs = {v: PartitionSpec(*([None] * d), STAGE_AXIS) for v, d in self.sum_split.items()}
        accs, sums = jax.shard_map(self._pipeline, mesh=self.mesh, in_specs=tuple(specs),
                                   out_specs=(PartitionSpec(STAGE_AXIS), split_specs),
                                   axis_names=frozenset({STAGE_AXIS}), check_vma=False)(*args)
        micro = self.analysis.micro
        sums = {v: jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self._sum_spec(v)))
                for v, x in sums.items()}
        for v, stacked in accs.items():
            s = self.acc_of[v][0]
            aval = micro.avals[v]
            rows = stacked[s]
            x = self.rows.unpack(rows, self.store[v], aval.shape, mesh=self.mesh).astype(aval.dtype)
            sums[v] = jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self._sum_spec(v)))
        # The update runs on the whole mesh, each state value split as it is between steps.
        return self._update(sums, list(flat))

    def _weight_of(self, v):
        """The state input a summed gradient ``v`` meets in the update: one of its shape, dtype and sub-mesh
        layout that is split over ``"stage"`` (None: none is)."""
        aval = self.analysis.micro.avals[v]
        for u, pspec in self.state_pspec.items():
            a = self.analysis.full.avals[u]
            if (pspec == self.store[v] and self.split_dim[u] is not None and tuple(a.shape) == tuple(aval.shape)
                    and a.dtype == aval.dtype):
                return u
        return None

    def _sum_spec(self, v) -> PartitionSpec:
        """The layout a summed gradient ``v`` meets the update in: its weight's between-steps layout (the update
        then needs only its 1/S), else its stage's layout, whole over ``"stage"``."""
        u = self.sum_weight[v]
        return self.store[v] if u is None else self._state_spec(u)

    def _scatter_layouts(self):
        """Per stage, the packing of the 1/S parts of its summed gradients that it hands every stage (along the
        dimension their weights are split over ``"stage"``), for :meth:`_scatter_sums`."""
        self.sum_weight = {v: self._weight_of(v) for v in self.acc_of}
        self.sum_split = {}
        self.scatter_layout = [[] for _ in range(self.S)]   # stage -> [(value, dtype, offset in a packet)]
        self.scatter_len: dict = {}
        for v, (s, _) in sorted(self.acc_of.items()):
            u = self.sum_weight[v]
            if u is None:
                continue
            self.sum_split[v] = self.split_dim[u]
            dt = _dtype(self.analysis.micro.avals[v])
            used = sum(self.local[w] // self.S for w, wdt, _ in self.scatter_layout[s] if wdt == dt)
            self.scatter_layout[s].append((v, dt, used))
            self.scatter_len[dt] = max(self.scatter_len.get(dt, 0), used + self.local[v] // self.S)

    def _scatter_sums(self, mem) -> dict:
        """Inside the stage ``shard_map``, after the last tick: every summed gradient's 1/S part on each stage
        (the part of the update that stage runs), by one ``all_to_all`` over ``"stage"`` from the stage that
        summed it. Returns value -> its part (the global array leaves split over ``"stage"``)."""
        if not self.scatter_len:
            return {}
        micro, S = self.analysis.micro, self.S

        def parts(v, rows):
            """The ``S`` parts of ``v``'s rows along its split dimension, each as rows."""
            block = local_shape(micro.avals[v].shape, self.store[v], self.rows.sizes)
            d, x = self.sum_split[v], rows.reshape(self.rows.rows, *block)
            step = block[d] // S
            return [jax.lax.slice_in_dim(x, j * step, (j + 1) * step, axis=1 + d).reshape(self.rows.rows, -1)
                    for j in range(S)]

        def pack(s):
            def run(mem):
                out = {}
                for dt, n in sorted(self.scatter_len.items()):
                    per_dest = [[] for _ in range(S)]
                    for v, vdt, _ in self.scatter_layout[s]:
                        if vdt == dt:
                            off = self.layout[s][("acc", v)]
                            for j, part in enumerate(parts(v, jax.lax.slice_in_dim(mem[dt], off, off + self.local[v],
                                                                                   axis=1))):
                                per_dest[j].append(part)
                    out[dt] = jnp.stack([self._padded(p, n, dt) for p in per_dest])
                return out
            return run

        packets = jax.lax.switch(jax.lax.axis_index(STAGE_AXIS), [pack(s) for s in range(S)], mem)
        got = {dt: self._exchange(x) for dt, x in packets.items()}
        out = {}
        for s in range(S):
            for v, dt, off in self.scatter_layout[s]:
                aval, d = micro.avals[v], self.sum_split[v]
                shape = (*aval.shape[:d], aval.shape[d] // S, *aval.shape[d + 1:])
                rows = got[dt][s, :, off:off + self.local[v] // S]
                out[v] = self.rows.unpack(rows, self.store[v], shape).astype(aval.dtype)
        return out

    def _update(self, sums: dict, flat: list):
        """The update tasks on the summed gradients; returns the step's flat outputs."""
        full = self.analysis.full
        env = dict(sums)
        for task in self.part.update_tasks():
            inner = {}
            for v in task.invars:
                if v in env:
                    inner[v] = env[v]
                elif v in self.invar_pos:
                    inner[v] = flat[self.invar_pos[v]]
                else:
                    inner[v] = jnp.asarray(full.consts[v])
            env.update(zip(task.outvars, self._full_ev.run(OpGraph(task.invars, task.ops, task.outvars), inner),
                           strict=True))
        outs = []
        for v in full.graph.outvars:
            if not isinstance(v, int):
                outs.append(jnp.asarray(v.value))
            elif v in env:
                outs.append(env[v])
            elif v in self.invar_pos:
                outs.append(flat[self.invar_pos[v]])
            else:
                outs.append(jnp.asarray(full.consts[v]))
        return outs

    def state_bytes(self) -> float:
        """Per-device bytes of the arguments other than the batch, in their input layouts (the train state,
        split over ``"stage"`` and the sub-mesh axes between steps, :meth:`_state_layouts`)."""
        full = self.analysis.full
        total = 0.0
        for i, (v, sharding) in enumerate(zip(full.graph.invars, self.in_shardings, strict=True)):
            if i in self.batch_positions:
                continue
            aval = full.avals[v]
            shape = tuple(getattr(aval, "shape", ()))
            total += math.prod(sharding.shard_shape(shape)) * aval.dtype.itemsize
        return total

    # ---- running -------------------------------------------------------------------------------------
    def global_inputs(self, flat):
        """Each argument as a global array on the stage mesh in its input layout (every process passes the
        same full data, or the previous step's outputs)."""
        out = []
        for x, target in zip(flat, self.in_shardings, strict=True):
            if isinstance(x, jax.Array) and x.sharding.device_set == set(self.mesh.devices.flat) \
                    and x.sharding.is_equivalent_to(target, x.ndim):
                out.append(x)
            elif jax.process_count() == 1:
                out.append(jax.device_put(x, target))
            else:
                host = np.asarray(x)
                out.append(jax.make_array_from_callback(host.shape, target, lambda idx, h=host: h[idx]))
        return out

    def lower(self, flat):
        """``jax.stages.Lowered`` of the step for ``flat`` (arrays or ``jax.ShapeDtypeStruct``s with these
        ``in_shardings``)."""
        return self._jit.lower(*flat)

    def compiled(self, flat):
        """The compiled program for ``flat``'s shapes (``.as_text()`` shows the collective-permutes)."""
        inputs = self.global_inputs(flat)
        key = tuple((np.shape(x), str(x.dtype)) for x in inputs)
        hit = self._compiled.get(key)
        if hit is None:
            hit = self._jit.lower(*inputs).compile()
            stuck = permutes_in_branches(hit)
            if stuck:   # the Evaluator's gather_then_slice should leave none; running would hang, not fail
                raise MeshError(
                    f"XLA partitioned a stage's task of the SPMD pipeline with {len(stuck)} collective-permute(s) "
                    f"(e.g. {stuck[0]}): only that stage's devices run the task, and the permute would wait for "
                    f"every device of the mesh forever. Fix: PipelineOptions(runtime='device_put') on one process, "
                    f"or other sub-mesh shapes (submeshes=...); please report the model.")
            self._compiled[key] = hit
        return hit, inputs

    def run(self, flat):
        """Run the step on flat arguments; returns flat outputs (metrics replicated, the state sharded)."""
        compiled, inputs = self.compiled(flat)
        return compiled(*inputs)
