"""Model code written for Explicit mesh axes runs under autoshard, its annotations read as the user's intent.

``jax.sharding.reshard`` and ``out_sharding=`` become pins matched to the planning mesh by axis names (or
dropped with one warning when it lacks the axis); the layouts jax inferred, and the reshards its backward
pass writes, are not pins. Every result is compared with ``jax.jit`` / ``nnx.jit`` of the same step.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.planner import AutoshardWarning
from tests.helpers import assert_trees_close

nnx = pytest.importorskip("flax.nnx")
pytest.importorskip("optax")

from tests.zoo import minigpt_explicit  # noqa: E402

CPU_SIM = autoshard.cluster_preset("cpu-sim")


def _explicit(shape=(2, 4), names=("data", "model")):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))


def _annotated(w, x):
    y = jnp.einsum("bd,df->bf", x, w, out_sharding=P("data", "model"))
    y = jax.sharding.reshard(jnp.tanh(y), P("data", None))
    return jax.sharding.reshard(y @ w.T, jax.typeof(x).sharding)


def _loss(w, x):
    return (_annotated(w, x) ** 2).sum()


def _arrays(mesh):
    w = jnp.arange(128.0, dtype=jnp.float32).reshape(8, 16) / 100
    x = jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8) / 10
    with jax.set_mesh(mesh):
        return jax.device_put(w, P(None, "model")), jax.device_put(x, P("data", None))


@functools.cache
def _reference():
    mesh = _explicit()
    w, x = _arrays(mesh)
    with jax.set_mesh(mesh):
        value, grad = jax.jit(jax.value_and_grad(_loss))(w, x)
        out = jax.jit(_annotated)(w, x)
    return np.asarray(value), np.asarray(grad), np.asarray(out)


@pytest.mark.parametrize("inside", [True, False], ids=["under-set_mesh", "arrays-only"])
def test_explicit_annotations_run_and_match_jax_jit(inside):
    """Called under ``jax.set_mesh`` of the Explicit mesh, or outside it with arrays placed on it."""
    mesh = _explicit()
    w, x = _arrays(mesh)
    step = autoshard.parallelize(jax.value_and_grad(_loss), mesh=autoshard.make_mesh((2, 4), ("data", "model")),
                                 cluster=CPU_SIM, progress=None)
    if inside:
        with jax.set_mesh(mesh):
            value, grad = step(w, x)
    else:
        value, grad = step(w, x)
    ref_value, ref_grad, _ = _reference()
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_a_reshard_is_a_pin_on_the_planning_mesh():
    """The step's result is the user's ``reshard(..., jax.typeof(x).sharding)``: the compiled program returns
    it laid out so, batch on ``data``."""
    mesh = _explicit()
    w, x = _arrays(mesh)
    step = autoshard.parallelize(_annotated, mesh=autoshard.make_mesh((2, 4), ("data", "model")), cluster=CPU_SIM,
                                 progress=None)
    out = step(w, x)
    np.testing.assert_allclose(out, _reference()[2], rtol=1e-5)
    compiled = step.lower(w, x).compile()
    (sharding,) = jax.tree_util.tree_leaves(compiled.output_shardings)
    assert sharding.spec[0] == "data" and all(d is None for d in sharding.spec[1:]), sharding.spec


def test_annotations_on_axes_the_planning_mesh_lacks_are_dropped_with_one_warning():
    mesh = _explicit()
    w, x = _arrays(mesh)
    step = autoshard.parallelize(jax.value_and_grad(_loss), mesh=autoshard.make_mesh((2, 4), ("x", "y")),
                                 cluster=CPU_SIM, progress=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value, _ = step(w, x)
    dropped = [w for w in caught if issubclass(w.category, AutoshardWarning) and "lay out nothing" in str(w.message)]
    assert len(dropped) == 1, [str(w.message) for w in caught]
    assert "no axis 'data'" in str(dropped[0].message) and "test_explicit.py" in str(dropped[0].message)
    np.testing.assert_allclose(value, _reference()[0], rtol=1e-5)


def test_reshard_without_an_explicit_mesh_is_an_input_error_naming_the_line():
    def step(x):
        return jax.sharding.reshard(x * 2, P("data"))

    with pytest.raises(autoshard.InputError, match="test_explicit.py") as info:
        autoshard.parallelize(step, mesh=autoshard.make_mesh((8,), ("data",)), progress=None)(jnp.ones(8))
    assert "Explicit" in str(info.value)


@functools.cache
def _minigpt_reference():
    case = minigpt_explicit.case()
    model, optimizer = case.make_objects()
    step = nnx.jit(case.train_step)
    with jax.set_mesh(minigpt_explicit.explicit_mesh()):
        losses = [float(step(model, optimizer, case.make_batch())) for _ in range(2)]
    return model, optimizer, losses


@pytest.mark.parametrize("mesh_name", ["2x4-data-model", "auto", "4x2-batch-model"])
def test_minigpt_tutorial_trains_in_place_like_nnx_jit(mesh_name):
    """flax's MiniGPT tutorial as written (built under an Explicit ("batch", "model") mesh, ``with_partitioning``
    layouts, ``reshard(logits, jax.typeof(inputs).sharding)``, in-place ``train_step``) equals ``nnx.jit``."""
    mesh = {"2x4-data-model": lambda: autoshard.make_mesh((2, 4), ("data", "model")), "auto": lambda: None,
            "4x2-batch-model": lambda: autoshard.make_mesh((4, 2), ("batch", "model"))}[mesh_name]()
    case = minigpt_explicit.case()
    ref_model, ref_optimizer, ref_losses = _minigpt_reference()
    model, optimizer = case.make_objects()
    step = autoshard.parallelize(case.train_step, mesh=mesh, cluster=CPU_SIM, progress=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AutoshardWarning)  # the 'batch' annotations on a ('data', 'model') mesh
        with jax.set_mesh(minigpt_explicit.explicit_mesh()):
            losses = [float(step(model, optimizer, case.make_batch())) for _ in range(2)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert int(optimizer.step[...]) == 2
    assert_trees_close(_without_key_bias(model), _without_key_bias(ref_model), what="model")
    assert_trees_close(_without_key_bias(optimizer), _without_key_bias(ref_optimizer), what="optimizer")


def _without_key_bias(obj):
    """The state of ``obj`` without the attention key biases (and their Adam moments): softmax is invariant to
    adding ``q . b`` to every score of a query, so their gradient is zero but for roundoff, which Adam scales
    up to steps of the learning rate's size in either direction; no two programs agree on it."""
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(obj))[0]
            if "['key']['bias']" not in jax.tree_util.keystr(path)}


