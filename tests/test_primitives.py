"""The rules of jax 0.10's newer primitives, each in a tiny step: stack, unstack, tile, RNG (dropout on a
typed key), ragged_dot, approx_top_k, bitcasts, batched linear algebra, a shard_map region and a
custom_partitioning op. Every step runs through ``autoshard.parallelize`` on a (2, 4) mesh, matches
``jax.jit``, and shows in its plan or its compiled HLO that the op really got sharded."""

import re
import warnings

import einops
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.capture import capture_graph
from autoshard.cluster import cluster_preset
from autoshard.cost import CostModel
from autoshard.errors import MeshError
from autoshard.planner import enumerate_strategies
from autoshard.spec import MeshInfo, ShardingSpec

RTOL = 1e-5
DATA, MODEL = 0, 1  # mesh axis indices in ShardingSpec


@pytest.fixture(scope="module")
def mesh():
    return autoshard.make_mesh((2, 4), ("data", "model"))


def _normal(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _run(f, mesh, *args, rtol=RTOL):
    step = autoshard.parallelize(f, mesh=mesh)
    got = step(*args)
    want = jax.jit(f)(*args)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-6),
                 got, want)
    return step


def _specs_of(step, f, args, prim) -> list[ShardingSpec]:
    """The planned layout of each output of every ``prim`` op (value ids as capture numbers them)."""
    program = capture_graph(f, args)
    plan = step.plan(*args)
    out = []
    for op in program.ops:
        if op.name == prim:
            for v in op.outputs:
                spec = plan.value_specs[v]
                assert spec.rank == len(program.avals[v].shape), "value ids differ from the plan's"
                out.append(spec)
    assert out, f"no {prim} in the step"
    return out


def _split(spec: ShardingSpec) -> bool:
    return not spec.is_replicated()


def _hlo(step, *args) -> str:
    return step.lower(*args).compile().as_text()


# ---- stack / unstack / tile -------------------------------------------------------------------------------


def _rope(x, w):
    """Rotary embedding by interleaved pairs (jnp.stack on the last axis), then a projection."""
    b, s, d = x.shape
    pos = jnp.arange(s, dtype=jnp.float32)[:, None]
    freq = jnp.exp(-jnp.arange(d // 2, dtype=jnp.float32) / d)[None, :]
    cos, sin = jnp.cos(pos * freq), jnp.sin(pos * freq)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    y = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(b, s, d)
    return jnp.tanh(y @ w)


def test_stack_in_rope_shards_with_the_batch(mesh):
    args = (_normal((16, 8, 32)), _normal((32, 64), 1))
    step = _run(_rope, mesh, *args)
    (spec,) = _specs_of(step, _rope, args, "stack")
    assert _split(spec) and not spec.dims[-1], spec  # split on batch/seq, the pair dim whole


def test_unstack_keeps_the_other_dims_split(mesh):
    def f(x, w):
        a, b, c = jnp.unstack(x, axis=1)
        return jnp.tanh((a * b + c) @ w)

    args = (_normal((16, 3, 32)), _normal((32, 64), 1))
    step = _run(f, mesh, *args)
    specs = _specs_of(step, f, args, "unstack")
    assert len(specs) == 3 and len(set(specs)) == 1 and _split(specs[0]), specs


@pytest.mark.parametrize("repeat", ["tile", "einops"])
def test_class_token_tiled_over_the_batch(mesh, repeat):
    """ViT's class token: ``jnp.tile`` (a ``tile`` primitive) or ``einops.repeat`` of a (1, 1, d) parameter."""

    def f(cls, x, w):
        b = x.shape[0]
        tok = jnp.tile(cls, (b, 1, 1)) if repeat == "tile" else einops.repeat(cls, "1 1 d -> b 1 d", b=b)
        h = jnp.concatenate([tok, x], axis=1)
        return jnp.tanh(h @ w).sum(axis=1)

    args = (_normal((1, 1, 32)), _normal((16, 7, 32), 1), _normal((32, 64), 2))
    step = _run(f, mesh, *args)
    if repeat == "tile":
        (spec,) = _specs_of(step, f, args, "tile")
        assert _split(spec), spec


def test_bitcast_convert_type_narrowing_and_widening(mesh):
    def f(x):
        b = jax.lax.bitcast_convert_type(x, jnp.uint8)  # (16, 32, 4)
        back = jax.lax.bitcast_convert_type(b ^ jnp.uint8(1), jnp.float32)
        return back * jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.int32) + 1, jnp.float32)

    args = (_normal((16, 32)),)
    step = _run(f, mesh, *args)
    specs = _specs_of(step, f, args, "bitcast_convert_type")
    assert any(s.rank == 3 and _split(s) and not s.dims[-1] for s in specs), specs


