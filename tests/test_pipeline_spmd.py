"""The SPMD pipeline runtime (one program, ppermute over a stage axis) equals the single-device jax.jit step,
on one process and across two processes (2 x 4 CPU devices, gloo collectives)."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.hlo import collective_stats
from autoshard.pipeline.spmd import SpmdPipelineExecutable, allocate
from benchmarks.models import mlp
from benchmarks.models.mlp import MLPConfig
from tests.helpers import assert_trees_close, mesh
from tests.pipeline_spmd_worker import spmd_options, tiny_gpt_batch, tiny_gpt_init, tiny_gpt_step

ROOT = Path(__file__).resolve().parent.parent
SMALL_MLP = MLPConfig(num_layers=4, input_dim=16, hidden_dim=32, output_dim=8, loss="ce")


def _model(family, batch_size=16):
    """``(state, batch, train_step)``: the benchmark MLP (flax) or the worker's pure-JAX tiny GPT (batch 32)."""
    if family == "gpt":
        return tiny_gpt_init(), tiny_gpt_batch(), tiny_gpt_step
    spec = mlp.build(SMALL_MLP, batch_size)
    return spec.init_state(jax.random.key(0)), spec.make_batch(jax.random.key(1)), spec.train_step


def _two_steps_match(step, state, batch, ref, ref_losses):
    """Two steps of ``step`` equal the reference's losses and parameters; returns the state after them."""
    out, losses = state, []
    for _ in range(2):
        out, m = step(out, batch)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(out["params"], ref["params"], rtol=1e-5, atol=5e-5, what="params")
    return out


def _reference(state, batch, train_step, steps):
    ref, losses = state, []
    for _ in range(steps):
        ref, m = jax.jit(train_step)(ref, batch)
        losses.append(float(m["loss"]))
    return ref, losses


@pytest.mark.parametrize("family,schedule,batch_size,stages", [
    ("mlp", "gpipe", 16, 2), ("gpt", "1f1b", 32, 2),
    pytest.param("mlp", "1f1b", 16, 4, marks=pytest.mark.slow), pytest.param("gpt", "gpipe", 32, 2,
                                                                             marks=pytest.mark.slow)])
