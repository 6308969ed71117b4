"""The performance model's mechanisms: roofline compute, collectives on network tiers, overlap, pipelines.

These check mechanisms, not published figures (those are ``python -m benchmarks.published``)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autoshard
from autoshard.cluster import ClusterSpec, cluster_preset, from_hardware
from autoshard.collectives import Collective, CollectiveKind, Link, collective_seconds
from autoshard.cost import CostModel
from autoshard.perf import (
    HARDWARE,
    Task,
    Work,
    collective_seconds_on,
    hardware_for_device_kind,
    hardware_preset,
    matmul_efficiency,
    operand_class,
    pipeline_seconds,
    seconds,
    simulate,
)
from autoshard.perf.comm import group_link, moved_bytes
from autoshard.spec import MeshInfo

H100 = hardware_preset("h100")


# ---- compute ---------------------------------------------------------------------------------------------


def test_a_memory_bound_op_is_priced_by_its_bytes():
    acc = H100.accelerator
    adam = Work(flops=1e9, bytes=36e9, kind="vector")  # AdamW over 1.3B fp32 parameters moves about 36 GB
    assert seconds(adam, acc) == pytest.approx(36e9 / acc.stream_bandwidth)
    assert seconds(dataclasses.replace(adam, bytes=72e9), acc) == pytest.approx(2 * seconds(adam, acc))


def test_a_large_matmul_runs_at_the_sustained_rate_and_a_skinny_one_slower():
    acc = H100.accelerator
    flops = 2.0 * 8192**3
    big = Work(flops, 3 * 8192**2 * 2, "matmul", "bf16", (1, 8192, 8192, 8192))
    assert seconds(big, acc) == pytest.approx(flops / acc.matmul_rate("bf16"))
    # 100 rows in 128-row tiles: 100/128 of the rate; 2 tiles on 132 SMs: 2/132 of it
    assert matmul_efficiency(acc, 1, 100, 32768, 8192) == pytest.approx(100 / 128)
    assert matmul_efficiency(acc, 1, 128, 256, 8192) == pytest.approx(2 / acc.compute_units)
    # fp8 operands run at the fp8 rate, twice the peak of bf16
    assert acc.matmul_rate("fp8") > acc.matmul_rate("bf16")


def test_a_tpu_pads_to_its_mxu():
    tpu = hardware_preset("tpu-v5p").accelerator
    assert matmul_efficiency(tpu, 1, 4096, 4096, 100) == pytest.approx(100 / 128)


@pytest.mark.parametrize(("dtypes", "cls"), [((jnp.bfloat16, jnp.bfloat16), "bf16"),
                                             ((jnp.float32, jnp.float32), "tf32"),
                                             ((jnp.float8_e4m3fn, jnp.float8_e5m2), "fp8"),
                                             ((jnp.float16, jnp.bfloat16), "bf16")])
def test_operand_classes(dtypes, cls):
    assert operand_class(dtypes) == cls


# ---- collectives -----------------------------------------------------------------------------------------


def test_a_collective_across_nodes_costs_what_its_slowest_tier_costs():
    nvlink, ib = H100.tiers
    inside = group_link(H100, 8, 8)
    across = group_link(H100, 16, 16)
    assert inside.tier == "nvlink" and inside.bandwidth == pytest.approx(nvlink.bandwidth * nvlink.efficiency)
    assert across.tier == "ib" and across.bandwidth == pytest.approx(ib.bandwidth * ib.efficiency)
    b = 1e9
    t = collective_seconds_on(H100, "all-gather", b, group=16, span=16)
    assert t == pytest.approx(across.latency + 15 / 16 * b / across.bandwidth)
    # one device per node (a data axis outside a tensor axis of 8): still the NICs
    assert group_link(H100, 4, 32).tier == "ib"


def test_the_planner_prices_mesh_axes_by_the_tiers_they_cross():
    info = MeshInfo((2, 8), ("data", "model"))
    model = CostModel.create(info, cluster_preset("h100"), platform="gpu")
    inside = model.collective_time(Collective("all-reduce", (1,), 1e8))
    across = model.collective_time(Collective("all-reduce", (0,), 1e8))
    both = model.collective_time(Collective("all-reduce", (0, 1), 1e8))
    assert model.stream(Collective("all-reduce", (1,), 1e8)) == "nvlink"
    assert model.stream(Collective("all-reduce", (0,), 1e8)) == "ib"
    assert inside < across < both  # 16 devices move more than 2 on the same slowest link


def test_a_cluster_of_two_nodes_puts_its_first_axis_across_them():
    spec = cluster_preset("h100-2node-ib")
    info = MeshInfo((2, 4), ("data", "model"))
    model = CostModel.create(info, spec, platform="gpu")
    assert model.stream(Collective("all-gather", (0,), 1e6)) == "ib"
    assert model.stream(Collective("all-gather", (1,), 1e6)) == "nvlink"


def test_moved_bytes_per_kind():
    assert moved_bytes("all-reduce", 8.0, 4) == pytest.approx(2 * 3 / 4 * 8)
    assert moved_bytes("all-gather", 8.0, 4) == pytest.approx(3 / 4 * 8)
    assert moved_bytes("collective-permute", 8.0, 2) == 8.0
    assert moved_bytes("all-gather", 8.0, 1) == 0.0


def test_the_cpu_profile_is_unchanged():
    """Without a hardware model (cpu-sim) compute is flops at one rate and a collective Alpa's formula."""
    spec = cluster_preset("cpu-sim")
    assert spec.hardware is None
    info = MeshInfo((2, 4), ("data", "model"))
    model = CostModel.create(info, spec, platform="cpu")
    assert not model.overlap
    assert model.compute_time(1e9) == pytest.approx(1e9 / spec.flops)
    assert model.work_time(Work(flops=1e9, bytes=1e12)) == pytest.approx(1e9 / spec.flops)
    c = Collective("all-gather", (1,), 1e6)
    assert model.collective_time(c) == pytest.approx(
        collective_seconds(CollectiveKind.ALL_GATHER, 1e6, [Link(4, spec.latency, 1 / spec.bandwidth)]))


