"""Automatic rematerialisation: the rewrite, the joint search, and what XLA compiled."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.capture import capture_graph
from autoshard.driver import MeshTarget, PlanRequest, attempt_sharding
from autoshard.hlo import memory_stats
from autoshard.lower import make_flat_function
from autoshard.remat import RematSearch, choose_remat, find_remat_units, rematerialize
from autoshard.signature import output_ties
from autoshard.spec import replicated
from tests.helpers import assert_trees_close, run_steps

WIDTH, BATCH, LAYERS = 128, 1024, 4


def _chain_step(ws, x):
    """Identical tanh layers without skip connections, plain SGD: the activations dominate."""

    def loss(ws):
        h = x
        for w in ws:
            h = jnp.tanh(jnp.tanh(h @ w) @ w)
        return jnp.mean(h * h)

    value, grads = jax.value_and_grad(loss)(ws)
    return [w - 0.1 * g for w, g in zip(ws, grads, strict=True)], {"loss": value}


def _chain_args():
    ws = [jax.random.normal(jax.random.key(i), (WIDTH, WIDTH)) / WIDTH ** 0.5 for i in range(LAYERS)]
    x = jax.random.normal(jax.random.key(99), (BATCH, WIDTH))
    return ws, x


def _capture_chain():
    ws, x = _chain_args()
    program = capture_graph(_chain_step, (ws, x))
    ties = output_ties((ws, x), jax.eval_shape(_chain_step, ws, x))
    return program, ties, (ws, x)


def test_rewrite_recomputes_in_the_backward_and_lowers_xla_temp_memory():
    """Single device: every unit rematerialised cuts XLA's temp buffers; results equal jax.jit."""
    program, ties, args = _capture_chain()
    units = find_remat_units(program, ties, max_units=2)  # a chain keeps every unit's input: few, long units
    assert len(units) == 2
    assert all(u.insert_at > max(program.graph.ops.index(program.ops[i]) for i in u.ops) for u in units)
    mesh = autoshard.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    leaves = jax.tree.leaves(args)
    ref = jax.tree.leaves(jax.jit(_chain_step)(*args))
    temps = []
    for k in (0, len(units)):
        prog, groups = rematerialize(program, units[:k])
        specs = {v: replicated(len(getattr(a, "shape", ()))) for v, a in enumerate(prog.avals)}
        jitted = jax.jit(make_flat_function(prog, specs, {}, mesh, None, remat_groups=groups))
        temps.append(memory_stats(jitted.lower(*leaves).compile())["temp"])
        for got, want in zip(jitted(*leaves), ref, strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
    assert temps[1] < 0.75 * temps[0], temps


def _plan_fn(mesh, donated=(), profile=None):
    cluster = autoshard.cluster_preset("h100-nvlink")
    ties = _capture_chain()[1]

    def attempt(prog, budget):
        """One exact sharding solve of ``prog`` under ``budget``: an Attempt (a plan, or why none fits)."""
        request = PlanRequest(prog, mesh=mesh, cluster=cluster, donated=frozenset(donated), ties=ties,
                              profile=profile)
        return attempt_sharding(request, MeshTarget.create(request, mesh), budget, remat_split=True)

    return attempt, cluster


@pytest.mark.parametrize("fraction", [0.9, 0.8])
def test_prefix_search_matches_brute_force_over_every_remat_subset(fraction):
    """The joint optimum over (remat subset x sharding): every subset of units, each planned exactly.

    The sharding solves are exact (``stats["optimal"]``; the MILP is checked against brute force over
    strategy assignments in test_solver.py). Candidates are ranked by their decoded plans' simulated steps
    (``PlanCost.total_seconds``): the search returns the best prefix of units, and here that is the best of
    every subset too. Planned for XLA:CPU, whose memory check is the solver's row (``calibrate_row`` False): a
    subset fits when its row does, with no estimate-trusting rescue (``driver._rescued``) in between."""
    program, ties, _ = _capture_chain()
    units = find_remat_units(program, ties, max_units=4)
    assert len(units) == 4
    mesh = autoshard.make_mesh((8,), ("data",))
    plan_fn, cluster = _plan_fn(mesh, profile=autoshard.backends.CPU)
    free = plan_fn(program, None).plan
    budget = fraction * free.memory.peak_bytes  # the unconstrained plan does not fit
    best, best_prefix = None, None
    for r in range(len(units) + 1):
        for subset in itertools.combinations(units, r):
            p = plan_fn(rematerialize(program, subset)[0], budget).plan
            if p is None:  # does not fit
                continue
            assert p.stats["optimal"], "brute force needs exact sharding solves"
            if best is None or p.cost.total_seconds < best[0] - 1e-15:
                best = (p.cost.total_seconds, r)
            if subset == tuple(units[:r]) and (best_prefix is None or p.cost.total_seconds < best_prefix[0] - 1e-15):
                best_prefix = (p.cost.total_seconds, r)
    assert best is not None and best[1] > 0  # remat is needed to fit
    plan, choice = choose_remat(plan_fn, program, ties, budget=budget, flops_per_second=cluster.flops * 8,
                                max_units=4)
    assert choice is not None and choice.units == best_prefix[1] == best[1]
    assert plan.cost.total_seconds == pytest.approx(best[0], rel=1e-9)
    assert plan.stats["solver_peak"] <= budget


@pytest.fixture(scope="module")
def gpt_remat():
    from benchmarks.models import get_model

    spec = get_model("gpt", "tiny", 128)
    mesh = autoshard.make_mesh((8,), ("data",))
    cluster = autoshard.cluster_preset("h100-nvlink")
    return spec, mesh, cluster


def test_tiny_gpt_under_a_budget_that_data_parallelism_cannot_meet(gpt_remat):
    spec, mesh, cluster = gpt_remat
    state, batch = spec.abstract_state(), spec.abstract_batch()
    free = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=cluster, donate_argnums=(0,), progress=None)
    free_peak = memory_stats(free.lower(state, batch).compile())["peak"]
    budget = 8e6
    assert free_peak > budget  # the data-parallel plan does not fit
    step = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=cluster, memory_budget=budget,
                                 donate_argnums=(0,), progress=None)
    plan = step.plan(state, batch)
    assert plan.remat is not None and plan.remat.units > 0
    assert "rematerialise" in plan.summary(rich=False)
    compiled_peak = memory_stats(step.lower(state, batch).compile())["peak"]
    assert compiled_peak <= budget, (compiled_peak, plan.memory)
    real_state, real_batch = spec.init_state(jax.random.key(0)), spec.make_batch(jax.random.key(1))
    ref_state, ref_losses = run_steps(jax.jit(spec.train_step), real_state, real_batch)
    out_state, losses = run_steps(step, jax.tree.map(np.asarray, real_state), real_batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(out_state["params"], ref_state["params"], rtol=1e-5, atol=5e-5, what="params")
    # A saved plan redoes the same rewrite.
    saved = autoshard.Plan.from_json(plan.to_json(), mesh=mesh)
    assert saved.remat.units == plan.remat.units
    again = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=cluster, plan=saved, donate_argnums=(0,),
                                  progress=None)
    _, again_losses = run_steps(again, jax.tree.map(np.asarray, real_state), real_batch)
    np.testing.assert_allclose(again_losses, ref_losses, rtol=1e-5)


