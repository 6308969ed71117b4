"""``Options``: every ``parallelize`` option, validated once, and what each runtime honours.

``parallelize(step, mesh=..., memory_budget=...)`` builds one frozen :class:`Options` and hands it
to the runtime that runs the step:

- ``"single"``: one SPMD program (:class:`autoshard.Parallelized`);
- ``"pipelined"``: ``num_microbatches > 1`` or ``pipeline=``: several programs over microbatches and
  stages (:class:`autoshard.pipeline.PipelinedStep`);
- ``"accumulated"``: the single runtime's last memory lever, a pipelined step over the smallest
  number of microbatches that fits (see :mod:`autoshard.pipeline.auto`);
- ``"multi-process"``: either of the first two in a ``jax.distributed`` job.

An option that a runtime cannot honour is refused with an :class:`~autoshard.errors.InputError`
naming the option and the runtime (:meth:`Options.check_runtime`); none is dropped. The table of
refusals is data, :data:`UNSUPPORTED`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from autoshard.cluster import is_device_count
from autoshard.errors import InputError

PROGRESS_KINDS = ("auto", "tqdm", "rich")
TIE_LAYERS = (True, False, "auto")
REMAT = (True, False, "auto")
RUNTIMES = ("single", "pipelined", "accumulated", "multi-process pipelined")


def _ints(value, name: str, problems: list) -> tuple:
    """``value`` (an int or a sequence of ints) as a tuple; a problem for anything else."""
    if value is None:
        return ()
    items = (value,) if isinstance(value, int) else value
    try:
        items = tuple(items)
    except TypeError:
        items = None
    if items is None or not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        problems.append(f"{name}={value!r}: expected an int or a tuple of ints. Fix: {name}=(0,) names the first "
                        "argument.")
        return ()
    return items


def _names(value, name: str, problems: list) -> tuple:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else value
    try:
        items = tuple(items)
    except TypeError:
        items = None
    if items is None or not all(isinstance(n, str) for n in items):
        problems.append(f"{name}={value!r}: expected a parameter name or a tuple of them. Fix: {name}=('batch',).")
        return ()
    return items


def _positive(value, name: str, problems: list, fix: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        problems.append(f"{name}={value!r}: expected a positive number. Fix: {fix}")


@dataclasses.dataclass(frozen=True)
class Options:
    """Every option of :func:`autoshard.parallelize`, validated once.

    Made by ``parallelize`` from its keyword arguments and validated here, all at once: an invalid
    value raises :class:`~autoshard.errors.InputError` listing every problem, each naming the option
    and ending with a fix. ``memory_budget`` is stored in bytes; the argnums and argnames are tuples.

    Attributes:
      mesh: a ``jax.sharding.Mesh`` with Auto axes (see :func:`autoshard.make_mesh`), or an ``AbstractMesh``
        (planning only). None: all devices, and the planner picks the shape among
        :func:`autoshard.cluster.candidate_meshes` (2-D within a node; over several nodes, MaxText's
        ``("data", "fsdp", "tensor")`` with data across nodes). An int: that many devices, planned as
        ``AbstractMesh`` es of those shapes (``step.plan(...)`` only; run the plan on a concrete mesh of its shape).
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
      solver_time_limit: seconds the solver may spend (on a pipelined step: on the microbatch plan
        of ``num_microbatches`` alone; each stage candidate of a ``pipeline`` has
        ``PipelineOptions.solver_time_limit``).
      tie_layers: solve structurally identical nodes (repeated layers) as one: much faster on deep
        unrolled models, and exact whenever identical layers want identical layouts (not so for
        patterns that alternate across layers). ``"auto"``: only for graphs of more than
        ``TIE_LAYERS_ABOVE`` nodes after follower merging.
      num_microbatches: split the batch arguments on their leading axis into this many microbatches,
        accumulate the gradients, and apply the update once (see :mod:`autoshard.pipeline`).
      pipeline: an :class:`autoshard.PipelineOptions`: run the step as a pipeline of stages on
        sub-meshes (inter-operator parallelism). None: no pipeline.
      progress: planning progress bar: ``"auto"`` (tqdm or rich, in a terminal or notebook), ``"tqdm"``,
        ``"rich"``, a ``callback(stage, done, total)``, or None to silence it.
      batch_argnums: the positional arguments holding the batch. In a multi-process job
        (``jax.distributed``), each process passes only its own slice of them (rows along the leading
        axis): autoshard plans for the global batch (local leading dim times ``jax.process_count()``),
        splits it over the mesh axes that span processes, and joins the slices with
        ``jax.make_array_from_process_local_data``. None: the last dynamic argument, unless its leaves
        are already global ``jax.Array``s; ``()``: none. A microbatched step splits these arguments
        into microbatches (None: every argument that is not returned updated). See
        :mod:`autoshard.distributed`.
      step_timeout: seconds. When set, a step that fails in a multi-process job (a peer process
        died) or runs longer than this prints a clear message and ends the process with status
        ``autoshard.distributed.STEP_FAILED_EXIT_CODE`` instead of hanging in a collective. The clock
        starts when the step is dispatched (after planning and compiling), so it must exceed the
        slowest healthy step's run time. None: no watchdog.
      precision: ``"bf16"``: every fp32 matmul and convolution reads bf16 copies of its operands and
        accumulates in fp32; parameters, optimizer state and the update stay fp32 (master weights).
        None or ``"fp32"``: the step's own dtypes. See :mod:`autoshard.precision`.
      remat: when the memory budget binds, let the planner also consider recomputing forward segments
        in the backward pass (chosen jointly with the sharding; see :mod:`autoshard.remat`).
        ``plan.remat`` reports the choice. ``"auto"`` (the default): wherever the runtime can. On a
        pipeline (``pipeline=``), ``True`` makes every stage's backward recompute its forward, keeping
        only each in-flight microbatch's stage inputs (:mod:`autoshard.pipeline.recompute`,
        ``plan.stats["recompute"]``); ``"auto"`` does so when no pipeline fits the memory limit without
        it. ``True`` with ``num_microbatches`` alone is an error (the microbatch program runs as
        captured). False: never.
      accumulate: when no plan of the full batch fits the memory budget (sharding, ``remat`` and host
        offload all tried), split the batch arguments into the smallest number ``k`` of
        microbatches dividing the batch size whose programs fit (XLA's compiled peaks), and
        accumulate the gradients, as ``num_microbatches=k`` would. Results equal the full step up
        to float reordering; a step whose batch reductions are not sums (a max over the batch,
        BatchNorm) is never split and keeps the InfeasibleError. Then ``step.plan(...)`` is a
        :class:`~autoshard.pipeline.PipelinePlan` with ``num_microbatches == k`` (also
        ``plan.stats["num_microbatches"]``). A budget that the full batch meets is planned as
        without it. Not with ``hints=``, nor in a multi-process job. False: raise the
        InfeasibleError instead. A microbatched or pipelined step accumulates by construction: there
        the option has nothing left to choose.
      state_roles: ``{pytree-path regex: role}`` overriding what an argument leaf is (``"parameter"``,
        ``"optimizer_state"``, ...; see :mod:`autoshard.roles`), e.g. ``{"momentum":
        "optimizer_state"}`` for an optimizer that is not optax. Roles decide what host offload may
        move (optimizer state only) and label the report. None: optax's state types, nnx variable
        types and PRNG key dtypes decide.
      profile: the :class:`autoshard.BackendProfile` of the backend the plan is for (how its compiler
        lays out memory and lowers collectives: ``autoshard.backends.CPU``, ``GPU``, ``TPU``). None: the
        platform of the mesh's devices; an ``AbstractMesh`` (no devices) plans for GPUs.
      verify: after planning, compile the whole step once (every task of a pipelined step) and record
        what XLA compiled against what the plan predicted in ``plan.stats["verify"]``: peak memory per
        device, communication bytes (``Plan.verify``) and the seconds the compile took, kept apart from
        the planning time. Planning never needs this compile (it checks memory on one representative
        program at most); it costs what compiling a large program costs. Needs concrete devices.
      filter: ``eqx.filter_jit``'s rule for the dynamic arguments. True: their array leaves (jax and
        numpy arrays, ``ShapeDtypeStruct``s) are traced and planned; every other leaf (a Python int,
        float or bool, a function, None, a string) is static: part of the cache key (by value where it is
        hashable, else by identity) and passed to the step as it is. The step's non-array outputs come
        back as it made them (an updated ``eqx.Module`` keeps its int fields and functions). False: every
        leaf is traced, as under ``jax.jit`` (a Python int becomes a traced scalar, a function is an
        error). None (the default): True for a call whose dynamic arguments hold an ``eqx.Module``, else
        False.

    Example:
      >>> import autoshard
      >>> autoshard.Options(memory_budget="2GB", static_argnums=1).memory_budget
      2000000000.0
      >>> autoshard.Options(num_microbatches=4).runtime
      'pipelined'
    """

    mesh: Any = None
    cluster: Any = None
    memory_budget: Any = None
    static_argnums: tuple = ()
    donate_argnums: tuple = ()
    static_argnames: tuple = ()
    donate_argnames: tuple = ()
    plan: Any = None
    hints: Mapping = dataclasses.field(default_factory=dict)
    solver_time_limit: float = 10.0
    tie_layers: bool | str = "auto"
    num_microbatches: int = 1
    pipeline: Any = None
    progress: str | Callable | None = "auto"
    batch_argnums: tuple | None = None
    step_timeout: float | None = None
    precision: str | None = None
    remat: bool | str = "auto"
    accumulate: bool = True
    state_roles: Mapping = dataclasses.field(default_factory=dict)
    profile: Any = None
    verify: bool = False
    filter: bool | None = None

    def __post_init__(self):
        problems: list[str] = []
        setattr_ = object.__setattr__
        setattr_(self, "memory_budget", _budget(self.memory_budget, problems))
        for name in ("static_argnums", "donate_argnums"):
            setattr_(self, name, _ints(getattr(self, name), name, problems))
        for name in ("static_argnames", "donate_argnames"):
            setattr_(self, name, _names(getattr(self, name), name, problems))
        if self.batch_argnums is not None:
            setattr_(self, "batch_argnums", _ints(self.batch_argnums, "batch_argnums", problems))
        for name in ("hints", "state_roles"):
            value = {} if getattr(self, name) is None else getattr(self, name)
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                problems.append(f"{name}={value!r}: expected a dict keyed by pytree-path regexes. Fix: "
                                f"{name}={{'kernel': ...}}.")
                value = {}
            setattr_(self, name, dict(value))
        _positive(self.solver_time_limit, "solver_time_limit", problems, "solver_time_limit=10.0 (seconds).")
        _positive(self.step_timeout, "step_timeout", problems, "step_timeout=300 (seconds), or None for no watchdog.")
        _check_choices(self, problems)
        _check_types(self, problems)
        if problems:
            raise InputError("invalid parallelize options:\n  " + "\n  ".join(problems))

    @property
    def runtime(self) -> str:
        """``"pipelined"`` when microbatches or a pipeline are asked for, else ``"single"``."""
        return "pipelined" if self.num_microbatches != 1 or self.pipeline is not None else "single"

    @property
    def wants_remat(self) -> bool:
        """Whether the single-program planner may recompute (``remat`` True or ``"auto"``)."""
        return self.remat is not False

    def replace(self, **changes) -> Options:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    def unsupported(self, runtime: str) -> list[str]:
        """Why each option set here cannot run on ``runtime`` (empty: every one is honoured)."""
        return [f"{name}= {why}" for name, (is_set, why) in UNSUPPORTED.get(runtime, {}).items() if is_set(self)]

    def check_runtime(self, runtime: str) -> None:
        """Raise :class:`InputError` naming every option set here that ``runtime`` cannot honour."""
        problems = self.unsupported(runtime)
        if problems:
            raise InputError(f"options the {runtime} runtime cannot honour:\n  " + "\n  ".join(problems))


def _budget(value, problems: list):
    from autoshard.cluster import parse_bytes

    try:
        budget = parse_bytes(value)
    except InputError as e:
        problems.append(f"{e} Fix: memory_budget=16e9 or memory_budget='16GB'.")
        return None
    if budget is not None and not budget > 0:
        problems.append(f"memory_budget={value!r}: expected a positive size. Fix: memory_budget='16GB', or None for "
                        "the ClusterSpec's memory.")
    return budget


def _check_choices(o: Options, problems: list) -> None:
    from autoshard.precision import PRECISIONS

    if o.tie_layers not in TIE_LAYERS or isinstance(o.tie_layers, int) and not isinstance(o.tie_layers, bool):
        problems.append(f"tie_layers={o.tie_layers!r}: expected True, False or 'auto'. Fix: tie_layers='auto'.")
    if o.remat not in REMAT or isinstance(o.remat, int) and not isinstance(o.remat, bool):
        problems.append(f"remat={o.remat!r}: expected True, False or 'auto'. Fix: remat='auto'.")
    if not isinstance(o.accumulate, bool):
        problems.append(f"accumulate={o.accumulate!r}: expected True or False. Fix: accumulate=True.")
    if o.filter is not None and not isinstance(o.filter, bool):
        problems.append(f"filter={o.filter!r}: expected True, False or None. Fix: filter=True to trace only the "
                        "array leaves (as eqx.filter_jit), or None to decide by whether an eqx.Module is passed.")
    if not isinstance(o.verify, bool):
        problems.append(f"verify={o.verify!r}: expected True or False. Fix: verify=True to compile the planned "
                        "step once and compare it with the prediction.")
    if not (o.progress is None or o.progress is False or callable(o.progress) or o.progress in PROGRESS_KINDS):
        problems.append(f"progress={o.progress!r}: expected 'auto', 'tqdm', 'rich', a callback(stage, done, total) or "
                        "None. Fix: progress=None to silence it.")
    if o.precision not in PRECISIONS:
        problems.append(f"precision={o.precision!r} is not supported. Fix: precision='bf16' for bf16 matmuls with "
                        "fp32 master weights, or precision=None to keep the step's dtypes.")
    k = o.num_microbatches
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        problems.append(f"num_microbatches={k!r}: expected a positive int. Fix: num_microbatches=4, or 1 for none.")


def _check_types(o: Options, problems: list) -> None:
    from autoshard.pipeline.options import PipelineOptions
    from autoshard.plan import Plan

    if o.pipeline is not None and not isinstance(o.pipeline, PipelineOptions):
        problems.append(f"pipeline={o.pipeline!r}: expected autoshard.PipelineOptions(...) or None. Fix: "
                        "pipeline=autoshard.PipelineOptions(num_stages=2).")
    if o.profile is not None:
        from autoshard.backends import BackendProfile

        if not isinstance(o.profile, BackendProfile):
            problems.append(f"profile={o.profile!r}: expected an autoshard.BackendProfile or None. Fix: "
                            "profile=autoshard.backends.GPU.")
    if o.plan is not None and not isinstance(o.plan, Plan):
        problems.append(f"plan={type(o.plan).__name__}: expected a saved autoshard.Plan. Fix: "
                        "plan=autoshard.Plan.from_json(text).")
    if o.mesh is not None:
        from autoshard.cluster import resolve_mesh
        from autoshard.errors import MeshError

        try:
            resolve_mesh(o.mesh)  # refuse a Manual-axis mesh now, not at the first call
        except MeshError as e:
            problems.append(f"mesh: {e}")


UNSUPPORTED: dict[str, dict[str, tuple[Callable[[Options], bool], str]]] = {
    "pipelined": {
        "mesh": (lambda o: is_device_count(o.mesh),
                 "as a device count: the pipeline search takes the mesh it divides into stages. Fix: "
                 "mesh=jax.sharding.AbstractMesh(shape, names) of that many devices."),
        "plan": (lambda o: o.plan is not None,
                 "(a saved Plan) is one program's layouts, and a microbatched or pipelined step runs several. "
                 "Fix: drop plan=, or run without num_microbatches/pipeline."),
        "hints": (lambda o: bool(o.hints),
                  "is not applied to the stage programs (their arguments are microbatches and stage boundaries). "
                  "Fix: drop hints=, or run without num_microbatches/pipeline."),
        "remat": (lambda o: o.remat is True and o.pipeline is None,
                  "with num_microbatches alone: the microbatch program runs as captured (a pipeline's stages "
                  "recompute their forward passes, autoshard.pipeline.recompute). Fix: remat='auto' (the "
                  "default), pipeline=autoshard.PipelineOptions(...), or run without num_microbatches."),
        "state_roles": (lambda o: bool(o.state_roles),
                        "has no effect: stage plans offload nothing. Fix: drop state_roles=, or run without "
                        "num_microbatches/pipeline."),
    },
    # The single runtime's last lever: it declines (the InfeasibleError stands) rather than drop these.
    "accumulated": {
        "hints": (lambda o: bool(o.hints), "pins layouts of the full-batch program only."),
        "accumulate": (lambda o: not o.accumulate, "is False."),
    },
    # runtime='spmd' takes process-local batch slices (batch_argnums=) as the single runtime does; nothing
    # else differs across processes.
    "multi-process pipelined": {},
}
"""Per runtime: option -> (whether it is set, why the runtime cannot honour it, with the fix)."""
