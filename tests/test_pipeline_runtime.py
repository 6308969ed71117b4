"""Pipelined steps on sub-meshes equal the single-device jax.jit step (loss and Adam-updated params)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.hlo import collective_stats
from autoshard.plan import compiled_bytes_by_kind
from autoshard.spec import MeshInfo
from benchmarks.models import gpt, mlp
from benchmarks.models.gpt import GPTConfig
from benchmarks.models.mlp import MLPConfig
from tests.helpers import assert_trees_close, mesh

SMALL_GPT = GPTConfig(vocab_size=64, seq_len=8, hidden=32, num_layers=4, num_heads=2)
SMALL_MLP = MLPConfig(num_layers=4, input_dim=16, hidden_dim=32, output_dim=8, loss="ce")
LAYOUTS = {"2x(2,2)": [(2, 2), (2, 2)], "4x(1,2)": [(1, 2)] * 4}


def _spec(family, k):
    return mlp.build(SMALL_MLP, 16) if family == "mlp" else gpt.build(SMALL_GPT, 8 if k == 4 else 16)


def check_pipeline(spec, options, k, steps=2):
    state = spec.init_state(jax.random.key(0))
    batch = spec.make_batch(jax.random.key(1))
    ref = jax.jit(spec.train_step)
    step = autoshard.parallelize(spec.train_step, mesh=mesh("2x4"), num_microbatches=k, pipeline=options)
    ref_state, out_state = state, state
    for _ in range(steps):
        ref_state, ref_metrics = ref(ref_state, batch)
        out_state, metrics = step(out_state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    assert_trees_close(out_state["params"], ref_state["params"], rtol=1e-5, atol=5e-5, what="params")
    return step, state, batch


CASES = [(f, lay, sched, k) for f in ("mlp", "gpt") for lay in LAYOUTS for sched in ("1f1b", "gpipe") for k in (4, 8)]
FAST = {("mlp", "2x(2,2)", "1f1b", 4), ("mlp", "2x(2,2)", "gpipe", 8), ("mlp", "4x(1,2)", "1f1b", 8),
        ("mlp", "4x(1,2)", "gpipe", 4), ("gpt", "2x(2,2)", "1f1b", 4)}


@pytest.mark.parametrize("family,layout,schedule,k", [
    pytest.param(*c, marks=() if c in FAST else pytest.mark.slow, id="-".join(map(str, c))) for c in CASES])
def test_pipeline_matches_reference(family, layout, schedule, k):
    shapes = LAYOUTS[layout]
    opts = autoshard.PipelineOptions(num_stages=len(shapes), layers=len(shapes), schedule=schedule,
                                     submeshes=shapes, solver_time_limit=0.5)
    step, state, batch = check_pipeline(_spec(family, k), opts, k)
    plan = step.plan(state, batch)
    assert plan.num_stages == len(shapes)
    assert [s.mesh_shape for s in plan.stages] == shapes
    devices = [d for s in plan.stages for d in s.devices]
    assert sorted(devices) == list(range(8))
    # Each stage owns its parameters' update: no stage is idle in the backward.
    assert all(s.plan is not None for s in plan.stages)


def _boundary_step(params, batch):
    def loss_fn(params):
        h = batch["x"]
        for i, w in enumerate(params):
            if i:
                h = autoshard.pipeline_boundary(h)
            h = jnp.tanh(h @ w)
        return jnp.mean((h - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return [w - 0.1 * g for w, g in zip(params, grads, strict=True)], {"loss": loss}


def test_manual_boundaries_cut_forward_and_backward():
    params = [jax.random.normal(jax.random.key(i), (8, 8)) * 0.3 for i in range(4)]
    batch = {"x": jax.random.normal(jax.random.key(9), (16, 8)), "y": jnp.zeros((16, 8))}
    ref_params, ref_m = jax.jit(_boundary_step)(params, batch)
    step = autoshard.parallelize(_boundary_step, mesh=mesh("2x4"), num_microbatches=4,
                                 pipeline=autoshard.PipelineOptions(schedule="1f1b", solver_time_limit=0.5))
    out_params, m = step(params, batch)
    np.testing.assert_allclose(float(m["loss"]), float(ref_m["loss"]), rtol=1e-5)
    assert_trees_close(out_params, ref_params, rtol=1e-5, atol=1e-6)
    plan = step.plan(params, batch)
    assert plan.num_stages == 4 and plan.stats["manual_cut"]
    exe = step.prepared(params, batch).executable
    # Stage s updates exactly its own weight (the update tasks write params[s] on stage s).
    for s in range(4):
        assert ("B", s) in exe.part.tasks and ("F", s) in exe.part.tasks
    # The backward of stage s reads the forward residuals of stage s only through its own F task.
    for s in range(4):
        b = exe.part.tasks[("B", s)]
        producers = {exe.part.producer_task.get(v) for v in b.invars} - {None}
        assert all(p[0] != "F" or p[1] >= s for p in producers)


def test_boundary_is_identity_under_jit_and_grad():
    f = lambda x: jnp.sum(autoshard.pipeline_boundary(x) ** 2)  # noqa: E731
    x = jnp.arange(4.0)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(x), 2 * x)
    assert "pipeline_boundary" in str(jax.make_jaxpr(jax.grad(f))(x))


def _reduction_bytes(compiled) -> float:
    stats = collective_stats(compiled)
    return stats.bytes("all-reduce") + stats.bytes("reduce-scatter")


def test_gradients_reduced_once_per_step():
    """With reduce_gradients="step" (the default) no microbatch task reduces a gradient: each device adds up its
    own partial sums, and one program per stage reduces them before the update. The result equals jax.jit."""
    k = 4
    spec = _spec("gpt", k)
    shapes = LAYOUTS["2x(2,2)"]
    per_step = {}
    for mode in ("step", "microbatch"):
        # a limit the stage solves finish well inside: at 0.5 s a loaded machine cut them short and the plan
        # kept more activation reductions in the microbatch tasks (8192 bytes against the bound's 4814)
        opts = autoshard.PipelineOptions(num_stages=2, layers=2, submeshes=shapes, solver_time_limit=10.0,
                                         reduce_gradients=mode)
        step, state, batch = check_pipeline(spec, opts, k)
        exe = step.prepared(state, batch).executable
        tasks = exe.compiled_tasks()
        micro = sum(_reduction_bytes(c) for key, c in tasks.items() if key[0] in "FB")
        once = sum(_reduction_bytes(c) for key, c in tasks.items() if key[0] == "R")
        per_step[mode] = (micro, once, exe.partials)
    micro, once, partials = per_step["step"]
    micro, once, partials = per_step["step"]
    micro_mb, once_mb, partials_mb = per_step["microbatch"]
    assert all(partials) and not any(partials_mb)
    # What a microbatch still reduces is activations (statistics over the "model" axis), a small part.
    assert micro < 0.1 * micro_mb
    # Per step: k microbatches' gradient reductions against one reduction of their sums.
    assert k * micro_mb + once_mb > 3 * (k * micro + once)


def test_residuals_are_handed_over_in_the_layout_the_forward_resharded_them_to():
    """A residual that the forward task reshards for one of its readers and the backward task reads in that layout
    too is passed over in it: the plan priced that reshard once (one program merges the identical collectives),
    and the two tasks now pay it once. Each stage's compiled tasks move no more bytes than its plan predicts, and
    the step equals jax.jit. (A GPT of hidden 64 on 2 x (2, 2): both stages hand residuals over so.)"""
    k = 4
    spec = gpt.build(GPTConfig(vocab_size=64, seq_len=16, hidden=64, num_layers=4, num_heads=4), 16)
    # a limit the stage solves finish well inside (proven optimal), so the plan does not depend on the load
    opts = autoshard.PipelineOptions(num_stages=2, layers=2, submeshes=LAYOUTS["2x(2,2)"], solver_time_limit=10.0)
    step, state, batch = check_pipeline(spec, opts, k)
    exe = step.prepared(state, batch).executable
    assert any(exe.handoff)
    plan, tasks = step.plan(state, batch), exe.compiled_tasks()
    for s, handoff in enumerate(exe.handoff):
        f, b = exe.part.tasks[("F", s)], exe.part.tasks[("B", s)]
        assert set(handoff) <= set(f.outvars) & set(b.invars)
        for v, spec in handoff.items():
            assert spec != plan.stages[s].plan.value_specs[v]
            assert exe.sharding(v, s).spec == spec.to_partition_spec(MeshInfo.from_mesh(exe.meshes[s]))
        compiled: dict = {}
        for key, c in tasks.items():
            if key[1] == s:
                for kind, nbytes in compiled_bytes_by_kind(c).items():
                    compiled[kind] = compiled.get(kind, 0.0) + nbytes
        check = plan.stages[s].plan.check_against(compiled)
        assert check.compiled_bytes <= check.predicted_bytes, (s, check)


def test_handoff_layouts_pick_the_forward_reshard_every_backward_reader_can_slice():
    """Unit cases of handoff_layouts on a hand-made stage: a residual gathered by both tasks is handed over
    gathered; one the backward also reads in a layout that is no slice of the gather, or that the forward
    never reads (made only for the backward), keeps its producer's layout."""
    from types import SimpleNamespace

    from autoshard.pipeline.partition import Partition, Task, handoff_layouts
    from autoshard.spec import ShardingSpec

    split, whole, other = ShardingSpec(((0,), (1,))), ShardingSpec(((0,), ())), ShardingSpec(((1,), (0,)))

    def op(index, *inputs):
        return SimpleNamespace(index=index, inputs=inputs)

    # values 1, 2, 3 are made split by the forward and read by the backward
    f = Task(("F", 0), (op(0, 1), op(1, 2)), (), (1, 2, 3))
    b = Task(("B", 0), (op(10, 1), op(11, 2), op(12, 2), op(13, 3)), (1, 2, 3), ())
    part = Partition(1, {f.key: f, b.key: b}, {1: f.key, 2: f.key, 3: f.key}, frozenset(), ())
    plan = SimpleNamespace(value_specs={1: split, 2: split, 3: split},
                           operand_specs={(0, 0): whole, (1, 0): whole, (10, 0): whole, (11, 0): whole,
                                          (12, 0): other, (13, 0): whole})
    assert handoff_layouts(part, 0, plan, outputs=()) == {1: whole}
    assert handoff_layouts(part, 0, None, outputs=()) == {}
    assert handoff_layouts(part, 0, plan, outputs=(1,)) == {}   # a step output is read elsewhere too