# ---- RNG: dropout on a typed key ---------------------------------------------------------------------------

KEY = jax.random.key(42)


@pytest.mark.parametrize("where", ["closed_over", "inside"])
def test_dropout_mask_shards_with_its_activations(mesh, where):
    def f(x, w):
        h = jnp.tanh(x @ w)
        key = KEY if where == "closed_over" else jax.random.key(7)
        keep = jax.random.bernoulli(key, 0.75, h.shape)
        return jnp.where(keep, h / 0.75, 0.0)

    args = (_normal((16, 32)), _normal((32, 64), 1))
    step = _run(f, mesh, *args)  # bits from one replicated key: the same numbers as jax.jit
    (bits,) = _specs_of(step, f, args, "random_bits")
    (h,) = _specs_of(step, f, args, "tanh")
    assert _split(bits) and bits == h, (bits, h)


def test_a_batch_of_keys_shards_along_its_dims(mesh):
    def f(x):
        keys = jax.random.clone(jax.random.split(jax.random.key(3), x.shape[0]))
        noise = jax.vmap(lambda k: jax.random.normal(k, x.shape[1:]))(keys)
        return x * noise

    args = (_normal((16, 32)),)
    step = _run(f, mesh, *args)
    (bits,) = _specs_of(step, f, args, "random_bits")
    assert _split(bits), bits
    program = capture_graph(f, args)
    assert any(op.name == "random_clone" for op in program.ops)


# ---- ragged_dot / approx_top_k / linalg ------------------------------------------------------------------------


def test_ragged_dot_grouped_matmul_and_its_gradient(mesh):
    group_sizes = jnp.array([4, 8, 0, 4], jnp.int32)

    def f(x, w):
        return jax.value_and_grad(lambda x, w: jnp.tanh(jax.lax.ragged_dot(x, w, group_sizes)).sum(),
                                  argnums=(0, 1))(x, w)

    args = (_normal((16, 32)), _normal((4, 32, 64), 1) / 6)
    step = _run(f, mesh, *args)
    program = capture_graph(f, args)
    plan = step.plan(*args)
    ragged = [op for op in program.ops if op.name == "ragged_dot_general"]
    assert len(ragged) == 3  # forward, d/dw (ragged contracting), d/dx
    # the expert weights are split on n (their last dim) or k, never on the group dim
    w_spec = plan.operand_specs.get((ragged[0].index, 1)) or plan.value_specs[ragged[0].inputs[1]]
    assert _split(w_spec) and not w_spec.dims[0], w_spec


def test_approx_top_k_keeps_its_row_whole(mesh):
    def f(x, w):
        h = x @ w
        vals, idx = jax.lax.approx_max_k(h, 4)
        return vals, jnp.take_along_axis(h, idx, axis=-1)  # equal to vals whatever the order of ties

    args = (_normal((16, 32)), _normal((32, 64), 1))
    step = _run(f, mesh, *args)
    vals, idx = _specs_of(step, f, args, "approx_top_k")
    assert vals == idx and _split(vals) and not vals.dims[-1], vals


