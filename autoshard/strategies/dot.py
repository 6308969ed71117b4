"""Contractions: ``dot_general`` and ``conv_general_dilated``.

Each active mesh axis takes one role: split a batch dimension, a free dimension
of either operand, or the contracted dimension, or none. A split contraction
leaves partial sums: the strategy either all-reduces them, or reduce-scatters
them onto one output dimension (Alpa's "RS" family, which is ZeRO's gradient
reduce-scatter when the contraction is the batch).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from autoshard.spec import ShardingSpec, replicated
from autoshard.strategies.base import (
    RuleContext,
    Strategy,
    assign_axes,
    divides,
    register_strategy,
    replicated_strategy,
)
from autoshard.strategies.opinfo import register_op


def dot_flops(dimension_numbers, lhs_shape, out_shape) -> float:
    """``2 · output elements · contracted size`` of a ``dot_general``."""
    (lc, _), _ = dimension_numbers
    return 2.0 * math.prod(out_shape) * math.prod(lhs_shape[d] for d in lc)


def conv_flops(dimension_numbers, rhs_shape, out_shape) -> float:
    """``2 · output elements · (kernel input features · window)`` of a ``conv_general_dilated``
    (the kernel's input-feature dim already counts one feature group)."""
    rhs_spec = dimension_numbers.rhs_spec
    return 2.0 * math.prod(out_shape) * rhs_shape[rhs_spec[1]] * math.prod(rhs_shape[d] for d in rhs_spec[2:])


def _shape(x, avals) -> tuple[int, ...]:
    return tuple(x.shape) if not isinstance(x, int) else tuple(avals[x].shape)  # a Const literal has its own


def _dot_op_flops(op, avals) -> float:
    return dot_flops(op.params["dimension_numbers"], _shape(op.inputs[0], avals), _shape(op.outputs[0], avals))


def _conv_op_flops(op, avals) -> float:
    return conv_flops(op.params["dimension_numbers"], _shape(op.inputs[1], avals), _shape(op.outputs[0], avals))


def _dot_summed(op, ranks) -> tuple[tuple[int, ...], tuple[int, ...]]:
    (lc, rc), _ = op.params["dimension_numbers"]
    return tuple(lc), tuple(rc)


def _conv_summed(op, ranks) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # Only the feature dimension: a split window (spatial) dimension needs halos, not a sum of parts.
    if op.params["feature_group_count"] == 1 and op.params["batch_group_count"] == 1:
        dn = op.params["dimension_numbers"]
        return (dn.lhs_spec[1],), (dn.rhs_spec[1],)
    return (), ()


register_op("dot_general", contraction=True, contracted_dims=lambda op: _dot_summed(op, None)[0],
            summed_dims=_dot_summed, flops=_dot_op_flops)
register_op("conv_general_dilated", contraction=True, contracted_dims=lambda op: _conv_summed(op, None)[0],
            summed_dims=_conv_summed, flops=_conv_op_flops)


@dataclasses.dataclass(frozen=True, slots=True)
class _Roles:
    """One role assignment of the mesh axes: operand layouts, output placements, contracted axes."""

    lhs: ShardingSpec
    rhs: ShardingSpec
    out_placements: tuple
    k_axes: tuple
    shards: int


def _finish(ctx, name, roles: _Roles, flops) -> list[Strategy]:
    """Strategies for one role assignment: all-reduce the partial sums, or reduce-scatter them."""
    lhs_spec, rhs_spec, k_axes = roles.lhs, roles.rhs, roles.k_axes
    out_rank = len(ctx.out_shapes[0])
    base_out = assign_axes(out_rank, roles.out_placements)
    compute = ctx.compute_time(flops, roles.shards)
    if not k_axes:
        return [Strategy(name, (lhs_spec, rhs_spec), (base_out,), compute=compute)]
    nbytes = ctx.out_bytes() / base_out.num_shards(ctx.mesh)
    comm, c = ctx.collective("all-reduce", k_axes, nbytes)
    out = [Strategy(name + "|AR", (lhs_spec, rhs_spec), (base_out,), compute=compute, comm=comm, collectives=(c,))]
    for d in range(out_rank):
        # The scattered axes tile within the tiles the output already has on ``d``: the
        # reduce-scatter of a partial sum over ``k`` leaves device (i, k) block ``i·n_k + k``.
        dims = list(base_out.dims)
        dims[d] = dims[d] + tuple(k_axes)
        spec = ShardingSpec(tuple(dims))
        if not divides(ctx.out_shapes[0], spec, ctx.mesh):
            continue
        comm, c = ctx.collective("reduce-scatter", k_axes, nbytes)
        out.append(Strategy(f"{name}|RS{d}", (lhs_spec, rhs_spec), (spec,), compute=compute, comm=comm,
                            collectives=(c,)))
    return out


def _place(roles, axes, choice):
    """Turn one role per mesh axis into (lhs, rhs, out) placements and the contracted axes."""
    lp, rp, op_, k_axes = [], [], [], []
    for a, ri in zip(axes, choice, strict=True):
        dl, dr, o, is_k = roles[ri][:4]
        if dl is not None:
            lp.append((dl, a))
        if dr is not None:
            rp.append((dr, a))
        if o is not None:
            op_.append((o, a))
        if is_k:
            k_axes.append(a)
    return lp, rp, op_, k_axes


def _placements(ctx: RuleContext, roles, lshape, rshape):
    """Every way to put each mesh axis on one role (or none) that divides both operands:
    ``(lhs_spec, rhs_spec, output placements, contracted axes, shards of the work)``."""
    axes = ctx.mesh.active_axes
    for choice in itertools.product(range(len(roles)), repeat=len(axes)):
        lp, rp, op_, k_axes = _place(roles, axes, choice)
        lhs_spec, rhs_spec = assign_axes(len(lshape), lp), assign_axes(len(rshape), rp)
        if not (divides(lshape, lhs_spec, ctx.mesh) and divides(rshape, rhs_spec, ctx.mesh)):
            continue
        shards = ctx.mesh.axes_size([a for a, ri in zip(axes, choice, strict=True) if ri != 0])
        yield _Roles(lhs_spec, rhs_spec, tuple(op_), tuple(k_axes), shards)


@register_strategy("dot_general")
def _dot_general(op, ctx: RuleContext) -> list[Strategy]:
    return _dot_strategies(ctx, op.params["dimension_numbers"])


def _dot_strategies(ctx: RuleContext, dimension_numbers) -> list[Strategy]:
    (lc, rc), (lb, rb) = dimension_numbers
    lshape, rshape = ctx.in_shapes[:2]
    lfree = [d for d in range(len(lshape)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rshape)) if d not in rc and d not in rb]
    # Roles: (lhs dim, rhs dim, out dim, is_contraction); None where the operand lacks the dim.
    roles = [(None, None, None, False)]
    roles += [(dl, dr, i, False) for i, (dl, dr) in enumerate(zip(lb, rb, strict=True))]
    roles += [(d, None, len(lb) + i, False) for i, d in enumerate(lfree)]
    roles += [(None, d, len(lb) + len(lfree) + i, False) for i, d in enumerate(rfree)]
    roles += [(dl, dr, None, True) for dl, dr in zip(lc, rc, strict=True)]
    flops = dot_flops(dimension_numbers, lshape, ctx.out_shapes[0])
    out = []
    for r in _placements(ctx, roles, lshape, rshape):
        out.extend(_finish(ctx, f"{r.lhs}x{r.rhs}", r, flops))
    return out