def test_generous_budget_plans_without_remat(gpt_remat):
    spec, mesh, cluster = gpt_remat
    step = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=cluster, memory_budget=1e9,
                                 donate_argnums=(0,), progress=None)
    plan = step.plan(spec.abstract_state(), spec.abstract_batch())
    assert plan.remat is None
    assert plan.stats["budget_bound"] is False


@pytest.mark.slow
def test_remat_with_tensor_parallel_layouts_matches_reference():
    """A 2x4 mesh on the CPU preset: the recompute runs under model-axis layouts too."""
    from benchmarks.models import get_model

    spec = get_model("gpt", "tiny", 128)
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    budget = 5.5e6  # the unconstrained plan compiles to about 10 MB
    # The solver's limits are wall-clock: a generous one keeps the plan the same on a busy machine.
    step = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=autoshard.cluster_preset("cpu-sim"),
                                 memory_budget=budget, donate_argnums=(0,), progress=None, solver_time_limit=30.0)
    state, batch = spec.abstract_state(), spec.abstract_batch()
    plan = step.plan(state, batch)
    assert plan.remat is not None and plan.remat.units > 0
    assert memory_stats(step.lower(state, batch).compile())["peak"] <= budget
    real_state, real_batch = spec.init_state(jax.random.key(0)), spec.make_batch(jax.random.key(1))
    ref_state, ref_losses = run_steps(jax.jit(spec.train_step), real_state, real_batch)
    out_state, losses = run_steps(step, jax.tree.map(np.asarray, real_state), real_batch)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(out_state["params"], ref_state["params"], rtol=1e-5, atol=5e-5, what="params")


