"""Test setup: 8 simulated CPU devices, set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("AUTOSHARD_VALIDATE", "1")  # CapturedProgram.from_graph checks what each pass builds

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("AUTOSHARD_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: pass --runslow or set AUTOSHARD_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
