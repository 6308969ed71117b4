"""Reading collectives, memory and flops out of compiled HLO."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from autoshard.cluster import ClusterSpec, cluster_preset, make_mesh
from autoshard.hlo import (
    CollectiveStats,
    collective_stats,
    flops,
    memory_stats,
)
from autoshard.hlo_schedule import estimate_step_time


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((2, 4), ("x", "y"))


def _compile(mesh, f, args, in_specs, out_spec):
    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    return (
        jax.jit(f, in_shardings=tuple(shard(s) for s in in_specs), out_shardings=shard(out_spec))
        .lower(*args)
        .compile()
    )


A = jax.ShapeDtypeStruct((64, 128), jnp.float32)
B = jax.ShapeDtypeStruct((128, 32), jnp.float32)


# -- compiled programs with known collectives ----------------------------------------


def test_matmul_with_sharded_contraction_all_reduces_the_output(mesh):
    compiled = _compile(mesh, lambda a, b: a @ b, (A, B), (P(None, "y"), P("y", None)), P())
    stats = collective_stats(compiled)
    assert stats.count() == 1
    (c,) = stats.collectives
    assert c.kind == "all-reduce"
    assert c.bytes == 64 * 32 * 4
    assert c.shapes == ("f32[64,32]",) and c.dtypes == ("f32",)
    assert c.group_size == 4
    assert set(c.groups) == {(0, 1, 2, 3), (4, 5, 6, 7)}  # the "y" axis
    assert c.multiplicity == 1
    assert stats.bytes("all_reduce") == 8192
    assert stats.by_kind() == {"all-reduce": {"count": 1, "bytes": 8192.0}}
    assert stats.num_devices == 8


def test_sum_over_sharded_axis_all_reduces_along_that_axis(mesh):
    compiled = _compile(mesh, lambda a: a.sum(0), (A,), (P("x", "y"),), P("y"))
    stats = collective_stats(compiled)
    assert stats.count("all-reduce") == 1
    assert stats.count() == 1
    (c,) = stats.collectives
    assert c.bytes == 128 // 4 * 4  # f32[32]: dimension 128 split four ways
    assert set(c.groups) == {(0, 4), (1, 5), (2, 6), (3, 7)}  # the "x" axis


def test_resharding_to_replicated_all_gathers(mesh):
    def f(a):
        return jax.lax.with_sharding_constraint(a * 2, NamedSharding(mesh, P())) + 1

    stats = collective_stats(_compile(mesh, f, (A,), (P("x", None),), P()))
    assert stats.count("all-gather") == 1
    assert stats.count() == 1
    (c,) = stats.collectives
    assert c.bytes == 64 * 128 * 4
    assert c.operand_bytes == 32 * 128 * 4
    assert c.group_size == 2


def _loop_body(b):
    return lambda c: jnp.tanh(c @ b) @ b.T


def test_fori_loop_multiplies_by_trip_count(mesh):
    def f(a, b):
        return jax.lax.fori_loop(0, 5, lambda i, c: _loop_body(b)(c), a)

    compiled = _compile(mesh, f, (A, B), (P(None, "y"), P("y", None)), P(None, "y"))
    stats = collective_stats(compiled)
    (c,) = [c for c in stats.collectives if c.kind == "all-reduce"]
    assert c.multiplicity == 5
    assert stats.count("all-reduce") == 5
    assert stats.count("all-reduce", weighted=False) == 1
    assert stats.bytes("all-reduce") == 5 * 64 * 32 * 4
    # both matmuls of the body, five times
    assert stats.dot_flops == 5 * 2 * (2 * 64 * 32 * 32)


def test_scan_and_nested_loops_multiply(mesh):
    def f(a, b):
        def inner(c, _):
            return _loop_body(b)(c), None

        def outer(c, _):
            return jax.lax.scan(inner, c, None, length=4)[0], None

        return jax.lax.scan(outer, a, None, length=3)[0]

    compiled = _compile(mesh, f, (A, B), (P(None, "y"), P("y", None)), P(None, "y"))
    stats = collective_stats(compiled)
    assert stats.count("all-reduce") == 12
    assert {c.multiplicity for c in stats.collectives} == {12}


def test_memory_and_flops_are_positive(mesh):
    compiled = _compile(mesh, lambda a, b: a @ b, (A, B), (P(None, "y"), P("y", None)), P())
    mem = memory_stats(compiled)
    assert mem["argument"] == (64 * 128 + 128 * 32) * 4 / 4
    assert mem["output"] == 64 * 32 * 4
    assert mem["peak"] == mem["argument"] + mem["output"] + mem["temp"] - mem["alias"]
    assert mem["peak"] > 0
    assert flops(compiled) >= 2 * 64 * 32 * 32


def test_flops_accepts_list_of_dicts():
    class Fake:
        def cost_analysis(self):
            return [{"flops": 3.0}, {"flops": 4.0}]

    assert flops(Fake()) == 7.0


def test_estimate_step_time(mesh):
    compiled = _compile(mesh, lambda a, b: a @ b, (A, B), (P(None, "y"), P("y", None)), P())
    spec = ClusterSpec(flops=1e12, bandwidth=(1e9, 1e10), latency=(1e-5, 1e-6), memory=2**30)
    est = estimate_step_time(compiled, spec, mesh)
    nbytes = 64 * 32 * 4
    assert est["communication_s"] == pytest.approx(1e-6 + 2 * 3 / 4 * nbytes / 1e10)
    assert est["compute_s"] == pytest.approx(flops(compiled) / 1e12)
    assert est["time_s"] == pytest.approx(est["compute_s"] + est["communication_s"])
    assert est["simple_s"] == pytest.approx(est["compute_s"] + nbytes / 1e10)
    assert est["per_kind"]["all-reduce"]["count"] == 1
    assert estimate_step_time(compiled, cluster_preset("cpu-sim"), mesh)["time_s"] > 0


def test_estimate_step_time_counts_loop_iterations(mesh):
    def f(a, b):
        return jax.lax.fori_loop(0, 5, lambda i, c: _loop_body(b)(c), a)

    compiled = _compile(mesh, f, (A, B), (P(None, "y"), P("y", None)), P(None, "y"))
    spec = cluster_preset("cpu-sim")
    est = estimate_step_time(compiled, spec, mesh)
    one = spec.for_mesh(mesh).all_reduce_cost(64 * 32 * 4, axis=1, n=4)
    assert est["communication_s"] == pytest.approx(5 * one)
    assert est["flops"] > flops(compiled)  # the four extra iterations' matmuls


# -- hand-written HLO text -----------------------------------------------------------

_MODULE = """\
HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p: f32[16,8]) -> f32[16,8] {
  %p = f32[16,8]{1,0} parameter(0)
  ROOT %ar = f32[16,8]{1,0} all-reduce(%p), channel_id=1, replica_groups=GROUPS, use_global_device_ids=true, to_apply=%add
}
"""


@pytest.mark.parametrize(
    "groups, expected",
    [
        ("{{0,1,2,3},{4,5,6,7}}", {(0, 1, 2, 3), (4, 5, 6, 7)}),
        ("[2,4]<=[8]", {(0, 1, 2, 3), (4, 5, 6, 7)}),
        ("[4,2]<=[2,4]T(1,0)", {(0, 4), (1, 5), (2, 6), (3, 7)}),
        ("{}", {tuple(range(8))}),
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", {(0, 4), (1, 5), (2, 6), (3, 7)}),
        ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
         {(0, 1, 2, 3), (4, 5, 6, 7)}),
        ("mesh['a'=8] {'a':(1)2}", {(0, 4), (1, 5), (2, 6), (3, 7)}),
        ("mesh['a'=8] {'a':(4)2}", {(0, 1), (2, 3), (4, 5), (6, 7)}),
        ("@mesh<a=2,b=4> {b}", {(0, 1, 2, 3), (4, 5, 6, 7)}),
    ],
)  # fmt: skip
def test_replica_group_forms(groups, expected):
    stats = collective_stats(_MODULE.replace("GROUPS", groups))
    (c,) = stats.collectives
    assert set(c.groups) == expected
    assert c.bytes == 16 * 8 * 4
    assert c.operand_bytes == 16 * 8 * 4
    assert c.computation == "main"


_ASYNC = """\
HloModule m, num_partitions=4

