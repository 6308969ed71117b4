"""Multi-process runs on ``jax.distributed``: 2 processes x 4 CPU devices on localhost, gloo collectives.

The workers (tests/multihost_worker.py) run in subprocesses, since a process's device count and its
place in a distributed job are fixed when jax starts. This process (8 devices, see conftest.py)
computes the references: the single-device ``jax.jit`` run and the single-process 8-device run.

Tolerances: the processes' gradients are summed by gloo all-reduces in another order than on one
device, so float32 results differ in the last bits; losses agree to rtol 1e-5, parameters to the
atol 5e-5 that tests/helpers.py justifies for Adam.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import jax
import numpy as np
import pytest

import autoshard
from autoshard.distributed import STEP_FAILED_EXIT_CODE, ProcessLocalArgs, StepWatchdog, process_axes
from autoshard.errors import InputError, MeshError
from tests import multihost_worker as worker
from tests.helpers import assert_trees_close

ocp = pytest.importorskip("orbax.checkpoint")
pytest.importorskip("flax")

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().with_name("multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(mode: str, out: Path, *, processes: int = 2, local_devices: int = 4, extra=()):
    """Start one worker per process (stdout+stderr in out/log{i}.txt); each one's exit is timed."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={local_devices}",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    port = _free_port()
    procs = []
    for i in range(processes):
        with open(out / f"log{i}.txt", "w") as log:
            p = subprocess.Popen(
                [sys.executable, str(WORKER), mode, str(out), "--port", str(port), "--process-id", str(i),
                 "--num-processes", str(processes), *extra],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        p.ended = None
        threading.Thread(target=_time_exit, args=(p,), daemon=True).start()
        procs.append(p)
    return procs


def _time_exit(p):
    p.wait()
    p.ended = time.monotonic()


def _wait(procs, timeout: float) -> list[tuple[int | None, float]]:
    """(return code, exit time) per process; kills whatever is still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.ended is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return [(p.returncode if p.ended is not None else None, p.ended or time.monotonic()) for p in procs]


def _log(out: Path, i: int) -> str:
    return (out / f"log{i}.txt").read_text(errors="replace")


# ---- references, computed in this process --------------------------------------------------------


@pytest.fixture(scope="module")
def initial():
    spec = worker.tiny_gpt()
    return types.SimpleNamespace(spec=spec, state0=spec.init_state(jax.random.key(0)))


@pytest.fixture(scope="module")
def job(tmp_path_factory, initial):
    """The issue's recipe run by 2 processes x 4 devices for 3 steps, then an orbax checkpoint.

    The workers start here; ``job.result()`` waits for them, so that the references are computed
    while they run.
    """
    out = tmp_path_factory.mktemp("multihost")
    worker.save_initial_state(initial.state0, out)
    procs = _launch("train", out, extra=("--steps", "3"))
    done = []

    def result():
        if not done:
            codes = _wait(procs, timeout=300)
            for i, (rc, _) in enumerate(codes):
                assert rc == 0, f"process {i} exited with {rc}:\n{_log(out, i)[-4000:]}"
            results = [json.loads((out / f"result{i}.json").read_text()) for i in range(2)]
            params = [dict(np.load(out / f"params{i}.npz")) for i in range(2)]
            done.append(types.SimpleNamespace(out=out, results=results, params=params))
        return done[0]

    try:
        yield types.SimpleNamespace(result=result)
    finally:
        _wait(procs, timeout=0)  # kills any worker still running


@pytest.fixture(scope="module")
def reference(initial):
    """Single-device jax.jit run of 6 steps: losses, and the state after step 3 and step 6."""
    spec, state = initial.spec, initial.state0
    step = jax.jit(spec.train_step)
    losses, states = [], []
    for i in range(6):
        state, metrics = step(state, worker.global_batch(spec, i))
        losses.append(float(metrics["loss"]))
        states.append(state)
    return types.SimpleNamespace(spec=spec, losses=losses, state0=initial.state0, state3=states[2],
                                 state6=states[5])


def _flat(tree):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_params_close(got: dict, expected_tree, atol=5e-5):
    expected = _flat(expected_tree)
    assert sorted(got) == sorted(expected)
    for path, e in expected.items():
        np.testing.assert_allclose(got[path], e, rtol=1e-5, atol=atol, err_msg=f"params{path}")


# ---- acceptance 1: intra-op across processes ------------------------------------------------------


def test_two_processes_match_single_device_jit_and_single_process_run(job, reference):
    # The single-process 8-device run of the same recipe (mesh 2x4, full batch), while the job runs.
    spec = reference.spec
    step = autoshard.parallelize(spec.train_step, mesh=autoshard.make_mesh((2, 4), ("data", "model")),
                                 progress=None)
    state, losses = reference.state0, []
    for i in range(3):
        state, metrics = step(state, worker.global_batch(spec, i))
        losses.append(float(metrics["loss"]))

    job = job.result()
    ours = job.results[0]
    assert ours["processes"] == 2 and ours["devices"] == 8
    # Metrics are global replicated arrays: every process reads the same loss.
    assert job.results[1]["losses"] == ours["losses"] and ours["loss_replicated"]
    np.testing.assert_allclose(ours["losses"], reference.losses[:3], rtol=1e-5)
    # Outputs are global arrays: params are spread over both processes' devices.
    assert ours["global_state"]
    for gathered in job.params:
        _assert_params_close(gathered, reference.state3["params"])
    np.testing.assert_allclose(ours["losses"], losses, rtol=1e-5)
    _assert_params_close(job.params[0], state["params"])


def test_every_process_runs_process_zeros_plan_with_the_batch_split_over_processes(job):
    first, second = job.result().results
    assert first["fingerprint"] == second["fingerprint"]
    assert first["plan"] == second["plan"]  # byte-identical JSON: process 1 loaded process 0's plan
    plan = autoshard.Plan.from_json(first["plan"], mesh=autoshard.make_mesh((2, 4), ("data", "model")))
    tokens = plan.in_avals[plan.in_paths.index("[1]['tokens']")]
    assert tokens[0] == (worker.GLOBAL_BATCH, 8)  # planned for the global batch, not the local slice
    # The leading dim is pinned to "data", the axis that spans the processes (S0 = mesh axis 0).
    assert first["tokens_spec"] == ["[S0, R]"]


# ---- acceptance 3: elastic restart ---------------------------------------------------------------


def test_elastic_restart_on_four_devices_continues_the_loss_trajectory(job, reference):
    """The 8-device job's checkpoint restores onto a re-planned 4-device mesh; 3 more steps follow."""
    spec = reference.spec
    mesh = autoshard.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    step = autoshard.parallelize(spec.train_step, mesh=mesh, progress=None)
    abstract = jax.eval_shape(spec.init_state, jax.random.key(0))
    plan = step.plan(abstract, jax.eval_shape(spec.make_batch, jax.random.key(0)))
    job = job.result()
    with ocp.StandardCheckpointer() as ckpt:
        state = ckpt.restore(job.out / "ckpt", autoshard.apply_plan(plan, abstract))
    for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(plan.in_shardings[0]), strict=True):
        assert x.sharding == s and len(x.sharding.device_set) == 4
    assert_trees_close(state["params"], reference.state3["params"], rtol=1e-5, atol=5e-5, what="restored")
    losses = []
    for i in range(3, 6):
        state, metrics = step(state, worker.global_batch(spec, i))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(job.results[0]["losses"] + losses, reference.losses, rtol=1e-5)
    assert_trees_close(state["params"], reference.state6["params"], rtol=1e-5, atol=5e-5, what="params")


