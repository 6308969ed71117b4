"""The main demo: plan and run a sharded GPT train step on 8 simulated CPU devices.

    python -m benchmarks.demo [--layers 4] [--mesh 2,4]

It plans the step from abstract shapes, prints the plan summary, runs two steps
sharded and checks the loss against a single-device ``jax.jit`` reference, then
compares the predicted communication with what XLA compiled.
"""

from __future__ import annotations

import argparse
import os
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    ap.add_argument("--mesh", default="2,4", help="mesh shape, e.g. 2,4 or 8")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args(argv)

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}").strip()
    import jax
    import numpy as np

    import autoshard
    from benchmarks.models import gpt

    config = gpt.GPTConfig(vocab_size=512, seq_len=64, hidden=args.hidden, num_layers=args.layers, num_heads=4)
    spec = gpt.build(config, args.batch)
    shape = tuple(int(x) for x in args.mesh.split(","))
    names = ("data", "model")[-len(shape):] if len(shape) <= 2 else tuple(f"axis{i}" for i in range(len(shape)))
    mesh = autoshard.make_mesh(shape, names)
    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices, mesh {dict(mesh.shape)}")
    print(f"GPT: {args.layers} layers, hidden {args.hidden}, batch {args.batch}, "
          f"{spec.num_params() / 1e6:.2f}M parameters\n")

    step = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=autoshard.cluster_preset("cpu-sim"),
                                 donate_argnums=(0,))
    t = time.perf_counter()
    plan = step.plan(spec.abstract_state(), spec.abstract_batch())
    print(f"planned in {time.perf_counter() - t:.2f}s\n")
    print(plan.summary(max_rows=16))

    state = spec.init_state(jax.random.key(0))
    batch = spec.make_batch(jax.random.key(1))
    reference = jax.jit(spec.train_step)
    ref_state, ref_metrics = reference(state, batch)
    _, ref_metrics2 = reference(ref_state, batch)

    sharded_state, metrics = step(state, batch)
    sharded_state, metrics2 = step(sharded_state, batch)
    print("\nloss          step 1        step 2")
    print(f"jax.jit   {float(ref_metrics['loss']):12.6f}  {float(ref_metrics2['loss']):12.6f}")
    print(f"autoshard {float(metrics['loss']):12.6f}  {float(metrics2['loss']):12.6f}")
    ok = np.allclose(float(metrics2["loss"]), float(ref_metrics2["loss"]), rtol=1e-5)
    compiled = step.lower(sharded_state, batch).compile()
    print("\npredicted vs compiled communication (per device, per step):")
    print(plan.verify(compiled))
    print("\nresult:", "matches the single-device reference" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
