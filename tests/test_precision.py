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


BF16_ULP = 2.0**-8  # bf16 keeps 8 bits of significand: one unit in the last place, relative


def _assert_updates_within_bf16_ulps(params, ref, start, ulps=4):
    """The sharded step's parameter updates equal the reference's up to bf16 rounding.

    The sharded program sums in another order, so an fp32 value that feeds a matmul can differ by an
    fp32 ulp and then round to the neighbouring bf16 value. A gradient is a sum of such products, so
    its error is a few bf16 ulps of the products' scale: the largest update among the leaves of the
    same module (a bias whose exact gradient is zero, like attention's key bias, carries only that
    noise). SGD keeps updates linear in the gradients; Adam's first steps are lr * sign(g), which
    turns that noise into +-lr wherever g is near zero.
    """
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    d_out = {jax.tree_util.keystr(p): np.asarray(a) - np.asarray(s)
             for (p, a), s in zip(flat, jax.tree.leaves(start), strict=True)}
    d_ref = {jax.tree_util.keystr(p): np.asarray(e) - np.asarray(s)
             for (p, _), e, s in zip(flat, jax.tree.leaves(ref), jax.tree.leaves(start), strict=True)}
    module = {k: k[:k.rfind("[")] for k in d_ref}
    scale = {}
    for k, d in d_ref.items():
        scale[module[k]] = max(scale.get(module[k], 0.0), float(np.max(np.abs(d), initial=0.0)))
    for k, d in d_ref.items():
        np.testing.assert_allclose(d_out[k], d, rtol=0, atol=ulps * BF16_ULP * scale[module[k]], err_msg=k)


@pytest.mark.parametrize("family,config,batch,mesh_name", CASES, ids=[c[0] for c in CASES])
def test_bf16_matches_the_cast_reference_and_keeps_fp32_state(family, config, batch, mesh_name):
    spec = get_model(family, config, batch, optimizer="sgd")
    step = autoshard.parallelize(spec.train_step, mesh=mesh(mesh_name), cluster=autoshard.cluster_preset("cpu-sim"),
                                 precision="bf16")
    state, b = spec.init_state(jax.random.key(0)), spec.make_batch(jax.random.key(1))
    # The reference: the same casts, on one device (in the CPU form, see autoshard.precision).
    ref_state, ref_losses = run_steps(jax.jit(cast_matmuls(spec.train_step, widen=True)), state, b)
    out_state, losses = run_steps(step, state, b)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_updates_within_bf16_ulps(out_state["params"], ref_state["params"], state["params"])
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


def test_a_bf16_dots_partial_sums_are_reduced_in_f32_on_cpu():
    """A dot whose contracting dimension is split leaves partial sums to all-reduce; XLA:CPU promotes a bf16
    all-reduce to f32 (its reduction computation ``*.clone_promoted``), so the plan prices it at 4 bytes an
    element there, as it compiles."""
    def layer(w, x):
        return jnp.tanh(x @ w)

    m = autoshard.make_mesh((8,), ("model",))
    w, x = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((16, 2048), jnp.bfloat16)
    # The contracting dimension split on both operands: the small product is a partial sum over the mesh, far
    # cheaper to all-reduce than the weight to gather.
    step = autoshard.parallelize(layer, mesh=m, hints={r"\[0\]": P("model", None), r"\[1\]": P(None, "model")})
    plan = step.plan(w, x)
    compiled = step.lower(w, x).compile()
    check = plan.verify(compiled)
    assert check.compiled.get("all-reduce") == 16 * 2048 * 4  # the product, f32, whole on every device
    assert check.predicted == check.compiled


def test_unknown_precision_is_a_clear_error():
    with pytest.raises(autoshard.InputError, match=r"precision='fp8' is not supported.*precision='bf16'"):
        autoshard.parallelize(lambda x: x, precision="fp8")


def test_precision_with_a_pipeline_is_taken():
    # Honoured by the pipelined runtime (numerics: tests/test_frontend.py, bf16 like the single program).
    assert autoshard.parallelize(lambda x: x, num_microbatches=2, precision="bf16").options.precision == "bf16"


def _zeros_of(x, n):
    return jnp.zeros((3, n)) + x.sum()


def test_a_tracing_error_under_bf16_names_the_step_and_its_argument():
    """precision="bf16" traces the step through its cast; a tracing error still names the user's function
    and argument, not the cast's wrapper."""
    step = autoshard.parallelize(_zeros_of, precision="bf16", progress=None)
    with pytest.raises(TypeError) as info:
        step(jnp.ones(4), 5)
    message = "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])
    assert "_zeros_of" in message and "argument n" in message
    assert "cast_fun" not in message and "<lambda>" not in message
