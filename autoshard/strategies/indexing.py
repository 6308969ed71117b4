"""Gather and scatter: embedding lookups and their gradients.

Mesh axes may split (a) the index batch (each device looks up its own indices in
a replicated table), or (b) a table dimension that every lookup takes whole (the
hidden dimension of an embedding). A scatter-add whose index batch is split sums
partial tables with an all-reduce.
"""

from __future__ import annotations

import itertools
import math

from autoshard.strategies.base import RuleContext, Strategy, assign_axes, divides, register_strategy
from autoshard.strategies.opinfo import register_op


def _product_strategies(ctx, roles, build, name):
    axes = ctx.mesh.active_axes
    out = []
    for choice in itertools.product(range(len(roles)), repeat=len(axes)):
        res = build([(a, roles[ri]) for a, ri in zip(axes, choice, strict=True) if roles[ri] is not None])
        if res is not None:
            out.append(res)
    return out


@register_strategy("gather")
def _gather(op, ctx: RuleContext) -> list[Strategy]:
    dn = op.params["dimension_numbers"]
    operand_shape, idx_shape = ctx.in_shapes[0], ctx.in_shapes[1]
    out_shape = ctx.out_shapes[0]
    slice_sizes = op.params["slice_sizes"]
    offset_dims = tuple(dn.offset_dims)
    op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
    window_operand_dims = [d for d in range(len(operand_shape))
                           if d not in dn.collapsed_slice_dims and d not in op_batching]
    batch_out_dims = [d for d in range(len(out_shape)) if d not in offset_dims]
    idx_batch_dims = list(range(len(idx_shape) - 1))  # jax puts the index vector last
    roles = [None]
    # (a) index batch: out batch dim <-> indices dim (operand batching dims follow along)
    for ob, ib in zip(batch_out_dims, idx_batch_dims, strict=False):
        opd = op_batching[idx_batching.index(ib)] if ib in idx_batching else None
        roles.append(("batch", ob, ib, opd))
    # (b) operand dims taken whole by every slice
    for od, wd in zip(offset_dims, window_operand_dims, strict=False):
        if slice_sizes[wd] == operand_shape[wd]:
            roles.append(("window", od, None, wd))

    def build(placed):
        ops_, idx_, out_ = [], [], []
        for a, (_, od, ib, opd) in placed:
            out_.append((od, a))
            if ib is not None:
                idx_.append((ib, a))
            if opd is not None:
                ops_.append((opd, a))
        specs = (assign_axes(len(operand_shape), ops_), assign_axes(len(idx_shape), idx_),
                 assign_axes(len(out_shape), out_))
        if not all(divides(s, sp, ctx.mesh) for s, sp in zip((operand_shape, idx_shape, out_shape), specs,
                                                            strict=True)):
            return None
        return Strategy(f"{specs[0]}[{specs[1]}]", specs[:2], specs[2:],
                        compute=ctx.compute_time(math.prod(out_shape), specs[2]))

    return _product_strategies(ctx, roles, build, "gather")


def _scatter_add_summed(op, ranks) -> tuple[tuple[int, ...], ...]:
    """The index dimensions a scatter-add sums over (not batching ones), and the updates' dimensions they pair
    with; the operand (zeros, for a sum) has none."""
    dn = op.params["dimension_numbers"]
    idx_batching = set(getattr(dn, "scatter_indices_batching_dims", ()))
    upd_scatter = [d for d in range(ranks[2]) if d not in tuple(dn.update_window_dims)]
    pairs = [(ib, ud) for ib, ud in zip(range(ranks[1] - 1), upd_scatter, strict=False) if ib not in idx_batching]
    return (), tuple(ib for ib, _ in pairs), tuple(ud for _, ud in pairs)


register_op("scatter-add", "scatter_add", summed_dims=_scatter_add_summed)


@register_strategy("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min",
                   "scatter_min", "scatter-max", "scatter_max", "scatter-sub", "scatter_sub")
def _scatter(op, ctx: RuleContext) -> list[Strategy]:
    dn = op.params["dimension_numbers"]
    operand_shape, idx_shape, upd_shape = ctx.in_shapes[:3]
    op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    window_operand_dims = [d for d in range(len(operand_shape))
                           if d not in dn.inserted_window_dims and d not in op_batching]
    upd_window = tuple(dn.update_window_dims)
    upd_scatter = [d for d in range(len(upd_shape)) if d not in upd_window]
    idx_batch_dims = list(range(len(idx_shape) - 1))
    is_add = "add" in op.name
    roles = [None]
    for ud, od in zip(upd_window, window_operand_dims, strict=False):
        if upd_shape[ud] == operand_shape[od]:
            roles.append(("window", od, None, ud))
    for ud, ib in zip(upd_scatter, idx_batch_dims, strict=False):
        if ib in idx_batching:
            roles.append(("batched", op_batching[idx_batching.index(ib)], ib, ud))
        elif is_add:
            roles.append(("partial", None, ib, ud))

    def build(placed):
        o_, i_, u_, partial = [], [], [], []
        for a, (kind, od, ib, ud) in placed:
            if od is not None:
                o_.append((od, a))
            if ib is not None:
                i_.append((ib, a))
            u_.append((ud, a))
            if kind == "partial":
                partial.append(a)
        specs = (assign_axes(len(operand_shape), o_), assign_axes(len(idx_shape), i_),
                 assign_axes(len(upd_shape), u_))
        if not all(divides(s, sp, ctx.mesh) for s, sp in zip(ctx.in_shapes[:3], specs, strict=True)):
            return None
        comm, colls = 0.0, ()
        if partial:
            comm, c = ctx.collective("all-reduce", partial, ctx.out_bytes() / specs[0].num_shards(ctx.mesh))
            colls = (c,)
        return Strategy(f"{specs[0]}<-{specs[2]}", specs, (specs[0],), comm=comm, collectives=colls,
                        compute=ctx.compute_time(math.prod(upd_shape), specs[2]))

    return _product_strategies(ctx, roles, build, "scatter")
