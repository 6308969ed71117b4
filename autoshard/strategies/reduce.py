"""Reductions and scans along an axis."""

from __future__ import annotations

import math

from autoshard.cost import ELEMENTWISE_FLOPS_PER_ELEMENT
from autoshard.spec import ShardingSpec, candidate_specs, replicated
from autoshard.strategies.base import RuleContext, Strategy, register_strategy
from autoshard.strategies.opinfo import register_op

# Reductions take their producers into the same fusion (XLA's input fusion), but their own
# result is written to a buffer: XLA does not fuse a reduce into its consumers.
register_op(*("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin "
              "reduce_window_sum reduce_window_max reduce_window_min reduce_window cumsum cumprod cummax cummin "
              "cumlogsumexp select_and_scatter_add select_and_gather_add sort").split(), reduction=True)
register_op("reduce_sum", summed_dims=lambda op, ranks: (tuple(op.params["axes"]),))


@register_strategy("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                   "reduce_xor", follows=True)
def _reduce(op, ctx: RuleContext) -> list[Strategy]:
    """Reduce locally, then all-reduce over the axes that split a reduced dimension."""
    axes = set(op.params["axes"])
    shape = ctx.in_shapes[0]
    numel = math.prod(shape)
    out = []
    for spec in candidate_specs(shape, ctx.mesh):
        out_spec = ShardingSpec(tuple(d for i, d in enumerate(spec.dims) if i not in axes))
        reduced = [a for i, d in enumerate(spec.dims) if i in axes for a in d]
        comm, colls = 0.0, ()
        if reduced:
            nbytes = ctx.out_bytes() / max(out_spec.num_shards(ctx.mesh), 1)
            comm, c = ctx.collective("all-reduce", reduced, nbytes)
            colls = (c,)
        out.append(Strategy(str(spec), (spec,), (out_spec,),
                            compute=ctx.compute_time(numel * ELEMENTWISE_FLOPS_PER_ELEMENT, spec),
                            comm=comm, collectives=colls))
    return out


@register_strategy("argmax", "argmin", follows=True)
def _arg_reduce(op, ctx: RuleContext) -> list[Strategy]:
    """The reduced dimension must be whole on each device."""
    axes = set(op.params["axes"])
    shape = ctx.in_shapes[0]
    out = []
    for spec in candidate_specs(shape, ctx.mesh):
        if any(spec.dims[i] for i in axes):
            continue
        out_spec = ShardingSpec(tuple(d for i, d in enumerate(spec.dims) if i not in axes))
        out.append(Strategy(str(spec), (spec,), (out_spec,),
                            compute=ctx.compute_time(math.prod(shape), spec)))
    return out


def _whole_dims_strategies(ctx: RuleContext, whole_dims, nout=None) -> list[Strategy]:
    """Output layout = input layout, with ``whole_dims`` unsharded on both."""
    shape = ctx.in_shapes[0]
    whole = set(whole_dims)
    out = []
    for spec in candidate_specs(shape, ctx.mesh):
        if any(spec.dims[i] for i in whole):
            continue
        ins = tuple(None if c else (spec if s == shape else replicated(len(s)))
                    for s, c in zip(ctx.in_shapes, ctx.const_inputs, strict=True))
        outs = tuple(spec if s == shape else replicated(len(s)) for s in ctx.out_shapes)
        out.append(Strategy(str(spec), ins, outs, compute=ctx.compute_time(math.prod(shape), spec)))
    return out


@register_strategy("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", follows=True)
def _cumulative(op, ctx: RuleContext) -> list[Strategy]:
    return _whole_dims_strategies(ctx, [op.params["axis"]])


@register_strategy("sort", follows=True)
def _sort(op, ctx: RuleContext) -> list[Strategy]:
    return _whole_dims_strategies(ctx, [op.params["dimension"]])


def _select_along(ctx: RuleContext, axis: int) -> list[Strategy]:
    """Ops that pick k entries along ``axis``: it stays whole; every output keeps the other dims' split."""
    shape = ctx.in_shapes[0]
    axis %= len(shape)
    out = []
    for spec in candidate_specs(shape, ctx.mesh):
        if spec.dims[axis]:
            continue
        out.append(Strategy(str(spec), (spec,), (spec,) * len(ctx.out_shapes),
                            compute=ctx.compute_time(math.prod(shape), spec)))
    return out


@register_strategy("top_k", follows=True)
def _top_k(op, ctx: RuleContext) -> list[Strategy]:
    return _select_along(ctx, op.params.get("axis", -1))


@register_strategy("approx_top_k", follows=True)
def _approx_top_k(op, ctx: RuleContext) -> list[Strategy]:
    """Like ``top_k``: the reduction dimension stays whole (its recall target is over the whole row)."""
    return _select_along(ctx, op.params["reduction_dimension"])


@register_strategy("reduce", follows=True)
def _reduce_generic(op, ctx: RuleContext) -> list[Strategy]:
    """A reduction with a user computation (variadic: n operands, then n init values). The reduced
    dims stay whole: an arbitrary computation has no collective to finish a split one."""
    dims = set(op.params["dimensions"])
    n = len(ctx.out_shapes)
    shape = ctx.in_shapes[0]
    out = []
    for spec in candidate_specs(shape, ctx.mesh):
        if any(spec.dims[i] for i in dims):
            continue
        kept = ShardingSpec(tuple(d for i, d in enumerate(spec.dims) if i not in dims))
        ins = tuple(None if c else (spec if k < n else replicated(len(s)))
                    for k, (s, c) in enumerate(zip(ctx.in_shapes, ctx.const_inputs, strict=True)))
        out.append(Strategy(str(spec), ins, (kept,) * n, compute=ctx.compute_time(n * math.prod(shape), spec)))
    return out