@register_strategy("conv_general_dilated")
def _conv(op, ctx: RuleContext) -> list[Strategy]:
    dn = op.params["dimension_numbers"]
    lhs_b, lhs_f = dn.lhs_spec[0], dn.lhs_spec[1]
    rhs_o, rhs_i = dn.rhs_spec[0], dn.rhs_spec[1]
    out_b, out_f = dn.out_spec[0], dn.out_spec[1]
    groups = op.params["feature_group_count"]
    batch_groups = op.params["batch_group_count"]
    lshape, rshape = ctx.in_shapes
    # Roles: (lhs dim, rhs dim, out dim, is_contraction, divisor that must split evenly)
    roles = [(None, None, None, False, 1)]
    if batch_groups == 1:
        roles.append((lhs_b, None, out_b, False, 1))
    else:
        roles.append((lhs_b, rhs_o, out_f, False, batch_groups))
    if groups == 1:
        roles.append((None, rhs_o, out_f, False, 1))
        roles.append((lhs_f, rhs_i, None, True, 1))
    else:
        roles.append((lhs_f, rhs_o, out_f, False, groups))
    flops = conv_flops(dn, rshape, ctx.out_shapes[0])
    axes = ctx.mesh.active_axes
    out = []
    for choice in itertools.product(range(len(roles)), repeat=len(axes)):
        if any(roles[ri][4] != 1 and roles[ri][4] % ctx.mesh.axes_size(
                [a for a, c in zip(axes, choice, strict=True) if c == ri]) for ri in set(choice)):
            continue  # a grouped role must split its groups evenly
        lp, rp, op_, k_axes = _place(roles, axes, choice)
        lhs_spec, rhs_spec = assign_axes(len(lshape), lp), assign_axes(len(rshape), rp)
        if not (divides(lshape, lhs_spec, ctx.mesh) and divides(rshape, rhs_spec, ctx.mesh)):
            continue
        if not divides(ctx.out_shapes[0], assign_axes(len(ctx.out_shapes[0]), op_), ctx.mesh):
            continue
        shards = ctx.mesh.axes_size([a for a, ri in zip(axes, choice, strict=True) if ri != 0])
        out.extend(_finish(ctx, f"{lhs_spec}*{rhs_spec}", _Roles(lhs_spec, rhs_spec, tuple(op_), tuple(k_axes), shards),
                           flops))
    return out



