"""Sources (iota, empty), identities (reshard, names, barriers) and ops that run replicated on purpose.

Each :func:`register_replicated` call names why replicated is right for those primitives;
:func:`autoshard.strategies.coverage` reports the reasons.
"""

from __future__ import annotations

import math

from autoshard.capture import INLINED
from autoshard.spec import candidate_specs, replicated
from autoshard.strategies.base import (
    RuleContext,
    Strategy,
    register_replicated,
    register_replicated_family,
    register_strategy,
    replicated_strategy,
)
from autoshard.strategies.opinfo import op_flops, register_op

register_replicated(
    "while", "cond", "custom_linear_solve", "composite", "remat_opt", "linear_call", "custom_vmap_call",
    "compute_on", "fused_call", "xla_metadata_call", "call", "custom_jvp_call_jaxpr", "eval_jaxpr",
    "program_order",
    why="its body is re-bound as is; the operands it carries across the control flow or call boundary "
    "stay whole, so the body sees the values it was written for",
)
register_replicated(
    "pure_callback", "io_callback", "debug_callback", "debug_print", "buffer_callback", "inspect_sharding",
    "check", why="a host callback (or a check) sees whole arrays, as the user's function expects",
)
register_replicated(
    "custom_call", "ffi_call", "call_exported", "cudnn_fusion", "rnn_fwd", "rnn_bwd", "scaled_matmul",
    why="a foreign kernel (FFI, serialized module, GPU-only cuDNN/cuBLASLt call) has no declared sharding; "
    "it computes on whole operands",
)
register_replicated(
    "dot_product_attention_fwd", "dot_product_attention_bwd", "dot_product_attention_fp8_fwd",
    "dot_product_attention_fp8_bwd",
    why="the cuDNN attention kernel itself exists only inside the custom_partitioning that lowers its "
    "traced wrapper (strategies/attention.py shards the wrapper on batch and heads)",
)
register_replicated(
    "rng_uniform",
    why="XLA's RngUniform draws from a hidden backend state; kept whole, it draws what one jax.jit draws",
)
register_replicated(
    "after_all", "create_token", "platform_index", "dim_as_value", "dimension_size", "shape_assertion",
    "empty2",
    why="a token, a scalar or a shape check: there is nothing to split",
)
register_replicated(
    "new_ref", "empty_ref", "free_ref", "freeze", "accum_grad_in_ref", "get", "swap", "addupdate",
    "run_state", "broadcast_to", "pin", "unpin", "create_linear", "box_get", "box_set", "new_box",
    "new_log", "log_extend", "log_read", "call_hi_primitive", "call_hi_primitive_linearized",
    why="a mutable reference (jax.new_ref, state, hijax box) aliases one buffer; it stays whole so every "
    "read and write sees the same data",
)
register_replicated(
    "custom_lin", "unreachable",
    why="exists only while jax differentiates a function; never in a traced step",
)
register_replicated(
    "global_array_to_host_local_array", "host_local_array_to_global_array",
    why="multi-process array conversions run outside jit, on process-local data",
)
# Sparse formats: the nse dimension of the indices does not map onto any dense dimension, so a dense
# layout says nothing about which entries a device holds.
register_replicated(
    "bcoo_dot_general", "bcoo_dot_general_sampled", "bcoo_extract", "bcoo_fromdense", "bcoo_sort_indices",
    "bcoo_spdot_general", "bcoo_sum_duplicates", "bcoo_todense", "bcoo_transpose", "bcsr_dot_general",
    "bcsr_extract", "bcsr_fromdense", "bcsr_todense", "coo_fromdense", "coo_matmat", "coo_matvec",
    "coo_spmm", "coo_spmv", "coo_todense", "csr_fromdense", "csr_matmat", "csr_matvec", "csr_spmm",
    "csr_spmv", "csr_todense", "spsolve", "todense",
    why="a sparse operand's entries (data, indices) have no dense layout to split",
)
# Collectives over named axes are only legal where those axes are manual: inside a shard_map body,
# which is re-bound as it is (see strategies/manual.py). At the top level they do not occur.
register_replicated(
    "psum", "pmax", "pmin", "ppermute", "all_gather", "all_to_all", "axis_index", "ragged_all_to_all",
    "reduce_scatter", "psum_invariant", "all_gather_invariant", "all_gather_reduced", "pbroadcast",
    "preduced", "psend", "precv", "unreduced_psum", "unreduced_pmax", "unreduced_pmin", "unreduced_reduce_scatter",
    "pvary",
    "reduced_vary_cast_p", "vary_unreduced_cast_p",
    "all_gather_start", "all_gather_done", "all_gather_reduced_start", "all_to_all_start", "all_to_all_done",
    "pbroadcast_start", "pbroadcast_done", "ppermute_start", "ppermute_done", "psum_start", "psum_done",
    "psum_invariant_start", "reduce_scatter_start", "reduce_scatter_done", "unreduced_psum_start",
    "unreduced_reduce_scatter_start",
    why="a collective over manual mesh axes exists only inside a shard_map body, which keeps its own layout",
)
# pallas_call has a rule of its own (strategies/pallas.py: split along the parallel axes of its grid).
register_replicated(
    "core_map", "tpu_custom_call", "mosaic_gpu_p",
    why="a Pallas/Mosaic/Triton kernel launch without a grid autoshard can read computes on whole operands "
    "(wrap it in shard_map or custom_partitioning to shard it)",
)
register_replicated_family(
    "jax._src.pallas", "jax.experimental.pallas", "jax.experimental.mosaic", "jax._src.tpu_custom_call",
    why="a kernel-language primitive: it exists only inside a Pallas/Mosaic kernel body, which runs as one op",
)




