"""autoshard's own configuration for a published run: ``python -m benchmarks.published --autoshard``.

For a reconstructed row (:func:`benchmarks.published.reconstruct`) this searches the parallel configurations a
practitioner would try for the same model, global batch, hardware and device count, lets autoshard lay out
every program of the chosen ones itself (no hints), and predicts the step with the same performance model
that predicts the published configuration. Nothing is read from the row's own parallel columns
(``tp, pp, dp, fsdp, cp, microbatch, recompute``): only the model, the sequence, the batch, the accelerator
and the device count.

The search, in two steps:

1. **Candidates** (:func:`candidates`): devices factor as ``pipeline × data × (fsdp, context, tensor)``, the
   last fastest. Tensor degrees are the powers of two that divide the heads, the KV heads and the device
   count, up to the accelerator's innermost link tier (an NVLink node; a TPU slice's ICI up to 16). Context
   degrees are 1, or powers of two with at least 4,096 tokens a device for sequences of 8k and more. Pipeline
   degrees are the powers of two and the divisors of the layers, up to 64 and half the layers (with a
   power of two that does not divide them, the last stage takes fewer). The data ranks all shard the parameters
   (FSDP / ZeRO-3), all replicate them (with the optimizer state over them when needed, ZeRO-1), or shard
   them within groups replicated 2, 4 or 8 times or within one group of a link tier (hybrid). A pipeline runs one
   sequence per data rank per microbatch, 1F1B, flat or interleaved (two: only a refinement of the shape the search
   settles on, :data:`PIPELINE_SEQUENCES`); without one, any power-of-two count of microbatches.
2. **Screen, then plan** (:func:`screen`, :func:`search`): every candidate gets a roofline from arithmetic
   alone (compute at the chip's sustained matmul rate, the 1F1B bubble, the tensor, context, FSDP and
   data-parallel collectives of :func:`autoshard.perf.collective_seconds_on`, and a memory count of
   weights, optimizer state, kept activations and logits). Those that fit are ranked by it. The best of
   each kind (with or without a pipeline, FSDP or replicated parameters, context split or not, tensor
   parallel or not) is planned and predicted in full (:func:`benchmarks.published.predict` with
   ``own_layouts=True``); a kind whose best is refused, over the device's memory or recomputed more than the
   screen assumed, its next ones
   (:data:`KIND_RETRIES`); then the neighbours of the fastest that fits, in the screen's order, moving
   whenever one is faster, up to :data:`MAX_EVALUATE` plans. A plan over the memory or refused says the screen
   undercounted: the next of its kind, and while nothing fits the next of any kind, is one the screen puts below
   it (a made-up Llama-3-8B at 32k tokens on 32 H100s: the 20 fastest by the screen were all over, screened at
   47-70 GiB, planned at 82 GiB and more). The fastest predicted that fits the device's memory is autoshard's
   configuration. The screen only orders; every reported number is the performance model's.
"""

from __future__ import annotations

import dataclasses
import math
import time

from benchmarks.published import in_flight, step_flops

EVALUATE = 6
"""Kinds planned in full per row before the neighbourhood search (:func:`search`)."""

MAX_EVALUATE = 20
"""At most this many full plans per row (the kinds' best, then neighbours of the fastest): 16 before tensor
parallelism became a kind of its own (:func:`_kind`). A fastest with a pipeline gets one plan more, its variant with
two sequences a microbatch (:data:`PIPELINE_SEQUENCES`)."""

KIND_RETRIES = 2
"""A kind whose best by the screen is refused or over the device's memory when planned, or planned with each layer
recomputed where the screen counted the matmuls' results kept, gets up to this many of its next candidates planned:
the screen's memory count is coarse both ways (MaxText-scale16 on 8,192 v5e chips: the best without a pipeline or
tensor parallelism, one microbatch, is refused; its next, two microbatches, plans 1.47x faster than anything else
the search planned. MaxText-scale32 on 64 v5p: one microbatch over FSDP 64 fits only recomputing every layer, 10.55
s; two microbatches keep the matmuls' results, 8.99 s)."""

PIPELINE_SEQUENCES = (1, 2)
"""Sequences a data rank puts in one pipeline microbatch (Megatron-LM's ``--micro-batch-size``; its published
GPT-3 175B runs use 1 and 2): two halve the microbatches, their per-microbatch sends and the stage programs' launches
for a longer bubble and more activations in flight."""

