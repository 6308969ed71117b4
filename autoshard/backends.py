"""Backend profiles: what the XLA backend that compiles a plan does differently.

A :class:`BackendProfile` is chosen once per plan from the platform of the mesh's devices
(:func:`profile_for_mesh`), or passed by the user (``PlanRequest.profile``), the way jax
registers lowerings per platform. The memory estimate (:func:`autoshard.memory.estimate_memory`)
and the lowering (:func:`autoshard.lower.make_flat_function`) read it; nothing else in autoshard
asks which platform it is on for these behaviours.

**The profile follows the devices that compile, not the cluster preset.** The benchmarks plan
for presets named after GPUs and TPUs (``h100-nvlink``, ``tpu-v5e``) on simulated CPU devices,
and XLA:CPU compiles what they measure. The preset prices compute and links; the profile models
the compiler that builds the program, so it comes from ``mesh.devices`` (CPU there), and a plan's
predicted memory is checked against the ``memory_analysis()`` of the program XLA actually built.
One exception: devices that stand in for the preset's chips (no ``memory_budget``, so the budget is
that chip's memory: :meth:`autoshard.driver.MeshTarget.stands_in`) are planned with the chip's
profile (:meth:`~autoshard.driver.MeshTarget.profile`), as an ``AbstractMesh`` is; the lowering
still follows the devices. A comparison with XLA:CPU's compile there passes ``profile=CPU``.

Each rule below says what it follows. The CPU profile reproduces, exactly, the estimate that was
measured against XLA:CPU (``python -m benchmarks.memory_gap``); the GPU and TPU profiles start
from XLA's documented behaviour and are not yet measured.
"""

from __future__ import annotations

import dataclasses

_CPU_LIBRARY_REDUCTIONS = frozenset(("reduce_sum", "reduce_max", "reduce_min", "reduce_prod"))