def test_spmd_pipeline_matches_reference(family, schedule, batch_size, stages, monkeypatch):
    state, batch, train_step = _model(family, batch_size)
    ref, ref_losses = _reference(state, batch, train_step, 2)
    step = autoshard.parallelize(train_step, mesh=mesh("2x4"), num_microbatches=4,
                                 pipeline=spmd_options(schedule, stages=stages))
    # No device_put between stage sub-meshes: arrays are only ever placed on the whole (stage, *sub-mesh) mesh.
    targets = []
    device_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, s=None, **kw: targets.append(s) or device_put(x, s, **kw))
    out, losses = state, []
    for _ in range(2):
        out, m = step(out, batch)
        losses.append(float(m["loss"]))
    monkeypatch.undo()
    assert targets and all(len(t.device_set) == 8 for t in targets)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(out["params"], ref["params"], rtol=1e-5, atol=5e-5, what="params")
    entry = step.prepared(state, batch)
    exe = entry.executable
    assert isinstance(exe, SpmdPipelineExecutable) and entry.plan.stats["runtime"] == "spmd"
    # Activations move inside the one program: collective-permutes over the stage axis, no device_put.
    hlo = exe.compiled(jax.tree.leaves((state, batch)))[0].as_text()
    assert "collective-permute" in hlo
    assert exe.mesh.devices.shape == (stages, 1, 8 // stages) and exe.mesh.axis_names == ("stage", "data", "model")
    assert exe.num_ticks <= 2 * (4 + stages - 1)   # one F and one B tick per microbatch and stage, plus fill
    with pytest.raises(autoshard.InputError, match="runtime='device_put'"):
        step.timeline(state, batch)


WIDE_MLP = MLPConfig(num_layers=4, input_dim=16, hidden_dim=256, output_dim=8, loss="ce")


def _stage_groups(exe):
    """Each stage's logical device ids (what HLO replica groups name: positions in the mesh, stage-major)."""
    R = exe.mesh.devices[0].size
    return [frozenset(range(s * R, (s + 1) * R)) for s in range(exe.S)]


@pytest.mark.parametrize("sub,schedule", [((2, 2), "gpipe"), ((1, 2), "1f1b"),
                                          pytest.param((2, 2), "1f1b", marks=pytest.mark.slow),
                                          pytest.param((1, 2), "gpipe", marks=pytest.mark.slow)])
def test_spmd_stages_run_their_intra_op_plans(sub, schedule):
    """2 stages x ``sub``: a memory budget that replicated weights exceed makes each stage's plan split them; the
    one SPMD program takes the weights in those layouts and runs the plan's collectives inside the pipeline loop,
    over one stage's devices only. Two steps equal jax.jit."""
    spec = mlp.build(WIDE_MLP, 8)
    state, batch, train_step = spec.init_state(jax.random.key(0)), spec.make_batch(jax.random.key(1)), spec.train_step
    ref, ref_losses = _reference(state, batch, train_step, 2)
    n = 2 * sub[0] * sub[1]
    devices = mesh("2x4") if n == 8 else autoshard.make_mesh((1, n), ("data", "model"), devices=jax.devices()[:n])
    # a limit no stage solve reaches (each is proven optimal first), so load cannot leave a stage unsplit
    opts = autoshard.PipelineOptions(num_stages=2, layers=2, schedule=schedule, submeshes=[sub] * 2,
                                     solver_time_limit=10.0, runtime="spmd")
    # under a budget below the state the runtime holds between steps, the step says so
    tight = autoshard.parallelize(train_step, mesh=devices, num_microbatches=4, pipeline=opts, memory_budget=480_000)
    with pytest.warns(UserWarning, match="of train state per device between steps"):
        tight.plan(state, batch)
    # a budget between the least a stage can take and what it takes replicated binds the stage plans
    budget = 2_200_000
    step = autoshard.parallelize(train_step, mesh=devices, num_microbatches=4, pipeline=opts, memory_budget=budget)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert max(st.memory_bytes for st in step.plan(state, batch).stages) <= budget
    out = _two_steps_match(step, state, batch, ref, ref_losses)
    exe = step.prepared(state, batch).executable
    assert exe.mesh.devices.shape == (2, *sub)
    split = [sh for sh in exe.in_shardings if sh.spec != jax.sharding.PartitionSpec()]
    assert split, "no stage plan split a weight"
    # The new state keeps the layout it came in with: the next step takes it as it is.
    for leaf, sh in zip(jax.tree.leaves(out), exe.out_shardings[:len(jax.tree.leaves(out))], strict=False):
        assert leaf.sharding.is_equivalent_to(sh, leaf.ndim)
    # what the plan reports the state takes per device is what the arrays hold; most of it is split over the
    # stages too, so a device holds less than its stage's share of every weight and moment
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(out))
    assert step.plan(state, batch).stats["spmd_state_bytes"] == held
    invars = exe.analysis.full.graph.invars
    whole_over_stages = sum(  # the same leaves in their stage layouts, not split over "stage"
        math.prod(jax.sharding.NamedSharding(exe.mesh, exe.state_pspec[invars[i]]).shard_shape(x.shape)) * x.itemsize
        for i, x in enumerate(jax.tree.leaves(out)))
    assert held < 0.75 * whole_over_stages
    assert any("stage" in str(sh.spec) for sh in exe.in_shardings)
    stats = collective_stats(exe.compiled(jax.tree.leaves((state, batch)))[0])
    in_loop = [c for c in stats.collectives if c.kind != "collective-permute" and c.multiplicity == exe.num_ticks]
    assert in_loop, "no intra-op collective inside the pipeline loop"
    stages = _stage_groups(exe)
    for c in in_loop:
        assert c.groups and all(any(set(g) <= st for st in stages) for g in c.groups), (c, stages)


def test_1f1b_stashes_fewer_microbatches_than_gpipe():
    """Slots are reused once dead: 1F1B keeps at most S - s microbatches alive on stage s, GPipe all k."""
    state, batch, train_step = _model("mlp")
    mem = {}
    for schedule in ("1f1b", "gpipe"):
        step = autoshard.parallelize(train_step, mesh=mesh("2x4"), num_microbatches=4, pipeline=spmd_options(schedule))
        step.plan(state, batch)   # builds the executable; nothing is compiled until it runs
        exe = step.prepared(state, batch).executable
        acc = exe.acc_len["float32"]
        mem[schedule] = exe.mem_len["float32"] - acc
    assert 0 < mem["1f1b"] < mem["gpipe"]


