"""Pallas kernels, split along the parallel axes of their grid.

A ``pallas_call`` runs its kernel body once per point of its grid, each time on the blocks its
operands' and outputs' index maps pick. Where one grid axis walks a dimension of a value one block
per step (the block index along that dimension *is* the grid index, the block size is fixed, and
the dimension is exactly grid extent x block size), every device can run the kernel on its own
slice of that axis: the same body on a smaller grid, over the slices of every value the axis walks.
Values the axis does not index (a weight every row reads) stay whole along it. Batch and heads of
an attention kernel, the rows of a row-wise softmax or layer norm are such axes.

A grid axis may be split only when that is certain to compute the same thing:

- every output is walked by it one-to-one (no two steps along it write the same block: an axis
  that accumulates into one output block, like the ``k`` of a matmul, is never split);
- every value it indexes at all, it walks one-to-one (a block index of ``i // 2`` or ``n - i``
  would read other blocks on a device's slice);
- the compiler params do not declare it ``"arbitrary"`` (Mosaic's ``dimension_semantics``);
- the kernel body does not read ``program_id`` along it (each device counts from 0 again);
- the call has no mesh of its own, no dynamic grid bounds, and aliased operands and outputs are
  walked alike.

Everything else keeps the kernel replicated, with one warning that says why. One thing cannot be
seen: jax folds ``num_programs`` of a static grid into a constant when it traces the body, so a body
that uses the grid's extent along a split axis (rather than ``program_id``) sees the global extent. The lowering
(:func:`local_params`, the op's :attr:`~autoshard.strategies.OpInfo.local_params`) re-binds the
kernel inside a ``shard_map`` over the mesh axes that split it, with the grid extent divided by the
shards and every block mapping's array shape local.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings

import jax
import jax.extend.core as jex_core
import numpy as np

from autoshard.explicit import without_mesh
from autoshard.spec import MeshInfo, ShardingSpec
from autoshard.strategies.base import RuleContext, Strategy, register_strategy, replicated_strategy
from autoshard.strategies.manual import jaxpr_flops
from autoshard.strategies.opinfo import elements, register_op

# Primitives by which a kernel body learns where it is on the grid.
_GRID_READS = ("program_id", "num_programs")


@dataclasses.dataclass(frozen=True, slots=True)
class GridAxis:
    """A grid axis the kernel may be split along.

    Attributes:
      axis: its position in the grid.
      extent: its number of steps.
      dims: per operand, then per output, the dimension it walks one block per step; None for a
        value it does not index (that value stays whole along it).
    """

    axis: int
    extent: int
    dims: tuple[int | None, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class KernelGrid:
    """What a ``pallas_call`` allows: the grid axes it may be split along, and why the others may not.

    Attributes:
      axes: the splittable grid axes.
      why: why the kernel, or the grid axes not in ``axes``, must stay whole ("" when every axis may split).
      flops: the kernel body's flops times the grid size (one per output element when the body is unread).
    """

    axes: tuple[GridAxis, ...]
    why: str
    flops: float


def _block_size(dim) -> int | None:
    """The fixed size of a block dimension, or None where blocks are not fixed windows (element offsets,
    bounded slices, gathers)."""
    if dim is None or type(dim).__name__ in ("Squeezed", "Mapped"):
        return 1
    if isinstance(dim, int):
        return dim
    if type(dim).__name__ == "Blocked":
        return int(dim.block_size)
    return None


def _dependencies(closed) -> list[tuple[frozenset[int], int | None]]:
    """Per output of an index map: the grid indices (invar positions) it depends on, and the one it is
    exactly (None when it is computed, or a literal)."""
    jaxpr = getattr(closed, "jaxpr", closed)
    deps = {v: frozenset((i,)) for i, v in enumerate(jaxpr.invars)}

    def of(x):
        return frozenset() if isinstance(x, jex_core.Literal) else deps.get(x, frozenset())

    for eqn in jaxpr.eqns:
        read = frozenset().union(*(of(x) for x in eqn.invars))
        for v in eqn.outvars:
            deps[v] = read
    out = []
    for x in jaxpr.outvars:
        exact = None if isinstance(x, jex_core.Literal) else next(
            (i for i, v in enumerate(jaxpr.invars) if v is x), None)
        out.append((of(x), exact))
    return out


def _grid_reads(jaxpr) -> set[int]:
    """The axes (``program_id``'s own numbering) at which the kernel body, nested jaxprs included, reads
    its grid position; ``-1`` for a read whose axis it does not name."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    axes: set[int] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _GRID_READS:
            axes.add(int(eqn.params.get("axis", -1)))
        for inner in jex_core.jaxprs_in_params(eqn.params):
            axes |= _grid_reads(inner)
    return axes


def _semantics(params, rank: int) -> tuple[str, ...] | None:
    """The declared dimension semantics of the grid (Mosaic), lower-case; None when not declared."""
    declared = getattr(params.get("compiler_params"), "dimension_semantics", None)
    if declared is None:
        return None
    names = tuple(str(getattr(s, "value", s)).lower() for s in declared)
    if len(names) != rank:
        raise ValueError(f"{len(names)} dimension semantics for a grid of rank {rank}")
    return names


def _body_flops(params, grid) -> float:
    return jaxpr_flops(params["jaxpr"]) * math.prod(grid)


def _walked_dims(g: int, extent: int, gm, deps):
    """Per operand (scalar-prefetch ones first, never walked) and output of grid mapping ``gm``, the dimension
    grid axis ``g`` walks one block per step, None where it indexes nothing; or why ``g`` cannot be split.
    ``deps``: per block mapping, its index map's :func:`_dependencies`."""
    dims: list[int | None] = [None] * gm.num_index_operands
    n_in = gm.num_inputs
    for k, (bm, dep) in enumerate(zip(gm.block_mappings, deps, strict=True)):
        kind, j = ("output", k - n_in) if k >= n_in else ("operand", k)
        walked = [d for d, (on, _) in enumerate(dep) if g in on]
        if not walked:
            if kind == "output":
                return dims, f"every step along grid axis {g} writes the same block of output {j} (it accumulates)"
            dims.append(None)
            continue
        d = walked[0]
        size = _block_size(bm.block_shape[d])
        if len(walked) > 1 or dep[d][1] != g:
            return dims, f"the block index of {kind} {j} along grid axis {g} is not the grid index"
        if size is None or bm.array_aval.shape[d] != extent * size:
            return dims, (f"{kind} {j}'s dimension {d} ({bm.array_aval.shape[d]}) is not {extent} fixed blocks "
                          f"of {size} along grid axis {g}")
        dims.append(d)
    return dims, None


def read_kernel(params, n_operands: int) -> KernelGrid:
    """Which grid axes of a ``pallas_call`` (its eqn ``params``, ``n_operands`` operands) may be split.

    Never raises: params this jax spells differently leave the kernel whole, and ``why`` says so."""
    try:
        return _read_kernel(params, n_operands)
    except Exception as e:  # noqa: BLE001 - another jax's pallas_call params: keep the kernel whole
        outs = params.get("out_avals", ()) if hasattr(params, "get") else ()
        return KernelGrid((), f"autoshard cannot read the pallas_call params of jax {jax.__version__} "
                              f"({type(e).__name__}: {e})", float(sum(elements(a) for a in outs)))


def _read_kernel(params, n_operands: int) -> KernelGrid:
    gm = params["grid_mapping"]
    grid = tuple(gm.grid)
    if params.get("mesh") is not None:
        return KernelGrid((), "the kernel runs on a Pallas mesh of its own (core_map)", 0.0)
    if gm.num_dynamic_grid_bounds or not all(isinstance(n, int) for n in grid):
        return KernelGrid((), "its grid has dynamic bounds", 0.0)
    flops = _body_flops(params, grid)
    n_index, n_in, n_out = gm.num_index_operands, gm.num_inputs, gm.num_outputs
    mappings = tuple(gm.block_mappings)
    if n_operands != n_index + n_in or len(mappings) != n_in + n_out:
        return KernelGrid((), f"{n_operands} operands for {n_index} scalar-prefetch operands and {n_in} "
                              f"inputs (closed-over refs?)", flops)
    if getattr(params.get("compiler_params"), "collective_id", None) is not None:
        return KernelGrid((), "the kernel communicates across devices itself (collective_id)", flops)
    semantics = _semantics(params, len(grid))
    vmapped = tuple(getattr(gm, "vmapped_dims", ()))
    named = [g for g in range(len(grid)) if g not in vmapped]  # program_id counts the grid without vmapped axes
    reads = _grid_reads(params["jaxpr"])
    deps = [_dependencies(bm.index_map_jaxpr) for bm in mappings]
    aliases = tuple(params.get("input_output_aliases", ()))

    axes, why = [], []
    for g, extent in enumerate(grid):
        if extent <= 1:
            continue
        if semantics is not None and semantics[g] == "arbitrary":
            why.append(f"grid axis {g} is declared 'arbitrary'")
            continue
        dims, problem = _walked_dims(g, extent, gm, deps)
        if problem is None:
            for i, o in aliases:
                if dims[i] != dims[n_index + n_in + o]:
                    problem = f"operand {i} is aliased to output {o} but grid axis {g} walks them differently"
        if problem is None and (-1 in reads or (g in named and named.index(g) in reads)):
            problem = f"the kernel body reads its position along grid axis {g} (program_id)"
        if problem:
            why.append(problem)
            continue
        axes.append(GridAxis(g, extent, tuple(dims)))
    if not axes and not why:
        why.append("its grid has no axis longer than 1")
    kernel = KernelGrid(tuple(axes), "; ".join(why), flops)
    localized(params, kernel, {ga.axis: ga.extent for ga in axes})  # this jax's params can be rebuilt, or raise
    return kernel


def _params_flops(op, avals) -> float:
    return read_kernel(op.params, len(op.inputs)).flops or float(sum(elements(avals[v]) for v in op.outputs))


def _choice_specs(axes: tuple[GridAxis, ...], mesh_axes_of: dict[int, tuple[int, ...]], ranks) -> tuple[ShardingSpec, ...]:
    """Each value's layout when grid axis ``g`` is split over mesh axes ``mesh_axes_of[g]``."""
    dims = [[() for _ in range(r)] for r in ranks]
    for ga in axes:
        mesh_axes = mesh_axes_of.get(ga.axis, ())
        for k, d in enumerate(ga.dims):
            if d is not None and d < len(dims[k]) and mesh_axes:
                dims[k][d] = mesh_axes
    return tuple(ShardingSpec(tuple(d)) for d in dims)


def _warn_replicated(op, why: str) -> None:
    # The warnings module shows one warning per distinct message.
    warnings.warn(f"autoshard runs the Pallas kernel at {op.source()} replicated: {why}. To split it, give it a "
                  "grid axis that walks its operands and outputs one block per step (the block index is the grid "
                  "index) and that the kernel body does not read with program_id.", UserWarning, stacklevel=2)


@register_strategy("pallas_call")
def _pallas_call(op, ctx: RuleContext) -> list[Strategy]:
    """Replicated, plus one strategy per assignment of mesh axes to the kernel's splittable grid axes
    (each mesh axis to one grid axis or none, their product dividing its extent)."""
    kernel = read_kernel(op.params, len(ctx.in_shapes))
    flops = kernel.flops or float(sum(math.prod(s) for s in ctx.out_shapes))
    whole = replicated_strategy(ctx, flops, name="replicated" if kernel.axes else f"replicated ({kernel.why})")
    if not kernel.axes:
        _warn_replicated(op, kernel.why)
        return [whole]
    mesh, n_in = ctx.mesh, len(ctx.in_shapes)
    ranks = tuple(len(s) for s in (*ctx.in_shapes, *ctx.out_shapes))
    const = (*ctx.const_inputs, *(False,) * len(ctx.out_shapes))
    out, seen = [whole], {whole.in_specs + whole.out_specs}
    grid_axes = kernel.axes
    for choice in itertools.product(range(len(grid_axes) + 1), repeat=len(mesh.active_axes)):
        mesh_axes_of = {ga.axis: tuple(a for a, c in zip(mesh.active_axes, choice, strict=True) if c == i + 1)
                        for i, ga in enumerate(grid_axes)}
        if any(ga.extent % mesh.axes_size(mesh_axes_of[ga.axis]) for ga in grid_axes):
            continue
        # A constant operand the split walks would need slicing: not worth a strategy.
        if any(const[k] and d is not None and mesh_axes_of[ga.axis] for ga in grid_axes for k, d in enumerate(ga.dims)):
            continue
        specs = _choice_specs(grid_axes, mesh_axes_of, ranks)
        ins = tuple(None if c else s for s, c in zip(specs[:n_in], ctx.const_inputs, strict=True))
        if ins + specs[n_in:] in seen:
            continue
        seen.add(ins + specs[n_in:])
        shards = mesh.axes_size([a for axes in mesh_axes_of.values() for a in axes])
        name = ",".join(f"grid{g}:{''.join(map(str, a))}" for g, a in mesh_axes_of.items() if a)
        out.append(Strategy(name, ins, specs[n_in:], compute=ctx.cost.compute_time(flops / shards)))
    return out


def local_params(op, in_specs, out_specs, mesh: MeshInfo):
    """The ``pallas_call`` params for each device's shards under the planned layouts ``in_specs`` (per operand,
    None: a constant, replicated) and ``out_specs``; None when the layouts split nothing.

    Each split grid axis's extent is divided by its shards, and every block mapping walked by it (and the
    output avals) take the local array shape; the kernel body and the index maps are unchanged: on a
    device's slice, the local grid index is the local block index."""
    specs = (*in_specs, *out_specs)
    if all(s is None or s.is_replicated() for s in specs):
        return None
    kernel = read_kernel(op.params, len(in_specs))
    mesh_axes_of = {}
    for ga in kernel.axes:
        layouts = {specs[k].dims[d] for k, d in enumerate(ga.dims) if d is not None and specs[k] is not None}
        if len(layouts) > 1:
            raise ValueError(f"the pallas_call at {op.source()} is planned with grid axis {ga.axis} split "
                             f"differently on its operands and outputs: {sorted(layouts)}")
        mesh_axes_of[ga.axis] = next(iter(layouts), ())
    expected = _choice_specs(kernel.axes, mesh_axes_of, tuple(0 if s is None else s.rank for s in specs))
    for k, (got, want) in enumerate(zip(specs, expected, strict=True)):
        if got is not None and got != want:
            raise ValueError(f"the pallas_call at {op.source()} is planned with its value {k} in layout {got}, "
                             f"which no split of its grid gives (expected {want}): autoshard's Pallas rule and "
                             "its lowering disagree")
    shards = {g: mesh.axes_size(axes) for g, axes in mesh_axes_of.items()}
    params = localized(op.params, kernel, shards)
    return dict(params, jaxpr=_Unmeshed().param(params["jaxpr"]))


def localized(params, kernel: KernelGrid, shards: dict[int, int]) -> dict:
    """``params`` with grid axis ``g`` split ``shards[g]`` ways (see :func:`local_params`)."""
    gm = params["grid_mapping"]
    n_index, n_in = gm.num_index_operands, gm.num_inputs
    grid = list(gm.grid)
    per_value = [dict() for _ in range(n_index + len(gm.block_mappings))]
    for ga in kernel.axes:
        n = shards.get(ga.axis, 1)
        if n == 1:
            continue
        grid[ga.axis] //= n
        for k, d in enumerate(ga.dims):
            if d is not None:
                per_value[k][d] = n

    def local(shape, split):
        return tuple(s // split.get(i, 1) for i, s in enumerate(shape))

    mappings = tuple(bm.replace(array_aval=bm.array_aval.update(shape=local(bm.array_aval.shape, split)))
                     for bm, split in zip(gm.block_mappings, per_value[n_index:], strict=True))
    out_avals = tuple(a.update(shape=local(a.shape, split))
                      for a, split in zip(params["out_avals"], per_value[n_index + n_in:], strict=True))
    new = dict(params, grid_mapping=gm.replace(grid=tuple(grid), block_mappings=mappings), out_avals=out_avals)
    total = math.prod(shards.values())
    estimate = params.get("cost_estimate")
    if estimate is not None and total > 1:
        new["cost_estimate"] = dataclasses.replace(estimate, **{
            f.name: getattr(estimate, f.name) // total for f in dataclasses.fields(estimate)
            if isinstance(getattr(estimate, f.name), int)})
    return new


_NO_MESH = jax.sharding.AbstractMesh((), ())


class _Unmeshed:
    """Rebuilds a kernel body (and the jaxprs nested in it) as if it had been traced outside any mesh.

    The step is traced under autoshard's Auto mesh, so the body's types, literals, nested ``jit`` s and eqn
    contexts name that mesh. On a device's shard (a ``shard_map`` body, whose values are typed on the manual
    mesh) jax refuses to mix the two; a kernel traced outside any mesh runs there. One instance per body:
    it maps each old variable to its new one."""

    def __init__(self):
        self.vars = {}

    def var(self, v):
        if isinstance(v, jex_core.Literal):
            aval = without_mesh(v.aval)
            val = v.val
            if isinstance(val, np.ndarray) and hasattr(val, "aval"):  # jax's typed host array: its type holds the mesh
                val = type(val)(np.asarray(val), without_mesh(val.aval))
            return jex_core.Literal(val, aval)
        new = self.vars.get(v)
        if new is None:
            aval = without_mesh(v.aval)
            new = v if aval is v.aval else (jex_core.DropVar(aval) if isinstance(v, jex_core.DropVar)
                                             else jex_core.Var(aval))
            self.vars[v] = new
        return new

    def param(self, value):
        if isinstance(value, jex_core.ClosedJaxpr):
            return value.replace(jaxpr=self.jaxpr(value.jaxpr))
        if isinstance(value, jex_core.Jaxpr):
            return self.jaxpr(value)
        if isinstance(value, jax.sharding.Mesh) and not value.empty:  # a nested jit's context mesh
            return jax.sharding.Mesh(np.empty((), dtype=object), ())
        if isinstance(value, tuple) and any(isinstance(v, (jex_core.Jaxpr, jex_core.ClosedJaxpr)) for v in value):
            return tuple(self.param(v) for v in value)
        return value

    def jaxpr(self, jaxpr):
        eqns = []
        for eqn in jaxpr.eqns:
            with eqn.ctx.manager, jax.sharding.use_abstract_mesh(_NO_MESH):  # the eqn's other settings stay
                eqns.append(jex_core.new_jaxpr_eqn(
                    [self.var(x) for x in eqn.invars], [self.var(v) for v in eqn.outvars], eqn.primitive,
                    {k: self.param(v) for k, v in eqn.params.items()}, eqn.effects, eqn.source_info))
        return jaxpr.replace(constvars=[self.var(v) for v in jaxpr.constvars],
                             invars=[self.var(v) for v in jaxpr.invars],
                             outvars=[self.var(x) for x in jaxpr.outvars], eqns=eqns)


register_op("pallas_call", flops=_params_flops, local_params=local_params)
