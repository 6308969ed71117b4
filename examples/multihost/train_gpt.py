"""Train a GPT with autoshard on every process of a multi-host job (jax.distributed).

Every process runs this same script. It joins the job (``autoshard.distributed.initialize``, which
is ``jax.distributed.initialize``: it auto-detects SLURM, Open MPI, Kubernetes and Cloud TPU, or reads
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``), builds one global mesh,
and trains with each process feeding only its own rows of the batch. With ``--ckpt-dir`` it saves
an orbax checkpoint every ``--save-every`` steps and, when started again (on the same or on a
different number of devices), re-plans for the devices it has and resumes from the last checkpoint.

Launch recipes: ``slurm.sbatch`` (SLURM), ``cloud_gpu.sh`` (GPU VMs or Kubernetes), ``local_cpu.sh``
(two processes on this machine with simulated CPU devices). See the README's "Multi-host" section.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

import autoshard
from benchmarks.models import get_model


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny", help="GPT config (tiny, 125M, 350M, ...)")
    p.add_argument("--global-batch", type=int, default=8, help="rows per step over all processes")
    p.add_argument("--steps", type=int, default=10, help="train until this step")
    p.add_argument("--data", type=int, default=None,
                   help="size of the 'data' mesh axis; default: the number of hosts (processes when each "
                        "process drives several devices, else $SLURM_JOB_NUM_NODES)")
    p.add_argument("--ckpt-dir", default=None, help="shared directory for orbax checkpoints")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--step-timeout", type=float, default=600,
                   help="seconds a step may run before the job is declared stuck (see step_timeout)")
    p.add_argument("--pipeline-stages", type=int, default=0,
                   help="run as a pipeline of this many stages (each under its own intra-op plan on a "
                        "sub-mesh, one SPMD program across the processes); 0: one sharded program")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step of a pipeline")
    return p.parse_args()


def data_axis_size(requested: int | None) -> int:
    if requested:
        return requested
    if jax.local_device_count() > 1:  # one process per host, driving all its devices
        return jax.process_count()
    return int(os.environ.get("SLURM_JOB_NUM_NODES", jax.process_count()))  # one process per device


def local_batch(spec, step: int, global_batch: int):
    """This process's rows of step ``step``'s batch. Replace with your own per-host data loader."""
    rows = global_batch // jax.process_count()
    first = jax.process_index() * rows
    batch = spec.make_batch(jax.random.key(1000 + step))  # synthetic: the same global batch everywhere
    return {k: np.asarray(v)[first:first + rows] for k, v in batch.items()}


def restore_target(step, plan, abstract_state, batch):
    """The state's shapes with the shardings this run's plan gives them (what a checkpoint restores onto)."""
    if isinstance(plan, autoshard.Plan):
        return autoshard.apply_plan(plan, abstract_state)
    # a pipeline: the state enters its one SPMD program in the layouts of the stages that read it
    shardings = step.prepared(abstract_state, batch).executable.in_shardings
    leaves, tree = jax.tree.flatten(abstract_state)
    return jax.tree.unflatten(tree, [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                                     for a, s in zip(leaves, shardings, strict=False)])


def main():
    args = parse_args()
    autoshard.distributed.initialize()
    if args.global_batch % jax.process_count():
        raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of the "
                         f"{jax.process_count()} processes")
    data = data_axis_size(args.data)
    mesh = autoshard.make_mesh((data, jax.device_count() // data), ("data", "model"))
    spec = get_model("gpt", args.config, batch_size=args.global_batch)
    if args.pipeline_stages:   # each process still passes only its rows of the batch (argument 1)
        pipeline = autoshard.PipelineOptions(num_stages=args.pipeline_stages, runtime="auto")
        step = autoshard.parallelize(spec.train_step, mesh=mesh, num_microbatches=args.microbatches,
                                     pipeline=pipeline, batch_argnums=(1,), step_timeout=args.step_timeout)
    else:
        step = autoshard.parallelize(spec.train_step, mesh=mesh, donate_argnums=(0,), step_timeout=args.step_timeout)
    me = jax.process_index()

    abstract_state = jax.eval_shape(spec.init_state, jax.random.key(0))
    plan = step.plan(abstract_state, local_batch(spec, 0, args.global_batch))  # every process, together
    first_step, state = 0, None
    if args.ckpt_dir:
        import orbax.checkpoint as ocp

        ckpt = ocp.CheckpointManager(os.path.abspath(args.ckpt_dir),
                                     options=ocp.CheckpointManagerOptions(max_to_keep=2))
        if ckpt.latest_step() is not None:  # elastic restart: restore onto this run's plan
            first_step = ckpt.latest_step()
            target = restore_target(step, plan, abstract_state, local_batch(spec, 0, args.global_batch))
            state = ckpt.restore(first_step, args=ocp.args.StandardRestore(target))
    if state is None:
        state = spec.init_state(jax.random.key(0))  # the same on every process
    if me == 0:
        print(f"{jax.process_count()} processes, {jax.device_count()} devices, mesh {dict(mesh.shape)}, "
              f"starting at step {first_step}\n{plan.summary(max_rows=8, rich=False)}", flush=True)

    for i in range(first_step, args.steps):
        t = time.perf_counter()
        state, metrics = step(state, local_batch(spec, i, args.global_batch))
        loss = float(metrics["loss"])  # a replicated global scalar: every process can read it
        if me == 0:
            print(f"step {i + 1}: loss {loss:.5f} ({time.perf_counter() - t:.2f} s)", flush=True)
        if args.ckpt_dir and ((i + 1) % args.save_every == 0 or i + 1 == args.steps):
            ckpt.save(i + 1, args=ocp.args.StandardSave(state))  # every process writes its shards
    if args.ckpt_dir:
        ckpt.wait_until_finished()
        ckpt.close()


if __name__ == "__main__":
    main()
