"""autoshard: automatic intra-operator sharding of JAX train steps.

Importing autoshard is cheap: the submodules (and jax) load on first use.

Example:
  >>> import autoshard
  >>> mesh = autoshard.make_mesh((2, 4), ("data", "model"))    # doctest: +SKIP
  >>> step = autoshard.parallelize(train_step, mesh=mesh)        # doctest: +SKIP
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "parallelize": "autoshard.api",
    "Parallelized": "autoshard.api",
    "Options": "autoshard.options",
    "Plan": "autoshard.plan",
    "PlanCost": "autoshard.plan",
    "PlanCheck": "autoshard.plan",
    "Explanation": "autoshard.explain",
    "PlanRequest": "autoshard.driver",
    "ClusterSpec": "autoshard.cluster",
    "cluster_preset": "autoshard.cluster",
    "profile_cluster": "autoshard.cluster",
    "make_mesh": "autoshard.cluster",
    "ShardingSpec": "autoshard.spec",
    "register_strategy": "autoshard.strategies",
    "register_op": "autoshard.strategies",
    "op_info": "autoshard.strategies",
    "BackendProfile": "autoshard.backends",
    "CollectiveKind": "autoshard.collectives",
    "AutoshardWarning": "autoshard.planner",
    "AutoshardError": "autoshard.errors",
    "InputError": "autoshard.errors",
    "MeshError": "autoshard.errors",
    "InfeasibleError": "autoshard.errors",
    "PlanError": "autoshard.errors",
    "ProblemFormatError": "autoshard.errors",
    "visualize": "autoshard.report",
    "apply_plan": "autoshard.placement",
    "PipelineOptions": "autoshard.pipeline",
    "pipeline_boundary": "autoshard.pipeline",
}

# Submodules that are public API; ``autoshard.distributed.initialize()`` works without importing them.
_SUBMODULES = ("backends", "distributed")  # autoshard.backends.CPU etc., loaded on first use

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"autoshard.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autoshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
