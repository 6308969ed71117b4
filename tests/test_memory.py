"""Predicted per-device memory against XLA's memory_analysis of the compiled plan."""

from __future__ import annotations

import pytest

import autoshard
from autoshard.hlo import memory_stats
from benchmarks.models import get_model

CASES = [("mlp", "h1024", 32, ()), ("gpt", "tiny", 64, (0,)), ("gpt_scan", "tiny", 8, ())]


@pytest.mark.parametrize("family,config,batch,donate", CASES, ids=[f"{c[0]}-{c[2]}-d{len(c[3])}" for c in CASES])
def test_predicted_peak_memory_tracks_xla(family, config, batch, donate):
    spec = get_model(family, config, batch)
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    step = autoshard.parallelize(spec.train_step, mesh=mesh, cluster=autoshard.cluster_preset("cpu-sim"),
                                 donate_argnums=donate)
    state, b = spec.abstract_state(), spec.abstract_batch()
    plan = step.plan(state, b)
    compiled = step.lower(state, b).compile()
    xla_peak = memory_stats(compiled)["peak"]
    predicted = plan.cost.peak_memory_bytes
    assert predicted == pytest.approx(xla_peak, rel=0.25), (predicted, xla_peak, plan.memory.breakdown)
    assert plan.memory.peak_bytes == predicted
    assert set(plan.memory.breakdown) >= {"parameters", "optimizer_state", "inputs", "outputs", "intermediates"}