def test_batched_cholesky_splits_the_batch(mesh):
    def f(a):
        m = a @ jnp.swapaxes(a, -1, -2) + 4 * jnp.eye(a.shape[-1])
        return jnp.linalg.cholesky(m)

    args = (_normal((16, 4, 4)),)
    step = _run(f, mesh, *args, rtol=1e-4)
    (spec,) = _specs_of(step, f, args, "cholesky")
    assert _split(spec) and not spec.dims[1] and not spec.dims[2], spec


# ---- shard_map ------------------------------------------------------------------------------------------


def _shard_map_step(mesh):
    def body(x, w):
        return jnp.tanh(x @ w)

    def f(x, w):
        y = jax.shard_map(body, mesh=mesh, in_specs=(P("data", None), P(None, "model")),
                          out_specs=P("data", "model"))(x * 2.0, w)
        return (y ** 2).sum(axis=1)

    return f


def test_shard_map_region_keeps_its_declared_layouts(mesh):
    f = _shard_map_step(mesh)
    args = (_normal((16, 32)), _normal((32, 64), 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoshard.AutoshardWarning)  # shard_map has a rule now
        step = _run(f, mesh, *args)
    plan = step.plan(*args)
    assert plan.in_specs[1] == ShardingSpec(((), (MODEL,))), plan.in_specs  # w enters as the region wants it
    (out,) = _specs_of(step, f, args, "shard_map")
    assert out == ShardingSpec(((DATA,), (MODEL,)))
    assert "all-gather" not in _hlo(step, *args)


def test_shard_map_on_another_mesh_names_the_line_and_the_fix():
    other = autoshard.make_mesh((4, 2), ("data", "model"))
    f = _shard_map_step(other)
    args = (_normal((16, 32)), _normal((32, 64), 1))
    program = capture_graph(f, args)  # parallelize traces under its mesh, where jax itself refuses this
    cost = CostModel.create(MeshInfo((2, 4), ("data", "model")), cluster_preset("cpu-sim"))
    with pytest.raises(MeshError, match=r"shard_map at .*test_primitives.py:\d+ runs on .*Fix: "):
        enumerate_strategies(program, cost)


# ---- custom_partitioning --------------------------------------------------------------------------------


def _row_normalize(x):
    return x / jnp.sum(x, axis=-1, keepdims=True)


@custom_partitioning
def row_normalize(x):
    return _row_normalize(x)


def _partition_rows(mesh, arg_shapes, result_shape):
    rows = arg_shapes[0].sharding.spec[0] if len(arg_shapes[0].sharding.spec) else None
    sharding = NamedSharding(mesh, P(rows, None))
    return mesh, _row_normalize, sharding, (sharding,)


row_normalize.def_partition(partition=_partition_rows, sharding_rule="i j -> i j", need_replication_factors=("j",))


@custom_partitioning
def scale_and_shift(x, y):
    return 2.0 * x + y


def _partition_elementwise(mesh, arg_shapes, result_shape):
    shardings = tuple(a.sharding for a in arg_shapes)
    return mesh, lambda x, y: 2.0 * x + y, shardings[0], shardings


scale_and_shift.def_partition(partition=_partition_elementwise, sharding_rule="b f, b f -> b f")


def test_custom_partitioning_ops_run_on_shards(mesh):
    def f(x, w, y):
        h = jnp.exp(jnp.tanh(x @ w))
        return scale_and_shift(row_normalize(h), y)

    args = (_normal((16, 32)), _normal((32, 64), 1), _normal((16, 64), 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autoshard.AutoshardWarning)
        step = _run(f, mesh, *args)
    specs = _specs_of(step, f, args, "custom_partitioning")
    norm, shift = specs
    assert _split(norm) and not norm.dims[1], norm  # rows split, the normalized dim whole
    hlo = _hlo(step, *args)
    assert "all-gather" not in hlo  # the rows stay where the matmul made them
    # the normalization's row sum runs on a shard of the rows: f32[16 / shards] per device
    n = 16 // norm.num_shards(MeshInfo((2, 4), ("data", "model")))
    assert re.search(rf"f32\[{n}\]\S* reduce\(", hlo), hlo


# ---- a primitive autoshard does not know ---------------------------------------------------------------

my_double_p = jax.extend.core.Primitive("my_double")
my_double_p.def_impl(lambda x: 2 * x)
my_double_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(my_double_p, mlir.lower_fun(lambda x: 2 * x, multiple_results=False))


def test_unknown_primitive_warns_at_the_users_line(mesh):
    def f(x, w):
        return jnp.tanh(my_double_p.bind(x) @ w)  # the line the warning names

    line = f.__code__.co_firstlineno + 1
    args = (_normal((16, 32)), _normal((32, 64), 1))
    with pytest.warns(autoshard.AutoshardWarning, match=rf"my_double \(at .*test_primitives.py:{line}\)"):
        _run(f, mesh, *args)


# ---- every strategy of the new rules is valid for its shapes (the invariant of tests/test_invariants.py) ----


def _new_primitives(x, w, a, keys):
    """One step that binds every rule added for jax 0.10's primitives, forward and backward."""
    def loss(x, w, a):
        y = jnp.stack([x, 2 * x], axis=1)  # (8, 2, 16)
        p, q = jnp.unstack(y, axis=1)
        t = jnp.tile(p[:, None, :], (1, 2, 1)).reshape(p.shape[0], -1)  # (8, 32)
        h = jax.lax.ragged_dot(t, w, jnp.array([2, 4, 2], jnp.int32))  # w: (3, 32, 16)
        vals, _ = jax.lax.approx_max_k(h, 2)
        keep = jax.random.bernoulli(jax.random.fold_in(jax.random.key(0), 1), 0.5, h.shape)
        bits = jax.lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.float32).sum(-1)  # (8, 16)
        chol = jnp.linalg.cholesky(a @ jnp.swapaxes(a, -1, -2) + 4 * jnp.eye(a.shape[-1]))
        spec = jnp.abs(jnp.fft.fft(h)).sum()
        return jnp.where(keep, h, 0.0).sum() + vals.sum() + bits.sum() + chol.sum() + spec

    wrapped = jax.random.wrap_key_data(jax.random.key_data(jax.random.clone(keys)))
    noise = jax.vmap(lambda k: jax.random.uniform(k, (4,)))(jax.random.split(wrapped[0], 8))
    custom = scale_and_shift(row_normalize(jnp.exp(x)), x)  # custom_partitioning has no derivative
    return jax.grad(loss, argnums=(0, 1, 2))(x, w, a), noise, custom


NEW_RULES = {"stack", "unstack", "tile", "ragged_dot_general", "approx_top_k", "random_bits", "random_fold_in",
             "random_seed", "random_split", "random_wrap", "random_unwrap", "random_clone", "bitcast_convert_type",
             "cholesky", "fft", "custom_partitioning"}


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4), (4, 2), (1, 8), (2, 2, 2)])
def test_new_rule_strategies_are_valid_for_their_shapes(mesh_shape):
    from tests.test_invariants import _check_strategies, _mesh_info

    keys = jax.random.split(jax.random.key(1), 4)
    args = (jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((3, 32, 16), jnp.float32),
            jax.ShapeDtypeStruct((8, 4, 4), jnp.float32), keys)
    program = capture_graph(_new_primitives, args)
    seen = _check_strategies(program, _mesh_info(mesh_shape))
    assert NEW_RULES <= seen, NEW_RULES - seen


