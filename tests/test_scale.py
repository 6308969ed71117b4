"""Planning at scale: on a jax.sharding.AbstractMesh (device counts this machine does not have), and
the solver on the memory rows of large models."""

import jax
import pytest
from jax.sharding import AbstractMesh, AxisType

import autoshard
from autoshard.errors import InputError, MeshError
from benchmarks.models import get_model


def _plan(mesh, batch=8, **kwargs):
    spec = get_model("gpt", "tiny", batch)
    step = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=autoshard.cluster_preset("h100-2node-ib"),
                                 **kwargs)
    return step, spec, step.plan(spec.abstract_state(), spec.abstract_batch())


def test_an_abstract_mesh_plans_as_the_concrete_mesh_of_its_shape():
    # The concrete mesh's CPU devices stand in for the preset's H100s (the cluster's memory is the budget), so both
    # are planned for XLA:GPU, as an AbstractMesh is (MeshTarget.profile). Both solves must finish: the
    # probe's share of the default 10 s limit (2 s) proves this optimum in about 1 s on a quiet machine, but
    # not always beside a loaded test suite. A solve that proves its optimum returns at once, so the longer
    # limit costs nothing. The two problems must have the same optimum; the plans' own objectives are not
    # compared, since optima tie (the solver prices a reshard per reader, a plan once per value) and which
    # tied optimum a solve returns can depend on the time its heuristics got.
    _, _, abstract = _plan(AbstractMesh((2, 4), ("data", "model")), solver_time_limit=120.0)
    _, _, concrete = _plan(autoshard.make_mesh((2, 4), ("data", "model")), solver_time_limit=120.0)
    assert abstract.stats["optimal"] and concrete.stats["optimal"]
    assert abstract.stats["solver"]["bound"] == pytest.approx(concrete.stats["solver"]["bound"], rel=1e-9)
    assert abstract.in_specs == concrete.in_specs and abstract.out_specs == concrete.out_specs
    assert abstract.memory.peak_bytes == concrete.memory.peak_bytes
    assert "compiled_peak" not in abstract.stats  # nothing was compiled


def test_a_plan_on_an_abstract_mesh_cannot_run_and_says_how_to():
    step, spec, plan = _plan(AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2))
    assert isinstance(plan.mesh, AbstractMesh) and plan.mesh.axis_types == (AxisType.Auto,) * 2
    with pytest.raises(MeshError, match=r"AbstractMesh \{'data': 2, 'model': 4\}.*Fix: on a machine with 8 devices"):
        step.lower(spec.abstract_state(), spec.abstract_batch())
    with pytest.raises(MeshError, match="no devices to run it on"):
        step(spec.abstract_state(), spec.abstract_batch())


def test_a_thousand_devices_plan_from_shapes_alone():
    """GPT-125M on 1,024 devices that do not exist: the work is spread, and the memory predicted."""
    spec = get_model("gpt", "125M", 256)
    plans = {}
    for shape in ((1, 1), (64, 16)):
        step = autoshard.parallelize(spec.train_step, mesh=AbstractMesh(shape, ("data", "model")),
                                     cluster=autoshard.cluster_preset("h100-nvlink"),
                                     memory_budget=1e13 if shape == (1, 1) else None)  # one device: no fit
        plans[shape] = step.plan(spec.abstract_state(), spec.abstract_batch())
    one, many = plans[(1, 1)], plans[(64, 16)]
    assert many.mesh_info.shape == (64, 16)
    assert many.cost.flops <= one.cost.flops / 64  # the work is spread (some, like the update of replicated state, is not)
    assert many.memory.peak_bytes < one.memory.peak_bytes / 4
    assert "<div" in many._repr_html_()


def test_a_manual_abstract_mesh_is_refused():
    with pytest.raises((MeshError, InputError), match="Manual.*Fix"):  # parallelize validates its options
        _plan(AbstractMesh((2, 4), ("data", "model"), axis_types=(AxisType.Manual,) * 2))


def test_resolve_mesh_keeps_abstract_meshes_abstract():
    from autoshard.cluster import is_abstract, resolve_mesh

    got = resolve_mesh(AbstractMesh((4, 256), ("data", "model")))
    assert is_abstract(got) and tuple(got.axis_sizes) == (4, 256)
    assert not is_abstract(resolve_mesh(jax.make_mesh((2, 4), ("a", "b"))))


