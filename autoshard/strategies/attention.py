"""cuDNN fused attention (``jax.nn.dot_product_attention(..., implementation="cudnn")``).

jax traces it as ``dot_product_attention_fwd_wrapper`` / ``_bwd_wrapper`` and lowers those through a
``custom_partitioning`` whose rule allows splits on the batch and the heads only (the sequence
and head dims must stay whole). The rule here gives the planner the same choice: each mesh axis
splits the batch, the heads, or nothing, on every operand and result alike.
"""

from __future__ import annotations

import itertools
import math

from autoshard.spec import ShardingSpec
from autoshard.strategies.base import RuleContext, Strategy, assign_axes, divides, register_strategy

BNTH = 1  # jax's AttentionLayout.BNTH; BTNH is 0


def _roles(shape, batch: int, heads: int, layout: int, stats: bool):
    """(batch dim, heads dim) of one value, None where it has no such dim (or broadcasts it)."""
    if len(shape) == 4 and not stats:
        b, n = (0, 1) if layout == BNTH else (0, 2)
        return (b if shape[b] == batch else None, n if shape[n] == heads else None)
    if len(shape) == 3 and stats:  # softmax statistics (B * segments, N, T)
        return (0 if shape[0] % batch == 0 else None, 1 if shape[1] == heads else None)
    if len(shape) >= 1 and shape[0] == batch:  # sequence lengths, offsets
        return (0, None)
    return (None, None)


def _value_roles(op, ctx: RuleContext):
    query = ctx.in_shapes[0]
    layout = op.params["layout"]
    batch, heads = query[0], query[1 if layout == BNTH else 2]
    bwd = "bwd" in op.name
    ins = []
    for k, s in enumerate(ctx.in_shapes):
        ins.append(_roles(s, batch, heads, layout, stats=bwd and k == 10))
    outs = []
    for k, s in enumerate(ctx.out_shapes):
        outs.append(_roles(s, batch, heads, layout, stats=not bwd and k == 1 and len(s) == 3))
    return ins, outs


def _flops(ctx: RuleContext, op) -> float:
    q, v = ctx.in_shapes[0], ctx.in_shapes[2]
    seq_kv = v[2] if op.params["layout"] == BNTH else v[1]
    fwd = 4.0 * math.prod(q) * seq_kv
    return 2.5 * fwd if "bwd" in op.name else fwd


@register_strategy("dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper",
                   "dot_product_attention_fp8_fwd_wrapper", "dot_product_attention_fp8_bwd_wrapper")
def _cudnn_attention(op, ctx: RuleContext) -> list[Strategy]:
    """Every mesh axis splits the batch, the heads, or nothing (jax's own partition rule)."""
    ins, outs = _value_roles(op, ctx)
    axes = ctx.mesh.active_axes
    flops = _flops(ctx, op)
    out = []
    for choice in itertools.product(range(3), repeat=len(axes)):
        def spec(shape, roles, choice=choice):
            placed = [(roles[c - 1], a) for a, c in zip(axes, choice, strict=True) if c and roles[c - 1] is not None]
            return assign_axes(len(shape), placed)

        in_specs = tuple(None if c else spec(s, r) for s, r, c in zip(ctx.in_shapes, ins, ctx.const_inputs,
                                                                      strict=True))
        out_specs = tuple(spec(s, r) for s, r in zip(ctx.out_shapes, outs, strict=True))
        # every axis must split the query and the output: a value that lacks a dim cannot carry it
        if spec(ctx.in_shapes[0], ins[0]).num_shards(ctx.mesh) != ctx.mesh.axes_size(
                [a for a, c in zip(axes, choice, strict=True) if c]):
            continue
        values = [(s, sp) for s, sp in zip(ctx.in_shapes, in_specs, strict=True) if sp is not None]
        values += list(zip(ctx.out_shapes, out_specs, strict=True))
        if not all(divides(s, sp, ctx.mesh) for s, sp in values):
            continue
        shards = spec(ctx.in_shapes[0], ins[0]).num_shards(ctx.mesh)
        out.append(Strategy(str(in_specs[0] or ShardingSpec(())), in_specs, out_specs,
                            compute=ctx.compute_time(flops, shards)))
    return out
