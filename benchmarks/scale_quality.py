"""Quality at 16, 32 and 64 devices: autoshard's plan against the best hand-written 3-D configurations (issue 16).

    python -m benchmarks.scale_quality [--rows 2.6B-16] [--methods autoshard,fsdp_tp,megatron3d]
        [--out benchmarks/results/scale_quality.json] [--timeout 600]

Nothing runs: every program is compiled from ``ShapeDtypeStruct``s on simulated CPU devices, one process
per job (``XLA_FLAGS`` sets the device count before jax starts), and scored with the formula every
method of ``benchmarks/README.md`` gets, ``autoshard.hlo_schedule.estimate_step_time(compiled, cluster,
mesh)["time_s"]`` (compute from the compiled flops, alpha-beta time of every compiled collective). A
plan whose compiled per-device peak (``autoshard.hlo.memory_stats``) exceeds the preset's 80 GiB is a
failure (OOM). Presets: ``h100-nvlink`` (one NVLink domain), ``h100-2node-ib`` and ``h100-4node-ib`` (mesh
axis 0 spans 2 or 4 nodes at 50 GB/s, axis 1 stays in a node; only meshes ``(a, b)`` with ``a`` a multiple
of the node count are allowed).

Methods, each the best of its sweep:

- ``autoshard``: ``autoshard.parallelize(train_step, mesh=(a, b) of ("data", "model"), cluster=preset,
  memory_budget=preset.memory, donate_argnums=(0,))`` planned on every factorization the preset allows;
  the plan autoshard itself predicts fastest (``plan.cost.objective``) is compiled and scored, as in
  ``benchmarks/suite/measure.py``.
- ``fsdp_tp``: ``benchmarks.baselines.fsdp_tp`` (Megatron tensor parallelism on ``model``, parameters
  and optimizer state also split over ``data``, ZeRO-3 style) on every ``(dp, tp)`` factorization; the
  best measured one that fits.
- ``megatron3d``: Megatron-LM pipeline x data x tensor parallelism, pp in {2, 4, 8}, tp in {1, 2, 4, 8},
  dp = N / (pp tp), k microbatches in {pp, 2 pp, 4 pp} with the global batch B divisible by k dp; the
  best that fits. One pipeline program does not exist as one XLA program, so it is scored from
  compiled pieces:

  * a stage is a *proxy GPT*: the same width with ``num_layers / pp`` blocks **plus the embedding,
    positional embedding, final LayerNorm and tied head**. The real first stage has the embedding and
    the real last stage the head (the heaviest: 2 d V flops per token); the proxy has both, so it is
    the slowest real stage plus an embedding lookup (a gather, cheap) - every stage is priced as the
    slowest one, slightly pessimistic for Megatron, as the 1F1B schedule's time is set by its
    slowest stage. Its memory is the first/last stage's (both hold the vocabulary embedding).
  * ``t_mb``: one microbatch's forward and backward of the proxy (loss and grad, no optimizer), B/k
    sequences on a ``(dp, tp)`` mesh with Megatron's rules (``baselines.megatron``). The gradient is
    computed per data-parallel replica (``vmap`` over a leading ``[dp]`` axis split over ``data``) so
    this program holds no gradient all-reduce: Megatron accumulates the microbatches' gradients
    locally and all-reduces once per step.
  * ``t_update``: the stage's optimizer step, once: the ``[dp]`` gradients summed (the one data-
    parallel all-reduce) and AdamW applied to the stage's parameters and optimizer state.
  * ``p2p``: one activation (forward) or activation-gradient (backward) transfer between adjacent
    stages, ``alpha + (B/k) * seq * d_model * 4 B / (dp * tp) / bw`` per device: each data-parallel
    replica sends its own B/(k dp) sequences and, with Megatron's scatter-gather optimisation, each of
    the tp ranks 1/tp of them, all pairs at once.
  * ``t_tied``: the tied embedding's gradient all-reduced between the first and the last stage once
    per step, ``alpha + V * d_model * 4 B / tp / bw`` (an all-reduce of 2 ranks).

  Step time = (k + pp - 1) * t_mb + t_update + (k + pp - 1) * 2 * p2p + t_tied.

  Under ``h100-nvlink`` bw = 450 GB/s (alpha 5 us). Under the multi-node presets the pp stages are
  split evenly over the nodes: with pp >= nodes every stage's (dp, tp) devices sit inside one node and
  ``t_mb`` and ``t_update`` are scored with the one-node ``h100-nvlink`` preset; with pp < nodes (pp 2 on
  4 nodes) a stage spans nodes / pp nodes along its dp axis (dp must be a multiple of that) and is scored
  with the multi-node preset. ``p2p`` and ``t_tied`` use the 50 GB/s inter-node link (alpha 10 us) - the
  boundary between the nodes is the slowest, and the formula prices every slot at it. Peak memory per device (first stage, 1F1B holds min(k, pp)
  microbatches): ``peak(t_mb program) + optimizer state + a gradient accumulator + (min(k, pp) - 1)
  * temp(t_mb program)``, or the update program's peak if larger; ``temp`` holds one microbatch's
  saved activations and the backward's scratch, so the stash is overestimated.

- ``autoshard_pipeline`` (``--methods ...,autoshard_pipeline``): autoshard's own pipeline,
  ``PipelineOptions(num_stages="auto", runtime="device_put")`` with k in {4, 8, 16} microbatches on the whole
  ``(2, N/2)`` mesh (``(4, N/4)`` under ``h100-4node-ib``), and with ``num_stages=2`` forced (Megatron's best pp). Every task is compiled (``step.prepared(...).executable.compiled_tasks()``) and
  scored on its stage's sub-mesh (with the one-node preset when the stage's devices share a node);
  t_mb = max over stages of (its F + B tasks), t_update = max over stages of its R (update) tasks,
  p2p as above with the smallest stage's device count, and the same step time
  (k + S - 1) * t_mb + t_update + (k + S - 1) * 2 * p2p (no tied-embedding term: whatever autoshard's
  stages exchange besides the boundary activations is not priced). Peak: the largest compiled task
  peak of a stage + (in_flight - 1) x the planner's per-microbatch activation bytes.

Output: a table and ``--out`` (every job's candidates; jobs from an earlier run that this one did not
repeat are kept, so pieces can be measured one at a time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time

GiB = 2**30
PRESETS = {"h100-nvlink": 1, "h100-2node-ib": 2, "h100-4node-ib": 4}  # preset -> nodes (mesh axis 0 spans them)
ONE_NODE = "h100-nvlink"  # the preset a pipeline stage inside one node is scored with
METHODS = ("autoshard", "fsdp_tp", "megatron3d", "autoshard_pipeline")
DEFAULT_METHODS = METHODS[:3]
PIPELINE_MICROBATCHES = (4, 8, 16)  # Megatron sweeps k up to 4 pp = 16
PIPELINE_STAGES = ("auto", 2)  # "auto": the stage search picks; 2: forced, to compare with Megatron's pp = 2


@dataclasses.dataclass(frozen=True)
class Row:
    """A GPT config at global batch ``batch`` on ``devices`` simulated devices."""

    name: str
    config: str
    batch: int
    devices: int


ROWS = (
    Row("2.6B-16", "2.6B", 32, 16),
    Row("6.7B-32", "6.7B", 64, 32),
    # 64 devices: the single-program methods compile the whole 64-device step (minutes each); the pipelines
    # compile per stage
    Row("15B-64", "15B", 128, 64),
    # the GPT-39B shape and batch (benchmarks/scale.py plans it on an AbstractMesh); here compiled
    Row("39B-64", "39B", 64, 64),
    Row("tiny-16", "tiny", 32, 16),  # smoke test of the machinery, not in the default rows
)
DEFAULT_ROWS = ("2.6B-16",)


def factorizations(n: int, nodes: int = 1) -> list[tuple[int, int]]:
    """``(a, b)`` with ``a * b == n`` and ``a`` a multiple of ``nodes``, ``b`` ascending."""
    return [(n // b, b) for b in range(1, n + 1) if n % b == 0 and (n // b) % nodes == 0]


def megatron3d_shapes(row: Row, config) -> list[tuple[int, int, int]]:
    """``(pp, dp, tp)`` of the sweep: pp in {2, 4, 8}, tp in {1, 2, 4, 8}, the layers split evenly."""
    out = []
    for pp in (2, 4, 8):
        for tp in (1, 2, 4, 8):
            if row.devices % (pp * tp) == 0 and config.num_layers % pp == 0 and config.hidden % tp == 0:
                out.append((pp, row.devices // (pp * tp), tp))
    return out


def jobs_for(row: Row, methods) -> list[str]:
    from benchmarks.models.gpt import CONFIGS

    jobs = []
    if "autoshard" in methods:
        jobs += [f"{row.name}:autoshard:{p}" for p in PRESETS]
    if "fsdp_tp" in methods:
        jobs += [f"{row.name}:fsdp_tp:{a}x{b}" for a, b in factorizations(row.devices)]
    if "megatron3d" in methods:
        jobs += [f"{row.name}:megatron3d:{pp}x{dp}x{tp}" for pp, dp, tp in megatron3d_shapes(row, CONFIGS[row.config])]
    if "autoshard_pipeline" in methods:
        jobs += [f"{row.name}:autoshard_pipeline:{p}@{k}" + ("" if n == "auto" else f"@{n}")
                 for p in PRESETS for k in PIPELINE_MICROBATCHES for n in PIPELINE_STAGES]
    return jobs


# ---- measuring, inside a job's process ---------------------------------------------------------------


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _mesh(shape):
    import jax

    import autoshard

    return autoshard.make_mesh(shape, ("data", "model"), devices=jax.devices()[: shape[0] * shape[1]])


def _scored(compiled, shape, presets) -> dict:
    """Peak memory and the step-time formula under each preset of ``presets``."""
    import autoshard
    from autoshard.hlo import memory_stats
    from autoshard.hlo_schedule import estimate_step_time

    mem = memory_stats(compiled)
    scores = {}
    for p in presets:
        est = estimate_step_time(compiled, autoshard.cluster_preset(p), shape)
        scores[p] = {k: est[k] for k in ("time_s", "compute_s", "communication_s")}
    return {"peak_bytes": mem["peak"], "temp_bytes": mem["temp"], "scores": scores}


def autoshard_job(row: Row, preset: str) -> dict:
    """Plan on every mesh the preset allows; compile and score the one autoshard predicts fastest."""
    import gc

    import autoshard
    from benchmarks.models import get_model

    spec = get_model("gpt", row.config, row.batch)
    state, batch = spec.abstract_state(), spec.abstract_batch()
    cluster = autoshard.cluster_preset(preset)
    planned, best = [], None
    for shape in factorizations(row.devices, PRESETS[preset]):
        step = autoshard.parallelize(spec.train_step, mesh=_mesh(shape), cluster=cluster, donate_argnums=(0,),
                                     memory_budget=cluster.memory, progress=None)
        t0 = time.perf_counter()
        try:
            plan = step.plan(state, batch)
        except Exception as e:  # noqa: BLE001 - e.g. an infeasible mesh is a result
            planned.append({"mesh": list(shape), "error": _error(e), "planning_s": time.perf_counter() - t0})
            continue
        planned.append({"mesh": list(shape), "objective_s": plan.cost.objective, "planning_s": time.perf_counter() - t0,
                        "predicted_peak_bytes": plan.cost.peak_memory_bytes, "optimal": plan.stats.get("optimal")})
        if best is None or plan.cost.objective < best[2].cost.objective:
            best = (shape, step, plan)
        gc.collect()
    out = {"planned": planned}
    if best is None:
        return {**out, "error": "no mesh could be planned"}
    shape, step, plan = best
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    check = plan.verify(compiled)
    scored = _scored(compiled, shape, [preset])
    return {**out, "mesh": list(shape), "compile_s": time.perf_counter() - t0, "peak_bytes": scored["peak_bytes"],
            "step_time_s": scored["scores"][preset]["time_s"], "score": scored["scores"][preset],
            "predicted_objective_s": plan.cost.objective, "comm_ratio": check.ratio}


def fsdp_tp_step(spec, gathered, sharded):
    """The train step with FSDP made explicit: each parameter is all-gathered over ``data`` to its
    Megatron layout (``gathered``) before the forward, and its gradient constrained back to the FSDP+TP
    layout (``sharded``: a reduce-scatter) before AdamW updates the shards, as ZeRO-3 does."""
    import jax
    import optax

    wsc = jax.lax.with_sharding_constraint

    def step(state, batch):
        def loss(p):
            return spec.loss_fn({"params": p, "model_state": state["model_state"]}, batch)[0]

        value, grads = jax.value_and_grad(loss)(wsc(state["params"], gathered))
        grads = wsc(grads, sharded)
        updates, opt_state = spec.optimizer.update(grads, state["opt_state"], state["params"])
        new = {**state, "params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
               "step": state["step"] + 1}
        return new, {"loss": value}

    return step


def fsdp_tp_job(row: Row, shape: tuple[int, int]) -> dict:
    """Compile FSDP+TP on one ``(dp, tp)`` mesh two ways, score both under every preset allowing the mesh:
    ``propagated`` (``baselines.fsdp_tp``'s shardings on the model's own step, XLA propagates the rest)
    and ``gathered`` (:func:`fsdp_tp_step`, the gathers and reduce-scatters pinned)."""
    import jax

    from benchmarks import baselines
    from benchmarks.models import get_model

    spec = get_model("gpt", row.config, row.batch)
    state, batch = spec.abstract_state(), spec.abstract_batch()
    mesh = _mesh(shape)
    presets = [p for p, nodes in PRESETS.items() if shape[0] % nodes == 0]
    out = {"mesh": list(shape), "variants": {}}
    t0 = time.perf_counter()
    compiled = baselines.compile_baseline(spec.train_step, state, batch, mesh, "fsdp_tp", donate=True)
    out["variants"]["propagated"] = {"compile_s": time.perf_counter() - t0, **_scored(compiled, shape, presets)}
    del compiled
    st_sh, b_sh = baselines.fsdp_tp(state, batch, mesh)
    gathered = baselines.megatron(state, batch, mesh)[0]["params"]
    step = jax.jit(fsdp_tp_step(spec, gathered, st_sh["params"]), in_shardings=(st_sh, b_sh),
                   out_shardings=(st_sh, None), donate_argnums=(0,))
    t0 = time.perf_counter()
    compiled = step.lower(_with(state, st_sh), _with(batch, b_sh)).compile()
    out["variants"]["gathered"] = {"compile_s": time.perf_counter() - t0, **_scored(compiled, shape, presets)}
    return out


def _with(tree, shardings):
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _per_device_bytes(tree, shardings) -> float:
    import jax
    import numpy as np

    sizes = jax.tree.map(lambda x, s: math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize, tree, shardings)
    return float(sum(jax.tree.leaves(sizes)))


def _stage_programs(spec, mesh, dp: int):
    """``(forward_backward, update)`` jitted for one stage under Megatron's rules on ``mesh``."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks import baselines

    state = spec.abstract_state()
    st_sh, _ = baselines.megatron(state, spec.abstract_batch(), mesh)
    stacked_sh = jax.tree.map(lambda s: NamedSharding(mesh, P("data", *s.spec)), st_sh["params"])

    def forward_backward(params, batch):
        def one(b):
            return jax.grad(lambda p: spec.loss_fn({"params": p, "model_state": {}}, b)[0])(params)

        return jax.vmap(one)(batch)  # per data-parallel replica: no all-reduce here

    def update(state, stacked):
        grads = jax.tree.map(lambda g: g.sum(0) / dp, stacked)  # the one data-parallel all-reduce
        updates, opt_state = spec.optimizer.update(grads, state["opt_state"], state["params"])
        return {**state, "params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
                "step": state["step"] + 1}

    fb = jax.jit(forward_backward, in_shardings=(st_sh["params"], NamedSharding(mesh, P("data"))),
                 out_shardings=stacked_sh)
    up = jax.jit(update, in_shardings=(st_sh, stacked_sh), out_shardings=st_sh, donate_argnums=(0,))
    return fb, up, state, st_sh, stacked_sh