# ---- overlap ---------------------------------------------------------------------------------------------


def test_overlap_shortens_a_step_with_independent_compute():
    tasks = [Task("matmul", "compute", 3.0), Task("all-gather", "nvlink", 2.0),
             Task("next matmul", "compute", 3.0, deps=(1,))]
    assert simulate(tasks).makespan == 6.0
    assert simulate(tasks, overlap=False).makespan == 8.0
    assert simulate(tasks).exposed == 0.0
    # a collective whose result the very next op needs cannot hide
    chained = [Task("matmul", "compute", 3.0), Task("all-reduce", "nvlink", 2.0, deps=(0,)),
               Task("next", "compute", 3.0, deps=(1,))]
    assert simulate(chained).makespan == 8.0 and simulate(chained).exposed == 2.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["compute", "nvlink", "ib"]), st.floats(0, 10),
                          st.lists(st.integers(0, 30), max_size=3)), min_size=1, max_size=30))
def test_overlap_never_lengthens_a_step(spec):
    tasks = [Task(str(i), stream, sec, tuple(sorted({d for d in deps if d < i})))
             for i, (stream, sec, deps) in enumerate(spec)]
    serial = simulate(tasks, overlap=False)
    parallel = simulate(tasks)
    assert parallel.makespan <= serial.makespan + 1e-9
    assert all(p <= s + 1e-9 for p, s in zip(parallel.start, serial.start, strict=True))


def test_a_task_may_not_depend_on_a_later_one():
    with pytest.raises(ValueError, match="depends on task 1, which comes later"):
        simulate([Task("a", "compute", 1.0, deps=(1,)), Task("b", "compute", 1.0)])


# ---- pipelines -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), [(1, 4), (2, 4), (4, 8), (8, 64)])
def test_1f1b_of_equal_stages_is_the_closed_form(p, m):
    t = pipeline_seconds([1.0] * p, [2.0] * p, microbatches=m)
    assert t.step == pytest.approx((m + p - 1) * 3.0)
    assert t.bubble == pytest.approx((p - 1) / (m + p - 1))


def test_interleaving_shrinks_the_bubble_by_the_virtual_stages():
    plain = pipeline_seconds([1.0] * 4, [2.0] * 4, microbatches=8)
    inter = pipeline_seconds([1.0] * 4, [2.0] * 4, microbatches=8, virtual=2)
    assert inter.step == pytest.approx((8 + 3 / 2) * 3.0)
    assert inter.step < plain.step


