"""Predict published, measured training runs with autoshard's performance model.

    python -m benchmarks.published [--csv ../shared/published_runs.csv] [--json benchmarks/results/published.json]
                                   [--only REGEX] [--md benchmarks/PUBLISHED.md] [--autoshard]

Each row of the CSV (format: ``../shared/published_runs.md``) is one measured multi-device run with its
configuration. The row is **reconstructed** as a JAX program and planned with autoshard, then **predicted**
with the performance model (:mod:`autoshard.perf`), in the row's own unit:

1. **Model.** :mod:`benchmarks.models.llm` with the row's dimensions. The architecture follows the model's
   family as its name gives it (GPT: LayerNorm, learned positions, GeLU, tied embeddings; Llama: RMSNorm,
   RoPE, SwiGLU, GQA, untied; MaxText's decoders: RMSNorm, ReLU, head dim 256, tied), matmuls in bf16
   (fp8 when the precision says so) with fp32 parameters and AdamW state.
2. **Parallel configuration.** Devices are laid out as ``(pipeline, data, fsdp, context, tensor)``, the
   last fastest, as Megatron-LM and MaxText order them. The data ranks that shard parameters (ZeRO-3,
   FSDP) are the ``fsdp`` axis; the rest replicate (``data``). On a TPU row the data column counts DCN
   slices and FSDP is over ICI; on a GPU row FSDP is part of the data ranks: whichever product equals the
   device count decides.
3. **Plans.** One pipeline stage (or interleaved model chunk: the first holds the embedding, the last the
   head and loss) is planned on an ``AbstractMesh`` of the ``(fsdp, context, tensor)`` devices with the
   row's layouts as hints: Megatron's column- and row-parallel weights on ``tensor``, every weight split over
   ``fsdp``, the microbatch split over ``fsdp`` and its sequence over ``context``. The planner lays out
   everything else. Three programs per stage: the forward, the forward and backward of one microbatch,
   and the optimizer update; each plan's predicted step is the list-scheduled roofline of
   :mod:`autoshard.perf`. As autoshard's own pipeline plans a stage, the stage's inputs (its parameters, fp8
   weight copies and the neighbouring stage's activations) are on the device: none is priced as a host feed.
4. **The step.** The stages' forward and backward times make a pipeline schedule
   (:func:`autoshard.perf.pipeline_seconds`: 1F1B, interleaved, or GPipe as the row says, with the
   activations crossing each stage boundary at the link between the stages' devices), plus the gradient
   all-reduce over the ``data`` replicas (once per step, after the last microbatch) and the update.
5. **Unit.** Tokens/s per device, seconds per step, or TFLOP/s per device counted by the source's FLOP
   convention as its notes state it: Megatron-LM's Eq. 3 (with the recomputed forward), MaxText's
   ``6·N·tokens`` plus causal attention; for other sources the model FLOPs without recomputation.

``--autoshard`` also plans each reconstructed row with autoshard's own configuration
(:mod:`benchmarks.published_search`: the same model, batch, hardware and device count; its own mesh
factorization, pipeline, microbatches, recomputation and layouts) and reports ``speedup``: the published
configuration's predicted step over autoshard's, both by the same model. The published configuration is
predicted as it ran; autoshard's must fit the device's memory by the model's estimate.

Unknown fields (``?``) are stated in the row's ``assumptions``, never tuned: microbatch 1, the 1F1B
schedule without interleaving, and recomputation only when the plan without it does not fit the device's
memory. A row the benchmark cannot reconstruct (mixture-of-experts layers, multi-head latent attention) is
listed with its reason. Nothing depends on a row's source beyond its FLOP convention.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import re
import statistics
import time

DEFAULT_CSV = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "published_runs.csv")
DEFAULT_JSON = "benchmarks/results/published.json"
DEFAULT_MD = "benchmarks/PUBLISHED.md"

AXES = ("fsdp", "context", "tensor")


# ---- reading a row ---------------------------------------------------------------------------------------


def _num(text) -> float | None:
    """The first number in a field (``[9216]`` -> 9216, ``2 (op)`` -> 2, ``8/dev`` -> 8); None for ``?``, ``-``."""
    if text is None:
        return None
    m = re.search(r"-?\d+(?:\.\d+)?", str(text).replace(",", ""))
    return float(m.group()) if m else None


def _int(text, default=None) -> int | None:
    v = _num(text)
    return default if v is None else int(round(v))


def _unknown(text) -> bool:
    return str(text).strip() in ("?", "")


_HARDWARE = (("a10040", "a100-40"), ("a100", "a100-80"), ("h200", "h200"), ("h100", "h100"), ("b200", "b200"),
             ("tpuv5p", "tpu-v5p"), ("tpuv5e", "tpu-v5e"), ("tpuv5", "tpu-v5p"),
             ("tpuv6e", "tpu-v6e"), ("tpuv4", "tpu-v4"))


def hardware_name(accel: str) -> str | None:
    """The :data:`autoshard.perf.HARDWARE` preset of an ``accel`` field (``A100-80GB``, ``TPUv5p``...)."""
    key = re.sub(r"[^a-z0-9]", "", accel.lower())
    for k, name in _HARDWARE:
        if key.startswith(k) or k in key:
            return name
    return None


def flop_convention(source: str) -> str:
    """The FLOP convention the source's notes state (``published_runs.md``): ``"megatron-eq3"`` counts the
    recomputed forward, ``"maxtext"`` counts 6·N·tokens plus causal attention, ``"model"`` (every other
    source) the model's FLOPs without recomputation."""
    if source.upper().startswith("MEG"):
        return "megatron-eq3"
    if source.upper().startswith("MTX"):
        return "maxtext"
    return "model"


@dataclasses.dataclass(frozen=True)
class Reconstruction:
    """A row made concrete: the model, the devices and how they are used, and what was measured.

    ``dp`` counts the data-parallel replicas outside the planned mesh (DCN slices on a TPU row), ``fsdp``
    the data ranks that shard parameters, ``microbatch`` the sequences one ``(fsdp, context, tensor)``
    replica runs per microbatch and ``microbatches`` how many make a step."""

    cfg: object  # benchmarks.models.llm.LMConfig
    hardware: str
    n: int
    dp: int
    fsdp: int
    cp: int
    tp: int
    pp: int
    virtual: int
    schedule: str
    microbatch: int
    microbatches: int
    batch: int
    recompute: str
    zero1: str  # "yes", "no" or "auto": AdamW state split over the data replicas (ZeRO-1, distributed optimizer)
    unit: str
    measured: float
    convention: str
    assumptions: tuple[str, ...]