def test_remat_replans_under_a_shrunk_budget_and_refuses_when_xla_stays_over():
    """The remat search shares compile.fit_compiled: a choice whose compiled peak is over the budget is
    planned again under the budget times budget/compiled times 0.97, twice, then refused."""
    from types import SimpleNamespace

    from autoshard.driver import Attempt

    program, ties, _ = _capture_chain()
    limits = []

    def plan_fn(prog, limit):  # more recompute costs more: the plan without remat is always chosen
        limits.append(limit)
        seconds = 1.0 + 1e-3 * len(prog.ops)
        plan = SimpleNamespace(cost=SimpleNamespace(objective=seconds, total_seconds=seconds, peak_memory_bytes=150.0))
        return Attempt(plan=plan, budget_bound=True, unconstrained_objective=0.5)

    with pytest.raises(autoshard.InfeasibleError, match="peaks at 200 bytes by XLA's memory_analysis"):
        choose_remat(plan_fn, program, ties, budget=100.0, flops_per_second=1e30,
                     check=lambda plan, prog, groups: 200.0)
    shrink = 100.0 / 200.0 * 0.97
    assert sorted(set(limits), reverse=True) == pytest.approx([100.0, 100.0 * shrink, 100.0 * shrink * shrink])


def test_observed_floor_prices_the_next_segment_at_the_least_cost_per_flop_seen():
    """Once consecutive candidates are planned, the next one's floor is the last one's unconstrained objective plus
    its segment's flops at the least cost per recomputed flop seen (times the margin); before that, none."""
    from types import SimpleNamespace

    from autoshard.remat import OBSERVED_FLOOR_SHARE

    search = RematSearch(None, None, budget=1.0)
    search.units = tuple(SimpleNamespace(matmul_flops=f) for f in (10.0, 10.0, 20.0, 10.0))
    free = {0: 1.0, 1: 1.5, 2: 1.8}  # 0.05 then 0.03 per flop
    search.attempts = {(k, 1.0): SimpleNamespace(unconstrained_objective=v) for k, v in free.items()}
    assert search.observed_floor(1, 1.0) == -np.inf  # nothing seen between candidates yet
    assert search.observed_floor(3, 1.0) == pytest.approx(1.8 + OBSERVED_FLOOR_SHARE * 0.03 * 20.0)
    assert search.observed_floor(4, 1.0) == -np.inf  # candidate 3 not planned
    assert search.observed_floor(3, 2.0) == -np.inf  # another limit's candidates say nothing here
    # a candidate refused before its probe has no unconstrained objective (NaN): it says nothing either
    search.attempts[(2, 1.0)] = SimpleNamespace(unconstrained_objective=float("nan"))
    assert search.observed_floor(3, 1.0) == -np.inf


class _CountSearch(RematSearch):
    """A remat search whose ``plan_fn`` is handed the count itself (no program rewritten)."""

    def candidate(self, k):
        return k


def _count_attempt(k: int, fits: bool, peak: float | None = None):
    """An Attempt-like answer for count ``k``: its plan (cost growing with ``k``, peak ``peak``) or an error naming
    ``peak`` as the smallest."""
    from types import SimpleNamespace

    seconds = 1.0 + 0.1 * k
    plan = SimpleNamespace(cost=SimpleNamespace(objective=seconds, total_seconds=seconds, peak_memory_bytes=peak))
    return SimpleNamespace(plan=plan if fits else None,
                           error=None if fits else autoshard.InfeasibleError("over", smallest_memory=peak),
                           budget_bound=True, unconstrained_objective=seconds)


