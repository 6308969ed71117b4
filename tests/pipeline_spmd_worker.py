"""A tiny pure-JAX GPT train step, and one process of the two-process SPMD pipeline test.

Usage: ``python tests/pipeline_spmd_worker.py PROCESS_ID PORT OUT_DIR [LAYOUT]`` with ``XLA_FLAGS`` giving
each process 4 CPU devices. Both processes run the same pipelined step (1F1B, 4 microbatches) on identical
full inputs and write what they read back to ``OUT_DIR/proc<i>.npz``. ``LAYOUT``: ``rows`` (default: 2
stages, one per process), ``4stages`` (2 stages per process) or ``straddle`` (2 stages, each on 2 devices
of both processes).
The model is plain ``jax.numpy`` (no flax) so that a worker starts in seconds.
"""

from __future__ import annotations

import os
import sys
import time

VOCAB, SEQ, WIDTH, LAYERS, HEADS, BATCH = 32, 8, 16, 2, 2, 32


def tiny_gpt_init(seed: int = 0):
    """Parameters (embeddings, ``LAYERS`` pre-LN blocks, head) and Adam moments, as numpy arrays (no compile)."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def w(*shape):
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)

    def ln():
        return {"g": np.ones(WIDTH, np.float32), "b": np.zeros(WIDTH, np.float32)}

    params = {"wte": w(VOCAB, WIDTH), "wpe": w(SEQ, WIDTH), "head": w(WIDTH, VOCAB), "ln_f": ln(),
              "blocks": [{"ln1": ln(), "qkv": w(WIDTH, 3 * WIDTH), "proj": w(WIDTH, WIDTH), "ln2": ln(),
                          "fc": w(WIDTH, 4 * WIDTH), "out": w(4 * WIDTH, WIDTH)} for _ in range(LAYERS)]}

    def zeros(tree):
        return {k: zeros(v) if isinstance(v, dict) else [zeros(x) for x in v] if isinstance(v, list)
                else np.zeros_like(v) for k, v in tree.items()}

    return {"params": params, "opt": {"m": zeros(params), "v": zeros(params), "t": np.zeros((), np.int32)}}


def tiny_gpt_batch(seed: int = 1):
    import numpy as np

    seq = np.random.default_rng(seed).integers(0, VOCAB, (BATCH, SEQ + 1), dtype=np.int32)
    return {"tokens": seq[:, :-1], "targets": seq[:, 1:]}


def tiny_gpt_loss(params, batch):
    import jax
    import jax.numpy as jnp

    def norm(x, p):
        mu = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]

    x = params["wte"][batch["tokens"]] + params["wpe"]
    b, t, d = x.shape
    mask = jnp.tril(jnp.ones((t, t), bool))
    for blk in params["blocks"]:
        q, k, v = jnp.split(norm(x, blk["ln1"]) @ blk["qkv"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, HEADS, d // HEADS) for a in (q, k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // HEADS)
        a = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, d) @ blk["proj"]
        x = x + jax.nn.gelu(norm(x, blk["ln2"]) @ blk["fc"]) @ blk["out"]
    logits = norm(x, params["ln_f"]) @ params["head"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], -1))


def tiny_gpt_step(state, batch, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam step; returns ``(new_state, {"loss": loss})``."""
    import jax
    import jax.numpy as jnp

    loss, grads = jax.value_and_grad(tiny_gpt_loss)(state["params"], batch)
    opt = state["opt"]
    t = opt["t"] + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["v"], grads)
    c1, c2 = 1 - b1 ** t.astype(jnp.float32), 1 - b2 ** t.astype(jnp.float32)
    params = jax.tree.map(lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps), state["params"], m, v)
    return {"params": params, "opt": {"m": m, "v": v, "t": t}}, {"loss": loss}


