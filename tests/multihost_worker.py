"""One process of a multi-process test job (started by tests/test_multihost.py, not collected).

Usage: python tests/multihost_worker.py MODE OUT_DIR [--port P --process-id I --num-processes N]

Modes:
  train:   the issue's recipe on a ``(processes, local devices)`` mesh: a tiny GPT trained for
           ``--steps`` steps, each process passing its slice of the batch; writes losses, the plan
           and the gathered params, then saves an orbax checkpoint of the state.
  die:     two processes run a small step; process 1 exits just before step 2.
  hang:    two processes run a small step; process 1 sleeps just before step 2.
  errors:  process 1 passes one row fewer than process 0, then a plan that cannot fit its memory
           budget fails on process 0; every process prints the errors autoshard raises.

The device count comes from XLA_FLAGS in the environment, set by the caller.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GLOBAL_BATCH = 8


def tiny_gpt():
    from benchmarks.models import gpt

    config = gpt.GPTConfig(vocab_size=64, seq_len=8, hidden=32, num_layers=1, num_heads=2)
    return gpt.build(config, GLOBAL_BATCH)


def global_batch(spec, step: int):
    """The global batch of step ``step`` (the same on every process and in the reference)."""
    import jax

    return jax.tree.map(np.asarray, spec.make_batch(jax.random.key(100 + step)))


def initial_state(spec, folder):
    """``spec.init_state(key(0))``, read from ``folder/init.npz`` when the caller saved it there.

    Initialising eagerly costs each worker seconds of CPU that the test machine is short of.
    """
    import jax

    abstract = jax.eval_shape(spec.init_state, jax.random.key(0))
    path = os.path.join(folder, "init.npz")
    if not os.path.exists(path):
        return jax.tree.map(np.asarray, spec.init_state(jax.random.key(0)))
    saved = np.load(path)
    flat, tree = jax.tree_util.tree_flatten_with_path(abstract)
    return jax.tree_util.tree_unflatten(tree, [saved[jax.tree_util.keystr(p)] for p, _ in flat])


def save_initial_state(state, folder):
    import jax

    np.savez(os.path.join(folder, "init.npz"),
             **{jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]})


def local_slice(batch, process: int, num_processes: int):
    rows = GLOBAL_BATCH // num_processes
    return {k: v[process * rows:(process + 1) * rows] for k, v in batch.items()}


def train(args):
    import jax
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils

    import autoshard

    t0 = time.perf_counter()
    spec = tiny_gpt()
    state = initial_state(spec, args.out)
    _phase("init", t0)
    mesh = autoshard.make_mesh((jax.process_count(), jax.local_device_count()), ("data", "model"))
    step = autoshard.parallelize(spec.train_step, mesh=mesh, progress=None, step_timeout=120,
                                 donate_argnums=(0,))
    me, n = jax.process_index(), jax.process_count()
    losses = []
    for i in range(args.steps):
        state, metrics = step(state, local_slice(global_batch(spec, i), me, n))
        losses.append(float(metrics["loss"]))  # a replicated global scalar: readable on every process
        _phase(f"step {i}", t0)
    plan = step.plan(jax.eval_shape(lambda: state), local_slice(global_batch(spec, 0), me, n))
    params = multihost_utils.process_allgather(state["params"], tiled=True)
    flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    np.savez(os.path.join(args.out, f"params{me}.npz"), **flat)
    loss_sharding = metrics["loss"].sharding
    with open(os.path.join(args.out, f"result{me}.json"), "w") as f:
        json.dump({"losses": losses, "plan": plan.to_json(), "fingerprint": plan.fingerprint,
                   "global_state": all(isinstance(x, jax.Array) and not x.is_fully_addressable
                                       for x in jax.tree.leaves(state["params"]) if x.ndim),
                   "loss_replicated": bool(loss_sharding.is_fully_replicated),
                   "tokens_spec": [str(s) for p, s in zip(plan.in_paths, plan.in_specs, strict=True)
                                   if p == "[1]['tokens']"],
                   "devices": jax.device_count(), "processes": n}, f)
    _phase("results", t0)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(args.out, "ckpt"), state)
    _phase("checkpoint", t0)


def _phase(what, t0):
    print(f"[{time.perf_counter() - t0:7.2f} s] {what}", flush=True)


def fail(args):
    import jax
    import jax.numpy as jnp

    import autoshard

    def train_step(w, x):
        loss = jnp.mean(jnp.tanh(x @ w) ** 2)
        return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w), loss

    step = autoshard.parallelize(train_step, progress=None, step_timeout=args.step_timeout or None)
    me = jax.process_index()
    w = np.ones((16, 16), np.float32) / 16
    x = np.ones((4, 16), np.float32) * (me + 1)
    for i in range(4):
        if me == 1 and i == 2:
            print(f"process 1: {args.mode} before step {i}", flush=True)
            if args.mode == "die":
                os._exit(3)
            time.sleep(3600)
        w, loss = step(w, x)
        print(f"process {me}: step {i} loss {float(loss):.6f} at {time.time():.3f}", flush=True)
    print(f"process {me}: finished", flush=True)


def errors(args):
    import jax
    import jax.numpy as jnp

    import autoshard

    w = np.ones((16, 16), np.float32)
    step = autoshard.parallelize(lambda w, x: jnp.sum(x @ w), progress=None)
    rows = 4 - jax.process_index()
    try:
        step(w, np.ones((rows, 16), np.float32))
    except autoshard.InputError as e:
        print(f"InputError: {e}", flush=True)
    tight = autoshard.parallelize(lambda w, x: jnp.sum(x @ w), progress=None, memory_budget=100)
    try:
        tight(w, np.ones((4, 16), np.float32))
    except autoshard.InfeasibleError as e:
        print(f"InfeasibleError: {e}", flush=True)


def main():
    t0 = time.perf_counter()
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("train", "die", "hang", "errors"))
    p.add_argument("out")
    p.add_argument("--port", type=int)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--step-timeout", type=float, default=20, help="0: no watchdog")
    p.add_argument("--heartbeat", type=int, default=10)
    args = p.parse_args()
    if args.num_processes > 1:
        import autoshard.distributed

        _phase("imported", t0)

        autoshard.distributed.initialize(f"localhost:{args.port}", args.num_processes, args.process_id,
                                         heartbeat_timeout_seconds=args.heartbeat, initialization_timeout=60)
    _phase("initialized", t0)
    {"train": train, "die": fail, "hang": fail, "errors": errors}[args.mode](args)


if __name__ == "__main__":
    main()
