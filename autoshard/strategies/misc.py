"""Sources (iota), random numbers, control flow and other ops with a fixed layout."""

from __future__ import annotations

import math

from autoshard.spec import candidate_specs
from autoshard.strategies.base import RuleContext, Strategy, register_strategy, replicated_strategy

REPLICATED_ONLY = (
    "random_bits random_seed random_split random_fold_in random_wrap random_unwrap threefry2x32 "
    "rng_bit_generator rng_uniform while cond custom_call pure_callback io_callback debug_callback "
    "cudnn_dot_product_attention psum all_gather"
).split()


@register_strategy(*REPLICATED_ONLY)
def _replicated(op, ctx: RuleContext) -> list[Strategy]:
    """Known ops that autoshard runs replicated (control flow keeps its operands whole)."""
    flops = sum(math.prod(s) for s in ctx.out_shapes)
    return [replicated_strategy(ctx, flops)]


@register_strategy("optimization_barrier")
def _optimization_barrier(op, ctx: RuleContext) -> list[Strategy]:
    """An identity on its operands: every layout passes through (when all operands share a shape).

    Remat fences (autoshard/remat.py) are such barriers; they lead their own node, so the
    recomputed ops behind them do not merge into the forward ops that made their inputs."""
    shapes = set(ctx.in_shapes)
    if len(shapes) != 1:
        return [replicated_strategy(ctx)]
    specs = candidate_specs(next(iter(shapes)), ctx.mesh)
    n = len(ctx.in_shapes)
    return [Strategy(str(s), (s,) * n, (s,) * n) for s in specs]


@register_strategy("iota")
def _iota(op, ctx: RuleContext) -> list[Strategy]:
    shape = ctx.out_shapes[0]
    return [Strategy(str(s), (), (s,), compute=ctx.compute_time(math.prod(shape), s))
            for s in candidate_specs(shape, ctx.mesh)]