def test_the_search_stops_at_a_count_whose_plan_the_budget_does_not_bind():
    """A fitting count whose plan is its unconstrained optimum (not budget-bound) ends the upward search: more
    recompute frees memory that buys nothing. Stand-ins whose objectives fall with the count (a time-limited
    solver's noise) would otherwise be planned one after another; while the budget binds they still are."""
    from types import SimpleNamespace

    def run(bound_from):
        planned = []

        def plan_fn(k, limit):
            planned.append(k)
            got = _count_attempt(k, k >= 3)
            seconds = 2.0 - 0.01 * k
            if got.plan is not None:
                got.plan.cost = SimpleNamespace(objective=seconds, total_seconds=seconds, peak_memory_bytes=None)
            got.budget_bound, got.unconstrained_objective = k >= bound_from, 1.0
            return got

        search = _CountSearch(plan_fn, None, budget=1.0)
        search.units = tuple(SimpleNamespace(matmul_flops=1.0) for _ in range(6))
        return search.search(1.0, flops_per_second=1e30), planned

    assert run(bound_from=99) == (3, [0, 1, 2, 3])  # from count 3 on, the unconstrained optimum fits
    assert run(bound_from=0) == (6, [0, 1, 2, 3, 4, 5, 6])


def test_the_fastest_fitting_plan_is_chosen_the_bisections_included():
    """The bisection plans larger counts on its way to the fewest that fit; when a time-limited solve found a
    faster plan at one of them, that plan is the answer, at no extra solve."""
    from types import SimpleNamespace

    planned = []

    def plan_fn(k, limit):
        planned.append(k)
        got = _count_attempt(k, k >= 23)
        if got.plan is not None:
            seconds = 1.0 if k == 64 else 2.0
            got.plan.cost = SimpleNamespace(objective=seconds, total_seconds=seconds, peak_memory_bytes=None)
        got.budget_bound = False
        return got

    search = _CountSearch(plan_fn, None, budget=1.0)
    search.units = tuple(SimpleNamespace(matmul_flops=1.0) for _ in range(64))
    assert search.search(1.0, flops_per_second=1e30) == 64
    assert 23 in planned and max(planned) == 64 and len(planned) <= 9, planned  # bisection only: not budget-bound


