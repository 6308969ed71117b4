"""Multi-process (multi-host) runs on JAX's multi-controller runtime, ``jax.distributed``.

Every process runs the same program. autoshard adds three things on top of ``jax.distributed``:

1. **Process-local batches.** Each process passes its own slice of the batch (the arguments in
   ``parallelize(..., batch_argnums=...)``). autoshard plans for the *global* batch (the local leading
   dimension times the number of processes), pins its leading dimension to the mesh axes that span
   processes, and assembles global arrays with ``jax.make_array_from_process_local_data``.
2. **One plan everywhere.** Process 0 plans and broadcasts ``Plan.to_json()``; the other processes
   load it (:func:`broadcast_plan`), so a solver that is not bit-deterministic cannot split the job.
3. **Failing fast.** ``parallelize(..., step_timeout=...)`` watches every step (:class:`StepWatchdog`):
   a step that fails (a peer process died and the collective lost its connection) or does not finish
   in time prints a clear message and ends the process with :data:`STEP_FAILED_EXIT_CODE`, instead of
   hanging in a collective that Python cannot interrupt.

Example (every process runs this; see ``examples/multihost/``)::

    autoshard.distributed.initialize()          # jax.distributed.initialize, plus gloo on CPU
    mesh = autoshard.make_mesh((jax.process_count(), jax.local_device_count()), ("data", "model"))
    step = autoshard.parallelize(train_step, mesh=mesh, step_timeout=300)
    state, metrics = step(state, local_batch)   # local_batch: this process's rows only
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from autoshard.errors import InputError, MeshError, PlanError

STEP_FAILED_EXIT_CODE = 70
"""Exit status of a process that :class:`StepWatchdog` ends (``EX_SOFTWARE``)."""


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, heartbeat_timeout_seconds: int | None = None,
               initialization_timeout: int | None = None, **kwargs: Any) -> None:
    """``jax.distributed.initialize``, with CPU collectives set to gloo first.

    On a cluster that ``jax.distributed`` auto-detects (SLURM, Open MPI, Kubernetes/GKE, Cloud TPU),
    call it without arguments. Elsewhere pass the coordinator's ``host:port``, the number of
    processes and this process's id, or set ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
    ``JAX_PROCESS_ID``.

    Args:
      coordinator_address: ``host:port`` of process 0's coordination service.
      num_processes: processes in the job.
      process_id: this process's index in ``range(num_processes)``.
      heartbeat_timeout_seconds: after this many seconds without a heartbeat from a process, the
        coordination service declares it dead and ends every other process (jax's default: 100).
      initialization_timeout: seconds to wait for every process to connect (jax's default: 300).
      **kwargs: passed on to ``jax.distributed.initialize``.

    Must run before anything touches a jax device.

    Example:
      >>> import autoshard, jax
      >>> autoshard.distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=0)  # doctest: +SKIP
      >>> jax.process_count()  # doctest: +SKIP
      2
    """
    # The CPU backend all-reduces across processes only with a collectives library; gloo ships in
    # jaxlib. The flag is read when the CPU client starts and is ignored by GPU and TPU backends.
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    env = os.environ
    if num_processes is None and "JAX_NUM_PROCESSES" in env:
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and "JAX_PROCESS_ID" in env:
        process_id = int(env["JAX_PROCESS_ID"])
    if heartbeat_timeout_seconds is not None:
        kwargs["heartbeat_timeout_seconds"] = int(heartbeat_timeout_seconds)
    if initialization_timeout is not None:
        kwargs["initialization_timeout"] = int(initialization_timeout)
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)


# ---- which mesh axes span processes ----------------------------------------------------------------


def process_axes(mesh) -> tuple[str, ...]:
    """The mesh axes along which the owning process changes, in mesh order.

    A process-local batch is laid out along these axes: each process owns one contiguous run of
    their (flattened) coordinates, of equal length for every process, and holds the rows there.

    Raises:
      MeshError: a coordinate of those axes holds devices of several processes, or a process owns a
        broken run, so a process-local slice cannot be a contiguous block of the global batch.
    """
    procs = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    axes = tuple(i for i in range(procs.ndim) if np.any(np.diff(procs, axis=i) != 0))
    keep = [i for i in range(procs.ndim) if i not in axes]
    # Rows: the within-process axes; columns: the coordinates along the process axes, in order.
    blocks = np.moveaxis(procs, keep, list(range(len(keep)))).reshape(
        int(np.prod([procs.shape[i] for i in keep], dtype=int)), -1)
    names = tuple(mesh.axis_names[i] for i in axes)
    owner = blocks[0]
    runs = 1 + int(np.count_nonzero(np.diff(owner)))
    counts = np.unique(owner, return_counts=True)[1]
    if not (np.all(blocks == owner) and runs == len(counts) and np.all(counts == counts[0])):
        shape = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
        raise MeshError(
            f"the mesh {shape} mixes processes within the axes {names or '()'}: each process must own one "
            "contiguous block of devices along the axes that span processes, so that its local batch is "
            "one block of the global batch.\n"
            "Fix: build the mesh with the processes on the leading axis, e.g. "
            "autoshard.make_mesh((jax.process_count(), jax.local_device_count()), ('data', 'model')).")
    return names


# ---- process-local arguments -------------------------------------------------------------------------


def _is_global(leaf) -> bool:
    return isinstance(leaf, jax.Array) and not leaf.is_fully_addressable


def default_batch_argnums(batch_argnums, dyn, dyn_index) -> tuple[int, ...]:
    """Positional arguments that are process-local. None: the last dynamic one, unless it is global."""
    if batch_argnums is not None:
        return (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
    if not dyn:
        return ()
    leaves = jax.tree_util.tree_leaves(dyn[-1])
    if leaves and all(_is_global(x) for x in leaves):
        return ()
    return (dyn_index[-1],)


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessLocalArgs:
    """Which flat argument leaves each process passes its own slice of, and how they join.

    Attributes:
      mesh: the mesh the step runs on.
      axes: mesh axes spanning processes; a local batch's leading dimension is split over them.
      num_processes: ``jax.process_count()``.
      leaves: flat indices (over the dynamic arguments) of the process-local leaves.
      paths: their pytree paths, as in :attr:`Plan.in_paths`.
    """

    mesh: Any
    axes: tuple[str, ...]
    num_processes: int
    leaves: tuple[int, ...]
    paths: tuple[str, ...]

    @classmethod
    def create(cls, mesh, batch_argnums, dyn, dyn_index, n_args) -> ProcessLocalArgs:
        argnums = default_batch_argnums(batch_argnums, dyn, dyn_index)
        problems, local = [], set()
        for a in argnums:
            if not -n_args <= a < n_args or a % n_args not in dyn_index:
                problems.append(f"batch_argnums names argument {a}, which is not a dynamic argument "
                                f"(dynamic: {list(dyn_index)})")
            else:
                local.add(dyn_index.index(a % n_args))
        leaves, paths = [], []
        flat = jax.tree_util.tree_flatten_with_path(tuple(dyn))[0]
        for i, (path, leaf) in enumerate(flat):
            if path[0].idx not in local:
                continue
            where = f"argument {dyn_index[path[0].idx]} at {jax.tree_util.keystr(path[1:]) or '<root>'}"
            if _is_global(leaf):
                problems.append(f"{where} is already a global jax.Array; a process-local argument takes "
                                "this process's rows only (a numpy array or a local jax.Array)")
            elif np.ndim(leaf) == 0:
                problems.append(f"{where} is a scalar; a process-local batch needs a leading batch "
                                "dimension to concatenate the processes' slices along")
            leaves.append(i)
            paths.append(jax.tree_util.keystr(path))
        if problems:
            raise InputError(
                "cannot assemble the process-local arguments into global arrays:\n  " + "\n  ".join(problems)
                + "\nFix: pass parallelize(..., batch_argnums=...) naming only the arguments whose leaves each "
                "process holds its own slice of (batch_argnums=() when every argument is global or the same "
                "on every process).")
        owners = {d.process_index for d in mesh.devices.flat}
        if leaves and len(owners) != jax.process_count():
            raise MeshError(
                f"the mesh holds devices of processes {sorted(owners)} only, but {jax.process_count()} processes "
                "pass slices of the batch. Fix: build the mesh over every process's devices, e.g. "
                "autoshard.make_mesh((jax.process_count(), jax.local_device_count()), ('data', 'model')).")
        return cls(mesh, process_axes(mesh), jax.process_count(), tuple(leaves), tuple(paths))

    @classmethod
    def for_call(cls, mesh, batch_argnums, call, abstract) -> ProcessLocalArgs:
        """The process-local leaves of a bound call (:class:`autoshard.signature.BoundCall`) whose arguments
        are ``abstract``, checked to have the same shapes on every process."""
        labels = call.positional_labels
        local = cls.create(mesh, batch_argnums, call.dyn, labels, len(labels))
        local.check_same_everywhere(call.key(abstract))
        return local

    def global_abstract(self, abstract):
        """Abstract arguments with each process-local leaf's leading dim times the process count."""
        flat, tree = jax.tree_util.tree_flatten(abstract)
        for i in self.leaves:
            x = flat[i]
            flat[i] = jax.ShapeDtypeStruct((x.shape[0] * self.num_processes, *x.shape[1:]), x.dtype,
                                           weak_type=getattr(x, "weak_type", False))
        return jax.tree_util.tree_unflatten(tree, flat)

    def hints(self, user_hints: dict) -> dict:
        """``user_hints`` plus one pinning each process-local leaf's leading dim to :attr:`axes`.

        A leaf the user pinned already keeps the user's spec.
        """
        pinned = dict(user_hints)
        patterns = [re.compile(p) for p in user_hints]
        axis = self.axes[0] if len(self.axes) == 1 else (self.axes or None)
        for path in self.paths:
            if not any(rx.search(path) for rx in patterns):
                pinned["^" + re.escape(path) + "$"] = PartitionSpec(axis)
        return pinned

    def check_same_everywhere(self, key) -> None:
        """Raise the same :class:`InputError` on every process when their argument shapes differ."""
        from jax.experimental import multihost_utils

        # Shapes and dtypes only: a treedef's repr may hold process-specific addresses (static fields).
        digest = hashlib.sha256(repr(key[1]).encode()).digest()[:8]
        mine = np.frombuffer(digest, np.uint32).copy()
        everyone = np.asarray(multihost_utils.process_allgather(mine))
        differ = [p for p in range(everyone.shape[0]) if not np.array_equal(everyone[p], everyone[0])]
        if differ:
            shapes = ", ".join(f"{path}: {shape}" for path, shape in zip(self.paths, _local_shapes(key, self.leaves),
                                                                         strict=True))
            raise InputError(
                f"processes {differ} called the step with argument shapes or dtypes that differ from "
                f"process 0's (this is process {jax.process_index()}; its process-local leaves: "
                f"{shapes}). Every process must pass the same structure and the same local batch shape.\n"
                "Fix: give every process an equal slice of the global batch (drop or pad the remainder).")

    def make_global(self, flat_args, shardings) -> list:
        """Assemble the process-local leaves of ``flat_args`` into global arrays on ``shardings``."""
        out = list(flat_args)
        for i, path in zip(self.leaves, self.paths, strict=True):
            x = np.asarray(out[i])
            global_shape = (x.shape[0] * self.num_processes, *x.shape[1:])
            try:
                out[i] = jax.make_array_from_process_local_data(shardings[i], x, global_shape)
            except ValueError as e:
                raise InputError(f"cannot assemble the process-local leaf {path} of local shape {x.shape} into "
                                 f"a global array of shape {global_shape} on {shardings[i].spec}: {e}") from None
        return out


def _local_shapes(key, leaves):
    shapes = key[1]
    return [shapes[i][0] for i in leaves]


# ---- one plan for every process --------------------------------------------------------------------


def broadcast_from_first(make, encode, decode):
    """Process 0 calls ``make()``; every process returns its result: process 0 the object itself, the others
    ``decode(text)`` of the ``encode(result)`` text it sends them through a collective.

    When ``make`` fails on process 0 (say ``InfeasibleError``), every process raises that error instead
    of waiting."""
    from jax.experimental import multihost_utils

    from autoshard import errors

    source = jax.process_index() == 0
    made, failure = None, None
    if source:
        try:
            made = make()
            payload = {"text": encode(made)}
        except Exception as e:  # noqa: BLE001 - the others learn of it below, then it is raised here
            failure = e
            payload = {"error": type(e).__name__, "message": str(e)}
    data = np.frombuffer(json.dumps(payload).encode(), np.uint8) if source else np.zeros(0, np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.array([data.size], np.int32), is_source=source)[0])
    buf = data if source else np.zeros(n, np.uint8)
    buf = np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=source))
    if failure is not None:
        raise failure
    if source:
        return made
    received = json.loads(buf.tobytes().decode())
    if "error" in received:
        kind = getattr(errors, received["error"], None)
        kind = kind if isinstance(kind, type) and issubclass(kind, errors.AutoshardError) else errors.PlanError
        prefix = "" if kind.__name__ == received["error"] else f"{received['error']}: "
        raise kind(f"planning failed on process 0: {prefix}{received['message']}")
    return decode(received["text"])


