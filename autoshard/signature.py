"""The step's call signature: how one call's arguments become the traced program's inputs.

``StepSignature`` is made once per parallelized function from the ``jax.jit``-style options
(``static_argnums``/``static_argnames``, ``donate_argnums``/``donate_argnames``). ``bind(args,
kwargs)`` turns one call into a :class:`BoundCall`:

- static arguments (by position or by name) are set aside: they are part of the cache key and are
  passed to the step as they are;
- the dynamic arguments, positional and keyword, become one tuple ``dyn`` (keyword arguments after
  the positional ones, sorted by name), each labelled with its position or its name;
- flax nnx graph nodes (``nnx.Module``, ``nnx.Optimizer``, ``nnx.Rngs``, ...) anywhere in a dynamic
  argument are split into their ``nnx.State`` (``nnx.split`` over all of them at once, so a shared
  submodule is one set of leaves), as ``nnx.jit`` does. The traced function merges them back, runs the
  step, and returns the objects' new state after the step's own outputs; :meth:`BoundCall.finish`
  writes it into the caller's objects (``nnx.update``): parameters, optimizer state, ``optimizer.step``,
  BatchNorm statistics and ``Rngs`` counters change in place, as under ``nnx.jit``;
- with ``filter`` on (``parallelize(filter=True)``, or by default when a dynamic argument holds an
  ``eqx.Module``), ``eqx.filter_jit``'s rule: the array leaves of the dynamic arguments are traced, and
  every other leaf (a Python int, float or bool, a function, None, a string) is static, part of the cache
  key, and passed to the step as it is (:class:`LeafPartition`). What the step returns is split the same
  way: its non-array leaves come back as the step made them when it was traced.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import keyword
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from autoshard.errors import InputError


def _as_tuple(x, kind) -> tuple:
    if x is None:
        return ()
    if isinstance(x, kind):
        return (x,)
    return tuple(x)


def _parameters(fun):
    try:
        return list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):  # builtins and some callables have no signature
        return None


def _resolve(nums, names, params, what: str):
    """``jax.jit``'s rule: a positional-or-keyword parameter named by number is also named by name, and
    the other way round. Returns ``(nums, names)`` as frozensets."""
    nums, names = set(nums), set(names)
    if params is None:
        return frozenset(nums), frozenset(names)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    known = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    has_var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    for n in names:
        if n not in known and not has_var_kw:
            raise InputError(f"{what}_argnames names {n!r}, which is not a parameter of the step (its parameters: "
                             f"{', '.join(p.name for p in params)}). Fix: name one of them.")
    for i, p in enumerate(positional):
        if i in nums and p.kind == p.POSITIONAL_OR_KEYWORD:
            names.add(p.name)
        if p.name in names:
            nums.add(i)
    return frozenset(nums), frozenset(names)


@dataclasses.dataclass(frozen=True)
class StepSignature:
    """The ``jax.jit``-style argument options of one parallelized step (see :meth:`create`)."""

    fun: Callable
    static_argnums: frozenset
    static_argnames: frozenset
    donate_argnums: frozenset
    donate_argnames: frozenset
    positional_names: tuple = ()  # names of the positional parameters, where the signature is known
    filter: bool | None = None    # eqx.filter_jit's rule: True, False, or None (on when an eqx.Module is passed)

    @classmethod
    def from_options(cls, fun, options) -> StepSignature:
        """The signature of ``fun`` under an :class:`autoshard.Options`' argnums and argnames."""
        return cls.create(fun, options.static_argnums, options.static_argnames, options.donate_argnums,
                          options.donate_argnames, filter=options.filter)

    @classmethod
    def create(cls, fun, static_argnums=(), static_argnames=(), donate_argnums=(), donate_argnames=(), *,
               filter=None):
        params = _parameters(fun)
        snums, snames = _resolve(_as_tuple(static_argnums, int), _as_tuple(static_argnames, str), params, "static")
        dnums, dnames = _resolve(_as_tuple(donate_argnums, int), _as_tuple(donate_argnames, str), params, "donate")
        positional = tuple(p.name for p in params or () if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        both = [f"argument {i}" + (f" ({positional[i]!r})" if i < len(positional) else "") for i in sorted(snums & dnums)]
        both += [f"argument {n!r}" for n in sorted((snames & dnames) - set(positional))]
        if both:
            raise InputError(f"{', '.join(both)} {'is' if len(both) == 1 else 'are'} both static and donated. "
                             "Fix: donate only array arguments.")
        return cls(fun, snums, snames, dnums, dnames, positional, filter)

    def _positions(self, nums, n: int, kwargs, what: str) -> frozenset:
        out = set()
        name = getattr(self.fun, "__name__", "the step")
        for i in nums:
            if -n <= i < n:
                out.add(i % n)
            elif i < 0 or not (i < len(self.positional_names) and self.positional_names[i] in kwargs):
                raise InputError(
                    f"{what}_argnums={tuple(sorted(nums))} names argument {i}, but {name} was called with {n} "
                    f"positional arguments. Fix: pass {what}_argnums within range(0, {n}).")
        return frozenset(out)

    def bind(self, args: tuple, kwargs: dict) -> BoundCall:
        """Split one call into static and dynamic parts (see the module docstring)."""
        n = len(args)
        static_nums = self._positions(self.static_argnums, n, kwargs, "static")
        donate_nums = self._positions(self.donate_argnums, n, kwargs, "donate")
        static, dyn, labels = [], [], []
        for i, a in enumerate(args):
            if i in static_nums:
                static.append((i, a))
            else:
                dyn.append(a)
                labels.append(i)
        for k in sorted(kwargs):
            if k in self.static_argnames:
                static.append((k, kwargs[k]))
            else:
                dyn.append(kwargs[k])
                labels.append(k)
        static = tuple(static)
        try:
            hash(static)
        except TypeError as e:
            raise InputError(f"static arguments must be hashable: {e}. Fix: pass a hashable value (a tuple, not "
                             "a list), or make the argument dynamic.") from None
        donated = tuple(lab in (donate_nums if isinstance(lab, int) else self.donate_argnames) for lab in labels)
        graph = _NodeGraph.split(tuple(dyn)) if has_graph_nodes(dyn) else None
        pure, inputs = tuple(dyn) if graph is None else graph.pure, None
        if self.filter or (self.filter is None and has_equinox_modules(dyn)):
            pure, inputs = LeafPartition.split(pure)
        return BoundCall(self, pure, tuple(labels), static, donated, graph, inputs)


@dataclasses.dataclass(frozen=True, eq=False)
class BoundCall:
    """One call, bound: the dynamic arguments ``dyn`` (each labelled with its position or keyword), the
    static ones, which dynamic arguments are donated, and the nnx objects to update after the call.

    Under ``filter``, ``dyn`` holds only the array leaves (None where another leaf was), ``inputs`` the
    rest, and ``outputs`` records the non-array leaves the step returned when it was traced."""

    signature: StepSignature
    dyn: tuple
    labels: tuple
    static: tuple
    donated: tuple
    graph: _NodeGraph | None = None
    inputs: LeafPartition | None = None
    outputs: OutputRecord = dataclasses.field(default_factory=lambda: OutputRecord())

    @property
    def positional_labels(self) -> tuple:
        """Each dynamic argument's position in the call; keyword arguments count as ``-1``."""
        return tuple(lab if isinstance(lab, int) else -1 for lab in self.labels)

    def abstract(self):
        """The dynamic arguments as ``ShapeDtypeStruct``s, every leaf checked to be an array."""
        static_names = [k for k, _ in self.static]
        for path, leaf in jax.tree_util.tree_flatten_with_path(self.dyn)[0]:
            check_leaf(jax.tree_util.keystr(path[1:]), leaf, self.labels[path[0].idx], static_names)
        return jax.tree_util.tree_map(abstract_leaf, self.dyn)

    def leaves(self) -> list:
        """The dynamic arguments' flat leaves, refusing abstract ones (a run needs arrays)."""
        leaves = jax.tree_util.tree_leaves(self.dyn)
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            raise InputError("cannot run on jax.ShapeDtypeStruct arguments; use .plan() or .lower() instead")
        return leaves

    def key(self, abstract) -> tuple:
        """The cache key: structure, shapes and dtypes, static values, labels, nnx graph definitions."""
        leaves, tree = jax.tree_util.tree_flatten(abstract)
        return self.key_of(leaves, tree)

    def key_of(self, leaves, tree) -> tuple:
        """:meth:`key` from flat leaves that have ``shape`` and ``dtype`` (arrays or abstract ones)."""
        shapes = tuple((tuple(x.shape), x.dtype) for x in leaves)
        graph = None if self.graph is None else self.graph.static_key
        return (tree, shapes, self.static, self.labels, graph, self.inputs)

    def in_paths(self, abstract) -> tuple[str, ...]:
        """A readable pytree path per flat leaf: ``[0]['params']...`` for positional arguments,
        ``batch['x']`` for keyword ones."""
        out = []
        for path, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]:
            lab = self.labels[path[0].idx]
            head = f"[{path[0].idx}]" if isinstance(lab, int) else lab
            out.append(head + jax.tree_util.keystr(path[1:]))
        return tuple(out)

    def donated_leaves(self) -> set[int]:
        out, offset = set(), 0
        for a, d in zip(self.dyn, self.donated, strict=True):
            n = len(jax.tree_util.tree_leaves(a))
            if d:
                out.update(range(offset, offset + n))
            offset += n
        return out

    def pure_function(self) -> Callable:
        """The step as a function of ``*dyn``. With nnx objects, it returns ``(out, *new_dyn)``; under
        ``filter``, only its array leaves (the rest is recorded in ``outputs``).

        It carries the step's name and source (``__wrapped__``) and a signature naming each dynamic argument
        as the step does, so that jax's tracing errors name the user's function and argument paths
        (``model.patch_embedding.patch_size``), as under ``jax.jit``."""
        fun, labels, static = self.signature.fun, self.labels, self.static
        graph, inputs, outputs = self.graph, self.inputs, self.outputs

        def call(dyn):
            args, kwargs = {}, {}
            for lab, v in (*static, *zip(labels, dyn, strict=True)):
                (args if isinstance(lab, int) else kwargs)[lab] = v
            n = max(args) + 1 if args else 0
            if set(args) != set(range(n)):  # pragma: no cover - labels come from a real call
                raise AssertionError(f"argument positions {sorted(args)} are not contiguous")
            return fun(*(args[i] for i in range(n)), **kwargs)

        step = (lambda *dyn: call(dyn)) if graph is None else graph.wrap(call, getattr(fun, "__name__", "the step"))
        if inputs is None:
            pure = step
        else:
            def pure(*dyn):
                out, outputs.partition = LeafPartition.split(step(*inputs.merge(dyn)))
                return out

        target = fun
        while isinstance(target, functools.partial):
            target = target.func
        functools.update_wrapper(pure, target, updated=())
        pure.__signature__ = self._traced_signature()
        return pure

    def _traced_signature(self) -> inspect.Signature:
        """Positional parameters named as the step names its dynamic arguments (``*args`` where it cannot)."""
        names = []
        for lab in self.labels:
            known = isinstance(lab, str) or lab < len(self.signature.positional_names)
            names.append((lab if isinstance(lab, str) else self.signature.positional_names[lab]) if known else None)
        if (None in names or len(set(names)) < len(names)
                or not all(n.isidentifier() and not keyword.iskeyword(n) for n in names)):
            return inspect.Signature([inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)])
        return inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in names])

    def state_arguments(self, abstract, out_shape) -> frozenset:
        """Positions of the dynamic arguments the step returns updated (the state; the rest is the batch):
        those holding nnx objects, and those an output of the step is the next version of."""
        outputs, held = (out_shape, frozenset()) if self.graph is None else (out_shape[0], self.graph.arguments())
        tied = set(output_ties(abstract, outputs).values())
        out, offset = set(held), 0
        for i, a in enumerate(abstract):
            n = len(jax.tree_util.tree_leaves(a))
            if any(j in tied for j in range(offset, offset + n)):
                out.add(i)
            offset += n
        return frozenset(out)

    def finish(self, outputs):
        """The step's outputs as the user sees them: non-array leaves put back (under ``filter``), and nnx
        objects' new state written back."""
        if self.inputs is not None:
            outputs = self.outputs.merge(outputs)
        if self.graph is None:
            return outputs
        out, *new_dyn = outputs
        self.graph.update(tuple(new_dyn))
        return out