@dataclasses.dataclass(frozen=True, slots=True)
class BackendProfile:
    """Platform behaviour of one XLA backend, as the memory estimate and the lowering need it.

    Attributes:
      platform: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (jax's platform names; ``"cuda"``/``"rocm"``
        map to ``"gpu"``).
      buffer_alignment: bytes every temporary buffer is rounded up to.
      library_reductions: reductions the backend emits as library calls that take no broadcast
        operand, so a centring ``x - broadcast(mean)`` feeding one is written out.
      conv_layout_copies: convolution operands (and results) not in the backend's one convolution
        layout are copied (transposed) into it.
      maxpool_index_buffers: ``select_and_scatter_add`` (a max-pool gradient) is expanded into an
        argmax over each window, with index buffers (the memory estimate's lowering buffers).
      reduce_scatter_as_all_reduce: the backend emits a reduce-scatter as an all-reduce and a slice.
      widen_half_precision_collectives: the backend moves 2-byte floats (bf16, f16) through
        collectives as f32 (:class:`autoshard.cost.CostModel` prices their bytes so).
      mixed_precision_dots: the backend runs an unfused bf16 x bf16 -> f32 dot (XLA:CPU does not:
        :func:`autoshard.precision.widen_operands`; it computes a bf16 dot on f32 copies of its operands, which the
        memory estimate counts, ``memory._widened_operands``).
      async_collectives: collectives run asynchronously (start/done pairs), overlapping compute.
      latency_hiding_scheduler: XLA schedules with the latency-hiding scheduler (which starts from a
        memory-minimising schedule and may keep more alive to overlap collectives).
      inputs_gathered_at_start: XLA schedules the gather of a step argument (an operand resharded to a larger
        layout) at the step's start, so the gathered copy lives from there to its last reader; otherwise the
        gather runs at its first reader, as a memory-minimising schedule places it.
      remat_select_fence: lowering keeps a recompute distinct with a select on an always-true
        predicate, besides the optimization barrier (the backend may expand the barrier before CSE).
      fused_attention: the backend runs attention (scores, mask, softmax, their product with the values, and
        the backward of all that) as one kernel, so the score matrices stay on chip: the memory estimate and
        the solver's row give them no buffer, as the performance model prices them as a kernel
        (:func:`autoshard.attention.attention_scores`). A step traced on CPU for a GPU or TPU target has the XLA
        form of ``jax.nn.dot_product_attention``; on the target, ``implementation=None`` picks cuDNN's
        kernel (or the user's flash/splash kernel). A step that forces ``implementation="xla"`` there
        materialises the scores: plan it with ``profile=dataclasses.replace(GPU, fused_attention=False)``.
      calibrate_row: the solver's memory row is calibrated to the estimate when a budget binds
        (:func:`autoshard.driver.solve_under_budget`): the row prices live values in the program's own
        order, 1.1x to 1.3x the estimate's list schedule, and the estimate is the one trusted.
    """

    platform: str
    buffer_alignment: int = 1
    library_reductions: frozenset = frozenset()
    conv_layout_copies: bool = False
    maxpool_index_buffers: bool = False
    reduce_scatter_as_all_reduce: bool = False
    widen_half_precision_collectives: bool = False
    mixed_precision_dots: bool = True
    async_collectives: bool = False
    latency_hiding_scheduler: bool = False
    inputs_gathered_at_start: bool = True
    remat_select_fence: bool = False
    fused_attention: bool = False
    calibrate_row: bool = True

    def aligned(self, nbytes: float) -> float:
        """``nbytes`` rounded up to the buffer alignment."""
        a = self.buffer_alignment
        return float(-(-nbytes // a) * a) if a > 1 else float(nbytes)


CPU = BackendProfile(
    "cpu",
    # xla/backends/cpu/alignment.h: "XLA:CPU itself aligns intermediate buffers to this boundary"
    # (Align() = 64, tsl::Allocator::kAllocatorAlignment).
    buffer_alignment=64,
    # XLA:CPU runs large reductions as library fusions that take no broadcast: BatchNorm's x - mean
    # is written out in the forward and kept for the backward's sum((x - mean) * dy). Measured on the
    # tiny Wide-ResNet (benchmarks/memory_gap.py); the rule is kept to the centring.
    library_reductions=_CPU_LIBRARY_REDUCTIONS,
    # XLA:CPU's convolution runtime (Eigen) takes [batch, spatial..., feature] images and
    # [spatial..., in, out] kernels; layout assignment copies other layouts (memory_gap.py).
    conv_layout_copies=True,
    # cpu_compiler.cc runs SelectAndScatterExpander ("rewrite select-and-scatter as a scatter and a
    # reduce-window"): the winners' indices and the index iotas are buffers of their own.
    maxpool_index_buffers=True,
    # XLA:CPU has no reduce-scatter thunk: the partitioner's reduce-scatter becomes an all-reduce
    # and a dynamic slice (what autoshard.cost prices on CPU).
    reduce_scatter_as_all_reduce=True,
    # XLA:CPU's collectives reduce bf16/f16 in f32: the partitioned program converts around each
    # one, so the bytes moved are f32's (tests/test_precision.py compiles it).
    widen_half_precision_collectives=True,
    # XLA:CPU cannot execute an unfused bf16 x bf16 -> f32 dot ("Unsupported element type for
    # DotThunk::Execute"): precision="bf16" rounds the operands and widens them back to f32.
    mixed_precision_dots=False,
    # XLA:CPU expands optimization_barrier before CSE (autoshard/lower.py).
    remat_select_fence=True,
    # XLA:CPU keeps more alive than the estimate around recomputation (notebook 03: a remat plan of
    # 8.62 MiB predicted compiles to 10.84 MiB); the row's program order covers it, so the row stands.
    calibrate_row=False,
)

GPU = BackendProfile(
    "gpu",
    # XLA:GPU aligns its buffers to kXlaAllocatedBufferAlignBytes (xla/service/gpu/gpu_constants.h;
    # 128 or 256 bytes by version) and the BFC allocator rounds requests up to 256 bytes
    # (kMinAllocationSize); 256 bounds both. Not yet measured against memory_analysis().
    buffer_alignment=256,
    # XLA:GPU emits a reduce with its elementwise producers, broadcasts included, as one reduction
    # fusion (the reduction emitter's input fusion): nothing to write out for a centring.
    library_reductions=frozenset(),
    # cuDNN convolutions get the layout they need from GPU layout assignment (NCHW or NHWC by dtype
    # and architecture); those copies are not modelled until measured on a GPU.
    conv_layout_copies=False,
    # gpu_compiler.cc runs SelectAndScatterExpander too ("Rewrite select-and-scatter as a scatter and
    # a reduce-window").
    maxpool_index_buffers=True,
    # NCCL has a reduce-scatter; XLA:GPU emits it (ReduceScatterCreator in gpu_compiler.cc).
    reduce_scatter_as_all_reduce=False,
    # Collectives are async by default (--xla_gpu_disable_async_collectives lists the kinds to turn
    # off: NVIDIA JAX-Toolbox PGLE.md) and --xla_gpu_enable_latency_hiding_scheduler moves them to
    # overlap compute (docs.jax.dev/en/latest/gpu_performance_tips.html).
    async_collectives=True,
    latency_hiding_scheduler=True,
    # The latency-hiding scheduler starts from a memory-minimising schedule (see TPU below), which runs an
    # all-gather just before its first reader, and overlaps it with the compute before that within its memory
    # limit; XLA:CPU's sequential schedule was measured to gather arguments at the start (memory.py).
    inputs_gathered_at_start=False,
    # jax.checkpoint relies on optimization_barrier alone on GPU.
    remat_select_fence=False,
    # cuDNN's fused attention (jax.nn.dot_product_attention picks it on GPU; MaxText, NeMo and Megatron
    # train with flash attention): scores never reach HBM.
    fused_attention=True,
    # Measured on one H200 (GPT-1.3B, bf16, cuDNN attention; benchmarks/results/gpu.json): the estimate
    # is 1.07x XLA's peak, 1.09x with 4 of 8 forward segments recomputed, and the row 1.24x the estimate.
    calibrate_row=True,
)

# TPU shares the XLA behaviour the GPU profile cites: reductions fuse their producers (no library
# reductions), SelectAndScatterExpander is a generic pass, and libtpu schedules async start/done
# collectives with the latency-hiding scheduler over a memory-minimising base schedule (its
# precondition: "LatencyHidingScheduler expects a base schedule that minimizes memory pressure").
# TPU arrays are padded to (8, 128) tiles, a shape effect the estimate does not model yet; no buffer
# alignment rule is documented, so none is applied.
TPU = dataclasses.replace(GPU, platform="tpu", buffer_alignment=1)

PROFILES = {"cpu": CPU, "gpu": GPU, "cuda": GPU, "rocm": GPU, "tpu": TPU}


def profile_for(platform: str) -> BackendProfile:
    """The profile of jax platform ``platform`` (``"cpu"``, ``"gpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``).

    Example:
        >>> from autoshard.backends import profile_for
        >>> profile_for("cpu").buffer_alignment
        64
    """
    try:
        return PROFILES[platform]
    except KeyError:
        raise ValueError(f"no backend profile for platform {platform!r}. Fix: pass one of {sorted(PROFILES)}, "
                         f"or build an autoshard.backends.BackendProfile and pass it as profile=.") from None


def profile_for_mesh(mesh) -> BackendProfile:
    """The profile of the platform of ``mesh``'s devices: the backend that will compile the plan.
    An ``AbstractMesh`` has no devices: its plans are for GPUs (pass ``profile=`` for another)."""
    from autoshard.cluster import is_abstract

    return GPU if is_abstract(mesh) else profile_for(mesh.devices.flat[0].platform)


def resolve_profile(profile: BackendProfile | None, mesh, cluster=None) -> BackendProfile:
    """``profile`` when the user gave one, else the mesh's platform's. An ``AbstractMesh`` planned for a
    ``cluster`` with hardware (:class:`~autoshard.ClusterSpec`) gets its chip's platform (a TPU preset: TPU)."""
    if profile is not None:
        return profile
    from autoshard.cluster import is_abstract

    hw = getattr(cluster, "hardware", None)
    if hw is not None and is_abstract(mesh):
        return profile_for(hw.accelerator.platform)
    return profile_for_mesh(mesh)
