"""Leaf roles: what each flat argument of a step is, classified once, from the argument pytree.

Offload moves only optimizer state, the memory estimate splits carried state into parameters and
optimizer state, and the report labels every leaf: all three read the roles classified here
(``CapturedProgram.in_roles``, then ``Plan.in_roles``), never the leaves' path names.

A leaf's role is the first that applies:

1. the user's ``parallelize(..., state_roles={path_regex: role})``, searched in the leaf's path
   (as ``hints`` are): for an optimizer that is not optax, e.g. ``{"momentum": "optimizer_state"}``;
2. ``optimizer_state``: under an optax state (a NamedTuple whose class is defined in an ``optax``
   module: ``ScaleByAdamState``, ``TraceState``, ``EmptyState``...), in an ``nnx.OptState`` variable
   (what ``nnx.Optimizer`` holds), or under a pytree entry named exactly ``opt_state``
   (``nnx.Optimizer``'s attribute, flax ``TrainState``'s field, the usual dict key);
3. ``model_state``: in an ``nnx.BatchStat`` variable, or under an entry named exactly ``batch_stats``
   (linen's collection);
4. ``rng_key``: a typed PRNG key (``jax.dtypes.prng_key`` dtype);
5. carried (tied to an output that replaces it with a new value): ``parameter`` when floating
   point, else ``other`` (step counters);
6. ``input``: read, not carried (the batch: :func:`autoshard.intent.batch_inputs` reads it from these
   leaves only, so weights passed beside the batch are named ``"parameter"`` with ``state_roles``).

A parameter named ``mu_proj`` is a parameter: no rule looks for substrings of names.
"""

from __future__ import annotations

import dataclasses
import re
import sys

import jax
import jax.numpy as jnp

from autoshard.errors import InputError

ROLES = ("parameter", "optimizer_state", "model_state", "rng_key", "input", "other")
"""Every role a leaf can have."""

_NAMED_ENTRIES = {"opt_state": "optimizer_state", "batch_stats": "model_state"}


def classify_leaves(args, in_paths, carried=(), state_roles=None) -> tuple[str, ...]:
    """One role per flat leaf of ``args`` (see the module docstring).

    Args:
      args: the (abstract) arguments pytree, as the step is traced with it.
      in_paths: the readable path of each flat leaf (``CapturedProgram.in_paths``).
      carried: flat input indices that an output replaces with a new value (:func:`carried_inputs`).
      state_roles: ``{path_regex: role}`` overrides, searched in ``in_paths``.
    """
    structural = _structural_roles(args)
    overrides = _compiled_overrides(state_roles)
    carried = set(carried)
    return tuple(_role(path, role, dtype, i in carried, overrides)
                 for i, (path, (role, dtype)) in enumerate(zip(in_paths, structural, strict=True)))


def program_roles(program, ties=None) -> tuple[str, ...]:
    """``program.in_roles``, or, for a program nobody classified (``capture_graph`` called directly, a
    pipeline stage), the roles :func:`classify_leaves` gives its arguments' structure and ``ties``."""
    if program.in_roles:
        return program.in_roles
    avals = [program.avals[v] for v in program.graph.invars]
    if program.in_tree is None:
        args = avals
    else:
        args = jax.tree_util.tree_unflatten(program.in_tree, avals)
    return classify_leaves(args, program.in_paths, carried_inputs(program, ties))


def with_roles(program, args, ties=None, state_roles=None):
    """``program`` with its arguments ``args`` classified (``in_roles``)."""
    roles = classify_leaves(args, program.in_paths, carried_inputs(program, ties), state_roles)
    return dataclasses.replace(program, in_roles=roles)


def carried_inputs(program, ties=None) -> set[int]:
    """Flat inputs that a tied output replaces with a new value. An output that returns the input itself
    (an nnx step hands back its batch argument with the objects' new state) carries nothing."""
    g = program.graph
    return {i for o, i in (ties or {}).items() if g.outvars[o] != g.invars[i]}


def _role(path: str, structural: str | None, dtype, carried: bool, overrides) -> str:
    for rx, role in overrides:
        if rx.search(path):
            return role
    if structural is not None:
        return structural
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return "rng_key"
    if not carried:
        return "input"
    floating = dtype is not None and jnp.issubdtype(dtype, jnp.inexact)  # bfloat16 included
    return "parameter" if floating else "other"


def _structural_roles(args) -> list[tuple[str | None, object]]:
    """(role from the pytree's types and entry names, or None; dtype) per flat leaf."""
    out = []
    nodes = jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_typed_node)[0]
    for path, node in nodes:
        named = next((_NAMED_ENTRIES[k] for k in map(_entry_name, path) if k in _NAMED_ENTRIES), None)
        role = _node_role(node) or named
        for leaf in jax.tree_util.tree_leaves(node):
            out.append((role, getattr(leaf, "dtype", None)))
    return out


def _entry_name(key) -> str | None:
    for attr in ("key", "name"):
        value = getattr(key, attr, None)
        if isinstance(value, str):
            return value
    return None


def _is_optax_state(x) -> bool:
    cls = type(x)
    return (isinstance(x, tuple) and hasattr(cls, "_fields")
            and (cls.__module__ == "optax" or cls.__module__.startswith("optax.")))


def _nnx_variable_role(x) -> str | None:
    if "flax.nnx" not in sys.modules:  # an nnx variable can only exist once nnx is imported
        return None
    from flax import nnx

    if not isinstance(x, nnx.Variable):
        return None
    if isinstance(x, nnx.OptState):
        return "optimizer_state"
    if isinstance(x, nnx.BatchStat):
        return "model_state"
    return "parameter" if isinstance(x, nnx.Param) else None


def _is_typed_node(x) -> bool:
    return _is_optax_state(x) or _nnx_variable_role(x) is not None


def _node_role(x) -> str | None:
    if _is_optax_state(x):
        return "optimizer_state"
    return _nnx_variable_role(x)


def _compiled_overrides(state_roles) -> list[tuple[re.Pattern, str]]:
    out = []
    for pattern, role in (state_roles or {}).items():
        if role not in ROLES:
            raise InputError(f"state_roles={{{pattern!r}: {role!r}}}: {role!r} is not a leaf role. "
                             f"Fix: use one of {', '.join(ROLES)}, e.g. "
                             f"state_roles={{{pattern!r}: 'optimizer_state'}}.")
        try:
            out.append((re.compile(pattern), role))
        except re.error as e:
            raise InputError(f"state_roles key {pattern!r} is not a regular expression ({e}). Fix: pass a "
                             "regex searched in the leaf's path, e.g. state_roles={'momentum': 'optimizer_state'}.") from None
    return out