def test_auto_runtime_is_device_put_on_one_process():
    state, batch, train_step = _model("mlp")
    step = autoshard.parallelize(train_step, mesh=mesh("2x4"), num_microbatches=4,
                                 pipeline=spmd_options("1f1b", runtime="auto"))
    assert step.plan(state, batch).stats["runtime"] == "device_put"


def test_spmd_runtime_errors():
    with pytest.raises(autoshard.InputError, match="runtime='nccl'"):
        autoshard.PipelineOptions(runtime="nccl")
    state, batch, train_step = _model("mlp")
    opts = autoshard.PipelineOptions(num_stages=3, layers=3, submeshes=[(1, 4), (1, 2), (1, 2)], runtime="spmd",
                                     solver_time_limit=0.2)
    step = autoshard.parallelize(train_step, mesh=mesh("2x4"), num_microbatches=4, pipeline=opts)
    with pytest.raises(autoshard.MeshError, match="same sub-mesh shape on every stage"):
        step.plan(state, batch)


def _per_example_step(params, batch):
    def loss_fn(params):
        h = jnp.tanh(jnp.tanh(batch["x"] @ params[0]) @ params[1])
        return jnp.mean(h ** 2), h

    (loss, h), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return [w - 0.1 * g for w, g in zip(params, grads, strict=True)], {"loss": loss, "h": h}


def test_spmd_refuses_per_example_outputs():
    params = [jnp.eye(8) * 0.5, jnp.eye(8) * 0.5]
    batch = {"x": jnp.ones((16, 8))}
    step = autoshard.parallelize(_per_example_step, mesh=mesh("2x4"), num_microbatches=4,
                                 pipeline=spmd_options("1f1b"))
    with pytest.raises(autoshard.InputError, match=r"output .*'h'.* is computed per microbatch"):
        step.plan(params, batch)


def test_allocate_reuses_dead_slots():
    # b lives after a dies: it takes a's place; c overlaps both and goes after them.
    placed, length = allocate([("a", "f", 4, 0, 1), ("b", "f", 4, 2, 3), ("c", "f", 2, 0, 3)])
    assert placed["a"] == placed["b"] == 0 and placed["c"] == 4 and length == {"f": 6}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("layout,schedule,batch,stage_procs,sub", [
    ("blocks", "gpipe", "local", [[0], [1]], (2, 2)),
    ("rows", "1f1b", "full", [[0], [1]], (1, 4)),
    pytest.param("4stages", "1f1b", "local", [[0], [0], [1], [1]], (1, 2), marks=pytest.mark.slow),
    pytest.param("straddle", "1f1b", "full", [[0, 1], [0, 1]], (1, 4), marks=pytest.mark.slow)])
def test_pipeline_across_processes(tmp_path, layout, schedule, batch, stage_procs, sub):
    """2 stages, one per process (2 processes x 4 CPU devices, gloo), 4 microbatches, two steps, each stage under
    its intra-op plan (process 0's, received by process 1); ``batch="local"``: each process passes its own half
    of the batch (batch_argnums).

    Slow variants: two stages per process; stages whose devices straddle both processes."""
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    procs = []
    try:
        for i in range(2):
            with open(logs[i], "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(ROOT / "tests" / "pipeline_spmd_worker.py"), str(i), str(port), str(tmp_path),
                     layout, schedule, batch],
                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        ref, ref_losses = _reference(tiny_gpt_init(), tiny_gpt_batch(), tiny_gpt_step, 2)   # while they start
        deadline = time.monotonic() + 240
        # A worker that fails leaves the other waiting in a collective: stop at the first failure.
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"worker {i} exited with {p.returncode}:\n{logs[i].read_text(errors='replace')[-4000:]}"
    ref_leaves = jax.tree.leaves(ref["params"])
    plans = [str(np.load(tmp_path / f"proc{i}.npz")["stage_plans"]) for i in range(2)]
    assert plans[0] == plans[1]   # one plan everywhere
    for i in range(2):
        out = np.load(tmp_path / f"proc{i}.npz")
        assert str(out["runtime"]) == "spmd"
        assert out["stage_procs"].tolist() == stage_procs   # rows: stage s lives on process s
        assert int(out["permutes"]) > 0 and tuple(out["sub"]) == sub
        # the stage plans' collectives run inside the pipeline loop, over one stage's devices each
        assert int(out["intra"]) > 0 and bool(out["within"])
        assert "device_put between device sets of different processes" in str(out["refused"])
        np.testing.assert_allclose(out["losses"], ref_losses, rtol=1e-5)
        for j, r in enumerate(ref_leaves):
            np.testing.assert_allclose(out[f"p{j}"], np.asarray(r), rtol=1e-5, atol=5e-5)