# ---- acceptance 4: a process that dies mid-job ----------------------------------------------------

_FAILURE_JOBS = {
    "dead": ("die", ("--step-timeout", "30")),
    "dead_no_watchdog": ("die", ("--step-timeout", "0", "--heartbeat", "8")),
    "hung": ("hang", ("--step-timeout", "8")),  # 8 s > a healthy step on a loaded machine
    "errors": ("errors", ()),
}


@pytest.fixture(scope="module")
def failure_jobs(tmp_path_factory):
    """The small 2-process jobs below, started together: they spend most of their time waiting."""
    jobs = {}
    for name, (mode, extra) in _FAILURE_JOBS.items():
        out = tmp_path_factory.mktemp(name)
        jobs[name] = (out, _launch(mode, out, extra=extra))
    try:
        yield jobs
    finally:
        for _, procs in jobs.values():
            _wait(procs, timeout=0)


def test_a_dead_process_makes_the_other_exit_with_a_clear_error(failure_jobs):
    out, procs = failure_jobs["dead"]
    (rc0, t0), (rc1, t1) = _wait(procs, timeout=120)
    log = _log(out, 0)
    assert rc1 == 3, _log(out, 1)
    assert rc0 == STEP_FAILED_EXIT_CODE, log
    assert re.search(r"autoshard: train_step call \d failed after .* on process 0 of 2\. Most likely another "
                     r"process of the job died", log), log
    # gloo notices the closed connection at once; the watchdog turns it into an exit.
    assert t0 - t1 < 20, f"process 0 took {t0 - t1:.1f} s to fail after process 1 died"


def test_without_a_watchdog_jax_still_ends_the_job_within_the_heartbeat_timeout(failure_jobs):
    """The documented fallback: the read raises (gloo), and jax aborts the process at exit."""
    out, procs = failure_jobs["dead_no_watchdog"]
    (rc0, t0), (rc1, t1) = _wait(procs, timeout=120)
    log = _log(out, 0)
    assert rc1 == 3 and rc0 not in (0, None), log
    assert "Gloo all-reduce failed" in log or "JAX distributed service detected fatal errors" in log, log
    assert t0 - t1 < 8 + 15, f"process 0 took {t0 - t1:.1f} s to end after process 1 died"