%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %s = bf16[] add(%x, %y)
}

%rs_wrapped (a: bf16[64]) -> bf16[16] {
  %a = bf16[64]{0} parameter(0)
  ROOT %rs = bf16[16]{0} reduce-scatter(%a), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
}

ENTRY %main (p: bf16[64], q: f32[8,4]) -> (bf16[64], f32[32,4], f32[8,4]) {
  %p = bf16[64]{0} parameter(0)
  %q = f32[8,4]{1,0} parameter(1)
  %ars = bf16[64]{0} all-reduce-start(%p), replica_groups={{0,1},{2,3}}, to_apply=%add
  %ard = bf16[64]{0} all-reduce-done(%ars)
  %ags = (f32[8,4]{1,0}, f32[32,4]{1,0}) all-gather-start(%q), replica_groups=[1,4]<=[4], dimensions={0}
  %agd = f32[32,4]{1,0} all-gather-done(%ags)
  %cps = (f32[8,4]{1,0}, f32[8,4]{1,0}, u32[], u32[]) collective-permute-start(%q), source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  %cpd = f32[8,4]{1,0} collective-permute-done(%cps)
  %as = ((bf16[64]{0}), bf16[16]{0}, s32[]) async-start(%p), calls=%rs_wrapped
  %ad = bf16[16]{0} async-done(%as), calls=%rs_wrapped
  ROOT %t = (bf16[64]{0}, f32[32,4]{1,0}, f32[8,4]{1,0}) tuple(%ard, %agd, %cpd)
}
"""


def test_async_start_counted_once_and_done_ignored():
    stats = collective_stats(_ASYNC)
    kinds = {c.kind: c for c in stats.collectives}
    assert stats.count() == 4
    assert set(kinds) == {"all-reduce", "all-gather", "collective-permute", "reduce-scatter"}
    ar = kinds["all-reduce"]
    assert ar.is_async and ar.opcode == "all-reduce-start"
    assert ar.bytes == 128 and ar.group_size == 2
    ag = kinds["all-gather"]
    assert ag.bytes == 32 * 4 * 4 and ag.operand_bytes == 8 * 4 * 4
    assert ag.groups == ((0, 1, 2, 3),)
    cp = kinds["collective-permute"]
    assert cp.bytes == 8 * 4 * 4
    assert set(cp.groups) == {(0, 1), (2, 3)}
    rs = kinds["reduce-scatter"]
    assert rs.bytes == 32 and rs.operand_bytes == 128 and rs.multiplicity == 1
    assert rs.computation == "rs_wrapped"


_NESTED = """\
HloModule m, num_partitions=2

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%inner_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %v = f32[4]{0} get-tuple-element(%t), index=1
  %i = s32[] get-tuple-element(%t), index=0
  %r = f32[4]{0} call(%v), to_apply=%reducer
  ROOT %o = (s32[], f32[4]{0}) tuple(%i, %r)
}