def test_spmd_stage_search_keeps_one_submesh_shape():
    """With the sub-meshes left to the stage DP, runtime='spmd' gets stages of one shape (the DP run per shape
    that tiles the mesh), and the step still equals jax.jit."""
    state, batch, train_step = _model("gpt")
    ref, ref_losses = _reference(state, batch, train_step, 1)
    opts = autoshard.PipelineOptions(num_stages=2, layers=2, runtime="spmd", solver_time_limit=0.2,
                                     stage_cost="estimate")
    step = autoshard.parallelize(train_step, mesh=mesh("2x4"), num_microbatches=4, pipeline=opts)
    shapes = {st.mesh_shape for st in step.plan(state, batch).stages}
    assert len(shapes) == 1 and math.prod(next(iter(shapes))) == 4
    out, m = step(state, batch)
    np.testing.assert_allclose(float(m["loss"]), ref_losses[0], rtol=1e-5)
    assert_trees_close(out["params"], ref["params"], rtol=1e-5, atol=5e-5, what="params")


def _keyed_step(state, batch):
    def loss_fn(p):
        return jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["p"])
    params = jax.tree.map(lambda w, g: w - 0.1 * g, state["p"], grads)
    return {"p": params, "rng": jax.random.fold_in(state["rng"], 1)}, {"loss": loss}


def test_spmd_state_may_hold_a_typed_prng_key():
    """A typed key in the state (as nnx's Rngs carry) has no numeric buffer to split over the stages: it stays whole
    and comes out as jax.jit makes it."""
    state = {"p": {"w1": jnp.full((8, 16), 0.1), "w2": jnp.full((16, 4), 0.1)}, "rng": jax.random.key(0)}
    batch = {"x": jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8) / 100}
    opts = autoshard.PipelineOptions(num_stages=2, layers=2, submeshes=[(1, 4)] * 2, solver_time_limit=10.0,
                                     runtime="spmd")
    step = autoshard.parallelize(_keyed_step, mesh=mesh("2x4"), num_microbatches=4, pipeline=opts)
    out, m = step(state, batch)
    ref, ref_m = jax.jit(_keyed_step)(state, batch)
    np.testing.assert_allclose(float(m["loss"]), float(ref_m["loss"]), rtol=1e-5)
    assert_trees_close(out["p"], ref["p"], rtol=1e-5, atol=1e-6, what="params")
    np.testing.assert_array_equal(jax.random.key_data(out["rng"]), jax.random.key_data(ref["rng"]))


def test_spmd_gradients_reduced_once_per_step():
    """runtime="spmd" with reduce_gradients="step": the gradients a stage's plan reduces leave the pipeline loop
    unreduced and are reduced once after it; two steps equal jax.jit, and the loop's reductions shrink to a
    tenth of those with reduce_gradients="microbatch" (here: none left)."""
    state, batch, train_step = _model("gpt")
    ref, ref_losses = _reference(state, batch, train_step, 2)
    in_loop = {}
    for mode in ("step", "microbatch"):
        opts = autoshard.PipelineOptions(num_stages=2, layers=2, submeshes=[(2, 2)] * 2, solver_time_limit=0.2,
                                         runtime="spmd", reduce_gradients=mode)
        step = autoshard.parallelize(train_step, mesh=mesh("2x4"), num_microbatches=4, pipeline=opts)
        _two_steps_match(step, state, batch, ref, ref_losses)
        exe = step.prepared(state, batch).executable
        stats = collective_stats(exe.compiled(jax.tree.leaves((state, batch)))[0])
        in_loop[mode] = (sum(c.bytes * c.multiplicity for c in stats.collectives
                             if c.kind in ("all-reduce", "reduce-scatter") and c.multiplicity == exe.num_ticks),
                         sum(len(p) for p in exe.partials))
    assert in_loop["step"][1] > 0 and in_loop["microbatch"][1] == 0
    assert in_loop["step"][0] < 0.1 * in_loop["microbatch"][0], in_loop