def different_program(fingerprint: str, captured: str) -> PlanError:
    """The error of a process that captured another program than process 0 planned."""
    return PlanError(
        f"process 0 planned a different program (fingerprint {fingerprint}) than process "
        f"{jax.process_index()} captured ({captured}): the step function or its arguments "
        "differ between processes. Fix: run the same code with the same argument shapes everywhere.")


def broadcast_plan(make_plan, program, mesh):
    """Process 0 calls ``make_plan()``; every process returns that plan.

    The others receive its JSON (``Plan.to_json``) through a collective, load it onto ``mesh`` and
    check that it was made for the program they captured themselves. When planning fails on
    process 0 (say ``InfeasibleError``), every process raises that error instead of waiting.
    """
    from autoshard.plan import Plan

    plan = broadcast_from_first(make_plan, lambda p: p.to_json(), lambda text: Plan.from_json(text, mesh=mesh))
    if plan.fingerprint != program.fingerprint():
        raise different_program(plan.fingerprint, program.fingerprint())
    return plan


# ---- failing fast ----------------------------------------------------------------------------------


class StepWatchdog:
    """Ends the process when a step fails in a multi-process job or runs longer than ``timeout``.

    A collective whose peer process died either fails (gloo: "Connection closed by peer") or, on
    some transports, waits forever, and a blocked collective cannot be interrupted from Python. The
    watchdog waits for each step's outputs on a background thread. When the step raises in a
    multi-process job, or has not finished after ``timeout`` seconds, it prints a message naming the
    step, the process and the likely cause to stderr, and ends the process with ``os._exit``
    (status :data:`STEP_FAILED_EXIT_CODE`), so the job scheduler sees the failure at once.

    The clock starts when a step is dispatched, after planning and compiling: the timeout must
    exceed the slowest healthy step's run time.
    """

    def __init__(self, timeout: float, *, name: str = "step"):
        if not timeout > 0:
            raise InputError(f"step_timeout={timeout!r}: expected a positive number of seconds, or None")
        self.timeout = float(timeout)
        self.name = name
        self._count = 0
        self._lock = threading.Lock()

    @classmethod
    def for_step(cls, timeout: float | None, fun) -> StepWatchdog | None:
        """The watchdog of ``parallelize(fun, step_timeout=timeout)``; None when ``timeout`` is None."""
        return None if timeout is None else cls(timeout, name=f"{getattr(fun, '__name__', 'step')} call")

    def watch(self, outputs) -> None:
        """Start watching one step's ``outputs`` (any pytree of jax arrays); returns at once."""
        with self._lock:
            self._count += 1
            number = self._count
        # Read the job's shape now: the threads may run while the interpreter shuts jax down.
        where = (jax.process_index(), jax.process_count())
        done = threading.Event()
        start = time.monotonic()

        def wait():
            try:
                jax.block_until_ready(outputs)
            except Exception as e:  # noqa: BLE001 - any runtime failure of the step
                # A later step may have consumed (donated) these outputs before this thread looked:
                # that step is watched in turn, and would fail too if this one had.
                if where[1] > 1 and not _any_deleted(outputs):
                    self._die(f"{self.name} {number} failed after {time.monotonic() - start:.1f} s: "
                              f"{type(e).__name__}: {_first_line(e)}", *where)
            finally:
                done.set()

        def monitor():
            if not done.wait(self.timeout):
                self._die(f"{self.name} {number} did not finish within step_timeout={self.timeout:g} s", *where)

        threading.Thread(target=wait, name=f"autoshard-wait-{number}", daemon=True).start()
        threading.Thread(target=monitor, name=f"autoshard-watchdog-{number}", daemon=True).start()

    @staticmethod
    def _die(what: str, process: int, processes: int) -> None:
        cause = ("Most likely another process of the job died or hangs (see its log); a collective waits "
                 "for every process." if processes > 1 else "The step hangs or is slower than the timeout.")
        try:
            sys.stderr.write(
                f"\nautoshard: {what} on process {process} of {processes}. {cause}\n"
                f"autoshard: exiting with status {STEP_FAILED_EXIT_CODE} (parallelize(..., step_timeout=...) "
                "watchdog); restart the job from its last checkpoint.\n")
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            os._exit(STEP_FAILED_EXIT_CODE)


def _any_deleted(tree) -> bool:
    return any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree_util.tree_leaves(tree))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:500] if text else ""