%reducer (v: f32[4]) -> f32[4] {
  %v = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%v), replica_groups={{0,1}}, to_apply=%add
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%outer_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  ROOT %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"6"}}
}

%unknown_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %v = f32[4]{0} get-tuple-element(%t), index=1
  %i = s32[] get-tuple-element(%t), index=0
  %ag = f32[8]{0} all-gather(%v), replica_groups={{0,1}}, dimensions={0}
  ROOT %o = (s32[], f32[4]{0}) tuple(%i, %v)
}

ENTRY %main (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %w1 = (s32[], f32[4]{0}) while(%p), condition=%cond, body=%outer_body, backend_config={"known_trip_count":{"n":"7"}}
  ROOT %w2 = (s32[], f32[4]{0}) while(%w1), condition=%cond, body=%unknown_body
}
"""


def test_nested_whiles_and_calls_multiply():
    stats = collective_stats(_NESTED)
    by_name = {c.name: c for c in stats.collectives}
    assert by_name["ar"].multiplicity == 42
    assert not by_name["ar"].in_unknown_loop
    assert by_name["ar"].computation == "reducer"
    assert by_name["ag"].multiplicity == 1 and by_name["ag"].in_unknown_loop
    assert stats.bytes("all-reduce") == 42 * 16
    assert stats.count() == 43


def test_str_renders_a_table():
    stats = collective_stats(_NESTED)
    text = str(stats)
    assert "all-reduce" in text and "42" in text and "total per step" in text
    assert isinstance(stats, CollectiveStats)
    assert "no collectives" in str(CollectiveStats(()))


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="unknown collective kind 'all-sum'"):
        collective_stats(_NESTED).count("all-sum")


def test_permutes_in_branches_finds_a_permute_only_some_devices_reach():
    """A ``lax.switch`` on the device's position whose branch permutes: compiled, never run (it would hang)."""
    from autoshard.hlo import permutes_in_branches

    m = make_mesh((8,), ("s",))

    def body(x, permute_in_branch):
        i = jax.lax.axis_index("s")
        shift = lambda v: jax.lax.ppermute(v, "s", [(j, (j + 1) % 8) for j in range(8)])  # noqa: E731
        if permute_in_branch:
            return jax.lax.switch(i % 2, [shift, lambda v: v * 2], x)
        return shift(jax.lax.switch(i % 2, [lambda v: v + 1, lambda v: v * 2], x))

    x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    for inside in (True, False):
        f = jax.shard_map(lambda v, inside=inside: body(v, inside), mesh=m, in_specs=P("s"), out_specs=P("s"))
        found = permutes_in_branches(jax.jit(f).lower(x).compile())
        assert bool(found) == inside, found