def test_gpipe_and_the_slowest_stage_bound_a_pipeline():
    t = pipeline_seconds([1.0, 2.0, 1.0], [2.0, 4.0, 2.0], microbatches=6, schedule="gpipe")
    assert t.step >= 6 * 6.0  # the slowest stage runs every microbatch's forward and backward
    with_links = pipeline_seconds([1.0] * 3, [2.0] * 3, microbatches=6, transfer=0.5)
    assert with_links.step > pipeline_seconds([1.0] * 3, [2.0] * 3, microbatches=6).step
    with pytest.raises(ValueError, match="one forward and backward time per stage"):
        pipeline_seconds([1.0], [1.0, 2.0], microbatches=2)


def test_the_runtime_simulation_and_the_model_agree():
    from autoshard.pipeline.schedule import chain_deps, stage_orders
    from autoshard.pipeline.schedule import simulate as simulate_schedule

    orders = stage_orders(4, 8, "1f1b")
    runtime = simulate_schedule(orders, [1.0] * 4, [2.0] * 4, chain_deps(4), transfer=[0.1] * 3)
    model = pipeline_seconds([1.0] * 4, [2.0] * 4, microbatches=8, transfer=0.1)
    assert runtime.makespan == pytest.approx(model.step)


# ---- hardware --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "name"), [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                            ("NVIDIA A100-SXM4-40GB", "a100-40"),
                                            ("NVIDIA A100-SXM4-80GB", "a100-80"), ("TPU v5 lite", "tpu-v5e"),
                                            ("TPU v5p", "tpu-v5p"), ("TPU v4", "tpu-v4"), ("NVIDIA B200", "b200")])
def test_the_preset_follows_the_device_kind(kind, name):
    assert hardware_for_device_kind(kind).name == name


def test_every_preset_has_memory_rates_and_a_network():
    for name, hw in HARDWARE.items():
        acc = hw.accelerator
        assert acc.hbm_bytes > 0 and acc.matmul_rate("bf16") < acc.peak_flops["bf16"], name
        assert hw.tiers[-1].span is None, name


def test_a_cluster_with_hardware_round_trips_through_json():
    spec = from_hardware("h200", nodes=2)
    again = ClusterSpec.from_json(spec.to_json())
    assert again.hardware is spec.hardware and again.nodes == 2 and again.memory == spec.memory


# ---- the planner on a hardware model ---------------------------------------------------------------------


def _mlp(params, x):
    h = jax.nn.gelu(x @ params["w1"])
    return jnp.mean((h @ params["w2"]) ** 2)


def test_a_plan_carries_its_work_and_its_overlapped_step():
    mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    params = {"w1": jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16),
              "w2": jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)}
    x = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
    step = autoshard.parallelize(jax.grad(_mlp), mesh=mesh, cluster=cluster_preset("h100"), progress=None)
    plan = step.plan(params, x)
    cost = plan.cost
    assert cost.flops > 0 and cost.hbm_bytes > 0
    # the step overlaps: never more than compute plus communication, never less than either
    assert max(cost.compute_seconds, cost.communication_seconds) <= cost.total_seconds + 1e-12
    assert cost.total_seconds <= cost.compute_seconds + cost.communication_seconds + 1e-12
    by_kind = plan.stats["perf"]["by_kind"]
    assert by_kind["matmul"]["flops"] >= 3 * 2 * 512 * 1024 * 4096 / 8 * 0.99  # fwd + bwd, split 8 ways


