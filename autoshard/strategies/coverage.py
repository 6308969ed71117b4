"""Which primitives autoshard shards, handles as structure, or runs replicated on purpose.

``coverage()`` is the contract that ``tests/test_coverage.py`` checks against every primitive the
installed jax defines: none may be unclassified.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import warnings

from autoshard.strategies.base import registered_primitives, replicated_families, replicated_reasons
from autoshard.strategies.opinfo import registered_ops

# Captured as structure: inlined into the op graph (capture.INLINED), or kept as one structured op
# whose body the planner solves (scan). ``while`` and ``cond`` are structure too, but run replicated.
STRUCTURAL_KINDS = ("inlined", "scan")


@functools.cache
def installed_primitives() -> dict[str, tuple[str, ...]]:
    """Every ``jax.extend.core.Primitive`` that is an attribute of one of jax's modules, by name,
    with the modules that hold it. Modules that fail to import (platform-only ones) are skipped."""
    import jax
    import jax.extend.core as jex_core

    found: dict[str, set[str]] = {}
    for info in pkgutil.walk_packages(jax.__path__, "jax.", onerror=lambda name: None):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - GPU/TPU-only modules, optional dependencies
            continue
        for value in list(vars(module).values()):
            if isinstance(value, jex_core.Primitive):
                found.setdefault(value.name, set()).add(info.name)
    return {name: tuple(sorted(mods)) for name, mods in found.items()}


def coverage() -> dict[str, str]:
    """Primitive name -> ``"rule"``, ``"structural"`` or ``"replicated: <why that is right>"``.

    Covers every primitive with a registered rule, every primitive capture handles as structure,
    every primitive registered with :func:`~autoshard.strategies.register_replicated`, and the
    primitives of the installed jax that belong to a replicated family (kernel languages).

    Example:
        >>> from autoshard.strategies import coverage
        >>> coverage()["dot_general"]
        'rule'
    """
    out: dict[str, str] = {}
    families = replicated_families()
    if families:
        for name, modules in installed_primitives().items():
            for prefixes, why in families.items():
                if all(m.startswith(prefixes) for m in modules):
                    out[name] = f"replicated: {why}"
    reasons = replicated_reasons()
    for name in registered_primitives():
        out[name] = f"replicated: {reasons[name]}" if name in reasons else "rule"
    for name, info in registered_ops().items():
        if info.structure in STRUCTURAL_KINDS:
            out[name] = "structural"
    return out
