"""Plan reports: the HTML repr, rich summary, PNG figures, progress callbacks."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard import report
from tests import helpers
from tests.helpers import mesh as make_test_mesh


def _mlp(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"]) ** 2)


def _train_step(state, x):
    loss, grads = jax.value_and_grad(_mlp)(state["params"], x)
    new = jax.tree.map(
        lambda p, g, m: (p - 0.1 * (0.9 * m + g), 0.9 * m + g),
        state["params"],
        grads,
        state["opt_state"]["momentum"],
    )
    params = jax.tree.map(lambda _, t: t[0], state["params"], new)
    momentum = jax.tree.map(lambda _, t: t[1], state["params"], new)
    return {"params": params, "opt_state": {"momentum": momentum}}, {"loss": loss}


def _abstract_state(d_in=64, d_h=256):
    params = {
        "w1": jax.ShapeDtypeStruct((d_in, d_h), jnp.float32),
        "b1": jax.ShapeDtypeStruct((d_h,), jnp.float32),
        "w2": jax.ShapeDtypeStruct((d_h, d_in), jnp.float32),
    }
    return {"params": params, "opt_state": {"momentum": params}}


@pytest.fixture(scope="module")
def plan():
    step = autoshard.parallelize(
        _train_step, mesh=make_test_mesh("2x4"), cluster=autoshard.cluster_preset("cpu-sim")
    )
    return step.plan(_abstract_state(), jax.ShapeDtypeStruct((32, 64), jnp.float32))


def test_leaf_rows_cover_every_argument_with_roles(plan):
    rows = report.leaf_rows(plan)
    assert [r.path for r in rows] == list(plan.in_paths)
    roles = {r.path: r.role for r in rows}
    assert roles["[0]['params']['w1']"] == "parameter"
    assert roles["[0]['opt_state']['momentum']['w1']"] == "optimizer state"
    assert roles["[1]"] == "input"
    for r in rows:
        assert r.bytes_per_device * plan.mesh_info.size >= r.bytes_total >= r.bytes_per_device


def test_time_breakdown_splits_communication_by_bytes(plan):
    parts = report.time_breakdown(plan)
    assert parts["compute"] == plan.cost.compute_seconds
    assert math.isclose(sum(parts.values()), plan.cost.total_seconds, rel_tol=1e-9)
    by_kind = plan.predicted_bytes_by_kind()
    comm = {k: v for k, v in parts.items() if k != "compute"}
    assert set(comm) == {k for k, b in by_kind.items() if b > 0}
    total = sum(by_kind.values())
    for kind, seconds in comm.items():
        assert math.isclose(seconds, plan.cost.communication_seconds * by_kind[kind] / total, rel_tol=1e-9)


def test_memory_breakdown_budget_is_optional(plan):
    mem = report.memory_breakdown(plan)
    assert mem["peak"] == plan.cost.peak_memory_bytes
    assert mem["arguments"] == sum(r[4] for r in plan.parameter_table())
    assert mem["budget"] == plan.stats["memory_budget"]  # parallelize's default: the ClusterSpec's memory
    import dataclasses

    unbudgeted = dataclasses.replace(plan, stats={k: v for k, v in plan.stats.items() if k != "memory_budget"})
    assert report.memory_breakdown(unbudgeted)["budget"] is None
    assert math.isclose(sum(mem["parts"].values()), mem["peak"], rel_tol=1e-6)  # the parts make up the peak
    assert report.memory_breakdown(plan, budget=2**30)["budget"] == 2**30


def test_repr_html_shows_leaves_time_and_memory(plan):
    text = plan._repr_html_()
    assert text.startswith("<div") and text.rstrip().endswith("</div>")
    for path in plan.in_paths:  # every leaf, html-escaped
        assert path.replace("'", "&#x27;") in text
    assert "P(None, &#x27;model&#x27;)" in text or "P(&#x27;" in text
    assert "compute" in text and "Memory per device" in text and "budget</td>" in text
    for kind, nbytes in plan.predicted_bytes_by_kind().items():
        if nbytes:
            assert kind in text
    assert "<script" not in text
    assert "budget</td>" in report.plan_html(plan, budget=2**30)


def test_summary_plain_and_rich(plan):
    plain = plan.summary(rich=False)
    assert "[0]['params']['w1']" in plain and "┃" not in plain
    pytest.importorskip("rich")
    fancy = plan.summary(rich=True)
    assert "┃" in fancy and "time per step" in fancy and "memory per device" in fancy
    assert "[0]['params']['w1']" in fancy and "\x1b[" not in report.rich_summary(plan, color=False)
    assert plan.summary() == plain  # stdout is captured, not a terminal: plain text by default


def test_visualize_writes_a_png_that_is_not_blank(plan, tmp_path):
    pytest.importorskip("matplotlib")
    Image = pytest.importorskip("PIL.Image")
    path = tmp_path / "plan.png"
    fig = autoshard.visualize(plan, path, dpi=60)
    assert len(fig.axes) == 4
    assert fig._repr_png_().startswith(b"\x89PNG\r\n\x1a\n")  # shows itself in a notebook without pyplot
    with Image.open(path) as im:
        assert im.format == "PNG"
        assert im.size == (17 * 60, round(4.2 * 60))
        pixels = np.asarray(im.convert("L"), dtype=np.float32)
    assert pixels.std() > 10  # drawn on, not a blank canvas
    assert (pixels < 128).mean() > 0.01


def test_visualize_with_budget_and_a_plan_without_collectives(tmp_path):
    pytest.importorskip("matplotlib")
    step = autoshard.parallelize(lambda x: x * 2, mesh=make_test_mesh("8"))
    plan = step.plan(jax.ShapeDtypeStruct((8, 4), jnp.float32))
    fig = autoshard.visualize(plan, tmp_path / "p.png", budget=1e6)
    assert (tmp_path / "p.png").stat().st_size > 1000
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert any("budget" in t.get_text() for legend in legends for t in legend.get_texts())
    assert "no collectives" in plan._repr_html_()


def test_progress_callback_kinds(capsys):
    assert report.progress_callback(None) is None
    with pytest.raises(ValueError, match="progress kind"):
        report.progress_callback("bogus")
    pytest.importorskip("tqdm")
    cb = report.progress_callback("tqdm")
    for i, stage in enumerate(["capture", "strategies", "solve"], 1):
        cb(stage, i, 3)
    assert not cb.is_open  # closed at done == total


# ---- python -m autoshard explain ---------------------------------------------------------------------

_STEP_FILE = """
import jax
import jax.numpy as jnp
import autoshard