def _link(preset: str) -> tuple[float, float]:
    """(bandwidth, latency) of the slowest link between pipeline stages under ``preset``."""
    import autoshard

    c = autoshard.cluster_preset(preset)
    bw = c.bandwidth if isinstance(c.bandwidth, tuple) else (c.bandwidth,)
    lat = c.latency if isinstance(c.latency, tuple) else (c.latency,) * len(bw)
    i = min(range(len(bw)), key=lambda j: bw[j])
    return bw[i], lat[i]


def _replica_batch(batch, mesh, dp: int):
    """``[mb, ...]`` leaves as ``[dp, mb / dp, ...]``, the leading axis split over ``data``."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sh = NamedSharding(mesh, P("data"))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((dp, x.shape[0] // dp, *x.shape[1:]), x.dtype, sharding=sh),
                        batch)


def megatron3d_job(row: Row, pp: int, dp: int, tp: int) -> dict:
    """Compile one (pp, dp, tp) stage's update once and its microbatch program for every k; score each k."""
    import jax

    from benchmarks.models import gpt

    full = gpt.CONFIGS[row.config]
    config = dataclasses.replace(full, num_layers=full.num_layers // pp)
    mesh = _mesh((dp, tp))
    ks = [k for k in (pp, 2 * pp, 4 * pp) if row.batch % (k * dp) == 0]
    out = {"pp": pp, "dp": dp, "tp": tp, "stage_layers": config.num_layers, "candidates": []}
    if not ks:
        return {**out, "error": f"no k in {{pp, 2pp, 4pp}} with B={row.batch} divisible by k*dp"}
    t0 = time.perf_counter()
    spec = gpt.build(config, row.batch // ks[0])
    fb, up, state, st_sh, stacked_sh = _stage_programs(spec, mesh, dp)
    stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((dp, *x.shape), x.dtype), state["params"])
    scored_with = sorted({_megatron_stage_preset(p, pp) for p in PRESETS})
    update = _scored(up.lower(_with(state, st_sh), _with(stacked, stacked_sh)).compile(), (dp, tp), scored_with)
    opt_bytes = _per_device_bytes(state["opt_state"], st_sh["opt_state"])
    grad_bytes = _per_device_bytes(state["params"], st_sh["params"])
    out.update(update=update, update_compile_s=time.perf_counter() - t0, opt_state_bytes=opt_bytes,
               grad_bytes=grad_bytes)
    for k in ks:
        mb = row.batch // k
        t0 = time.perf_counter()
        spec = gpt.build(config, mb)
        fb, *_ = _stage_programs(spec, mesh, dp)
        batch = _replica_batch(spec.abstract_batch(), mesh, dp)
        stage = _scored(fb.lower(_with(state["params"], st_sh["params"]), batch).compile(), (dp, tp), scored_with)
        inflight = min(k, pp)
        peak = max(stage["peak_bytes"] + opt_bytes + grad_bytes + (inflight - 1) * stage["temp_bytes"],
                   update["peak_bytes"])
        cand = {"pp": pp, "dp": dp, "tp": tp, "k": k, "microbatch": mb, "compile_s": time.perf_counter() - t0,
                "stage": stage, "peak_bytes": peak, "step_time_s": {}, "terms": {}}
        for preset in PRESETS:
            within = _megatron_stage_preset(preset, pp)
            if within != ONE_NODE and dp % (PRESETS[preset] // pp):
                continue  # the stage's nodes cannot split its dp axis evenly
            bw, lat = _link(preset)
            t_mb, t_up = stage["scores"][within]["time_s"], update["scores"][within]["time_s"]
            p2p = lat + mb * config.seq_len * config.hidden * 4 / (dp * tp) / bw
            tied = lat + config.vocab_size * config.hidden * 4 / tp / bw
            slots = k + pp - 1
            cand["terms"][preset] = {"t_mb": t_mb, "t_update": t_up, "p2p": p2p, "t_tied": tied, "slots": slots}
            cand["step_time_s"][preset] = slots * t_mb + t_up + slots * 2 * p2p + tied
        out["candidates"].append(cand)
    return out


def _megatron_stage_preset(preset: str, pp: int) -> str:
    """The preset a Megatron stage is scored with under ``preset``: one node's when each stage fits in a node
    (pp >= nodes), else ``preset`` itself (its dp axis spans the stage's nodes)."""
    return ONE_NODE if PRESETS[preset] <= pp else preset


def _stage_cluster(devices, n: int, preset: str) -> str:
    """The preset a stage on ``devices`` is scored with: one node's if its devices share a node."""
    nodes = PRESETS[preset]
    return ONE_NODE if len({d // (n // nodes) for d in devices}) == 1 else preset


def autoshard_pipeline_job(row: Row, preset: str, k: int, num_stages="auto") -> dict:
    """``PipelineOptions(num_stages="auto")`` on the whole ``(max(2, nodes), N / that)`` mesh with k microbatches: compile
    every task (``compiled_tasks``) and score it on its stage's sub-mesh; step time by the pipeline formula."""
    import autoshard
    from autoshard.hlo import memory_stats
    from autoshard.hlo_schedule import estimate_step_time
    from benchmarks.models import get_model

    spec = get_model("gpt", row.config, row.batch)
    state, batch = spec.abstract_state(), spec.abstract_batch()
    cluster = autoshard.cluster_preset(preset)
    rows = max(2, PRESETS[preset])
    step = autoshard.parallelize(spec.train_step, mesh=_mesh((rows, row.devices // rows)), cluster=cluster,
                                 memory_budget=cluster.memory, donate_argnums=(0,), num_microbatches=k,
                                 progress=None, pipeline=autoshard.PipelineOptions(num_stages=num_stages,
                                                                                   runtime="device_put"))
    t0 = time.perf_counter()
    entry = step.prepared(state, batch)
    pplan, plan_s = entry.plan, time.perf_counter() - t0
    t0 = time.perf_counter()
    tasks = entry.executable.compiled_tasks()
    stages = [{"mesh": list(st.mesh_shape), "layers": list(st.layers), "devices": len(st.devices),
               "predicted_time_s": st.time_s, "predicted_memory_bytes": st.memory_bytes, "in_flight": st.in_flight,
               "cluster": _stage_cluster(st.devices, row.devices, preset), "tasks": {}} for st in pplan.stages]
    for key, compiled in tasks.items():
        st = stages[key[1]]
        est = estimate_step_time(compiled, autoshard.cluster_preset(st["cluster"]), tuple(st["mesh"]))
        st["tasks"]["".join(str(x) for x in key)] = {"phase": key[0], "time_s": est["time_s"],
                                                     "peak_bytes": memory_stats(compiled)["peak"]}
    for st, plan_st in zip(stages, pplan.stages, strict=True):
        by = {ph: sum(t["time_s"] for t in st["tasks"].values() if t["phase"] == ph) for ph in "FBR"}
        st.update(t_mb=by["F"] + by["B"], t_update=by["R"])
        st["peak_bytes"] = plan_st.compiled_peak({_task_key(name): t["peak_bytes"] for name, t in st["tasks"].items()})
    S, cfg = len(stages), spec_config(row)
    bw, lat = _link(preset) if S > 1 else (1.0, 0.0)
    p2p = 0.0 if S == 1 else lat + (row.batch // k) * cfg.seq_len * cfg.hidden * 4 / min(st["devices"] for st in stages) / bw
    t_mb, t_up = max(st["t_mb"] for st in stages), max(st["t_update"] for st in stages)
    step_time = (k + S - 1) * t_mb + t_up + (k + S - 1) * 2 * p2p
    return {"preset": preset, "k": k, "num_stages": S, "stages_asked": num_stages, "plan_s": plan_s, "compile_s": time.perf_counter() - t0,
            "predicted_step_s": pplan.step_time_s, "stages": stages, "step_time_s": step_time,
            "terms": {"t_mb": t_mb, "t_update": t_up, "p2p": p2p, "slots": k + S - 1},
            "peak_bytes": max(st["peak_bytes"] for st in stages)}


def _task_key(name: str) -> tuple:
    """A task's key from its name in the job's JSON (``"F0"``, ``"R00"``, ``"R0reduce"``): its phase first."""
    return (name[0], name[1:])


def spec_config(row: Row):
    from benchmarks.models.gpt import CONFIGS

    return CONFIGS[row.config]


def run_job(name: str) -> dict:
    row_name, method, arg = name.split(":")
    row = next(r for r in ROWS if r.name == row_name)
    base = {"job": name, "row": row.name, "method": method, "devices": row.devices, "batch": row.batch}
    try:
        if method == "autoshard":
            return {**base, "preset": arg, **autoshard_job(row, arg)}
        if method == "autoshard_pipeline":
            preset, k, *stages = arg.split("@")
            return {**base, **autoshard_pipeline_job(row, preset, int(k), int(stages[0]) if stages else "auto")}
        if method == "fsdp_tp":
            return {**base, **fsdp_tp_job(row, tuple(int(x) for x in arg.split("x")))}
        pp, dp, tp = (int(x) for x in arg.split("x"))
        return {**base, **megatron3d_job(row, pp, dp, tp)}
    except Exception as e:  # noqa: BLE001 - a job that fails is reported, never dropped
        return {**base, "error": _error(e)}


# ---- the driver: one process per job, then the table ---------------------------------------------------


def launch(name: str, devices: int, timeout: float) -> dict:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "benchmarks.scale_quality", "--one", name], env=env,
                              capture_output=True, text=True, timeout=timeout)
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        result = {"job": name, "error": f"timeout after {timeout:.0f} s (dropped)"}
    except (IndexError, json.JSONDecodeError):
        result = {"job": name, "error": done.stderr.strip()[-300:]}
    result["wall_s"] = time.perf_counter() - t0
    return result


def best_of(jobs: dict, row: Row, preset: str) -> dict:
    """The row's best candidate per method under ``preset`` (fitting in memory), with every candidate."""
    limit = 80 * GiB
    out = {}
    for method in METHODS:
        cands = []
        for r in jobs.values():
            if r.get("row") != row.name or r.get("method") != method:
                continue
            if method == "autoshard_pipeline" and r["job"].split(":")[-1].startswith(preset + "@"):
                forced = len(r["job"].split("@")) == 3  # ROW:autoshard_pipeline:PRESET@K@STAGES
                cands.append({"config": f"{r.get('num_stages')} stages k{r['job'].split('@')[1]}"
                                        + (" forced" if forced else ""),
                              "step_time_s": r.get("step_time_s"), "peak_bytes": r.get("peak_bytes"),
                              "error": r.get("error")})
            elif method == "autoshard" and r.get("preset") == preset:
                cands.append({"mesh": r.get("mesh"), "step_time_s": r.get("step_time_s"),
                              "peak_bytes": r.get("peak_bytes"), "error": r.get("error")})
            elif method == "fsdp_tp" and r.get("variants"):
                cands += [{"mesh": r["mesh"], "variant": name, "step_time_s": v["scores"][preset]["time_s"],
                           "peak_bytes": v["peak_bytes"]}
                          for name, v in r["variants"].items() if preset in v["scores"]]
            elif method == "fsdp_tp" and r.get("error"):
                mesh = [int(x) for x in r["job"].split(":")[-1].split("x")]
                if mesh[0] % PRESETS[preset] == 0:
                    cands.append({"mesh": mesh, "step_time_s": None, "error": r["error"]})
            elif method == "megatron3d":
                cands += [{"config": f"pp{c['pp']} dp{c['dp']} tp{c['tp']} k{c['k']}",
                           "step_time_s": c["step_time_s"][preset], "peak_bytes": c["peak_bytes"]}
                          for c in r.get("candidates", []) if preset in c["step_time_s"]]
                if r.get("error"):
                    cands.append({"config": r["job"].split(":")[-1], "step_time_s": None, "error": r["error"]})
        for c in cands:
            c["oom"] = c.get("peak_bytes") is not None and c["peak_bytes"] > limit
        fits = [c for c in cands if c.get("step_time_s") is not None and not c["oom"]]
        out[method] = {"best": min(fits, key=lambda c: c["step_time_s"], default=None), "candidates": cands}
    return out


def summarize(jobs: dict, rows) -> list[dict]:
    out = []
    for row in rows:
        for preset in PRESETS:
            methods = best_of(jobs, row, preset)
            if not any(m["candidates"] for m in methods.values()):
                continue
            t = {m: (v["best"] or {}).get("step_time_s") for m, v in methods.items()}
            baseline = min((t[m] for m in ("fsdp_tp", "megatron3d") if t[m] is not None), default=None)
            ours = min((t[m] for m in ("autoshard", "autoshard_pipeline") if t[m] is not None), default=None)
            out.append({"row": row.name, "config": row.config, "batch": row.batch, "devices": row.devices,
                        "preset": preset, "methods": methods,
                        "best_baseline_over_autoshard": baseline / t["autoshard"] if baseline and t["autoshard"] else None,
                        "best_baseline_over_best_autoshard": baseline / ours if baseline and ours else None})
    return out


def _cell(best: dict | None) -> str:
    if best is None:
        return "-"
    where = best.get("config") or "x".join(str(x) for x in best["mesh"])
    if best.get("variant"):
        where += f", {best['variant']}"
    return f"{best['step_time_s'] * 1e3:.1f} ({where})"


def table(summary: list[dict]) -> str:
    lines = ["| row | preset | autoshard ms (mesh) | FSDP+TP ms (dp x tp) | Megatron 3-D ms | "
             "autoshard pipeline ms | best baseline / autoshard | best baseline / best autoshard |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in summary:
        m = s["methods"]
        ratios = [s["best_baseline_over_autoshard"], s["best_baseline_over_best_autoshard"]]
        lines.append(f"| {s['row']} (B={s['batch']}) | {s['preset']} | {_cell(m['autoshard']['best'])} | "
                     f"{_cell(m['fsdp_tp']['best'])} | {_cell(m['megatron3d']['best'])} | "
                     f"{_cell(m['autoshard_pipeline']['best'])} | "
                     + " | ".join("-" if r is None else f"{r:.2f}x" for r in ratios) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/scale_quality.json")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated, of {[r.name for r in ROWS]}")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated, of {METHODS}")
    ap.add_argument("--jobs", default=None, help="comma-separated job names (ROW:METHOD:ARG) instead of --methods")
    ap.add_argument("--no-run", action="store_true", help="only rebuild the table and --out from --out's jobs")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per job's process")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one job in this process
    args = ap.parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_job(args.one)))
        return 0
    rows = [r for r in ROWS if r.name in args.rows.split(",")]
    names = [] if args.no_run else args.jobs.split(",") if args.jobs else [j for r in rows for j in jobs_for(r, args.methods.split(","))]
    jobs = {}
    if args.out and os.path.exists(args.out):
        with open(args.out) as f:
            jobs = {j["job"]: j for j in json.load(f).get("jobs", [])}
    for name in names:
        row = next(r for r in ROWS if r.name == name.split(":")[0])
        jobs[name] = launch(name, row.devices, args.timeout)
        r = jobs[name]
        print(f"{name}: {r.get('error') or 'ok'} ({r['wall_s']:.0f} s)", flush=True)
        if args.out:
            _write(args.out, jobs)
    summary = summarize(jobs, [r for r in ROWS if any(j.startswith(r.name + ":") for j in jobs)])
    print(table(summary))
    if args.out:
        _write(args.out, jobs)
        print(f"wrote {args.out}")
    return 0


def _write(path: str, jobs: dict) -> None:
    import jax

    from benchmarks.output import commit

    rows = [r for r in ROWS if any(j.startswith(r.name + ":") for j in jobs)]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"jax": jax.__version__, "commit": commit(), "cpus": os.cpu_count(), "summary": summarize(jobs, rows),
                   "jobs": list(jobs.values())}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
