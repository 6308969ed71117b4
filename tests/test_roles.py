"""Leaf roles (autoshard.roles): classified once from the argument pytree's types, never from names."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard
from autoshard.roles import classify_leaves

D = 1024
TX = optax.adam(1e-3)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    """Attribute paths (``.mu_proj``): the old substring test took ``.mu`` for Adam's moment."""

    mu_proj: jax.Array
    w: jax.Array


def _loss(p: Params, x):
    return jnp.mean(jnp.tanh(x @ p.mu_proj) @ p.w)


def _adam_step(state, x):
    params, opt = state  # a plain tuple: no "opt_state" anywhere in the paths
    loss, grads = jax.value_and_grad(_loss)(params, x)
    updates, opt = TX.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), loss


def _abstract(d=D):
    sd = jax.ShapeDtypeStruct
    params = Params(sd((d, d), jnp.float32), sd((d, d), jnp.float32))
    return (params, jax.eval_shape(TX.init, params)), sd((32, d), jnp.float32)


def _roles(plan) -> dict[str, str]:
    return dict(zip(plan.in_paths, plan.in_roles, strict=True))


@pytest.fixture(scope="module")
def mesh():
    return autoshard.make_mesh((8,), ("data",))


def test_optax_state_is_optimizer_state_under_any_container_and_mu_proj_is_a_parameter(mesh):
    state, x = _abstract(64)
    plan = autoshard.parallelize(_adam_step, mesh=mesh).plan(state, x)
    roles = _roles(plan)
    assert roles["[0][0].mu_proj"] == roles["[0][0].w"] == "parameter"
    for moment in ("mu", "nu"):
        for name in ("mu_proj", "w"):
            assert roles[f"[0][1][0].{moment}.{name}"] == "optimizer_state"
    assert roles["[0][1][0].count"] == "optimizer_state"
    assert roles["[1]"] == "input"
    assert autoshard.Plan.from_json(plan.to_json()).in_roles == plan.in_roles


def test_structure_dtype_and_carrying_decide_the_rest():
    sd = jax.ShapeDtypeStruct
    args = ({"w": sd((4,), jnp.float32), "step": sd((), jnp.int32), "batch_stats": {"mean": sd((4,), jnp.float32)}},
            jax.eval_shape(lambda: jax.random.key(0)), sd((2, 4), jnp.float32))
    paths = ("[0]['batch_stats']['mean']", "[0]['step']", "[0]['w']", "[1]", "[2]")
    assert classify_leaves(args, paths, carried={0, 1, 2, 3}) == (
        "model_state", "other", "parameter", "rng_key", "input")


def _momentum_step(state, x):
    grads = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"])))(state["params"])
    momentum = jax.tree.map(lambda m, g: 0.9 * m + g, state["momentum"], grads)
    params = jax.tree.map(lambda p, m: p - 0.1 * m, state["params"], momentum)
    return {"params": params, "momentum": momentum}


def test_an_optimizer_that_is_not_optax_is_named_by_state_roles(mesh):
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    state, x = {"params": {"w": w}, "momentum": {"w": w}}, jax.ShapeDtypeStruct((32, 64), jnp.float32)
    plain = autoshard.parallelize(_momentum_step, mesh=mesh).plan(state, x)
    assert _roles(plain)["[0]['momentum']['w']"] == "parameter"  # nothing says otherwise: carried state
    named = autoshard.parallelize(_momentum_step, mesh=mesh, state_roles={r"\['momentum'\]": "optimizer_state"})
    roles = _roles(named.plan(state, x))
    assert roles["[0]['momentum']['w']"] == "optimizer_state"
    assert roles["[0]['params']['w']"] == "parameter"


def test_a_state_role_that_is_not_a_role_is_refused(mesh):
    w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    step = autoshard.parallelize(_momentum_step, mesh=mesh, state_roles={"momentum": "optimiser"})
    with pytest.raises(autoshard.InputError, match="'optimiser' is not a leaf role.*Fix:"):
        step.plan({"params": {"w": w}, "momentum": {"w": w}}, jax.ShapeDtypeStruct((4, 8), jnp.float32))


def test_offload_moves_only_optimizer_state_and_matches_reference(mesh):
    """Sharding alone does not fit 4.5 MB per device (about 4 MB of Adam state); offload moves moments only."""
    state, x = _abstract()
    step = autoshard.parallelize(_adam_step, mesh=mesh, cluster=autoshard.cluster_preset("h100-nvlink"),
                                 memory_budget=4.5e6, donate_argnums=(0,), remat=False, accumulate=False)
    plan = step.plan(state, x)
    roles = _roles(plan)
    assert plan.offloaded and {roles[p] for p in plan.offloaded} == {"optimizer_state"}
    assert "[0][0].mu_proj" not in plan.offloaded
    assert {jax.tree.leaves(plan.in_shardings)[i].memory_kind for i in plan.host_inputs} == {"pinned_host"}
    keys = jax.random.split(jax.random.key(0), 3)
    params = Params(*(jax.random.normal(k, (D, D), jnp.float32) / 32 for k in keys[:2]))
    real = ((params, TX.init(params)), jax.random.normal(keys[2], (32, D), jnp.float32))
    (ref_state, ref_loss) = jax.jit(_adam_step)(*real)
    (out_state, loss) = step(jax.tree.map(np.asarray, real[0]), real[1])
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(out_state), jax.tree.leaves(ref_state), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_nnx_optimizer_state_and_batch_of_an_in_place_step(mesh):
    from flax import nnx

    def train_step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    roles = _roles(autoshard.parallelize(train_step, mesh=mesh).plan(model, optimizer, jnp.ones((8, 4))))
    assert roles["[0]['kernel'].value"] == "parameter"
    assert roles["[1]['opt_state'][0]['mu']['kernel'].value"] == "optimizer_state"
    assert roles["[1]['step'].value"] == "optimizer_state"  # nnx.OptState, as nnx.Optimizer keeps it
    assert roles["[2]"] == "input"  # handed back unchanged with the objects' state: not carried