def train_step(params, x):
    loss, grads = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def example_args():
    return {"w": jax.ShapeDtypeStruct((64, 256), jnp.float32)}, jax.ShapeDtypeStruct((32, 64), jnp.float32)


@autoshard.parallelize(mesh=autoshard.make_mesh((8,), ("data",)))
def pinned_step(params, x):
    return train_step(params, x)


def no_args_step(x):
    return x
"""


def test_explain_cli_prints_and_writes_the_plan(tmp_path, capsys):
    from autoshard.__main__ import main

    src = tmp_path / "steps.py"
    src.write_text(_STEP_FILE.replace("def no_args_step", "def no_args_step_unused"))
    rc = main(
        [
            "explain",
            f"{src}:train_step",
            "--devices",
            "8",
            "--mesh",
            "2,4",
            "--cluster",
            "cpu-sim",
            "--no-rich",
            "--html",
            str(tmp_path / "p.html"),
            "--json",
            str(tmp_path / "p.json"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "autoshard plan on mesh {'data': 2, 'model': 4}" in out and "[0]['w']" in out
    assert 'class="autoshard-plan"' in (tmp_path / "p.html").read_text()
    assert autoshard.Plan.from_json((tmp_path / "p.json").read_text()).mesh_info.shape == (2, 4)

    assert main(["explain", f"{src}:pinned_step", "--no-rich"]) == 0  # a Parallelized keeps its own mesh
    assert "{'data': 8}" in capsys.readouterr().out


def test_explain_cli_says_what_is_missing(tmp_path, capsys):
    from autoshard.__main__ import main

    src = tmp_path / "steps.py"
    src.write_text(_STEP_FILE.replace("def example_args", "def other_args"))
    assert main(["explain", f"{src}:train_step"]) == 2
    assert "def train_step_example_args():" in capsys.readouterr().err
    assert main(["explain", f"{src}:nope"]) == 2
    assert "defines no function 'nope'" in capsys.readouterr().err
    assert main(["explain", str(tmp_path / "missing.py:train_step")]) == 2
    assert "no such file" in capsys.readouterr().err
    src.write_text(_STEP_FILE)
    assert main(["explain", f"{src}:pinned_step", "--mesh", "2,4"]) == 2
    assert "already parallelized" in capsys.readouterr().err


# ---- every plan type has the same report surface ------------------------------------------------------


def _sgd_step(params, batch):
    def loss_fn(p):
        return jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), {"loss": loss}


def test_pipeline_plans_have_the_report_surface_of_a_plan(tmp_path):
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    params = {"w1": jax.random.normal(k1, (16, 32)) / 4, "w2": jax.random.normal(k2, (32, 4)) / 6}
    batch = {"x": jax.random.normal(k3, (16, 16)), "y": jnp.ones((16, 4))}
    step = autoshard.parallelize(_sgd_step, mesh=make_test_mesh("2x4"), num_microbatches=2, progress=None,
                                 pipeline=autoshard.PipelineOptions(num_stages=2, solver_time_limit=0.5))
    plan = step.plan(params, batch)
    assert isinstance(plan, report.Report) and plan.num_stages == 2
    assert plan._repr_html_().count("intra-op plan") == 2
    helpers.check_report_surface(plan, step.prepared(params, batch).executable, tmp_path)
