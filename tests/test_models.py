"""The model zoo: every family trains under jax.jit and traces from abstract values alone."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.models import CONFIGS, get_model, gpt, moe

FAMILIES = sorted(CONFIGS)
BATCH = 4
# These tests check the math, not the speed: skip XLA's backend optimizations to compile faster.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.cache
def _tiny(family):
    """(spec, initial state, batch, jitted train step), shared between tests to compile once."""
    spec = get_model(family, "tiny", BATCH)
    # RBG keys: XLA:CPU compiles threefry slowly, and every eager init op is its own compile.
    state = jax.jit(spec.init_state, compiler_options=FAST_COMPILE)(jax.random.key(0, impl="rbg"))
    batch = jax.jit(spec.make_batch, compiler_options=FAST_COMPILE)(jax.random.key(1, impl="rbg"))
    return spec, state, batch, jax.jit(spec.train_step, compiler_options=FAST_COMPILE)


def _shapes(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_trains(family):
    spec, state, batch, step = _tiny(family)
    assert jax.tree.structure(state) == jax.tree.structure(spec.abstract_state())
    assert _shapes(state) == _shapes(spec.abstract_state())
    assert _shapes(batch) == _shapes(spec.abstract_batch())
    assert all(leaf.shape[0] == BATCH for leaf in jax.tree.leaves(batch))

    losses = []
    for _ in range(3):
        new_state, metrics = step(state, batch)
        assert jax.tree.structure(new_state) == jax.tree.structure(state)
        assert _shapes(new_state) == _shapes(state)
        state = new_state
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)), losses
    # Same batch every step, so the optimizer must make progress on it.
    assert losses[2] < losses[0], losses
    assert int(state["step"]) == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_train_step_traces_from_abstract_values(family):
    spec = get_model(family, "tiny", BATCH)
    jaxpr = jax.make_jaxpr(spec.train_step)(spec.abstract_state(), spec.abstract_batch())
    assert len(jaxpr.eqns) > 10
    invars = jax.tree.leaves((spec.abstract_state(), spec.abstract_batch()))
    assert len(jaxpr.jaxpr.invars) == len(invars)


@pytest.mark.parametrize("family", ["convnet", "wresnet"])
def test_batch_norm_statistics_are_updated(family):
    _, state, batch, step = _tiny(family)
    new_state, _ = step(state, batch)
    assert jax.tree.leaves(state["model_state"]), "expected BatchNorm running stats in model_state"
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), state["model_state"], new_state["model_state"])
    assert all(jax.tree.leaves(changed)), changed


def test_gpt_scan_matches_unrolled():
    unrolled, state, batch, step = _tiny("gpt")
    scanned, _, _, scan_step = _tiny("gpt_scan")
    stacked = gpt.stack_block_params(state["params"])
    scan_state = {**state, "params": stacked, "opt_state": scanned.optimizer.init(stacked)}
    assert _shapes(scan_state) == _shapes(scanned.abstract_state())

    new_state, metrics = step(state, batch)
    new_scan_state, scan_metrics = scan_step(scan_state, batch)
    np.testing.assert_allclose(metrics["loss"], scan_metrics["loss"], rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=2e-4),
        gpt.stack_block_params(new_state["params"]),
        new_scan_state["params"],
    )


@pytest.mark.parametrize(
    ("family", "config", "expected"),
    [("gpt", "350M", 350e6), ("gpt_scan", "125M", 125e6), ("moe", "380M", 380e6), ("wresnet", "250M", 250e6)],
)
def test_large_config_is_abstract(family, config, expected):
    spec = get_model(family, config, batch_size=8)
    abstract = spec.abstract_state()
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    assert abs(spec.num_params() - expected) / expected < 0.1, spec.num_params()


def test_top2_gating_respects_capacity():
    gates = jax.nn.softmax(jax.random.normal(jax.random.key(0, impl="rbg"), (3, 16, 4)), axis=-1)
    combine, dispatch, aux = moe.top2_gating(gates, capacity=3)
    assert combine.shape == dispatch.shape == (3, 16, 4, 3)
    assert float(dispatch.sum(axis=1).max()) <= 1  # a buffer slot holds at most one token
    assert float(dispatch.sum(axis=(2, 3)).max()) <= 2  # a token goes to at most two experts
    assert float(combine.sum(axis=(2, 3)).max()) <= 1 + 1e-6
    assert np.isfinite(float(aux))

    # With room for every token, each token reaches both its experts and its weights sum to 1.
    combine, dispatch, _ = moe.top2_gating(gates, capacity=32)
    np.testing.assert_array_equal(dispatch.sum(axis=(2, 3)), 2)
    np.testing.assert_allclose(combine.sum(axis=(2, 3)), 1, rtol=1e-5)


def test_get_model_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown model family 'bert'"):
        get_model("bert", "tiny", 8)
    with pytest.raises(ValueError, match="unknown gpt config '7B'"):
        get_model("gpt", "7B", 8)
