"""Run the tiny configs for real and compare their losses with a single-device ``jax.jit`` reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import baselines
from benchmarks.models import get_model
from benchmarks.suite.cases import Case, data_parallel_mesh
from benchmarks.suite.measure import make_mesh

STEPS = 2
LOSS_RTOL = 1e-5


def _losses(step, state, batch, n=STEPS) -> list[float]:
    out = []
    for _ in range(n):
        state, metrics = step(state, batch)
        out.append(float(metrics["loss"]))
    return out


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _run_compiled(plan, compiled):
    """Run the executable autoshard's step was measured with, placing the inputs as the plan says."""

    def run(state, batch):
        flat = jax.tree.leaves(jax.device_put((state, batch), plan.in_shardings))
        return jax.tree_util.tree_unflatten(plan.out_tree, compiled(*flat))

    return run


def execute_case(
    case: Case, num_devices: int, autoshard_steps: dict, megatron_mesh, executables: dict | None = None
) -> list[dict]:
    """``STEPS`` train steps of every method on real arrays; one record per method (and preset).

    ``executables`` maps ``(method, mesh)`` to the baseline executables that were measured; they
    are run as they are (no second compile). Others are compiled here.
    """
    executables = executables or {}
    devices = jax.devices()[:num_devices]
    spec = get_model(case.family, case.config, case.batch_size(num_devices))
    state = spec.init_state(jax.random.key(0))
    batch = spec.make_batch(jax.random.key(1))
    reference = _losses(jax.jit(spec.train_step), state, batch)
    rules = baselines.MEGATRON_RULES_BY_FAMILY.get(case.family, baselines.MEGATRON_RULES)

    runs = []
    for method in ("data_parallel", "zero2", "fsdp", "megatron"):
        shape = megatron_mesh if method == "megatron" else data_parallel_mesh(num_devices)
        if shape is None or shape[1] == 1 and method == "megatron":
            continue  # the best "Megatron" was data parallelism, already run
        kw = {"rules": rules} if method == "megatron" else {}
        mesh = make_mesh(tuple(shape), devices)
        jitted, st_sh, b_sh = baselines.jit_baseline(spec.train_step, state, batch, mesh, method, **kw)
        run = executables.get((method, tuple(shape)), jitted)  # the measured executable donates its state
        # Donation may free buffers that device_put shares with its source: place a copy.
        placed = jax.device_put(_copy(state), st_sh), jax.device_put(batch, b_sh)
        runs.append((method, None, list(shape), run, placed))
    for preset, (step, plan, compiled) in autoshard_steps.items():
        run = step if compiled is None else _run_compiled(plan, compiled)
        runs.append(("autoshard", preset, list(plan.mesh.devices.shape), run, (_copy(state), batch)))

    records = []
    for method, preset, shape, step, (st, b) in runs:
        record = {"model": case.name, "method": method, "preset": preset, "mesh": shape, "devices": num_devices,
                  "losses": None, "reference_losses": reference, "max_rel_err": None, "ok": False, "error": None}
        try:
            losses = _losses(step, st, b)
            err = float(np.max(np.abs(np.array(losses) - np.array(reference)) / np.abs(np.array(reference))))
            record.update(losses=losses, max_rel_err=err, ok=err <= LOSS_RTOL)
        except Exception as e:  # noqa: BLE001 - report and continue with the other methods
            record["error"] = f"{type(e).__name__}: {e}"[:300]
        records.append(record)
    return records
