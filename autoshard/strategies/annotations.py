"""Sharding annotations written in the user's model code: ``jax.lax.with_sharding_constraint``, and
``jax.sharding.reshard`` / ``out_sharding=`` in code written for Explicit mesh axes (:mod:`autoshard.explicit`).

A constraint is a pin: its one strategy lays the value out as the user asked, matched to the
planning mesh by axis names, so the planner prices everything around it. Lowering applies the plan's
layout in its place (``lower.py``), on whichever mesh the plan chose. A constraint that names axes
the planning mesh lacks, or that does not divide the value, lays out nothing: it follows its operand.
"""

from __future__ import annotations

import math

from autoshard.explicit import pin_sharding
from autoshard.spec import ShardingSpec
from autoshard.strategies.base import RuleContext, Strategy, divides, register_strategy
from autoshard.strategies.elementwise import elementwise_strategies


def pinned_spec(op, ctx: RuleContext) -> ShardingSpec | None:
    """The layout a ``sharding_constraint`` (or ``reshard``) asks for on the planning mesh, or None if it cannot
    be had."""
    sharding = pin_sharding(op)
    pspec = getattr(sharding, "spec", None)
    if pspec is None:
        return None
    shape = ctx.out_shapes[0]
    try:
        spec = ShardingSpec.from_partition_spec(pspec, len(shape), ctx.mesh)
    except (ValueError, TypeError):  # another mesh's axis names, or P.UNCONSTRAINED entries
        return None
    return spec if divides(shape, spec, ctx.mesh) else None


@register_strategy("sharding_constraint", "reshard")
def _sharding_constraint(op, ctx: RuleContext) -> list[Strategy]:
    spec = pinned_spec(op, ctx)
    if spec is None:
        return elementwise_strategies(op, ctx)
    return [Strategy(str(spec), (spec,), (spec,), compute=ctx.compute_time(math.prod(ctx.out_shapes[0]), spec))]