def test_attention_scores_are_found_and_kept_on_chip():
    from autoshard.attention import attention_scores
    from autoshard.capture import capture_graph

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).sum()

    qkv = [jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.float32)] * 3
    program = capture_graph(jax.grad(attention, argnums=(0, 1, 2)), qkv)
    scores = attention_scores(program)
    shapes = {tuple(program.avals[v].shape) for v in scores}
    assert (2, 4, 256, 256) in shapes
    assert all(math.prod(s) >= 256 * 256 for s in shapes)
    mlp = capture_graph(jax.grad(_mlp), ({"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32),
                                          "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32)},
                                         jax.ShapeDtypeStruct((512, 64), jnp.float32)))
    assert attention_scores(mlp) == frozenset()


def test_an_abstract_mesh_is_planned_for_its_clusters_platform():
    from jax.sharding import AbstractMesh

    from autoshard.backends import CPU, GPU, TPU, resolve_profile

    mesh = AbstractMesh((2, 4), ("data", "model"))
    assert resolve_profile(None, mesh, autoshard.cluster_preset("tpu-v5p")) is TPU
    assert resolve_profile(None, mesh, autoshard.cluster_preset("h200")) is GPU
    assert resolve_profile(None, mesh, autoshard.cluster_preset("cpu-sim")) is GPU  # no hardware: as before
    assert resolve_profile(CPU, mesh, autoshard.cluster_preset("tpu-v5p")) is CPU  # the user's profile wins


def test_a_backend_that_fuses_attention_keeps_the_scores_out_of_memory():
    """On a GPU/TPU profile the score matrices stay on chip: the estimate and the solver's row give them no
    buffer, and without fused attention both count them (here the scores dominate: 2 x 4 x 1024^2 fp32)."""
    from autoshard.backends import GPU
    from autoshard.capture import capture_graph
    from autoshard.cost import CostModel
    from autoshard.memory import estimate_memory
    from autoshard.planner import build_problem, enumerate_strategies, merge_followers
    from autoshard.spec import MeshInfo, ShardingSpec

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).sum()

    qkv = [jax.ShapeDtypeStruct((2, 1024, 4, 64), jnp.float32)] * 3
    program = capture_graph(jax.grad(attention, argnums=(0, 1, 2)), qkv)
    info = MeshInfo((1,), ("data",))
    specs = {v: ShardingSpec(((),) * len(a.shape)) for v, a in enumerate(program.avals) if hasattr(a, "shape")}
    scores_bytes = 2 * 4 * 1024 * 1024 * 4
    unfused = dataclasses.replace(GPU, fused_attention=False)
    fused_peak = estimate_memory(program, specs, info, profile=GPU).peak_bytes
    unfused_peak = estimate_memory(program, specs, info, profile=unfused).peak_bytes
    assert unfused_peak - fused_peak >= scores_bytes
    assert fused_peak < scores_bytes

    def row_peak(profile):
        cost = CostModel.create(info, autoshard.cluster_preset("h100"), profile=profile)
        merged = merge_followers(enumerate_strategies(program, cost), cost, program.avals)
        built = build_problem(merged, program, cost, memory_limit=1e12)
        return max(float(m.min()) for m in built.problem.node_memory if m.size)

    assert row_peak(unfused) >= scores_bytes > row_peak(GPU)


def test_fused_attention_scores_in_a_scanned_layer_take_no_memory_either():
    """The scores of an attention inside ``lax.scan`` (layers stacked, as MaxText runs them) are kept on chip where
    the backend fuses attention, as at the top level: a scan body's peak counted them (MaxText-52B on 192 TPU v4,
    10 sequences of 2,048 a device, 64 heads: 10.7 GB of fp32 scores in its recomputed layer)."""
    from autoshard.backends import GPU
    from autoshard.capture import capture_graph
    from autoshard.memory import estimate_memory
    from autoshard.spec import MeshInfo, ShardingSpec

    def layers(q, k, v):
        def layer(h, _):
            s = jnp.einsum("bqhd,bkhd->bhqk", h, k) / 8.0
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v), None

        return jax.lax.scan(jax.checkpoint(layer), q, None, length=2)[0].sum()

    qkv = [jax.ShapeDtypeStruct((2, 1024, 4, 64), jnp.float32)] * 3
    program = capture_graph(jax.grad(layers, argnums=(0, 1, 2)), qkv)
    info = MeshInfo((1,), ("data",))
    specs = {v: ShardingSpec(((),) * len(a.shape)) for v, a in enumerate(program.avals) if hasattr(a, "shape")}
    scores_bytes = 2 * 4 * 1024 * 1024 * 4
    fused = estimate_memory(program, specs, info, profile=GPU).peak_bytes
    unfused = estimate_memory(program, specs, info, profile=dataclasses.replace(GPU, fused_attention=False)).peak_bytes
    assert unfused - fused >= scores_bytes and fused < scores_bytes
