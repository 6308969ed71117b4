"""Capture: trace a step function into a flat, immutable op graph.

``capture_graph`` traces with ``jax.make_jaxpr`` (abstract arguments are fine) and
walks the jaxpr. Nested ``jit``, ``custom_jvp_call``, ``custom_vjp_call`` and
``remat2`` are inlined: the planner sees their bodies as ordinary ops. ``scan`` is
kept as one structured op whose body is a nested :class:`OpGraph`, so the planner
solves the body once. ``while``, ``cond`` and anything else with a sub-jaxpr
stay opaque ops, re-bound as they are at lowering.

Every value in a captured program has a global integer id; ``CapturedProgram.avals``
maps ids to their abstract values.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.extend.core as jex_core
import numpy as np

from autoshard.errors import InvalidProgramError
from autoshard.explicit import auto_context, reshard_primitive, without_mesh

INLINED = {
    # primitive name -> the param that holds the body
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "composite": "jaxpr",  # lax.composite: its decomposition
    "custom_vmap_call": "call",  # outside vmap, the function itself
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Const:
    """A literal or closed-over constant operand."""

    value: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(np.shape(self.value))


Operand = int | Const


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Op:
    """One primitive application.

    Attributes:
      index: position in the program's global op list (``CapturedProgram.ops``).
      primitive: the jax primitive.
      params: its params, as in the jaxpr.
      inputs: value ids, or :class:`Const` for literals and constants.
      outputs: value ids.
      ctx: the eqn's context (entered when re-binding).
      source_info: the eqn's source info, for messages.
      body: for ``scan``, the loop body as a nested graph; else None.
      trips: how many times the op runs per step (product of enclosing scan lengths).
    """

    index: int
    primitive: Any
    params: dict
    inputs: tuple[Operand, ...]
    outputs: tuple[int, ...]
    ctx: Any
    source_info: Any
    body: OpGraph | None = None
    trips: int = 1

    @property
    def name(self) -> str:
        return self.primitive.name

    def source(self) -> str:
        """``file:line`` of the user code that made this op, when known."""
        return source_location(self.source_info)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class OpGraph:
    """A straight-line graph: inputs, ops in program order, outputs."""

    invars: tuple[int, ...]
    ops: tuple[Op, ...]
    outvars: tuple[Operand, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class CapturedProgram:
    """A traced step function, or a part of one (a pipeline stage). Build one with :meth:`from_graph`.

    Attributes:
      graph: the top-level graph; its invars are the flattened arguments.
      avals: abstract value (``ShapedArray``) per value id.
      ops: every op of ``graph``, nested scan bodies included, ordered by ``Op.index``. In a whole
        program (captured, or rewritten by :mod:`autoshard.remat`) the indices are ``0..n-1``, so
        ``ops[i].index == i``. A part (``in_tree`` None: a pipeline stage) keeps the whole program's
        indices, which its plan's ``operand_specs`` are keyed by: its ``ops`` are a sorted subset.
      in_tree, out_tree: pytree structures of the (dynamic) arguments and outputs; None for a part.
      in_paths, out_paths: readable pytree paths of each flat leaf.
      consts: value id -> constant array, for closed-over constants.
      producer: value id -> (op index, output position); absent for inputs.
      uses: value id -> every (op index, operand position) that reads it.
      in_roles: what each flat argument is (:data:`autoshard.roles.ROLES`), or ``()`` when not
        classified (see :func:`autoshard.roles.classify_leaves`).
      op_weights: op index -> how many times the solver's objective counts the op (and its operands'
        resharding) per step, beyond its ``trips``; absent: once. A pipeline stage's program runs its
        microbatch ops ``k`` times and its update once (:func:`autoshard.pipeline.search.stage_program`).
        The plan's reported cost stays that of one run of every op.
      reduce_weights: op index -> how many times the objective counts the op's own communication (the
        reduction of its partial sums); absent: as ``op_weights``. A pipeline reduces the gradients of its
        microbatches once per step (:mod:`autoshard.pipeline.deferred`).
      held: value ids a pipeline's runtime holds for the whole step, the running sums of one stage's
        microbatches (:mod:`autoshard.pipeline.accumulate`): their memory counts from the program's start.
        A sum among them in ``reduce_weights`` that a strategy reduce-scatters is offered twice, reduced in
        every run (its communication counted as ``op_weights``) and held unreduced, reduced
        ``reduce_weights`` times (:func:`autoshard.planner.deferral_twins`). Empty: every value as made
        and read, a reduce-scatter counted ``reduce_weights`` times at its reduced size, the least either
        costs (a bound, which a pipeline's layer costs take).
      in_flight_bytes: bytes per device of the other microbatches' activations a pipeline stage keeps
        while its microbatches run (its schedule's in-flight count): they count beside the running sums,
        from the program's start to the first reader of a ``held`` value (the update, which runs after
        the last microbatch).
    """

    graph: OpGraph
    avals: tuple
    ops: tuple[Op, ...]
    in_tree: Any
    out_tree: Any
    in_paths: tuple[str, ...]
    out_paths: tuple[str, ...]
    consts: dict
    producer: dict
    uses: dict
    in_roles: tuple[str, ...] = ()
    op_weights: Mapping[int, float] = dataclasses.field(default_factory=dict)
    reduce_weights: Mapping[int, float] = dataclasses.field(default_factory=dict)
    held: frozenset = frozenset()
    in_flight_bytes: float = 0.0

    @classmethod
    def from_graph(cls, graph: OpGraph, avals, *, in_tree, out_tree, in_paths, out_paths, consts,
                   in_roles=()) -> CapturedProgram:
        """The program of ``graph``: ``ops``, ``producer`` and ``uses`` derived from it.

        With ``AUTOSHARD_VALIDATE=1`` in the environment (the tests set it), the result is checked
        with :meth:`validate`, as ``jax_enable_checks`` has jax check every jaxpr it builds.
        """
        ops = graph_ops(graph)
        producer, uses = index_ops(ops)
        program = cls(graph=graph, avals=tuple(avals), ops=ops, in_tree=in_tree, out_tree=out_tree,
                      in_paths=tuple(in_paths), out_paths=tuple(out_paths), consts=dict(consts),
                      producer=producer, uses=uses, in_roles=tuple(in_roles))
        if os.environ.get(VALIDATE_ENV, "") not in ("", "0"):
            program.validate()
        return program

    def validate(self) -> None:
        """Check the invariants every pass relies on.

        Raises:
          InvalidProgramError: (an ``AssertionError``) naming the op or field that breaks one.
        """
        check_program(self)

    @property
    def num_eqns(self) -> int:
        return len(self.ops)

    def out_shape(self):
        """The outputs as ``ShapeDtypeStruct``s in the step's output structure (what ``jax.eval_shape``
        of the captured function gives; a captured part of a program has no output structure)."""
        leaves = [self.avals[v] if isinstance(v, int) else
                  jax.ShapeDtypeStruct(np.shape(v.value), np.asarray(v.value).dtype) for v in self.graph.outvars]
        return jax.tree_util.tree_unflatten(self.out_tree, leaves)

    def fingerprint(self) -> str:
        """A short hash of the op sequence and shapes, to match saved plans."""
        import hashlib

        h = hashlib.sha256()
        for op in self.ops:
            h.update(op.name.encode())
            for v in op.outputs:
                a = self.avals[v]
                h.update(f"{getattr(a, 'shape', ())}{getattr(a, 'dtype', '')}".encode())
        for v in self.graph.invars:
            h.update(str(self.avals[v]).encode())
        return h.hexdigest()[:16]


VALIDATE_ENV = "AUTOSHARD_VALIDATE"
"""Environment variable: when set (not ``0``), :meth:`CapturedProgram.from_graph` validates what it builds."""


def graph_ops(graph: OpGraph) -> tuple[Op, ...]:
    """Every op of ``graph``, nested scan bodies included, once each, ordered by ``Op.index``.

    A scan's body ops are numbered before the scan (capture builds the body first), so for a
    captured program this is also program order. A body shared by two scan ops (remat duplicates
    a scan, keeping its body) is counted once."""
    found: dict[int, Op] = {}
    seen_bodies: set[int] = set()
    stack = [graph]
    while stack:
        g = stack.pop()
        for op in g.ops:
            found.setdefault(op.index, op)
            if op.body is not None and id(op.body) not in seen_bodies:
                seen_bodies.add(id(op.body))
                stack.append(op.body)
    return tuple(found[i] for i in sorted(found))


def op_spans(graph: OpGraph) -> tuple[dict[int, tuple[int, int]], int]:
    """``(op index -> (first, last) position, end)``: the time line of the solver's memory row.

    Ops count from 1 in program order; a scan takes one position to start (its inputs read, its outputs
    allocated) and then one per op of its body, in the body's order (nested bodies the same way), so a
    body's values are seen live only as long as within one iteration, as :mod:`autoshard.memory`'s
    estimate sees them, not all at once. ``end`` is the position after the last op. A body shared by two
    scans (remat duplicates a scan, keeping its body) takes the later scan's positions."""
    spans: dict[int, tuple[int, int]] = {}
    t = 0

    def walk(g: OpGraph) -> None:
        nonlocal t
        for op in g.ops:
            t += 1
            first = t
            if op.body is not None:
                walk(op.body)
            spans[op.index] = (first, t)

    walk(graph)
    return spans, t + 1


