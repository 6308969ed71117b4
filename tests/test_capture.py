"""``capture_graph``: what survives tracing, what is inlined, and that planned programs still compute the same."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.capture import CapturedProgram, Const, OpGraph, capture_graph
from autoshard.strategies import scan_counts

WRAPPERS = {
    "jit",
    "pjit",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "remat2",
    "checkpoint",
    "closed_call",
    "core_call",
}


@pytest.fixture(scope="module")
def mesh():
    return autoshard.make_mesh((2, 4), ("data", "model"))


def _sds(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _names(program: CapturedProgram) -> list[str]:
    return [op.name for op in program.ops]


def _jaxpr_names(fun, *args) -> set[str]:
    """Primitive names at the top level of ``fun``'s jaxpr (wrappers show up here)."""
    return {eqn.primitive.name for eqn in jax.make_jaxpr(fun)(*args).eqns}


@jax.custom_vjp
def _double_clip_grad(x):
    return x * 2.0


_double_clip_grad.defvjp(lambda x: (x * 2.0, None), lambda _, g: (jnp.clip(2.0 * g, -1.0, 1.0),))


@jax.jit
def _jitted_sin(x):
    return jnp.sin(x) + 1.0


# name -> (function of x, the wrapper primitive jax leaves in the jaxpr, a primitive of its body)
NESTED = {
    "jit": (_jitted_sin, "jit", "sin"),
    "custom_jvp": (jax.nn.relu, "custom_jvp_call", "max"),
    "custom_vjp": (_double_clip_grad, "custom_vjp_call", "mul"),
    "checkpoint": (jax.checkpoint(lambda x: jnp.tanh(x) * 3.0), "remat2", "tanh"),
    "gelu": (jax.nn.gelu, None, "tanh"),
    "jit_in_jit": (jax.jit(lambda x: _jitted_sin(x) * 2.0), "jit", "sin"),
}


@pytest.mark.parametrize("kind", sorted(NESTED))
def test_nested_calls_are_inlined(kind):
    fn, wrapper, inner = NESTED[kind]
    x = _sds(8, 16)
    if wrapper is not None:
        assert wrapper in _jaxpr_names(fn, x)  # the test means something: jax did leave a wrapper
    program = capture_graph(fn, (x,))
    names = _names(program)
    assert not WRAPPERS & set(names), names
    assert inner in names
    for op in program.ops:
        assert all(isinstance(v, int) for v in op.outputs)
        assert op.body is None and op.trips == 1
    # The inlined ops are wired to the argument and the output.
    assert program.uses[program.graph.invars[0]]
    assert program.graph.outvars[0] in program.producer


def test_nested_calls_inside_a_scan_body_are_inlined():
    def fn(x):
        def body(c, y):
            c = jax.checkpoint(lambda a: _double_clip_grad(jax.nn.relu(_jitted_sin(a))))(c + y)
            return c, c.sum()

        return jax.lax.scan(body, x[0], x)

    program = capture_graph(fn, (_sds(4, 16),))
    (scan,) = [op for op in program.ops if op.name == "scan"]
    body_names = [op.name for op in scan.body.ops]
    assert not WRAPPERS & set(body_names), body_names
    assert {"sin", "max", "mul"} <= set(body_names)


def test_scan_stays_one_op_with_a_body():
    def fn(w, xs):
        def body(c, x):
            h = jnp.tanh(c @ w + x)
            return h, h.sum()

        return jax.lax.scan(body, xs[0], xs)

    program = capture_graph(fn, (_sds(16, 16), _sds(6, 16)))
    scans = [op for op in program.ops if op.name == "scan"]
    assert len(scans) == 1
    scan = scans[0]
    assert isinstance(scan.body, OpGraph)
    assert scan.trips == 1
    body_names = [op.name for op in scan.body.ops]
    assert "dot_general" in body_names and "tanh" in body_names
    # Body ops appear in the global op list, before the scan, and run once per iteration.
    for op in scan.body.ops:
        assert program.ops[op.index] is op
        assert op.index < scan.index
        assert op.trips == 6
    # Top-level graph holds the scan, not its body.
    top = {op.index for op in program.graph.ops}
    assert scan.index in top and not top & {op.index for op in scan.body.ops}
    # The body takes one invar per scan operand: consts (w), then the carry, then a slice of xs.
    assert scan_counts(scan.params) == (1, 1)
    assert [tuple(program.avals[v].shape) for v in scan.body.invars] == [(16, 16), (16,), (16,)]
    assert tuple(program.avals[scan.outputs[1]].shape) == (6,)