class StepCache:
    """The programs a step built, one per cache key (:meth:`BoundCall.key`).

    ``lookup(args, kwargs)`` binds the call, and builds (``build(call, abstract)``) only on a miss. A
    call whose leaves are all arrays is looked up without abstracting them (the common, hot path)."""

    def __init__(self, signature: StepSignature, build: Callable):
        self.signature = signature
        self._build = build
        self._entries: dict = {}
        self._outputs: dict = {}  # key -> the OutputRecord of the call that built the entry (under filter)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, args: tuple, kwargs: dict) -> tuple[Any, BoundCall]:
        """``(entry, call)`` for one call: the built program and the bound call."""
        call = self.signature.bind(args, kwargs)
        leaves, tree = jax.tree_util.tree_flatten(call.dyn)
        if all(isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) for x in leaves):
            key = call.key_of(leaves, tree)
            entry = self._entries.get(key)
            if entry is not None:
                return entry, self._recorded(key, call)
        abstract = call.abstract()
        key = call.key(abstract)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = self._build(call, abstract)
            self._outputs[key] = call.outputs
            return entry, call
        return entry, self._recorded(key, call)

    def _recorded(self, key, call: BoundCall) -> BoundCall:
        """``call``, told what the step's traced outputs held besides arrays (under ``filter``)."""
        if call.inputs is not None:
            call.outputs.partition = self._outputs[key].partition
        return call


