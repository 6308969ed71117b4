"""Ops whose sharding the user declared: ``shard_map`` regions and ``custom_partitioning`` kernels.

A ``shard_map`` is one opaque op: its body is manual and is re-bound as it is. Its ``in_specs``
and ``out_specs`` fix the layouts of its operands and results, so its rule has exactly one
strategy. A ``custom_partitioning`` op declares a Shardy sharding rule: a factor name per
dimension of each operand and result. Dimensions that share a factor may be split alike, so the
strategies assign mesh axes to factors; XLA then calls the op's ``partition`` callback on the
shards.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.extend.core as jex_core
from jax.experimental.custom_partitioning import BATCHING

from autoshard.errors import MeshError
from autoshard.spec import MeshInfo, ShardingSpec
from autoshard.strategies.base import RuleContext, Strategy, divides, register_strategy, replicated_strategy


def jaxpr_flops(jaxpr) -> float:
    """A rough count of a jaxpr's flops: contractions exactly, everything else one per output element."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        out = sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
        if eqn.primitive.name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            total += 2.0 * out * math.prod(eqn.invars[0].aval.shape[d] for d in lc)
            continue
        inner = list(jex_core.jaxprs_in_params(eqn.params))
        if inner:
            trips = int(eqn.params.get("length", 1))
            total += trips * sum(jaxpr_flops(j) for j in inner)
        else:
            total += out
    return total


# ---- shard_map -----------------------------------------------------------------------------------------


def _mesh_axes(mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, (int(n) for n in mesh.axis_sizes), strict=True))


def _check_same_mesh(op, info: MeshInfo) -> None:
    theirs = _mesh_axes(op.params["mesh"])
    ours = dict(zip(info.names, info.shape, strict=True))
    if all(ours.get(name) == size for name, size in theirs.items() if size > 1):
        return
    raise MeshError(
        f"the shard_map at {op.source()} runs on mesh axes {theirs}, but autoshard plans this step on "
        f"mesh axes {ours}. A shard_map's body is manual: its in_specs and out_specs name the axes of its "
        "own mesh, so the plan must use those axes with the same sizes. "
        f"Fix: plan on the shard_map's mesh, e.g. autoshard.parallelize(f, mesh=autoshard.make_mesh("
        f"{tuple(theirs.values())}, {tuple(theirs)}))."
    )


def _from_pspec(pspec, rank: int, info: MeshInfo) -> ShardingSpec:
    """``pspec`` on the planning mesh; axes of size 1 split nothing, so they are dropped."""
    spec = ShardingSpec.from_partition_spec(pspec, rank, info)
    return ShardingSpec(tuple(tuple(a for a in d if info.shape[a] > 1) for d in spec.dims))


@register_strategy("shard_map")
def _shard_map(op, ctx: RuleContext) -> list[Strategy]:
    """The one layout the shard_map declares; its body runs on each device's shards."""
    _check_same_mesh(op, ctx.mesh)
    p = op.params
    ins = tuple(None if c else _from_pspec(ps, len(s), ctx.mesh)
                for ps, s, c in zip(p["in_specs"], ctx.in_shapes, ctx.const_inputs, strict=True))
    outs = tuple(_from_pspec(ps, len(s), ctx.mesh) for ps, s in zip(p["out_specs"], ctx.out_shapes, strict=True))
    # The body's avals are per-device shards already: its flops are the per-device compute.
    return [Strategy("shard_map", ins, outs, compute=ctx.cost.compute_time(jaxpr_flops(p["jaxpr"])))]


# ---- custom_partitioning -------------------------------------------------------------------------------


class _TypeLike:
    """What a callable sharding rule reads of an MLIR type: its shape."""

    def __init__(self, shape):
        self.shape = list(shape)
        self.rank = len(shape)


def _declared_rule(op, ctx: RuleContext):
    """The op's SdyShardingRule, calling a rule given as a function of the mesh and the types."""
    rule = op.params.get("sharding_rule")
    if rule is None or hasattr(rule, "operand_mappings"):
        return rule
    try:
        mesh = jax.sharding.AbstractMesh(ctx.mesh.shape, ctx.mesh.names)
        made = rule(*op.params.get("static_args", ()), mesh, [_TypeLike(s) for s in ctx.in_shapes],
                    [_TypeLike(s) for s in ctx.out_shapes])
    except Exception:  # a rule that needs real MLIR types: nothing autoshard can read
        return None
    if isinstance(made, tuple) and len(made) == 2:
        made = made[0]
    return made if hasattr(made, "operand_mappings") else None


def _dim_factors(mapping, rank: int) -> list[str | None]:
    """Per dimension, the factor that a split of it follows (a compound dim follows its major factor)."""
    dims = tuple(mapping)
    factors: list[str | None] = []
    if dims and isinstance(dims[0], str) and dims[0].startswith(BATCHING):
        group = dims[0][len(BATCHING):] or "0"
        dims = dims[1:]
        factors = [f"{BATCHING}{group}_{j}" for j in range(rank - len(dims))]
    factors += [d if isinstance(d, str) else d[0] for d in dims]
    return factors