def check_program(program: CapturedProgram) -> None:
    """:meth:`CapturedProgram.validate`: raise :class:`InvalidProgramError` at the first broken invariant."""
    from autoshard.roles import ROLES

    g = program.graph
    _expect(len(program.in_paths) == len(g.invars),
            f"{len(program.in_paths)} in_paths for {len(g.invars)} graph inputs")
    _expect(len(program.out_paths) == len(g.outvars),
            f"{len(program.out_paths)} out_paths for {len(g.outvars)} graph outputs")
    _expect(not program.in_roles or len(program.in_roles) == len(g.invars),
            f"{len(program.in_roles)} in_roles for {len(g.invars)} graph inputs")
    bad_roles = sorted(set(program.in_roles) - set(ROLES))
    _expect(not bad_roles, f"in_roles {bad_roles} are not among {ROLES}")
    _check_op_table(program)
    n = len(program.avals)
    for v in (*program.consts, *g.invars):
        _expect(0 <= v < n, f"value {v} (a graph input or const) has no aval (the program has {n})")
    _check_scope(program, g, set(g.invars) | set(program.consts), set(), "the program")
    producer, uses = index_ops(program.ops)
    _expect(program.producer == producer, "producer does not match the ops (rebuild it with index_ops)")
    _expect({v: list(u) for v, u in program.uses.items()} == uses, "uses does not match the ops")