@pytest.mark.slow
def test_spmd_stages_recompute_their_forward_with_remat():
    """runtime="spmd" with remat=True: the backward branches recompute the forward, the stages' buffers keep
    only their inputs per microbatch (smaller than the residuals), and two steps equal jax.jit."""
    state, batch, train_step = _model("gpt")
    ref, ref_losses = _reference(state, batch, train_step, 2)
    sizes = {}
    for remat in (False, True):
        opts = autoshard.PipelineOptions(num_stages=2, layers=2, submeshes=[(2, 2)] * 2, solver_time_limit=0.2,
                                         runtime="spmd", schedule="gpipe")
        step = autoshard.parallelize(train_step, mesh=mesh("2x4"), num_microbatches=4, pipeline=opts, remat=remat)
        _two_steps_match(step, state, batch, ref, ref_losses)
        exe = step.prepared(state, batch).executable
        sizes[remat] = sum(exe.mem_len.values()) - sum(exe.acc_len.values())
    assert sizes[True] < 0.7 * sizes[False], sizes


def test_remat_auto_recomputes_only_when_the_pipeline_does_not_fit():
    """remat="auto" (the default) on a pipeline: no recompute while the stages fit the memory budget; under a
    budget that only recomputing stages meet, they recompute (plan.stats["recompute"]), and nothing warns."""
    state, batch, train_step = _model("gpt")
    opts = autoshard.PipelineOptions(num_stages=2, layers=2, submeshes=[(2, 2)] * 2, solver_time_limit=0.2,
                                     schedule="gpipe")

    def planned(**kw):
        return autoshard.parallelize(train_step, mesh=mesh("2x4"), num_microbatches=8, pipeline=opts,
                                     **kw).plan(state, batch)

    keep, recompute = planned(remat=False), planned(remat=True)
    assert not keep.stats["recompute"] and recompute.stats["recompute"]
    high = max(st.memory_bytes for st in keep.stages)
    low = max(st.memory_bytes for st in recompute.stages)
    assert not planned(memory_budget=2 * high).stats["recompute"]
    tight = 1.02 * low   # the recomputing stages fit; without recompute, no plan does
    with pytest.warns(UserWarning, match="has no plan within"):
        over = planned(remat=False, memory_budget=tight)
    assert max(st.memory_bytes for st in over.stages) > tight
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert planned(memory_budget=tight).stats["recompute"]


def test_a_stage_branch_reshards_without_permuting_devices():
    """Inside a stage's ``lax.switch`` branch, a value whose layout swaps the order of the sub-mesh axes is
    resharded through their common part (gather, then slice): the direct reshard is a collective-permute,
    which only that stage's devices reach (it hung the nnx LLaMA pipeline)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from autoshard.cluster import make_mesh
    from autoshard.hlo import permutes_in_branches
    from autoshard.lower import common_part
    from autoshard.spec import MeshInfo, ShardingSpec

    m = make_mesh((2, 2, 2), ("stage", "data", "model"))
    info = MeshInfo.from_mesh(m)
    src, dst = ShardingSpec(((1, 2), ())), ShardingSpec(((2, 1), ()))
    mid = common_part(src, dst)
    assert mid == ShardingSpec(((), ()))
    assert common_part(ShardingSpec(((1,), (2,))), ShardingSpec(((1, 2), ()))) == ShardingSpec(((1,), ()))

    def program(via):
        def branch(x):
            x = jax.lax.with_sharding_constraint(x, NamedSharding(m, src.to_partition_spec(info)))
            for spec in via:
                x = jax.lax.with_sharding_constraint(x, NamedSharding(m, spec.to_partition_spec(info)))
            return jax.lax.with_sharding_constraint(x * 2, NamedSharding(m, P()))   # leaves gathered

        def per_stage(x):
            return jax.lax.switch(jax.lax.axis_index("stage"), [branch, lambda x: x + 1], x)

        return jax.shard_map(per_stage, mesh=m, in_specs=P("stage"), out_specs=P("stage"), axis_names={"stage"},
                             check_vma=False)

    x = jax.ShapeDtypeStruct((2 * 8, 4), jnp.float32, sharding=NamedSharding(m, P("stage")))
    direct = permutes_in_branches(jax.jit(program([dst])).lower(x).compile())
    routed = permutes_in_branches(jax.jit(program([mid, dst])).lower(x).compile())
    assert direct and not routed, (direct, routed)
