"""Equinox as Equinox users write it: ``eqx.Module`` steps under ``parallelize`` with ``eqx.filter_jit``'s rule.

The zoo's Equinox cases (``tests/zoo/equinox_vit.py``: a ViT with an optax optimizer passed to the step,
and a BatchNorm MLP threading an ``eqx.nn.State``) run 2 steps under ``parallelize`` on a (2, 4) mesh and
with ``mesh=None``, and must equal ``eqx.filter_jit`` of the same step: losses, every array leaf, and every
other leaf (the modules' int fields, the optimizer's functions) as it was. Then the rule itself on plain
functions, and the errors: a function leaf without ``filter``, and tracing errors that name the user's
function, line and argument path.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.errors import InputError
from autoshard.testing import cache_size

eqx = pytest.importorskip("equinox")
optax = pytest.importorskip("optax")
pytest.importorskip("einops")

from tests.zoo import equinox_vit  # noqa: E402

CASES = {"vit": equinox_vit.vit_case, "batchnorm": equinox_vit.batchnorm_case}
MESHES = {
    "2x4": lambda: autoshard.make_mesh((2, 4), ("data", "model")),
    "auto": lambda: None,
}
CPU_SIM = autoshard.cluster_preset("cpu-sim")


def run(case, step, steps=2):
    carry, losses = case.init(), []
    for i in range(steps):
        *carry, loss = step(*case.arguments(tuple(carry), i))
        losses.append(float(loss))
    return tuple(carry), losses


@functools.cache
def filter_jit_reference(name):
    case = CASES[name]()
    return run(case, eqx.filter_jit(case.train_step))


def assert_same_trees(actual, expected, *, rtol=1e-5, atol=5e-5):
    """Equal structure; array leaves close; every other leaf the same value of the same type."""
    act = jax.tree_util.tree_flatten_with_path(actual)
    exp = jax.tree_util.tree_flatten_with_path(expected)
    assert act[1] == exp[1], "the trees differ in structure"
    for (path, a), (_, e) in zip(act[0], exp[0], strict=True):
        where = jax.tree_util.keystr(path)
        if eqx.is_array(e):
            assert eqx.is_array(a), f"{where}: {type(a).__name__} where filter_jit gives an array"
            np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol, err_msg=where)
        else:
            assert type(a) is type(e) and (a is e or a == e), f"{where}: {a!r} != {e!r}"


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("name", CASES)
def test_equinox_zoo_matches_filter_jit(name, mesh_name):
    case = CASES[name]()
    ref_carry, ref_losses = filter_jit_reference(name)
    step = autoshard.parallelize(case.train_step, mesh=MESHES[mesh_name](), cluster=CPU_SIM, progress=None)
    carry, losses = run(case, step)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_same_trees(carry, ref_carry)
    assert cache_size(step) == 1  # the second step's static leaves (ints, functions) hit the first's entry
    if name == "vit":
        model = carry[0]
        assert type(model.patch_embedding.patch_size) is int and model.num_layers == 2


def test_a_function_leaf_without_filter_says_to_filter():
    case = equinox_vit.vit_case()
    step = autoshard.parallelize(case.train_step, filter=False, progress=None)
    args = case.arguments(case.init(), 0)
    with pytest.raises(InputError, match=r"argument 1 has a leaf at .*init of type function(.|\n)*filter=True"
                                         r"(.|\n)*eqx\.filter_jit(.|\n)*Equinox"):
        step.plan(*args)


def test_filter_keeps_non_array_leaves_static_and_returns_them():
    """Plain pytrees, no equinox: ints, strings, functions and None are static and come back as they were."""

    def step(x, cfg):
        y = jnp.tanh(x) * cfg["scale"] if cfg["act"] == "tanh" else cfg["fn"](x)
        return {"y": y.reshape(cfg["rows"], -1), "rows": cfg["rows"], "fn": cfg["fn"], "none": None, "tag": "ok"}

    x = jnp.arange(16.0).reshape(4, 4)
    cfg = {"scale": 2.0, "act": "tanh", "fn": jax.nn.relu, "rows": 2}
    par = autoshard.parallelize(step, filter=True, cluster=CPU_SIM, progress=None)
    expected = eqx.filter_jit(step)(x, cfg)
    out = par(x, cfg)
    assert_same_trees(out, expected)
    assert out["fn"] is jax.nn.relu and out["rows"] == 2 and out["tag"] == "ok"
    assert_same_trees(par(x, dict(cfg)), expected)  # equal static values: the same entry
    assert cache_size(par) == 1
    other = {**cfg, "rows": 8, "act": "relu"}
    assert_same_trees(par(x, other), eqx.filter_jit(step)(x, other))
    assert cache_size(par) == 2


def test_unhashable_static_leaves_key_by_identity():
    class Config:  # an __eq__ and no __hash__: unhashable, as equinox compares it by identity
        def __init__(self, n):
            self.n = n

        def __eq__(self, other):
            return isinstance(other, Config) and other.n == self.n

    def step(x, cfg):
        return x * cfg[0].n

    par = autoshard.parallelize(step, filter=True, cluster=CPU_SIM, progress=None)
    x, one = jnp.ones(8), Config(3)
    np.testing.assert_allclose(par(x, [one]), 3 * np.ones(8))
    par(x, [one])
    assert cache_size(par) == 1
    np.testing.assert_allclose(par(x, [Config(3)]), 3 * np.ones(8))
    assert cache_size(par) == 2


def test_a_module_turns_filter_on_and_plans_only_its_arrays():
    class Scale(eqx.Module):
        weight: jax.Array
        power: int
        activation: callable

        def __call__(self, x):
            return self.activation(x @ self.weight) ** self.power

    def step(model, x):
        return model(x).sum()

    model = Scale(jnp.ones((4, 4)), 2, jax.nn.tanh)
    par = autoshard.parallelize(step, cluster=CPU_SIM, progress=None)  # filter=None: on for an eqx.Module
    np.testing.assert_allclose(par(model, jnp.ones((8, 4))), eqx.filter_jit(step)(model, jnp.ones((8, 4))),
                               rtol=1e-6)
    plan = par.plan(model, jax.ShapeDtypeStruct((8, 4), jnp.float32))
    assert [p for p in plan.in_paths if "power" in p or "activation" in p] == []


# ---- errors that point at the user's code --------------------------------------------------------------


class Patches(eqx.Module):
    weight: jax.Array
    patch_size: int

    def __call__(self, x):
        return x.reshape(-1, self.patch_size) @ self.weight


def patchify_step(model, x):
    return jnp.zeros((model.patch_size, 2)).sum() + model(x).sum()


def test_a_traced_int_shape_names_the_function_line_and_argument_path():
    step = autoshard.parallelize(patchify_step, filter=False, cluster=CPU_SIM, progress=None)
    model = Patches(jnp.ones((4, 3)), 4)
    with pytest.raises(TypeError) as info:
        step(model, jnp.ones((8, 4)))
    message = "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])
    assert "patchify_step" in message and "test_equinox.py" in message
    assert "model.patch_size" in message and "filter=True" in message
    assert "flat_fun" not in message and "flat[" not in message
    line = patchify_step.__code__.co_firstlineno + 1  # the line that made the shape
    assert re.search(rf"test_equinox\.py:{line}\b", message), message


class _Stack(eqx.Module):
    first: eqx.nn.Linear
    last: eqx.nn.Linear
    depth: int

    def __call__(self, x):
        for _ in range(self.depth):
            x = jax.nn.tanh(self.first(x))
        return self.last(x)


def _sgd_step(model, optimizer, opt_state, x, y):
    def loss_fn(model):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = optimizer.update(grads, opt_state)
    return eqx.apply_updates(model, updates), opt_state, loss


def test_a_microbatched_step_filters_too():
    key1, key2 = jax.random.split(jax.random.PRNGKey(0))
    model = _Stack(eqx.nn.Linear(8, 8, key=key1), eqx.nn.Linear(8, 2, key=key2), 2)
    optimizer = optax.sgd(0.1)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    x, y = jax.random.normal(key1, (8, 8)), jax.random.normal(key2, (8, 2))
    expected = eqx.filter_jit(_sgd_step)(model, optimizer, opt_state, x, y)
    step = autoshard.parallelize(_sgd_step, num_microbatches=2, batch_argnums=(3, 4), cluster=CPU_SIM, progress=None)
    assert_same_trees(step(model, optimizer, opt_state, x, y), expected, atol=1e-6)


def test_filter_takes_true_false_or_none():
    with pytest.raises(InputError, match=r"filter='yes': expected True, False or None"):
        autoshard.parallelize(_sgd_step, filter="yes")
