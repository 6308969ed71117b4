"""``apply_plan``: put an existing state (or a restore target) onto a plan's shardings.

A plan names every argument leaf by its pytree path (``plan.in_paths``), so an
argument can be matched against it without the plan's treedef: this works for
plans loaded with :meth:`Plan.from_json` too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from autoshard.errors import PlanError


def apply_plan(plan, tree: Any, *, argnum: int | None = 0) -> Any:
    """Place ``tree`` onto the shardings ``plan`` chose for argument ``argnum``.

    Each leaf is moved with ``jax.device_put`` onto its planned ``NamedSharding``.
    A ``jax.ShapeDtypeStruct`` leaf comes back as a ``ShapeDtypeStruct`` that
    carries the sharding, which is what checkpoint libraries take as a restore
    target (``orbax.checkpoint``'s ``StandardRestore``).

    Args:
      plan: an :class:`autoshard.Plan` (from ``Parallelized.plan`` or ``Plan.from_json``).
      tree: the argument as the step function takes it: a dict, a flax ``TrainState``,
        an ``nnx.State``, any pytree of arrays. Static fields stay as they are.
      argnum: which dynamic argument of the step ``tree`` is (0 for ``train_step(state, batch)``'s
        state). None: ``tree`` is the tuple of all dynamic arguments.

    Returns:
      ``tree`` with every leaf placed (or annotated) with its planned sharding.

    Raises:
      PlanError: ``tree`` does not have the leaves, shapes or dtypes the plan was made for.
        Every mismatch is listed with its pytree path.

    Example:
      >>> step = autoshard.parallelize(train_step, mesh=mesh)         # doctest: +SKIP
      >>> plan = step.plan(state, batch)                               # doctest: +SKIP
      >>> state = autoshard.apply_plan(plan, state)                    # doctest: +SKIP
    """
    import jax
    from jax.sharding import NamedSharding

    prefix = "" if argnum is None else f"[{argnum}]"
    planned = {p: i for i, p in enumerate(plan.in_paths) if p.startswith(prefix)}
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [prefix + jax.tree_util.keystr(p) for p, _ in flat]
    if argnum is not None and not planned:
        args = sorted({p.split("]")[0] + "]" for p in plan.in_paths})
        raise PlanError(f"the plan has no argument {argnum}; its dynamic arguments are {', '.join(args)}.\n"
                        f"Fix: pass argnum= one of those indices, or argnum=None for the tuple of all of them.")

    problems = []
    missing = sorted(set(planned) - set(paths))
    extra = [p for p in paths if p not in planned]
    if missing:
        problems.append(_listed("the plan has leaves that the tree lacks", missing))
    if extra:
        problems.append(_listed("the tree has leaves the plan does not know", extra))
    info = plan.mesh_info
    placed = []
    for path, (_, leaf) in zip(paths, flat, strict=True):
        i = planned.get(path)
        if i is None:
            continue
        shape, dtype = plan.in_avals[i]
        got_shape, got_dtype = tuple(np.shape(leaf)), _dtype(leaf)
        if tuple(shape) != got_shape:
            problems.append(f"{path}: shape {got_shape}, but the plan was made for {tuple(shape)}")
        elif got_dtype is not None and str(got_dtype) != str(dtype):
            problems.append(f"{path}: dtype {got_dtype}, but the plan was made for {dtype}")
        placed.append(NamedSharding(plan.mesh, plan.in_specs[i].to_partition_spec(info)))
    if problems:
        raise PlanError(
            f"cannot apply the plan to this tree (argument {'*' if argnum is None else argnum}):\n  "
            + "\n  ".join(problems)
            + "\nA plan fits exactly the argument structure, shapes and dtypes it was made for.\n"
            "Fix: plan again for this state (step.plan(state, batch)), or pass the matching argnum=."
        )
    leaves = [_place(leaf, sharding) for (_, leaf), sharding in zip(flat, placed, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _listed(what: str, paths: list[str], limit: int = 8) -> str:
    shown = ", ".join(paths[:limit])
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return f"{what}: {shown}{more}"


def _dtype(leaf):
    import jax

    if isinstance(leaf, (bool, int, float, complex)):
        return jax.dtypes.canonicalize_dtype(type(leaf))
    dtype = getattr(leaf, "dtype", None)
    return None if dtype is None else jax.dtypes.canonicalize_dtype(dtype)


def _place(leaf, sharding):
    import jax

    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return jax.device_put(leaf, sharding)
