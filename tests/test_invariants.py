"""Invariants over random shapes and meshes (hypothesis): candidate specs, resharding costs, rule strategies."""

import ast
import functools
import itertools
import math
import pathlib

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoshard.capture import Const, capture_graph
from autoshard.cluster import cluster_preset
from autoshard.cost import CostModel
from autoshard.planner import enumerate_strategies
from autoshard.spec import MeshInfo, ShardingSpec, candidate_specs, replicated

MESHES = [(8,), (2, 4), (4, 2), (1, 8), (2, 2, 2)]
DIMS = [1, 2, 3, 4, 6, 8, 16]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _mesh_info(shape) -> MeshInfo:
    return MeshInfo(tuple(shape), tuple(f"axis{i}" for i in range(len(shape))))


def _cost_model(info: MeshInfo, platform="cpu") -> CostModel:
    return CostModel.create(info, cluster_preset("cpu-sim"), platform=platform)


meshes = st.sampled_from(MESHES).map(_mesh_info)
shapes = st.lists(st.sampled_from(DIMS), min_size=0, max_size=4).map(tuple)


def _check_spec(spec: ShardingSpec, shape, info: MeshInfo, what=""):
    """A spec is valid for ``shape`` on ``info``: right rank, even split, each axis once, no size-1 axes."""
    assert spec.rank == len(shape), f"{what}: spec {spec} has rank {spec.rank}, shape {shape}"
    axes = [a for d in spec.dims for a in d]
    assert len(axes) == len(set(axes)), f"{what}: spec {spec} uses a mesh axis twice"
    assert all(0 <= a < info.ndim for a in axes), (
        f"{what}: spec {spec} names an axis outside mesh {info.shape}"
    )
    assert all(info.shape[a] > 1 for a in axes), (
        f"{what}: spec {spec} shards over a size-1 axis of {info.shape}"
    )
    for n, d in zip(shape, spec.dims, strict=True):
        assert n % info.axes_size(d) == 0, (
            f"{what}: spec {spec} does not divide shape {shape} on mesh {info.shape}"
        )


# ---- candidate specs -----------------------------------------------------------------------------------


@SETTINGS
@given(shape=shapes, info=meshes)
def test_candidate_specs_are_valid(shape, info):
    specs = candidate_specs(shape, info)
    assert replicated(len(shape)) in specs
    assert len(set(specs)) == len(specs)
    for spec in specs:
        _check_spec(spec, shape, info)
        for d in spec.dims:  # axes on one dimension go major to minor, in index order
            assert list(d) == sorted(d)


@SETTINGS
@given(shape=shapes, info=meshes)
def test_candidate_specs_are_complete(shape, info):
    """Brute force: every way to put each active axis on one dimension (or none) that divides evenly."""
    want = set()
    for choice in itertools.product(range(-1, len(shape)), repeat=len(info.active_axes)):
        dims = tuple(
            tuple(a for a, c in zip(info.active_axes, choice, strict=True) if c == i)
            for i in range(len(shape))
        )
        if all(n % info.axes_size(d) == 0 for n, d in zip(shape, dims, strict=True)):
            want.add(ShardingSpec(dims))
    assert set(candidate_specs(shape, info)) == want


def test_candidate_specs_skip_size_one_axes():
    info = _mesh_info((1, 8))
    specs = candidate_specs((16, 16), info)
    assert all(0 not in spec.used_axes for spec in specs)
    assert len(specs) == 3  # replicated, or axis 1 on either dimension


# ---- resharding costs ------------------------------------------------------------------------------------


def _slice_only(a: ShardingSpec, b: ShardingSpec) -> bool:
    """``b`` is reached from ``a`` by slicing alone: on every dimension, ``a``'s axes are a major-to-minor
    prefix of ``b``'s. Each device then already holds its ``b`` shard inside its ``a`` shard. Anything
    else (an axis dropped or moved to another dimension, or a new axis inserted *before* a kept one,
    which renumbers the shards) needs data from other devices."""
    return all(db[: len(da)] == da for da, db in zip(a.dims, b.dims, strict=True))


