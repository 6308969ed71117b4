"""Layout ops: broadcast, reshape, transpose, squeeze, concatenate, pad, slices.

Most follow their operand: the output keeps the operand's layout, mapped through
the op. Where a dimension is cut, padded, reversed or split in a way that a
sharding cannot follow, the rule requires that dimension whole on the input, so
the planner prices the gather on the edge into the op.
"""

from __future__ import annotations

import math

from autoshard.spec import ShardingSpec, candidate_specs, replicated
from autoshard.strategies.base import RuleContext, Strategy, divides, drop_axes, register_strategy
from autoshard.strategies.opinfo import register_op

# A broadcast is recomputed per element inside its readers' fusion (never written out), and its
# layout is one readers should not follow.
register_op("broadcast_in_dim", fused_source=True, weak_layout=True)
# Reshapes of a buffer are bitcasts: they name the same bytes.
register_op("reshape", "squeeze", "expand_dims", bitcast=True)
# Windowed reductions run on their own (XLA wraps each in a fusion of one op), so their operands
# are buffers.
register_op("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
            "select_and_scatter_add", "select_and_gather_add", windowed=True)


def _main_shape(ctx):
    return ctx.in_shapes[0]


def _same_layout(ctx: RuleContext, whole_dims, main: int = 0) -> list[Strategy]:
    """Each output (and each operand shaped like it) keeps the main operand's
    layout, with ``whole_dims`` unsharded."""
    shape = ctx.in_shapes[main]
    whole = set(whole_dims)
    out = []
    for spec in candidate_specs(shape, ctx.mesh):
        if any(spec.dims[i] for i in whole):
            continue
        ins = tuple(
            None if c else (spec if len(s) == len(shape) else replicated(len(s)))
            for s, c in zip(ctx.in_shapes, ctx.const_inputs, strict=True)
        )
        outs = tuple(spec for _ in ctx.out_shapes)
        if not all(divides(s, spec, ctx.mesh) for s in ctx.out_shapes):
            continue
        if not all(sp is None or divides(s, sp, ctx.mesh) for s, sp in zip(ctx.in_shapes, ins, strict=True)):
            continue
        out.append(Strategy(str(spec), ins, outs, compute=ctx.compute_time(math.prod(shape), spec)))
    return out


@register_strategy("broadcast_in_dim")
def _broadcast_in_dim(op, ctx: RuleContext) -> list[Strategy]:
    """Any output layout; operand dims that are not broadcast keep the output's split."""
    out_shape = ctx.out_shapes[0]
    bdims = op.params["broadcast_dimensions"]
    in_shape = ctx.in_shapes[0]
    out = []
    for spec in candidate_specs(out_shape, ctx.mesh):
        if ctx.const_inputs[0]:
            in_spec = None
        else:
            in_spec = ShardingSpec(
                tuple(spec.dims[bd] if in_shape[i] == out_shape[bd] else () for i, bd in enumerate(bdims))
            )
        extra = (None,) * (len(ctx.in_shapes) - 1)
        out.append(Strategy(str(spec), (in_spec, *extra), (spec,),
                            compute=ctx.compute_time(math.prod(out_shape), spec)))
    return out


@register_strategy("transpose", follows=True)
def _transpose(op, ctx: RuleContext) -> list[Strategy]:
    perm = op.params["permutation"]
    return [
        Strategy(str(spec), (spec,), (ShardingSpec(tuple(spec.dims[p] for p in perm)),))
        for spec in candidate_specs(ctx.in_shapes[0], ctx.mesh)
    ]


@register_strategy("squeeze", follows=True)
def _squeeze(op, ctx: RuleContext) -> list[Strategy]:
    gone = {d % len(ctx.in_shapes[0]) for d in op.params["dimensions"]}
    return [
        Strategy(str(spec), (spec,), (ShardingSpec(tuple(d for i, d in enumerate(spec.dims) if i not in gone)),))
        for spec in candidate_specs(ctx.in_shapes[0], ctx.mesh)
    ]


