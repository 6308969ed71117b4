"""The benchmark suite (``python -m benchmarks.run``): its quick run, its JSON and its baselines."""

from __future__ import annotations

import json
import os

import jax
import pytest
from jax.sharding import PartitionSpec as P

from benchmarks import baselines
from benchmarks.models import get_model
from benchmarks.run import run_suite
from benchmarks.suite import cases, report

ROW_FIELDS = {
    "model", "family", "config", "params", "batch", "devices", "method", "preset", "mesh", "status", "oom",
    "memory_limit", "step_time_s", "compute_s", "communication_s", "simple_s", "flops_per_device",
    "collectives", "collective_bytes", "memory", "peak_bytes", "lower_s", "compile_s",
}  # fmt: skip


SLOW = os.environ.get("AUTOSHARD_SLOW") == "1"
MODELS = ("gpt-tiny", "moe-tiny", "wresnet-tiny") if SLOW else ("gpt-tiny",)
"""The quick suite's models these tests check: all three with AUTOSHARD_SLOW=1 (about 100 s on
2 cores), the GPT alone by default (MoE and Wide-ResNet run end to end in tests/test_end_to_end.py)."""


@pytest.fixture(scope="module")
def quick():
    """The --quick suite (``MODELS``), in process, on the 8 devices conftest.py sets up."""
    return run_suite("all" if SLOW else "gpt", 8, quick=True, progress=False)


def test_quick_suite_rows_have_every_field(quick):
    meta = quick["meta"]
    assert meta["jax_version"] == jax.__version__ and meta["device_kind"] and meta["devices"] == 8
    models = {r["model"] for r in quick["rows"]}
    assert models == set(MODELS)
    for model in models:
        for preset in ("h100-nvlink", "h100-2node-ib"):
            methods = {r["method"] for r in quick["rows"] if r["model"] == model and r["preset"] == preset}
            assert methods == set(cases.METHODS), (model, preset, methods)
    for r in quick["rows"]:
        assert r["status"] == "ok", (r["model"], r["method"], r["preset"], r.get("error"))
        assert ROW_FIELDS <= set(r), sorted(ROW_FIELDS - set(r))
        assert r["step_time_s"] > 0 and r["flops_per_device"] > 0 and r["peak_bytes"] > 0
        # the step overlaps communication with compute: never longer than their sum, never shorter than either
        assert r["step_time_s"] <= r["compute_s"] + r["communication_s"] + 1e-12
        assert r["step_time_s"] >= max(r["compute_s"], r["communication_s"]) - 1e-12
        for kind, v in r["collectives"].items():
            assert kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
            assert v["count"] >= 1 and v["bytes"] >= 0
    json.dumps(quick, default=float)  # everything serialises


def test_quick_suite_autoshard_fields(quick):
    for r in (r for r in quick["rows"] if r["method"] == "autoshard"):
        a = r["autoshard"]
        assert {"capture", "strategies", "problem", "solve"} <= set(a["timings"])
        assert a["planning_s"] > 0 and a["planning_by_mesh"]
        assert {"compute_s", "communication_s", "communication_bytes", "peak_memory_bytes"} <= set(
            a["predicted"]
        )
        assert a["verify"]["compiled_bytes"] >= 0 and a["memory_ratio"] > 0


def test_quick_suite_megatron_reports_its_sweep(quick):
    for r in (r for r in quick["rows"] if r["method"] == "megatron"):
        meshes = [tuple(c["mesh"]) for c in r["candidates"]]
        assert (8, 1) in meshes and tuple(r["mesh"]) in meshes  # tp = 1 is data parallelism


def test_quick_suite_tiny_losses_match_single_device(quick):
    runs = {(e["model"], e["method"], e["preset"]) for e in quick["executions"]}
    for model in MODELS:
        for preset in ("h100-nvlink", "h100-2node-ib"):
            assert (model, "autoshard", preset) in runs
        for method in ("data_parallel", "zero2", "fsdp"):
            assert (model, method, None) in runs
    for e in quick["executions"]:
        assert e["ok"], e
        assert e["losses"] == pytest.approx(e["reference_losses"], rel=1e-5)


