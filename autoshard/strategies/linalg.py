"""Batched linear algebra (``jax.lax.linalg``): the batch dims split, each matrix stays whole.

Every operand and result of these primitives shares the leading batch dims of the first operand,
followed by its own matrix (or vector) dims. A device then factors or solves the matrices of its
batch slice, with no communication.
"""

from __future__ import annotations

import math

from autoshard.spec import ShardingSpec, candidate_specs
from autoshard.strategies.base import RuleContext, Strategy, register_strategy, replicated_strategy

# primitive -> rank of the first operand's core (the dims that are not batch)
CORE_RANK = {
    "cholesky": 2, "cholesky_update": 2, "eig": 2, "eigh": 2, "hessenberg": 2, "householder_product": 2,
    "lu": 2, "lu_pivots_to_permutation": 1, "ormqr": 2, "qr": 2, "schur": 2, "svd": 2,
    "symmetric_product": 2, "triangular_solve": 2, "tridiagonal": 2, "tridiagonal_solve": 1,
    "geqrf": 2, "geqp3": 2,
}


@register_strategy(*CORE_RANK)
def _batched_matrix(op, ctx: RuleContext) -> list[Strategy]:
    first = ctx.in_shapes[0]
    nbatch = len(first) - CORE_RANK[op.name]
    batch = first[:nbatch]
    core = first[nbatch:]
    flops = math.prod(first) * max(core, default=1)
    if nbatch <= 0 or any(len(s) < nbatch or s[:nbatch] != batch for s in ctx.in_shapes + ctx.out_shapes):
        return [replicated_strategy(ctx, flops)]
    out = []
    for spec in candidate_specs(batch, ctx.mesh):
        def full(shape, spec=spec):
            return ShardingSpec(spec.dims + ((),) * (len(shape) - nbatch))

        ins = tuple(None if c else full(s) for s, c in zip(ctx.in_shapes, ctx.const_inputs, strict=True))
        out.append(Strategy(str(spec), ins, tuple(full(s) for s in ctx.out_shapes),
                            compute=ctx.compute_time(flops, spec)))
    return out