def _shardable_factors(rule, per_value) -> list[str]:
    """Pass-through factors, in order of appearance. Reduction, need-replication and permutation
    factors stay whole (the partition callback would have to finish them), and so do the minor
    factors of compound dims."""
    fixed = set(rule.reduction_factors) | set(rule.need_replication_factors) | set(rule.permutation_factors)
    for mapping in (*rule.operand_mappings, *rule.result_mappings):
        for d in mapping:
            if not isinstance(d, str):
                fixed.update(d[1:])
    seen = []
    for factors in per_value:
        for f in factors:
            if f is not None and f not in fixed and f not in seen:
                seen.append(f)
    return seen


def _rule_strategies(op, ctx: RuleContext, rule) -> list[Strategy]:
    shapes = (*ctx.in_shapes, *ctx.out_shapes)
    mappings = (*rule.operand_mappings, *rule.result_mappings)
    if len(mappings) != len(shapes):
        return []
    per_value = [_dim_factors(m, len(s)) for m, s in zip(mappings, shapes, strict=True)]
    if any(len(f) != len(s) for f, s in zip(per_value, shapes, strict=True)):
        return []
    factors = _shardable_factors(rule, per_value)
    axes = ctx.mesh.active_axes
    flops = jaxpr_flops(op.params["call"])
    n_in = len(ctx.in_shapes)
    out, seen = [], set()
    for choice in itertools.product(range(len(factors) + 1), repeat=len(axes)):
        axes_of = {f: tuple(a for a, c in zip(axes, choice, strict=True) if c == i + 1)
                   for i, f in enumerate(factors)}
        specs = tuple(ShardingSpec(tuple(axes_of.get(f, ()) for f in fs)) for fs in per_value)
        if specs in seen or not all(divides(s, sp, ctx.mesh) for s, sp in zip(shapes, specs, strict=True)):
            continue
        seen.add(specs)
        ins = tuple(None if c else sp for sp, c in zip(specs[:n_in], ctx.const_inputs, strict=True))
        shards = ctx.mesh.axes_size([a for a, c in zip(axes, choice, strict=True) if c])
        name = ",".join(f"{f}:{''.join(map(str, a))}" for f, a in axes_of.items() if a) or "replicated"
        out.append(Strategy(name, ins, specs[n_in:], compute=ctx.cost.compute_time(flops / shards)))
    return out


def _callback_strategies(op, ctx: RuleContext) -> list[Strategy]:
    """Without a sharding rule (GSPMD): ask ``infer_sharding_from_operands`` which result sharding
    each candidate operand layout gives. Best effort: a callback that fails leaves that layout out."""
    infer = op.params.get("infer_sharding_from_operands")
    if infer is None:
        return []
    from jax.sharding import NamedSharding

    from autoshard.cluster import make_mesh
    from autoshard.spec import candidate_specs

    mesh = make_mesh(ctx.mesh.shape, ctx.mesh.names)
    ranks = {len(s) for s in ctx.in_shapes}
    if len(ranks) != 1:
        return []
    out_avals = [jax.ShapeDtypeStruct(s, d) for s, d in zip(ctx.out_shapes, ctx.out_dtypes, strict=True)]
    result_shape = jax.tree_util.tree_unflatten(op.params["out_tree"], out_avals)
    flops = jaxpr_flops(op.params["call"])
    out = []
    for spec in candidate_specs(ctx.in_shapes[0], ctx.mesh):
        if not all(divides(s, spec, ctx.mesh) for s in ctx.in_shapes):
            continue
        sharding = NamedSharding(mesh, spec.to_partition_spec(ctx.mesh))
        args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in zip(ctx.in_shapes, ctx.in_dtypes,
                                                                              strict=True)]
        try:
            got = infer(*op.params.get("static_args", ()), mesh, jax.tree_util.tree_unflatten(
                op.params["in_tree"], args), result_shape)
            results = jax.tree_util.tree_leaves(got, is_leaf=lambda x: isinstance(x, NamedSharding))
            outs = tuple(_from_pspec(r.spec, len(s), ctx.mesh) for r, s in zip(results, ctx.out_shapes,
                                                                               strict=True))
        except Exception:  # noqa: BLE001 - a user callback may refuse any layout it does not support
            continue
        if not all(divides(s, sp, ctx.mesh) for s, sp in zip(ctx.out_shapes, outs, strict=True)):
            continue
        ins = tuple(None if c else spec for c in ctx.const_inputs)
        out.append(Strategy(str(spec), ins, outs, compute=ctx.cost.compute_time(flops / spec.num_shards(ctx.mesh))))
    return out


@register_strategy("custom_partitioning")
def _custom_partitioning(op, ctx: RuleContext) -> list[Strategy]:
    """Strategies read off the declared sharding rule, else found through the propagation callbacks;
    replicated when neither says anything autoshard can use."""
    rule = _declared_rule(op, ctx)
    strategies = _rule_strategies(op, ctx, rule) if rule is not None else _callback_strategies(op, ctx)
    if not strategies:
        return [replicated_strategy(ctx, jaxpr_flops(op.params["call"]),
                                    name="replicated (no sharding rule autoshard can read)")]
    return strategies
