"""PRNG keys and random bits.

A typed key array (dtype ``key<fry>``) has the shape of its batch of keys; the key data
dimension (2 x uint32 for threefry) is implicit. A batch of keys shards along its dims like any
array. Ops that draw new arrays from keys (``random_bits``, ``random_split``, ``random_gamma``)
put the key batch first and the drawn dims after it: the keys take the leading dims' layout and
the drawn dims may be split freely, like ``iota``'s. A dropout mask drawn from one replicated key
is therefore made in the layout of the activations it masks. XLA partitions the counter-based
generator (``jax_threefry_partitionable``, on by default), so the numbers are the ones
``jax.jit`` draws.
"""

from __future__ import annotations

import math

from autoshard.spec import ShardingSpec, candidate_specs, replicated
from autoshard.strategies.base import RuleContext, Strategy, register_strategy
from autoshard.strategies.elementwise import elementwise_strategies
from autoshard.strategies.opinfo import register_op

# A dropout mask is as big as the activation it masks: its layout is not one to follow.
register_op("random_bits", weak_layout=True)


def _leading(spec: ShardingSpec, in_shape, out_shape) -> ShardingSpec:
    """An operand shaped like the leading dims of the output takes their layout; others stay whole."""
    n = len(in_shape)
    if tuple(in_shape) == tuple(out_shape[:n]):
        return ShardingSpec(spec.dims[:n])
    return replicated(n)


def _drawn(ctx: RuleContext, flops_per_element: float = 2.0) -> list[Strategy]:
    shape = ctx.out_shapes[0]
    out = []
    for spec in candidate_specs(shape, ctx.mesh):
        ins = tuple(None if c else _leading(spec, s, shape)
                    for s, c in zip(ctx.in_shapes, ctx.const_inputs, strict=True))
        out.append(Strategy(str(spec), ins, (spec,) * len(ctx.out_shapes),
                            compute=ctx.compute_time(flops_per_element * math.prod(shape), spec)))
    return out


@register_strategy("random_bits", "random_split", "random_gamma")
def _random_draw(op, ctx: RuleContext) -> list[Strategy]:
    """Keys ``[b...]`` -> ``[b..., drawn...]``: any output layout; the keys take the leading dims'."""
    return _drawn(ctx)


@register_strategy("random_fold_in", "random_seed", "random_clone", follows=True)
def _random_elementwise(op, ctx: RuleContext) -> list[Strategy]:
    """One key per element (per seed, per message): elementwise over the batch of keys."""
    return elementwise_strategies(op, ctx)


def _minor_dims(ctx: RuleContext, wide: tuple[int, ...], narrow: tuple[int, ...], narrow_is_input: bool):
    """``narrow`` is ``wide`` without its trailing data dims (key data, an extended dtype's
    representation): the shared leading dims keep their layout, the data dims stay whole."""
    extra = len(wide) - len(narrow)
    out = []
    for spec in candidate_specs(narrow, ctx.mesh):
        full = ShardingSpec(spec.dims + ((),) * extra)
        ins, outs = (spec, full) if narrow_is_input else (full, spec)
        out.append(Strategy(str(spec), (ins,), (outs,)))
    return out


@register_strategy("random_wrap", "to_edtype", follows=True)
def _wrap(op, ctx: RuleContext) -> list[Strategy]:
    """``u32[b..., 2]`` -> ``key[b...]``."""
    return _minor_dims(ctx, ctx.in_shapes[0], ctx.out_shapes[0], narrow_is_input=False)


@register_strategy("random_unwrap", "from_edtype", follows=True)
def _unwrap(op, ctx: RuleContext) -> list[Strategy]:
    """``key[b...]`` -> ``u32[b..., 2]``."""
    return _minor_dims(ctx, ctx.out_shapes[0], ctx.in_shapes[0], narrow_is_input=True)


@register_strategy("rng_bit_generator")
def _rng_bit_generator(op, ctx: RuleContext) -> list[Strategy]:
    """``(key, bits) = rng_bit_generator(key)``: the key stays whole and the bits take any layout.
    XLA draws the stream as jax.jit does, so the numbers match; the compute is counted whole."""
    key, bits = ctx.out_shapes
    compute = ctx.cost.compute_time(2.0 * math.prod(bits))
    return [Strategy(str(s), (replicated(len(ctx.in_shapes[0])),), (replicated(len(key)), s), compute=compute)
            for s in candidate_specs(bits, ctx.mesh)]
