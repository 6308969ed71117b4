"""Which frontier sums a stage keeps unreduced (autoshard.pipeline.deferred), from the plan's layouts alone."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoshard.capture import capture_graph
from autoshard.pipeline.deferred import PartialSum, partial_sums, summed_axes
from autoshard.spec import MeshInfo, ShardingSpec

MESH = MeshInfo((2, 4), ("data", "model"))
S = ShardingSpec


@dataclasses.dataclass
class _Plan:
    value_specs: dict
    operand_specs: dict
    mesh_info: MeshInfo = MESH
    deferred: frozenset = frozenset()


@dataclasses.dataclass
class _Task:
    ops: tuple
    frontier: tuple


def _wgrad(x, dy):
    return jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())))


def extra_bytes(partials, avals, mesh) -> float:
    """Per-device bytes the running sums take beyond the reduced values."""
    return sum(acc - reduced for acc, reduced in (ps.bytes(avals[ps.value], mesh) for ps in partials.values()))


def _program(f, *shapes):
    return capture_graph(f, tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))


def _only(program, name):
    (op,) = [o for o in program.ops if o.name == name]
    return op


def _plan(op, ins, out):
    return _Plan({op.outputs[0]: out, **dict(zip(op.inputs, ins, strict=True))}, {})


def test_weight_gradient_split_over_batch_is_a_partial_sum():
    prog = _program(_wgrad, (16, 8), (16, 12))
    op = _only(prog, "dot_general")
    # the batch on "data" in both operands, the output's columns on "model": an all-reduce over "data"
    plan = _plan(op, [S(((0,), ())), S(((0,), (1,)))], S(((), (1,))))
    assert summed_axes(plan, op) == (0,)
    got = partial_sums([_Task(prog.ops, (op.outputs[0],))], plan, prog.avals)
    ps = got[op.outputs[0]]
    assert not ps.scatters and ps.acc_spec == S(((0,), (), (1,)))
    assert ps.acc_shape((8, 12), MESH) == (2, 8, 12)
    assert extra_bytes(got, prog.avals, MESH) == 0


def test_operands_split_differently_are_not_a_partial_sum():
    prog = _program(_wgrad, (16, 8), (16, 12))
    op = _only(prog, "dot_general")
    assert summed_axes(_plan(op, [S(((0,), ())), S(((), ()))], S(((), ()))), op) == ()
    # the left operand's batch is split over both axes, the right one's over "data" only
    assert summed_axes(_plan(op, [S(((0, 1), ())), S(((0,), ()))], S(((), ()))), op) == ()


def test_reduce_scatter_kept_unreduced_only_where_the_plan_defers_it():
    prog = _program(_wgrad, (16, 8), (16, 12))
    op = _only(prog, "dot_general")
    plan = _plan(op, [S(((0,), ())), S(((0,), ()))], S(((0,), ())))   # ZeRO: the sum scattered over "data"
    tasks = [_Task(prog.ops, (op.outputs[0],))]
    assert partial_sums(tasks, plan, prog.avals) == {}
    got = partial_sums(tasks, dataclasses.replace(plan, deferred=frozenset({op.outputs[0]})), prog.avals)
    # running sum 8*12*4 bytes per device, against 4*12*4 reduced
    assert got[op.outputs[0]].scatters and extra_bytes(got, prog.avals, MESH) == 192.0


def test_reduce_sum_and_scatter_add_into_zeros():
    prog = _program(lambda g: g.sum(0), (16, 8))
    op = _only(prog, "reduce_sum")
    assert summed_axes(_plan(op, [S(((0, 1), ()))], S(((),))), op) == (0, 1)

    def embed_grad(ids, ct):
        return jnp.zeros((10, 8)).at[ids].add(ct)

    prog = capture_graph(embed_grad, (jax.ShapeDtypeStruct((16,), jnp.int32), jax.ShapeDtypeStruct((16, 8), jnp.float32)))
    op = next(o for o in prog.ops if o.name.startswith("scatter"))
    specs = [S(((), ())), S(((0,), ())), S(((0,), ()))]
    plan = _Plan({v: s for v, s in zip(op.inputs, specs, strict=False) if isinstance(v, int)},
                 {(op.index, i): s for i, s in enumerate(specs)})
    assert summed_axes(plan, op) == (0,)


def test_partial_sum_needs_axes():
    with pytest.raises(ValueError, match="no axes"):
        PartialSum(0, 0, (), S(((),)))


def test_unknown_primitive_is_never_a_partial_sum():
    prog = _program(lambda x: jnp.max(x, axis=0), (16, 8))
    op = _only(prog, "reduce_max")
    assert summed_axes(_plan(op, [S(((0,), ()))], S(((),))), op) == ()
    np.testing.assert_equal(partial_sums([_Task(prog.ops, (op.outputs[0],))], None, prog.avals), {})
