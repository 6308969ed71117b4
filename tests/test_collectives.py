"""One collective formula: the planner, the cluster spec and the compiled-program score agree."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding

from autoshard.cluster import cluster_preset
from autoshard.collectives import ALL_TO_ALL_PENALTY, Collective, CollectiveKind, Link, collective_seconds
from autoshard.cost import CostModel
from autoshard.hlo import collective_stats
from autoshard.hlo_schedule import estimate_step_time
from autoshard.spec import MeshInfo, ShardingSpec

CLUSTER = cluster_preset("h100-2node-ib")  # a slow axis 0 and a fast axis 1


@pytest.mark.parametrize(("name", "kind"), [
    ("all-gather-start", CollectiveKind.ALL_GATHER),
    ("all_reduce", CollectiveKind.ALL_REDUCE),
    ("ppermute", CollectiveKind.COLLECTIVE_PERMUTE),
    ("ragged-all-to-all", CollectiveKind.ALL_TO_ALL),
    ("reduce-scatter", CollectiveKind.REDUCE_SCATTER),
])
def test_kinds_parse_from_hlo_and_jax_spellings(name, kind):
    assert CollectiveKind.parse(name) is kind
    assert kind == kind.value  # members are the opcode strings


def test_an_unknown_kind_is_a_value_error_listing_the_kinds():
    with pytest.raises(ValueError, match="unknown collective kind 'broadcast'.*all-gather"):
        CollectiveKind.parse("broadcast")


def test_the_planner_and_the_cluster_price_every_collective_alike():
    info = MeshInfo(shape=(2, 4), names=("data", "model"))
    model = CostModel.create(info, CLUSTER, platform="gpu")
    spec = CLUSTER.for_mesh((2, 4))
    for kind in CollectiveKind:
        for axes in ((0,), (1,), (0, 1)):
            planned = model.collective_time(Collective(kind, axes, 3e7))
            scored = spec.collective_cost(kind, 3e7, axes, [info.shape[a] for a in axes])
            assert planned == pytest.approx(scored, rel=1e-12), (kind, axes)


def test_all_to_all_over_two_axes_pays_the_slowest_latency_once():
    slow, fast = Link(2, 1e-5, 1 / 5e10), Link(4, 5e-6, 1 / 4.5e11)
    got = collective_seconds("all-to-all", 1e8, [slow, fast])
    assert got == pytest.approx(1e-5 + 7 / 8 * 1e8 * ALL_TO_ALL_PENALTY / 5e10)


def test_a_compiled_all_to_all_is_scored_as_the_planner_priced_it():
    """A reshard that XLA compiles to one all-to-all: the planner's bytes are the compiled
    per-device buffer, and its seconds are what estimate_step_time charges for the program."""
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    info = MeshInfo.from_mesh(mesh)
    src, dst = ShardingSpec(((1,), ())), ShardingSpec(((), (1,)))
    shape = (256, 512)
    dst_sharding = NamedSharding(mesh, dst.to_partition_spec(info))
    f = jax.jit(lambda a: jax.lax.with_sharding_constraint(a * 2, dst_sharding) * 3,
                in_shardings=NamedSharding(mesh, src.to_partition_spec(info)), out_shardings=dst_sharding)
    compiled = f.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile()
    kinds = [c.kind for c in collective_stats(compiled).collectives]
    assert kinds == ["all-to-all"]
    seconds, planned = CostModel.create(info, CLUSTER, platform="cpu").reshard(shape, 4, src, dst)
    assert [c.kind for c in planned] == ["all-to-all"]
    assert planned[0].bytes == collective_stats(compiled).collectives[0].bytes == 256 * 512 * 4 / 4
    assert estimate_step_time(compiled, CLUSTER, mesh)["communication_s"] == pytest.approx(seconds, rel=1e-9)


def test_hierarchical_order_is_fastest_axis_first_whatever_order_the_links_come_in():
    a, b = Link(2, 1e-5, 1 / 5e10), Link(4, 5e-6, 1 / 4.5e11)
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert collective_seconds(kind, 1e8, [a, b]) == pytest.approx(collective_seconds(kind, 1e8, [b, a]))
    assert all(collective_seconds(k, 1e8, [Link(1, 1.0, 1.0)]) == 0.0 for k in CollectiveKind)