SCREEN_MEMORY_SHARE = 1.25
"""A candidate may be planned when the screen's memory count is under this share of the device's memory
(the count is coarse both ways; the plans decide what fits)."""

MAX_PIPELINE = 64
MIN_CONTEXT_TOKENS = 4096
MIN_CHUNK_LAYERS = (4, 2)
"""Interleaved pipelines tried: the most model chunks per device with at least this many layers each."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """autoshard's configuration for one row, predicted."""

    rec: object  # benchmarks.published.Reconstruction
    prediction: object  # benchmarks.published.Prediction
    screened: int
    planned: int
    seconds: float

    def line(self) -> str:
        """The plan in one line: mesh, stages (and model chunks a device when interleaved), microbatches,
        recomputation, ZeRO level, context split."""
        r, p = self.rec, self.prediction
        zero = "3" if r.fsdp > 1 else ("1" if p.zero1 else "0")
        stages = f"{r.pp} stage(s)" + (f" interleaved x{r.virtual}" if r.virtual > 1 else "")
        return (f"pp{r.pp} x dp{r.dp} x (fsdp{r.fsdp}, cp{r.cp}, tp{r.tp}); {stages}, m{r.microbatches} "
                f"x {r.microbatch} seq; remat={p.recompute}; ZeRO-{zero}; context split {r.cp}")


def _powers_of_two(limit: int):
    k = 1
    while k <= limit:
        yield k
        k *= 2


