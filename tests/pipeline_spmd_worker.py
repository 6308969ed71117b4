"""One process of the two-process SPMD pipeline test (``tests/test_pipeline_spmd.py``).

Usage: ``python tests/pipeline_spmd_worker.py PROCESS_ID PORT OUT_DIR`` with ``XLA_FLAGS`` giving each
process 4 CPU devices. Both processes run the same pipelined step (2 stages, one per process, 1F1B,
4 microbatches) on identical full inputs and write what they read back to ``OUT_DIR/proc<i>.npz``.
"""

from __future__ import annotations

import os
import sys


def main(process_id: int, port: int, out_dir: str):
    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id)
    import autoshard
    from autoshard.pipeline.spmd import SpmdPipelineExecutable
    from tests.test_pipeline_spmd import TINY_GPT, spmd_options
    from benchmarks.models import gpt

    spec = gpt.build(TINY_GPT, 8)
    state = spec.init_state(jax.random.key(0))
    batch = spec.make_batch(jax.random.key(1))
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))   # row i: process i's 4 devices
    step = autoshard.parallelize(spec.train_step, mesh=mesh, num_microbatches=4,
                                 pipeline=spmd_options("1f1b", runtime="auto"))
    new_state, metrics = step(state, batch)
    entry = step._get((state, batch))
    exe = entry.executable
    assert isinstance(exe, SpmdPipelineExecutable), type(exe)
    stage_procs = [sorted({d.process_index for d in row}) for row in exe.mesh.devices]
    flat = jax.tree.leaves((state, batch))
    hlo = exe.lower(flat).compile().as_text()
    leaves = [np.asarray(x.addressable_data(0)) for x in jax.tree.leaves(new_state["params"])]
    np.savez(os.path.join(out_dir, f"proc{process_id}.npz"), loss=np.asarray(metrics["loss"].addressable_data(0)),
             stage_procs=np.asarray(stage_procs), permutes=hlo.count("collective-permute"),
             runtime=entry.plan.stats["runtime"], **{f"p{i}": x for i, x in enumerate(leaves)})
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