def _check_op_table(program: CapturedProgram) -> None:
    indices = [op.index for op in program.ops]
    _expect(all(a < b for a, b in zip(indices, indices[1:])), "ops are not in strictly increasing index order")
    if program.in_tree is not None:  # a whole program numbers its own ops
        for k, op in enumerate(program.ops):
            _expect(op.index == k, f"op {op.index} ({op.name} at {op.source()}) sits at position {k} of ops")
    table = {op.index: op for op in program.ops}
    walked = graph_ops(program.graph)
    for op in walked:
        _expect(table.get(op.index) is op, f"op {op.index} ({op.name} at {op.source()}) of the graph is not "
                                           "the one ops holds at that index")
    _expect(len(walked) == len(table), f"ops holds {len(table) - len(walked)} ops the graph does not reach")


def _check_scope(program: CapturedProgram, g: OpGraph, defined: set, checked: set, where: str) -> None:
    """Every value ``g`` reads is defined before (in ``defined``, or by an earlier op of ``g``)."""
    n = len(program.avals)
    for op in g.ops:
        what = f"op {op.index} ({op.name} at {op.source()}) in {where}"
        for k, x in enumerate(op.inputs):
            if isinstance(x, int):
                _expect(x in defined, f"{what} reads value {x} (operand {k}) before it is defined")
        if op.body is not None and id(op.body) not in checked:
            checked.add(id(op.body))
            body_in = set(op.body.invars)
            for v in body_in:
                _expect(0 <= v < n, f"{what}: body input {v} has no aval")
            _check_scope(program, op.body, body_in | set(program.consts), checked, f"the body of op {op.index}")
        for v in op.outputs:
            _expect(0 <= v < n, f"{what} makes value {v}, which has no aval (the program has {n})")
            _expect(v not in defined, f"{what} makes value {v}, which is already defined")
            defined.add(v)
    for j, x in enumerate(g.outvars):
        if isinstance(x, int):
            _expect(x in defined, f"output {j} of {where} is value {x}, which is never defined")


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidProgramError(f"invalid CapturedProgram: {message}. Fix: this is an autoshard bug in the pass "
                                  "that built the program; please report it with the step function.")


