"""The GPU check: one script, one device, under 8 minutes.

    python -m benchmarks.gpu [--config 1.3B] [--batch 8] [--steps 10] [--out benchmarks/results/gpu.json]
    python -m benchmarks.gpu --smoke        # a tiny GPT with XLA attention: checks the script on any backend
    python -m benchmarks.gpu --calibrate    # the performance model's kernels timed (benchmarks/gpu_calibrate.py)
    python -m benchmarks.gpu --predict benchmarks/results/gpu.json   # no GPU: the model's step for that run

On the one device it measures:

1. **Throughput.** A GPT train step (bf16 compute, fp32 parameters and Adam state,
   ``jax.nn.dot_product_attention(implementation="cudnn")``), as ``jax.jit`` and as
   ``autoshard.parallelize``, in tokens/s over ``--steps`` timed steps after two warm-up steps.
   The target is autoshard >= 0.99x jax.jit: on one device the plan is the program itself, so
   anything less is overhead of the lowering.
2. **Memory fidelity.** The plan's predicted peak per device (``plan.memory``) against XLA's
   ``memory_analysis()`` of the compiled step.
3. **Memory levers.** Under a budget of 80% of the unconstrained compiled peak, with ``remat=True``:
   the plan's remat choice, its compiled peak and step time. Then, with ``remat=False`` and a budget of
   the compiled peak less three quarters of the optimizer state (which offloading that state meets), host
   offload of the optimizer state to ``pinned_host``: what moved, the device peak and step time. Both
   budgets are met by their lever alone; tighter ones need remat and offload together, or accumulation.

Each part records its error instead of stopping the script, and the JSON (default
``benchmarks/results/gpu.json``) holds every number printed.

``--predict FILE`` needs no GPU: it plans the measured run of ``FILE`` (its device, config and batch) on one
simulated device under the preset of that device and the GPU backend profile, and puts the performance
model's step (``plan.cost.step_seconds``) against the measured ``autoshard`` step (issue 44's target: within
10%). The GPT is traced with XLA attention (cuDNN's needs a GPU); the model prices its score matrices as
the fused kernel's, as it does on a GPU, so the time is that of the measured program (its memory is not).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback


def _time_steps(step, state, batch, steps: int) -> tuple[float, object]:
    """Seconds per step over ``steps`` steps after two warm-up steps (the state is donated and threaded)."""
    import jax

    for _ in range(2):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    t = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - t) / steps, metrics


def _throughput(spec, args, tokens: int) -> dict:
    import jax

    import autoshard

    out = {}
    reference = jax.jit(spec.train_step, donate_argnums=(0,))
    sec, metrics = _time_steps(reference, spec.init_state(jax.random.key(0)), spec.make_batch(jax.random.key(1)),
                               args.steps)
    out["jax_jit"] = {"step_s": sec, "tokens_per_s": tokens / sec, "loss": float(metrics["loss"])}
    t = time.perf_counter()
    step = autoshard.parallelize(spec.train_step, donate_argnums=(0,), progress=None)
    plan = step.plan(spec.abstract_state(), spec.abstract_batch())
    out["plan_s"] = time.perf_counter() - t
    sec, metrics = _time_steps(step, spec.init_state(jax.random.key(0)), spec.make_batch(jax.random.key(1)),
                               args.steps)
    out["autoshard"] = {"step_s": sec, "tokens_per_s": tokens / sec, "loss": float(metrics["loss"])}
    out["ratio"] = out["autoshard"]["tokens_per_s"] / out["jax_jit"]["tokens_per_s"]
    out["plan"] = {"predicted_peak_bytes": plan.memory.peak_bytes, "predicted_step_s": plan.cost.total_seconds}
    return out


def _compiled_stats(step, spec) -> dict:
    from autoshard.hlo import memory_stats

    return memory_stats(step.lower(spec.abstract_state(), spec.abstract_batch()).compile())


def _compiled_peak(step, spec) -> float:
    return _compiled_stats(step, spec)["peak"]


def _memory(spec) -> dict:
    import autoshard

    step = autoshard.parallelize(spec.train_step, donate_argnums=(0,), progress=None)
    plan = step.plan(spec.abstract_state(), spec.abstract_batch())
    stats = _compiled_stats(step, spec)
    compiled = stats["peak"]
    return {"predicted_peak_bytes": plan.memory.peak_bytes, "compiled_peak_bytes": compiled,
            "compiled": stats, "predicted_over_compiled": plan.memory.peak_bytes / compiled,
            "breakdown": {k: float(v) for k, v in plan.memory.breakdown.items()}
            if hasattr(plan.memory, "breakdown") else {}}


def _lever(spec, args, tokens: int, *, budget: float, remat: bool) -> dict:
    import jax

    import autoshard

    step = autoshard.parallelize(spec.train_step, donate_argnums=(0,), memory_budget=budget, remat=remat,
                                 progress=None)
    plan = step.plan(spec.abstract_state(), spec.abstract_batch())
    out = {"budget_bytes": budget}
    if hasattr(plan, "num_microbatches"):  # no full-batch plan fits: the planner chose gradient accumulation
        out.update(accumulated_microbatches=plan.num_microbatches, why=plan.stats.get("accumulated_because"),
                   predicted_peak_bytes=max(s.memory_bytes for s in plan.stages),
                   compiled_peak_bytes=max(plan.stats.get("task_peaks", {0: float("nan")}).values()))
    else:
        out.update(remat=None if plan.remat is None else str(plan.remat), offloaded=list(plan.offloaded),
                   host_bytes=float(getattr(plan.memory, "host_bytes", 0.0)),
                   predicted_peak_bytes=plan.memory.peak_bytes, compiled_peak_bytes=_compiled_peak(step, spec))
    sec, metrics = _time_steps(step, spec.init_state(jax.random.key(0)), spec.make_batch(jax.random.key(1)),
                               args.steps)
    out.update(step_s=sec, tokens_per_s=tokens / sec, loss=float(metrics["loss"]))
    return out


def _run_part(results: dict, name: str, fn) -> None:
    t = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as e:  # a benchmark records what failed and goes on to the next part
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=8)}
    results[name]["seconds"] = time.perf_counter() - t
    print(f"[{name}] {json.dumps(results[name], default=str)[:600]}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="1.3B")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--attention", default=None, help="xla or cudnn (default: cudnn on GPU, xla elsewhere)")
    ap.add_argument("--smoke", action="store_true", help="a tiny GPT: check the script itself on any backend")
    ap.add_argument("--out", default="benchmarks/results/gpu.json")
    ap.add_argument("--parts", default="throughput,memory,remat,offload",
                    help="comma-separated parts to run (the levers need memory)")
    ap.add_argument("--calibrate", action="store_true",
                    help="time the performance model's kernels instead (benchmarks/gpu_calibrate.py)")
    ap.add_argument("--repeats", type=int, default=5, help="with --calibrate: timed runs per kernel (best kept)")
    ap.add_argument("--predict", default=None, metavar="FILE",
                    help="no GPU: the performance model's step for the run measured in FILE")
    args = ap.parse_args(argv)
    if args.predict:
        return predict(args.predict, "benchmarks/results/gpu_predicted.json" if args.out == ap.get_default("out")
                       else args.out)
    if args.calibrate:
        from benchmarks.gpu_calibrate import calibrate

        if args.smoke:
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        if args.out == "benchmarks/results/gpu.json":
            args.out = "benchmarks/results/gpu_calibration.json"
        return calibrate(args)
    if args.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        args.config, args.batch, args.steps = "tiny", 8, 2
    import jax
    import jax.numpy as jnp

    from benchmarks.models import get_model

    device = jax.devices()[0]
    attention = args.attention or ("cudnn" if device.platform == "gpu" else "xla")
    spec = get_model("gpt", args.config, args.batch, dtype=jnp.bfloat16, attention_impl=attention)
    seq = spec.abstract_batch()["tokens"].shape[1] if "tokens" in spec.abstract_batch() else 1
    tokens = args.batch * seq
    results = {"device": str(device.device_kind), "platform": device.platform, "jax": jax.__version__,
               "host": platform.node(), "config": args.config, "batch": args.batch, "attention": attention,
               "num_params": spec.num_params(), "tokens_per_step": tokens}
    print(f"GPT-{args.config} ({spec.num_params() / 1e9:.2f}B parameters), batch {args.batch}, attention "
          f"{attention}, on {device.device_kind} (jax {jax.__version__})", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)

    parts = set(args.parts.split(","))

    def part(name, fn):  # the JSON is rewritten after each part, so a run cut short keeps what it measured
        if name not in parts:
            return
        _run_part(results, name, fn)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)

    part("throughput", lambda: _throughput(spec, args, tokens))
    part("memory", lambda: _memory(spec))
    peak = results.get("memory", {}).get("compiled_peak_bytes")
    if peak:
        opt_state = results["memory"]["breakdown"].get("optimizer_state", 0.0)
        part("remat", lambda: _lever(spec, args, tokens, budget=0.8 * peak, remat=True))
        part("offload", lambda: _lever(spec, args, tokens, budget=peak - 0.75 * opt_state, remat=False))
    tp = results.get("throughput", {})
    if "ratio" in tp:
        print(f"\ntokens/s: jax.jit {tp['jax_jit']['tokens_per_s']:.0f}, autoshard {tp['autoshard']['tokens_per_s']:.0f} "
              f"({tp['ratio']:.3f}x; target >= 0.99x)")
    if "predicted_over_compiled" in results.get("memory", {}):
        print(f"peak memory predicted/compiled: {results['memory']['predicted_over_compiled']:.3f}")
    print(f"wrote {args.out}")
    return 0


def predict(measured_path: str, out: str) -> int:
    """Plan the run measured in ``measured_path`` on one simulated device; print and write predicted/measured."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp

    import autoshard
    from autoshard.perf import hardware_for_device_kind
    from benchmarks.models import get_model

    with open(measured_path) as f:
        measured = json.load(f)
    hw = hardware_for_device_kind(measured["device"])
    if hw is None:
        raise SystemExit(f"--predict: no hardware preset for device {measured['device']!r} "
                         "(autoshard.perf.HARDWARE lists the presets)")
    spec = get_model("gpt", measured["config"], measured["batch"], dtype=jnp.bfloat16, attention_impl="xla")
    step = autoshard.parallelize(spec.train_step, mesh=autoshard.make_mesh((1,), ("data",)),
                                 cluster=autoshard.ClusterSpec.from_hardware(hw), profile=autoshard.backends.GPU,
                                 donate_argnums=(0,), progress=None)
    plan = step.plan(spec.abstract_state(), spec.abstract_batch())
    got = measured.get("throughput", {}).get("autoshard", {}).get("step_s")
    perf = plan.stats.get("perf", {})
    result = {"measured_file": measured_path, "device": measured["device"], "preset": hw.name,
              "config": measured["config"], "batch": measured["batch"], "measured_step_s": got,
              "predicted_step_s": plan.cost.step_seconds,
              "ratio": plan.cost.step_seconds / got if got else None,
              "by_kind": perf.get("by_kind", {})}
    print(f"GPT-{measured['config']} batch {measured['batch']} on {measured['device']} ({hw.name}): predicted "
          f"{plan.cost.step_seconds * 1e3:.1f} ms, measured {got * 1e3:.1f} ms" if got else "no measured step",
          f"(predicted/measured {result['ratio']:.3f}; target within 10%)" if got else "")
    for kind, k in sorted(result["by_kind"].items(), key=lambda kv: -kv[1]["seconds"]):
        print(f"  {kind:<14} {k['seconds'] * 1e3:8.1f} ms  {k['flops'] / 1e12:8.2f} TFLOP  {k['bytes'] / 1e9:8.2f} GB")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