def reshape_groups(in_shape, out_shape):
    """Pair up runs of input and output dims with equal products (size-1 dims join a neighbour)."""
    groups, i, j = [], 0, 0
    n_in, n_out = len(in_shape), len(out_shape)
    while i < n_in or j < n_out:
        i0, j0 = i, j
        p_in = in_shape[i] if i < n_in else 1
        p_out = out_shape[j] if j < n_out else 1
        i, j = min(i + 1, n_in) if i < n_in else i, min(j + 1, n_out) if j < n_out else j
        while p_in != p_out:
            if p_in < p_out and i < n_in:
                p_in *= in_shape[i]
                i += 1
            elif j < n_out:
                p_out *= out_shape[j]
                j += 1
            else:
                break
        groups.append((tuple(range(i0, i)), tuple(range(j0, j))))
    return groups


def _first_big(dims, shape):
    for d in dims:
        if shape[d] > 1:
            return d
    return None


@register_strategy("reshape", follows=True)
def _reshape(op, ctx: RuleContext) -> list[Strategy]:
    """Splits on the major dim of a merged or split run survive; others must be gathered."""
    in_shape, out_shape = ctx.in_shapes[0], ctx.out_shapes[0]
    groups = reshape_groups(in_shape, out_shape)
    seen, out = set(), []
    for spec in candidate_specs(in_shape, ctx.mesh):
        in_dims = [list(d) for d in spec.dims]
        out_dims = [[] for _ in out_shape]
        for gi, go in groups:
            src, dst = _first_big(gi, in_shape), _first_big(go, out_shape)
            for d in gi:
                if d != src and in_dims[d]:
                    in_dims[d] = []  # a minor dim of the run cannot stay split
            if src is None:
                continue
            axes = in_dims[src]
            if axes and (dst is None or out_shape[dst] % ctx.mesh.axes_size(axes) != 0):
                in_dims[src] = []
                continue
            if axes:
                out_dims[dst] = list(axes)
        in_spec = ShardingSpec(tuple(tuple(d) for d in in_dims))
        out_spec = ShardingSpec(tuple(tuple(d) for d in out_dims))
        if (in_spec, out_spec) in seen:
            continue
        seen.add((in_spec, out_spec))
        out.append(Strategy(str(in_spec), (in_spec, *(None,) * (len(ctx.in_shapes) - 1)), (out_spec,)))
    return out


@register_strategy("concatenate", follows=True)
def _concatenate(op, ctx: RuleContext) -> list[Strategy]:
    d = op.params["dimension"]
    main = max(range(len(ctx.in_shapes)), key=lambda k: (not ctx.const_inputs[k], math.prod(ctx.in_shapes[k])))
    return _same_layout(ctx, [d], main)


@register_strategy("pad", follows=True)
def _pad(op, ctx: RuleContext) -> list[Strategy]:
    whole = [i for i, (lo, hi, interior) in enumerate(op.params["padding_config"]) if lo or hi or interior]
    return _same_layout(ctx, whole)


@register_strategy("slice", follows=True)
def _slice(op, ctx: RuleContext) -> list[Strategy]:
    whole = [i for i, (a, b) in enumerate(zip(ctx.in_shapes[0], ctx.out_shapes[0], strict=True)) if a != b]
    if op.params.get("strides") and any(s != 1 for s in op.params["strides"]):
        whole += [i for i, s in enumerate(op.params["strides"]) if s != 1]
    return _same_layout(ctx, whole)


@register_strategy("dynamic_slice", follows=True)
def _dynamic_slice(op, ctx: RuleContext) -> list[Strategy]:
    whole = [i for i, (a, b) in enumerate(zip(ctx.in_shapes[0], ctx.out_shapes[0], strict=True)) if a != b]
    return _same_layout(ctx, whole)


@register_strategy("dynamic_update_slice", follows=True)
def _dynamic_update_slice(op, ctx: RuleContext) -> list[Strategy]:
    whole = [i for i, (a, b) in enumerate(zip(ctx.in_shapes[0], ctx.in_shapes[1], strict=True)) if a != b]
    return _same_layout(ctx, whole)


@register_strategy("rev", follows=True)
def _rev(op, ctx: RuleContext) -> list[Strategy]:
    return _same_layout(ctx, op.params["dimensions"])


@register_strategy("split", follows=True)
def _split(op, ctx: RuleContext) -> list[Strategy]:
    return _same_layout(ctx, [op.params["axis"]])


@register_strategy("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
                   "select_and_scatter_add", "select_and_gather_add", "select_and_scatter", follows=True)
