"""A gradient a microbatched stage reduce-scatters is either reduced every microbatch or held unreduced for
the step (``Plan.deferred``), as its solver chooses under the memory limit; the runtime does what the plan
chose, and the result equals jax.jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import autoshard
from autoshard.hlo import collective_stats, memory_stats
from autoshard.pipeline.deferred import PartialSum, summed_axes
from tests.helpers import assert_trees_close

D, BATCH, K = 128, 4096, 4
OPT = optax.adamw(1e-3)


def _step(state, batch):
    params, opt_state = state

    def loss(p):
        h = jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"]
        return jnp.mean((h - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = OPT.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": value}


def _inputs():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k1, (D, 4 * D)) * 0.05, "w2": jax.random.normal(k2, (4 * D, D)) * 0.05}
    batch = {"x": jax.random.normal(k3, (BATCH, D)), "y": jax.random.normal(k4, (BATCH, D))}
    return (params, OPT.init(params)), batch


def _micro_reduction_bytes(tasks) -> float:
    """Bytes a microbatch's tasks reduce (they run K times a step)."""
    return sum(collective_stats(c).bytes("reduce-scatter") + collective_stats(c).bytes("all-reduce")
               for key, c in tasks.items() if key[0] in "FB")


def _scattered(exe, plan) -> dict:
    """The stage's gradients ``plan`` reduce-scatters (value id -> bytes of the whole gradient)."""
    out = {}
    for task in exe.part.micro_tasks(0):
        for op in task.ops:
            v = op.outputs[0] if len(op.outputs) == 1 else None
            axes = summed_axes(plan, op) if v in task.frontier else ()
            if axes and PartialSum(v, op.index, axes, plan.value_specs[v]).scatters:
                out[v] = float(np.prod(exe.analysis.avals[v].shape) * 4)
    return out


def test_reduce_scattered_gradients_are_held_unreduced_where_the_plan_chooses():
    """Data parallel over 8 devices, 4 microbatches: under a memory budget the optimizer state is sharded and
    the two weight gradients are reduce-scattered. Each is held unreduced for the step (8x its reduced size)
    while the budget allows, and reduce-scattered every microbatch where it does not; what runs is what the
    plan chose, and what compiles fits the budget."""
    state, batch = _inputs()
    ref_state, ref_metrics = jax.jit(_step)(state, batch)
    mesh = autoshard.make_mesh((8, 1), ("data", "model"))
    weights = 2 * D * 4 * D * 4   # bytes of the two weights (and of each of their Adam moments)
    held, reduced = set(), set()
    for budget in (5.7 * weights, 4.3 * weights, 3.8 * weights):
        step = autoshard.parallelize(_step, mesh=mesh, num_microbatches=K, memory_budget=budget, progress=None)
        out_state, metrics = step(state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
        assert_trees_close(out_state[0], ref_state[0], rtol=1e-5, atol=5e-5, what="params")
        entry = step.prepared(state, batch)
        plan, exe = entry.plan.stages[0].plan, entry.executable
        scattered = _scattered(exe, plan)
        assert plan.deferred <= set(scattered) and plan.deferred <= set(exe.partials[0])
        assert not (set(scattered) - plan.deferred) & set(exe.partials[0])
        tasks = exe.compiled_tasks()
        assert max(memory_stats(c)["peak"] for c in tasks.values()) <= budget
        # a gradient reduced every microbatch is a reduce-scatter (XLA:CPU: an all-reduce) of all its rows
        each = sum(b for v, b in scattered.items() if v not in plan.deferred)
        micro = _micro_reduction_bytes(tasks)
        assert micro >= each and (micro == 0) == (each == 0)
        held |= {budget} if plan.deferred else set()
        reduced |= {budget} if each else set()
    assert held and reduced   # both choices were taken