def test_the_minigpt_plan_honours_its_annotations_on_a_mesh_with_their_names():
    """On the tutorial's own axis names, the logits come out as the user's ``reshard`` asks: batch on ``batch``."""
    case = minigpt_explicit.case()
    model, _ = case.make_objects()

    def logits(model, tokens):
        return model(tokens)

    step = autoshard.parallelize(logits, mesh=autoshard.make_mesh((4, 2), ("batch", "model")), cluster=CPU_SIM,
                                 progress=None)
    tokens = case.make_batch()[0]
    with jax.set_mesh(minigpt_explicit.explicit_mesh()):
        ref = nnx.jit(logits)(model, tokens)  # first: the step hands the model back on its own (Auto) mesh
        compiled = step.lower(model, tokens).compile()
        out = step(model, tokens)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    sharding = jax.tree_util.tree_leaves(compiled.output_shardings)[0]  # the logits (the model's state follows)
    assert sharding.spec[0] == "batch", sharding.spec
    assert isinstance(sharding, NamedSharding)


def test_mesh_none_plans_over_the_axis_names_of_the_users_explicit_mesh():
    """Called outside ``jax.set_mesh`` (inside it, ``mesh=None`` is the mesh in context) with arrays placed on
    the Explicit mesh, ``mesh=None`` tries meshes named as that one, so its annotations apply (no warning)."""
    case = minigpt_explicit.case()
    model, _ = case.make_objects()

    def logits(model, tokens):
        return model(tokens)

    step = autoshard.parallelize(logits, mesh=None, cluster=CPU_SIM, progress=None)
    tokens = case.make_batch()[0]
    with jax.set_mesh(minigpt_explicit.explicit_mesh()):
        ref = nnx.jit(logits)(model, tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AutoshardWarning)
        plan = step.plan(model, tokens)
        out = step(model, tokens)
    assert tuple(plan.mesh.axis_names) == ("batch", "model")
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