def test_nested_scans_multiply_trips():
    def fn(xs):
        def outer(c, x):
            c, _ = jax.lax.scan(lambda c2, y: (c2 + jnp.sin(y), None), c, x)
            return c, None

        return jax.lax.scan(outer, xs[0, 0], xs)[0]

    program = capture_graph(fn, (_sds(3, 5, 16),))
    (outer,) = [op for op in program.graph.ops if op.name == "scan"]
    (inner,) = [op for op in outer.body.ops if op.name == "scan"]
    assert inner.trips == 3
    assert {op.name: op.trips for op in inner.body.ops}["sin"] == 15


def test_literals_become_const():
    program = capture_graph(lambda x: x * 2.0 + 1.0, (_sds(4, 8),))
    (mul,) = [op for op in program.ops if op.name == "mul"]
    (add,) = [op for op in program.ops if op.name == "add"]
    assert isinstance(mul.inputs[0], int) and isinstance(mul.inputs[1], Const)
    assert float(mul.inputs[1].value) == 2.0 and mul.inputs[1].shape == ()
    assert isinstance(add.inputs[1], Const) and float(add.inputs[1].value) == 1.0
    assert add.inputs[0] == mul.outputs[0]


TABLE = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 100


def test_closed_over_constants():
    bias = jnp.linspace(0.0, 1.0, 16)
    scale = jnp.float32(3.0)

    def fn(x):
        return (x + bias) * scale + TABLE

    program = capture_graph(fn, (_sds(8, 16),))
    assert len(program.consts) >= 2  # the two arrays; a scalar may be inlined as a Const
    by_shape = {tuple(np.shape(c)): c for c in program.consts.values()}
    np.testing.assert_array_equal(np.asarray(by_shape[(16,)]), np.asarray(bias))
    np.testing.assert_array_equal(np.asarray(by_shape[(8, 16)]), TABLE)
    used = {x for op in program.ops for x in op.inputs if isinstance(x, int)}
    for vid, value in program.consts.items():
        assert vid in used
        assert vid not in program.graph.invars
        assert tuple(program.avals[vid].shape) == tuple(np.shape(value))


def test_paths_are_readable():
    def fn(params, batch):
        return {"loss": (batch["x"] @ params["layers"][0]["w"]).sum()}, [params["layers"][1]["b"] * 2]

    params = {"layers": [{"w": _sds(16, 8)}, {"b": _sds(8)}]}
    program = capture_graph(fn, (params, {"x": _sds(4, 16)}))
    assert program.in_paths == ("[0]['layers'][0]['w']", "[0]['layers'][1]['b']", "[1]['x']")
    assert program.out_paths == ("[0]['loss']", "[1][0]")
    assert len(program.graph.invars) == 3 and len(program.graph.outvars) == 2
    assert program.out_tree == jax.tree.structure(({"loss": 0}, [0]))


def test_producer_uses_and_avals_are_consistent():
    def fn(w, x):
        return jax.nn.softmax(x @ w, axis=-1).sum(0)

    program = capture_graph(fn, (_sds(16, 8), _sds(4, 16)))
    for op in program.ops:
        for k, v in enumerate(op.outputs):
            assert program.producer[v] == (op.index, k)
        for k, x in enumerate(op.inputs):
            if isinstance(x, int):
                assert (op.index, k) in program.uses[x]
    assert program.num_eqns == len(program.ops)
    assert [op.index for op in program.ops] == list(range(len(program.ops)))
    assert tuple(program.avals[program.graph.outvars[0]].shape) == (8,)


