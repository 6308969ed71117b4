"""Host offload: optimizer state moves to pinned_host memory only when no sharding fits the device budget."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import autoshard
from autoshard.capture import capture_graph
from autoshard.compile import compile_plan
from autoshard.hlo import memory_stats
from benchmarks.models import get_model
from tests.helpers import alpha_beta_h100, assert_trees_close, run_steps

# MLP h1024 (25 MB of parameters, 75 MB of state with Adam) on 8 devices: fully sharded, the
# device needs about 13 MB; with the optimizer state in host memory, about 10 MB (predicted).
BUDGET = 11e6


def _cluster(name):
    """The memory levers' tests plan on an alpha-beta H100 (tests.helpers.alpha_beta_h100): what they check
    is the levers' mechanics under a budget, with the plans the old yardstick made."""
    return alpha_beta_h100() if name == "h100-nvlink" else autoshard.cluster_preset(name)


def _step(budget, cluster="h100-nvlink"):
    spec = get_model("mlp", "h1024", 32)
    mesh = autoshard.make_mesh((8,), ("data",))
    step = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=_cluster(cluster),
                                 memory_budget=budget, donate_argnums=(0,))
    return spec, step


def _runs_like_reference(spec, step, reference=None, *, rtol=1e-5, opt_state=True):
    """Two steps of ``step`` from real state equal two of ``reference`` (default: jax.jit of the step)."""
    reference = reference if reference is not None else jax.jit(spec.train_step)
    real_state, batch = spec.init_state(jax.random.key(0)), spec.make_batch(jax.random.key(1))
    ref_state, ref_losses = run_steps(reference, real_state, batch)
    out_state, losses = run_steps(step, jax.tree.map(np.asarray, real_state), batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    assert_trees_close(out_state["params"], ref_state["params"], atol=5e-5, what="params")
    if opt_state:
        assert_trees_close(out_state["opt_state"], ref_state["opt_state"], atol=1e-6, what="opt_state")
    return out_state


def test_sharding_alone_cannot_meet_the_budget(monkeypatch):
    """Without offload the smallest reachable peak is above BUDGET: offload is what makes it fit."""
    monkeypatch.setattr("autoshard.offload.offload_candidates", lambda program, ties: ())
    spec, step = _step(BUDGET)
    with pytest.raises(autoshard.InfeasibleError, match="raise memory_budget to (at least|about)") as err:
        step.plan(spec.abstract_state(), spec.abstract_batch())
    assert err.value.smallest_memory > BUDGET


def test_budget_only_host_memory_meets_offloads_optimizer_state_and_matches_reference():
    spec, step = _step(BUDGET)
    state, b = spec.abstract_state(), spec.abstract_batch()
    plan = step.plan(state, b)
    assert plan.offloaded and all("opt_state" in p for p in plan.offloaded)
    assert plan.memory.peak_bytes <= BUDGET and plan.memory.host_bytes > 0
    assert "offloaded to host memory" in plan.summary(rich=False)
    # Priced at the host link: every offloaded shard moves in and out once per step.
    host_bandwidth = _cluster("h100-nvlink").host_bandwidth
    assert plan.stats["host_transfer_seconds"] == pytest.approx(2 * plan.memory.host_bytes / host_bandwidth)
    shardings = jax.tree.leaves(plan.in_shardings)
    assert {shardings[i].memory_kind for i in plan.host_inputs} == {"pinned_host"}

    stats = memory_stats(step.lower(state, b).compile())
    assert stats["peak"] <= BUDGET  # device memory only: argument + output + temp - alias
    # XLA holds exactly the offloaded shards in host memory (the planner's host line).
    assert stats["host_argument"] == pytest.approx(plan.memory.host_bytes)
    assert stats["host_output"] == pytest.approx(plan.memory.host_bytes)

    out_state = _runs_like_reference(spec, step)
    host = {jax.tree.leaves(out_state)[i].sharding.memory_kind for i in plan.host_inputs}
    assert host == {"pinned_host"}  # the updated state stays in host memory for the next step


def test_generous_budget_offloads_nothing():
    spec, step = _step(200e6)
    state, b = spec.abstract_state(), spec.abstract_batch()
    plan = step.plan(state, b)
    assert plan.offloaded == () and plan.memory.host_bytes == 0
    stats = memory_stats(step.lower(state, b).compile())
    assert stats["host_argument"] == 0 and stats["host_output"] == 0


def test_budget_below_offload_reports_the_smallest_reachable():
    spec, step = _step(4e6)
    with pytest.raises(autoshard.InfeasibleError, match=r"even with all \d+ optimizer-state leaves offloaded"
                                                        r".*raise memory_budget to at least") as err:
        step.plan(spec.abstract_state(), spec.abstract_batch())
    smallest = err.value.smallest_memory
    assert 4e6 < smallest < BUDGET
    # The budget the error names is one the planner can meet.
    _, step = _step(smallest * 1.01)
    plan = step.plan(spec.abstract_state(), spec.abstract_batch())
    # The solver's memory row meets it (plan.memory is the finer estimate of autoshard.memory).
    assert plan.offloaded and plan.stats["solver_peak"] <= smallest * 1.01


def test_plan_json_keeps_the_offload():
    spec, step = _step(BUDGET)
    plan = step.plan(spec.abstract_state(), spec.abstract_batch())
    again = autoshard.Plan.from_json(plan.to_json(), mesh=plan.mesh)
    assert again.host_inputs == plan.host_inputs and again.host_outputs == plan.host_outputs
    saved = autoshard.parallelize(spec.train_step, plan=again, donate_argnums=(0,))
    stats = memory_stats(saved.lower(spec.abstract_state(), spec.abstract_batch()).compile())
    assert stats["host_argument"] == pytest.approx(plan.memory.host_bytes)


def test_offload_with_bf16_precision_matches_the_cast_reference():
    """SGD with momentum (its trace is the optimizer state): Adam's first steps are lr * sign(g), which
    turns the bf16 rounding noise of another summation order into +-lr wherever g is near zero."""
    from autoshard.precision import cast_matmuls

    spec = get_model("mlp", "h1024", 32, optimizer="sgd")
    step = autoshard.parallelize(spec.train_step, mesh=autoshard.make_mesh((8,), ("data",)),
                                 cluster=_cluster("h100-nvlink"), memory_budget=BUDGET,
                                 donate_argnums=(0,), precision="bf16")
    state, b = spec.abstract_state(), spec.abstract_batch()
    plan = step.plan(state, b)
    assert plan.offloaded
    assert memory_stats(step.lower(state, b).compile())["peak"] <= BUDGET
    # The sharded sums run in another order; a 1-ulp fp32 difference sometimes rounds to another
    # bf16 value (2^-9 relative): the second loss moves by ~7e-6 relative here.
    _runs_like_reference(spec, step, jax.jit(cast_matmuls(spec.train_step, widen=True)), rtol=2e-5, opt_state=False)


def test_gpt_offload_matches_reference():
    """Attention, embeddings and layer norms: every optimizer-state shape round-trips through host memory.

    The offload is written into a saved plan (every optimizer-state leaf, ``count`` included): on a
    model this small the planner's memory row is too coarse for a budget that only offload meets
    (the MLP tests above cover the choice); this checks the lowering and the numbers."""
    import json

    spec = get_model("gpt", "tiny", 8)
    step = autoshard.parallelize(spec.train_step, mesh=autoshard.make_mesh((8,), ("data",)), donate_argnums=(0,))
    state, b = spec.abstract_state(), spec.abstract_batch()
    saved = json.loads(step.plan(state, b).to_json())
    saved["host_inputs"] = [i for i, p in enumerate(saved["in_paths"]) if "['opt_state']" in p]
    saved["host_outputs"] = [saved["out_paths"].index(saved["in_paths"][i]) for i in saved["host_inputs"]]
    plan = autoshard.Plan.from_json(json.dumps(saved), mesh=autoshard.make_mesh((8,), ("data",)))
    offloading = autoshard.parallelize(spec.train_step, plan=plan, donate_argnums=(0,))
    stats = memory_stats(offloading.lower(state, b).compile())
    assert stats["host_argument"] > 0 and stats["host_output"] > 0
    out_state = _runs_like_reference(spec, offloading)
    host = {jax.tree.leaves(out_state)[i].sharding.memory_kind for i in plan.host_inputs}
    assert host == {"pinned_host"}


def test_reports_show_the_host_memory():
    from autoshard.report import memory_breakdown, plan_html, rich_summary

    spec, step = _step(BUDGET)
    plan = step.plan(spec.abstract_state(), spec.abstract_batch())
    mem = memory_breakdown(plan)
    assert mem["host"] == plan.memory.host_bytes > 0
    assert "host memory (offloaded)" in plan_html(plan)
    pytest.importorskip("rich")
    assert "host memory (offloaded)" in rich_summary(plan)


def test_memory_stats_moves_host_buffers_out_of_the_device_numbers():
    """XLA:CPU counts pinned_host buffers as device bytes and reports host_* = 0; memory_stats splits them."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    m = autoshard.make_mesh((8,), ("data",))
    dev, host = NamedSharding(m, P("data")), NamedSharding(m, P("data"), memory_kind="pinned_host")

    def update(w, mu, g):
        mu = 0.9 * jax.device_put(mu, dev) + g
        return w - 0.1 * mu, jax.device_put(mu, host)

    shard = 128 * 256 * 4  # one device's shard of a (1024, 256) f32 array
    args = [jax.ShapeDtypeStruct((1024, 256), np.float32, sharding=s) for s in (dev, host, dev)]
    compiled = jax.jit(update, out_shardings=(dev, host), donate_argnums=(0, 1)).lower(*args).compile()
    stats = memory_stats(compiled)
    assert stats["host_argument"] == stats["host_output"] == stats["host_alias"] == shard
    assert stats["argument"] == 2 * shard and stats["alias"] == shard
    raw = compiled.memory_analysis()
    assert raw.argument_size_in_bytes == 3 * shard  # what XLA:CPU itself reports


@pytest.mark.parametrize("needed", [1, 3, 7, 16])
def test_offload_search_finds_a_small_fitting_set(monkeypatch, needed):
    """A fake solver that fits iff at least ``needed`` leaves are offloaded (16 equal leaves, shortfall of 2)."""
    from types import SimpleNamespace

    from autoshard.errors import InfeasibleError
    from autoshard.offload import plan_with_offload

    avals = {v: jax.ShapeDtypeStruct((8, 1024), np.float32) for v in range(16)}  # 32 KiB, 4 KiB per device
    program = SimpleNamespace(avals=avals, graph=SimpleNamespace(invars=tuple(range(16))))
    monkeypatch.setattr("autoshard.offload.offload_candidates", lambda program, ties: tuple(range(16)))
    tried = []

    def solve_with(offloaded, limit):
        tried.append(len(offloaded))
        if len(offloaded) < needed:
            raise InfeasibleError("too big", smallest_memory=1e6)
        return len(offloaded)

    error = InfeasibleError("no fit", smallest_memory=100e3 + 2 * 4096)
    chosen = plan_with_offload(solve_with, program, {}, error, budget=100e3, num_devices=8)
    assert needed <= chosen <= 2 * needed and len(tried) <= 8, tried
    if needed <= 2:
        assert chosen == 2 and tried == [2]  # the shortfall's own guess fits: one solve


def test_offload_search_reports_the_smallest_when_nothing_fits(monkeypatch):
    from types import SimpleNamespace

    from autoshard.errors import InfeasibleError
    from autoshard.offload import plan_with_offload

    program = SimpleNamespace(avals={0: jax.ShapeDtypeStruct((8,), np.float32)}, graph=SimpleNamespace(invars=(0,)))
    monkeypatch.setattr("autoshard.offload.offload_candidates", lambda program, ties: (0,))

    def solve_with(offloaded, limit):
        raise InfeasibleError("too big", smallest_memory=5e5)

    # A solver that reached a peak under the budget but gave up on time must still terminate.
    with pytest.raises(InfeasibleError, match="even with all 1 optimizer-state leaves") as err:
        plan_with_offload(solve_with, program, {}, InfeasibleError("x", smallest_memory=9e5), budget=1e6,
                          num_devices=8)
    assert err.value.smallest_memory == 5e5


def test_an_offload_plan_over_budget_once_compiled_is_never_returned():
    """Just above the solver's floor its memory row is optimistic (2.3 MB planned, 9.1 MB compiled,
    before the check): the planner compiles the offload plan and re-plans or refuses, never returns it."""
    from benchmarks.models import mlp

    spec = mlp.build(mlp.MLPConfig(num_layers=4, input_dim=512, hidden_dim=512, output_dim=512), 256)
    state, b = spec.abstract_state(), spec.abstract_batch()
    with pytest.raises(autoshard.InfeasibleError) as err:
        _step_for(spec, 1.0).plan(state, b)
    budget = err.value.smallest_memory * 1.02
    step = _step_for(spec, budget)
    try:
        step.plan(state, b)
    except autoshard.InfeasibleError as e:
        assert "the best offload plan found has a device peak" in str(e) and e.smallest_memory > budget
        return
    assert memory_stats(step.lower(state, b).compile())["peak"] <= budget


def _step_for(spec, budget):
    return autoshard.parallelize(spec.train_step, mesh=autoshard.make_mesh((8,), ("data",)), progress=None,
                                 cluster=_cluster("h100-nvlink"), memory_budget=budget,
                                 donate_argnums=(0,), accumulate=False)


def test_the_error_names_the_lever_that_came_closest(monkeypatch):
    """Remat compiled just over the budget, offload further over: the error raised is remat's. A solver-row
    bound (unchecked) is not compared with compiled peaks; with no checked error the last lever's stands."""
    from autoshard import driver
    from autoshard.errors import InfeasibleError

    shard = InfeasibleError("shard", smallest_memory=3.0e6)  # the solver's row: optimistic, never chosen
    remat = InfeasibleError("remat", smallest_memory=4.598e6, checked=True)
    offload = InfeasibleError("offload", smallest_memory=5.884e6, checked=True)

    def failing(error):
        return lambda request, on, limit, previous: driver.Attempt(error=error)

    def levers(*errors):
        return tuple(failing(e) for e in errors)

    monkeypatch.setattr(driver, "LEVERS", levers(shard, remat, offload))
    with pytest.raises(InfeasibleError, match="^remat$"):
        driver.run_levers(None, None, None)
    monkeypatch.setattr(driver, "LEVERS", levers(shard, InfeasibleError("last", smallest_memory=9e6)))
    with pytest.raises(InfeasibleError, match="^last$"):
        driver.run_levers(None, None, None)