# ---- eqx.filter_jit's rule -------------------------------------------------------------------------


def is_array_leaf(x) -> bool:
    """A leaf that ``filter`` traces: ``eqx.is_array``'s rule (jax and numpy arrays and scalars), and
    ``ShapeDtypeStruct``s, which stand for arrays when planning."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def has_equinox_modules(tree) -> bool:
    """Whether ``tree`` holds an ``eqx.Module`` (equinox is not imported for this: without it, none can exist)."""
    eqx = sys.modules.get("equinox")
    if eqx is None:
        return False
    is_module = functools.partial(_is_instance, cls=eqx.Module)
    return any(is_module(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_module))


def _is_instance(x, cls) -> bool:
    return isinstance(x, cls)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class StaticLeaf:
    """A leaf that ``filter`` keeps out of the trace, as a cache key: equal by type and value where it is
    hashable (``3``, ``"gelu"``, a function), else by identity (as equinox compares them)."""

    value: Any

    def _hashable(self) -> bool:
        try:
            hash(self.value)
        except TypeError:
            return False
        return True

    def __hash__(self) -> int:
        return hash((type(self.value), self.value)) if self._hashable() else id(self.value)

    def __eq__(self, other) -> bool:
        if not isinstance(other, StaticLeaf):
            return NotImplemented
        a, b = self.value, other.value
        if a is b:
            return True
        if type(a) is not type(b) or not (self._hashable() and other._hashable()):
            return False
        try:
            return bool(a == b)
        except Exception:  # an __eq__ that returns something without a truth value
            return False


@dataclasses.dataclass(frozen=True)
class LeafPartition:
    """A pytree split by ``eqx.filter_jit``'s rule: its structure, and each leaf that is not an array with
    its position. :meth:`split` returns the tree with those leaves replaced by None (the arrays, which are
    traced) and the partition; :meth:`merge` puts them back. Equal partitions make equal cache keys."""

    tree: Any              # the whole tree's treedef
    static: tuple          # (leaf position, StaticLeaf) per leaf that is not an array

    @classmethod
    def split(cls, tree) -> tuple[Any, LeafPartition]:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        static = tuple((i, StaticLeaf(x)) for i, x in enumerate(leaves) if not is_array_leaf(x))
        if not static:
            return tree, cls(treedef, ())
        placed = set(i for i, _ in static)
        arrays = [None if i in placed else x for i, x in enumerate(leaves)]
        return jax.tree_util.tree_unflatten(treedef, arrays), cls(treedef, static)

    def merge(self, arrays):
        """The whole tree from the split-off ``arrays`` (the tree :meth:`split` returned, or its values)."""
        if not self.static:
            return arrays
        flat = iter(jax.tree_util.tree_leaves(arrays))
        static = dict(self.static)
        leaves = [static[i].value if i in static else next(flat) for i in range(self.tree.num_leaves)]
        if next(flat, None) is not None:  # pragma: no cover - the arrays come from split
            raise AssertionError("more array leaves than the partition has places for")
        return jax.tree_util.tree_unflatten(self.tree, leaves)


class OutputRecord:
    """What a filtered step returned besides arrays: the :class:`LeafPartition` of its outputs, recorded when
    it is traced, with which :meth:`merge` rebuilds each call's outputs."""

    __slots__ = ("partition",)

    def __init__(self):
        self.partition: LeafPartition | None = None

    def merge(self, arrays):
        if self.partition is None:  # pragma: no cover - the step is traced before it runs
            raise AssertionError("the step's outputs were never traced")
        return self.partition.merge(arrays)


