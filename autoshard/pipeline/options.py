"""``PipelineOptions``: how to cut a step into pipeline stages and run them."""

from __future__ import annotations

import dataclasses
import math

from autoshard.errors import InputError

SCHEDULES = ("gpipe", "1f1b")
RUNTIMES = ("auto", "device_put", "spmd")
GRADIENT_REDUCTIONS = ("step", "microbatch")


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """Options of inter-operator (pipeline) parallelism.

    Attributes:
      num_stages: an int, or ``"auto"``: the stage DP picks the count that minimises the
        pipeline latency. Ignored when the step calls :func:`autoshard.pipeline_boundary`
        (the boundaries fix the cut).
      layers: how many layers the forward pass is clustered into before stages are formed
        (Alpa's layer clustering); ``"auto"`` picks a few per stage (with ``num_stages="auto"``: 8 up to
        256 devices, then more as the mesh grows, :func:`autoshard.pipeline.search.auto_layer_count`).
      schedule: ``"1f1b"`` (PipeDream-flush: at most ``num_stages - s`` microbatches alive on
        stage ``s``) or ``"gpipe"`` (all forwards, then all backwards).
      submeshes: one logical mesh shape per stage, e.g. ``[(2, 2), (2, 2)]``; devices are handed
        out in order. Their sizes must add up to the mesh. None: the stage DP chooses.
      batch_argnums: positional arguments holding the batch (split on axis 0). None: every
        argument whose leaves are not returned updated (the state is; the batch is not).
      stage_cost: ``"planner"`` (each distinct layer planned on each candidate sub-mesh) or
        ``"estimate"`` (flops and data-parallel gradient all-reduce only, much faster).
      solver_time_limit: seconds the intra-op solver may spend on each stage candidate. The chosen
        stages' own plans get ``parallelize(solver_time_limit=...)`` (or this, when larger).
      runtime: ``"device_put"`` (one jitted program per task, arrays moved between stage
        sub-meshes by ``jax.device_put``: one process only), ``"spmd"`` (the whole pipeline as one
        SPMD program over a ``("stage", "data", "model")`` mesh, each stage under its intra-op plan,
        ``ppermute`` between stages: works across processes; every stage on one sub-mesh shape) or ``"auto"``
        (``"spmd"`` when the stages' devices belong to several processes, else ``"device_put"``).
      reduce_gradients: ``"step"``: a gradient that a stage's plan all-reduces over the devices splitting
        the batch is accumulated unreduced over the microbatches and all-reduced once per step (as
        Megatron-LM does; :mod:`autoshard.pipeline.deferred`); one the plan reduce-scatters is either held
        unreduced, at its unreduced size, or reduced every microbatch, as the stage's solver chooses;
        ``"microbatch"``: every microbatch's gradients are reduced as its plan says.

    Example:
      >>> import autoshard
      >>> autoshard.PipelineOptions(num_stages=2, schedule="gpipe").schedule
      'gpipe'
    """

    num_stages: int | str = "auto"
    layers: int | str = "auto"
    schedule: str = "1f1b"
    submeshes: tuple | None = None
    batch_argnums: tuple | None = None
    stage_cost: str = "planner"
    solver_time_limit: float = 2.0
    runtime: str = "auto"
    reduce_gradients: str = "step"

    def __post_init__(self):
        problems = []
        if self.schedule not in SCHEDULES:
            problems.append(f"schedule={self.schedule!r}; expected one of {SCHEDULES}")
        if not (self.num_stages == "auto" or (isinstance(self.num_stages, int) and self.num_stages >= 1)):
            problems.append(f"num_stages={self.num_stages!r}; expected a positive int or 'auto'")
        if not (self.layers == "auto" or (isinstance(self.layers, int) and self.layers >= 1)):
            problems.append(f"layers={self.layers!r}; expected a positive int or 'auto'")
        if self.runtime not in RUNTIMES:
            problems.append(f"runtime={self.runtime!r}; expected one of {RUNTIMES}")
        if self.reduce_gradients not in GRADIENT_REDUCTIONS:
            problems.append(f"reduce_gradients={self.reduce_gradients!r}; expected one of {GRADIENT_REDUCTIONS}")
        if self.stage_cost not in ("planner", "estimate"):
            problems.append(f"stage_cost={self.stage_cost!r}; expected 'planner' or 'estimate'")
        if self.submeshes is not None:
            try:
                shapes = tuple(tuple(int(d) for d in s) for s in self.submeshes)
            except TypeError:
                shapes = None
            if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
                problems.append(f"submeshes={self.submeshes!r}; expected 2-D shapes like [(2, 2), (2, 2)]")
            else:
                object.__setattr__(self, "submeshes", shapes)
                if isinstance(self.num_stages, int) and self.num_stages != len(shapes):
                    problems.append(f"num_stages={self.num_stages} but {len(shapes)} submeshes were given")
        if self.batch_argnums is not None:
            b = self.batch_argnums
            object.__setattr__(self, "batch_argnums", (b,) if isinstance(b, int) else tuple(b))
        if problems:
            raise InputError("invalid PipelineOptions: " + "; ".join(problems))

    def submesh_sizes(self) -> tuple[int, ...] | None:
        return None if self.submeshes is None else tuple(math.prod(s) for s in self.submeshes)
