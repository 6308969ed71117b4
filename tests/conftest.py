"""Test setup: 8 simulated CPU devices, set before jax is imported."""

import os

# The 8 simulated devices are threads that share this machine's cores with the other test worker (and its
# solver processes). XLA:CPU aborts the whole process when a collective's threads arrive further apart than
# its termination timeout; once in CI a worker died so ("Fatal Python error: Aborted" while the benchmark
# suite's quick run read a loss) and pytest-xdist then hung. A slow thread is not a wrong program, so the
# collectives wait up to 10 minutes (both flags are in jaxlib 0.10.2; XLA added them in 2025).
_COLLECTIVE_WAIT = 600
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + f" --xla_cpu_collective_timeout_seconds={_COLLECTIVE_WAIT}"
    + f" --xla_cpu_collective_call_terminate_timeout_seconds={_COLLECTIVE_WAIT}"
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