spec_pairs = st.tuples(shapes, meshes).flatmap(
    lambda si: st.tuples(
        st.just(si[0]),
        st.just(si[1]),
        st.sampled_from(candidate_specs(si[0], si[1])),
        st.sampled_from(candidate_specs(si[0], si[1])),
    )
)


@settings(max_examples=200, deadline=None)
@given(case=spec_pairs, itemsize=st.sampled_from([1, 2, 4]), platform=st.sampled_from(["cpu", "gpu"]))
def test_reshard_cost_is_zero_iff_slicing_only(case, itemsize, platform):
    shape, info, a, b = case
    model = _cost_model(info, platform)
    cost = model.reshard_time(shape, itemsize, a, b)
    assert cost >= 0
    assert model.reshard_time(shape, itemsize, a, a) == 0
    assert (cost == 0) == _slice_only(a, b), (shape, info.shape, str(a), str(b), cost)
    seconds, collectives = model.reshard(shape, itemsize, a, b)
    assert seconds == cost
    assert (len(collectives) == 0) == (cost == 0)
    assert all(c.bytes > 0 and c.axes for c in collectives)
    # Twice the bytes never costs less.
    assert model.reshard_time(shape, 2 * itemsize, a, b) >= cost


def test_reshard_examples():
    """Hand-checked cases of the invariant on a 2x4 mesh."""
    info = _mesh_info((2, 4))
    model = _cost_model(info)
    shape = (16, 16)

    def spec(*dims):
        return ShardingSpec(tuple(dims))

    r = spec((), ())
    assert model.reshard_time(shape, 4, r, spec((0,), (1,))) == 0  # slice both axes
    assert model.reshard_time(shape, 4, spec((1,), ()), spec((1, 0), ())) == 0  # split each shard further
    assert model.reshard_time(shape, 4, spec((1,), ()), spec((0, 1), ())) > 0  # renumbers the shards
    assert model.reshard_time(shape, 4, spec((0,), ()), r) > 0  # all-gather
    kinds = [c.kind for c in model.reshard(shape, 4, spec((0,), ()), spec((), (0,)))[1]]
    assert kinds == ["all-to-all"]


# ---- every strategy a rule enumerates is valid for its shapes ---------------------------------------------


def _gpt_loss(params, tokens, *, heads):
    """A one-layer GPT: embedding gather, layernorm, attention with reshape to heads, MLP, softmax xent."""
    x = params["embed"][tokens]  # gather
    b, s, d = x.shape

    def layernorm(h, g):
        mu = h.mean(-1, keepdims=True)
        var = ((h - mu) ** 2).mean(-1, keepdims=True)
        return (h - mu) * jax.lax.rsqrt(var + 1e-5) * g

    h = layernorm(x, params["ln1"])
    q, k, v = jnp.split(h @ params["qkv"], 3, axis=-1)
    q, k, v = (t.reshape(b, s, heads, d // heads).transpose(0, 2, 1, 3) for t in (q, k, v))
    att = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d // heads)
    att = jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, -1e9)
    att = jax.nn.softmax(att, axis=-1)
    o = jnp.einsum("bhqk,bhkd->bhqd", att, v).transpose(0, 2, 1, 3).reshape(b, s, d)
    x = x + o @ params["proj"]
    x = x + jax.nn.gelu(layernorm(x, params["ln2"]) @ params["fc1"]) @ params["fc2"]
    logits = layernorm(x, params["lnf"]) @ params["embed"].T
    logp = jax.nn.log_softmax(logits, axis=-1)
    targets = jnp.roll(tokens, -1, axis=1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean() + 0.0 * jnp.argmax(logits, -1).sum()


def _gpt_args(batch, seq, d, vocab):
    f = jnp.float32
    params = {
        "embed": jax.ShapeDtypeStruct((vocab, d), f),
        "ln1": jax.ShapeDtypeStruct((d,), f),
        "qkv": jax.ShapeDtypeStruct((d, 3 * d), f),
        "proj": jax.ShapeDtypeStruct((d, d), f),
        "ln2": jax.ShapeDtypeStruct((d,), f),
        "fc1": jax.ShapeDtypeStruct((d, 4 * d), f),
        "fc2": jax.ShapeDtypeStruct((4 * d, d), f),
        "lnf": jax.ShapeDtypeStruct((d,), f),
    }
    return params, jax.ShapeDtypeStruct((batch, seq), jnp.int32)


def _misc_ops(x, w):
    """Rules outside the transformer: conv, pooling, cumulative ops, sort, top_k, pad, concat, scan."""
    img = x.reshape(x.shape[0], 1, x.shape[1], -1)
    y = jax.lax.conv_general_dilated(img, w, (1, 1), "SAME")
    y = jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 1, 2, 1), (1, 1, 2, 1), "VALID")
    z = y.reshape(y.shape[0], -1)
    z = jnp.cumsum(z, axis=1) + jnp.sort(z, axis=0)
    top, _ = jax.lax.top_k(z, 2)
    z = jnp.concatenate([jnp.pad(z, ((0, 0), (1, 1))), z], axis=1)
    z = jax.lax.dynamic_slice_in_dim(z, 1, 2, axis=1)
    c, ys = jax.lax.scan(lambda c, r: (c + jnp.sin(r), c * 2), z[0], z)
    return c.sum() + ys.sum() + top.sum() + jnp.max(z, axis=0).sum()