class _Builder:
    def __init__(self, explicit: bool = False):
        self.avals: list = []
        self.ops: list[Op] = []
        self.consts: dict[int, Any] = {}
        # traced under Explicit mesh axes: read as Auto, every op in a context without the mesh (explicit.py)
        self.explicit = explicit
        if explicit:
            self.auto_ctx = auto_context()

    def new_value(self, aval) -> int:
        if self.explicit:
            aval = without_mesh(aval)
        self.avals.append(aval)
        return len(self.avals) - 1

    def _auto_params(self, eqn) -> tuple[dict, Any]:
        """An explicitly traced eqn's params read over Auto axes: the layouts jax inferred (``sharding=``)
        dropped, and the user's ``out_sharding=`` dropped and returned, to become a pin after the op."""
        params, pin = dict(eqn.params), None
        if not self.explicit or eqn.primitive.name in ("reshard", "sharding_constraint"):
            return params, pin
        if params.get("out_sharding") is not None:
            pin, params["out_sharding"] = params["out_sharding"], None
            if _transposed(eqn):  # jax's own: the backward pass types every transposed op
                pin = None
        if isinstance(params.get("sharding"), jax.sharding.NamedSharding):
            params["sharding"] = None
        return params, pin

    def _dropped(self, eqn, env, inputs) -> bool:
        """Whether ``eqn`` is a ``reshard`` that jax's backward pass wrote (the transpose of the user's, or of a
        layout the types implied): not the user's intent, so its output is its operand."""
        if not (self.explicit and eqn.primitive.name == "reshard" and _transposed(eqn)):
            return False
        if not isinstance(eqn.outvars[0], jex_core.DropVar):
            env[eqn.outvars[0]] = inputs[0]
        return True

    def _pin(self, eqn, value: int, sharding, trips: int) -> Op:
        """A ``reshard`` op after ``eqn`` pinning its output ``value`` to ``sharding`` (its output: the pinned
        value)."""
        if not isinstance(sharding, jax.sharding.NamedSharding):  # a PartitionSpec on the context's mesh
            sharding = jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(), sharding)
        out = self.new_value(self.avals[value])
        op = Op(index=len(self.ops), primitive=reshard_primitive(), params={"dst_sharding": sharding},
                inputs=(value,), outputs=(out,), ctx=self.auto_ctx, source_info=eqn.source_info, body=None,
                trips=trips)
        self.ops.append(op)
        return op

    def graph(self, jaxpr, consts, trips: int) -> OpGraph:
        env: dict = {}
        invars = []
        for v in jaxpr.invars:
            vid = self.new_value(v.aval)
            env[v] = vid
            invars.append(vid)
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = self._const(v.aval, c)
        ops: list[Op] = []
        self._eqns(jaxpr.eqns, env, ops, trips)
        outvars = tuple(self._read(env, v) for v in jaxpr.outvars)
        return OpGraph(tuple(invars), tuple(ops), outvars)

    def _const(self, aval, value) -> Operand:
        if np.ndim(value) == 0 or not hasattr(value, "shape"):
            return Const(value)
        vid = self.new_value(aval)
        self.consts[vid] = value
        return vid

    @staticmethod
    def _read(env, v) -> Operand:
        if isinstance(v, jex_core.Literal):
            return Const(v.val)
        return env[v]

    def _eqns(self, eqns, env, ops: list[Op], trips: int):
        for eqn in eqns:
            name = eqn.primitive.name
            inputs = tuple(self._read(env, v) for v in eqn.invars)
            if name in INLINED and INLINED[name] in eqn.params:
                inner = eqn.params[INLINED[name]]
                inner_jaxpr = getattr(inner, "jaxpr", inner)
                inner_consts = getattr(inner, "consts", ())
                sub_env: dict = {}
                for v, c in zip(inner_jaxpr.constvars, inner_consts, strict=True):
                    sub_env[v] = self._const(v.aval, c)
                # custom_vjp_call passes its consts first; the call jaxpr takes them all as invars.
                for v, x in zip(inner_jaxpr.invars, inputs, strict=True):
                    sub_env[v] = x
                self._eqns(inner_jaxpr.eqns, sub_env, ops, trips)
                for v, inner_out in zip(eqn.outvars, inner_jaxpr.outvars, strict=True):
                    env[v] = self._read(sub_env, inner_out)
                continue
            if self._dropped(eqn, env, inputs):
                continue
            body = None
            if name == "scan":
                closed = eqn.params["jaxpr"]
                body = self.graph(closed.jaxpr, closed.consts, trips * int(eqn.params["length"]))
            outputs = []
            for v in eqn.outvars:
                vid = self.new_value(v.aval)
                outputs.append(vid)
                if not isinstance(v, jex_core.DropVar):
                    env[v] = vid
            params, pin = self._auto_params(eqn)
            op = Op(
                index=len(self.ops),
                primitive=eqn.primitive,
                params=params,
                inputs=inputs,
                outputs=tuple(outputs),
                ctx=self.auto_ctx if self.explicit else eqn.ctx,
                source_info=eqn.source_info,
                body=body,
                trips=trips,
            )
            self.ops.append(op)
            ops.append(op)
            if pin is not None and len(outputs) == 1 and not isinstance(eqn.outvars[0], jex_core.DropVar):
                pin_op = self._pin(eqn, outputs[0], pin, trips)
                env[eqn.outvars[0]] = pin_op.outputs[0]
                ops.append(pin_op)