def test_calibrated_row_scale_is_the_models_peak_over_xlas():
    from autoshard import driver
    from benchmarks.models import mlp

    spec = mlp.build(mlp.MLPConfig(num_layers=2, input_dim=256, hidden_dim=256, output_dim=256), 64)
    mesh = autoshard.make_mesh((8,), ("data",))
    program = capture_graph(spec.train_step, (spec.abstract_state(), spec.abstract_batch()))
    request = driver.PlanRequest(program, mesh=mesh, cluster=_cluster("h100-nvlink"), memory_budget=1e9)
    on = driver.MeshTarget.create(request, mesh)
    scale = driver.calibrated_row_scale(request, on)
    free = driver.attempt_sharding(request, dataclasses.replace(on, budget=None), None).plan
    compiled = memory_stats(compile_plan(program, free))["peak"]
    assert scale == pytest.approx(free.memory.peak_bytes / compiled, rel=1e-9)
    abstract = dataclasses.replace(on, mesh=jax.sharding.AbstractMesh((8,), ("data",)))
    assert driver.calibrated_row_scale(request, abstract) is None  # nothing to compile


def test_a_pessimistic_model_retries_with_a_scaled_row_and_never_returns_a_plan_over_budget(monkeypatch):
    """A model that over-predicts: the levers run again with the row scaled; every plan is still checked."""
    from autoshard import driver
    from benchmarks.models import mlp

    spec = mlp.build(mlp.MLPConfig(num_layers=4, input_dim=512, hidden_dim=512, output_dim=512), 256)
    state, b = spec.abstract_state(), spec.abstract_batch()
    with pytest.raises(autoshard.InfeasibleError) as floor:
        _step_for(spec, 1.0).plan(state, b)
    calls = []
    monkeypatch.setattr(driver, "calibrated_row_scale", lambda request, on: calls.append(on.budget) or 1.5)
    budget = 0.9 * floor.value.smallest_memory
    step = _step_for(spec, budget)
    try:
        step.plan(state, b)
    except autoshard.InfeasibleError as e:
        assert e.smallest_memory > budget
    else:
        assert memory_stats(step.lower(state, b).compile())["peak"] <= budget
    assert calls == [budget]


@pytest.mark.parametrize("row,compiled,expected", [
    (170e3, 203e3, 0.99 * 170e3),         # the row well inside the limit: just below it, or the plan comes back
    (150e3, 300e3, 200e3 * 200 / 300),    # the ratio shrinks further than the row: the ratio's limit
])
def test_fit_compiled_replans_just_below_the_refused_plans_row(row, compiled, expected):
    """A refused plan's next limit is the shrunk budget, or just under the plan's own row peak when that is less;
    not the row shrunk by the ratio too, which over-shrinks where the row is far under the check."""
    from types import SimpleNamespace

    from autoshard.compile import BELOW_ROW, fit_compiled

    limits = []

    def search(limit):
        limits.append(limit)
        return SimpleNamespace(stats={"solver_peak": row}, peak=compiled if len(limits) == 1 else 190e3)

    plan = fit_compiled(search, lambda p: p.peak, 200e3, limit=200e3, refuse=AssertionError)
    assert plan.peak == 190e3 and limits[0] == 200e3
    assert limits[1] == pytest.approx(min(200e3 * 200e3 / compiled, BELOW_ROW * row)) == pytest.approx(expected)