def _check_strategies(program, info: MeshInfo):
    cost = _cost_model(info)
    graph = enumerate_strategies(program, cost)
    avals = program.avals
    seen_ops = set()
    for n, node in enumerate(graph.nodes):
        assert node.strategies, f"node {n} ({node.label}) has no strategy"
        for s in node.strategies:
            what = f"{node.label} strategy {s.name!r}"
            assert len(s.out_specs) == len(node.outputs), what
            for v, spec in zip(node.outputs, s.out_specs, strict=True):
                _check_spec(spec, tuple(avals[v].shape), info, what + " output")
            assert s.compute >= 0 and s.comm >= 0, what
            if node.op is None:
                continue
            op = node.op
            seen_ops.add(op.name)
            assert len(s.in_specs) == len(op.inputs), what
            for x, spec in zip(op.inputs, s.in_specs, strict=True):
                if spec is None:
                    continue
                shape = x.shape if isinstance(x, Const) else tuple(avals[x].shape)
                _check_spec(spec, shape, info, what + " operand")
    return seen_ops


GPT_OPS = {
    "dot_general",
    "gather",
    "reshape",
    "transpose",
    "reduce_sum",
    "reduce_max",
    "exp",
    "div",
    "rsqrt",
    "broadcast_in_dim",
    "select_n",
    "argmax",
    "slice",
    "add_any",
    "scatter-add",
    "iota",
}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.sampled_from([2, 4, 6]),
    seq=st.sampled_from([4, 8]),
    heads=st.sampled_from([2, 4]),
    head_dim=st.sampled_from([2, 3, 4]),
    vocab=st.sampled_from([12, 16]),
    info=meshes,
)
def test_rule_strategies_are_valid_for_a_gpt_train_step(batch, seq, heads, head_dim, vocab, info):
    params, tokens = _gpt_args(batch, seq, heads * head_dim, vocab)
    loss_and_grad = jax.value_and_grad(lambda p, t: _gpt_loss(p, t, heads=heads))
    program = capture_graph(loss_and_grad, (params, tokens))
    seen = _check_strategies(program, info)
    assert GPT_OPS <= seen, GPT_OPS - seen  # the step did exercise these rules


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_rule_strategies_are_valid_for_misc_ops(mesh_shape):
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((4, 1, 3, 3), jnp.float32)
    program = capture_graph(jax.grad(_misc_ops, argnums=(0, 1)), (x, w))
    seen = _check_strategies(program, _mesh_info(mesh_shape))
    assert {"conv_general_dilated", "cumsum", "sort", "top_k", "pad", "concatenate", "dynamic_slice"} <= seen


