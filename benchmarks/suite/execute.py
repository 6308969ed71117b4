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


def execute_case(case: Case, num_devices: int, autoshard_steps: dict, megatron_mesh) -> list[dict]:
    """``STEPS`` train steps of every method on real arrays; one record per method (and preset)."""
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
        placed = jax.device_put(state, st_sh), jax.device_put(batch, b_sh)
        runs.append((method, None, list(shape), lambda s, b, j=jitted, bs=b_sh: j(s, jax.device_put(b, bs)),
                     placed))
    for preset, step in autoshard_steps.items():
        # The step donates its state: hand it a copy so the reference state stays alive.
        runs.append(("autoshard", preset, list(step.mesh.devices.shape), step,
                     (jax.tree.map(jnp.copy, state), batch)))

    records = []
    for method, preset, shape, step, (st, b) in runs:
        try:
            losses = _losses(step, st, b)
            err = float(np.max(np.abs(np.array(losses) - np.array(reference)) / np.abs(np.array(reference))))
            records.append({"model": case.name, "method": method, "preset": preset, "mesh": shape,
                            "devices": num_devices, "losses": losses, "reference_losses": reference,
                            "max_rel_err": err, "ok": err <= LOSS_RTOL, "error": None})
        except Exception as e:  # noqa: BLE001 - report and continue with the other methods
            records.append({"model": case.name, "method": method, "preset": preset, "mesh": shape,
                            "devices": num_devices, "losses": None, "reference_losses": reference,
                            "max_rel_err": None, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]})
    return records
