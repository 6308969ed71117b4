"""Plans that respect what the mesh axes mean, and ``Plan.explain``.

- A batch axis (``data``, ``batch``, ...) carries the batch: checked on a small LLaMA on (2, 4)
  whose cheapest plan, read without the names, puts the batch on ``model`` (4) and makes the MLP
  tensor-parallel over ``data`` (2). The batch follows the name, not the position, and a hint
  that pins the batch elsewhere wins.
- A batch that no mesh axis divides is named in one warning.
- ``plan.explain(path)`` compares the chosen layout with the best plan for each other layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.errors import PlanError
from autoshard.intent import is_batch_axis
from autoshard.spec import candidate_specs
from tests.helpers import assert_trees_close

CPU = autoshard.cluster_preset("cpu-sim")


# ---- a small LLaMA: RMSNorm, rotary positions, grouped-query attention, SwiGLU -------------------
def _llama_params(seed, *, vocab, hidden, layers, heads, kv_heads, ffn):
    hd = hidden // heads
    rng = np.random.default_rng(seed)  # numpy: eager jax.random would compile a kernel per shape

    def w(shape):
        return jnp.asarray(0.02 * rng.standard_normal(shape), jnp.float32)

    blocks = [{"attn_norm": jnp.ones((hidden,)), "wq": w((hidden, heads * hd)), "wk": w((hidden, kv_heads * hd)),
               "wv": w((hidden, kv_heads * hd)), "wo": w((heads * hd, hidden)), "mlp_norm": jnp.ones((hidden,)),
               "w_gate": w((hidden, ffn)), "w_up": w((hidden, ffn)), "w_down": w((ffn, hidden))}
              for _ in range(layers)]
    return {"embed": w((vocab, hidden)), "blocks": blocks, "norm": jnp.ones((hidden,)),
            "lm_head": w((hidden, vocab))}


def _rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _rope(x):
    s, d = x.shape[1], x.shape[-1]
    freqs = 1.0 / (10000 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angle = jnp.arange(s, dtype=jnp.float32)[:, None] * freqs[None]
    cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


def _llama(params, tokens, *, heads, kv_heads):
    b, s = tokens.shape
    h = params["embed"][tokens]
    hd = h.shape[-1] // heads
    causal = jnp.tril(jnp.ones((s, s), bool))
    for blk in params["blocks"]:
        x = _rms_norm(h, blk["attn_norm"])
        q = _rope((x @ blk["wq"]).reshape(b, s, heads, hd))
        k = _rope((x @ blk["wk"]).reshape(b, s, kv_heads, hd))
        v = (x @ blk["wv"]).reshape(b, s, kv_heads, hd)
        k, v = (jnp.repeat(t, heads // kv_heads, axis=2) for t in (k, v))
        att = jax.nn.softmax(jnp.where(causal, jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd), -1e9), axis=-1)
        h = h + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, -1) @ blk["wo"]
        x = _rms_norm(h, blk["mlp_norm"])
        h = h + (jax.nn.silu(x @ blk["w_gate"]) * (x @ blk["w_up"])) @ blk["w_down"]
    return _rms_norm(h, params["norm"]) @ params["lm_head"]


def llama(*, vocab=256, hidden=128, layers=1, heads=4, kv_heads=2, batch=8, seq=8):
    """(state, batch, train_step) of a LLaMA-style decoder trained with SGD and momentum (Adam's first
    step, g / |g|, would make a weight with a tiny gradient as noisy as the reduction order)."""
    tx = optax.sgd(0.1, momentum=0.9)

    def train_step(state, batch_):
        def loss_fn(params):
            logits = _llama(params, batch_["tokens"], heads=heads, kv_heads=kv_heads)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch_["targets"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}

    params = _llama_params(0, vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                           ffn=4 * hidden)
    seqs = jnp.asarray(np.random.default_rng(1).integers(0, vocab, (batch, seq + 1)), jnp.int32)
    return {"params": params, "opt": tx.init(params)}, {"tokens": seqs[:, :-1], "targets": seqs[:, 1:]}, train_step


def _specs(plan) -> dict[str, tuple]:
    """path -> PartitionSpec entries (trailing Nones dropped) of every argument leaf."""
    out = {}
    for path, spec in zip(plan.in_paths, plan.in_specs, strict=True):
        out[path] = tuple(spec.to_partition_spec(plan.mesh_info))
    return out


def _names(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _compiled_spec(compiled, plan, path: str) -> tuple:
    """The PartitionSpec XLA compiled for one argument leaf (the step is jitted over flat leaves)."""
    shardings = jax.tree.leaves(compiled.input_shardings[0])
    return tuple(shardings[plan.in_paths.index(path)].spec)


# ---- a batch axis carries the batch --------------------------------------------------------------
@pytest.mark.parametrize("names", [("data", "model"), ("batch", "model"), ("model", "data")])
def test_the_batch_follows_the_batch_axis_name(names):
    """Read without the names, the cheapest plan on (2, 4) puts the batch on the 4-way axis and the
    MLP on the 2-way one. The batch must go on the axis named like a batch axis, wherever it is,
    and the MLP kernels on the other."""
    batch_axis = next(n for n in names if is_batch_axis(n))
    model_axis = next(n for n in names if n != batch_axis)
    state, batch, train_step = llama()
    mesh = autoshard.make_mesh((2, 4), names)
    step = autoshard.parallelize(train_step, mesh=mesh, cluster=CPU, progress=None)
    plan = step.plan(state, batch)
    specs = _specs(plan)
    for leaf in ("tokens", "targets"):
        lead = _names(specs[f"[1]['{leaf}']"][0]) if specs[f"[1]['{leaf}']"] else ()
        assert not lead or batch_axis in lead, f"{leaf} batch dimension on {lead}, not on {batch_axis!r}"
    assert batch_axis in _names((specs["[1]['targets']"] or (None,))[0]), specs["[1]['targets']"]
    for kernel, dim in (("w_gate", 1), ("w_up", 1), ("w_down", 0)):
        entries = specs[f"[0]['params']['blocks'][0]['{kernel}']"]
        on = _names(entries[dim]) if len(entries) > dim else ()
        assert model_axis in on and batch_axis not in on, f"{kernel}: {entries}"
    if names == ("data", "model"):  # once: what XLA compiled, and the numbers against jax.jit
        compiled = step.lower(state, batch).compile()
        targets = _compiled_spec(compiled, plan, "[1]['targets']")
        assert targets and batch_axis in _names(targets[0]), f"compiled targets sharding {targets}"
        gate = _compiled_spec(compiled, plan, "[0]['params']['blocks'][0]['w_gate']")
        assert len(gate) == 2 and _names(gate[1]) == (model_axis,), f"compiled w_gate sharding {gate}"
        ref_state, ref_metrics = jax.jit(train_step)(state, batch)
        out_state, metrics = step(state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
        assert_trees_close(out_state["params"], ref_state["params"], rtol=1e-5, atol=1e-6, what="params")


def test_a_pinned_batch_wins_over_the_axis_names():
    state, batch, train_step = llama(hidden=64)
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    plan = autoshard.parallelize(train_step, mesh=mesh, cluster=CPU, progress=None,
                                 hints={r"^\[1\]": P("model")}).plan(state, batch)
    specs = _specs(plan)
    assert specs["[1]['tokens']"] == ("model",) and specs["[1]['targets']"] == ("model",)


def test_axis_names_that_mean_the_batch():
    assert all(map(is_batch_axis, ("data", "DATA", "batch", "dp", "fsdp", "data_parallel", "replica")))
    assert not any(map(is_batch_axis, ("model", "tensor", "tp", "mp", "pipe", "expert", "seq")))


# ---- a batch that no axis divides -----------------------------------------------------------------
def _mlp_step():
    tx = optax.adam(1e-3)

    def step(state, batch):
        def loss(w):
            return jnp.mean((jnp.tanh(batch["x"] @ w["w1"]) @ w["w2"] - batch["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": value}

    params = {"w1": 0.1 * jax.random.normal(jax.random.key(0), (64, 64)),
              "w2": 0.1 * jax.random.normal(jax.random.key(1), (64, 8))}
    return step, {"params": params, "opt": tx.init(params)}


def test_an_indivisible_batch_is_named_in_one_warning():
    step_fn, state = _mlp_step()
    batch = {"x": jnp.ones((3, 64)), "y": jnp.ones((3, 8))}
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    step = autoshard.parallelize(step_fn, mesh=mesh, cluster=CPU, progress=None)
    with pytest.warns(autoshard.AutoshardWarning, match=r"size 3 in \[1\]\['x'\], \[1\]\['y'\].*data=2, model=4") \
            as record:
        step.plan(state, batch)
    assert sum("divisible by no mesh axis" in str(w.message) for w in record) == 1


def test_a_batch_of_one_sequence_is_not_warned_about():
    """One sequence per step (long context) has no batch to split: no warning says every device runs it whole."""
    import warnings

    step_fn, state = _mlp_step()
    batch = {"x": jnp.ones((1, 64)), "y": jnp.ones((1, 8))}
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        autoshard.parallelize(step_fn, mesh=mesh, cluster=CPU, progress=None).plan(state, batch)
    assert not [w for w in record if "is not split" in str(w.message)]


def test_a_batch_only_a_model_axis_divides_is_named_too():
    step_fn, state = _mlp_step()
    batch = {"x": jnp.ones((2, 64)), "y": jnp.ones((2, 8))}
    mesh = autoshard.make_mesh((4, 2), ("data", "model"))
    with pytest.warns(autoshard.AutoshardWarning, match=r"size 2 in \[1\]\['x'\].*no batch axis \(data=4\); model=2"):
        plan = autoshard.parallelize(step_fn, mesh=mesh, cluster=CPU, progress=None).plan(state, batch)
    x = _specs(plan)["[1]['x']"]
    assert not x or x[0] is None, f"the batch went onto {x[0]}, which is not a batch axis"


def test_weights_passed_beside_the_batch_are_told_apart_by_their_role():
    """Three stacked weight copies (leading size 3, the layer count) ride in the batch argument beside x and y (16
    rows): the commonest leading size among the batch argument's leaves would take the copies for the batch.
    ``state_roles`` names them parameters, and the batch is x and y again, which 8 devices divide (a pipeline
    stage's fp8 weight copies in benchmarks.published)."""
    import warnings

    step_fn, state = _mlp_step()
    batch = {"x": jnp.ones((16, 64)), "y": jnp.ones((16, 8)), "w8": {k: jnp.ones((3, 64, 64)) for k in "abc"}}
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    with pytest.warns(autoshard.AutoshardWarning, match=r"size 3 in \[1\]\['w8'\]\['a'\]"):
        autoshard.parallelize(step_fn, mesh=mesh, cluster=CPU, progress=None).plan(state, batch)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        plan = autoshard.parallelize(step_fn, mesh=mesh, cluster=CPU, progress=None,
                                     state_roles={r"\['w8'\]": "parameter"}).plan(state, batch)
    assert not [w for w in record if "is not split" in str(w.message)]
    roles = dict(zip(plan.in_paths, plan.in_roles, strict=True))
    assert roles["[1]['w8']['a']"] == "parameter" and roles["[1]['x']"] == "input"


# ---- plan.explain --------------------------------------------------------------------------------
def _small_plan(**kw):
    step_fn, state = _mlp_step()
    batch = {"x": jnp.ones((16, 64)), "y": jnp.ones((16, 8))}
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    return autoshard.parallelize(step_fn, mesh=mesh, cluster=CPU, progress=None, **kw).plan(state, batch)


def test_explain_compares_the_chosen_layout_with_every_other():
    plan = _small_plan()
    why = plan.explain("params']['w1")  # a unique substring
    assert why.path == "[0]['params']['w1']"
    assert why.chosen.chosen and why.chosen.objective == plan.cost.objective
    layouts = {str(s.to_partition_spec(plan.mesh_info)) for s in candidate_specs((64, 64), plan.mesh_info)}
    assert {o.spec for o in why.options} == layouts
    for alt in why.alternatives:
        assert alt.objective is not None and alt.objective >= why.chosen.objective * (1 - 1e-9), alt
    text = str(why)
    assert all(o.spec in text for o in why.options)
    assert "[0]['opt'][0].mu['w1']" in text  # the moments' layouts are shown beside the kernel's
    assert "<table" in why._repr_html_()


def test_explain_says_zero1_when_a_kernel_is_whole_and_its_moments_are_split():
    plan = _small_plan(hints={r"params'\]\['w1'\]$": P(), r"(mu|nu)\['w1'\]$": P(None, "data")})
    why = plan.explain("[0]['params']['w1']", layouts=[P("model")])
    assert [o.spec for o in why.options] == [str(P()), str(P("model"))]
    assert "ZeRO-1" in why.verdict and "moments are split" in why.verdict, why.verdict


def test_explain_errors_name_the_fix():
    plan = _small_plan()
    with pytest.raises(PlanError, match=r"(?s)matches 3 argument leaves.*mu\['w2'\]"):
        plan.explain("w2")
    with pytest.raises(PlanError, match=r"(?s)names no argument leaf.*\[0\]\['params'\]\['w1'\]"):
        plan.explain("[0]['params']['w9']")
    loaded = autoshard.Plan.from_json(plan.to_json(), mesh=plan.mesh)
    with pytest.raises(PlanError, match="(?s)Plan.from_json.*Fix"):
        loaded.explain("[0]['params']['w1']")


# ---- wide models, small batch --------------------------------------------------------------------
@pytest.mark.slow  # plans and compiles a hidden-1024 GPT: 10-30 s
def test_wide_gpt_puts_the_mlp_on_model_and_the_batch_on_data():
    """Hidden 1024, 32 x 64 tokens, on (2, 4): the MLP kernels are split on `model` (Megatron) and the
    batch on `data` in what XLA compiled. (At a few hundred tokens the cheapest plan, also by XLA's
    compiled bytes, is tensor parallelism over both axes with the batch whole; the rule allows it.)"""
    from benchmarks.models import gpt

    config = gpt.GPTConfig(vocab_size=8192, seq_len=64, hidden=1024, num_layers=2, num_heads=16)
    spec = gpt.build(config, 32)
    state, batch = spec.abstract_state(), spec.abstract_batch()
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    step = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=CPU, progress=None, solver_time_limit=30)
    plan = step.plan(state, batch)
    compiled = step.lower(state, batch).compile()
    for i in range(config.num_layers):
        fc = _compiled_spec(compiled, plan, f"[0]['params']['blocks'][{i}]['mlp']['fc']['kernel']")
        proj = _compiled_spec(compiled, plan, f"[0]['params']['blocks'][{i}]['mlp']['proj']['kernel']")
        assert len(fc) == 2 and _names(fc[1]) == ("model",) and proj and _names(proj[0]) == ("model",), (fc, proj)
    targets = _compiled_spec(compiled, plan, "[1]['targets']")
    assert targets and "data" in _names(targets[0]), targets