def test_fingerprint_tracks_ops_and_shapes():
    def fn(x):
        return jnp.tanh(x).sum()

    a = capture_graph(fn, (_sds(4, 8),)).fingerprint()
    assert a == capture_graph(fn, (jnp.zeros((4, 8)),)).fingerprint()
    assert a != capture_graph(fn, (_sds(8, 8),)).fingerprint()
    assert a != capture_graph(lambda x: jnp.sin(x).sum(), (_sds(4, 8),)).fingerprint()


def test_control_flow_other_than_scan_stays_opaque():
    def fn(x):
        y = jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x)
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, y))[1]

    program = capture_graph(fn, (_sds(4, 8),))
    names = _names(program)
    assert "cond" in names and "while" in names
    assert all(op.body is None for op in program.ops)


# ---- end to end: a planned program that contains each construct equals jax.jit -----------------------


def _step(params, x):
    h = _jitted_sin(x @ params["w1"])
    h = jax.nn.relu(h) + jax.nn.gelu(h)
    h = _double_clip_grad(h)
    h = jax.checkpoint(lambda a: jnp.tanh(a @ params["w2"]) * 3.0)(h)

    def body(c, row):
        c = jnp.tanh(c + row * 0.5 + TABLE[0])
        return c, c.sum()

    c, ys = jax.lax.scan(body, h[0], h)
    return (c * 2.0).sum() + ys.sum() + (TABLE @ params["w2"]).sum()


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (16, 16)) / 4, "w2": jax.random.normal(k2, (16, 16)) / 4}


def _x():
    return jax.random.normal(jax.random.key(1), (8, 16))


def _close(got, want, **kw):
    kw.setdefault("rtol", 1e-5)  # sharded reductions sum in another order than one device
    jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), **kw), got, want)


def test_planned_forward_equals_jit(mesh):
    got = autoshard.parallelize(_step, mesh=mesh)(_params(), _x())
    _close(got, jax.jit(_step)(_params(), _x()), rtol=1e-5)


