"""The notebooks in notebooks/ run top to bottom on 8 simulated CPU devices, and are stored without outputs.

Each notebook runs in a fresh kernel whose working directory is a temporary folder (the files it
writes land there). The kernel inherits this process's environment: XLA_FLAGS from conftest.py and
the repository root on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CELL_TIMEOUT_S = 300


def _run(name: str, workdir: pathlib.Path, monkeypatch, **env) -> tuple[object, float]:
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    )
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    )
    t = time.perf_counter()
    client.execute()
    return nb, time.perf_counter() - t


def _outputs(nb, output_type=None):
    return [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if output_type is None or o.output_type == output_type
    ]


def _text(nb) -> str:
    return "".join(o.get("text", "") for o in _outputs(nb, "stream"))


def _mimes(nb) -> list[str]:
    return [m for o in _outputs(nb) if o.output_type in ("display_data", "execute_result") for m in o.data]


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name} cell {i} has outputs; strip them before committing "
                "(jupyter nbconvert --clear-output --inplace notebooks/*.ipynb)"
            )
    assert "xla_force_host_platform_device_count=8" in nb.cells[1].source, (
        "the first code cell sets 8 devices"
    )


def test_01_quickstart(tmp_path, monkeypatch):
    nb, seconds = _run("01_quickstart.ipynb", tmp_path, monkeypatch)
    text = _text(nb)
    assert "8 cpu devices" in text and "largest difference" in text
    html = [o.data["text/html"] for o in _outputs(nb) if "text/html" in o.get("data", {})]
    assert any('class="autoshard-plan"' in h and "argument leaves" in h for h in html)
    assert "image/png" in _mimes(nb)
    assert (tmp_path / "gpt_plan.png").stat().st_size > 10_000
    print(f"01_quickstart: {seconds:.1f}s")


def test_02_inspecting_plans(tmp_path, monkeypatch):
    nb, seconds = _run("02_inspecting_plans.ipynb", tmp_path, monkeypatch)
    text = _text(nb)
    assert "ratio" in text and "InfeasibleError" in text and "PlanError" in text
    assert "applied the saved plan" in text
    assert json.loads((tmp_path / "mlp_plan.json").read_text())["format"] == "autoshard-plan/1"
    assert _mimes(nb).count("image/png") >= 2
    print(f"02_inspecting_plans: {seconds:.1f}s")


def test_03_pipeline_and_memory(tmp_path, monkeypatch):
    nb, seconds = _run("03_pipeline_and_memory.ipynb", tmp_path, monkeypatch)
    text = _text(nb)
    # Memory: the levers in order, each checked inside the notebook (asserts there fail the run).
    assert "InfeasibleError" in text and "rematerialise" in text
    assert "{'pinned_host'}" in text  # offloaded optimizer state stays in host memory after the step
    assert "gradient accumulation chosen by the planner" in text
    # Pipeline: both schedules planned as 2 stages, run, and compared with jax.jit.
    assert text.count("pipeline: 2 stage(s)") == 2 and text.count("loss difference") == 2
    assert _mimes(nb).count("image/png") == 2
    print(f"03_pipeline_and_memory: {seconds:.1f}s")


def test_04_benchmarks_makes_a_tiny_results_file(tmp_path, monkeypatch):
    results = tmp_path / "results.json"
    nb, seconds = _run("04_benchmarks.ipynb", tmp_path, monkeypatch, AUTOSHARD_RESULTS=str(results))
    rows = json.loads(results.read_text())["rows"]
    assert {r["method"] for r in rows} >= {"autoshard", "data_parallel", "megatron"}
    assert all(r["step_time_s"] > 0 for r in rows)
    assert "wrote" in _text(nb) and _mimes(nb).count("image/png") == 2
    print(f"04_benchmarks (generating): {seconds:.1f}s")


def test_04_benchmarks_reads_benchmarks_run_rows(tmp_path, monkeypatch):
    # The shape `python -m benchmarks.run` writes: meta, rows with status, mesh lists, an OOM row.
    def row(model, method, preset, mesh, t, status="ok"):
        return {
            "model": model,
            "method": method,
            "preset": preset,
            "mesh": mesh,
            "status": status,
            "step_time_s": t if status == "ok" else None,
            "compute_s": t / 2 if t else None,
            "communication_s": t / 2 if t else None,
            "peak_bytes": 1e9,
        }

    rows = []
    for model in ("gpt-125M", "moe-380M"):
        for preset in ("h100-nvlink", "tpu-v5e"):
            rows += [
                row(model, "data_parallel", preset, [8, 1], 0.30),
                row(model, "megatron", preset, [2, 4], 0.25),
                row(model, "megatron", preset, [4, 2], 0.20),
                row(model, "autoshard", preset, [2, 4], 0.18),
                row(model, "fsdp", preset, [8, 1], None, status="oom"),
            ]
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"meta": {"suite": "all", "devices": 8}, "rows": rows}))
    nb, seconds = _run("04_benchmarks.ipynb", tmp_path, monkeypatch, AUTOSHARD_RESULTS=str(results))
    text = _text(nb)
    assert "16 rows" in text and "'oom': 4" in text and "wrote" not in text
    assert text.count("0.90") == 4  # autoshard 0.18 / best baseline 0.20, per model and preset
    print(f"04_benchmarks (reading): {seconds:.1f}s")