def _transposed(eqn) -> bool:
    """Whether jax's backward pass wrote ``eqn`` (its name stack holds a ``transpose`` transform)."""
    return "transpose(" in str(getattr(eqn.source_info, "name_stack", ""))


def index_ops(ops) -> tuple[dict, dict]:
    """``(producer, uses)`` of a flat op list: value id -> ``(op index, output position)``, and value
    id -> every ``(op index, operand position)`` that reads it (the fields of :class:`CapturedProgram`)."""
    producer, uses = {}, {}
    for op in ops:
        for k, v in enumerate(op.outputs):
            producer[v] = (op.index, k)
        for k, x in enumerate(op.inputs):
            if isinstance(x, int):
                uses.setdefault(x, []).append((op.index, k))
    return producer, uses


def capture_graph(fun, args, *, in_paths=None, explicit: bool = False) -> CapturedProgram:
    """Trace ``fun(*args)`` (arrays or ``ShapeDtypeStruct``s) into a :class:`CapturedProgram`.

    ``fun`` is traced on the argument pytrees themselves, so jax's tracing errors name ``fun`` (or the
    function it wraps, ``__wrapped__``) and each argument by its signature and pytree path, as under
    ``jax.jit``. An exception raised while tracing gets a note naming the step, its source line, the
    line that raised, and, for an error about a traced value, the leaves traced from Python scalars.

    ``explicit``: ``fun`` is traced under an Explicit mesh (code written for one, :mod:`autoshard.explicit`);
    its annotations become pins and the layouts jax inferred are dropped."""
    in_tree = jax.tree_util.tree_structure(args)
    if in_paths is None:
        in_paths = tuple(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0])
    try:
        closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    except Exception as e:
        e.add_note(tracing_note(fun, args, e))
        raise
    out_leaves_paths = jax.tree_util.tree_flatten_with_path(out_shape)[0]
    out_tree = jax.tree_util.tree_structure(out_shape)
    b = _Builder(explicit)
    graph = b.graph(closed.jaxpr, closed.consts, 1)
    return CapturedProgram.from_graph(
        graph,
        b.avals,
        in_tree=in_tree,
        out_tree=out_tree,
        in_paths=in_paths,
        out_paths=tuple(jax.tree_util.keystr(p) for p, _ in out_leaves_paths),
        consts=b.consts,
    )