def _pipeline_degrees(layers: int) -> list[int]:
    """Pipeline degrees: powers of two, and the divisors of the layers (even stages), up to
    :data:`MAX_PIPELINE` and half the layers."""
    top = min(MAX_PIPELINE, max(layers // 2, 1))
    return sorted(set(_powers_of_two(top)) | {d for d in range(1, top + 1) if layers % d == 0})


def _fsdp_degrees(data: int, inner: int, hw) -> list[int]:
    """How many of ``data`` ranks shard the parameters: none, all, all but 2-8 replicas of them, or as many
    as keep a group of ``inner`` (context x tensor) devices each within one group of a link tier (an NVLink
    node, a TPU slice): hybrid sharding, FSDP within the group and data parallel across groups."""
    out = {1, data} | {data // r for r in (2, 4, 8) if data % r == 0}
    for tier in hw.tiers:
        if tier.span and tier.span % inner == 0 and data % (tier.span // inner) == 0:
            out.add(tier.span // inner)
    return sorted(d for d in out if d >= 1)


def _tensor_limit(hw) -> int:
    span = hw.tiers[0].span if len(hw.tiers) > 1 else None
    return min(span or 16, 16)


def candidates(rec, hw) -> list:
    """The configurations :func:`search` considers for ``rec``'s model, batch, hardware and device count
    (module docstring), as :class:`benchmarks.published.Reconstruction` s with ``recompute`` and ``zero1`` left
    to the plan (``"auto"``)."""
    cfg, n, batch = rec.cfg, rec.n, rec.batch
    out = []
    for tp in _powers_of_two(min(_tensor_limit(hw), n)):
        if cfg.heads % tp or (cfg.kv_heads % tp and tp % cfg.kv_heads) or n % tp:
            continue
        for cp in _powers_of_two(16):
            if cp > 1 and (cfg.seq < 8192 or cfg.seq // cp < MIN_CONTEXT_TOKENS or cfg.seq % cp):
                continue
            for pp in _pipeline_degrees(cfg.layers):
                if n % (tp * cp * pp):
                    continue
                data = n // (tp * cp * pp)
                if batch % data:
                    continue
                for fsdp in _fsdp_degrees(data, tp * cp, hw):
                    out.extend(_microbatchings(rec, hw, dict(tp=tp, cp=cp, pp=pp, fsdp=fsdp, dp=data // fsdp)))
    return out


def _microbatchings(rec, hw, shape: dict) -> list:
    """The candidate's microbatchings: one or two sequences per data rank with a pipeline (flat and interleaved;
    two only where that leaves at least a microbatch per stage);
    without one, every power-of-two count of microbatches (gradient accumulation) that divides the
    sequences of a data rank."""
    replicas = rec.batch // shape["dp"]
    ranks = shape["fsdp"]
    per_rank = replicas // ranks
    # the row's own recomputation is not read: "auto" starts from the matmuls' results kept (predict)
    base = dataclasses.replace(rec, cfg=dataclasses.replace(rec.cfg, remat="minimal"), virtual=1, schedule="1f1b",
                               recompute="auto", zero1="auto", **shape)
    if shape["pp"] > 1:
        out = []
        vs = {_interleaving(rec.cfg.layers, shape["pp"], least) for least in MIN_CHUNK_LAYERS} - {1}
        for seqs in PIPELINE_SEQUENCES:
            m = per_rank // seqs
            if per_rank % seqs or (seqs > 1 and m < shape["pp"]):
                continue
            flat = dataclasses.replace(base, microbatches=m, microbatch=ranks * seqs)
            out += [flat] + [dataclasses.replace(flat, virtual=v) for v in sorted(vs) if m % shape["pp"] == 0]
        return out
    return [dataclasses.replace(base, microbatches=m, microbatch=replicas // m)
            for m in _powers_of_two(per_rank) if per_rank % m == 0]


def _interleaving(layers: int, pp: int, least: int) -> int:
    """Model chunks per pipeline device for the interleaved 1F1B schedule: the most that keep at least
    ``least`` layers in every chunk and divide the layers evenly (1: none)."""
    best = 1
    for v in range(2, layers // (pp * least) + 1):
        if layers % (pp * v) == 0:
            best = v
    return best


def kept_width(cfg) -> int:
    """The values one layer keeps per token for its backward under the candidates' "minimal" recomputation (jax's
    ``checkpoint_dots_with_no_batch_dims``, :func:`benchmarks.models.llm._layers`), counted in elements: its input
    and the outputs of the weight matmuls the backward reads (q, k, v, the attention's output projection, the
    MLP's up projections). The attention's output and the MLP's activation are not outputs of dots without
    batch dimensions, and the MLP's down projection's output is not read by the backward: recomputed or not
    kept. ``tests/test_published.py`` checks it against the residuals ``jax.vjp`` keeps for the model's layers."""
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return cfg.hidden * 2 + q + 2 * kv + cfg.ffn * (2 if cfg.mlp == "swiglu" else 1)


def screen_memory(rec, hw) -> tuple[str, float]:
    """``(recompute, bytes)``: the busiest device's memory by arithmetic (weights and gradients, optimizer state,
    kept activations, logits) with the matmuls' results kept (``"minimal"``), or with each layer recomputed
    (``"full"``) when that does not fit the device."""
    c = rec.cfg
    stage_params = c.num_params() / rec.pp
    shards = rec.fsdp * rec.tp
    weights = 4 * stage_params / shards  # bf16 weights and gradients
    optimizer = 12 * stage_params / shards / (rec.dp if rec.dp > 1 else 1)
    tokens = rec.microbatch * c.seq / (rec.fsdp * rec.cp)  # one device's tokens of a microbatch
    layers = math.ceil(c.layers / rec.pp)
    held = in_flight(rec) / rec.virtual  # whole stages' worth of microbatches held at once
    width = kept_width(c)
    kept = {"minimal": 2 * tokens * width / rec.tp * layers * held,
            "full": (2 * tokens * c.hidden * layers * held + 2 * tokens * width) / rec.tp}
    logits = 4 * tokens * c.vocab / rec.tp * 2
    recompute = "minimal" if weights + optimizer + kept["minimal"] + logits <= hw.memory else "full"
    return recompute, weights + optimizer + kept[recompute] + logits


def screen(rec, hw) -> tuple[float, float]:
    """``(seconds, bytes)``: a candidate's step and its busiest device's memory by arithmetic (module
    docstring), to order candidates before they are planned. Recomputes the forward when the activations of
    the microbatches in flight do not fit otherwise."""
    from autoshard.perf import collective_seconds_on

    c = rec.cfg
    inner = rec.fsdp * rec.cp * rec.tp
    stage_params = c.num_params() / rec.pp
    tokens = rec.microbatch * c.seq / (rec.fsdp * rec.cp)  # one device's tokens of a microbatch
    kv = c.kv_heads * c.head_dim
    layers = math.ceil(c.layers / rec.pp)
    recompute, memory = screen_memory(rec, hw)

    flops = step_flops(dataclasses.replace(rec, convention="maxtext"))  # 6·N·tokens and causal attention
    if recompute == "full":
        flops *= 4 / 3
    rate = hw.accelerator.peak_flops["bf16"] * hw.accelerator.matmul_efficiency["bf16"]
    compute = flops / (rec.n * rate)
    per_micro = compute / rec.microbatches
    bubble = per_micro * (rec.pp - 1) / rec.virtual  # 1F1B: (p - 1) microbatch slots of a stage idle
    act = 2 * tokens * c.hidden
    passes = 3 if recompute == "full" else 2
    tensor = 0.0
    if rec.tp > 1:
        tensor = layers * rec.microbatches * 2 * passes * collective_seconds_on(
            hw, "all-reduce", act, group=rec.tp, span=rec.tp)
    context = 0.0
    if rec.cp > 1:
        context = layers * rec.microbatches * passes * collective_seconds_on(
            hw, "all-gather", 2 * 2 * tokens * kv / rec.tp * rec.cp, group=rec.cp, span=rec.cp * rec.tp)
    fsdp = 0.0
    if rec.fsdp > 1:
        gathered = 2 * stage_params / rec.tp
        fsdp = max(0.0, rec.microbatches * (passes + 1) * collective_seconds_on(
            hw, "all-gather", gathered, group=rec.fsdp, span=inner) - compute)
    data = 0.0
    if rec.dp > 1:
        data = collective_seconds_on(hw, "all-reduce", 2 * stage_params / (rec.fsdp * rec.tp), group=rec.dp, span=rec.n // rec.pp)
    return compute + bubble + tensor + context + fsdp + data, memory


def search(rec, *, time_limit: float = 2.0, log=None) -> Choice:
    """autoshard's configuration for ``rec`` (module docstring).

    Plans, in the screen's order, the best candidate of each kind (:func:`_diverse`), the next ones of a kind
    whose best is refused or over the memory (:data:`KIND_RETRIES`), then the neighbours of the fastest that
    fits (one of pipeline, tensor, context degree or FSDP changed; any microbatching), moving to a neighbour
    whenever it is faster, up to :data:`MAX_EVALUATE` plans; then, where the fastest has a pipeline, its variant with
    two sequences of a data rank a microbatch (:data:`PIPELINE_SEQUENCES`; one plan more).

    Raises:
      autoshard.InfeasibleError: no candidate that the screen admits is planned within the device's memory;
        the message names the closest plan.
    """
    from autoshard.errors import InfeasibleError
    from autoshard.perf import hardware_preset
    from benchmarks.published import predict

    t0 = time.perf_counter()
    hw = hardware_preset(rec.hardware)
    cands = candidates(rec, hw)
    scored = sorted(((screen(c, hw), i, c) for i, c in enumerate(cands)), key=lambda t: (t[0][0], t[1]))
    screened = {id(c): mem for (_, mem), _, c in scored}
    fitting = [c for (_, mem), _, c in scored if mem <= SCREEN_MEMORY_SHARE * hw.memory]
    if not fitting:  # the screen's count is coarse: plan the least memory first
        fitting = [c for _, _, c in sorted(scored, key=lambda t: (t[0][1], t[1]))][:MAX_EVALUATE]
    # more sequences a pipeline microbatch only refine the shape the search settles on (planned among the rest they
    # took the plans that reached the best: GPT-3 175B on 512 H100, 0.946 against 0.981)
    larger = [c for c in fitting if _sequences(c) > 1]
    fitting = [c for c in fitting if _sequences(c) == 1]
    done: dict = {}  # id(candidate) -> Prediction or None
    state = {"best": None, "over": None, "closest": None}

    def evaluate(cand) -> None:
        try:
            pred = predict(cand, time_limit=time_limit, own_layouts=True)
        except InfeasibleError as e:
            done[id(cand)] = None
            state["closest"] = state["closest"] or f"{_shape(cand)}: {str(e).splitlines()[0]}"
            return
        done[id(cand)] = pred
        if log:
            log(f"    {_shape(cand)}: {pred.step_s:.4g} s/step, {pred.peak_bytes / 1e9:.1f} GB, {pred.recompute}")
        if pred.peak_bytes > hw.memory:
            if state["over"] is None or pred.peak_bytes < state["over"][0]:
                state["over"] = (pred.peak_bytes, f"{pred.peak_bytes / 2**30:.1f} GiB at {_shape(cand)}")
        elif state["best"] is None or pred.step_s < state["best"][1].step_s:
            state["best"] = (cand, pred)

    firsts = _diverse(fitting)[:EVALUATE]
    for cand in firsts:
        evaluate(cand)
    for cand in firsts:  # a kind whose best is refused, over the memory or recomputed more than the screen
        for _ in range(KIND_RETRIES):  # assumed: its next ones, in the screen's order
            pred = done.get(id(cand))
            undercounted = pred is None or pred.peak_bytes > hw.memory or (
                pred.recompute == "full" and screen_memory(cand, hw)[0] != "full")
            if not undercounted or len(done) >= MAX_EVALUATE:
                break
            # the screen undercounted this one's memory: the next of its kind needs less by the screen
            cand = next((c for c in fitting if _kind(c) == _kind(cand) and id(c) not in done
                         and screened[id(c)] < screened[id(cand)]), None)
            if cand is None:
                break
            evaluate(cand)
    while len(done) < MAX_EVALUATE:
        if state["best"] is None:  # nothing planned fits: below the least screened memory of those that did not
            least = min((screened[i] for i, p in done.items() if p is None or p.peak_bytes > hw.memory),
                        default=math.inf)
            near = [c for c in fitting if id(c) not in done and screened[id(c)] < least]
        else:
            near = [c for c in fitting if id(c) not in done and _near(c, state["best"][0])]
        if not near:
            break
        evaluate(near[0])
    if state["best"] is not None:
        settled = state["best"][0]
        for cand in larger:
            if _same_but_microbatches(cand, settled):
                evaluate(cand)
    best = state["best"]
    if best is None:
        raise InfeasibleError(f"none of {len(done)} planned of {len(fitting)} screened configurations "
                              f"({len(cands)} candidates) fits {hw.memory / 2**30:.0f} GiB; closest: "
                              f"{state['over'][1] if state['over'] else state['closest']}")
    return Choice(best[0], best[1], len(cands), len(done), time.perf_counter() - t0)


def _sequences(c) -> int:
    """Sequences of a data rank in one microbatch of a pipeline candidate (1 without a pipeline)."""
    return c.microbatch // c.fsdp if c.pp > 1 else 1


def _same_but_microbatches(a, b) -> bool:
    """The same mesh, stages and interleaving; the microbatches may differ."""
    return (a.pp, a.dp, a.fsdp, a.cp, a.tp, a.virtual) == (b.pp, b.dp, b.fsdp, b.cp, b.tp, b.virtual)


def _near(a, b) -> bool:
    """Neighbours: one of the pipeline, tensor and context degrees or the interleaving differs, with either
    the data replicas or the FSDP degree kept (the other takes the devices freed or needed), the
    microbatches following a pipeline's; or only the split of the data ranks between replicas and FSDP,
    or only the microbatches, differ."""
    moved = sum((a.pp != b.pp, a.tp != b.tp, a.cp != b.cp, a.virtual != b.virtual))
    if moved == 0:
        return a.dp != b.dp or a.microbatches != b.microbatches
    return moved == 1 and (a.dp == b.dp or a.fsdp == b.fsdp) and (
        a.microbatches == b.microbatches or a.pp > 1 or b.pp > 1)


def _kind(c) -> tuple[bool, bool, bool, bool]:
    """With a pipeline or not, parameters sharded over the data ranks (FSDP) or replicated, the sequence split or
    not, tensor parallel or not."""
    return c.pp > 1, c.fsdp > 1, c.cp > 1, c.tp > 1


def _diverse(ranked: list) -> list:
    """``ranked`` with the best of each kind (:func:`_kind`) first, then the rest in order. The screen's arithmetic
    orders kinds coarsely, so each kind's best is planned before a second of any."""
    firsts, seen = [], set()
    for c in ranked:
        kind = _kind(c)
        if kind not in seen:
            seen.add(kind)
            firsts.append(c)
    return firsts + [c for c in ranked if all(c is not f for f in firsts)]


def _shape(rec) -> str:
    return (f"pp{rec.pp}xdp{rec.dp}x(fsdp{rec.fsdp},cp{rec.cp},tp{rec.tp}) v{rec.virtual} m{rec.microbatches} "
            f"mb{rec.microbatch}")
