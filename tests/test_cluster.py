"""Cluster specs, alpha-beta collective costs, presets, profiling and meshes."""

import dataclasses
import time

import jax
import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoshard.cluster import (
    ALL_TO_ALL_PENALTY,
    PRESETS,
    ClusterSpec,
    cluster_preset,
    ensure_auto_mesh,
    make_mesh,
    profile_cluster,
)
from autoshard.errors import MeshError

SPEC = ClusterSpec(flops=1e12, bandwidth=(1e9, 4e9), latency=(2e-5, 1e-6), memory=2**30, name="t")


# -- construction and presets --------------------------------------------------------


@pytest.mark.parametrize("name", ["h100-nvlink", "h200-nvlink", "a100", "tpu-v5e", "cpu-sim", "h100-2node-ib",
                                  "h100-4node-ib", "h100", "h200", "a100-40", "b200", "tpu-v4", "tpu-v5p", "tpu-v6e"])
def test_presets_exist_and_broadcast(name):
    spec = cluster_preset(name)
    assert spec is PRESETS[name] and spec.name == name
    shaped = spec.for_mesh((2, 2, 2))
    assert len(shaped.bandwidth) == len(shaped.latency) == 3
    if spec.hardware is None:
        assert shaped.bandwidth == (spec.bandwidth,) * 3
        assert shaped.latency == (spec.latency,) * 3
    else:  # per-axis numbers come from the tiers each axis's device groups cross
        assert all(b > 0 for b in shaped.bandwidth) and shaped.mesh_shape == (2, 2, 2)
    assert shaped.flops == spec.flops and shaped.memory == spec.memory


def test_two_node_preset_has_slow_first_axis():
    spec = cluster_preset("h100-2node-ib").for_mesh((2, 8))
    ib, nvlink = spec.hardware.tiers[1], spec.hardware.tiers[0]
    assert spec.axis_bandwidth(0) == ib.bandwidth * ib.efficiency
    assert spec.axis_bandwidth(1) == nvlink.bandwidth * nvlink.efficiency
    assert cluster_preset("h200-nvlink").memory > cluster_preset("h100-nvlink").memory


