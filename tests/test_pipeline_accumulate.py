"""Gradient accumulation without a pipeline: microbatched steps equal the unsplit step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.errors import InputError
from benchmarks.models import get_model, gpt
from benchmarks.models.gpt import GPTConfig
from tests.helpers import assert_trees_close, mesh

SMALL_GPT = GPTConfig(vocab_size=64, seq_len=8, hidden=32, num_layers=4, num_heads=2)


def _check(spec, k, mesh_name="2x4", steps=2):
    state = spec.init_state(jax.random.key(0))
    batch = spec.make_batch(jax.random.key(1))
    ref = jax.jit(spec.train_step)
    step = autoshard.parallelize(spec.train_step, mesh=mesh(mesh_name), num_microbatches=k, solver_time_limit=1.0)
    ref_state, out_state = state, state
    for _ in range(steps):
        ref_state, ref_metrics = ref(ref_state, batch)
        out_state, metrics = step(out_state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    assert_trees_close(out_state["params"], ref_state["params"], rtol=1e-5, atol=5e-5, what="params")
    return step, state, batch


@pytest.mark.parametrize("k", [4, 8])
def test_mlp_accumulation_equals_full_batch(k):
    _check(get_model("mlp", "tiny", batch_size=16), k)


def test_accumulation_without_a_mesh_equals_jit():
    """mesh=None (the planner picks the mesh) with num_microbatches and no pipeline."""
    spec = get_model("mlp", "tiny", batch_size=16)
    state, batch = spec.init_state(jax.random.key(0)), spec.make_batch(jax.random.key(1))
    ref_state, ref_metrics = jax.jit(spec.train_step)(state, batch)
    step = autoshard.parallelize(spec.train_step, num_microbatches=4, solver_time_limit=1.0, progress=None)
    out_state, metrics = step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    assert_trees_close(out_state["params"], ref_state["params"], rtol=1e-5, atol=5e-5, what="params")


@pytest.mark.slow
def test_gpt_accumulation_equals_full_batch():
    step, state, batch = _check(gpt.build(SMALL_GPT, 8), 4)
    plan = step.plan(state, batch)
    assert plan.num_stages == 1 and plan.num_microbatches == 4


def test_sum_loss_and_batched_output():
    """A sum (not mean) loss and a per-example output: partial sums add up, per-example values concatenate."""

    def step(w, batch):
        pred = jnp.tanh(batch["x"] @ w)
        loss, g = jax.value_and_grad(lambda w: jnp.sum((jnp.tanh(batch["x"] @ w) - batch["y"]) ** 2))(w)
        return w - 0.1 * g, {"loss": loss, "pred": pred}

    w = jax.random.normal(jax.random.key(0), (4, 3))
    batch = {"x": jax.random.normal(jax.random.key(1), (8, 4)), "y": jnp.ones((8, 3))}
    ref_w, ref_m = jax.jit(step)(w, batch)
    out_w, m = autoshard.parallelize(step, mesh=mesh("8"), num_microbatches=4, solver_time_limit=1.0)(w, batch)
    np.testing.assert_allclose(out_w, ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m["loss"], ref_m["loss"], rtol=1e-5)
    np.testing.assert_allclose(m["pred"], ref_m["pred"], rtol=1e-5, atol=1e-6)


def test_batch_not_divisible():
    spec = get_model("mlp", "tiny", batch_size=12)
    step = autoshard.parallelize(spec.train_step, mesh=mesh("8"), num_microbatches=8)
    with pytest.raises(InputError, match=r"batch size 12 .* not divisible by num_microbatches=8"):
        step.plan(spec.abstract_state(), spec.abstract_batch())


def test_max_over_batch_is_rejected():
    def step(w, x):
        g = jax.grad(lambda w: jnp.max(x @ w))(w)
        return w - g, {"loss": jnp.max(x @ w)}

    p = autoshard.parallelize(step, mesh=mesh("8"), num_microbatches=2)
    with pytest.raises(InputError, match=r"`reduce_max` .* not a sum"):
        p.plan(jnp.ones((4, 2)), jnp.ones((8, 4)))


def test_batchnorm_statistics_are_rejected():
    spec = get_model("convnet", "tiny", batch_size=8)
    step = autoshard.parallelize(spec.train_step, mesh=mesh("8"), num_microbatches=2)
    with pytest.raises(InputError, match=r"feeds back into per-example values"):
        step.plan(spec.abstract_state(), spec.abstract_batch())


def _dropout_step():
    """A two-layer MLP with dropout drawn from a key carried in the state (as nnx.Rngs and linen do)."""

    def forward(params, key, x):
        def layer(h, wk):
            w, k = wk
            h = jnp.tanh(h @ w)
            keep = jax.random.bernoulli(k, 0.8, h.shape)
            return jnp.where(keep, h / 0.8, 0.0), None

        keys = jax.random.split(key, 2)
        h = x
        for i in range(2):
            h, _ = layer(h, (params["w"][i], keys[i]))
        return h

    def step(state, batch):
        key, sub = jax.random.split(state["key"])
        loss, g = jax.value_and_grad(
            lambda p: jnp.mean((forward(p, sub, batch["x"]) - batch["y"]) ** 2))(state["params"])
        params = jax.tree.map(lambda p, d: p - 0.5 * d, state["params"], g)
        return {"params": params, "key": key}, {"loss": loss}

    state = {"params": {"w": jax.random.normal(jax.random.key(0), (2, 8, 8)) / 3}, "key": jax.random.key(7)}
    batch = {"x": jax.random.normal(jax.random.key(1), (16, 8)), "y": jax.random.normal(jax.random.key(2), (16, 8))}
    return step, state, batch


@pytest.mark.parametrize("runtime", [None, "device_put", "spmd"])
def test_microbatches_draw_the_full_steps_dropout(runtime):
    """Each microbatch takes its slice of the bits the full step draws: the split step equals the unsplit
    one with dropout on (it did not: each microbatch drew a mask of its own shape from the same key). Without
    a pipeline, and in two-stage pipelines under both runtimes."""
    fn, state, batch = _dropout_step()
    ref = jax.jit(fn)
    pipeline = None if runtime is None else autoshard.PipelineOptions(
        num_stages=2, submeshes=[(2, 2), (2, 2)], runtime=runtime, solver_time_limit=0.5)
    step = autoshard.parallelize(fn, mesh=mesh("2x4"), num_microbatches=4, solver_time_limit=1.0, pipeline=pipeline)
    ref_state, out_state = state, state
    for _ in range(2):
        ref_state, ref_metrics = ref(ref_state, batch)
        out_state, metrics = step(out_state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    assert_trees_close(out_state["params"], ref_state["params"], rtol=1e-5, atol=5e-5, what="params")
    analysis = step.prepared(state, batch).analysis
    assert len(analysis.draws) == 2


def _per_example_dropout_step(w, x, keys):
    def loss(w):
        def one(xi, k):
            h = jnp.tanh(xi @ w)
            return (jax.random.bernoulli(k, 0.9, h.shape) * h).sum()

        return jax.vmap(one)(x, keys).mean()

    value, grad = jax.value_and_grad(loss)(w)
    return w - 0.1 * grad, value


def test_microbatches_with_per_example_keys_draw_what_the_full_step_draws():
    """Dropout from per-example keys (split per example and vmapped, as Equinox models draw it): each
    microbatch draws its own examples' bits from its slice of the keys (a draw from one key for the whole
    batch is sliced from the full draw instead)."""
    w = jnp.ones((8, 32)) / 10
    x = jnp.arange(8 * 17 * 8.0).reshape(8, 17, 8) / 1000
    keys = jax.random.split(jax.random.key(0), 8)
    ref_w, ref_loss = jax.jit(_per_example_dropout_step)(w, x, keys)
    step = autoshard.parallelize(_per_example_dropout_step, num_microbatches=2, batch_argnums=(1, 2), progress=None)
    new_w, new_loss = step(w, x, keys)
    np.testing.assert_allclose(new_loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(new_w, ref_w, rtol=1e-5, atol=1e-6)
