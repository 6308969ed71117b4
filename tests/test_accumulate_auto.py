"""Gradient accumulation as a memory lever: chosen only when no full-batch plan fits the budget."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.errors import InfeasibleError, InputError
from autoshard.hlo import memory_stats
from autoshard.pipeline import PipelinePlan
from autoshard.testing import pipeline_executable
from tests.helpers import assert_trees_close, check_report_surface, mesh

BATCH, DIM, HIDDEN = 512, 16, 512


def _step(params, batch):
    """SGD on a wide two-layer MLP: no optimizer state to offload, activations dominate memory."""

    def loss_fn(p):
        hidden = jnp.tanh(batch["x"] @ p["w1"])
        return jnp.mean((hidden @ p["w2"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, params, grads), {"loss": loss}


def _inputs():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k1, (DIM, HIDDEN)) / 4, "w2": jax.random.normal(k2, (HIDDEN, DIM)) / 20}
    batch = {"x": jax.random.normal(k3, (BATCH, DIM)), "y": jax.random.normal(k4, (BATCH, DIM))}
    return params, batch


def test_accumulates_when_no_full_batch_plan_fits(tmp_path):
    t0 = time.perf_counter()
    params, batch = _inputs()
    budget = 2e5
    free = autoshard.parallelize(_step, mesh=mesh("8"), progress=None, solver_time_limit=1.0)
    assert memory_stats(free.lower(params, batch).compile())["peak"] > budget  # ~0.41 MB per device
    # Sharding, remat and offload alone cannot meet the budget ...
    strict = autoshard.parallelize(_step, mesh=mesh("8"), memory_budget=budget, accumulate=False, progress=None,
                                   solver_time_limit=1.0)
    with pytest.raises(InfeasibleError, match="no plan fits memory_budget"):
        strict.plan(params, batch)
    # ... microbatches do.
    step = autoshard.parallelize(_step, mesh=mesh("8"), memory_budget=budget, progress=None, solver_time_limit=1.0)
    plan = step.plan(params, batch)
    assert isinstance(plan, PipelinePlan)
    k = plan.num_microbatches
    assert k == plan.stats["num_microbatches"] and k in (2, 4)
    assert "gradient accumulation chosen by the planner" in plan.summary()
    exe = pipeline_executable(step, params, batch)
    from autoshard.pipeline.auto import compiled_task_peaks

    peaks = compiled_task_peaks(exe)
    assert peaks and max(peaks.values()) <= budget, peaks
    ref = jax.jit(_step)
    ref_params, out_params = params, params
    for _ in range(2):
        ref_params, ref_metrics = ref(ref_params, batch)
        out_params, metrics = step(out_params, batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    assert_trees_close(out_params, ref_params, rtol=1e-5, atol=5e-5, what="params")
    with pytest.raises(InputError, match="accumulated microbatches"):
        step.lower(params, batch)
    assert time.perf_counter() - t0 < 60
    check_report_surface(plan, exe, tmp_path)  # the notebook view, JSON and verify, like a Plan's


def test_generous_budget_does_not_accumulate():
    params, batch = _inputs()
    step = autoshard.parallelize(_step, mesh=mesh("8"), memory_budget=1e9, progress=None, solver_time_limit=1.0)
    plan = step.plan(params, batch)
    assert isinstance(plan, autoshard.Plan) and "num_microbatches" not in plan.stats
    out_params, metrics = step(params, batch)
    ref_params, ref_metrics = jax.jit(_step)(params, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)


def test_max_over_batch_keeps_the_infeasible_error():
    def step(w, x):
        g = jax.grad(lambda w: jnp.max(jnp.tanh(x @ w)))(w)
        return w - g, {"loss": jnp.max(x @ w)}

    p = autoshard.parallelize(step, mesh=mesh("8"), memory_budget=2e4, progress=None, solver_time_limit=1.0)
    with pytest.raises(InfeasibleError, match=r"(?s)no plan fits.*cannot help:.*`reduce_max` .* not a sum"):
        p.plan(jnp.ones((16, 512)), jnp.ones((512, 16)))


def test_a_bias_does_not_stop_accumulation():
    """At one example per microbatch jax writes a bias gradient's batch sum as a reshape, so that k
    cannot be split; the planner must go on to the next k, not give up."""

    def step(params, batch):
        def loss_fn(p):
            hidden = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
            return jnp.mean((hidden @ p["w2"] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, params, grads), {"loss": loss}

    params, batch = _inputs()
    params = {**params, "b1": jnp.full((HIDDEN,), 0.01)}
    p = autoshard.parallelize(step, mesh=mesh("8"), memory_budget=2e5, progress=None, solver_time_limit=1.0)
    plan = p.plan(params, batch)
    assert isinstance(plan, PipelinePlan) and 1 < plan.num_microbatches < BATCH
    out_params, metrics = p(params, batch)
    ref_params, ref_metrics = jax.jit(step)(params, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    assert_trees_close(out_params, ref_params, rtol=1e-5, atol=5e-5, what="params")
