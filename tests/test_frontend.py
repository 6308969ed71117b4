"""The programs users write: typed PRNG keys, nnx objects updated in place, keyword arguments and
argument names, meshes made by jax, sharding annotations and pmap leftovers in model code."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.errors import InputError


@pytest.fixture(scope="module")
def mesh():
    return autoshard.make_mesh((2, 4), ("data", "model"))


def _leaves_close(a, b, rtol=1e-5, atol=1e-6):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# ---- typed PRNG keys -------------------------------------------------------------------------------


def _noisy_step(state, x):
    keys = jax.vmap(jax.random.split)(state["keys"])
    noise = jax.vmap(lambda k: jax.random.normal(k, (x.shape[1],)))(keys[:, 0])
    drop = jax.random.bernoulli(state["key"], 0.8, x.shape)
    y = jnp.where(drop, x + noise, 0.0) @ state["w"]
    new = {"w": state["w"] - 0.01 * (x.T @ y), "keys": keys[:, 1], "key": jax.random.split(state["key"])[0],
           "legacy": jax.random.split(state["legacy"])[0]}
    return new, jnp.mean(y**2)


def _noisy_state():
    return {"w": jnp.linspace(-1, 1, 256, dtype=jnp.float32).reshape(16, 16),
            "keys": jax.random.split(jax.random.key(1), 8), "key": jax.random.key(2),
            "legacy": jax.random.PRNGKey(3)}


def test_typed_and_legacy_keys_anywhere_in_the_state(mesh):
    x = jnp.linspace(0, 1, 8 * 16, dtype=jnp.float32).reshape(8, 16)
    step = autoshard.parallelize(_noisy_step, mesh=mesh)
    state, ref = _noisy_state(), _noisy_state()
    for _ in range(2):
        state, loss = step(state, x)
        ref, ref_loss = jax.jit(_noisy_step)(ref, x)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    _leaves_close(state, ref)
    assert jax.dtypes.issubdtype(state["key"].dtype, jax.dtypes.prng_key)


def test_keys_plan_from_shape_dtype_structs(mesh):
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _noisy_state())
    plan = autoshard.parallelize(_noisy_step, mesh=mesh).plan(abstract, jax.ShapeDtypeStruct((8, 16), jnp.float32))
    assert "key" in plan.summary()
    assert len(plan.in_specs) == 5


# ---- nnx objects, in place -------------------------------------------------------------------------


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(16, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.bn(self.fc(x)))))


def _make_net():
    model = _Net(nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _nnx_step(model, optimizer, batch):
    def loss_fn(model):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _batch():
    return {"x": jnp.linspace(-1, 1, 8 * 16, dtype=jnp.float32).reshape(8, 16), "y": jnp.ones((8, 4))}


@pytest.mark.parametrize("on_mesh", [True, False], ids=["mesh", "auto-mesh"])
def test_nnx_optimizer_step_updates_in_place_like_nnx_jit(mesh, on_mesh):
    model, opt = _make_net()
    ref_model, ref_opt = _make_net()
    step = autoshard.parallelize(_nnx_step, mesh=mesh if on_mesh else None)
    ref = nnx.jit(_nnx_step)
    rng_count = int(model.drop.rngs.count[...]) if hasattr(model.drop, "rngs") else None
    for _ in range(2):
        loss, ref_loss = step(model, opt, _batch()), ref(ref_model, ref_opt, _batch())
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert int(opt.step[...]) == 2 == int(ref_opt.step[...])
    assert not np.allclose(model.bn.mean[...], 0.0)  # BatchNorm statistics moved
    if rng_count is not None:
        assert int(model.drop.rngs.count[...]) == rng_count + 2  # one dropout mask per step
    _leaves_close(nnx.state((model, opt)), nnx.state((ref_model, ref_opt)))
    assert len(step.cache) == 1  # the second call reused the plan


def test_nnx_step_returning_a_module_is_refused(mesh):
    model, _ = _make_net()

    def step(model, x):
        return model, model(x).sum()

    with pytest.raises(InputError, match=r"(?s)returns an nnx object.*Fix: return only arrays"):
        autoshard.parallelize(step, mesh=mesh)(model, _batch()["x"])


class _Mlp(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(16, 32, rngs=rngs)
        self.b = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def _make_mlp():
    model = _Mlp(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def test_nnx_objects_in_a_microbatched_step_update_in_place(mesh):
    model, opt = _make_mlp()
    ref_model, ref_opt = _make_mlp()
    step = autoshard.parallelize(_nnx_step, mesh=mesh, num_microbatches=2, progress=None)
    ref = nnx.jit(_nnx_step)
    for _ in range(2):
        np.testing.assert_allclose(step(model, opt, _batch()), ref(ref_model, ref_opt, _batch()), rtol=1e-5)
    assert int(opt.step[...]) == 2 == int(ref_opt.step[...])
    _leaves_close(nnx.state((model, opt)), nnx.state((ref_model, ref_opt)))
    assert len(step.cache) == 1 and step.plan(model, opt, _batch()).num_microbatches == 2


# ---- signature -------------------------------------------------------------------------------------


def _scaled(w, x, *, scale, power=2):
    return jnp.sum((x @ w) ** power) * scale


def test_static_argnames_and_keyword_arguments(mesh):
    w, x = jnp.ones((16, 8)) / 16, jnp.linspace(0, 1, 128, dtype=jnp.float32).reshape(8, 16)
    step = autoshard.parallelize(_scaled, mesh=mesh, static_argnames=("power",))
    ref = jax.jit(_scaled, static_argnames=("power",))
    np.testing.assert_allclose(step(w, x, scale=2.0, power=3), ref(w, x, scale=2.0, power=3), rtol=1e-5)
    np.testing.assert_allclose(step(w, x=x, scale=0.5), ref(w, x=x, scale=0.5), rtol=1e-5)
    assert len(step.cache) == 2  # a different static value, and x by keyword, are other entries
    plan = step.plan(w, x, scale=1.0, power=3)
    assert "scale" in plan.in_paths and any(p.startswith("[1]") for p in plan.in_paths)


def test_donate_argnames_donates_by_name(mesh):
    def step(params, x):
        return jax.tree_util.tree_map(lambda p: p - 0.1 * jnp.mean(x), params), jnp.sum(x)

    params = {"w": jnp.ones((16, 16))}
    f = autoshard.parallelize(step, mesh=mesh, donate_argnames=("params",))
    new, _ = f(params, jnp.ones((8, 16)))  # moved onto the planned sharding: the moved copy is donated
    newer, _ = f(new, jnp.ones((8, 16)))
    assert new["w"].is_deleted() and not params["w"].is_deleted()
    np.testing.assert_allclose(newer["w"], 0.8, rtol=1e-6)
    assert f.signature.donate_argnums == frozenset({0})


def test_unknown_argname_is_refused():
    with pytest.raises(InputError, match=r"static_argnames names 'nope'.*Fix"):
        autoshard.parallelize(_scaled, static_argnames=("nope",))


def test_pmap_collective_names_the_line_and_the_fix(mesh):
    def step(w, x):
        return jax.lax.pmean(jnp.sum(x @ w), "batch")  # a leftover from pmap code

    with pytest.raises(InputError, match=r"(?s)test_frontend.py:\d+.*pmap-style.*Fix: drop the collective"):
        autoshard.parallelize(step, mesh=mesh)(jnp.ones((16, 8)), jnp.ones((8, 16)))


# ---- meshes and annotations -------------------------------------------------------------------------


def _mlp(w, x):
    return jnp.tanh(x @ w).sum()


def test_ambient_explicit_mesh_of_set_mesh_is_used():
    explicit = jax.make_mesh((4, 2), ("data", "model"))
    w, x = jnp.ones((16, 8)) / 16, jnp.linspace(0, 1, 128, dtype=jnp.float32).reshape(8, 16)
    step = autoshard.parallelize(_mlp)
    with jax.set_mesh(explicit):
        out = step(w, x)
        plan = step.plan(w, x)
    np.testing.assert_allclose(out, jax.jit(_mlp)(w, x), rtol=1e-5)
    assert dict(zip(plan.mesh.axis_names, plan.mesh.devices.shape, strict=True)) == {"data": 4, "model": 2}


def test_with_sharding_constraint_in_model_code_is_a_pin(mesh):
    def f(w, x):
        h = jax.lax.with_sharding_constraint(x @ w, P("model", None))
        return jnp.sum(jnp.tanh(h) @ w.T)

    w, x = jnp.ones((16, 16)) / 16, jnp.linspace(0, 1, 128, dtype=jnp.float32).reshape(8, 16)
    step = autoshard.parallelize(f, mesh=mesh)
    with jax.set_mesh(mesh):
        ref = jax.jit(f)(w, x)
    np.testing.assert_allclose(step(w, x), ref, rtol=1e-5)
    program_specs = step.plan(w, x).value_specs
    assert autoshard.ShardingSpec(((1,), ())) in program_specs.values()


@pytest.mark.parametrize("annotate", ["reshard", "out_sharding"])
def test_explicit_sharding_annotations_name_the_line_and_the_fix(mesh, annotate):
    def f(w, x):
        if annotate == "reshard":
            h = jax.sharding.reshard(x @ w, P("data", None))
        else:
            h = jnp.dot(x, w, out_sharding=P("data", None))
        return h.sum()

    with pytest.raises(InputError, match=r"(?s)test_frontend.py:\d+.*with_sharding_constraint.*hints="):
        autoshard.parallelize(f, mesh=mesh)(jnp.ones((16, 8)), jnp.ones((8, 16)))


def test_functional_nnx_state_of_variables_is_a_pytree_not_an_object(mesh):
    """nnx.split's State holds Variables (graph nodes to nnx): the functional form must not be taken for
    objects to update in place (it returns a new State, which is an ordinary output)."""
    graphdef, params = nnx.split(_Net(nnx.Rngs(0, dropout=1)), nnx.Param, ...)[0:2]

    def step(params, batch):
        def loss_fn(params):
            model = nnx.merge(graphdef, params, nnx.split(_Net(nnx.Rngs(0, dropout=1)), nnx.Param, ...)[2])
            return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), loss

    new, loss = autoshard.parallelize(step, mesh=mesh)(params, _batch())
    ref_new, ref_loss = jax.jit(step)(params, _batch())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    _leaves_close(new, ref_new)


def test_a_shard_map_fixes_the_mesh_when_none_is_given(mesh):
    double = jax.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P("data"), out_specs=P("data"))

    def f(x):
        return jnp.sum(double(x) ** 2)

    x = jnp.linspace(0, 1, 32, dtype=jnp.float32).reshape(8, 4)
    step = autoshard.parallelize(f)
    np.testing.assert_allclose(step(x), jax.jit(f)(x), rtol=1e-5)
    assert step.plan(x).mesh.devices.shape == (2, 4)


def test_with_sharding_constraint_pins_by_name_when_the_planner_picks_the_mesh():
    def f(w, x):
        return jnp.sum(jnp.tanh(jax.lax.with_sharding_constraint(x @ w, P("data", None))))

    w, x = jnp.ones((16, 16)) / 16, jnp.linspace(0, 1, 128, dtype=jnp.float32).reshape(8, 16)
    step = autoshard.parallelize(f)
    np.testing.assert_allclose(step(w, x), jnp.sum(jnp.tanh(x @ w)), rtol=1e-5)
    plan = step.plan(w, x)
    data = plan.mesh.axis_names.index("data")
    assert autoshard.ShardingSpec(((data,), ())) in plan.value_specs.values(), plan.mesh


def test_composite_and_custom_vmap_bodies_are_planned_as_their_ops(mesh):
    from functools import partial

    from jax.custom_batching import custom_vmap

    @partial(jax.lax.composite, name="my.gelu")
    def gelu(x):
        return jax.nn.gelu(x)

    @custom_vmap
    def sin(x):
        return jnp.sin(x)

    @sin.def_vmap
    def _rule(axis_size, in_batched, xs):
        return jnp.sin(xs), in_batched[0]

    def f(w, x):
        return jnp.sum(sin(gelu(x @ w)) ** 2)

    w, x = jnp.ones((16, 16)) / 16, jnp.linspace(0, 1, 128, dtype=jnp.float32).reshape(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoshard.AutoshardWarning)  # no primitive left without a rule
        out = autoshard.parallelize(f, mesh=mesh)(w, x)
    np.testing.assert_allclose(out, jax.jit(f)(w, x), rtol=1e-5)


def test_dropout_masks_shard_with_their_activations(mesh):
    """A dropout mask (bits from one key) takes its activation's layout: the step's compiled collectives
    are the same bytes with dropout as without."""
    from autoshard.hlo import collective_stats

    def make(rate):
        def step(params, x, key):
            def loss_fn(p):
                h = jnp.tanh(x @ p["w1"])
                if rate:
                    h = jnp.where(jax.random.bernoulli(key, 1 - rate, h.shape), h / (1 - rate), 0.0)
                return jnp.mean((h @ p["w2"]) ** 2)

            loss, g = jax.value_and_grad(loss_fn)(params)
            return jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, params, g), loss

        return step

    params = {"w1": jnp.linspace(-1, 1, 64 * 256, dtype=jnp.float32).reshape(64, 256),
              "w2": jnp.linspace(-1, 1, 256 * 64, dtype=jnp.float32).reshape(256, 64)}
    x, key = jnp.linspace(0, 1, 64 * 64, dtype=jnp.float32).reshape(64, 64), jax.random.key(0)
    stats = {}
    for rate in (0.0, 0.25):
        step = autoshard.parallelize(make(rate), mesh=mesh)
        out, loss = step(params, x, key)
        ref, ref_loss = jax.jit(make(rate))(params, x, key)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        _leaves_close(out, ref)
        stats[rate] = collective_stats(step.lower(params, x, key).compile())
    assert stats[0.25].bytes() == pytest.approx(stats[0.0].bytes(), rel=0.01), (stats[0.25], stats[0.0])


# ---- one options object, every runtime ---------------------------------------------------------------


def _sgd_step(params, batch, *, lr=0.1):
    def loss_fn(p):
        return jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads), {"loss": loss}


def _sgd_inputs():
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    params = {"w1": jax.random.normal(k1, (16, 32)) / 4, "w2": jax.random.normal(k2, (32, 4)) / 6}
    return params, {"x": jax.random.normal(k3, (8, 16)), "y": jnp.ones((8, 4))}


def test_options_are_validated_at_once_naming_each_option():
    with pytest.raises(InputError) as info:
        autoshard.Options(num_microbatches=0, remat="sometimes", progress="loud", memory_budget="lots",
                          static_argnums="x", solver_time_limit=-1)
    text = str(info.value)
    for name in ("num_microbatches=0", "remat='sometimes'", "progress='loud'", "memory_budget='lots'",
                 "static_argnums='x'", "solver_time_limit=-1"):
        assert name in text
    assert text.count("Fix:") == 6
    o = autoshard.Options(memory_budget="1 KiB", static_argnums=1, batch_argnums=2)
    assert (o.memory_budget, o.static_argnums, o.batch_argnums, o.runtime) == (1024.0, (1,), (2,), "single")
    assert o.replace(pipeline=autoshard.PipelineOptions()).runtime == "pipelined"


def test_parallelize_takes_an_options_object(mesh):
    params, batch = _sgd_inputs()
    options = autoshard.Options(mesh=mesh, progress=None)
    step = autoshard.parallelize(_sgd_step, options=options)
    assert isinstance(step, autoshard.Parallelized) and step.options is options
    piped = autoshard.parallelize(_sgd_step, options=options, num_microbatches=2)
    assert piped.options.num_microbatches == 2 and piped.options.mesh is mesh
    (ref, ref_m), (got, got_m) = jax.jit(_sgd_step)(params, batch), piped(params, batch)
    np.testing.assert_allclose(float(got_m["loss"]), float(ref_m["loss"]), rtol=1e-5)
    _leaves_close(got, ref, atol=1e-6)


@pytest.mark.parametrize("option", [{"hints": {"w1": P(None, "model")}}, {"remat": True},
                                    {"state_roles": {"w1": "parameter"}}])
def test_pipelined_runtime_refuses_what_it_cannot_honour(mesh, option):
    name = next(iter(option))
    with pytest.raises(InputError, match=rf"(?s)pipelined runtime cannot honour.*{name}=.*Fix:"):
        autoshard.parallelize(_sgd_step, mesh=mesh, num_microbatches=2, **option)
    autoshard.parallelize(_sgd_step, mesh=mesh, **option)  # the single program honours it


def test_multi_process_pipelines_take_process_local_batches():
    """runtime='spmd' assembles process-local slices (tests/test_pipeline_spmd.py runs it on 2 processes)."""
    o = autoshard.Options(num_microbatches=2, batch_argnums=(1,))
    assert o.unsupported("pipelined") == [] and o.unsupported("multi-process pipelined") == []


def test_pipelined_step_takes_keywords_static_names_progress_and_a_watchdog(mesh, monkeypatch):
    from autoshard.distributed import StepWatchdog

    watched, seen = [], []
    monkeypatch.setattr(StepWatchdog, "watch", lambda self, outputs: watched.append(len(outputs)))
    params, batch = _sgd_inputs()
    step = autoshard.parallelize(_sgd_step, mesh=mesh, num_microbatches=2, static_argnames="lr", step_timeout=60,
                                 batch_argnums=1, progress=lambda stage, done, total: seen.append((done, total)))
    ref_params, ref_m = jax.jit(_sgd_step, static_argnames="lr")(params, batch, lr=0.05)
    got_params, got_m = step(params, batch=batch, lr=0.05)
    np.testing.assert_allclose(float(got_m["loss"]), float(ref_m["loss"]), rtol=1e-5)
    _leaves_close(got_params, ref_params, atol=1e-6)
    assert watched and seen and seen[-1][0] == seen[-1][1]  # the bar closed
    assert step.plan(params, batch=batch, lr=0.05).num_microbatches == 2 and len(step.cache) == 1


def test_pipelined_step_computes_in_bf16_like_the_single_program(mesh):
    from autoshard.precision import with_precision

    params, batch = _sgd_inputs()
    ref = jax.jit(with_precision(_sgd_step, "bf16", mesh))(params, batch)
    fp32 = jax.jit(_sgd_step)(params, batch)
    got = autoshard.parallelize(_sgd_step, mesh=mesh, num_microbatches=2, precision="bf16", progress=None)(params,
                                                                                                          batch)
    np.testing.assert_allclose(float(got[1]["loss"]), float(ref[1]["loss"]), rtol=1e-5)
    _leaves_close(got[0], ref[0], atol=1e-6)
    assert abs(float(got[1]["loss"]) - float(fp32[1]["loss"])) > 1e-6  # the matmuls did read bf16


def test_a_saved_plan_is_refused_by_the_pipelined_runtime(mesh):
    params, batch = _sgd_inputs()
    saved = autoshard.parallelize(_sgd_step, mesh=mesh, progress=None).plan(params, batch)
    with pytest.raises(InputError, match=r"(?s)pipelined runtime cannot honour.*plan= .*Fix:"):
        autoshard.parallelize(_sgd_step, mesh=mesh, num_microbatches=2, plan=saved)
    with pytest.raises(InputError, match=r"plan=int: expected a saved autoshard.Plan.*Fix:"):
        autoshard.Options(plan=3)


# ---- tracing errors name the user's function, line and argument ------------------------------------------


def _reshape_by(x, how, n):
    return jnp.zeros((3, n)) + x.sum() if how == "zeros" else x


def test_a_tracing_error_names_the_step_its_line_and_the_argument():
    """A Python int traced as jax.jit traces it: the error names the step (not autoshard's wrapper), its
    file:line, and the argument by the step's own parameter name, past the static one before it."""
    step = autoshard.parallelize(_reshape_by, static_argnums=1, progress=None)
    with pytest.raises(TypeError) as info:
        step(jnp.ones(4), "zeros", 5)
    message = "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])
    assert "_reshape_by" in message and f"test_frontend.py:{_reshape_by.__code__.co_firstlineno + 1}" in message
    assert "argument n" in message and "Python scalars, traced as jax.jit traces them: n" in message
    assert "flat_fun" not in message and "flat[" not in message


def test_a_tracer_in_python_control_flow_names_the_keyword_argument_path():
    def branchy(x, *, cfg):
        return x * 2 if cfg["n"] > 2 else x

    step = autoshard.parallelize(branchy, progress=None)
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        step(jnp.ones(4), cfg={"n": 3})
    message = "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])
    assert "branchy" in message and "cfg['n']" in message and "filter=True" in message
    assert "flat_fun" not in message and "flat[" not in message