@register_strategy("ragged_dot_general")
def _ragged_dot_general(op, ctx: RuleContext) -> list[Strategy]:
    """Grouped matmul (MoE experts): ``lhs [m, k] x rhs [g, k, n] -> [m, n]``, rows grouped by ``group_sizes``.

    The ragged dim (and the rhs group dim) stay whole: the group sizes count rows of the whole
    array. Batch dims, the other free dims (``n``) and the contraction (``k``, all-reduced) split as
    in ``dot_general``. In the ragged-contracting mode of the backward pass (``lhs [m, k] x
    dout [m, n] -> [g, k, n]``) the output gains a leading group dim that stays whole."""
    rdn = op.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
    ragged = rdn.lhs_ragged_dimensions[0]
    groups = tuple(rdn.rhs_group_dimensions)
    lshape, rshape = ctx.in_shapes[:2]
    lfree = [d for d in range(len(lshape)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rshape)) if d not in rc and d not in rb and d not in groups]
    lead = 1 if ragged in lc else 0
    num_groups = ctx.in_shapes[2][-1]
    expected = ((num_groups,) * lead + tuple(lshape[d] for d in lb) + tuple(lshape[d] for d in lfree)
                + tuple(rshape[d] for d in rfree))
    contracted = math.prod(lshape[d] for d in lc)
    flops = 2.0 * math.prod(ctx.out_shapes[0]) / max(num_groups, 1) ** lead * contracted
    gs_spec = None if ctx.const_inputs[2] else replicated(len(ctx.in_shapes[2]))
    if expected != tuple(ctx.out_shapes[0]):  # a mode this rule does not know: run it whole
        return [replicated_strategy(ctx, flops)]
    base = lead + len(lb)
    roles = [(None, None, None, False)]
    roles += [(dl, dr, lead + i, False) for i, (dl, dr) in enumerate(zip(lb, rb, strict=True)) if dl != ragged]
    roles += [(d, None, base + i, False) for i, d in enumerate(lfree) if d != ragged]
    roles += [(None, d, base + len(lfree) + i, False) for i, d in enumerate(rfree)]
    roles += [(dl, dr, None, True) for dl, dr in zip(lc, rc, strict=True) if dl != ragged]
    out = []
    for r in _placements(ctx, roles, lshape, rshape):
        for s in _finish(ctx, f"{r.lhs}x{r.rhs}", r, flops):
            if "|RS" not in s.name:  # the group-wise partial sums are all-reduced whole
                out.append(dataclasses.replace(s, in_specs=(*s.in_specs, gs_spec)))
    return out


def _scale_spec(spec: ShardingSpec, shape, scale_shape, mesh) -> ShardingSpec | None:
    """A block scale's layout: its operand's, on every dim the scale does not broadcast."""
    dims = tuple(d if m != 1 else () for d, m in zip(spec.dims, scale_shape, strict=True))
    out = ShardingSpec(dims)
    return out if divides(scale_shape, out, mesh) else None


# cuBLASLt's block-scaled matmul (GPU): a [B, M, K] x b [B, N, K] -> [B, M, N], lowered through a
# custom_partitioning that splits B, M, N and K (summed) as a dot_general does.
_SCALED_MATMUL_DIMS = (((2,), (2,)), ((0,), (0,)))


@register_strategy("scaled_dot", "scaled_matmul_wrapper")
def _scaled_dot(op, ctx: RuleContext) -> list[Strategy]:
    """A block-scaled ``dot_general`` (``lhs, rhs, lhs_scale, rhs_scale``, scales of the operands' rank,
    the contracted dims in blocks): each scale takes its operand's layout."""
    dims = op.params.get("dimension_numbers", _SCALED_MATMUL_DIMS)
    out = []
    for s in _dot_strategies(ctx, dims):
        if "|RS" in s.name:
            continue
        scales = []
        for k in (2, 3):
            if k >= len(ctx.in_shapes) or ctx.const_inputs[k]:
                scales.append(None)
                continue
            scales.append(_scale_spec(s.in_specs[k - 2], ctx.in_shapes[k - 2], ctx.in_shapes[k], ctx.mesh))
            if scales[-1] is None:
                break
        else:
            out.append(dataclasses.replace(s, in_specs=(*s.in_specs, *scales[:len(ctx.in_shapes) - 2])))
    return out