def test_typed_keys_among_the_residuals_are_counted_in_the_bytes_a_unit_frees():
    """A checkpointed dropout (flax's ``nn.remat`` over a layer with a typed key) keeps the key for its backward:
    a residual whose dtype numpy cannot read. The units are found, and their bytes count it (8 bytes a key)."""

    def layer(w, x, key):
        h = jnp.tanh(x @ w)
        return jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h / 0.9, 0.0)

    def step(params, batch):
        def loss(p):
            x = batch["x"]
            for w, k in zip(p, jax.random.split(batch["key"], len(p)), strict=True):
                x = jax.checkpoint(layer)(w, x, k)
            return jnp.mean(x ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        return [w - 0.1 * g for w, g in zip(params, grads, strict=True)], {"loss": value}

    params = [0.1 * jnp.ones((16, 16)) for _ in range(4)]
    program = capture_graph(step, (params, {"x": jnp.ones((8, 16)), "key": jax.random.key(0)}))
    units = find_remat_units(program, {i: i for i in range(4)})
    keys = [v for u in units for v in u.residuals if jax.dtypes.issubdtype(program.avals[v].dtype, jax.dtypes.prng_key)]
    assert keys and all(u.residual_bytes > 0 for u in units)
    assert units[0].residual_bytes == sum(8 if v in keys else program.avals[v].size * 4 for v in units[0].residuals)


def test_bisection_steps_by_the_residual_bytes_the_counts_free():
    """Segments that free unequal bytes (the last few of a language model: the final norm, the logits): the line
    between the ends' peaks is drawn over the bytes freed, so the fewest that fit are bracketed in two plans after
    the ends, where a line over the count (what the units give without their bytes) takes five."""
    from types import SimpleNamespace

    freed = [10.0] * 50 + [30.0] * 2 + [0.5] * 3

    def planned_by(weighted: bool):
        planned = []

        def plan_fn(k, limit):
            planned.append(k)
            peak = 100.0 + sum(freed[k:])
            return _count_attempt(k, peak <= limit, peak)

        search = _CountSearch(plan_fn, None, budget=110.0)
        search.units = tuple(SimpleNamespace(matmul_flops=1.0, residual_bytes=b if weighted else 0.0) for b in freed)
        return search.search(110.0, flops_per_second=1e30), planned

    fewest, planned = planned_by(True)
    assert fewest == 52 and planned[:4] == [0, 55, 52, 51], planned
    fewest, planned = planned_by(False)
    assert fewest == 52 and planned[:7] == [0, 55, 54, 53, 52, 26, 51], planned


def test_bisection_finds_the_fewest_segments_that_fit_in_log_many_plans():
    """Over many segments the search bisects for the fewest that fit, then goes upward while a candidate may
    still beat it; far fewer plans than one per count."""
    from types import SimpleNamespace

    planned = []

    def plan_fn(k, limit):
        planned.append(k)
        return _count_attempt(k, k >= 23)

    search = _CountSearch(plan_fn, None, budget=1.0)
    search.units = tuple(SimpleNamespace(matmul_flops=1.0) for _ in range(64))
    assert search.search(1.0, flops_per_second=1e30) == 23
    assert len(set(planned)) <= 10, planned
    none_fit = _CountSearch(lambda k, limit: plan_fn(-1 if k else 0, limit), None, budget=1.0)
    none_fit.units = search.units
    assert none_fit.search(1.0, flops_per_second=1e30) is None


@pytest.mark.parametrize("coarse_fits", [False, True])
def test_finer_segments_go_first_when_the_first_coarse_segment_does_not_fit(coarse_fits):
    """Coarse segments that each hold several layers: when recomputing the first one does not fit, the finer
    segments are searched first and the coarse counts after the first are never planned; when no finer count
    fits (a stand-in: recomputing every segment fits only in coarse ones), the coarse search runs after it."""
    from types import SimpleNamespace

    from autoshard.driver import Attempt
    from autoshard.remat import FINE_MAX_UNITS

    program, ties, _ = _capture_chain()
    coarse, fine = find_remat_units(program, ties, 3), find_remat_units(program, ties, FINE_MAX_UNITS)
    assert len(fine) >= 2 * len(coarse)
    names = {}
    for kind, units in (("fine", fine), ("coarse", coarse)):  # coarse last: a program both rewrites give is coarse
        for k in range(len(units) + 1):
            names[tuple(op.name for op in rematerialize(program, units[:k])[0].ops)] = (kind, k)
    planned = []

    def plan_fn(prog, limit):
        kind, k = names[tuple(op.name for op in prog.ops)]
        planned.append((kind, k))
        fits = (kind, k) == ("coarse", len(coarse)) if coarse_fits else kind == "fine" and k >= 5
        seconds = 1.0 + 0.1 * k
        plan = SimpleNamespace(cost=SimpleNamespace(objective=seconds, total_seconds=seconds, peak_memory_bytes=90.0))
        return Attempt(plan=plan if fits else None, error=None if fits else autoshard.InfeasibleError(
            "over", smallest_memory=200.0), budget_bound=True, unconstrained_objective=seconds)

    plan, choice = choose_remat(plan_fn, program, ties, budget=100.0, flops_per_second=1e30, max_units=3)
    if coarse_fits:
        assert (choice.units, choice.num_units) == (len(coarse), len(coarse))
        assert planned.index(("fine", len(fine))) < planned.index(("coarse", len(coarse))), planned
    else:
        assert (choice.units, choice.num_units, choice.max_units) == (5, len(fine), FINE_MAX_UNITS)
        assert ("coarse", 2) not in planned, planned
        assert planned[:2] == [("coarse", 0), ("coarse", 1)] and planned[2][0] == "fine", planned
        assert ("coarse", len(coarse)) not in planned, planned


def test_bisection_steps_to_where_the_peaks_cross_the_limit():
    """With the peaks of the planned ends known (a fitting plan's, the smallest an error names), the bisection
    plans the count where the line between them crosses the limit: peaks that fall evenly with the count are
    bracketed in three plans, where halving takes seven."""
    from types import SimpleNamespace

    planned = []

    def plan_fn(k, limit):
        planned.append(k)
        peak = 1000.0 - 15.0 * k
        return _count_attempt(k, peak <= limit, peak)

    search = _CountSearch(plan_fn, None, budget=655.0)
    search.units = tuple(SimpleNamespace(matmul_flops=1.0) for _ in range(64))
    assert search.search(655.0, flops_per_second=1e30) == 23
    assert planned[:4] == [0, 64, 23, 22], planned  # then upward from 23 while a candidate may beat it


def test_an_incumbent_from_another_mesh_caps_the_counts_planned():
    """With a plan from another mesh to beat, the bisection starts at the most segments whose floor (the objective
    without remat and budget, plus their matmuls at full speed) is under it; when that count does not fit, the
    search ends after that one plan, with an error that names no memory (no other lever should try)."""
    from types import SimpleNamespace

    units = tuple(SimpleNamespace(matmul_flops=1.0) for _ in range(64))
    planned = []

    def plan_fn(k, limit):
        planned.append(k)
        return _count_attempt(k, k >= 23)

    # floors: 1.0 (the plan without remat, unconstrained) + k / 10 flop/s; the incumbent 4.05 caps k at 30
    search = _CountSearch(plan_fn, None, budget=1.0, incumbent=4.05)
    search.units = units
    assert search.search(1.0, flops_per_second=10.0) == 23
    assert max(planned) == 30 and 64 not in planned, planned
    planned.clear()
    beaten = _CountSearch(plan_fn, None, budget=1.0, incumbent=3.05)  # caps k at 20, which does not fit
    beaten.units = units
    assert beaten.search(1.0, flops_per_second=10.0) is None
    assert planned == [0, 20], planned
    error = beaten.beaten(1.0)
    assert error.smallest_memory is None and "another mesh" in str(error)


def test_backward_gathers_a_sharded_weight_again_from_its_fence():
    """ZeRO-3 with remat, as jax.checkpoint does it: weights stored split over 8 devices, every matmul reading
    them whole. The backward's reads of a recomputed unit's weights go through the unit's fence, and the gather
    runs behind the barrier, so XLA gathers each weight twice (forward and backward) rather than keeping one
    gathered copy from the forward to the backward. Results equal jax.jit's."""
    from autoshard.hlo import collective_stats
    from autoshard.spec import ShardingSpec

    program, ties, args = _capture_chain()
    units = find_remat_units(program, ties, max_units=LAYERS)
    prog, groups = rematerialize(program, units)
    weights = set(program.graph.invars[:LAYERS])
    fenced = {prog.ops[i].outputs[0]: prog.ops[i].inputs[0] for g in groups for i in g.fences
              if prog.ops[i].inputs[0] in weights}
    assert set(fenced.values()) == weights
    # every backward read of a weight between the first recompute and the last residual read is of a fenced copy
    first = min(t for t, op in enumerate(prog.graph.ops) if op.index in {i for g in groups for i in g.fences})
    late = [op for op in prog.graph.ops[first:] if op.name == "dot_general"]
    assert late and all(x not in weights for op in late for x in op.inputs)

    mesh = autoshard.make_mesh((8,), ("data",))
    split = ShardingSpec(((0,), ()))
    leaves = jax.tree.leaves(args)
    want = jax.tree.leaves(jax.jit(_chain_step)(*args))
    # the fenced copies stored split and gathered by their readers, or fences that read the weights whole
    for fence_whole in (False, True):
        specs = {v: replicated(len(getattr(a, "shape", ()))) for v, a in enumerate(prog.avals)}
        specs.update({v: split for v in weights | (set() if fence_whole else set(fenced))})
        whole = {(op.index, k): replicated(2) for op in prog.graph.ops
                 if op.name == "dot_general" or (fence_whole and op.inputs[0] in weights and op.outputs[0] in fenced)
                 for k, x in enumerate(op.inputs) if x in weights or x in fenced}
        jitted = jax.jit(make_flat_function(prog, specs, whole, mesh, None, remat_groups=groups))
        stats = collective_stats(jitted.lower(*leaves).compile())
        assert stats.bytes("all-gather") >= 2 * LAYERS * WIDTH * WIDTH * 4, fence_whole
        for got, ref in zip(jitted(*leaves), want, strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)