def spmd_options(schedule: str, runtime: str = "spmd", stages: int = 2, submesh=None):
    """``stages`` stages sharing 8 devices equally (default: one mesh row of ``(1, 8 // stages)`` each), cut into
    as many layers."""
    import autoshard

    sub = (1, 8 // stages) if submesh is None else tuple(submesh)
    return autoshard.PipelineOptions(num_stages=stages, layers=stages, schedule=schedule, submeshes=[sub] * stages,
                                     solver_time_limit=0.2, runtime=runtime)


LAYOUTS = {   # layout -> (global mesh shape, stage count, stage sub-mesh, device order)
    "rows": ((2, 4), 2, (1, 4), (0, 1, 2, 3, 4, 5, 6, 7)),
    "blocks": ((4, 2), 2, (2, 2), (0, 1, 2, 3, 4, 5, 6, 7)),
    "4stages": ((2, 4), 4, (1, 2), (0, 1, 2, 3, 4, 5, 6, 7)),
    "straddle": ((2, 4), 2, (1, 4), (0, 1, 4, 5, 2, 3, 6, 7)),
}
"""``rows``: a (1, 4) stage per process; ``blocks``: a (2, 2) stage per process; ``4stages``: two (1, 2) stages per
process; ``straddle``: each (1, 4) stage on 2 devices of both processes."""


def main(process_id: int, port: int, out_dir: str, layout: str = "rows", schedule: str = "1f1b", batch: str = "full"):
    """``batch``: ``"full"`` (every process passes the whole batch) or ``"local"`` (its own half, named by
    ``batch_argnums``)."""
    t0 = time.perf_counter()
    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id)
    from jax.experimental import multihost_utils

    import autoshard
    from autoshard.hlo import collective_stats
    from autoshard.pipeline.spmd import SpmdPipelineExecutable

    state, full_batch = tiny_gpt_init(), tiny_gpt_batch()
    rows = BATCH // 2
    local = {k: v[process_id * rows:(process_id + 1) * rows] for k, v in full_batch.items()}
    batch, argnums = (local, (1,)) if batch == "local" else (full_batch, None)
    shape, stages, sub, order = LAYOUTS[layout]
    devices = [jax.devices()[i] for i in order]   # process 0's 4 devices, then process 1's
    mesh = autoshard.make_mesh(shape, ("data", "model"), devices=devices)
    step = autoshard.parallelize(tiny_gpt_step, mesh=mesh, num_microbatches=4, batch_argnums=argnums,
                                 pipeline=spmd_options(schedule, runtime="auto", stages=stages, submesh=sub))
    t1 = time.perf_counter()
    step.plan(state, batch)
    t2 = time.perf_counter()
    new_state, metrics = step(state, batch)
    new_state, metrics2 = step(new_state, batch)   # the outputs go straight back in, in their layouts
    print(f"worker {process_id}: start {t1 - t0:.1f} s, plan {t2 - t1:.1f} s, compile+run "
          f"{time.perf_counter() - t2:.1f} s", flush=True)
    entry = step.prepared(state, batch)
    exe = entry.executable
    assert isinstance(exe, SpmdPipelineExecutable), type(exe)
    stage_procs = [sorted({d.process_index for d in np.asarray(row).flat}) for row in exe.mesh.devices]
    flat = jax.tree.leaves((state, batch))
    if entry.process_local is not None:   # this process's rows -> the global batch the program takes
        flat = entry.process_local.make_global(flat, exe.in_shardings)
    stats = collective_stats(exe.compiled(flat)[0])
    R = exe.mesh.devices[0].size   # replica groups name logical ids: positions in the mesh, stage-major
    stage_ids = [set(range(s * R, (s + 1) * R)) for s in range(exe.S)]
    in_loop = [c for c in stats.collectives if c.kind != "collective-permute" and c.multiplicity == exe.num_ticks]
    within = all(c.groups and all(any(set(g) <= st for st in stage_ids) for g in c.groups) for c in in_loop)
    leaves = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(new_state["params"])]
    bad = autoshard.parallelize(tiny_gpt_step, mesh=mesh, num_microbatches=4,
                                pipeline=spmd_options(schedule, runtime="device_put", stages=stages, submesh=sub))
    try:
        bad.plan(state, full_batch)
        refused = ""
    except autoshard.InputError as e:
        refused = str(e)
    losses = [float(np.asarray(m["loss"].addressable_data(0))) for m in (metrics, metrics2)]
    np.savez(os.path.join(out_dir, f"proc{process_id}.npz"), losses=np.asarray(losses), refused=refused,
             stage_procs=np.asarray(stage_procs), permutes=stats.count("collective-permute"),
             intra=len(in_loop), within=within, sub=np.asarray(exe.mesh.devices.shape[1:]),
             stage_plans="\n".join(st.plan.to_json() for st in entry.plan.stages), runtime=entry.plan.stats["runtime"],
             **{f"p{i}": x for i, x in enumerate(leaves)})
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