# ---- flax nnx graph nodes ------------------------------------------------------------------------


def _nnx():
    """flax.nnx if the program has imported it (an nnx object can only exist then), else None."""
    if "flax.nnx" not in sys.modules:
        return None
    from flax import nnx

    return nnx


_NOT_NODES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, list, tuple, dict, int, float, complex,
              type(None))


def _is_graph_node(x) -> bool:
    """An nnx object to split and update in place. A ``Variable`` is not one here: ``nnx.State`` holds
    them (the functional ``nnx.split`` style), and they flatten to their values like any pytree."""
    if isinstance(x, _NOT_NODES):  # the common leaves and containers, quickly (this runs on every call)
        return False
    nnx = _nnx()
    return nnx is not None and not isinstance(x, nnx.Variable) and nnx.graph.is_graph_node(x)


def has_graph_nodes(tree) -> bool:
    if _nnx() is None:
        return False
    return any(_is_graph_node(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_graph_node))


@dataclasses.dataclass(frozen=True, eq=False)
class _NodeGraph:
    """The nnx objects of one call: where they sit in the arguments, and their split."""

    objects: tuple          # the caller's graph nodes, in leaf order
    tree: Any               # the arguments' treedef with graph nodes as leaves
    positions: tuple        # leaf positions of the graph nodes
    graphdef: Any
    pure: tuple             # the arguments with each graph node replaced by its nnx.State

    @classmethod
    def split(cls, dyn: tuple) -> _NodeGraph:
        nnx = _nnx()
        leaves, tree = jax.tree_util.tree_flatten(dyn, is_leaf=_is_graph_node)
        positions = tuple(i for i, x in enumerate(leaves) if _is_graph_node(x))
        objects = tuple(leaves[i] for i in positions)
        graphdef, state = nnx.split(objects)
        return cls(objects, tree, positions, graphdef, _placed(tree, leaves, positions, state))

    def arguments(self) -> frozenset:
        """Positions of the dynamic arguments that hold an nnx object."""
        held, offset = set(), 0
        for i, child in enumerate(self.tree.children()):
            n = child.num_leaves
            if any(offset <= p < offset + n for p in self.positions):
                held.add(i)
            offset += n
        return frozenset(held)

    @property
    def static_key(self):
        return (self.tree, self.graphdef)

    def _states(self, dyn) -> tuple[list, Any]:
        nnx = _nnx()
        parts = self.tree.flatten_up_to(dyn)
        return parts, nnx.State({j: parts[i] for j, i in enumerate(self.positions)})

    def wrap(self, call, name: str) -> Callable:
        nnx = _nnx()

        def pure(*dyn):
            parts, state = self._states(dyn)
            objects = nnx.merge(self.graphdef, state)
            for j, i in enumerate(self.positions):
                parts[i] = objects[j]
            out = call(tuple(jax.tree_util.tree_unflatten(self.tree, parts)))
            if has_graph_nodes(out):
                raise InputError(
                    f"{name} returns an nnx object. A parallelized nnx step updates the objects it is passed in "
                    "place (as nnx.jit does), and returns arrays.\nFix: return only arrays and metrics, e.g. "
                    "`return loss` instead of `return model, loss`; the model passed in is updated.")
            graphdef, new_state = nnx.split(objects)
            if graphdef != self.graphdef:
                raise InputError(
                    f"{name} changed the structure of the nnx objects it was passed (it added, removed or retyped "
                    "an attribute), which a compiled step cannot write back.\nFix: create every attribute in "
                    "__init__ (e.g. nnx.Variable(jnp.zeros(...))) and only update values in the step.")
            return (out, *_placed(self.tree, parts, self.positions, new_state))

        return pure

    def update(self, new_dyn: tuple) -> None:
        nnx = _nnx()
        _, state = self._states(new_dyn)
        nnx.update(self.objects, state)