def function_location(fun) -> str:
    """``name at file:line`` of the user's function behind ``fun`` (through ``functools.partial`` and
    ``__wrapped__``), as jax names a traced function; its ``repr`` where it has no code."""
    while isinstance(fun, functools.partial):
        fun = fun.func
    fun = inspect.unwrap(fun)
    code = getattr(fun, "__code__", None)
    name = getattr(fun, "__qualname__", getattr(fun, "__name__", None)) or repr(fun)
    return name if code is None else f"{name} at {code.co_filename}:{code.co_firstlineno}"


def argument_names(fun, args) -> tuple[str, ...]:
    """A name per leaf of ``args`` as the error messages of a trace give them: the parameter of ``fun``
    that receives the argument, then the pytree path (``model.blocks[0].patch_size``); ``args[i]...``
    where ``fun``'s signature does not take ``args``."""
    try:
        bound = inspect.signature(fun).bind(*args).arguments.items()
    except (TypeError, ValueError):
        bound = [("args", tuple(args))]
    return tuple(name + jax.tree_util.keystr(path)
                 for name, value in bound for path, _ in jax.tree_util.tree_flatten_with_path(value)[0])


def tracing_note(fun, args, exc: BaseException) -> str:
    """The note :func:`capture_graph` adds to an exception raised while tracing ``fun(*args)``."""
    note = f"autoshard was tracing {function_location(fun)}; the error was raised at {exception_location(exc)}."
    about_tracer = isinstance(exc, jax.errors.JAXTypeError) or "Tracer" in str(exc)
    scalars = [name for name, leaf in zip(argument_names(fun, args), jax.tree_util.tree_leaves(args), strict=True)
               if getattr(leaf, "weak_type", False) and not getattr(leaf, "shape", ())]
    if about_tracer and scalars:
        note += (f"\nThese leaves were Python scalars, traced as jax.jit traces them: {', '.join(scalars)}.\n"
                 "Fix: parallelize(..., filter=True) keeps every leaf that is not an array static (its value is "
                 "part of the cache key), as eqx.filter_jit does; or mark the argument static with "
                 "static_argnums=/static_argnames=.")
    return note


_LIBRARY_MARKERS = ("/jax/", "/jaxlib/", "/flax/", "/optax/", "/autoshard/", "/site-packages/", "<frozen")


def _stdlib_dirs() -> tuple[str, ...]:
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple({paths[k] + "/" for k in ("stdlib", "platstdlib") if k in paths})


_STDLIB_DIRS = _stdlib_dirs()


def _is_library(file_name: str) -> bool:
    """jax, libraries and the standard library (functools, contextlib): never the user's line."""
    return any(m in file_name for m in _LIBRARY_MARKERS) or file_name.startswith(_STDLIB_DIRS)


def source_location(source_info) -> str:
    """The innermost user frame of an eqn's traceback, as ``file:line``; ``"<unknown>"`` when the
    traceback holds none (jax records only its own frames for some ops made while differentiating)."""
    tb = getattr(source_info, "traceback", None)
    if tb is None:
        return "<unknown>"
    try:
        frames = tb.frames
    except Exception:  # pragma: no cover - traceback objects differ across jaxlib versions
        return "<unknown>"
    for f in frames:
        if not _is_library(f.file_name):
            return f"{f.file_name}:{f.line_num}"
    return "<unknown>"


def exception_location(exc: BaseException) -> str:
    """The innermost user frame (as in :func:`source_location`) of an exception raised while tracing."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    for f in reversed(frames):
        if not _is_library(f.filename):
            return f"{f.filename}:{f.lineno}"
    return "<unknown>"