def _scan_flops(op, avals) -> float:
    """A scan's body flops, once per iteration."""
    if op.body is None:
        return float(sum(math.prod(getattr(avals[v], "shape", ())) for v in op.outputs))
    return sum(op_flops(o, avals) for o in op.body.ops) * int(op.params.get("length", 1))


# Structure: capture inlines calls (capture.INLINED) and keeps a scan as one op over a body the
# planner solves; while and cond are opaque, re-bound as they are. Remat duplicates neither them nor
# effects (callbacks).
register_op(*INLINED, structure="inlined")
register_op("scan", structure="scan", flops=_scan_flops)
register_op("while", structure="while", duplicable=False)
register_op("cond", structure="cond", duplicable=False)
register_op("debug_callback", "io_callback", duplicable=False)
# An iota is computed inside its readers' fusion; a remat fence leads its own node (see remat.py).
register_op("iota", fused_source=True, weak_layout=True)
register_op("optimization_barrier", weak_layout=True)


def identity_strategies(ctx: RuleContext) -> list[Strategy]:
    """Every layout passes through unchanged (when all operands share one shape)."""
    shapes = set(ctx.in_shapes)
    if len(shapes) != 1 or len(ctx.out_shapes) != len(ctx.in_shapes):
        return [replicated_strategy(ctx)]
    specs = candidate_specs(next(iter(shapes)), ctx.mesh)
    n = len(ctx.in_shapes)
    return [Strategy(str(s), (s,) * n, (s,) * n) for s in specs]


@register_strategy("optimization_barrier")
def _optimization_barrier(op, ctx: RuleContext) -> list[Strategy]:
    """An identity on its operands: every layout passes through (when all operands share a shape).

    Remat fences (autoshard/remat.py) are such barriers; they lead their own node, so the
    recomputed ops behind them do not merge into the forward ops that made their inputs."""
    return identity_strategies(ctx)


@register_strategy("layout_constraint", "name", "consume", "assert_consumed_value",
                   "xla_metadata_value", "device_put", "shard_alike", "stage", "relayout",
                   "with_memory_space_constraint", follows=True)
def _identity(op, ctx: RuleContext) -> list[Strategy]:
    """Identities on values (``reshard``, an explicit-sharding annotation, is a pin: strategies/annotations.py).
    ``relayout`` (a device layout) and ``with_memory_space_constraint`` (a memory kind) change where the value
    lives, not its values."""
    return identity_strategies(ctx)


@register_strategy("tie", follows=True)
def _tie(op, ctx: RuleContext) -> list[Strategy]:
    """``tie(x, y) = y``: ``x`` only orders the computation; ``y`` passes through."""
    return [Strategy(str(s), (None, s), (s,)) for s in candidate_specs(ctx.in_shapes[1], ctx.mesh)]


@register_strategy("dce_sink")
def _dce_sink(op, ctx: RuleContext) -> list[Strategy]:
    """Keeps its operand alive; reads it in whatever layout it has."""
    return [Strategy("sink", (None,) * len(ctx.in_shapes), ())]


def source_strategies(ctx: RuleContext) -> list[Strategy]:
    """An op that makes new arrays from nothing (or from replicated scalars): any output layout."""
    shape = ctx.out_shapes[0]
    if any(s != shape for s in ctx.out_shapes):
        return [replicated_strategy(ctx)]
    ins = tuple(None if c else replicated(len(s)) for s, c in zip(ctx.in_shapes, ctx.const_inputs, strict=True))
    return [Strategy(str(s), ins, (s,) * len(ctx.out_shapes), compute=ctx.compute_time(math.prod(shape), s))
            for s in candidate_specs(shape, ctx.mesh)]


@register_strategy("iota", "empty", "iota_2x32_shape")
def _source(op, ctx: RuleContext) -> list[Strategy]:
    return source_strategies(ctx)