class NotReconstructed(Exception):
    """A row the benchmark cannot express; the message is the reason."""


def reconstruct(row: dict) -> Reconstruction:
    """The :class:`Reconstruction` of one CSV row.

    Raises:
      NotReconstructed: the row needs something this benchmark does not model, with the reason.
    """
    from benchmarks.models.llm import LMConfig

    assumptions = []
    model = row["model"]
    if "moe" in model.lower() or "e top" in row["ffn"] or (_int(row.get("ep"), 1) or 1) > 1:
        raise NotReconstructed("mixture-of-experts layers (expert parallelism, top-k routing) are not in the "
                               "benchmark's model")
    if "mla" in row["heads"].lower():
        raise NotReconstructed("multi-head latent attention is not in the benchmark's model")
    hardware = hardware_name(row["accel"])
    if hardware is None:
        raise NotReconstructed(f"no hardware preset for accelerator {row['accel']!r} (autoshard.perf.HARDWARE "
                               "has the chips whose sustained matmul rate has a source)")
    n = _int(row["n_accel"])
    layers, hidden, heads = _int(row["layers"]), _int(row["hidden"]), _int(row["heads"])
    kv = _int(row["kv_heads"], heads)
    ffn = _int(row["ffn"])
    seq, batch = _int(row["seq"]), _int(row["global_batch_seqs"])
    if None in (n, layers, hidden, heads, ffn, seq, batch):
        raise NotReconstructed("a model dimension, the sequence, the batch or the device count is not stated")
    family = model.lower()
    if "llama" in family:
        arch = dict(mlp="swiglu", norm="rmsnorm", positions="rope", tied=False, head_dim=hidden // heads)
    elif "maxtext" in family:  # MaxText base.yml at the cited commit: head_dim 256, relu, tied embeddings
        arch = dict(mlp="relu", norm="rmsnorm", positions="rope", tied=True, head_dim=256)
    else:
        arch = dict(mlp="gelu", norm="layernorm", positions="learned", tied=True, head_dim=hidden // heads)
    vocab = _int(row["vocab"])
    if vocab is None:
        vocab = 51200 if "gpt" in family else 32000
        assumptions.append(f"vocab ? -> {vocab}")
    precision = row["precision"].lower()
    fp8 = "fp8" in precision

    tp, pp, cp = _int(row["tp"], 1), _int(row["pp"], 1), _int(row["cp"], 1)
    dp_col = _int(row["dp"], None)
    zero = row["fsdp_or_zero"].strip()
    fsdp_col = _int(zero) if zero.upper().startswith("FSDP") and _int(zero) else None
    if zero.upper().startswith("ZERO-3"):
        fsdp_col = "all"
    if dp_col is None:
        dp_col = n // (tp * pp * cp)
    if isinstance(fsdp_col, int) and n == dp_col * fsdp_col * tp * pp * cp:  # FSDP besides the data column
        dp, fsdp = dp_col, fsdp_col
    elif n == dp_col * tp * pp * cp:  # FSDP among the data ranks
        fsdp = dp_col if fsdp_col == "all" else (fsdp_col or 1)
        if dp_col % fsdp:
            raise NotReconstructed(f"FSDP over {fsdp} does not divide the {dp_col} data ranks")
        dp = dp_col // fsdp
    else:
        raise NotReconstructed(f"{n} devices do not factor into the stated tp={tp}, pp={pp}, cp={cp}, "
                               f"data={dp_col}, fsdp={fsdp_col}")

    if fsdp > 1 and not any(d % (fsdp * (tp if i else 1)) == 0 or (i == 0 and d % fsdp == 0)
                            for i, d in enumerate((hidden, ffn, heads * arch["head_dim"]))):
        raise NotReconstructed(f"FSDP over {fsdp} devices divides no dimension of the weights (jax and autoshard "
                               "shard dimensions evenly; ZeRO-3 pads flattened parameters)")
    sched_col = row["vp_or_schedule"].strip()
    virtual, schedule, stated_m = 1, "1f1b", None
    if sched_col.upper().startswith("VP"):
        virtual = _int(sched_col, 1)
    elif "gpipe" in sched_col.lower():
        schedule, stated_m = "gpipe", _int(sched_col)
    elif _unknown(sched_col) and pp > 1:
        assumptions.append("schedule ? -> 1F1B, not interleaved")

    mb_col = row["microbatch"].strip()
    replicas = batch // dp  # sequences one (fsdp, context, tensor) replica runs per step, over its microbatches
    if "/dev" in mb_col:  # per-device batch (MaxText): each data replica runs its share at once
        microbatches = 1
    elif stated_m:
        microbatches = stated_m
    else:
        per_rank = _int(mb_col)
        if per_rank is None:
            per_rank = 1
            assumptions.append("microbatch ? -> 1 sequence per data rank")
        microbatches = max(1, batch // (dp * fsdp * per_rank))
    if replicas % microbatches:
        raise NotReconstructed(f"{replicas} sequences per replica do not split into {microbatches} microbatches")
    microbatch = replicas // microbatches

    zero1 = "yes" if re.match(r"zero-?[12]\b|dist", zero.lower()) else "auto" if _unknown(zero) else "no"
    if zero1 == "auto":
        assumptions.append("optimizer sharding ? -> none, or over the data replicas (ZeRO-1) when the step does "
                           "not fit in memory otherwise")
    rc = row["recompute"].strip().lower()
    # Without recomputation the big runs still fuse their elementwise work into kernels that keep only the
    # matmuls' results (and FlashAttention recomputes its scores): in JAX terms, jax.checkpoint with
    # checkpoint_dots_with_no_batch_dims, the "minimal" policy. Full recomputation keeps only layer inputs.
    recompute = {"full": "full", "remat": "full", "minimal": "minimal", "selective": "minimal",
                 "none": "minimal"}.get(rc, "auto")
    if recompute == "auto" and flop_convention(row["source"]) == "megatron-eq3":
        recompute = "full"  # the source's FLOP count includes a recomputed forward pass (its notes)
        assumptions.append("recompute ? -> full, as the source's FLOP convention counts it")
    if recompute == "auto":
        assumptions.append("recompute ? -> none (the matmuls' results kept), or full when that does not fit in "
                           "memory")

    metric = row["measured_metric"].split(";")[0].strip().lower()
    value = _num(row["measured_value"].split(";")[0])
    if "tok/s" in metric:
        unit = "tok/s/device"
    elif metric.startswith("s/"):
        unit = "s/step"
    elif "tflop/s" in metric:
        unit = "TFLOP/s/device"
    else:
        raise NotReconstructed(f"unknown metric {row['measured_metric']!r}")
    cfg = LMConfig(vocab=vocab, seq=seq, hidden=hidden, layers=layers, heads=heads, kv_heads=kv, ffn=ffn,
                   fp8=fp8, remat="minimal" if recompute == "auto" else recompute, **arch)
    return Reconstruction(cfg, hardware, n, dp, fsdp, cp, tp, pp, virtual, schedule, microbatch, microbatches,
                          batch, recompute, zero1, unit, value, flop_convention(row["source"]), tuple(assumptions))


def step_flops(rec: Reconstruction) -> float:
    """The FLOPs of one step as the row's source counts them."""
    c, B, s = rec.cfg, rec.batch, rec.cfg.seq
    L, h, V = c.layers, c.hidden, c.vocab
    if rec.convention == "megatron-eq3":  # Narayanan et al. SC'21, Eq. 3 (with the recomputed forward)
        return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    tokens = B * s
    if rec.convention == "maxtext":  # MaxText train.py calculate_training_tflops: 6·N·tokens + causal attention
        return 6 * c.num_params() * tokens + 6 * L * c.heads * c.head_dim * s * tokens
    non_embed = c.num_params() - c.vocab * h * (1 if c.tied else 2)
    return 6 * (non_embed + c.vocab * h) * tokens + 6 * L * c.heads * c.head_dim * s * tokens


# ---- planning and predicting -----------------------------------------------------------------------------


def _divides(n: int, k: int) -> bool:
    return k <= 1 or n % k == 0


def _spec(shape, *names):
    """A PartitionSpec of ``names`` per dimension, dropping any mesh axis that does not divide its dimension."""
    from jax.sharding import PartitionSpec as P

    return P(*[(nm if nm is not None and _divides(d, _SIZES.get(nm, 1)) else None) for d, nm in zip(shape, names,
                                                                                                   strict=True)])


_SIZES: dict = {}  # mesh axis -> size, for _spec while hints are built


def hints(rec: Reconstruction, params: dict, inputs: dict) -> dict:
    """Path-regex -> PartitionSpec: Megatron's column/row-parallel weights on ``tensor``, every weight over
    ``fsdp``, the microbatch over ``fsdp`` and its sequence over ``context``."""
    _SIZES.clear()
    _SIZES.update(fsdp=rec.fsdp, context=rec.cp, tensor=rec.tp)
    layer_rules = {"wq": (None, "fsdp", "tensor"), "wk": (None, "fsdp", "tensor"), "wv": (None, "fsdp", "tensor"),
                   "wo": (None, "tensor", "fsdp"), "wi": (None, "fsdp", "tensor"), "wg": (None, "fsdp", "tensor"),
                   "wd": (None, "tensor", "fsdp"), "ln1": (None, None), "ln2": (None, None)}
    out = {}
    for name, names in layer_rules.items():
        if name in params["layers"]:
            out[rf"\['layers'\]\['{name}'\]$"] = _spec(params["layers"][name].shape, *names)
    top = {"embed": ("tensor", "fsdp"), "pos": (None, "fsdp"), "head": ("fsdp", "tensor"), "final_ln": (None,)}
    for name, names in top.items():
        if name in params:
            out[rf"\['{name}'\]$"] = _spec(params[name].shape, *names)
    for name, x in inputs.items():
        if name == "fp8":  # the fp8 copies of the matmul weights: laid out as the weights
            for w, y in x.items():
                out[rf"\['fp8'\]\['{w}'\]$"] = _spec(y.shape, *layer_rules[w])
            continue
        names = ("fsdp", "context") + (None,) * (len(x.shape) - 2)
        out[rf"\['{name}'\]$"] = _spec(x.shape, *names)
    return out


@dataclasses.dataclass(frozen=True)
class StagePlans:
    forward: float
    backward: float
    forward_plan: object
    backward_plan: object
    residuals: float = 0.0


# The fp8 copies of a stage's matmul weights ride in its inputs beside the microbatch; they are weights, and their
# leading size (the stage's layer count) is not the batch's (autoshard.intent reads the batch from "input" leaves).
FP8_ROLES = {r"\['fp8'\]": "parameter"}


def _plan(fun, args, mesh, cluster, hint, time_limit: float, budget: float = 1e18):
    import autoshard

    step = autoshard.parallelize(fun, mesh=mesh, cluster=cluster, hints=hint, progress=None,
                                 solver_time_limit=time_limit, remat=False, memory_budget=budget,
                                 state_roles=FP8_ROLES)
    return step.plan(*args)


def own_budget(rec: Reconstruction, cfg, stage, hw) -> float:
    """The device memory a stage program may use when autoshard lays it out itself: the device's, less the
    fp32 master weights and AdamW moments (12 bytes a parameter) of the device's model chunks, split over all
    the stage's devices and, where ZeRO-1 may be chosen (``zero1`` not ``"no"``), over the data replicas too
    (:func:`pipeline_peak` then decides it)."""
    devices = rec.fsdp * rec.cp * rec.tp * (rec.dp if rec.zero1 != "no" else 1)
    return hw.memory - 12 * stage_param_count(cfg, stage) * rec.virtual / devices


def stage_param_count(cfg, stage) -> int:
    """Elements of ``stage``'s parameters."""
    import jax

    from benchmarks.models.llm import stage_params

    return sum(math.prod(a.shape) for a in jax.tree.leaves(stage_params(cfg, stage)))


def plan_stage(rec: Reconstruction, cfg, stage, mesh, cluster, time_limit: float, *,
               budget: float | None = None) -> StagePlans:
    """The forward and the forward-and-backward of one microbatch of ``stage``, planned on ``mesh``: with the
    row's layouts as hints, or (``budget`` given: :func:`predict` with ``own_layouts``) with none, under
    that memory budget, autoshard choosing every layout."""
    import jax.numpy as jnp

    from benchmarks.models.llm import stage_inputs, stage_params, stage_programs

    params = stage_params(cfg, stage, jnp.bfloat16)
    inputs = stage_inputs(cfg, stage, rec.microbatch)
    fwd, fb, _ = stage_programs(cfg, stage)
    hint = hints(rec, params, inputs) if budget is None else {}
    fwd_inputs = {k: v for k, v in inputs.items() if k != "cotangent"}
    limit = 1e18 if budget is None else budget
    devices = rec.fsdp * rec.cp * rec.tp
    residuals = residual_bytes(fb, (params, inputs), devices)
    if budget is not None:  # the other microbatches in flight keep their residuals meanwhile
        limit -= max(in_flight(rec) - 1, 0) * residuals
        if limit <= 0:
            from autoshard.errors import InfeasibleError

            raise InfeasibleError(f"the residuals of {in_flight(rec)} microbatches in flight ({residuals:.3g} bytes "
                                  "each) leave no memory for the stage")
    # as autoshard's own pipeline plans a stage (autoshard.pipeline.search.cluster_for): its inputs are its
    # parameters (resident) and the neighbouring stage's activations (device to device), none fed from the host
    resident = dataclasses.replace(cluster, host_bandwidth=1e30)
    pf = _plan(fwd, (params, fwd_inputs), mesh, resident, {k: v for k, v in hint.items() if "cotangent" not in k},
               time_limit, limit)
    pb = _plan(fb, (params, inputs), mesh, resident, hint, time_limit, limit)
    t_f = pf.cost.total_seconds
    return StagePlans(t_f, max(pb.cost.total_seconds - t_f, 0.0), pf, pb, residuals)


_FP8_PATH = "[1]['fp8']"  # the fp8 copies of the matmul weights, in a stage program's inputs


def _param_elements(plan, mesh_sizes, prefix: str = "[0]"):
    """``(elements, elements on one device)`` of each leaf of the plan's arguments under ``prefix``: by default
    the first argument (the parameters); ``_FP8_PATH``: the fp8 copies of the matmul weights."""
    for path, (shape, _), spec in zip(plan.in_paths, plan.in_avals, plan.in_specs, strict=True):
        if path.startswith(prefix):
            yield math.prod(shape), math.prod(n // math.prod(mesh_sizes[a] for a in axes) if axes else n
                                              for n, axes in zip(shape, spec.dims, strict=True))


def _local_fp8_bytes(plan, mesh_sizes) -> float:
    """Bytes of the fp8 weight copies (one byte an element) a stage program's plan holds on one device."""
    return float(sum(local for _, local in _param_elements(plan, mesh_sizes, _FP8_PATH)))


def _weight_leaves(plan, mesh_sizes):
    """``(elements, elements on one device, bytes an element)`` of every weight a stage program reads: its bf16
    parameters and the fp8 copies of its matmul weights."""
    for prefix, itemsize in (("[0]", 2), (_FP8_PATH, 1)):
        for elements, local in _param_elements(plan, mesh_sizes, prefix):
            yield elements, local, itemsize


def _local_param_bytes(plan, mesh_sizes) -> float:
    """Bytes of the plan's first argument (the parameters) held on one device, at 2 bytes an element (the
    bf16 gradients the data replicas all-reduce)."""
    return float(sum(2 * local for _, local in _param_elements(plan, mesh_sizes)))


def gathered_weights_seconds(plan, mesh_sizes, inner: int, hw) -> float:
    """Seconds to bring the updated bf16 weights (and fp8 copies) from fp32 masters split over the stage's
    ``inner`` devices into the plan's layouts: each weight a device holds more of than its share
    (``1 / inner``) is all-gathered over the devices that share its slice, the others need nothing; the gathers
    are combined (one latency). A layout that keeps the embedding whole gathers the embedding, not every
    parameter; one that keeps the fp8 copies whole gathers them once a step, not each microbatch."""
    from autoshard.perf import group_link
    from autoshard.perf.comm import moved_bytes

    seconds, latency = 0.0, 0.0
    for elements, local, itemsize in _weight_leaves(plan, mesh_sizes):
        group = round(local * inner / max(elements, 1))
        if group >= 2:
            link = group_link(hw, group, inner)
            seconds += moved_bytes("all-gather", itemsize * local, group) / link.bandwidth
            latency = max(latency, link.latency)
    return latency + seconds


def residual_bytes(fun, args, devices: int) -> float:
    """Bytes one device keeps from a microbatch's forward for its backward: the values of ``fun`` (a
    forward-and-backward) that forward ops make and backward ops read, split over the ``devices`` of the
    stage (every residual is split: batch, sequence, heads or features). Attention scores are not kept: the
    fused kernel recomputes them in its backward (:func:`autoshard.attention.attention_scores`)."""
    from autoshard.attention import attention_scores
    from autoshard.capture import capture_graph

    program = capture_graph(fun, args)
    scores = attention_scores(program)
    backward = set()
    for op in program.graph.ops:
        if "transpose" in str(getattr(op.source_info, "name_stack", "")):
            backward.add(op.index)
    total = 0.0
    for op in program.graph.ops:
        if op.index in backward:
            continue
        for v in op.outputs:
            if v not in scores and any(u in backward for u, _ in program.uses.get(v, ())):
                aval = program.avals[v]
                total += math.prod(aval.shape) * aval.dtype.itemsize
    return total / devices


def in_flight(rec: Reconstruction, stage: int = 0) -> int:
    """Microbatches (model-chunk microbatches when interleaved) whose activations device ``stage`` of a
    pipeline keeps at once: ``min(m, p - s)`` under 1F1B, Megatron-LM's warm-up ``(p - s - 1)·2 + (v - 1)·p
    + 1`` interleaved, all of them under GPipe."""
    p, v, m = rec.pp, rec.virtual, rec.microbatches
    if rec.schedule == "gpipe":
        return m * v
    if v > 1:
        return min(m * v, (p - stage - 1) * 2 + (v - 1) * p + 1)
    return min(m, p - stage)


def _param_count(plan) -> int:
    """Elements of the plan's first argument (the parameters)."""
    return sum(math.prod(shape) for path, (shape, _) in zip(plan.in_paths, plan.in_avals, strict=True)
               if path.startswith("[0]"))


def pipeline_peak(rec: Reconstruction, plans: dict, zero1: bool = False, own: bool = False) -> float:
    """The predicted peak of the busiest device over a step (bytes).

    Device ``s`` holds, for each of its model chunks: the bf16 parameters and their gradients, the fp32
    master weights and AdamW moments (12 bytes a parameter, split over the data replicas with ZeRO-1); the
    residuals each microbatch in flight keeps for its backward (:func:`residual_bytes`); the fp8 copies of its
    matmul weights (fp8 rows), in the plan's layout; and, once, one chunk
    program's own peak beyond its parameters and gradients (its transients). In flight on device ``s``:
    :func:`in_flight`.

    ``own`` (autoshard's own layouts, :func:`predict`): the masters and moments are split over every device
    of the stage whatever the layout of the bf16 parameters (ZeRO: the update is elementwise), the updated
    parameters gathered back once a step (:func:`predict` charges that)."""
    p, v = rec.pp, rec.virtual
    sizes = dict(enumerate((rec.fsdp, rec.cp, rec.tp)))
    chunks = p * v
    worst = 0.0
    for s in range(p):
        names = ["only" if chunks == 1 else "first" if c * p + s == 0 else "last" if c * p + s == chunks - 1
                 else "middle" for c in range(v)]
        static = transient = resid = 0.0
        for name in names:
            sp = plans[name]
            params = _local_param_bytes(sp.backward_plan, sizes)  # bf16
            fp8 = _local_fp8_bytes(sp.backward_plan, sizes)  # kept across the microbatches, as the parameters
            static += fp8
            if own:  # fp32 masters and moments split over all the stage's devices (and the data replicas)
                static += 2 * params + 12 * _param_count(sp.backward_plan) / (
                    rec.fsdp * rec.cp * rec.tp * (rec.dp if zero1 else 1))
            else:
                static += 2 * params + 6 * params / (rec.dp if zero1 else 1)
            transient = max(transient, sp.backward_plan.memory.peak_bytes - 2 * params - fp8)
            resid += sp.residuals / len(names)
        # the transient peak holds one microbatch's residuals already
        worst = max(worst, static + max(in_flight(rec, s) - 1, 0) * resid + max(transient, 0.0))
    return worst


@dataclasses.dataclass(frozen=True)
class Prediction:
    step_s: float
    pipeline_s: float
    dp_reduce_s: float
    update_s: float
    bubble: float
    recompute: str
    peak_bytes: float
    plan_s: float
    plan: str
    zero1: bool = False  # AdamW state split over the data replicas


def predict(rec: Reconstruction, *, time_limit: float = 2.0, own_layouts: bool = False) -> Prediction:
    """Plan the row's stages with autoshard and compose its step (see the module docstring).

    ``own_layouts``: no hints; autoshard lays out every stage program itself on the ``(fsdp, context,
    tensor)`` mesh, under the device's memory less the optimizer state (:func:`own_budget`). A stage that
    fits no budget without recomputation is planned with it (``recompute="auto"``); one that fits neither
    raises :class:`autoshard.InfeasibleError`.
    """
    import jax
    from jax.sharding import AbstractMesh, AxisType

    from autoshard.cluster import from_hardware
    from autoshard.errors import InfeasibleError
    from autoshard.perf import collective_seconds_on, hardware_preset, pipeline_seconds
    from benchmarks.models.llm import Stage

    t0 = time.perf_counter()
    hw = hardware_preset(rec.hardware)
    cluster = from_hardware(hw)
    shape = (rec.fsdp, rec.cp, rec.tp)
    mesh = AbstractMesh(shape, AXES, axis_types=(AxisType.Auto,) * 3)
    inner = math.prod(shape)
    chunks = rec.pp * rec.virtual
    per_chunk = math.ceil(rec.cfg.layers / chunks)
    kinds = [("only", Stage(per_chunk, True, True))] if chunks == 1 else [
        ("first", Stage(per_chunk, True, False)), ("middle", Stage(per_chunk, False, False)),
        ("last", Stage(per_chunk, False, True))]
    if chunks == 2:
        kinds = [k for k in kinds if k[0] != "middle"]

    def plans_for(cfg):
        return {name: plan_stage(rec, cfg, stage, mesh, cluster, time_limit,
                                 budget=own_budget(rec, cfg, stage, hw) if own_layouts else None)
                for name, stage in kinds}

    cfg = rec.cfg
    recompute = rec.recompute
    zero1 = rec.zero1 == "yes"
    try:
        plans = plans_for(cfg)
        peak = pipeline_peak(rec, plans, zero1, own_layouts)
    except InfeasibleError:
        if not (own_layouts and rec.recompute == "auto"):
            raise
        plans, peak = None, math.inf
    if rec.zero1 == "auto" and peak > hw.memory and rec.dp > 1 and plans is not None:
        zero1 = True
        peak = pipeline_peak(rec, plans, zero1, own_layouts)
    if rec.recompute == "auto":
        recompute = "minimal"
        if peak > hw.memory:
            cfg = dataclasses.replace(cfg, remat="full")
            plans = plans_for(cfg)
            recompute = "full"
            peak = pipeline_peak(rec, plans, zero1, own_layouts)
            if rec.zero1 == "auto" and peak > hw.memory and rec.dp > 1 and not zero1:
                zero1 = True
                peak = pipeline_peak(rec, plans, zero1, own_layouts)

    # per device: its chunks' forward and backward
    def device_times(s: int):
        names = []
        for c in range(rec.virtual):
            g = c * rec.pp + s
            names.append("only" if chunks == 1 else "first" if g == 0 else "last" if g == chunks - 1 else "middle")
        return (sum(plans[k].forward for k in names), sum(plans[k].backward for k in names))

    times = [device_times(s) for s in range(rec.pp)]
    fwd, bwd = [f for f, _ in times], [b for _, b in times]
    act = rec.microbatch * cfg.seq * cfg.hidden * 2 / inner  # one device's share of a boundary's activation
    stage_devices = rec.dp * inner  # devices between one stage's and the next one's (layout (pp, dp, ...))
    transfer = collective_seconds_on(hw, "collective-permute", act, group=2, span=2 * stage_devices)
    pipe = pipeline_seconds(fwd, bwd, microbatches=rec.microbatches, schedule=rec.schedule, virtual=rec.virtual,
                            transfer=transfer if rec.pp > 1 else 0.0)
    sizes = dict(enumerate(shape))
    biggest = max(plans.values(), key=lambda p: _local_param_bytes(p.backward_plan, sizes))
    local = _local_param_bytes(biggest.backward_plan, sizes) * rec.virtual
    share = 2 * _param_count(biggest.backward_plan) * rec.virtual / inner
    # the gradients' reduction over the data replicas, once per step: an all-reduce, or with ZeRO-1 a
    # reduce-scatter and, after the update of each replica's share, an all-gather of the new bf16 weights. With
    # autoshard's own layouts the masters are split over every device of the stage (pipeline_peak), so a device
    # reduces only its share of the gradients, a slice of what it holds (a layout that keeps the embedding
    # whole on every device would otherwise reduce all of it over the replicas)
    grad_bytes = share if own_layouts else local
    if zero1:
        dp_reduce = 2 * collective_seconds_on(hw, "all-gather", grad_bytes, group=rec.dp, span=rec.dp * inner)
    else:
        dp_reduce = collective_seconds_on(hw, "all-reduce", grad_bytes, group=rec.dp, span=rec.dp * inner)
    if own_layouts:  # the updated bf16 weights gathered from the split masters into the stages' layouts
        dp_reduce += gathered_weights_seconds(biggest.backward_plan, sizes, inner, hw) * rec.virtual
    # the update: planned on the device that holds the most parameters
    stage = dict(kinds)["first" if chunks > 1 else "only"]
    update_s = _update_seconds(rec, cfg, stage, mesh, cluster, time_limit, own_layouts) * rec.virtual / (
        rec.dp if zero1 else 1)
    step = pipe.step + dp_reduce + update_s
    p0 = next(iter(plans.values())).backward_plan
    desc = (f"mesh pp{rec.pp}xdp{rec.dp}x(fsdp{rec.fsdp},cp{rec.cp},tp{rec.tp}) v{rec.virtual} m{rec.microbatches} "
            f"mb{rec.microbatch} {rec.schedule} remat={recompute} zero1={zero1} fp8={cfg.fp8} "
            f"stage comm exposed {p0.cost.exposed_communication_seconds or 0:.3g}s of {p0.cost.total_seconds:.3g}s")
    del jax
    return Prediction(step, pipe.step, dp_reduce, update_s, pipe.bubble, recompute, peak,
                      time.perf_counter() - t0, desc, zero1)


def _update_seconds(rec: Reconstruction, cfg, stage, mesh, cluster, time_limit: float, own: bool) -> float:
    """The AdamW update of ``stage``'s parameters, planned: with the row's layouts, or (``own``) by autoshard
    under the memory :func:`pipeline_peak` gives it: masters and moments (in and out) and the fp32 gradients
    split over the stage's devices, the bf16 gradients and parameters whole."""
    import jax.numpy as jnp

    from benchmarks.models.llm import stage_params, stage_programs

    master = stage_params(cfg, stage)
    _, _, update = stage_programs(cfg, stage)
    args = (master, stage_params(cfg, stage, jnp.bfloat16), {"mu": master, "nu": master})
    if not own:
        return _plan(update, args, mesh, cluster, hints(rec, master, {}), time_limit).cost.total_seconds
    count = stage_param_count(cfg, stage)
    budget = 1.25 * (28 * count / math.prod(mesh.axis_sizes) + 4 * count)  # a quarter over, for transients
    return _plan(update, args, mesh, cluster, {}, time_limit, budget).cost.total_seconds


def throughput(rec: Reconstruction, step_s: float) -> float:
    """``step_s`` in the row's unit."""
    if rec.unit == "s/step":
        return step_s
    if rec.unit == "tok/s/device":
        return rec.batch * rec.cfg.seq / (step_s * rec.n)
    return step_flops(rec) / (step_s * rec.n) / 1e12


# ---- the table -------------------------------------------------------------------------------------------


def read_rows(path: str) -> list[dict]:
    """The rows of a CSV file in ``published_runs.csv``'s format."""
    with open(path, newline="") as f:
        return [dict(r) for r in csv.DictReader(f)]


def read_rows_text(text: str) -> list[dict]:
    """The rows of CSV text in ``published_runs.csv``'s format."""
    import io

    return [dict(r) for r in csv.DictReader(io.StringIO(text))]


def _peak_rss_gb() -> float:
    """This process's peak resident memory so far (GB)."""
    import resource
    import sys

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / (1e9 if sys.platform == "darwin" else 1e6)


_NOT_PLANNED = {"speedup": None, "autoshard_plan": None, "autoshard_predicted": None, "autoshard_plan_s": 0.0,
                "autoshard_rss_gb": None}


def autoshard_fields(rec: Reconstruction, published_step_s: float | None, *, time_limit: float = 2.0) -> dict:
    """The ``--autoshard`` columns of one reconstructed row: autoshard's own configuration
    (:func:`benchmarks.published_search.search`), its prediction in the row's unit, ``speedup`` (the published
    configuration's predicted step over autoshard's, both by the same model; None when either is not
    planned), the plan in one line, the search's seconds and the process's peak RSS."""
    from benchmarks.published_search import search

    t0 = time.perf_counter()
    try:
        choice = search(rec, time_limit=time_limit)
    except Exception as e:  # reported with its reason, never dropped
        return {**_NOT_PLANNED, "autoshard_plan_s": time.perf_counter() - t0, "autoshard_rss_gb": _peak_rss_gb(),
                "autoshard_reason": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    step = choice.prediction.step_s
    return {"speedup": published_step_s / step if published_step_s else None, "autoshard_plan": choice.line(),
            "autoshard_predicted": throughput(choice.rec, step), "autoshard_step_s": step,
            "autoshard_peak_gb": choice.prediction.peak_bytes / 1e9,
            "autoshard_plan_s": choice.seconds, "autoshard_rss_gb": _peak_rss_gb(),
            "autoshard_planned": f"{choice.planned} of {choice.screened} candidates", "autoshard_reason": ""}


def run(rows: list[dict], *, only: str | None = None, time_limit: float = 2.0, autoshard: bool = False
        ) -> list[dict]:
    """Reconstruct, plan and predict each row (module docstring); with ``autoshard`` also autoshard's own
    configuration for it (:func:`autoshard_fields`)."""
    out = []
    for i, row in enumerate(rows):
        if only and not re.search(only, f"{row['source']} {row['model']} {row['n_accel']}"):
            continue
        base = {"row": i, "source": row["source"], "model": row["model"], "accel": row["accel"],
                "n_accel": _int(row["n_accel"]), "unit": None, "measured": None, "predicted": None,
                "reconstructed": False, "reason": "", "plan_s": 0.0}
        try:
            rec = reconstruct(row)
        except NotReconstructed as e:
            extra = {**_NOT_PLANNED, "autoshard_reason": f"not reconstructed: {e}"} if autoshard else {}
            out.append({**base, "reason": str(e), **extra})
            print(f"[{i}] {row['source']} {row['model']} x{row['n_accel']}: not reconstructed: {e}", flush=True)
            continue
        base.update(unit=rec.unit, measured=rec.measured, assumptions=list(rec.assumptions),
                    config={"n": rec.n, "dp": rec.dp, "fsdp": rec.fsdp, "cp": rec.cp, "tp": rec.tp, "pp": rec.pp,
                            "virtual": rec.virtual, "microbatch_per_rank": rec.microbatch // max(rec.fsdp, 1)})
        try:
            pred = predict(rec, time_limit=time_limit)
        except Exception as e:  # a failed plan is reported with its error, not dropped
            extra = autoshard_fields(rec, None, time_limit=time_limit) if autoshard else {}
            out.append({**base, "reason": f"planning failed: {type(e).__name__}: {e}", **extra})
            print(f"[{i}] {row['source']} {row['model']} x{row['n_accel']}: planning failed: {e}", flush=True)
            continue
        value = throughput(rec, pred.step_s)
        r = {**base, "reconstructed": True, "predicted": value, "ratio": value / rec.measured,
             "step_s": pred.step_s, "pipeline_s": pred.pipeline_s, "dp_reduce_s": pred.dp_reduce_s,
             "update_s": pred.update_s, "bubble": pred.bubble, "recompute": pred.recompute,
             "peak_gb": pred.peak_bytes / 1e9, "plan_s": pred.plan_s, "plan": pred.plan}
        out.append(r)
        print(f"[{i}] {row['source']} {row['model']} x{row['n_accel']}: predicted {value:.4g} measured "
              f"{rec.measured:.4g} {rec.unit} ({value / rec.measured:.3f}x) in {pred.plan_s:.1f}s; {pred.plan}",
              flush=True)
        if autoshard:
            from autoshard.perf import hardware_preset

            r["published_fits"] = pred.peak_bytes <= hardware_preset(rec.hardware).memory
            r.update(autoshard_fields(rec, pred.step_s, time_limit=time_limit))
            got = f"speedup {r['speedup']:.3f}: {r['autoshard_plan']}" if r["autoshard_plan"] else \
                f"not planned: {r['autoshard_reason']}"
            print(f"    autoshard: {got} ({r['autoshard_plan_s']:.1f}s, RSS {r['autoshard_rss_gb']:.2f} GB)",
                  flush=True)
    return out


def summary(rows: list[dict]) -> dict:
    """Median and worst |predicted/measured - 1| per source and overall."""
    done = [r for r in rows if r["reconstructed"]]

    def stats(rs):
        errs = [abs(r["ratio"] - 1) for r in rs]
        return {"rows": len(rs), "median": statistics.median(errs) if errs else None,
                "worst": max(errs) if errs else None}

    by = {}
    for src in sorted({r["source"] for r in done}):
        by[src] = stats([r for r in done if r["source"] == src])
    return {"overall": stats(done), "sources": by, "accelerators": sorted({r["accel"] for r in done}),
            "not_reconstructed": len(rows) - len(done)}


def speedups(rows: list[dict]) -> dict | None:
    """``--autoshard``: how autoshard's configurations compare with the published ones, both predicted:
    rows planned, the least and median speedup, rows under 1.00 and at 1.10 or more (None without
    ``--autoshard``)."""
    if not any("speedup" in r for r in rows):
        return None
    got = [r["speedup"] for r in rows if r.get("speedup") is not None]
    fits = [r["speedup"] for r in rows if r.get("speedup") is not None and r.get("published_fits")]
    return {"rows": len(rows), "planned": len(got), "least": min(got) if got else None,
            "median": statistics.median(got) if got else None, "under_1_00": sum(g < 1.0 for g in got),
            "at_least_1_10": sum(g >= 1.10 for g in got),
            # rows whose published configuration fits the device's memory by the model's estimate too
            "published_fits": len(fits), "under_1_00_where_published_fits": sum(g < 1.0 for g in fits),
            "least_where_published_fits": min(fits) if fits else None}


def autoshard_table(rows: list[dict]) -> str:
    """The ``--autoshard`` table: per row, the published configuration's and autoshard's predictions and
    autoshard's plan, or why the row is not planned."""
    lines = ["| # | source | model | n | unit | measured | published cfg, predicted (peak GB) | autoshard, "
             "predicted (peak GB) | speedup | search s | RSS GB | autoshard's plan / reason |",
             "|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.get("speedup") is not None:
            over = "" if r.get("published_fits", True) else " over"
            lines.append(f"| {r['row']} | {r['source']} | {r['model']} | {r['n_accel']} | {r['unit']} | "
                         f"{r['measured']:.4g} | {r['predicted']:.4g} ({r['peak_gb']:.0f}{over}) | "
                         f"{r['autoshard_predicted']:.4g} ({r['autoshard_peak_gb']:.0f}) | "
                         f"{r['speedup']:.3f} | {r['autoshard_plan_s']:.1f} | {r['autoshard_rss_gb']:.2f} | "
                         f"{r['autoshard_plan']} |")
        else:
            lines.append(f"| {r['row']} | {r['source']} | {r['model']} | {r['n_accel']} | {r['unit'] or ''} | | | | "
                         f"| | | not planned: {r.get('autoshard_reason') or r['reason']} |")
    sp = speedups(rows)
    lines += ["", f"Planned {sp['planned']} of {sp['rows']} rows; speedup least "
              f"{sp['least'] or 0:.3f}, median {sp['median'] or 0:.3f}; under 1.00: {sp['under_1_00']}; "
              f"1.10 or more: {sp['at_least_1_10']}. Where the published configuration also fits the device's "
              f"memory by the model's estimate ({sp['published_fits']} rows; \"over\" marks the others, which "
              f"ran but which the estimate puts over): under 1.00: {sp['under_1_00_where_published_fits']}, least "
              f"{sp['least_where_published_fits'] or 0:.3f}."]
    return "\n".join(lines)


def _comparable(a: dict, b: dict) -> bool:
    """Two configurations the source compares: the same model on the same machine (device count), or the
    same configuration scaled over more data replicas (slices, data ranks)."""
    if a["n_accel"] == b["n_accel"]:
        return True
    ka, kb = a.get("config", {}), b.get("config", {})
    return {k: v for k, v in ka.items() if k not in ("dp", "n")} == {k: v for k, v in kb.items() if k not in ("dp", "n")}


def rankings(rows: list[dict]) -> list[dict]:
    """Per comparison group (one source, one model, one accelerator), whether the predictions order its
    comparable configurations (:func:`_comparable`) as measured: every such pair's predicted order against its
    measured one (the unit's own direction: seconds per step rank the other way)."""
    done = [r for r in rows if r["reconstructed"]]
    groups: dict = {}
    for r in done:
        groups.setdefault((r["source"], r["model"], r["accel"]), []).append(r)
    out = []
    for (source, model, accel), rs in groups.items():
        pairs = []
        for i, a in enumerate(rs):
            for b in rs[i + 1:]:
                if not _comparable(a, b) or a["measured"] == b["measured"]:
                    continue
                sign = -1 if a["unit"] == "s/step" else 1
                measured = sign * (a["measured"] - b["measured"]) > 0
                predicted = sign * (a["predicted"] - b["predicted"]) > 0
                pairs.append({"rows": [a["row"], b["row"]], "as_measured": measured == predicted})
        if pairs:
            out.append({"source": source, "model": model, "accel": accel, "pairs": pairs,
                        "ranked_as_measured": all(p["as_measured"] for p in pairs)})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| # | source | model | accel | n | unit | measured | predicted | pred/meas | plan s | plan / reason |",
             "|---:|---|---|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["reconstructed"]:
            lines.append(f"| {r['row']} | {r['source']} | {r['model']} | {r['accel']} | {r['n_accel']} | {r['unit']} | "
                         f"{r['measured']:.4g} | {r['predicted']:.4g} | {r['ratio']:.3f} | {r['plan_s']:.1f} | "
                         f"{r['plan']} |")
        else:
            lines.append(f"| {r['row']} | {r['source']} | {r['model']} | {r['accel']} | {r['n_accel']} | "
                         f"{r['unit'] or ''} | {r['measured'] if r['measured'] is not None else ''} | | | | "
                         f"not reconstructed: {r['reason']} |")
    s = summary(rows)
    ranks = rankings(rows)
    if ranks:
        lines.append("")
        lines.append("| comparison group | pairs | ranked as measured | pairs ordered otherwise |")
        lines.append("|---|---:|---|---|")
        for g in ranks:
            wrong = ", ".join(f"{a} vs {b}" for a, b in (p["rows"] for p in g["pairs"] if not p["as_measured"]))
            lines.append(f"| {g['source']} {g['model']} ({g['accel']}) | {len(g['pairs'])} | "
                         f"{'yes' if g['ranked_as_measured'] else 'no'} | {wrong} |")
    lines.append("")
    lines.append("| over | rows | median abs error | worst abs error |")
    lines.append("|---|---:|---:|---:|")
    for name, st in [("all", s["overall"]), *s["sources"].items()]:
        if st["rows"]:
            lines.append(f"| {name} | {st['rows']} | {st['median']:.1%} | {st['worst']:.1%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", default=DEFAULT_CSV)
    ap.add_argument("--json", default=DEFAULT_JSON)
    ap.add_argument("--md", default=None, help="also write the table to this markdown file")
    ap.add_argument("--only", default=None, help="regex over 'source model n_accel'")
    ap.add_argument("--solver-time", type=float, default=2.0)
    ap.add_argument("--autoshard", action="store_true",
                    help="also plan each row with autoshard's own configuration search (benchmarks/"
                         "published_search.py) and report its predicted speedup over the published one")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.csv):
        ap.error(f"--csv {args.csv}: no such file (the published runs are ../shared/published_runs.csv beside "
                 "this checkout; pass --csv FILE for another file in the same format)")
    rows = run(read_rows(args.csv), only=args.only, time_limit=args.solver_time, autoshard=args.autoshard)
    text = table(rows)
    if args.autoshard:
        text += "\n\n## autoshard's own configurations\n\n" + autoshard_table(rows)
    print()
    print(text)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary(rows), "rankings": rankings(rows),
                       "speedups": speedups(rows)}, f, indent=1, default=str)
        print(f"wrote {args.json}")
    if args.md:
        with open(args.md, "w") as f:
            f.write(_md_header(args) + text + "\n")
    return 0


def _md_header(args) -> str:
    """Where the table came from: the command, the commit and the date (the analysis is in benchmarks/README.md)."""
    import datetime

    from benchmarks.output import commit
    command = "python -m benchmarks.published" + (f" --csv {args.csv}" if args.csv != DEFAULT_CSV else "") + \
        (f" --only '{args.only}'" if args.only else "") + (" --autoshard" if args.autoshard else "") + \
        f" --md {args.md}"
    return (f"# Published runs, predicted\n\nWritten by `{command}` at commit {commit()} on "
            f"{datetime.date.today().isoformat()}. Each row: a measured run of `{os.path.relpath(args.csv)}` rebuilt as a JAX program, "
            "planned on an AbstractMesh of its device count and predicted by autoshard's performance model "
            "(`autoshard.perf`), in the source's unit (`pred/meas` above 1: the model is too fast). What the "
            "errors come from, and how each constant was chosen: benchmarks/README.md, \"Published runs\".\n\n")


if __name__ == "__main__":
    raise SystemExit(main())
