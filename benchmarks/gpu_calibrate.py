"""GPU calibration of the performance model: time kernels on the one GPU, put them against the model.

    python -m benchmarks.gpu --calibrate [--out benchmarks/results/gpu_calibration.json]
    python -m benchmarks.gpu --calibrate --smoke      # tiny shapes, any backend: checks the script itself

It times, on the one device, with jax:

1. **Matmuls**: square bf16 (and fp8 where the GPU has it) from 1k to 8k, and the local shapes of
   tensor-parallel transformer layers of 1B to 70B models (tokens x hidden/tp x ffn/tp, both orientations,
   tp = 1, 2, 4, 8).
2. **Memory-bound kernels**: a fused elementwise ``a * b + c`` and a row reduction over 2^28 floats.
3. **Attention**: ``jax.nn.dot_product_attention`` (cuDNN on GPU), forward and forward+backward, sequence
   2k and 8k, head dim 128.
4. **An optimizer update**: AdamW over 2^28 fp32 parameters (four streams in, three out).
5. **One transformer layer** of :mod:`benchmarks.models.llm` (forward and backward, bf16, hidden 4096) and
   the one-GPU GPT step of ``benchmarks.gpu``, each planned by autoshard on the device's preset: the model's
   predicted step against the measured one (target: within 10%).

Each kernel's time is the best of ``--repeats`` runs after a warm-up (a GPU kernel's variance is mostly
upward: interference, clocks ramping). The model's prediction for the same work
(:func:`autoshard.perf.seconds`) is printed beside it, and the JSON gets, per preset field, the efficiency the
measurements imply: the median over the large matmuls of measured/peak, the stream bandwidth over the data
sheet's, the attention kernel's fraction of peak. Those feed the model **only** through a committed file:
copy the ``"table"`` of the JSON to ``autoshard/perf/calibration/<preset>.json``; the preset then says it is
calibrated (``Accelerator.source``). The whole script runs in under 8 minutes on one H100 or H200.
"""

from __future__ import annotations

import json
import math
import statistics
import time

# The local matmul shapes of tensor-parallel transformer layers: (tokens, hidden, ffn) of 1B-70B models.
_LAYERS = ((8192, 2048, 8192), (8192, 4096, 14336), (8192, 8192, 28672))
_TP = (1, 2, 4, 8)


def _best(fn, args, repeats: int) -> float:
    """The best of ``repeats`` timed runs after a warm-up (:func:`autoshard.cluster._best_time`)."""
    from autoshard.cluster import _best_time

    return _best_time(fn, args, repeats)