def test_a_hung_process_trips_the_step_timeout(failure_jobs):
    out, procs = failure_jobs["hung"]
    (rc0, _), _ = _wait(procs, timeout=120)
    log = _log(out, 0)
    assert rc0 == STEP_FAILED_EXIT_CODE, log
    assert "autoshard: train_step call 3 did not finish within step_timeout=8 s on process 0 of 2" in log
    assert "step 1 loss" in log and "step 2 loss" not in log


def test_every_process_raises_the_same_error_instead_of_waiting_for_the_others(failure_jobs):
    out, procs = failure_jobs["errors"]
    codes = _wait(procs, timeout=120)
    for i, (rc, _) in enumerate(codes):
        log = _log(out, i)
        assert rc == 0, log
        # Local batches of different shapes: found by an all-gather of the shapes, before planning.
        assert re.search(r"InputError: processes \[1\] called the step with argument shapes or dtypes "
                         rf"that differ from process 0's \(this is process {i}; its process-local "
                         r"leaves: \[1\]: \(\d, 16\)\)(?s:.*)Fix: give every process an equal slice", log), log
        # Planning fails on process 0: the others get its error with the plan broadcast.
        prefix = "planning failed on process 0: " if i else ""
        assert f"InfeasibleError: {prefix}no plan fits memory_budget=100 bytes per device" in log, log


# ---- pieces, in this single process ----------------------------------------------------------------


def _fake_mesh(processes):
    devices = np.vectorize(lambda p: types.SimpleNamespace(process_index=int(p)), otypes=[object])(
        np.asarray(processes))
    return types.SimpleNamespace(devices=devices, axis_names=("data", "model")[:devices.ndim])


def test_process_axes_finds_the_axes_that_span_processes():
    assert process_axes(_fake_mesh([[0, 0, 0, 0], [1, 1, 1, 1]])) == ("data",)
    assert process_axes(_fake_mesh([[0, 1], [0, 1]])) == ("model",)
    assert process_axes(_fake_mesh([[0, 0], [1, 1], [2, 2], [3, 3]])) == ("data",)
    assert process_axes(autoshard.make_mesh((2, 4), ("data", "model"))) == ()  # one process
    assert process_axes(_fake_mesh([[0, 0, 1, 1], [0, 0, 1, 1]])) == ("model",)  # a run of 2 each
    with pytest.raises(MeshError, match=r"(?s)mixes processes.*Fix: build the mesh with the processes on the "
                                        r"leading axis"):
        process_axes(_fake_mesh([[0, 1], [1, 0]]))
    with pytest.raises(MeshError, match="mixes processes"):
        process_axes(_fake_mesh([[0, 1, 0, 1]]))  # process 0's rows would not be one block


def test_process_local_arguments_are_checked_with_paths_and_a_fix():
    mesh = autoshard.make_mesh((2, 4), ("data", "model"))
    dyn = ({"w": np.ones((4, 4))}, {"x": np.ones((2, 4)), "step": np.float32(1.0)})
    with pytest.raises(InputError, match=r"argument 1 at \['step'\] is a scalar(?s:.*)Fix: pass parallelize\(\.\.\., "
                                         r"batch_argnums=\.\.\.\)"):
        ProcessLocalArgs.create(mesh, None, dyn, [0, 1], 2)
    with pytest.raises(InputError, match=r"batch_argnums names argument 5"):
        ProcessLocalArgs.create(mesh, 5, dyn, [0, 1], 2)
    local = ProcessLocalArgs.create(mesh, (1,), ({"w": np.ones((4, 4))}, {"x": np.ones((2, 4))}), [0, 1], 2)
    assert local.paths == ("[1]['x']",) and local.leaves == (1,)
    assert ProcessLocalArgs.create(mesh, (), dyn, [0, 1], 2).leaves == ()
    hints = local.hints({})
    assert list(hints) == [r"^\[1\]\['x'\]$"]


def test_step_timeout_in_a_healthy_run_changes_nothing():
    def train_step(w, x):
        return w - 0.1 * x.T @ (x @ w), (x @ w).sum()

    w, x = np.ones((8, 8), np.float32), np.arange(32, dtype=np.float32).reshape(4, 8) / 32
    step = autoshard.parallelize(train_step, mesh=autoshard.make_mesh((2, 4), ("data", "model")),
                                 step_timeout=60, progress=None)
    ours = step(w, x)
    ref = jax.jit(train_step)(w, x)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-6)
    np.testing.assert_allclose(ours[1], ref[1], rtol=1e-6)
    with pytest.raises(InputError, match="step_timeout=0"):
        StepWatchdog(0)
