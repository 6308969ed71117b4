"""Mixed precision: precision="bf16" computes matmuls in bf16 (fp32 accumulation) and keeps fp32 master state."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.cost import CostModel
from autoshard.precision import cast_matmuls
from autoshard.spec import MeshInfo, ShardingSpec
from benchmarks.models import get_model
from tests.helpers import assert_trees_close, mesh, run_steps

CASES = [("mlp", "tiny", 8, "2x4"), ("gpt", "tiny", 8, "2x4")]


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


_DEF = re.compile(r"^\s*(%\w+) = (\S+) (%\w+)(.*)$", re.M)
_DOT = re.compile(r"stablehlo\.dot_general (%\w+), (%\w+),.*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)")


def _read_as_bf16(text: str, name: str) -> bool:
    """Whether a value reaches its reader through a bf16 -> f32 convert (layout constraints looked through)."""
    defs = {m.group(1): (m.group(2), m.group(3), m.group(4)) for m in _DEF.finditer(text)}
    while name in defs:
        op, src, rest = defs[name]
        if op == "stablehlo.convert":
            return "xbf16>) ->" in rest
        if op != "sdy.sharding_constraint":
            return False
        name = src
    return False


@pytest.mark.parametrize("family,config,batch,mesh_name", CASES, ids=[c[0] for c in CASES])
def test_bf16_matches_the_cast_reference_and_keeps_fp32_state(family, config, batch, mesh_name):
    spec = get_model(family, config, batch)
    step = autoshard.parallelize(spec.train_step, mesh=mesh(mesh_name), cluster=autoshard.cluster_preset("cpu-sim"),
                                 precision="bf16")
    state, b = spec.init_state(jax.random.key(0)), spec.make_batch(jax.random.key(1))
    # The reference: the same casts, on one device (in the CPU form, see autoshard.precision).
    ref_state, ref_losses = run_steps(jax.jit(cast_matmuls(spec.train_step, widen=True)), state, b)
    out_state, losses = run_steps(step, state, b)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # The sharded step sums in another order, and a 1-ulp fp32 difference sometimes rounds to a
    # different bf16 value. That stays below 5e-5 everywhere but in attention's key bias: its exact
    # gradient is zero (softmax ignores a per-query shift of the logits), so Adam turns the noise
    # into steps of up to the learning rate (1e-3), here measured at 2.5e-4.
    for (path, a), e in zip(jax.tree_util.tree_flatten_with_path(out_state["params"])[0],
                            jax.tree.leaves(ref_state["params"]), strict=True):
        noise_only = "['key']['bias']" in jax.tree_util.keystr(path)
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-3 if noise_only else 5e-5,
                                   err_msg=jax.tree_util.keystr(path))
    # Master weights and optimizer state stay fp32.
    assert {x.dtype for x in jax.tree.leaves(out_state["params"])} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(out_state["opt_state"]) if x.ndim} == {jnp.dtype(jnp.float32)}
    # Close to fp32, not equal: bf16 keeps 8 bits of mantissa (relative rounding 2^-9 per operand).
    fp32_state, fp32_losses = run_steps(jax.jit(spec.train_step), state, b)
    np.testing.assert_allclose(losses, fp32_losses, rtol=2e-2)
    assert not np.allclose(losses, fp32_losses, rtol=1e-7, atol=0)
    assert_trees_close(out_state["params"], fp32_state["params"], rtol=0, atol=2e-2, what="params vs fp32")


def test_bf16_rewrites_scan_bodies():
    """Layers under lax.scan: the body's matmuls are cast too. SGD (momentum), because Adam's first
    steps are lr * sign(g), which turns bf16 rounding noise into +-lr wherever g is near zero."""
    spec = get_model("gpt_scan", "tiny", 8, optimizer="sgd")
    state, b = spec.init_state(jax.random.key(0)), spec.make_batch(jax.random.key(1))
    jaxpr = str(jax.make_jaxpr(cast_matmuls(spec.train_step))(state, b))
    assert "scan[" in jaxpr
    assert jaxpr.count("= dot_general[") == jaxpr.count("preferred_element_type=float32") > 10
    step = autoshard.parallelize(spec.train_step, mesh=mesh("2x4"), cluster=autoshard.cluster_preset("cpu-sim"),
                                 precision="bf16")
    ref_state, ref_losses = run_steps(jax.jit(cast_matmuls(spec.train_step, widen=True)), state, b)
    out_state, losses = run_steps(step, state, b)
    # Another summation order sometimes rounds to another bf16 value: ~6e-6 relative on the second loss.
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert_trees_close(out_state["params"], ref_state["params"], atol=5e-5, what="params")


def test_every_dot_reads_bf16_rounded_operands_on_cpu():
    spec = get_model("gpt", "tiny", 8)
    step = autoshard.parallelize(spec.train_step, mesh=mesh("2x4"), cluster=autoshard.cluster_preset("cpu-sim"),
                                 precision="bf16")
    text = step.lower(spec.abstract_state(), spec.abstract_batch()).as_text()
    dots = _DOT.findall(text)
    assert len(dots) > 10
    assert all(_read_as_bf16(text, a) and _read_as_bf16(text, b) for a, b, *_ in dots)


def test_every_dot_takes_bf16_operands_where_the_backend_has_mixed_dots(monkeypatch):
    """The GPU/TPU form: bf16 x bf16 -> f32 dots in the program handed to XLA.

    Only lowered here: XLA:CPU compiles it but cannot run its unfused bf16 dots."""
    monkeypatch.setattr("autoshard.precision.widen_operands", lambda platform: False)
    spec = get_model("gpt", "tiny", 8)
    step = autoshard.parallelize(spec.train_step, mesh=mesh("2x4"), cluster=autoshard.cluster_preset("cpu-sim"),
                                 precision="bf16")
    dots = _DOT.findall(step.lower(spec.abstract_state(), spec.abstract_batch()).as_text())
    assert len(dots) > 10 and all("bf16" in a and "bf16" in b and "f32" in out for *_, a, b, out in dots)


def test_collective_bytes_follow_the_dtype():
    """bf16 values cost bf16 bytes where collectives carry bf16; XLA:CPU widens them to f32, priced so."""
    def layer(w, x):
        return jnp.tanh(x @ w)

    m = autoshard.make_mesh((8,), ("data",))
    w, x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)
    # Pinned row layouts force an all-gather of the weight.
    step = autoshard.parallelize(layer, mesh=m, hints={r"\[0\]": P("data", None), r"\[1\]": P("data", None)})
    check = step.plan(w, x).verify(step.lower(w, x).compile())
    assert check.predicted == check.compiled == {"all-gather": 4 * 2**20}
    gpu = CostModel.create(MeshInfo.from_mesh(m), autoshard.cluster_preset("h100-nvlink"), platform="gpu")
    src, dst = ShardingSpec(((0,), ())), ShardingSpec(((), ()))  # rows over mesh axis 0 -> replicated
    (_, (bf16,)), (_, (fp32,)) = gpu.reshard((1024, 1024), 2, src, dst), gpu.reshard((1024, 1024), 4, src, dst)
    assert bf16.bytes == fp32.bytes / 2 == 2 * 2**20


def test_unknown_precision_is_a_clear_error():
    with pytest.raises(autoshard.InputError, match=r"precision='fp8' is not supported.*precision='bf16'"):
        autoshard.parallelize(lambda x: x, precision="fp8")


def test_precision_with_a_pipeline_is_a_clear_error():
    with pytest.raises(autoshard.InputError, match="precision= is not supported with num_microbatches"):
        autoshard.parallelize(lambda x: x, num_microbatches=2, precision="bf16")
