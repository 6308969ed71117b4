"""Acceptance: every model, on every mesh, equals a single-device jax.jit reference after two steps."""

from __future__ import annotations

import pytest

from benchmarks.models import get_model
from tests.helpers import MESHES, check_against_reference, mesh

MODELS = {
    "mlp": ("mlp", "tiny", 16),
    "gpt": ("gpt", "tiny", 8),
    "gpt_scan": ("gpt_scan", "tiny", 8),
    "convnet": ("convnet", "tiny", 8),
    "moe": ("moe_layer", "tiny", 8),
}

# The quick default runs each model on two meshes; --runslow runs the whole grid.
QUICK = {("mlp", "8"), ("mlp", "2x4"), ("gpt", "2x4"), ("gpt", "1x8"), ("gpt_scan", "2x4"),
         ("convnet", "4x2"), ("moe", "2x4"), ("moe", "8")}


def _cases():
    for model in MODELS:
        for m in MESHES:
            marks = () if (model, m) in QUICK else (pytest.mark.slow,)
            yield pytest.param(model, m, id=f"{model}-{m}", marks=marks)


@pytest.mark.parametrize("model,mesh_name", list(_cases()))
def test_two_steps_match_reference(model, mesh_name):
    family, config, batch = MODELS[model]
    spec = get_model(family, config, batch)
    check_against_reference(spec, mesh(mesh_name))


def test_moe_transformer_matches_reference():
    spec = get_model("moe", "tiny", 8)
    check_against_reference(spec, mesh("4x2"))


def test_wide_resnet_matches_reference():
    spec = get_model("wresnet", "tiny", 8)
    check_against_reference(spec, mesh("8"))