def test_cudnn_attention_splits_batch_and_heads():
    """The traced cuDNN attention wrapper (CPU can trace it, not run it): every strategy splits the batch,
    the heads, or nothing, alike on q, k, v and the output. jax has no public handle to the wrapper."""
    fused = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    q = jax.ShapeDtypeStruct((8, 16, 4, 32), jnp.bfloat16)  # (batch, seq, heads, head_dim): BTNH

    def attention(q, k, v):
        none = jnp.zeros((0,), jnp.int32)
        return fused._dot_product_attention_fwd_p_wrapper.bind(
            q, k, v, jnp.zeros((0,), q.dtype), none, none, none, none, none, none, scale=0.1, seed=0,
            dropout_rate=0.0, variadic_args=(False, False), mask_type=fused.MaskType.CAUSAL,
            layout=fused.AttentionLayout.BTNH.value, sliding_window_length=None, is_training=True)

    program = capture_graph(attention, (q, q, q))
    info = MeshInfo((2, 4), ("data", "model"))
    graph = enumerate_strategies(program, CostModel.create(info, cluster_preset("cpu-sim")))
    (node,) = [n for n in graph.nodes if n.op is not None and n.op.name == "dot_product_attention_fwd_wrapper"]
    layouts = set()
    for s in node.strategies:
        qs = s.in_specs[0]
        assert s.in_specs[1] == s.in_specs[2] == qs == s.out_specs[0], s.name
        assert not qs.dims[1] and not qs.dims[3], s.name  # sequence and head dim whole
        assert s.out_specs[1].dims == (qs.dims[0], qs.dims[2], ()), s.name  # softmax stats (B, N, T)
        layouts.add(qs)
    assert ShardingSpec(((DATA,), (), (MODEL,), ())) in layouts  # batch on data, heads on model