def test_presets_follow_the_hardware_facts():
    """An H200 preset gets its own 141 GB; every GPU and TPU preset carries its hardware model."""
    assert cluster_preset("h200").memory == 141e9
    assert cluster_preset("a100-40").memory == 40 * 2**30
    for name in ("a100-80", "h100", "b200", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"):
        assert cluster_preset(name).hardware is not None, name


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown cluster preset 'v100'.*cpu-sim"):
        cluster_preset("v100")  # no preset without a sourced sustained matmul rate


def test_for_mesh_accepts_a_mesh():
    mesh = make_mesh((2, 4), ("x", "y"))
    assert SPEC.for_mesh(mesh) == SPEC
    assert cluster_preset("cpu-sim").for_mesh(mesh).bandwidth == (1e10, 1e10)


def test_for_mesh_length_mismatch_names_both_lengths():
    with pytest.raises(MeshError, match=r"bandwidth for 2 mesh axes.*has 3 axes \(shape \(2, 2, 2\)\)"):
        SPEC.for_mesh((2, 2, 2))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(flops=0), "ClusterSpec.flops must be a positive"),
        (dict(bandwidth=(1e9, -1.0)), r"ClusterSpec.bandwidth\[1\] must be a positive"),
        (dict(latency=float("nan")), "ClusterSpec.latency must be a positive"),
        (dict(memory="lots"), "ClusterSpec.memory must be a number"),
        (dict(host_bandwidth=-5), "ClusterSpec.host_bandwidth must be a positive"),
        (dict(latency=(1e-6, 1e-6, 1e-6)), "bandwidth has 2 mesh axes but ClusterSpec.latency has 3"),
        (dict(bandwidth=()), "ClusterSpec.bandwidth is an empty sequence"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(SPEC, **kwargs)


def test_lists_become_tuples():
    spec = ClusterSpec(flops=1, bandwidth=[1, 2], latency=[3, 4], memory=5)
    assert spec.bandwidth == (1.0, 2.0) and spec.latency == (3.0, 4.0)
    assert spec.ndim == 2


# -- alpha-beta costs ----------------------------------------------------------------


def test_single_axis_formulas():
    b, n = 1e6, 4
    beta = 1 / 4e9
    assert SPEC.all_gather_cost(b, 1, n) == pytest.approx(1e-6 + beta * 3 / 4 * b)
    assert SPEC.reduce_scatter_cost(b, 1, n) == pytest.approx(1e-6 + beta * 3 / 4 * b)
    assert SPEC.all_reduce_cost(b, 1, n) == pytest.approx(1e-6 + 2 * beta * 3 / 4 * b)
    assert SPEC.all_to_all_cost(b, 1, n) == pytest.approx(1e-6 + beta * 3 / 4 * b * ALL_TO_ALL_PENALTY)  # b per device
    assert SPEC.permute_cost(b, 0) == pytest.approx(2e-5 + b / 1e9)


@pytest.mark.parametrize("kind", ["all-gather", "all_reduce", "reduce-scatter", "all-to-all", "collective-permute"])
def test_one_device_costs_nothing(kind):
    assert SPEC.collective_cost(kind, 1e9, 0, 1) == 0.0
    assert SPEC.collective_cost(kind, 1e9, (0, 1), (1, 1)) == 0.0


@given(
    small=st.floats(0, 1e9),
    extra=st.floats(1, 1e9),
    axis=st.integers(0, 1),
    n=st.integers(2, 64),
)
def test_costs_are_monotone_in_bytes_and_all_reduce_is_two_reduce_scatters(small, extra, axis, n):
    big = small + extra
    for cost in (SPEC.all_gather_cost, SPEC.all_reduce_cost, SPEC.reduce_scatter_cost, SPEC.all_to_all_cost):
        assert cost(big, axis, n) > cost(small, axis, n) > 0
    ar = SPEC.all_reduce_cost(big, axis, n)
    rs = SPEC.reduce_scatter_cost(big, axis, n)
    assert ar == pytest.approx(2 * rs - SPEC.axis_latency(axis))


def test_multi_axis_is_hierarchical_fastest_axis_first():
    b = 1e8
    # axis 1 (4 GB/s, n=4) moves B, then axis 0 (1 GB/s, n=2) moves B/4
    want_ag = (1e-6 + 3 / 4 * b / 4e9) + (2e-5 + 1 / 2 * (b / 4) / 1e9)
    assert SPEC.collective_cost("all-gather", b, (0, 1), (2, 4)) == pytest.approx(want_ag)
    want_ar = (2e-6 + 2 * 3 / 4 * b / 4e9) + (2e-5 + 2 * 1 / 2 * (b / 4) / 1e9)
    assert SPEC.collective_cost("all-reduce", b, (0, 1), (2, 4)) == pytest.approx(want_ar)
    # cheaper than one flat group on the slow link
    assert want_ar < SPEC.all_reduce_cost(b, 0, 8)
    # all-to-all: one group of 8 on the slowest axis with the largest latency
    want_a2a = 2e-5 + 7 / 8 * b * ALL_TO_ALL_PENALTY / 1e9
    assert SPEC.collective_cost("all-to-all", b, (0, 1), (2, 4)) == pytest.approx(want_a2a)
    # one axis through collective_cost equals the direct method
    assert SPEC.collective_cost("all-reduce", b, 1, 4) == SPEC.all_reduce_cost(b, 1, 4)


def test_collective_cost_rejects_unknown_kind():
    with pytest.raises(ValueError, match="unknown collective kind .broadcast."):
        SPEC.collective_cost("broadcast", 1.0, 0, 2)


def test_axis_out_of_range():
    with pytest.raises(MeshError, match="axis 2 is out of range"):
        SPEC.axis_bandwidth(2)


# -- serialization -------------------------------------------------------------------


def test_json_round_trip(tmp_path):
    for spec in (SPEC, *PRESETS.values()):
        assert ClusterSpec.from_json(spec.to_json()) == spec
        assert ClusterSpec.from_dict(spec.to_dict()) == spec
    path = tmp_path / "cluster.json"
    SPEC.save(path)
    assert ClusterSpec.load(path) == SPEC


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match=r"unknown ClusterSpec fields \['gpus'\]"):
        ClusterSpec.from_dict({**SPEC.to_dict(), "gpus": 8})


# -- profiling -----------------------------------------------------------------------


def test_profile_cluster_on_2x4_mesh(tmp_path):
    mesh = make_mesh((2, 4), ("x", "y"))
    t0 = time.perf_counter()
    spec = profile_cluster(mesh, repeats=3)
    assert time.perf_counter() - t0 < 30
    assert spec.flops > 0 and spec.memory > 0 and spec.host_bandwidth > 0
    assert len(spec.bandwidth) == 2 and len(spec.latency) == 2
    assert all(b > 0 for b in spec.bandwidth) and all(a > 0 for a in spec.latency)
    assert ClusterSpec.from_json(spec.to_json()) == spec
    assert spec.for_mesh(mesh) == spec


def test_profile_cluster_needs_two_sizes():
    mesh = make_mesh((8,), ("d",))
    with pytest.raises(ValueError, match="at least two distinct sizes"):
        profile_cluster(mesh, sizes=(1024, 1024))


# -- meshes --------------------------------------------------------------------------


def test_make_mesh_is_auto():
    mesh = make_mesh((2, 4), ("data", "model"))
    assert mesh.shape == {"data": 2, "model": 4}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert ensure_auto_mesh(mesh) is mesh
    sub = make_mesh((2,), ("d",), devices=jax.devices()[:2])
    assert sub.devices.size == 2


@pytest.mark.parametrize(
    "shape, names, match",
    [
        ((4, 4), ("x", "y"), r"shape \(4, 4\) holds 16 devices but 8 devices were given"),
        ((2, 4), ("x",), r"2 axes in shape \(2, 4\) but 1 names"),
        ((2, 4), ("x", "x"), r"axis names must be unique, \['x'\] repeat"),
    ],
)
def test_make_mesh_errors(shape, names, match):
    with pytest.raises(MeshError, match=match):
        make_mesh(shape, names)


def test_ensure_auto_mesh_rejects_explicit_axes():
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with pytest.raises(MeshError, match=r"(?s)'x': Explicit.*autoshard.make_mesh\(\(2, 4\), \('x', 'y'\)\)"):
        ensure_auto_mesh(mesh)