def test_planned_gradient_equals_jit(mesh):
    grad = jax.grad(_step)
    program = capture_graph(grad, (_params(), _x()))
    assert not WRAPPERS & set(_names(program))
    got = autoshard.parallelize(grad, mesh=mesh)(_params(), _x())
    _close(got, jax.jit(grad)(_params(), _x()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(NESTED))
def test_planned_nested_call_equals_jit(mesh, kind):
    fn = NESTED[kind][0]

    def step(x):
        return fn(x) * 0.5

    x = _x()
    _close(autoshard.parallelize(step, mesh=mesh)(x), jax.jit(step)(x), rtol=1e-5)


def test_planned_control_flow_equals_jit(mesh):
    def step(w, x):
        y = jax.lax.cond(x.sum() > 0, lambda a: a @ w, lambda a: -a, x)
        y = jax.lax.fori_loop(0, (x[0, 0] > 100).astype(jnp.int32) + 2, lambda i, c: jnp.tanh(c @ w), y)

        def outer(c, rows):
            c, _ = jax.lax.scan(lambda c2, r: (c2 + jnp.sin(r), None), c, rows)
            return c, c

        return jax.lax.scan(outer, y[0], y.reshape(2, 4, 16))

    w, x = _params()["w1"], _x()
    _close(autoshard.parallelize(step, mesh=mesh)(w, x), jax.jit(step)(w, x), rtol=1e-5)


def test_planned_passthrough_outputs(mesh):
    def step(params, x):
        return x, jnp.zeros(3), params

    got = autoshard.parallelize(step, mesh=mesh)(_params(), _x())
    _close(got, jax.jit(step)(_params(), _x()))


def test_planned_literal_output(mesh):
    def step(x):
        return x.sum(), 2.0

    _close(autoshard.parallelize(step, mesh=mesh)(_x()), jax.jit(step)(_x()))


# ---- CapturedProgram.from_graph and validate -------------------------------------------------------


def _tiny(w, x):
    return jnp.sum(jnp.tanh(x @ w["a"]) * w["b"])


def _tiny_args():
    return {"a": _sds(4, 8), "b": _sds(8)}, _sds(2, 4)


def _scanned(w, x):
    def body(c, wi):
        return jnp.tanh(c @ wi), jnp.sum(c)

    c, ys = jax.lax.scan(body, x, w)
    return jnp.sum(c) + jnp.sum(ys)


# The gradient's ops are jax's: 0.11 differentiates tanh with its own one_minus_square primitive.
_SCANNED_GRAD_FINGERPRINT = {(0, 10): "5041399ac1116c4d", (0, 11): "5e11bf109853171e"}


def test_fingerprints_of_captured_programs_are_unchanged():
    """Saved plans are matched by fingerprint: these values were computed before ``from_graph`` existed."""
    assert capture_graph(_tiny, _tiny_args()).fingerprint() == "4fc9a0f63e393055"
    version = tuple(int(x) for x in jax.__version__.split(".")[:2])
    assert version in _SCANNED_GRAD_FINGERPRINT, f"record the fingerprint of jax {jax.__version__}'s gradient"
    got = capture_graph(jax.grad(_scanned), (_sds(3, 4, 4), _sds(2, 4))).fingerprint()
    assert got == _SCANNED_GRAD_FINGERPRINT[version]


def test_from_graph_derives_ops_producer_and_uses_from_the_graph():
    program = capture_graph(jax.grad(_scanned), (_sds(3, 4, 4), _sds(2, 4)))
    rebuilt = CapturedProgram.from_graph(program.graph, program.avals, in_tree=program.in_tree,
                                         out_tree=program.out_tree, in_paths=program.in_paths,
                                         out_paths=program.out_paths, consts=program.consts)
    assert [op.index for op in rebuilt.ops] == list(range(len(program.ops)))
    assert all(a is b for a, b in zip(rebuilt.ops, program.ops, strict=True))  # scan bodies included
    assert any(op.body is not None for op in rebuilt.ops)
    assert rebuilt.producer == program.producer and rebuilt.uses == program.uses
    assert rebuilt.fingerprint() == program.fingerprint()
    rebuilt.validate()


def _rebuilt(program, graph, **changes):
    fields = dict(in_tree=program.in_tree, out_tree=program.out_tree, in_paths=program.in_paths,
                  out_paths=program.out_paths, consts=program.consts)
    return CapturedProgram.from_graph(graph, program.avals, **{**fields, **changes})


def test_validate_names_the_op_that_reads_a_value_before_it_is_defined():
    program = capture_graph(_tiny, _tiny_args())
    ops = program.graph.ops
    swapped = OpGraph(program.graph.invars, (ops[1], ops[0], *ops[2:]), program.graph.outvars)
    with pytest.raises(autoshard.errors.InvalidProgramError,
                       match=rf"op {ops[1].index} \({ops[1].name} at .*reads value {ops[0].outputs[0]}"):
        _rebuilt(program, swapped)


def test_validate_checks_paths_and_value_ids():
    program = capture_graph(_tiny, _tiny_args())
    with pytest.raises(AssertionError, match="2 in_paths for 3 graph inputs"):
        _rebuilt(program, program.graph, in_paths=program.in_paths[:2])
    bad = OpGraph(program.graph.invars, program.graph.ops, (*program.graph.outvars, len(program.avals)))
    with pytest.raises(AssertionError, match="out_paths for 2 graph outputs"):
        _rebuilt(program, bad)
    with pytest.raises(AssertionError, match=f"output 1 of the program is value {len(program.avals)}"):
        _rebuilt(program, bad, out_paths=(*program.out_paths, "extra"))
