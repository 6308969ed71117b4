"""The planner's choice of mesh shape: ``mesh=None`` (all devices) and a device count (``mesh=64``).

Over several nodes the candidates are MaxText's 3-D ``(data, fsdp, tensor)`` shapes with data across nodes
(``autoshard.cluster.candidate_meshes``); within one node, every 2-D factorization, as before."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AbstractMesh

import autoshard
from autoshard.cluster import SEARCH_AXES, candidate_meshes
from tests.helpers import assert_trees_close

H100 = autoshard.cluster_preset("h100-nvlink")


def _shapes(meshes):
    return [(tuple(m.axis_sizes), tuple(m.axis_names)) for m in meshes]


def test_candidates_over_nodes_are_data_across_nodes_fsdp_and_tensor_within():
    got = _shapes(candidate_meshes(64, H100, abstract=True))
    assert got == [((8, 8, 1), SEARCH_AXES), ((8, 4, 2), SEARCH_AXES), ((8, 2, 4), SEARCH_AXES),
                   ((8, 1, 8), SEARCH_AXES)]
    # 256 H100s: the tensor degree stays within the 8-GPU node
    assert [s for s, _ in _shapes(candidate_meshes(256, H100, abstract=True))] == [
        (32, 8, 1), (32, 4, 2), (32, 2, 4), (32, 1, 8)]
    # a cluster of nodes named by ClusterSpec.nodes: 8 devices in 2 nodes of 4
    two = autoshard.cluster_preset("h100-2node-ib")
    assert [s for s, _ in _shapes(candidate_meshes(8, two, abstract=True))] == [(2, 4, 1), (2, 2, 2), (2, 1, 4)]


def test_candidates_within_one_node_are_every_2d_factorization():
    two_d = [((a, 8 // a), ("data", "model")) for a in (1, 2, 4, 8)]
    assert _shapes(candidate_meshes(8, H100, abstract=True)) == two_d
    assert _shapes(candidate_meshes(8, None, abstract=True)) == two_d
    cpu = autoshard.cluster_preset("cpu-sim")  # no link tiers
    assert _shapes(candidate_meshes(64, cpu, abstract=True)) == [((a, 64 // a), ("data", "model"))
                                                                  for a in (1, 2, 4, 8, 16, 32, 64)]
    # an Explicit mesh's names (a model written for them) keep the 2-D shapes
    assert {n for _, n in _shapes(candidate_meshes(64, H100, axis_names=("dp", "mp"), abstract=True))} == {
        ("dp", "mp")}
    concrete = candidate_meshes(8, None)
    assert all(isinstance(m, jax.sharding.Mesh) for m in concrete)


def _mlp():
    tx = optax.sgd(0.1, momentum=0.9)  # Adam divides by tiny second moments: reduction order shows in ulps

    def loss_fn(params, batch):
        h = jax.nn.relu(batch["x"] @ params["w1"])
        return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (256, 1024)) * 0.05, "w2": jax.random.normal(k2, (1024, 256)) * 0.05}
    state = {"params": params, "opt": tx.init(params)}
    batch = {"x": jax.random.normal(k3, (64, 256)), "y": jnp.zeros((64, 256))}
    return step, state, batch


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def test_a_device_count_plans_the_fastest_of_the_candidate_shapes():
    step, state, batch = _mlp()
    args = _abstract(state), _abstract(batch)
    plan = autoshard.parallelize(step, mesh=64, cluster=H100, progress=None, solver_time_limit=2.0).plan(*args)
    assert isinstance(plan.mesh, AbstractMesh) and plan.mesh.size == 64
    assert tuple(plan.mesh.axis_names) == SEARCH_AXES
    each = [autoshard.parallelize(step, mesh=m, cluster=H100, progress=None, solver_time_limit=2.0).plan(*args)
            for m in candidate_meshes(64, H100, abstract=True)]
    assert plan.cost.total_seconds <= min(p.cost.total_seconds for p in each) * (1 + 1e-9)
    # a plan for 64 devices this machine does not have: planning only
    with pytest.raises(autoshard.MeshError, match="AbstractMesh"):
        autoshard.parallelize(step, mesh=64, cluster=H100, progress=None)(state, batch)


def test_mesh_none_over_two_nodes_runs_a_3d_mesh_and_matches_jax_jit():
    step, state, batch = _mlp()
    f = autoshard.parallelize(step, cluster=autoshard.cluster_preset("h100-2node-ib"), progress=None,
                              solver_time_limit=2.0)
    plan = f.plan(state, batch)
    assert tuple(plan.mesh.axis_names) == SEARCH_AXES and tuple(plan.mesh.axis_sizes)[0] == 2
    got_state, got = f(state, batch)
    want_state, want = jax.jit(step)(state, batch)
    assert_trees_close(got_state, want_state)
    assert_trees_close(got, want, what="metrics")


def test_a_device_count_is_refused_where_it_cannot_be_honoured():
    step, *_ = _mlp()
    with pytest.raises(autoshard.InputError, match="device count must be positive"):
        autoshard.parallelize(step, mesh=0)
    with pytest.raises(autoshard.InputError, match="mesh.*device count"):
        autoshard.parallelize(step, mesh=64, num_microbatches=2)
    with pytest.raises(autoshard.InputError, match="not a jax.sharding.Mesh"):
        autoshard.parallelize(step, mesh=True)
