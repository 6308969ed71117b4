"""Shared test utilities: meshes, the single-device reference, and comparisons."""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import numpy as np

import autoshard

MESHES = {
    "8": ((8,), ("data",)),
    "2x4": ((2, 4), ("data", "model")),
    "4x2": ((4, 2), ("data", "model")),
    "1x8": ((1, 8), ("data", "model")),
}


def alpha_beta_h100():
    """An H100-like cluster without a hardware model: compute at one rate (70% of the bf16 peak), NVLink as one
    alpha-beta link, no overlap. For tests of the memory machinery that need the planner to prefer replicated
    state when nothing binds, which the performance model's overlap and roofline no longer guarantee."""
    import autoshard

    return autoshard.ClusterSpec(flops=989e12 * 0.7, bandwidth=450e9, latency=5e-6, memory=80 * 2**30,
                                 host_bandwidth=50e9, name="h100-alpha-beta")


def mesh(name: str):
    shape, names = MESHES[name]
    return autoshard.make_mesh(shape, names)


def run_steps(step, state, batch, n=2):
    losses = []
    for _ in range(n):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def assert_trees_close(actual, expected, *, rtol=1e-5, atol=1e-6, what="state"):
    """Leaf-by-leaf comparison that names the pytree path of the first mismatch."""
    exp_leaves = jax.tree_util.tree_flatten_with_path(expected)[0]
    act_leaves = jax.tree.leaves(actual)
    assert len(exp_leaves) == len(act_leaves), f"{what}: {len(act_leaves)} leaves, expected {len(exp_leaves)}"
    for (path, e), a in zip(exp_leaves, act_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol,
                                   err_msg=f"{what}{jax.tree_util.keystr(path)}")


def check_against_reference(spec, mesh_, *, cluster=None, steps=2, loss_rtol=1e-5, param_atol=5e-5):
    """Run ``spec.train_step`` under autoshard and under single-device jax.jit; compare."""
    state = spec.init_state(jax.random.key(0))
    batch = spec.make_batch(jax.random.key(1))
    ref_state, ref_losses = run_steps(jax.jit(spec.train_step), state, batch, steps)
    step = autoshard.parallelize(spec.train_step, mesh=mesh_,
                                 cluster=cluster or autoshard.cluster_preset("cpu-sim"))
    out_state, losses = run_steps(step, state, batch, steps)
    np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
    # Adam divides by sqrt(v): reduction-order noise in tiny gradients moves a weight by up to ~lr * 1e-2.
    assert_trees_close(out_state["params"], ref_state["params"], rtol=1e-5, atol=param_atol, what="params")
    return step


def check_report_surface(plan, executable, tmp_path):
    """``summary``, the notebook view, ``visualize``, a JSON round trip and ``verify`` against XLA."""
    from autoshard.hlo import collective_stats

    html = plan._repr_html_()
    assert html.startswith('<div class="autoshard-plan"') and plan.summary().splitlines()[0].split(":")[0] in html
    back = type(plan).from_json(plan.to_json())
    assert back.summary() == plan.summary() and back.to_json() == plan.to_json()
    check = plan.verify(executable)
    compiled = {}
    for stage in plan.stages:  # what verify compiled: each stage's forward and backward task, its reductions
        for program in executable.compiled_tasks(executable.microbatch_keys(stage.index)).values():
            for c in collective_stats(program).collectives:
                compiled[c.kind] = compiled.get(c.kind, 0.0) + c.bytes * c.multiplicity
    assert check.compiled == compiled and check.predicted_bytes > 0 and check.compiled_bytes > 0
    if importlib.util.find_spec("matplotlib") is not None:
        fig = plan.visualize(tmp_path / "pipeline.png", dpi=40)
        assert (tmp_path / "pipeline.png").read_bytes().startswith(b"\x89PNG") and fig.axes


def with_binding_limit(problem, fraction: float):
    """``problem`` (a ``ShardingProblem`` with memory and no limit) with a memory limit ``fraction`` of the
    way from the peak of every node's least-memory strategy to the peak of every node's cheapest one."""
    low = problem.peak_memory([int(np.argmin(m)) for m in problem.node_memory])
    high = problem.peak_memory([int(np.argmin(c)) for c in problem.node_costs])
    return dataclasses.replace(problem, memory_limit=low + fraction * (high - low))
