"""autoshard with the libraries a train step is written in: flax nnx and linen, optax, orbax.

Also ``apply_plan`` (placing an existing state on a plan's shardings) and user hints as
they reach the compiled program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.errors import PlanError
from tests.helpers import assert_trees_close
from tests.helpers import mesh as make_test_mesh

optax = pytest.importorskip("optax")
flax = pytest.importorskip("flax")


def _batch(n=32, d_in=32, d_out=16):
    return {
        "x": jax.random.normal(jax.random.key(1), (n, d_in)),
        "y": jax.random.normal(jax.random.key(2), (n, d_out)),
    }


def _same(sharding, spec, *, ndim):
    return sharding.is_equivalent_to(NamedSharding(sharding.mesh, spec), ndim)


# ---- flax nnx: split the module, pass its State, merge inside the step ---------------------------------


def _nnx_setup():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(32, 128, rngs=rngs)
            self.fc2 = nnx.Linear(128, 16, rngs=rngs)

        def __call__(self, x):
            return self.fc2(jax.nn.relu(self.fc1(x)))

    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    tx = optax.adamw(1e-2)

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            return jnp.mean((nnx.merge(graphdef, p)(batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return graphdef, train_step, params, tx.init(params)


def test_nnx_state_in_and_out_matches_jit():
    from flax import nnx

    graphdef, train_step, params, opt_state = _nnx_setup()
    step = autoshard.parallelize(train_step, mesh=make_test_mesh("2x4"))
    batch = _batch()
    out = step(params, opt_state, batch)
    ref = jax.jit(train_step)(params, opt_state, batch)
    assert isinstance(out[0], nnx.State)
    np.testing.assert_allclose(out[2], ref[2], rtol=1e-6)
    assert_trees_close(out[0], ref[0], what="params")
    model = nnx.merge(graphdef, out[0])  # the sharded State merges back into a module
    assert model.fc1.kernel[...].sharding.mesh.shape == {"data": 2, "model": 4}

    # apply_plan keeps the nnx.State type and places every leaf on its planned sharding
    plan = step.plan(params, opt_state, batch)
    placed = autoshard.apply_plan(plan, params)
    assert isinstance(placed, nnx.State)
    for leaf, sharding in zip(jax.tree.leaves(placed), jax.tree.leaves(plan.in_shardings[0]), strict=True):
        assert leaf.sharding == sharding


# ---- flax linen TrainState (apply_fn and tx are static fields) and optax.MultiSteps ---------------------


def _linen_setup(every_k=2):
    import flax.linen as nn
    from flax.training import train_state

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.Dense(128)(x))  # Dense_0: kernel (32, 128)
            return nn.Dense(16)(h)  # Dense_1: kernel (128, 16)

    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 32)))["params"]
    tx = optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)), every_k_schedule=every_k
    )
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def train_step(state, batch):
        def loss_fn(p):
            return jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return train_step, state


def test_linen_train_state_with_multisteps_chain_matches_jit():
    from flax.training import train_state

    train_step, state = _linen_setup(every_k=2)
    step = autoshard.parallelize(train_step, mesh=make_test_mesh("2x4"), donate_argnums=(0,))
    batch = _batch()
    ref, ours = state, state
    for _ in range(4):  # two accumulated mini-steps per optimizer update, twice
        ref, ref_metrics = jax.jit(train_step)(ref, batch)
        ours, metrics = step(ours, batch)
        np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    assert isinstance(ours, train_state.TrainState) and ours.apply_fn is state.apply_fn
    assert int(ours.step) == 4 and int(ours.opt_state.gradient_step) == 2
    assert_trees_close(ours.params, ref.params, rtol=1e-5, atol=1e-6, what="params")
    assert_trees_close(ours.opt_state, ref.opt_state, rtol=1e-5, atol=1e-6, what="opt_state")


# ---- orbax: save a sharded state, restore onto the plan's shardings, and onto a re-planned mesh ------


def test_orbax_round_trip_and_restore_onto_another_mesh(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    train_step, state = _linen_setup(every_k=1)
    batch = _batch()
    hints = {r"Dense_0'\]\['kernel": P(None, "model")}  # a leaf whose layout differs between the meshes
    step_a = autoshard.parallelize(train_step, mesh=make_test_mesh("2x4"), hints=hints)
    trained, _ = step_a(state, batch)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "step1", trained)
    abstract = jax.eval_shape(lambda: state)

    # Same mesh: the restore target is the plan's shardings, as ShapeDtypeStructs.
    plan_a = step_a.plan(state, batch)
    target_a = autoshard.apply_plan(plan_a, abstract)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(target_a))
    with ocp.StandardCheckpointer() as ckpt:
        restored_a = ckpt.restore(tmp_path / "step1", target_a)
    assert_trees_close(restored_a, trained, rtol=0, atol=0, what="restored")
    for x, s in zip(jax.tree.leaves(restored_a), jax.tree.leaves(plan_a.in_shardings[0]), strict=True):
        assert x.sharding == s

    # Another mesh shape: re-plan there, restore straight onto the new shardings, keep training.
    step_b = autoshard.parallelize(train_step, mesh=make_test_mesh("4x2"), hints=hints)
    plan_b = step_b.plan(state, batch)
    with ocp.StandardCheckpointer() as ckpt:
        restored_b = ckpt.restore(tmp_path / "step1", autoshard.apply_plan(plan_b, abstract))
    kernel = restored_b.params["Dense_0"]["kernel"]
    assert _same(kernel.sharding, P(None, "model"), ndim=2)
    assert kernel.addressable_shards[0].data.shape == (32, 64)  # 128 split over model=2, not 4
    assert_trees_close(restored_b, trained, rtol=0, atol=0, what="restored")
    ours, metrics = step_b(restored_b, batch)
    ref, ref_metrics = jax.jit(train_step)(trained, batch)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    assert_trees_close(ours.params, ref.params, rtol=1e-5, atol=1e-6, what="params")


# ---- hints reach the compiled program --------------------------------------------------------------------


def test_hint_pins_a_leaf_in_the_compiled_input_shardings():
    train_step, state = _linen_setup(every_k=1)
    batch = _batch()
    pinned = r"params\['Dense_1'\]\['kernel'\]"
    step = autoshard.parallelize(
        train_step,
        mesh=make_test_mesh("2x4"),
        hints={pinned: P("model", None), r"\[1\]\['x'\]": P(None, "data")},
    )
    plan = step.plan(state, batch)
    compiled = step.lower(state, batch).compile()
    by_path = dict(zip(plan.in_paths, compiled.input_shardings[0], strict=True))
    assert _same(by_path["[0].params['Dense_1']['kernel']"], P("model", None), ndim=2)
    assert _same(by_path["[1]['x']"], P(None, "data"), ndim=2)
    # the optimizer's copies of the leaf are free to differ; the pinned leaf is not
    ours, metrics = step(state, batch)
    ref, ref_metrics = jax.jit(train_step)(state, batch)
    assert _same(ours.params["Dense_1"]["kernel"].sharding, P("model", None), ndim=2)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
    assert_trees_close(ours.params, ref.params, rtol=1e-5, atol=1e-6, what="params")


# ---- apply_plan ------------------------------------------------------------------------------------------


def _dict_step(state, x):
    return jax.tree.map(lambda w: w - 0.1 * jnp.mean(x) * w, state), jnp.sum(x @ state["w"])


@pytest.fixture(scope="module")
def dict_plan():
    state = {"w": jnp.ones((16, 32)), "b": jnp.ones((32,))}
    step = autoshard.parallelize(_dict_step, mesh=make_test_mesh("2x4"), hints={r"\['w'\]": P(None, "model")})
    return step.plan(state, jnp.ones((8, 16)))


def test_apply_plan_places_host_arrays_and_annotates_abstract_leaves(dict_plan):
    state = {"w": np.ones((16, 32), np.float32), "b": np.zeros((32,), np.float32)}
    placed = autoshard.apply_plan(dict_plan, state)
    assert placed["w"].sharding == NamedSharding(dict_plan.mesh, P(None, "model"))
    np.testing.assert_array_equal(placed["w"], state["w"])
    abstract = autoshard.apply_plan(dict_plan, jax.eval_shape(lambda: state))
    assert abstract["w"].sharding == placed["w"].sharding
    both = autoshard.apply_plan(dict_plan, (state, np.ones((8, 16), np.float32)), argnum=None)
    assert both[1].sharding == dict_plan.in_shardings[1]
    batch_only = autoshard.apply_plan(dict_plan, np.ones((8, 16), np.float32), argnum=1)
    assert batch_only.sharding == dict_plan.in_shardings[1]


def test_apply_plan_works_with_a_saved_plan(dict_plan):
    loaded = autoshard.Plan.from_json(dict_plan.to_json())
    assert loaded.in_tree is None  # matched by paths, not by treedef
    placed = autoshard.apply_plan(
        loaded, {"w": np.ones((16, 32), np.float32), "b": np.ones((32,), np.float32)}
    )
    assert placed["w"].sharding.spec == P(None, "model")


def test_apply_plan_lists_every_mismatch(dict_plan):
    bad = {"w": np.ones((16, 31), np.float32), "b": np.ones((32,), np.int32), "extra": np.ones(3)}
    with pytest.raises(PlanError, match=r"(?s)lacks: none|") as info:
        autoshard.apply_plan(dict_plan, bad)
    msg = str(info.value)
    assert "[0]['extra']" in msg and "does not know" in msg
    assert "[0]['w']: shape (16, 31), but the plan was made for (16, 32)" in msg
    assert "[0]['b']: dtype int32, but the plan was made for float32" in msg
    assert "Fix:" in msg
    with pytest.raises(PlanError, match=r"the tree lacks: \[0\]\['b'\]"):
        autoshard.apply_plan(dict_plan, {"w": np.ones((16, 32), np.float32)})
    with pytest.raises(PlanError, match=r"no argument 2; its dynamic arguments are \[0\], \[1\]"):
        autoshard.apply_plan(dict_plan, {}, argnum=2)
