"""Pallas kernels split along the parallel axes of their grid (``autoshard/strategies/pallas.py``).

Every kernel runs in interpret mode on the simulated CPU devices, under ``autoshard.parallelize`` on a
(2, 4) mesh, and must match ``jax.jit`` of the same function. The plans (and what XLA compiled) show
that row-wise and attention kernels get their rows / batch and heads split, and that kernels whose grid
axis accumulates, reads blocks other than its own, or reads ``program_id`` are never split along it.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard.capture import capture_graph
from autoshard.cluster import cluster_preset
from autoshard.cost import CostModel
from autoshard.planner import enumerate_strategies
from autoshard.spec import MeshInfo
from autoshard.strategies import coverage
from autoshard.strategies.pallas import read_kernel
from tests.zoo import pallas_attention

RTOL = 1e-5
INFO = MeshInfo((2, 4), ("data", "model"))
CPU_SIM = cluster_preset("cpu-sim")


@pytest.fixture(scope="module")
def mesh():
    return autoshard.make_mesh((2, 4), ("data", "model"))


def _normal(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _run(f, mesh, *args, **options):
    step = autoshard.parallelize(f, mesh=mesh, cluster=CPU_SIM, progress=None, **options)
    got = step(*args)
    want = jax.jit(f)(*args)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=1e-6),
                 got, want)
    return step


def _kernel_ops(f, args):
    program = capture_graph(f, args)
    ops = [op for op in program.ops if op.name == "pallas_call"]
    assert ops, "no pallas_call in the step"
    return program, ops


def _kernel_specs(step, f, args):
    """The planned layout of every pallas_call operand and output: [(in_specs, out_specs)] per kernel."""
    program, ops = _kernel_ops(f, args)
    plan = step.plan(*args)
    out = []
    for op in ops:
        ins = tuple(plan.operand_specs.get((op.index, i), plan.value_specs.get(x)) for i, x in enumerate(op.inputs))
        out.append((ins, tuple(plan.value_specs[v] for v in op.outputs)))
    return out


def _strategies(f, args):
    """Every strategy the rule offers for the step's (one) pallas_call."""
    program, _ = _kernel_ops(f, args)
    graph = enumerate_strategies(program, CostModel.create(INFO, CPU_SIM))
    (node,) = [n for n in graph.nodes if n.op is not None and n.op.name == "pallas_call"]
    return node.strategies


def _kernel_grid(f, *args):
    _, (op,) = _kernel_ops(f, args)
    return read_kernel(op.params, len(op.inputs))


# ---- kernels ---------------------------------------------------------------------------------------------


def _softmax_rows_kernel(x_ref, o_ref):
    o_ref[...] = jax.nn.softmax(x_ref[...], axis=-1)


