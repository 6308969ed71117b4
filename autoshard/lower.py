"""Lower a plan: re-evaluate the captured program with every layout pinned.

The program runs under ``jax.jit`` with the plan's input and output shardings.
Every op is re-bound as in the jaxpr; each output is pinned with
``with_sharding_constraint`` to the layout the plan chose, and an operand whose
required layout differs from its producer's is resharded right before the op.
A ``scan`` is re-issued with ``lax.scan`` over a body evaluated the same way, so
the constraints sit inside the loop body.

A rematerialised program (:func:`autoshard.remat.rematerialize`) comes with its
recompute groups: before a group's first op, the values it reads from outside
pass through ``jax.lax.optimization_barrier`` together with a backward value, so
XLA neither merges the recompute into the forward (CSE) nor hoists it there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.backends import BackendProfile, resolve_profile
from autoshard.capture import CapturedProgram, Const, OpGraph
from autoshard.spec import MeshInfo, ShardingSpec
from autoshard.strategies import is_scan, op_info, scan_counts


def operand_spec(layout, op, i: int) -> ShardingSpec | None:
    """The layout ``op`` reads operand ``i`` in under ``layout`` (a plan or an :class:`Evaluator`: anything with
    ``operand_specs`` and ``value_specs``): where it reshards the operand, that layout, else its producer's;
    None for a constant."""
    spec = layout.operand_specs.get((op.index, i))
    if spec is None and isinstance(op.inputs[i], int):
        spec = layout.value_specs.get(op.inputs[i])
    return spec


# The env key of the microbatch index (a traced int32) where a step is run one microbatch at a time.
MICROBATCH = "microbatch"


def common_part(src: ShardingSpec, dst: ShardingSpec) -> ShardingSpec:
    """The split ``src`` and ``dst`` share: per dimension, the longest common prefix of their mesh axes.
    Going ``src -> common -> dst`` only gathers, then only slices (no device exchanges data with another
    in a new order)."""
    dims = []
    for a, b in zip(src.dims, dst.dims, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        dims.append(a[:n])
    return ShardingSpec(tuple(dims))


def _constrainable(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended) and np.ndim(x) > 0


class Evaluator:
    """Evaluates a captured program (inside a trace) with every value pinned to its planned layout.

    Args:
      value_specs: value id -> the layout its producer writes.
      operand_specs: (op index, operand position) -> the layout the op reads the operand in.
      mesh: the ``jax.sharding.Mesh``; ``info`` its :class:`MeshInfo` (derived when None).
      remat_groups: the :class:`~autoshard.remat.RematGroup` s of a rematerialised program.
      profile: the backend profile (:mod:`autoshard.backends`); None: the mesh's platform's.
      partials: op index -> the :class:`~autoshard.pipeline.deferred.PartialSum` it makes: the op's output
        is left as its per-device partial sums, stacked on a new leading dimension (a pipeline's
        gradients, reduced once per step).
      gather_then_slice: a value read in another layout than its producer wrote goes there through
        :func:`common_part` (an all-gather, then a slice), never by devices exchanging shards in a new
        order. Inside a ``lax.switch`` branch that only some devices take (the SPMD pipeline's stage
        tasks) that exchange, a collective-permute, waits for every device of the program and hangs:
        XLA:CPU's rendezvous counts all of them, and XLA:GPU acquires its clique over them all.
      draws: :attr:`~autoshard.pipeline.accumulate.StepAnalysis.draws`: random bits drawn at the
        microbatch's shape are drawn at the full batch's and sliced at microbatch ``env[MICROBATCH]``
        (when the env has it), so every example gets the bits the unsplit step gives it.
    """

    def __init__(self, program: CapturedProgram, value_specs, operand_specs, mesh, info: MeshInfo | None = None, *,
                 remat_groups=(), profile: BackendProfile | None = None, partials=None,
                 gather_then_slice: bool = False, draws=None):
        self.program = program
        self.group_of = {i: g for g in remat_groups for i in g.fences}
        self.value_specs = value_specs
        self.operand_specs = operand_specs
        self.mesh = mesh
        self.info = MeshInfo.from_mesh(mesh) if info is None else info
        self.profile = resolve_profile(profile, mesh)
        self.partials = dict(partials or {})
        self.gather_then_slice = gather_then_slice
        self.draws = dict(draws or {})
        self._shardings: dict[ShardingSpec, NamedSharding] = {}

    def sharding(self, spec: ShardingSpec) -> NamedSharding:
        s = self._shardings.get(spec)
        if s is None:
            s = self._shardings[spec] = NamedSharding(self.mesh, spec.to_partition_spec(self.info))
        return s

    def constrain(self, x, spec: ShardingSpec | None, src: ShardingSpec | None = None):
        if spec is None or not _constrainable(x):
            return x
        if self.gather_then_slice and src is not None and src != spec:
            mid = common_part(src, spec)
            if mid not in (src, spec):
                x = jax.lax.with_sharding_constraint(x, self.sharding(mid))
        return jax.lax.with_sharding_constraint(x, self.sharding(spec))

    def fence(self, group, env: dict):
        """All of a recompute group's fences at once: one barrier with the group's anchor.

        The barrier takes its operands as stored and the reshard to the fence's layout runs behind it, so a
        gather for the recompute (or, for a weight, for the backward that reads the fenced copy) is a
        collective of its own: XLA cannot merge it with the forward's gather of the same value and keep
        that gathered copy from the forward to the backward."""
        ops = [self.program.ops[i] for i in group.fences]
        vals = [env[op.inputs[0]] for op in ops]
        anchor = None if group.anchor is None else env[group.anchor]
        if anchor is not None and not jax.dtypes.issubdtype(anchor.dtype, jax.dtypes.extended):
            *vals, anchor = jax.lax.optimization_barrier((*vals, anchor))
            if self.profile.remat_select_fence:
                vals = _select_fence(vals, anchor)
        else:
            vals = jax.lax.optimization_barrier(tuple(vals))
        for op, x in zip(ops, vals, strict=True):
            x = self.constrain(x, self.operand_specs.get((op.index, 0)))
            env[op.outputs[0]] = self.constrain(x, self.value_specs.get(op.outputs[0]))

    def run(self, graph: OpGraph, env: dict):
        for op in graph.ops:
            group = self.group_of.get(op.index)
            if group is not None:
                if op.outputs[0] not in env:
                    self.fence(group, env)
                continue
            invals = []
            for i, x in enumerate(op.inputs):
                val = x.value if isinstance(x, Const) else env[x]
                spec = self.operand_specs.get((op.index, i))
                src = None if isinstance(x, Const) else self.value_specs.get(x)
                invals.append(self.constrain(val, spec, src) if spec is not None else val)
            if op.index in self.partials:
                ps = self.partials[op.index]
                env[op.outputs[0]] = self.constrain(self.partial_sum(op, invals, ps.axes), ps.acc_spec)
                continue
            if is_scan(op):
                outs = self.run_scan(op, invals, env.get(MICROBATCH))
            elif op.outputs[0] in self.draws and MICROBATCH in env:
                outs = (self.draw(op, invals, env[MICROBATCH]),)
            elif op.name in ("sharding_constraint", "reshard"):  # the user's pin: the plan's layout below replaces it
                outs = (invals[0],)
            elif (local := self.bind_local(op, invals)) is not None:  # a kernel split by its grid
                outs = local
            else:
                with op.ctx.manager:
                    outs = op.primitive.bind(*invals, **op.primitive.get_bind_params(op.params))
                if not op.primitive.multiple_results:
                    outs = (outs,)
            if op_info(op.name).contraction:
                outs = (self.constrain(outs[0], self.summed_spec(op)),)
            for v, o in zip(op.outputs, outs, strict=True):
                env[v] = self.constrain(o, self.value_specs.get(v))
        return [x.value if isinstance(x, Const) else env[x] for x in graph.outvars]

    def partial_sum(self, op, invals, axes):
        """``op`` (a contraction whose summed dimensions ``axes`` split) without its sum over ``axes``: each
        device's partial result, stacked on a new leading dimension split over ``axes``.

        A ``shard_map`` manual over ``axes`` only binds the op on each device's blocks of the summed
        dimensions; the other mesh axes stay automatic, so the op keeps its planned layout on them."""
        names = tuple(self.info.names[a] for a in axes)

        def manual_only(x, i):
            spec = operand_spec(self, op, i)
            if spec is None or np.ndim(x) == 0:
                return PartitionSpec()
            return PartitionSpec(*(tuple(self.info.names[a] for a in d if a in axes) or None for d in spec.dims))

        def body(*xs):
            with op.ctx.manager:
                out = op.primitive.bind(*xs, **op.primitive.get_bind_params(op.params))
            return out[None]

        leading = names[0] if len(names) == 1 else names
        # Inside another shard_map (the spmd pipeline's, manual over "stage") the context's mesh is the one to use.
        mesh = None if jax.sharding.get_abstract_mesh().manual_axes else self.mesh
        return jax.shard_map(body, mesh=mesh, in_specs=tuple(manual_only(x, i) for i, x in enumerate(invals)),
                             out_specs=PartitionSpec(leading), axis_names=set(names), check_vma=False)(*invals)

    def bind_local(self, op, invals):
        """``op`` bound on each device's shards, where its params depend on its operands' shapes and its planned
        layouts split it (:attr:`~autoshard.strategies.OpInfo.local_params`: a Pallas kernel's grid); None
        otherwise. A ``shard_map`` manual over the mesh axes that split it binds the op with its local params."""
        local_params = op_info(op.name).local_params
        if local_params is None:
            return None
        in_specs = tuple(operand_spec(self, op, i) for i in range(len(op.inputs)))
        out_specs = tuple(self.value_specs.get(v) for v in op.outputs)
        params = local_params(op, in_specs, out_specs, self.info)
        if params is None:
            return None
        used = sorted({a for s in (*in_specs, *out_specs) if s is not None for a in s.used_axes})

        def pspec(spec, x):
            return PartitionSpec() if spec is None or np.ndim(x) == 0 else spec.to_partition_spec(self.info)

        def body(*xs):
            # The eqn's context names the mesh it was traced under; the body runs on the manual one.
            manual = jax.sharding.get_abstract_mesh()
            with op.ctx.manager, jax.sharding.use_abstract_mesh(manual):
                outs = op.primitive.bind(*xs, **op.primitive.get_bind_params(params))
            return tuple(outs) if op.primitive.multiple_results else outs

        out_pspecs = tuple(PartitionSpec() if s is None else s.to_partition_spec(self.info) for s in out_specs)
        # Inside another shard_map (the spmd pipeline's, manual over "stage") the context's mesh is the one to use.
        mesh = None if jax.sharding.get_abstract_mesh().manual_axes else self.mesh
        outs = jax.shard_map(body, mesh=mesh, in_specs=tuple(pspec(s, x) for s, x in zip(in_specs, invals, strict=True)),
                             out_specs=out_pspecs if op.primitive.multiple_results else out_pspecs[0],
                             axis_names={self.info.names[a] for a in used}, check_vma=False)(*invals)
        return outs if op.primitive.multiple_results else (outs,)

    def summed_spec(self, op) -> ShardingSpec | None:
        """The layout of a contraction's output once its partial sums are added, where its planned
        layout scatters them within a dimension that other mesh axes already split.

        XLA's partitioner reaches such a layout (``(b, k)`` on one dimension, ``k`` the contracted
        axis) from the partial sums with an all-reduce and an all-gather over ``b``. Pinned to the
        summed layout first, it all-reduces (or reduce-scatters) and slices, as the plan priced it."""
        out = self.value_specs.get(op.outputs[0])
        lhs = operand_spec(self, op, 0)
        if out is None or lhs is None:
            return None
        summed = {a for d in op_info(op.name).contracted_dims(op) for a in lhs.dims[d]}
        if not any(summed.intersection(d) and not summed.issuperset(d) for d in out.dims):
            return None
        return out.without(summed)

    def draw(self, op, invals, m):
        """``op``'s random bits for microbatch ``m``: the full batch's bits, sliced along the batch axis."""
        axis, full = self.draws[op.outputs[0]]
        shape = list(op.params["shape"])
        size, shape[axis] = shape[axis], full
        with op.ctx.manager:
            bits = op.primitive.bind(*invals, **op.primitive.get_bind_params({**op.params, "shape": tuple(shape)}))
        return jax.lax.dynamic_slice_in_dim(bits, m * size, size, axis)

    def run_scan(self, op, invals, microbatch=None):
        p = op.params
        n_consts, n_carry = scan_counts(p)
        body = op.body
        consts, init, xs = invals[:n_consts], invals[n_consts:n_consts + n_carry], invals[n_consts + n_carry:]
        b_consts = body.invars[:n_consts]
        b_carry = body.invars[n_consts:n_consts + n_carry]
        b_xs = body.invars[n_consts + n_carry:]
        y_specs = [self.value_specs.get(v) for v in op.outputs[n_carry:]]
        y_specs = [None if s is None else ShardingSpec(s.dims[1:]) for s in y_specs]

        def step(carry, x):
            env = {} if microbatch is None else {MICROBATCH: microbatch}
            for v, val in zip(b_consts, consts, strict=True):
                env[v] = self.constrain(val, self.value_specs.get(v))
            for v, val in zip(b_carry, carry, strict=True):
                env[v] = self.constrain(val, self.value_specs.get(v))
            for v, val in zip(b_xs, x, strict=True):
                env[v] = self.constrain(val, self.value_specs.get(v))
            outs = self.run(body, env)
            new_carry = [self.constrain(o, self.value_specs.get(v)) for o, v in zip(outs[:n_carry], b_carry,
                                                                                  strict=True)]
            ys = [self.constrain(o, s) for o, s in zip(outs[n_carry:], y_specs, strict=True)]
            return new_carry, ys

        init = [self.constrain(val, self.value_specs.get(v)) for val, v in zip(init, b_carry, strict=True)]
        carry, ys = jax.lax.scan(step, init, list(xs), length=p["length"], reverse=p["reverse"],
                                 unroll=p.get("unroll", 1))
        return [*carry, *ys]


def _select_fence(vals, anchor):
    """Some backends (XLA:CPU, ``BackendProfile.remat_select_fence``) expand the barrier before CSE. A
    select on a predicate that is always true but that XLA cannot prove so keeps the recompute
    distinct from the forward."""
    bits = jax.lax.bitcast_convert_type(jnp.ravel(anchor)[0].astype(jnp.float32), jnp.uint32)
    keep = (bits | jnp.uint32(1)) != 0
    return [x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) else
            jnp.where(keep, x, jnp.zeros_like(x)) for x in vals]


def make_flat_function(program: CapturedProgram, value_specs, operand_specs, mesh, out_specs=None, *,
                       remat_groups=(), host_inputs=(), host_outputs=(), profile: BackendProfile | None = None):
    """The step as a function of flat arguments, with every layout pinned.

    ``out_specs`` (one per flat output, or None) reshards outputs whose planned
    layout differs from their producer's (outputs tied to an input's layout).
    ``remat_groups``: the :class:`~autoshard.remat.RematGroup`s of a rematerialised program.
    ``host_inputs`` / ``host_outputs``: flat indices of arguments and outputs that live in
    host memory (offloaded, see :mod:`autoshard.offload`): they are moved to device memory
    on entry and back to host memory on exit. ``profile``: the backend's (:mod:`autoshard.backends`);
    None: the mesh's platform's."""
    ev = Evaluator(program, value_specs, operand_specs, mesh, remat_groups=remat_groups, profile=profile)
    host_inputs, host_outputs = frozenset(host_inputs), frozenset(host_outputs)

    def flat_fun(*flat_args):
        env = {}
        for i, (v, x) in enumerate(zip(program.graph.invars, flat_args, strict=True)):
            if i in host_inputs:
                x = jax.device_put(x, ev.sharding(value_specs[v]).with_memory_kind("device"))
            env[v] = ev.constrain(x, value_specs.get(v))
        for v, c in program.consts.items():
            env[v] = ev.constrain(c, value_specs.get(v))
        outs = ev.run(program.graph, env)
        if out_specs is not None:
            outs = [ev.constrain(o, s) for o, s in zip(outs, out_specs, strict=True)]
        for j in host_outputs:
            spec = out_specs[j] if out_specs is not None else ShardingSpec(((),) * np.ndim(outs[j]))
            outs[j] = jax.device_put(outs[j], ev.sharding(spec).with_memory_kind("pinned_host"))
        return outs

    return flat_fun