def _placed(tree, leaves, positions, state) -> tuple:
    """The arguments with the graph node at each leaf position replaced by its part of ``state`` (the
    ``nnx.State`` of the split tuple of nodes; a node whose variables a shared one holds gets none)."""
    nnx = _nnx()
    parts = list(leaves)
    for j, i in enumerate(positions):
        parts[i] = state[j] if j in state else nnx.State({})
    return tuple(jax.tree_util.tree_unflatten(tree, parts))


def abstract_leaf(leaf):
    """A leaf's ``ShapeDtypeStruct``. Extended dtypes (typed PRNG keys, ``key<fry>``) keep their dtype:
    jax refuses to canonicalize them, and a key array is planned like an array of its shape."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    if isinstance(leaf, (int, float, bool, complex)):
        return jax.ShapeDtypeStruct((), jax.dtypes.canonicalize_dtype(type(leaf)), weak_type=True)
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
        return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype)
    return jax.ShapeDtypeStruct(np.shape(leaf), jax.dtypes.canonicalize_dtype(leaf.dtype))


def check_leaf(path: str, leaf, label, static_names=()):
    """Raise InputError unless ``leaf`` (at ``path`` of argument ``label``) is an array or an abstract one."""
    if isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct, np.generic, int, float, bool, complex)):
        return
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return
    what = f"argument {label}" if isinstance(label, int) else f"keyword argument {label!r}"
    if isinstance(label, int):
        fix = f"static_argnums={tuple(sorted({*(i for i in static_names if isinstance(i, int)), label}))}"
    else:
        fix = f"static_argnames={tuple(sorted({*(n for n in static_names if isinstance(n, str)), label}))}"
    raise InputError(
        f"{what} has a leaf at {path or '<root>'} of type {type(leaf).__name__}, which is not an "
        "array. Without filter=True, autoshard traces every leaf of a dynamic argument, as jax.jit does.\n"
        "Fix: parallelize(..., filter=True) traces the array leaves and keeps every other leaf (functions, "
        "Python ints, strings) static, as eqx.filter_jit does: the way to pass Equinox modules and optax "
        f"optimizers. Or pass arrays only, or mark the argument static: parallelize(..., {fix})."
    )


def output_ties(dyn_args, out_shape) -> dict[int, int]:
    """Output leaves that are the next version of an input leaf (same subtree, shapes and dtypes)."""
    in_leaves_offset, offset = [], 0
    for a in dyn_args:
        n = len(jax.tree_util.tree_leaves(a))
        in_leaves_offset.append((offset, jax.tree_util.tree_structure(a), jax.tree_util.tree_leaves(a)))
        offset += n
    candidates = [((), out_shape)]
    if isinstance(out_shape, (tuple, list)):
        candidates += [((j,), o) for j, o in enumerate(out_shape)]
    out_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
    ties = {}
    for prefix, sub in candidates:
        tree = jax.tree_util.tree_structure(sub)
        leaves = jax.tree_util.tree_leaves(sub)
        if not leaves:
            continue
        for start, in_tree, in_leaves in in_leaves_offset:
            if tree != in_tree:
                continue
            if any(tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype
                   for a, b in zip(leaves, in_leaves, strict=True)):
                continue
            first = next(k for k, p in enumerate(out_paths) if tuple(
                getattr(x, "idx", getattr(x, "key", None)) for x in p[:len(prefix)]) == prefix)
            for j in range(len(leaves)):
                ties.setdefault(first + j, start + j)
            break
    return ties