def test_markdown_tables(quick):
    text = report.markdown(quick)
    assert "| gpt-tiny | 0M | 16 | h100-nvlink |" in text
    assert "best baseline ÷ autoshard" in text
    comps = report.comparisons(quick["rows"])
    assert len(comps) == 2 * len(MODELS) and all(c["speedup"] is not None for c in comps)


def test_two_node_meshes_keep_the_model_axis_inside_a_node():
    one, two = cases.PRESETS
    assert cases.autoshard_meshes(8, one) == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert cases.autoshard_meshes(8, two) == [(8, 1), (4, 2), (2, 4)]
    assert cases.megatron_meshes(8, two) == [(4, 2), (2, 4)]
    assert baselines.tensor_parallel_meshes(16) == [(8, 2), (4, 4), (2, 8), (1, 16)]


def test_select_cases():
    assert [c.name for c in cases.select_cases("all", quick=True)] == ["gpt-tiny", "moe-tiny", "wresnet-tiny"]
    assert [c.config for c in cases.select_cases("gpt", quick=False, configs=("125M", "1.3B"))] == [
        "125M",
        "1.3B",
    ]
    assert cases.SUITES["gpt"][0].batch_size(8) == 16
    with pytest.raises(ValueError, match="not in suite"):
        cases.select_cases("moe", quick=False, configs=("125M",))


@pytest.mark.parametrize(
    ("family", "path", "expected"),
    [
        ("moe", "['params']['blocks'][0]['moe']['wi']", P(None, None, "model")),
        ("moe", "['params']['blocks'][0]['moe']['wo']", P(None, "model", None)),
        ("moe", "['params']['blocks'][1]['mlp']['fc']['kernel']", P(None, "model")),
        ("wresnet", "['params']['blocks'][0]['conv2']['kernel']", P(None, None, None, "model")),
        ("wresnet", "['params']['blocks'][0]['bn2']['scale']", P("model")),
        ("wresnet", "['model_state']['blocks'][0]['bn2']['var']", P("model")),
        ("wresnet", "['params']['blocks'][0]['conv3']['kernel']", P(None, None, "model", None)),
        ("wresnet", "['params']['blocks'][0]['conv1']['kernel']", P()),
    ],
)
def test_megatron_rules_for_moe_and_wresnet(family, path, expected):
    spec = get_model(family, "tiny", 8)
    state, batch = spec.abstract_state(), spec.abstract_batch()
    from autoshard import make_mesh

    mesh = make_mesh((4, 2), ("data", "model"))
    st_sh, _ = baselines.megatron(state, batch, mesh, rules=baselines.MEGATRON_RULES_BY_FAMILY[family])
    specs = {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(st_sh)[0]}
    assert specs[path] == expected


def test_scale_rows_report_planner_and_jit_memory_against_the_bound(monkeypatch):
    """benchmarks.scale: a row's planner RSS is judged against max(8 GB, 1.3 x jax.jit's), and the table
    shows flat rows (no layer plans) and failed ones without breaking its columns."""
    from benchmarks import scale

    answers = {"plan": {"plan_s": 3.0, "capture_s": 1.0, "stages": 1, "stage_meshes": [[1, 8, 1]], "step_ms": 5.0,
                        "peak_bytes": 2**30, "fits": True, "remat": "2/8", "plan_rss_gb": 9.0},
               "jit": {"jit_lower_s": 1.0, "jit_rss_gb": 6.0}}
    monkeypatch.setattr(scale, "in_process", lambda kind, row: dict(answers[kind]))
    row = scale.Row("x", "tiny", 8, 1, (1, 8, 1), pipeline=False, family="llama", axes=("dp", "fsdp", "mp"))
    out = scale.measure_row(row)
    assert out["devices"] == 8 and out["rss_bound_gb"] == pytest.approx(8.0) and not out["rss_within"]
    assert out["rss_ratio"] == pytest.approx(1.5)
    failed = {"row": "y", "devices": 64, "target_s": 60.0, "plan_error": "exit status -9: Killed"}
    lines = scale.table([out, failed]).splitlines()
    assert "1 x 1x8x1 remat 2/8" in lines[1] and lines[1].split()[-1] == "no"
    assert "no plan" in lines[2] and "Killed" in lines[2]
    assert scale._peak_rss_gb() > 0
