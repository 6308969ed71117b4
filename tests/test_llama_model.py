"""The Llama decoder of the model zoo (benchmarks/models/llama.py): it trains, it counts, it shards."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from benchmarks.models import get_model, llama, param_count

BATCH = 4
# These tests check the math, not the speed: skip XLA's backend optimizations to compile faster.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _jit(fn):
    return jax.jit(fn, compiler_options=FAST_COMPILE)


@functools.cache
def _tiny(**kwargs):
    """(spec, initial state, batch) of the fp32 tiny model; RBG keys, as threefry compiles slowly on CPU."""
    spec = get_model("llama", "tiny", BATCH, dtype=jnp.float32, **kwargs)
    state = _jit(spec.init_state)(jax.random.key(0, impl="rbg"))
    batch = _jit(spec.make_batch)(jax.random.key(1, impl="rbg"))
    return spec, state, batch


@functools.cache
def _reference_step():
    """One ``jax.jit`` train step of the plain fp32 tiny model: (new state, loss)."""
    spec, state, batch = _tiny()
    new_state, metrics = _jit(spec.train_step)(state, batch)
    return new_state, float(metrics["loss"])


def _kv_kernel(params, layer=0):
    attention = params["layers"][layer]["attention"]
    return attention["wk"]["kernel"], attention["wv"]["kernel"]


def test_tiny_trains_from_a_uniform_start():
    _, state, _ = _tiny()
    new_state, loss = _reference_step()
    assert np.isfinite(loss)
    # Small initial logits: the first loss is close to a uniform guess over the vocabulary.
    assert abs(loss - math.log(llama.CONFIGS["tiny"].vocab_size)) < 0.5, loss
    assert int(new_state["step"]) == 1
    assert {x.dtype for x in jax.tree.leaves(state["params"])} == {jnp.dtype(jnp.float32)}


def test_bf16_compute_keeps_fp32_params_and_logits():
    spec = get_model("llama", "tiny", BATCH)  # dtype defaults to bf16
    state = spec.abstract_state()
    assert {x.dtype for x in jax.tree.leaves(state["params"])} == {jnp.dtype(jnp.float32)}
    loss, _ = jax.eval_shape(spec.loss_fn, state, spec.abstract_batch())
    assert loss.dtype == jnp.float32
    jaxpr = jax.make_jaxpr(spec.loss_fn)(state, spec.abstract_batch())
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(e.invars[0].aval.dtype == jnp.bfloat16 for e in dots)


# Meta's published sizes. 70B is built scanned: the same parameters, and building 80 unrolled nnx layers
# three times over (spec, abstract state) takes ~10 s.
@pytest.mark.parametrize(
    ("family", "config", "expected"), [("llama", "llama3-8b", 8.03e9), ("llama_scan", "llama3-70b", 70.6e9)]
)
def test_published_configs_are_abstract_and_count_right(family, config, expected):
    spec = get_model(family, config, batch_size=8)
    state, batch = spec.abstract_state(), spec.abstract_batch()
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((state, batch)))
    assert batch["tokens"].shape == batch["targets"].shape == (8, llama.CONFIGS[config].seq_len)
    count = param_count(state["params"])
    assert abs(count - expected) / expected < 0.01, count


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_grouped_query_attention(num_kv_heads):
    config = llama.LlamaConfig(
        vocab_size=64, seq_len=8, hidden=32, num_layers=1, num_heads=4, num_kv_heads=num_kv_heads, ffn=64
    )
    spec = llama.build(config, 2, dtype=jnp.float32)
    state = _jit(spec.init_state)(jax.random.key(0, impl="rbg"))
    head_dim = config.hidden // config.num_heads
    for kernel in _kv_kernel(state["params"]):
        assert kernel.shape == (config.hidden, num_kv_heads * head_dim)
    assert state["params"]["layers"][0]["attention"]["wq"]["kernel"].shape == (32, 32)
    loss, _ = _jit(spec.loss_fn)(state, _jit(spec.make_batch)(jax.random.key(1, impl="rbg")))
    assert np.isfinite(float(loss))


def test_remat_matches_plain():
    spec, state, batch = _tiny(remat=True)  # the same init: remat changes no parameter
    ref_state, ref_loss = _reference_step()
    new_state, metrics = _jit(spec.train_step)(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), ref_loss, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), new_state["params"], ref_state["params"]
    )


def test_scan_layers_matches_unrolled():
    # Scanned layers are initialised from other keys, so the unrolled init is mapped onto their layout.
    scanned = get_model("llama_scan", "tiny", BATCH, dtype=jnp.float32, remat=True)
    _, state, batch = _tiny()
    stacked = llama.stack_layer_params(state["params"])
    scan_state = {**state, "params": stacked, "opt_state": scanned.optimizer.init(stacked)}
    shapes = functools.partial(jax.tree.map, lambda x: (x.shape, x.dtype))
    assert shapes(scan_state) == shapes(scanned.abstract_state())
    ref_state, ref_loss = _reference_step()
    new_state, metrics = _jit(scanned.train_step)(scan_state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), ref_loss, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5),
        llama.stack_layer_params(ref_state["params"]),
        new_state["params"],
    )


def test_autoshard_matches_jit():
    spec, state, batch = _tiny()
    # autoshard.make_mesh: Auto axes, since jax.make_mesh's default Explicit axes refuse sharding constraints.
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    step = autoshard.parallelize(
        spec.train_step, mesh=mesh, cluster=autoshard.cluster_preset("cpu-sim"), progress=None
    )
    new_state, metrics = step(state, batch)
    ref_state, ref_loss = _reference_step()
    np.testing.assert_allclose(float(metrics["loss"]), ref_loss, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-5),
        new_state["params"],
        ref_state["params"],
    )


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"hidden \(66\) must be divisible by num_heads \(4\)"):
        llama.LlamaConfig(256, 32, 66, 2, 4, 2, 128)
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"):
        llama.LlamaConfig(256, 32, 64, 2, 4, 3, 128)
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        get_model("llama", "tiny", 2, attention_impl="flash")