def _window(op, ctx: RuleContext) -> list[Strategy]:
    """Pooling: only dims with a unit window, unit stride and no padding may stay split."""
    dims = op.params.get("window_dimensions", ())
    strides = op.params.get("window_strides", ())
    padding = op.params.get("padding", ())
    whole = [i for i, w in enumerate(dims) if w != 1]
    whole += [i for i, s in enumerate(strides) if s != 1]
    whole += [i for i, p in enumerate(padding) if tuple(p) != (0, 0)]
    return _same_layout(ctx, whole)


@register_strategy("stack", follows=True)
def _stack(op, ctx: RuleContext) -> list[Strategy]:
    """Any output layout; each operand takes it without the new axis (a split of the new axis is
    a slice of replicated operands)."""
    axis = op.params["axis"]
    shape = ctx.out_shapes[0]
    out = []
    for spec in candidate_specs(shape, ctx.mesh):
        operand = ShardingSpec(spec.dims[:axis] + spec.dims[axis + 1:])
        ins = tuple(None if c else operand for c in ctx.const_inputs)
        out.append(Strategy(str(spec), ins, (spec,), compute=ctx.compute_time(math.prod(shape), spec)))
    return out


@register_strategy("unstack", follows=True)
def _unstack(op, ctx: RuleContext) -> list[Strategy]:
    """The unstacked axis stays whole; every output keeps the other dims' layout."""
    axis = op.params["axis"]
    out = []
    for spec in candidate_specs(ctx.in_shapes[0], ctx.mesh):
        if spec.dims[axis]:
            continue
        piece = ShardingSpec(spec.dims[:axis] + spec.dims[axis + 1:])
        out.append(Strategy(str(spec), (spec,), (piece,) * len(ctx.out_shapes)))
    return out


@register_strategy("tile", follows=True)
def _tile(op, ctx: RuleContext) -> list[Strategy]:
    """Any output layout; dims that are repeated come whole from the operand (each device slices its
    part of the copies), dims with one repeat keep their split."""
    reps = tuple(op.params["reps"])
    in_shape, out_shape = ctx.in_shapes[0], ctx.out_shapes[0]
    lead = len(out_shape) - len(in_shape)  # jnp.tile broadcasts the operand first; the primitive may not
    out = []
    for spec in candidate_specs(out_shape, ctx.mesh):
        operand = ShardingSpec(tuple(spec.dims[lead + i] if reps[lead + i] == 1 else () for i in range(len(in_shape))))
        out.append(Strategy(str(spec), (operand,), (spec,), compute=ctx.compute_time(math.prod(out_shape), spec)))
    return out


@register_strategy("bitcast_convert_type", follows=True)
def _bitcast_convert_type(op, ctx: RuleContext) -> list[Strategy]:
    """Elementwise when the widths match. A narrowing cast adds a minor dim (f32 -> u8[..., 4]) and a
    widening one removes it: the other dims keep their layout and that dim stays whole."""
    in_shape, out_shape = ctx.in_shapes[0], ctx.out_shapes[0]
    base = in_shape if len(in_shape) <= len(out_shape) else out_shape
    out = []
    for spec in candidate_specs(base, ctx.mesh):
        if len(base) == len(in_shape) == len(out_shape):
            ins, outs = spec, spec
        elif len(in_shape) < len(out_shape):
            ins, outs = spec, ShardingSpec(spec.dims + ((),))
        else:
            ins, outs = ShardingSpec(spec.dims + ((),)), spec
        out.append(Strategy(str(spec), (ins,), (outs,), compute=ctx.compute_time(math.prod(base), spec)))
    return out


@register_strategy("fft", follows=True)
def _fft(op, ctx: RuleContext) -> list[Strategy]:
    """The transformed (minor) dims stay whole; leading batch dims keep their split."""
    n = len(op.params["fft_lengths"])
    rank = len(ctx.in_shapes[0])
    batch = rank - n
    out = []
    for spec in candidate_specs(ctx.in_shapes[0], ctx.mesh):
        if any(spec.dims[batch:]):
            continue
        outs = ShardingSpec(spec.dims[:batch] + ((),) * (len(ctx.out_shapes[0]) - batch))
        out.append(Strategy(str(spec), (spec,), (outs,), compute=ctx.compute_time(
            5.0 * math.prod(ctx.in_shapes[0]) * max(1, math.log2(max(math.prod(ctx.in_shapes[0][batch:]), 2))),
            spec)))
    return out


__all__ = ["drop_axes", "reshape_groups"]
