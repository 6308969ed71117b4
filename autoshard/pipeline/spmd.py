"""Run a partitioned step as ONE SPMD program: stages on a ``"stage"`` mesh axis, ``ppermute`` between them.

``jax.device_put`` between device sets of different processes is refused outside TPU, so the
single-controller runtime (``runtime.py``) cannot span hosts. This runtime compiles the whole
pipeline into one ``jax.jit`` over a global mesh of shape ``(S, d)`` (axes ``"stage"``,
``"replica"``; stage ``s`` owns row ``s``), which every process calls, and moves activations
and cotangents inside it with ``lax.ppermute`` over ``"stage"``:

* The schedule (GPipe or 1F1B, ``schedule.stage_orders``) is list-scheduled with unit task
  times into *ticks*. The ticks are unrolled in Python; at each tick a ``lax.switch`` on
  ``lax.axis_index("stage")`` runs that stage's task (``F(s, m)``, ``B(s, m)`` or nothing),
  then one ``ppermute`` per stage offset carries what was produced to the stages that read it.
* Stages run different code and hold different values, but ``switch`` branches must agree on
  types. Every device therefore keeps one flat buffer per dtype (its *memory*) and each stage has
  its own static layout in it: received activations, residuals stashed from ``F`` for ``B``
  (no recompute), and the gradient accumulators. Slots are reused once dead (interval
  allocation over ticks), so 1F1B keeps fewer microbatches alive than GPipe. Messages are
  packed the same way, padded to the largest sender of that tick.
* After the last tick the accumulators (weight gradients, summed loss) leave ``shard_map``
  stacked over ``"stage"``; the update tasks (``R``) then run in the same jit outside
  ``shard_map``, on the whole mesh, and every output is replicated, so each process can read
  the new state and the metrics.

* Inside a stage, the ``d`` devices split every microbatch (data parallelism: the step is captured
  again at ``k * d`` microbatches, and the gradient sums are ``psum``-ed over ``"replica"``), or,
  when the microbatch does not split, compute the same thing.

First-version limits: no intra-op plan inside a stage; the state and the batch enter replicated on
every device (each process passes the full, identical arguments) and the update runs replicated;
all stages need the same number of devices; a step returning per-example values is refused.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.capture import OpGraph
from autoshard.errors import InputError, MeshError
from autoshard.lower import Evaluator
from autoshard.pipeline.partition import Partition, partition
from autoshard.pipeline.schedule import simulate, stage_orders
from autoshard.spec import MeshInfo

STAGE_AXIS = "stage"
REPLICA_AXIS = "replica"


def spans_processes(meshes) -> bool:
    """Whether the stages' devices belong to more than one process (``device_put`` cannot span them)."""
    return len({d.process_index for m in meshes for d in np.asarray(m.devices).flat}) > 1


def stage_mesh(meshes):
    """The global ``(S, d)`` mesh whose row ``s`` holds stage ``s``'s devices."""
    from autoshard.cluster import make_mesh

    sizes = [int(np.asarray(m.devices).size) for m in meshes]
    if len(set(sizes)) != 1:
        raise MeshError(
            f"runtime='spmd' needs the same number of devices on every stage, got {sizes} (stage -> devices). "
            "All stages are rows of one (stages, devices_per_stage) mesh. Fix: equal sub-meshes, e.g. "
            f"PipelineOptions(submeshes=[(1, {min(sizes)})] * {len(sizes)}), or runtime='device_put' on one host.")
    devices = [d for m in meshes for d in np.asarray(m.devices).flat]
    return make_mesh((len(meshes), sizes[0]), (STAGE_AXIS, REPLICA_AXIS), devices=devices)


def _size(aval) -> int:
    return int(math.prod(getattr(aval, "shape", ())))


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


def _forward_stage(part: Partition):
    """The stage of each forward op position in ``part`` (to cut another capture of the step the same way)."""
    stage = {p: key[1] for p in part.forward for key in part.op_tasks[p] if key[0] == "F"}
    return stage.__getitem__