def test_reshard_is_a_pin_like_a_sharding_constraint():
    """``jax.sharding.reshard`` traced under an Explicit mesh (code written for one, autoshard/explicit.py) is
    the user's pin: its one strategy lays the value out as asked, matched by axis names."""
    explicit = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)

    def f(x):
        return jax.sharding.reshard(jnp.tanh(x), P("data", None)) * 2

    arg = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(explicit.abstract_mesh, P()))
    with jax.sharding.use_abstract_mesh(explicit.abstract_mesh):
        program = capture_graph(f, (arg,), explicit=True)
    info = MeshInfo((2, 4), ("data", "model"))
    graph = enumerate_strategies(program, CostModel.create(info, cluster_preset("cpu-sim")))
    (node,) = [n for n in graph.nodes if n.op is not None and n.op.name == "reshard"]
    assert {s.out_specs[0] for s in node.strategies} == {ShardingSpec(((DATA,), ()))}


def _row_normalize_rows(mesh, arg_shapes, result_shape):
    spec = arg_shapes[0].sharding.spec
    return NamedSharding(mesh, P(spec[0] if len(spec) else None, None))


@custom_partitioning
def row_normalize_gspmd(x):
    return _row_normalize(x)


row_normalize_gspmd.def_partition(
    partition=lambda mesh, args, result: (mesh, _row_normalize, _row_normalize_rows(mesh, args, result),
                                          (_row_normalize_rows(mesh, args, result),)),
    infer_sharding_from_operands=_row_normalize_rows)


def test_custom_partitioning_without_a_rule_asks_its_callbacks(mesh):
    """Under GSPMD an op may declare only ``infer_sharding_from_operands``: the strategies are the result
    shardings it gives for each candidate operand layout."""
    def f(x, w):
        return row_normalize_gspmd(jnp.exp(jnp.tanh(x @ w)))

    args = (_normal((16, 32)), _normal((32, 64), 1))
    shardy = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            step = _run(f, mesh, *args)
            (spec,) = _specs_of(step, f, args, "custom_partitioning")
    finally:
        jax.config.update("jax_use_shardy_partitioner", shardy)
    assert _split(spec) and not spec.dims[1], spec


def test_rule_context_prices_typed_key_arrays():
    """``key<fry>`` is an extended dtype numpy cannot read: a threefry key counts its 2 x uint32 of data."""
    from autoshard.strategies import RuleContext

    info = MeshInfo((2, 4), ("data", "model"))
    keys = jax.random.split(jax.random.key(0), 4)
    ctx = RuleContext(mesh=info, cost=CostModel.create(info, cluster_preset("cpu-sim")), in_shapes=((),),
                      in_dtypes=(keys.dtype,), out_shapes=((4,),), out_dtypes=(keys.dtype,), const_inputs=(False,))
    assert ctx.out_bytes() == 4 * 8