def test_reduce_gradients_option_is_checked():
    with pytest.raises(autoshard.InputError, match="reduce_gradients='always'"):
        autoshard.PipelineOptions(reduce_gradients="always")


def test_stages_recompute_their_forward_with_remat():
    """remat=True on a pipeline: each stage's backward recomputes its forward from the stage's inputs, so a stage
    keeps less per in-flight microbatch; the results equal jax.jit."""
    k = 4
    spec = _spec("gpt", k)
    opts = autoshard.PipelineOptions(num_stages=2, layers=2, submeshes=LAYOUTS["2x(2,2)"], solver_time_limit=0.5)
    plain, state, batch = check_pipeline(spec, opts, k)
    step = autoshard.parallelize(spec.train_step, mesh=mesh("2x4"), num_microbatches=k, pipeline=opts, remat=True)
    ref_state, out_state = state, state
    for _ in range(2):
        ref_state, ref_metrics = jax.jit(spec.train_step)(ref_state, batch)
        out_state, metrics = step(out_state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    assert_trees_close(out_state["params"], ref_state["params"], rtol=1e-5, atol=5e-5, what="params")
    before, after = plain.plan(state, batch), step.plan(state, batch)
    assert after.stats["recompute"] and not before.stats["recompute"]
    for s0, s1 in zip(before.stages, after.stages, strict=True):
        assert s1.activation_bytes < s0.activation_bytes, (s0, s1)
    exe = step.prepared(state, batch).executable
    for s in range(2):
        f, b = exe.part.tasks[("F", s)], exe.part.tasks[("B", s)]
        assert not set(f.outvars) & set(b.invars)   # the backward reads none of its forward's values
        assert {op.index for op in f.ops if op.name == "dot_general"} & {op.index for op in b.ops}


def test_remat_true_needs_a_pipeline():
    with pytest.raises(autoshard.InputError, match="num_microbatches alone"):
        autoshard.parallelize(lambda s, b: s, num_microbatches=2, remat=True)