def test_strategy_check_catches_a_bad_spec():
    """The checker itself rejects what it should."""
    info = _mesh_info((2, 4))
    with pytest.raises(AssertionError, match="does not divide"):
        _check_spec(ShardingSpec(((1,),)), (6,), info)
    with pytest.raises(AssertionError, match="twice"):
        _check_spec(ShardingSpec(((0,), (0,))), (8, 8), info)
    with pytest.raises(AssertionError, match="size-1"):
        _check_spec(ShardingSpec(((0,),)), (8,), _mesh_info((1, 8)))
    with pytest.raises(AssertionError, match="rank"):
        _check_spec(ShardingSpec(((0,),)), (8, 8), info)


# ---- the package's own hygiene: public names only, no import cycle ---------------------------------------

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autoshard"


def _private(name: str) -> bool:
    """``_x`` but not ``__x__`` nor a protocol name like IPython's ``_repr_html_``."""
    return name.startswith("_") and not name.endswith("_")


def _defined_private(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, variables, attributes set on any object."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.Call) and len(n.args) > 1 and isinstance(n.args[1], ast.Constant):
            if getattr(n.func, "id", getattr(n.func, "attr", None)) in ("setattr", "__setattr__"):
                out.add(str(n.args[1].value))
    return {name for name in out if _private(name)}


@functools.cache
def _package_trees() -> dict:
    return {p: ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def private_uses(path: pathlib.Path) -> list[str]:
    """Where ``path`` imports another autoshard module's private name, or reads a private attribute
    that only another autoshard module defines (on an object other than ``self``/``cls``)."""
    trees = _package_trees()
    tree = trees.get(path) or ast.parse(path.read_text())
    own = _defined_private(tree)
    others = set().union(*(_defined_private(t) for p, t in trees.items() if p != path)) - own
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("autoshard"):
            found += [f"{path.name}:{n.lineno} imports {n.module}.{a.name}" for a in n.names if _private(a.name)]
        elif isinstance(n, ast.Attribute) and _private(n.attr) and n.attr in others:
            if not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                found.append(f"{path.name}:{n.lineno} reads {ast.unparse(n)}")
    return found


def import_cycles() -> list[list[str]]:
    """Strongly connected components (more than one module) of the package's import graph, counting
    imports inside functions too: a lazy import is still a dependency."""
    names = {}
    for p in _package_trees():
        parts = p.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p

    def resolve(name):
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, p in names.items():
        edges = set()
        for n in ast.walk(_package_trees()[p]):
            targets = [a.name for a in n.names] if isinstance(n, ast.Import) else []
            if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                targets = [n.module] + [f"{n.module}.{a.name}" for a in n.names]
            edges |= {resolve(t) for t in targets if t.startswith("autoshard.")} - {module, ""}
        graph[module] = edges
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on_stack.discard(comp[-1])
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _cases(paths, known: dict):
    return [pytest.param(p, id=str(p.relative_to(ROOT)),
                         marks=[pytest.mark.xfail(reason=known[p.name], strict=False)] if p.name in known else [])
            for p in paths]


# Test files allowed to reach for a private name, with why (none today).
KNOWN_PRIVATE_IN_TESTS: dict[str, str] = {}


@pytest.mark.parametrize("path", _cases(sorted(PACKAGE.rglob("*.py")), {}))
def test_no_module_uses_another_modules_private_names(path):
    assert private_uses(path) == []


@pytest.mark.parametrize("path", _cases(sorted((ROOT / "tests").rglob("*.py")), KNOWN_PRIVATE_IN_TESTS))
def test_tests_use_only_public_names(path):
    assert private_uses(path) == []


def test_the_private_name_scan_sees_what_it_should(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from autoshard.report import _fmt_bytes\n\ndef f(step):\n    return step._build, self._x\n")
    found = private_uses(bad)
    assert len(found) == 2 and "_fmt_bytes" in found[0] and "step._build" in found[1]


def test_no_import_cycle_in_the_package():
    assert import_cycles() == []


def long_or_wide_functions(root=PACKAGE) -> list[str]:
    """Functions over 80 lines, or taking more than 5 positional parameters (``self``/``cls`` aside)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = node.end_lineno - node.lineno + 1
            positional = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
            if lines > 80 or len(positional) > 5:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: {lines} lines, "
                             f"{len(positional)} positional")
    return found


def test_no_function_is_over_80_lines_or_takes_more_than_5_positional_parameters():
    assert long_or_wide_functions() == []
