"""Elementwise ops: every operand takes the output's layout; scalars stay replicated."""

from __future__ import annotations

import math

from autoshard.cost import ELEMENTWISE_FLOPS_PER_ELEMENT
from autoshard.spec import ShardingSpec, candidate_specs, replicated
from autoshard.strategies.base import RuleContext, Strategy, register_strategy
from autoshard.strategies.opinfo import register_op

ELEMENTWISE = (
    "abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp clz complex conj "
    "convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor "
    "ge gt igamma igammac imag integer_pow is_finite le lgamma log log1p log2 logistic lt max min mul ne neg "
    "nextafter not or population_count pow real reduce_precision rem round rsqrt select_n "
    "shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient "
    "sub tan tanh xor optimization_barrier_elementwise "
    "bessel_i0e bessel_i1e igamma_grad_a polygamma zeta regularized_incomplete_beta random_gamma_grad "
    "mulhi eq_to le_to lt_to zeros_like one_minus_square "
    # counter-based RNG kernels map each counter to its bits, element by element
    "threefry2x32 threefry4x32 philox2x32 philox4x32"
).split()


def _operand_spec(spec: ShardingSpec, in_shape, out_shape) -> ShardingSpec:
    """The output's layout for an operand; dims it broadcasts (size 1, as lax allows) stay whole."""
    if in_shape == out_shape:
        return spec
    if len(in_shape) != len(out_shape):
        return replicated(len(in_shape))
    return ShardingSpec(tuple(d if n == m else () for d, n, m in zip(spec.dims, in_shape, out_shape, strict=True)))


def elementwise_strategies(op, ctx: RuleContext) -> list[Strategy]:
    """One strategy per candidate layout of the output."""
    shape = ctx.out_shapes[0]
    numel = math.prod(shape)
    out = []
    for spec in candidate_specs(shape, ctx.mesh):
        ins = tuple(
            None if const else _operand_spec(spec, s, shape)
            for s, const in zip(ctx.in_shapes, ctx.const_inputs, strict=True)
        )
        out.append(
            Strategy(
                str(spec),
                ins,
                (spec,) * len(ctx.out_shapes),
                compute=ctx.compute_time(numel * ELEMENTWISE_FLOPS_PER_ELEMENT, spec),
            )
        )
    return out


register_strategy(*ELEMENTWISE, follows=True)(elementwise_strategies)

# Elementwise ops XLA's fusion deems expensive (instruction_fusion.cc IsExpensive): it will not
# duplicate them into several consumers, so their result is materialised once.
EXPENSIVE = ("exp exp2 expm1 log log1p log2 logistic tanh erf erfc erf_inv pow sqrt rsqrt cbrt div atan2 "
             "lgamma digamma igamma igammac").split()
register_op(*EXPENSIVE, expensive=True)
