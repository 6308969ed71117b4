"""Measured timelines, bubbles, and 1F1B's bounded activation memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autoshard
from autoshard.pipeline.schedule import chain_deps, max_in_flight, simulate, stage_orders
from tests.helpers import mesh


def _step(params, batch):
    def loss_fn(params):
        h = batch["x"]
        for i, w in enumerate(params):
            h = jnp.tanh((autoshard.pipeline_boundary(h) if i else h) @ w)
        return jnp.mean((h - batch["y"]) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(params)
    return [w - 0.1 * gw for w, gw in zip(params, g, strict=True)], {"loss": loss}


def _args():
    params = [jax.random.normal(jax.random.key(i), (32, 32)) * 0.2 for i in range(4)]
    return params, {"x": jnp.ones((64, 32)), "y": jnp.zeros((64, 32))}


def _pipelined(schedule, k=8):
    return autoshard.parallelize(_step, mesh=mesh("2x4"), num_microbatches=k, pipeline=autoshard.PipelineOptions(
        schedule=schedule, submeshes=[(1, 2)] * 4, solver_time_limit=0.5))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_schedule_in_flight_counts(schedule):
    orders = stage_orders(4, 8, schedule)
    counts = [max_in_flight(o) for o in orders]
    assert counts == ([4, 3, 2, 1] if schedule == "1f1b" else [8] * 4)
    sim = simulate(orders, [1.0] * 4, [2.0] * 4, chain_deps(4))
    # Both schedules have the same ideal makespan: (k + S - 1) * (f + b).
    assert sim.makespan == pytest.approx((8 + 4 - 1) * 3.0)
    assert sim.bubble_fraction == pytest.approx(3 / 11)


def test_timeline_and_memory_1f1b_vs_gpipe(tmp_path):
    params, batch = _args()
    mem = {}
    for schedule in ("1f1b", "gpipe"):
        step = _pipelined(schedule)
        tl = step.timeline(params, batch)
        fb = [e for e in tl.events if e[0] in ("F", "B")]
        assert len(fb) == 2 * 4 * 8
        assert 0.0 <= tl.bubble_fraction < 1.0
        for s in range(4):  # every stage ran every microbatch, forward before backward
            f_end = {e[2]: e[4] for e in fb if e[1] == s and e[0] == "F"}
            b_start = {e[2]: e[3] for e in fb if e[1] == s and e[0] == "B"}
            assert sorted(f_end) == sorted(b_start) == list(range(8))
            assert all(f_end[m] <= b_start[m] + 1e-9 for m in range(8))
            # Measured: no more microbatches alive on a stage than the schedule allows.
            assert tl.in_flight(s) <= (4 - s if schedule == "1f1b" else 8)
        mem[schedule] = step.stage_memory(params, batch)
        if schedule == "1f1b":
            path = tl.save_png(str(tmp_path / "timeline.png"))
            assert (tmp_path / "timeline.png").stat().st_size > 1000, path
    for s in range(4):
        one, gp = mem["1f1b"][s], mem["gpipe"][s]
        assert one["residual_bytes"] > 0
        # The compiled forward task returns at least its residuals (per device).
        assert one["output_bytes"] >= one["residual_bytes"]
        assert one["in_flight"] == 4 - s and gp["in_flight"] == 8
        assert one["activation_peak_bytes"] == (4 - s) * one["residual_bytes"] < one["all_microbatches_bytes"]