def test_a_milp_that_presolve_calls_infeasible_is_asked_again_without_presolve(monkeypatch):
    """HiGHS's presolve called GPT-39B's feasible memory-row MILP (1e11-byte coefficients) infeasible."""
    import numpy as np
    import scipy.optimize

    from autoshard.solver.memory import memory_rows
    from autoshard.solver.milp import solve_milp
    from autoshard.solver.problem import ShardingProblem
    from autoshard.solver.reduce import reduce_problem

    big = 1e11
    problem = ShardingProblem(node_costs=[np.array([1.0, 2.0]), np.array([1.0, 3.0])],
                              edges=np.array([[0, 1]]), edge_costs=[np.array([[0.0, np.inf], [np.inf, 0.0]])],
                              node_memory=[np.array([2 * big, big]), np.array([2 * big, big])],
                              intervals=np.array([[0, 2], [1, 3]]), memory_limit=2.5 * big)
    red = reduce_problem(problem, with_memory=True)
    rows = memory_rows(problem.intervals, problem.memory_limit, red.core_nodes, red.base_usage, True)
    calls, real = [], scipy.optimize.milp

    def flaky(c, **kw):  # what presolve did: "infeasible", until asked without it
        calls.append(kw["options"].get("presolve", True))
        if calls[-1]:
            return scipy.optimize.OptimizeResult(status=2, x=None, fun=None, message="infeasible")
        return real(c, **kw)

    monkeypatch.setattr(scipy.optimize, "milp", flaky)
    res = solve_milp(red, rows, time_limit=5.0)
    assert calls == [True, False] and res.status == "optimal"


def test_verify_compiles_the_planned_step_once_and_reports_it_apart():
    """verify=True: the whole step compiled after planning; its peak and communication against the plan's, and the
    compile's seconds, in plan.stats["verify"]. Without it, nothing is compiled for a plan this far from its budget."""
    _, _, plain = _plan(autoshard.make_mesh((2, 4), ("data", "model")))
    assert "verify" not in plain.stats and "compiled_peak" not in plain.stats
    _, _, plan = _plan(autoshard.make_mesh((2, 4), ("data", "model")), verify=True)
    report = plan.stats["verify"]
    assert report["compile_s"] > 0 and report["predicted_peak_bytes"] == plan.cost.peak_memory_bytes
    assert 0.5 < report["memory_ratio"] < 2.0, report
    # Bytes in Alpa's convention: XLA may split a reduction over (data, model) into one over each axis, which
    # counts the buffer twice, so the compiled bytes sit at or a little above the plan's.
    assert 0.9 <= report["communication_ratio"] < 1.5, report
    assert report["compiled_bytes"] and set(report["compiled_bytes"]) <= {
        "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"}


def test_verify_of_a_pipeline_reports_every_stage():
    spec = get_model("gpt", "tiny", 8)
    step = autoshard.parallelize(spec.train_step, mesh=autoshard.make_mesh((2, 4), ("data", "model")),
                                 num_microbatches=2, verify=True, pipeline=autoshard.PipelineOptions(
                                     num_stages=2, layers=2, submeshes=[(2, 2), (2, 2)], solver_time_limit=0.5))
    plan = step.plan(spec.abstract_state(), spec.abstract_batch())
    stages = plan.stats["verify"]["stages"]
    assert len(stages) == plan.num_stages == 2
    assert all(r["compiled_peak_bytes"] > 0 and 0.5 < r["memory_ratio"] < 2 for r in stages), stages


def test_verify_needs_devices_and_a_bool():
    with pytest.raises(MeshError, match="verify the plan"):
        _plan(AbstractMesh((2, 4), ("data", "model")), verify=True)
    with pytest.raises(InputError, match="verify='yes'"):
        autoshard.Options(verify="yes")


def test_a_remat_candidate_enumerated_from_a_shared_cache_has_the_strategies_of_its_own_enumeration():
    # The remat search plans its candidates with one strategy cache (PlanRequest.memo): a candidate repeats the
    # program's op signatures, so enumerating it after the program adds only the recompute's new ones, and the
    # strategies must be exactly what a call of its own prices.
    from autoshard.capture import capture_graph
    from autoshard.cost import CostModel
    from autoshard.planner import enumerate_strategies
    from autoshard.remat import find_remat_units, rematerialize
    from autoshard.spec import MeshInfo

    spec = get_model("gpt", "tiny", 8)
    program = capture_graph(spec.train_step, (spec.abstract_state(), spec.abstract_batch()))
    candidate = rematerialize(program, find_remat_units(program)[:2])[0]
    cost = CostModel.create(MeshInfo((2, 4), ("data", "model")), autoshard.cluster_preset("h100"))
    cache = {}
    enumerate_strategies(program, cost, cache=cache)
    filled = len(cache)
    shared = enumerate_strategies(candidate, cost, cache=cache)
    own = enumerate_strategies(candidate, cost)
    assert len(cache) < 1.2 * filled  # the candidate's signatures were nearly all the program's

    def priced(graph):
        return [(n.kind, [(s.name, s.compute, s.comm, s.in_specs, s.out_specs) for s in n.strategies])
                for n in graph.nodes]

    assert priced(shared) == priced(own) and shared.edges == own.edges
