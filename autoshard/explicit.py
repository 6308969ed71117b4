"""Model code written for Explicit mesh axes, read as the user's intent.

Since jax 0.9 a mesh's axes default to ``AxisType.Explicit``: a model built under
``jax.set_mesh(mesh)`` carries its layouts in its types (``jax.typeof(x).sharding``), and its code may
say where values go: ``jax.sharding.reshard(x, P(...))``, ``out_sharding=`` on einsums, matmuls and
flax layers, ``jax.typeof(inputs).sharding`` as a target. Such code only traces under an Explicit mesh.

autoshard traces it under the user's mesh (its abstract form, :func:`user_mesh`), with every argument
typed as the user placed it (:func:`typed_arguments`), and capture reads the result as a program over
Auto axes (:func:`autoshard.capture.capture_graph` with ``explicit=True``):

- a ``reshard`` is a pin, as ``with_sharding_constraint`` is (``strategies/annotations.py``), matched to
  the planning mesh by axis names; lowering replaces it by the plan's layout;
- an op's ``out_sharding=`` becomes that op without it, followed by such a pin;
- the layouts jax inferred (``sharding=`` params of broadcasts, iotas and the like, and every value's
  type) are dropped: they are jax's propagation, not the user's choice, and the plan chooses anew.

A pin whose axes the planning mesh lacks lays out nothing (it follows its operand), and the plan says so
in one warning (:func:`dropped_pins`).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

PIN_OPS = ("sharding_constraint", "reshard")
"""Ops that pin their operand's layout: the user's annotations."""


def _has_explicit_axes(mesh) -> bool:
    types = getattr(mesh, "axis_types", ()) or ()
    return any(t == AxisType.Explicit for t in types)


def user_mesh(leaves) -> jax.sharding.AbstractMesh | None:
    """The Explicit mesh the step's code was written for, as an ``AbstractMesh``, or None.

    It is the mesh in context (``with jax.set_mesh(mesh):`` around the call) when that has Explicit axes,
    else the mesh of the first argument leaf placed with a ``NamedSharding`` on Explicit axes (a model
    built under ``jax.set_mesh`` and called outside it)."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and _has_explicit_axes(context):
        return context
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and _has_explicit_axes(sharding.mesh):
            mesh = sharding.mesh
            return mesh if isinstance(mesh, jax.sharding.AbstractMesh) else mesh.abstract_mesh
    return None


def typed_arguments(abstract, leaves, mesh: jax.sharding.AbstractMesh):
    """``abstract`` (a pytree of ``ShapeDtypeStruct``s, one per leaf of ``leaves``) typed on ``mesh``: each
    array keeps its own layout where it is placed on an Explicit mesh of the same axis names, else it is
    replicated (``P()``: an array autoshard placed, on its Auto axes, is typed as the user's code expects of a
    fresh one); Python scalars stay untyped, as jax leaves them."""
    flat, tree = jax.tree_util.tree_flatten(abstract)
    typed = []
    for a, leaf in zip(flat, leaves, strict=True):
        if getattr(a, "weak_type", False) and not a.shape:
            typed.append(a)
            continue
        sharding = getattr(leaf, "sharding", None)
        spec = PartitionSpec()
        if (isinstance(sharding, NamedSharding) and _has_explicit_axes(sharding.mesh)
                and tuple(sharding.mesh.axis_names) == tuple(mesh.axis_names)):
            spec = sharding.spec  # placed by the user (autoshard's own layouts are on Auto axes: not typed)
        typed.append(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec),
                                          weak_type=getattr(a, "weak_type", False)))
    return jax.tree_util.tree_unflatten(tree, typed)


@functools.cache
def _reshard_primitive(mesh):
    with jax.sharding.use_abstract_mesh(mesh):
        arg = jax.ShapeDtypeStruct((1,), np.float32, sharding=NamedSharding(mesh, PartitionSpec()))
        jaxpr = jax.make_jaxpr(lambda x: jax.sharding.reshard(x, PartitionSpec()))(arg)
    return jaxpr.eqns[0].primitive


def reshard_primitive():
    """jax's ``reshard`` primitive (it has no public name: read off a ``jax.sharding.reshard`` traced under
    the Explicit mesh in context, or a one-device one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not _has_explicit_axes(mesh):
        mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,))
    return _reshard_primitive(mesh)


def without_mesh(aval):
    """``aval`` with no mesh in its type (a Ref's element type too): as if traced outside any mesh."""
    inner = getattr(aval, "inner_aval", None)  # a Ref: its element type names the mesh
    if inner is not None:
        new = without_mesh(inner)
        return aval if new is inner else aval.update(inner_aval=new)
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is None or mesh.empty:
        return aval
    return aval.update(sharding=None)


def auto_context():
    """An eqn context (``JaxprEqnContext``) without a mesh: the one every op of an explicitly traced program
    takes, so that lowering binds it on the planning mesh's Auto axes, not the Explicit mesh it was traced
    under (read off a traced op: it has no public constructor)."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return jax.make_jaxpr(lambda x: x + 1)(np.float32(1)).eqns[0].ctx


def pin_sharding(op):
    """The sharding a pin op (:data:`PIN_OPS`) asks for."""
    return op.params.get("sharding" if op.name == "sharding_constraint" else "dst_sharding")


def dropped_pins(program, axis_names) -> str | None:
    """The warning naming the pins (the user's annotations) whose axes the planning mesh lacks, which lay out
    nothing on it; None when there are none (:func:`autoshard.planner.warn_dropped_pins` issues it)."""
    names, dropped = set(axis_names), []
    for op in program.ops:
        if op.name not in PIN_OPS:
            continue
        spec = getattr(pin_sharding(op), "spec", None)
        missing = sorted({a for e in (spec or ()) for a in ((e,) if isinstance(e, str) else (e or ()))
                          if isinstance(a, str) and a not in names})
        if missing:
            dropped.append(f"{op.source()} ({PartitionSpec(*spec)}: no axis {', '.join(map(repr, missing))})")
    if not dropped:
        return None
    more = f" and {len(dropped) - 5} more" if len(dropped) > 5 else ""
    return (f"autoshard plans on mesh axes {tuple(axis_names)}; these sharding annotations name axes it does not "
            f"have, so they lay out nothing: {'; '.join(dropped[:5])}{more}. Fix: plan on a mesh with those axis "
            "names (parallelize(mesh=...)), or rename the axes in the annotations.")