class SpmdPipelineExecutable:
    """The pipelined step as one jitted SPMD program over a ``(stage, replica)`` mesh (module docstring)."""

    def __init__(self, analysis, part: Partition, meshes, schedule: str, reanalyze=None):
        self.k = k = analysis.num_microbatches
        self.schedule = schedule
        self.S = S = part.num_stages
        self.mesh = stage_mesh(meshes)
        per_stage = self.mesh.devices.shape[1]
        b = analysis.micro.avals[analysis.micro.graph.invars[analysis.batch_inputs[0]]].shape[0]
        # Data parallelism inside a stage: each of its d devices runs 1/d of every microbatch (the step
        # captured at k * d microbatches) and the gradient sums are added over "replica" at the end.
        self.dp = per_stage if reanalyze is not None and per_stage > 1 and b % per_stage == 0 else 1
        if self.dp > 1:
            try:
                analysis = reanalyze(num_microbatches=k * per_stage)
                part = partition(analysis, _forward_stage(part), S)
            except InputError:   # e.g. the step traces differently at the smaller batch: replicate instead
                self.dp = 1
        self.analysis = analysis
        self.part = part
        full, micro = analysis.full, analysis.micro
        self.batch_values = {full.graph.invars[p]: p for p in analysis.batch_inputs}
        self.batch_positions = frozenset(analysis.batch_inputs)
        self.invar_pos = {v: i for i, v in enumerate(full.graph.invars)}
        frontier = part.frontier_values
        self._check_outputs(frontier)

        # Branch 0 of the task switch idles; branch i > 0 runs self.tasks[i - 1] (on its own stage only).
        self.tasks = sorted(key for key in part.tasks if key[0] in ("F", "B"))
        self.tick = schedule_ticks(part, k, schedule)
        self.num_ticks = T = 1 + max(self.tick.values(), default=-1)
        self.task_table = np.zeros((T, S), np.int32)   # tick, stage -> branch of the task switch
        self.mb_table = np.zeros((T, S), np.int32)     # tick, stage -> microbatch
        for (ph, s, m), t in self.tick.items():
            self.task_table[t, s] = 1 + self.tasks.index((ph, s))
            self.mb_table[t, s] = m

        self._plan_memory(frontier)
        self._plan_messages()
        self._ev = Evaluator(micro, {}, {}, self.mesh, MeshInfo.from_mesh(self.mesh))
        self._full_ev = Evaluator(full, {}, {}, self.mesh, MeshInfo.from_mesh(self.mesh))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self._jit = jax.jit(self._program, out_shardings=self.replicated)
        self._compiled: dict = {}

    def _plan_memory(self, frontier):
        """Each stage's layout of its flat buffers: gradient accumulators, then per-microbatch values it
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
                aval = micro.avals[v]
                if v in frontier:
                    items[s].append((("acc", v), _dtype(aval), _size(aval), -1, T))
                    continue
                dests = sorted({rs for _, rs in readers.get(v, ())})
                self.sends[key] += [(v, rs) for rs in dests if rs != s]
                for m in range(k):
                    t = self.tick[(ph, s, m)]
                    for rs in dests:
                        last = max(self.tick[(rph, rs2, m)] for rph, rs2 in readers[v] if rs2 == rs)
                        items[rs].append(((v, m), _dtype(aval), _size(aval), t, last))
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
                    aval = micro.avals[key[1]]
                    self.acc_of[key[1]] = (s, off)
                    self.acc_len[_dtype(aval)] = max(self.acc_len.get(_dtype(aval), 0), off + _size(aval))

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
            aval = self.analysis.micro.avals[v]
            dt = _dtype(aval)
            out.append((v, dt, used.get(dt, 0)))
            used[dt] = used.get(dt, 0) + _size(aval)
        return out, used

    # ---- the traced program --------------------------------------------------------------------------
    def _slot(self, s, v, m):
        """The offset of microbatch ``m``'s ``v`` in stage ``s``'s memory (``m`` is traced)."""
        return jnp.asarray([self.layout[s][(v, mm)] for mm in range(self.k)], jnp.int32)[m]

    def _idle(self, mem, m):
        del m
        return mem, {d: {dt: jnp.zeros(n, dt) for dt, n in per.items()} for d, per in self.packet_len.items()}

    def _task_branch(self, key, args):
        ph, s = key
        micro = self.analysis.micro
        task = self.part.tasks[key]
        graph = OpGraph(task.invars, task.ops, task.outvars)
        frontier = set(task.frontier)

        def run(mem, m):
            env = {}
            for v in task.invars:
                aval = micro.avals[v]
                if v in self.batch_values:   # (k, 1, b / dp, ...) here: microbatch m, this device's part
                    env[v] = jax.lax.dynamic_index_in_dim(args[self.batch_values[v]], m, 0, keepdims=False)[0]
                elif v in self.part.producer_task:
                    off = self._slot(s, v, m)
                    env[v] = jax.lax.dynamic_slice(mem[_dtype(aval)], (off,), (_size(aval),)).reshape(aval.shape)
                elif v in self.invar_pos:
                    env[v] = args[self.invar_pos[v]]
                else:
                    env[v] = jnp.asarray(micro.consts[v])
            outs = dict(zip(task.outvars, self._ev.run(graph, env), strict=True))
            mem = dict(mem)
            for v, o in outs.items():
                dt = _dtype(micro.avals[v])
                flat = o.reshape(-1).astype(dt)
                if v in frontier:
                    off = self.layout[s][("acc", v)]
                    mem[dt] = mem[dt].at[off:off + flat.size].add(flat)
                elif (v, 0) in self.layout[s]:
                    mem[dt] = jax.lax.dynamic_update_slice(mem[dt], flat, (self._slot(s, v, m),))
            packets = {}
            for d, per in self.packet_len.items():
                layout, _ = self._packet_layout(key, d)
                packets[d] = {}
                for dt, n in per.items():
                    parts = [outs[v].reshape(-1).astype(dt) for v, vdt, _ in layout if vdt == dt]
                    used = sum(p.size for p in parts)
                    packets[d][dt] = jnp.concatenate([*parts, jnp.zeros(n - used, dt)])
            return mem, packets

        return run

    def _receive_branch(self, key, d):
        layout, _ = self._packet_layout(key, d)
        r = key[1] + d

        def run(mem, packet, m):
            mem = dict(mem)
            for v, dt, off in layout:
                x = packet[dt][off:off + _size(self.analysis.micro.avals[v])]
                mem[dt] = jax.lax.dynamic_update_slice(mem[dt], x, (self._slot(r, v, m),))
            return mem

        return run

    def _pipeline(self, *args):
        """The ``shard_map`` body: a scan over ticks; returns the stacked accumulators."""
        stage = jax.lax.axis_index(STAGE_AXIS)
        tasks = [self._idle] + [self._task_branch(key, args) for key in self.tasks]
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
        mem = {dt: jnp.zeros(n, dt) for dt, n in sorted(self.mem_len.items())}
        mem, _ = jax.lax.scan(tick, mem, rows)
        accs = {dt: mem[dt][:n] for dt, n in sorted(self.acc_len.items())}
        if self.dp > 1:
            accs = {dt: jax.lax.psum(x, REPLICA_AXIS) for dt, x in accs.items()}
        return {dt: x[None] for dt, x in accs.items()}

    def _program(self, *flat):
        # Batch leaves enter as (k, dp, b / dp, ...): microbatch, then the part of each device of a stage.
        split = PartitionSpec(None, REPLICA_AXIS) if self.dp > 1 else PartitionSpec()
        args, specs = [], []
        for i, x in enumerate(flat):
            if i in self.batch_positions:
                args.append(x.reshape(self.k, self.dp, x.shape[0] // (self.k * self.dp), *x.shape[1:]))
                specs.append(split)
            else:
                args.append(x)
                specs.append(PartitionSpec())
        accs = jax.shard_map(self._pipeline, mesh=self.mesh, in_specs=tuple(specs),
                             out_specs=PartitionSpec(STAGE_AXIS), check_vma=False)(*args)
        micro, full = self.analysis.micro, self.analysis.full
        env = {}
        for v, (s, off) in self.acc_of.items():
            aval = micro.avals[v]
            env[v] = accs[_dtype(aval)][s, off:off + _size(aval)].reshape(aval.shape)
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

    # ---- running -------------------------------------------------------------------------------------
    def global_inputs(self, flat):
        """Each argument as a replicated global array on the stage mesh (every process passes the same data)."""
        out = []
        for x in flat:
            if isinstance(x, jax.Array) and x.sharding.device_set == set(self.mesh.devices.flat) \
                    and x.sharding.is_equivalent_to(self.replicated, x.ndim):
                out.append(x)
            elif jax.process_count() == 1:
                out.append(jax.device_put(x, self.replicated))
            else:
                host = np.asarray(x)
                out.append(jax.make_array_from_callback(host.shape, self.replicated, lambda idx, h=host: h[idx]))
        return out

    def compiled(self, flat):
        """The compiled program for ``flat``'s shapes (``.as_text()`` shows the collective-permutes)."""
        inputs = self.global_inputs(flat)
        key = tuple((np.shape(x), np.dtype(x.dtype).name) for x in inputs)
        hit = self._compiled.get(key)
        if hit is None:
            hit = self._compiled[key] = self._jit.lower(*inputs).compile()
        return hit, inputs

    def run(self, flat):
        """Run the step on flat arguments; returns flat outputs, replicated on every device."""
        compiled, inputs = self.compiled(flat)
        return compiled(*inputs)