def row_softmax(x, block_rows=8, **kwargs):
    """A row-wise kernel: one block of rows per grid step."""
    n, d = x.shape
    spec = pl.BlockSpec((block_rows, d), lambda i: (i, 0))
    return pl.pallas_call(_softmax_rows_kernel, grid=(n // block_rows,), in_specs=[spec], out_specs=spec,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True, **kwargs)(x)


def _row_sum_kernel(x_ref, o_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] += jnp.sum(x_ref[...], axis=1, keepdims=True)


def row_sum(x, bm=8, bk=8):
    """Grid (rows, k): k accumulates into the same output block (an 'arbitrary' axis)."""
    m, k = x.shape
    return pl.pallas_call(_row_sum_kernel, grid=(m // bm, k // bk),
                          in_specs=[pl.BlockSpec((bm, bk), lambda i, j: (i, j))],
                          out_specs=pl.BlockSpec((bm, 1), lambda i, j: (i, 0)),
                          out_shape=jax.ShapeDtypeStruct((m, 1), x.dtype), interpret=True)(x)


def _double_kernel(x_ref, o_ref):
    o_ref[...] = 2.0 * x_ref[...]


def repeat_blocks(x, block_rows=8):
    """Each input block is read by two grid steps (block index i // 2): not one-to-one."""
    n, d = x.shape
    return pl.pallas_call(_double_kernel, grid=(2 * n // block_rows,),
                          in_specs=[pl.BlockSpec((block_rows, d), lambda i: (i // 2, 0))],
                          out_specs=pl.BlockSpec((block_rows, d), lambda i: (i, 0)),
                          out_shape=jax.ShapeDtypeStruct((2 * n, d), x.dtype), interpret=True)(x)


def _offset_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + pl.program_id(0).astype(jnp.float32)


def add_block_index(x, block_rows=8):
    """The body reads its grid position: on a device's slice it would count from 0 again."""
    n, d = x.shape
    spec = pl.BlockSpec((block_rows, d), lambda i: (i, 0))
    return pl.pallas_call(_offset_kernel, grid=(n // block_rows,), in_specs=[spec], out_specs=spec,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


# ---- which grid axes a kernel allows to split ---------------------------------------------------------------


def test_read_kernel_finds_the_parallel_axes():
    x = _normal((64, 16))
    rows = _kernel_grid(row_softmax, x)
    assert [(a.axis, a.extent, a.dims) for a in rows.axes] == [(0, 8, (0, 0))] and rows.why == ""
    assert rows.flops > 64 * 16  # the body's flops times the grid

    q = _normal((4, 8, 16, 8))
    attn = _kernel_grid(pallas_attention.pallas_attention, q, q, q)
    assert [(a.axis, a.extent, a.dims) for a in attn.axes] == [(0, 4, (0,) * 4), (1, 8, (1,) * 4)]

    summed = _kernel_grid(row_sum, _normal((32, 32)))
    assert [a.axis for a in summed.axes] == [0]
    assert "grid axis 1 writes the same block of output 0 (it accumulates)" in summed.why

    repeated = _kernel_grid(repeat_blocks, x)
    assert not repeated.axes and "block index of operand 0 along grid axis 0 is not the grid index" in repeated.why

    offset = _kernel_grid(add_block_index, x)
    assert not offset.axes and "reads its position along grid axis 0 (program_id)" in offset.why


def test_declared_dimension_semantics_are_obeyed():
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    x = _normal((64, 16))
    arbitrary = _kernel_grid(lambda x: row_softmax(x, compiler_params=pltpu.CompilerParams(
        dimension_semantics=("arbitrary",))), x)
    assert not arbitrary.axes and "grid axis 0 is declared 'arbitrary'" in arbitrary.why
    parallel = _kernel_grid(lambda x: row_softmax(x, compiler_params=pltpu.CompilerParams(
        dimension_semantics=("parallel",))), x)
    assert [a.axis for a in parallel.axes] == [0]


def test_unreadable_params_keep_the_kernel_whole():
    """Another jax's params (here: no grid mapping at all) are no error: the kernel stays replicated."""
    kernel = read_kernel({"out_avals": (jax.core.ShapedArray((8, 4), jnp.float32),)}, 1)
    assert not kernel.axes and "cannot read the pallas_call params" in kernel.why and kernel.flops == 32


def test_coverage_has_a_rule_for_pallas_call_and_says_why_the_rest_stays_whole():
    classified = coverage()
    assert classified["pallas_call"] == "rule"
    assert classified["core_map"].startswith("replicated: a Pallas/Mosaic/Triton kernel launch")


# ---- split kernels match jax.jit ----------------------------------------------------------------------------


def test_row_softmax_rows_are_split(mesh):
    x, w = _normal((256, 32)), _normal((32, 32), 1)

    def f(x, w):
        return row_softmax(jnp.tanh(x @ w)) @ w

    step = _run(f, mesh, x, w)
    ((ins, outs),) = _kernel_specs(step, f, (x, w))
    assert ins[0] == outs[0] and ins[0].dims[1] == () and ins[0].num_shards(INFO) == 8, (ins, outs)
    hlo = step.lower(x, w).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo


def test_vmapped_pallas_softmax_from_jax_ops_is_split(mesh):
    """jax's own Pallas softmax (``pallas.ops.gpu``) runs a grid of one row, vmapped over the rows."""
    softmax = pytest.importorskip("jax.experimental.pallas.ops.gpu.softmax")
    x = _normal((64, 32))

    def f(x):
        return softmax.softmax(jnp.sin(x), interpret=True) * 3.0

    grid = _kernel_grid(f, x)
    assert [(a.axis, a.extent, a.dims) for a in grid.axes] == [(0, 64, (0, 0))]
    step = _run(f, mesh, x)
    ((ins, outs),) = _kernel_specs(step, f, (x,))
    assert ins[0] == outs[0] and ins[0].num_shards(INFO) == 8, (ins, outs)


def test_attention_kernel_splits_batch_and_heads_in_the_compiled_program(mesh):
    q, k, v = (_normal((8, 8, 32, 16), s) for s in range(3))
    f = pallas_attention.pallas_attention
    step = _run(f, mesh, q, k, v)
    ((ins, outs),) = _kernel_specs(step, f, (q, k, v))
    assert set(ins) == set(outs) and len(set(outs)) == 1, (ins, outs)
    (spec,) = set(outs)
    assert spec.dims[2:] == ((), ()) and spec.num_shards(INFO) == 8, spec  # batch x heads over both axes
    compiled = step.lower(q, k, v).compile()
    for sharding in compiled.input_shardings[0]:
        assert sharding.shard_shape(q.shape)[2:] == (32, 16) and np.prod(sharding.shard_shape(q.shape)[:2]) == 8
    hlo = compiled.as_text()
    assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute", hlo)
    # The kernel's loop writes into the device's (batch, head) pairs only: 64 / 8 of them, not 64.
    written = re.findall(r"= f32\[(\d+),(\d+),32,16\]\S* dynamic-update-slice\(", hlo)
    assert written and {int(b) * int(h) for b, h in written} == {8}, written


def _sines_kernel(x_ref, o_ref):
    def body(i, acc):
        return acc + jnp.sin(x_ref[...] * i.astype(jnp.float32))

    o_ref[...] = jax.lax.fori_loop(0, 4, body, jnp.zeros_like(x_ref[...]))


def sines(x, block_rows=8):
    """A loop inside the body (a scan in the kernel's jaxpr)."""
    spec = pl.BlockSpec((block_rows, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(_sines_kernel, grid=(x.shape[0] // block_rows,), in_specs=[spec], out_specs=spec,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)


def _scale_kernel(s_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] * s_ref[0].astype(jnp.float32)


def prefetch_scaled(x, block_rows=8):
    """A scalar-prefetch operand (read by the index maps and the body) stays whole."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    spec = pl.BlockSpec((block_rows, x.shape[1]), lambda i, s_ref: (i, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(x.shape[0] // block_rows,),
                                             in_specs=[spec], out_specs=spec)
    return pl.pallas_call(_scale_kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=True)(jnp.array([3], jnp.int32), x)


@pytest.mark.parametrize("kernel", [row_sum, sines, prefetch_scaled], ids=["pl_when", "fori_loop", "scalar_prefetch"])
def test_kernels_with_control_flow_or_prefetch_split_their_rows(mesh, kernel):
    x = _normal((256, 64))

    def f(x):
        return kernel(jnp.tanh(x) + 1.0)

    step = _run(f, mesh, x)
    ((ins, outs),) = _kernel_specs(step, f, (x,))
    assert outs[0].dims[0] and ins[-1].dims[0] == outs[0].dims[0], (ins, outs)
    assert all(s.is_replicated() for s in ins[:-1]), ins  # the prefetched scalars


# ---- kernels that must not be split ----------------------------------------------------------------------


def test_accumulating_axis_is_never_split(mesh):
    x, w = _normal((64, 64)), _normal((64, 64), 1)

    def f(x, w):
        return row_sum(jnp.tanh(x @ w) + 1.0)  # positive terms: the sum has no cancellation

    for s in _strategies(f, (x, w)):
        assert s.in_specs[0].dims[1] == () and s.out_specs[0].dims[1] == (), s.name
    assert any(s.in_specs[0].dims[0] for s in _strategies(f, (x, w)))  # the rows still may split
    # The matmul's output is pinned split along the summed axis: the kernel still reads it whole there.
    step = _run(f, mesh, x, w, hints={r"\[1\]": P(None, ("data", "model"))})
    ((ins, _),) = _kernel_specs(step, f, (x, w))
    assert ins[0].dims[1] == (), ins


@pytest.mark.parametrize("kernel", [repeat_blocks, add_block_index], ids=["not_one_to_one", "reads_program_id"])
def test_kernels_that_cannot_split_stay_replicated_with_one_warning(mesh, kernel):
    x = _normal((64, 16))

    def f(x):
        return kernel(jnp.cos(x)) + 1.0

    (only,) = _strategies(f, (x,))
    assert only.name.startswith("replicated (") and all(s.is_replicated() for s in (*only.in_specs, *only.out_specs))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        step = _run(f, mesh, x)
    said = [str(w.message) for w in caught if "Pallas kernel" in str(w.message)]
    assert len(said) == 1 and "replicated: " in said[0], said
    ((ins, outs),) = _kernel_specs(step, f, (x,))
    assert all(s.is_replicated() for s in (*ins, *outs)), (ins, outs)


# ---- the zoo's attention model trains like jax.jit ------------------------------------------------------


@pytest.fixture(scope="module")
def zoo_reference():
    case = pallas_attention.case()
    return _train(case, jax.jit(case.train_step))


def _train(case, step, steps=2):
    state, batch, losses = case.init_state(), case.make_batch(), []
    for _ in range(steps):
        state, loss = step(state, batch)
        losses.append(float(loss))
    return state, losses


def test_zoo_pallas_attention_kernel_matches_its_plain_form():
    q, k, v = (_normal((2, 4, 16, 8), s) for s in range(3))
    np.testing.assert_allclose(pallas_attention.pallas_attention(q, k, v),
                               pallas_attention.reference_attention(q, k, v), rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("mesh_name", ["2x4", "auto"])
def test_zoo_pallas_attention_trains_like_jit(mesh_name, zoo_reference):
    case = pallas_attention.case()
    mesh_ = autoshard.make_mesh((2, 4), ("data", "model")) if mesh_name == "2x4" else None
    step = autoshard.parallelize(case.train_step, mesh=mesh_, cluster=CPU_SIM, progress=None)
    state, losses = _train(case, step)
    ref_state, ref_losses = zoo_reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=5e-5),
                 state, ref_state)
    args = (case.init_state(), case.make_batch())
    split = [outs[0] for _, outs in _kernel_specs(step, case.train_step, args)]
    assert split and all(not s.is_replicated() for s in split), split