def _matmul_shapes(smoke: bool) -> list[tuple[int, int, int]]:
    if smoke:
        return [(256, 256, 256), (512, 256, 128)]
    shapes = [(n, n, n) for n in (1024, 2048, 4096, 8192)]
    for tokens, hidden, ffn in _LAYERS:
        for tp in _TP:
            shapes += [(tokens, ffn // tp, hidden), (tokens, hidden, ffn // tp), (hidden, ffn // tp, tokens)]
    return shapes


def matmuls(acc, *, smoke: bool, repeats: int, fp8: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from autoshard.perf.compute import Work, seconds

    out = []
    dtypes = [("bf16", jnp.bfloat16)] + ([("fp8", jnp.float8_e4m3fn)] if fp8 else [])
    for name, dt in dtypes:
        for m, n, k in _matmul_shapes(smoke):
            a = jnp.ones((m, k), dt)
            b = jnp.ones((k, n), dt)
            f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.bfloat16))
            t = _best(f, (a, b), repeats)
            flops = 2.0 * m * n * k
            work = Work(flops, (m * k + k * n) * a.dtype.itemsize + m * n * 2, "matmul", name, (1, m, n, k))
            out.append({"kind": "matmul", "dtype": name, "shape": [m, n, k], "measured_s": t,
                        "predicted_s": seconds(work, acc), "tflops": flops / t / 1e12})
    return out


def memory_bound(acc, *, smoke: bool, repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from autoshard.perf.compute import Work, seconds

    n = 2**16 if smoke else 2**28
    x, y, z = (jnp.ones((n,), jnp.float32) * i for i in (1, 2, 3))
    out = []
    for name, fn, args, nbytes in (
        ("fma", jax.jit(lambda a, b, c: a * b + c), (x, y, z), 4 * 4 * n),
        ("row_sum", jax.jit(lambda a: a.reshape(-1, 1024).sum(-1)), (x,), 4 * n),
    ):
        t = _best(fn, args, repeats)
        out.append({"kind": "vector", "name": name, "bytes": nbytes, "measured_s": t,
                    "predicted_s": seconds(Work(0.0, nbytes, "vector"), acc), "gbps": nbytes / t / 1e9})
    # AdamW: p, g, m, v in; p, m, v out
    p = [jnp.ones((n,), jnp.float32) for _ in range(4)]

    def adam(p, g, m, v):
        m = 0.9 * m + 0.1 * g
        v = 0.95 * v + 0.05 * g * g
        return p - 1e-4 * m / (jnp.sqrt(v) + 1e-8), m, v

    t = _best(jax.jit(adam), p, repeats)
    nbytes = 7 * 4 * n
    out.append({"kind": "vector", "name": "adamw", "bytes": nbytes, "measured_s": t,
                "predicted_s": seconds(Work(0.0, nbytes, "vector"), acc), "gbps": nbytes / t / 1e9})
    return out


def attention(acc, *, smoke: bool, repeats: int, on_gpu: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from autoshard.perf.compute import Work, seconds

    out = []
    impl = "cudnn" if on_gpu else None
    for seq in ((128,) if smoke else (2048, 8192)):
        b, h, d = (1, 2, 64) if smoke else (4, 16, 128)
        q = jnp.ones((b, seq, h, d), jnp.bfloat16)

        def fwd(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

        def fb(q, k, v):
            return jax.grad(lambda *a: fwd(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

        flops = 4.0 * b * h * seq * seq * d / 2  # causal
        for name, fn, f, kind in (("fwd", fwd, flops, "attention_fwd"), ("fwd+bwd", fb, 3.5 * flops, None)):
            t = _best(jax.jit(fn), (q, q, q), repeats)
            if kind is None:
                pred = seconds(Work(flops, 0.0, "attention_fwd"), acc) + seconds(
                    Work(2.5 * flops, 0.0, "attention_bwd"), acc)
            else:
                pred = seconds(Work(f, 0.0, kind), acc)
            out.append({"kind": "attention", "name": name, "seq": seq, "measured_s": t, "predicted_s": pred,
                        "tflops": f / t / 1e12})
    return out


def layer_and_step(cluster, *, smoke: bool, repeats: int) -> list[dict]:
    """One llm layer's forward and backward and the GPT step of benchmarks.gpu: planned and measured."""
    import jax
    import jax.numpy as jnp

    import autoshard
    from benchmarks.models import get_model
    from benchmarks.models.llm import LMConfig, Stage, stage_inputs, stage_params, stage_programs

    out = []
    cfg = LMConfig(vocab=1024 if smoke else 32000, seq=128 if smoke else 4096, hidden=256 if smoke else 4096,
                   layers=1, heads=4 if smoke else 32, kv_heads=4 if smoke else 8, head_dim=64 if smoke else 128,
                   ffn=512 if smoke else 14336, mlp="swiglu", norm="rmsnorm", positions="rope", tied=False)
    stage = Stage(1, False, False)
    params = stage_params(cfg, stage, jnp.bfloat16)
    inputs = stage_inputs(cfg, stage, 1 if smoke else 2)
    _, fb, _ = stage_programs(cfg, stage)
    concrete = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (params, inputs))
    step = autoshard.parallelize(fb, cluster=cluster, progress=None)
    plan = step.plan(params, inputs)
    t = _best(step, concrete, repeats)
    out.append({"kind": "layer", "name": "llama-style layer fwd+bwd", "measured_s": t,
                "predicted_s": plan.cost.total_seconds})
    spec = get_model("gpt", "tiny" if smoke else "1.3B", 8, dtype=jnp.bfloat16,
                     attention_impl="xla" if smoke else "cudnn")
    gstep = autoshard.parallelize(spec.train_step, cluster=cluster, donate_argnums=(0,), progress=None)
    gplan = gstep.plan(spec.abstract_state(), spec.abstract_batch())
    state, batch = spec.init_state(jax.random.key(0)), spec.make_batch(jax.random.key(1))
    for _ in range(2):
        state, metrics = gstep(state, batch)
    jax.block_until_ready(metrics)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, metrics = gstep(state, batch)
        jax.block_until_ready((state, metrics))
        best = min(best, time.perf_counter() - t0)
    out.append({"kind": "step", "name": "GPT train step (benchmarks.gpu)", "measured_s": best,
                "predicted_s": gplan.cost.total_seconds})
    return out


def implied_table(acc, rows: list[dict]) -> dict:
    """The efficiencies the measurements imply (what ``autoshard/perf/calibration/<preset>.json`` takes)."""
    table = {}
    for cls in ("bf16", "fp8"):
        big = [r["tflops"] * 1e12 / acc.peak_flops[cls] for r in rows
               if r["kind"] == "matmul" and r["dtype"] == cls and min(r["shape"]) >= 2048]
        if big:
            table.setdefault("matmul_efficiency", {})[cls] = statistics.median(big)
    bw = [r["gbps"] * 1e9 / acc.hbm_bandwidth for r in rows if r["kind"] == "vector"]
    if bw:
        table["hbm_efficiency"] = min(1.0, statistics.median(bw))
    fwd = [r["tflops"] * 1e12 / acc.peak_flops["bf16"] for r in rows if r["kind"] == "attention" and r["name"] == "fwd"]
    fb = [r["tflops"] * 1e12 / acc.peak_flops["bf16"] for r in rows
          if r["kind"] == "attention" and r["name"] == "fwd+bwd"]
    if fwd and fb:
        table["attention_efficiency"] = [statistics.median(fwd), statistics.median(fb)]
    return table


def calibrate(args) -> int:
    import jax

    import autoshard
    from autoshard.cluster import preset_for_devices

    device = jax.devices()[0]
    cluster = preset_for_devices([device])
    if cluster.hardware is None:  # CPU (--smoke): the H100's model, so that the script's paths run
        cluster = autoshard.cluster_preset("h100")
    acc = cluster.hardware.accelerator
    on_gpu = device.platform == "gpu"
    fp8 = on_gpu and "fp8" in acc.peak_flops
    t0 = time.perf_counter()
    rows = []
    for part, fn in (("matmul", lambda: matmuls(acc, smoke=args.smoke, repeats=args.repeats, fp8=fp8)),
                     ("memory", lambda: memory_bound(acc, smoke=args.smoke, repeats=args.repeats)),
                     ("attention", lambda: attention(acc, smoke=args.smoke, repeats=args.repeats, on_gpu=on_gpu)),
                     ("layer", lambda: layer_and_step(cluster, smoke=args.smoke, repeats=args.repeats))):
        try:
            got = fn()
        except Exception as e:  # a part that fails is recorded, the others still run
            got = [{"kind": part, "error": f"{type(e).__name__}: {e}"}]
        rows += got
        for r in got:
            if "error" in r:
                print(f"[{part}] error: {r['error']}", flush=True)
                continue
            label = r.get("name") or "x".join(map(str, r.get("shape", ())))
            print(f"[{part}] {label:<32} measured {r['measured_s'] * 1e3:9.3f} ms  predicted "
                  f"{r['predicted_s'] * 1e3:9.3f} ms  predicted/measured {r['predicted_s'] / r['measured_s']:.3f}",
                  flush=True)
    result = {"device": str(device.device_kind), "preset": cluster.hardware.name, "jax": jax.__version__,
              "seconds": time.perf_counter() - t0, "rows": rows, "table": implied_table(acc, rows)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"implied table for {cluster.hardware.name}: {json.dumps(result['table'])}")
    print(f"wrote {args.out} in {result['seconds']:.0f} s. To use it: copy its 'table' to "
          f"autoshard/perf/calibration/{cluster.hardware.name}.json and commit it.")
    return 0
