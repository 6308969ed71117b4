"""Predicted per-device memory of a plan, as XLA's ``memory_analysis`` counts it.

The peak is arguments + results + XLA's temp allocation (see :func:`autoshard.hlo.memory_stats`);
a result aliased to a donated argument shares its buffer. The temp allocation is the peak of
the live temporaries over XLA's sequential schedule:

- which values are buffers: XLA fuses elementwise and layout ops into their readers
  (duplicating the cheap ones), so a value is materialised when it is an output, comes from a
  dot, convolution, gather, scan or reduction, is an expensive elementwise op read twice, is
  read by an op that is not a fusion, or is a ``sub`` of a broadcast (a centring, BatchNorm's
  or LayerNorm's x − mean) that feeds a sum: XLA:CPU runs large reductions as library fusions
  that take no broadcast, so it writes x − mean out in the forward and keeps it for the
  backward's sum((x − mean)·dy) (:func:`_materialised`);
- when they live: from the op that writes them to their last reader, where a fused producer's
  operands live until the reader that computes it runs (:func:`_fused_reads`), over the lower
  of program order and a greedy memory-minimising list schedule (XLA keeps the best of
  several schedulers, and moves each optimizer update next to its gradient);
- buffer reuse: an elementwise fusion writes over an operand it reads last, and a result's
  buffer holds one smaller temporary until the result is written (:func:`_sweep`);
- what the backend adds when lowering: layout copies of convolution operands and the index
  buffers of expanded max-pool gradients (:func:`_lowering_buffers`), and buffer alignment.
  A convolution that reads a copy, and a pooling gradient that scatters by the saved winners'
  indices, no longer read the original value, so it is not kept alive for them. On a backend
  without mixed-precision dots (XLA:CPU) a bf16 dot reads f32 copies of its operands, one per
  operand and layout for every dot that reads it, and writes an f32 result before converting it
  (:func:`_widened_operands`).

What is platform behaviour (alignment, library reductions, convolution copies, max-pool index
buffers, widened dot operands) comes from a :class:`~autoshard.backends.BackendProfile`; what is primitive behaviour
(fusion, reductions, expensive ops, bitcasts) from the primitive's
:class:`~autoshard.strategies.OpInfo`.
"""
from __future__ import annotations

import bisect
import dataclasses
import math

import numpy as np

from autoshard.attention import attention_scores
from autoshard.backends import BackendProfile, profile_for
from autoshard.capture import CapturedProgram, OpGraph
from autoshard.roles import program_roles
from autoshard.spec import MeshInfo, ShardingSpec
from autoshard.strategies import op_info


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Predicted memory per device.

    Attributes:
      peak_bytes: the largest total of live buffers.
      breakdown: at the peak, bytes per category: ``parameters`` (carried state that is not
        optimizer state), ``optimizer_state``, ``inputs`` (fresh inputs: the batch), ``outputs``
        (new values not aliased to a donated input), ``intermediates`` (activations, gradients,
        temporaries; in a microbatched stage's program also the running sums it holds for the step,
        ``CapturedProgram.held``).
      peak_position: the op position (in program order) where the peak occurs.
      host_bytes: bytes per device kept in host memory (offloaded state, see
        :mod:`autoshard.offload`); not part of ``peak_bytes``.
    """

    peak_bytes: float
    breakdown: dict
    peak_position: int
    host_bytes: float = 0.0


def value_bytes(aval, spec: ShardingSpec | None, mesh: MeshInfo) -> float:
    """Bytes of one device's shard of a value laid out as ``spec`` (whole when ``spec`` is None)."""
    shape = tuple(getattr(aval, "shape", ()))
    try:
        itemsize = np.dtype(aval.dtype).itemsize
    except TypeError:
        itemsize = 8
    if spec is None or not shape:
        return float(math.prod(shape) * itemsize)
    return float(math.prod(spec.shard_shape(shape, mesh)) * itemsize)


COMBINE_THRESHOLD = 30 * 2**20  # bytes XLA's all-reduce combiner puts in one all-reduce


def _aligned(b: float, profile: BackendProfile) -> float:
    a = profile.buffer_alignment
    return float(math.ceil(b / a) * a)


class _ShardBytes:
    """Per-device bytes, element count and shape of a value under its layout."""

    def __init__(self, program, value_specs, mesh):
        self.program, self.value_specs, self.mesh = program, value_specs, mesh

    def shape(self, v) -> tuple:
        return tuple(getattr(self.program.avals[v], "shape", ()))

    def __call__(self, v) -> float:
        return value_bytes(self.program.avals[v], self.value_specs.get(v), self.mesh)

    def count(self, v) -> float:
        return self(v) / max(self.program.avals[v].dtype.itemsize, 1)


def _size(aval) -> int:
    return math.prod(getattr(aval, "shape", ()))


def _fusible(op) -> bool:
    """XLA fuses the op into its readers (its OpInfo says so, and it has no body)."""
    return op.body is None and op_info(op.name).fusible


def _loop_fused(op) -> bool:
    """A fusible op whose result is not a reduction's (a reduce is never fused into its readers)."""
    return _fusible(op) and not op_info(op.name).reduction


def _materialised(graph: OpGraph, avals, profile: BackendProfile) -> set:
    """The values of a graph that XLA writes to a buffer.

    Elementwise and layout ops fuse into their readers (cheap ones duplicated into each
    reader); a result is materialised when it is a graph output, comes from a non-fusible
    op (dots, convolutions, gathers, scans, ...) or a reduction, is an expensive op read
    twice, or is read by an op that takes only buffers (anything but a fusion)."""
    outs = {x for x in graph.outvars if isinstance(x, int)}
    producer = {v: op for op in graph.ops for v in op.outputs}
    readers: dict[int, list] = {}
    for op in graph.ops:
        for x in op.inputs:
            if isinstance(x, int):
                readers.setdefault(x, []).append(op)
    mat: set = set()
    for op in graph.ops:
        loop = _loop_fused(op)
        for v in op.outputs:
            rs = readers.get(v, ())
            if v in outs or not loop or (len(rs) > 1 and op_info(op.name).expensive):
                mat.add(v)
    if profile.library_reductions:
        _centrings(graph, avals, producer, mat, profile.library_reductions)
    for op in graph.ops:  # operands of ops that are not fusions must be buffers
        if _fusible(op) and not op_info(op.name).windowed:
            continue
        for x in op.inputs:
            if not isinstance(x, int) or x in mat or x not in producer:
                continue
            p = producer[x]
            src = next((y for y in p.inputs if isinstance(y, int)), None)
            if op_info(p.name).bitcast and src is not None and (src in mat or src not in producer):
                continue
            mat.add(x)
    return mat


def materialised_values(program: CapturedProgram, profile: BackendProfile) -> frozenset:
    """Every value of the program (top level and scan bodies) that XLA writes to a buffer
    (:func:`_materialised`): what the performance model counts as HBM traffic (:mod:`autoshard.work`)."""
    out: set = set()
    stack = [program.graph]
    while stack:
        g = stack.pop()
        out |= _materialised(g, program.avals, profile)
        stack.extend(op.body for op in g.ops if op.body is not None)
    return frozenset(out)


def _centrings(graph: OpGraph, avals, producer, mat: set, library_reductions) -> None:
    """Add to ``mat`` the centrings that feed a library reduction.

    XLA:CPU emits large reductions as library fusions that take no broadcast: a centring
    (x - a broadcast mean) that feeds a reduction is written out (BatchNorm's x - mean, kept
    from the forward to the backward's sum((x - mean) * dy)). Writing out every op of a
    broadcast that feeds a sum (a scale, a mask too) overshot XLA by 30% on the tiny
    Wide-ResNet, so the rule is kept to the centring."""
    seen: set = set()  # whether a value is written out does not depend on which sum reached it
    for op in graph.ops:
        if op.name not in library_reductions:
            continue
        stack = [x for x in op.inputs if isinstance(x, int)]
        while stack:
            x = stack.pop()
            p = producer.get(x)
            if x in seen or x in mat or p is None or not _fusible(p) or op_info(p.name).fused_source:
                continue
            seen.add(x)
            if p.name == "sub" and any(isinstance(y, int) and _size(avals[y]) < _size(avals[x]) for y in p.inputs):
                mat.add(x)
                continue
            stack.extend(y for y in p.inputs if isinstance(y, int))


def _graph_peak(graph: OpGraph, program, value_specs, mesh, *, profile: BackendProfile, on_chip=frozenset()) -> float:
    """Peak of a scan body's own buffers, evaluated once per iteration; ``on_chip`` values (:func:`on_chip_values`:
    the attention scores of a fused attention, in a scanned layer as at the top level) take none. The widened
    operands and results of its 2-byte dots (:func:`_widened_operands`) count as at the top level."""
    last: dict[int, int] = {}
    for t, op in enumerate(graph.ops):
        for x in op.inputs:
            if isinstance(x, int):
                last[x] = t
    mat = _materialised(graph, program.avals, profile)
    live = 0.0
    peak = 0.0
    ends: dict[int, list[float]] = {}
    widened, results, _ = _widened_operands(graph, program.avals, value_specs, {}, mesh, profile=profile)
    made_at: dict[int, list[tuple[float, int]]] = {}
    for b, lo, hi in widened:
        made_at.setdefault(lo, []).append((b, hi))
    for t, op in enumerate(graph.ops):
        extra = results.get(t, 0.0)
        for b, hi in made_at.pop(t, ()):
            live += b
            ends.setdefault(hi, []).append(b)
        if op.body is not None:
            extra += _graph_peak(op.body, program, value_specs, mesh, profile=profile, on_chip=on_chip)
        for v in op.outputs:
            if v in mat and v not in on_chip:
                b = value_bytes(program.avals[v], value_specs.get(v), mesh)
                live += b
                ends.setdefault(last.get(v, len(graph.ops)), []).append(b)
        peak = max(peak, live + extra)
        for b in ends.pop(t, ()):
            live -= b
    return peak + 0.0


def _fused_reads(graph: OpGraph, materialised: set) -> list[tuple[int, ...]]:
    """Per op, the materialised values it reads once fused producers are inlined into it.

    A value XLA fuses into its single reader has no buffer: the reader computes it from
    the fused producer's own operands, so those stay live until the reader runs."""
    made_here = {v for op in graph.ops for v in op.outputs}
    sources: dict[int, frozenset] = {}
    reads = []
    for op in graph.ops:
        eff: set = set()
        for x in op.inputs:
            if not isinstance(x, int):
                continue
            if x in materialised or x not in made_here:
                eff.add(x)
            else:
                eff |= sources.get(x, frozenset())
        frozen = frozenset(eff)
        for v in op.outputs:
            if v not in materialised:
                sources[v] = frozen
        reads.append(tuple(sorted(eff)))
    return reads


@dataclasses.dataclass(frozen=True, eq=False)
class _Liveness:
    """What the schedules sweep. Nodes are top-level op positions (in program order), ``-1`` for the
    step's start, and other negative ids for combined all-reduces; values are value ids, and
    negative ids for the buffers lowering adds.

    Attributes:
      nodes: the nodes in program order.
      reads / made: node -> the temporaries it reads / writes.
      size: temporary -> bytes.
      inplace: node -> whether it may write its result over an operand it reads last.
      transient: node -> bytes live only while it runs (a scan body's peak, a result's temporary).
      alloc_at: offloaded inputs, copied in by their first reader.
      kept: results, which have buffers of their own for the whole step.
    """

    nodes: list
    reads: dict
    made: dict
    size: dict
    inplace: dict
    transient: dict
    alloc_at: set
    kept: set


def _list_schedule(live: _Liveness) -> list[int]:
    """A greedy memory-minimising order, like XLA's list scheduler: of the ready ops, run the
    one that frees the most temporary bytes net of what it allocates (program order breaks ties)."""
    import heapq

    nodes, reads, made, size, kept, alloc_at = live.nodes, live.reads, live.made, live.size, live.kept, live.alloc_at
    producer = {v: n for n in nodes for v in made[n]}
    consumers: dict[int, list[int]] = {}
    waiting: dict[int, int] = {}
    readers: dict[int, set] = {}
    for n in nodes:
        deps = {producer[v] for v in reads[n] if v in producer and producer[v] != n}
        waiting[n] = len(deps)
        for d in deps:
            consumers.setdefault(d, []).append(n)
        for v in reads[n]:
            if v in size and v not in kept:
                readers.setdefault(v, set()).add(n)
    remaining = {v: len(r) for v, r in readers.items()}
    done: set = set()

    def score(n):  # an offloaded input is copied in by its first reader
        if n < 0:  # the step's start comes first
            return float("inf")
        freed = sum(size[v] for v in reads[n] if v in remaining and remaining[v] == 1)
        copied = sum(size[v] for v in reads[n] if v in alloc_at and remaining[v] == len(readers[v]))
        return freed - copied - sum(size.get(v, 0.0) for v in made[n])

    heap = [(-score(n), n) for n in nodes if waiting[n] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        s, n = heapq.heappop(heap)
        if n in done or -s != score(n):
            if n not in done:
                heapq.heappush(heap, (-score(n), n))
            continue
        done.add(n)
        order.append(n)
        for v in reads[n]:
            if v in remaining:
                remaining[v] -= 1
                if remaining[v] == 1:  # its last reader now frees it: that reader's score rises
                    last = next(iter(readers[v] - done))
                    if waiting[last] == 0:
                        heapq.heappush(heap, (-score(last), last))
        for c in consumers.get(n, ()):
            waiting[c] -= 1
            if waiting[c] == 0:
                heapq.heappush(heap, (-score(c), c))
    return order


def _hosted(temps, free) -> float:
    """Bytes of ``temps`` that fit, one per buffer, in the free result buffers ``free`` (sorted)."""
    import bisect

    free = list(free)
    hosted = 0.0
    for b in sorted(temps, reverse=True):
        i = bisect.bisect_left(free, b)
        if i < len(free):
            hosted += b
            free.pop(i)
    return hosted


def _sweep(order, live: _Liveness) -> tuple[float, int]:
    """Peak bytes of XLA's temp allocation over an order, and the op at the peak.

    Results (``kept``) have buffers of their own for the whole step; until its result is
    written, each such buffer can hold one temporary no larger than itself (XLA's buffer
    assignment reuses it), so only the temporaries that find no such buffer count."""
    reads, made, size, inplace = live.reads, live.made, live.size, live.inplace
    transient, alloc_at, kept = live.transient, live.alloc_at, live.kept
    last: dict[int, int] = {}
    for k, n in enumerate(order):
        for v in reads[n]:
            if v in size and v not in kept:
                last[v] = k
    first_read: dict[int, int] = {}
    if alloc_at:
        for k, n in enumerate(order):
            for v in reads[n]:
                if v in alloc_at:
                    first_read.setdefault(v, k)
    unwritten = sorted(size[v] for v in kept)
    live_set: dict[int, float] = {}
    live, best, best_n = 0.0, 0.0, -1
    for k, n in enumerate(order):
        new = [v for v in made[n] if v in size and v not in kept]
        new += [v for v in reads[n] if first_read.get(v) == k]
        for v in made[n]:
            if v in kept:
                unwritten.pop(bisect.bisect_left(unwritten, size[v]))
        dying = [v for v in reads[n] if v in live_set and last.get(v) == k]
        added = sum(size[v] for v in new)
        # An elementwise fusion may write its result over an operand it is the last to read.
        reuse = min(added, sum(size[v] for v in dying)) if inplace[n] else 0.0
        total = live + added - reuse + transient.get(n, 0.0)
        if total > best:
            temps = [b for v, b in live_set.items()] + [size[v] for v in new]
            total -= _hosted(temps, unwritten) if unwritten else 0.0
            if total > best:
                best, best_n = total, n
        for v in new:  # a buffer made and last read by one node (a gather for one reader) dies with it
            if last.get(v, -1) > k:
                live_set[v] = size[v]
                live += size[v]
        for v in dying:
            live -= live_set.pop(v)
    return best, best_n


def _conv_copy(spec, shape, kernel: bool) -> bool:
    """Whether XLA:CPU must transpose a convolution operand (or result) to its one layout:
    [batch, spatial..., feature] for images, [spatial..., in, out] for kernels."""
    perm = (*spec[2:], spec[1], spec[0]) if kernel else (spec[0], *spec[2:], spec[1])
    moved = [d for d in perm if shape[d] != 1]  # moving size-1 dims is a bitcast
    return moved != sorted(moved)


def _lowering_buffers(graph: OpGraph, materialised: set, nbytes, profile: BackendProfile) -> tuple[list, dict, set]:
    """Buffers the backend adds when it lowers convolutions and max-pool gradients.

    Returns ``(extras, transient, covered)``: ``extras`` are ``(bytes, op made at or None for
    the step's start, op last read at)``; ``transient`` is op position -> bytes live only there;
    ``covered`` the ``(op, operand)`` reads that go to one of the extras instead (a
    convolution's copy; the pooling winners' indices). Which mechanisms apply is the profile's
    (``conv_layout_copies``, ``maxpool_index_buffers``)."""
    producer = {v: t for t, op in enumerate(graph.ops) for v in op.outputs}
    extras, transient, covered = [], {}, set()
    for t, op in enumerate(graph.ops):
        if op.name == "conv_general_dilated" and profile.conv_layout_copies:
            more, temp, reads = _conv_buffers(t, op, producer, materialised, nbytes)
            if temp:
                transient[t] = transient.get(t, 0.0) + temp
        elif op.name == "select_and_scatter_add" and profile.maxpool_index_buffers and isinstance(op.inputs[1], int):
            more, reads = _pool_buffers(graph, t, op, producer, nbytes)
        else:
            continue
        extras += more
        covered |= reads
    return extras, transient, covered


def _conv_buffers(t: int, op, producer, materialised: set, nbytes) -> tuple[list, float, set]:
    """A convolution operand in the wrong layout is copied: the copy of a program input is made at
    the start (XLA schedules it first), others right after the operand; a result in the wrong
    layout is written to a temporary first (the middle of the returned triple, 0 if none)."""
    dn = op.params["dimension_numbers"]
    extras, covered = [], set()
    for x, spec, kernel in ((op.inputs[0], dn.lhs_spec, False), (op.inputs[1], dn.rhs_spec, True)):
        if isinstance(x, int) and (x in materialised or x not in producer) and _conv_copy(
                spec, nbytes.shape(x), kernel):
            # The copy is made right after the operand (XLA fuses the transpose into its
            # producer): a forward activation read by a backward convolution is kept, in
            # the convolution's layout, until then.
            extras.append((nbytes(x), producer.get(x), t))
            covered.add((t, x))
    y = op.outputs[0]
    temp = nbytes(y) if _conv_copy(dn.out_spec, nbytes.shape(y), False) else 0.0
    return extras, temp, covered


def _pool_buffers(graph: OpGraph, t: int, op, producer, nbytes) -> tuple[list, set]:
    """``select_and_scatter_add`` is expanded into an argmax over each window next to the forward
    pooling: index iotas of the operand's shape, and the winners' indices, kept until the gradient."""
    source, operand = op.inputs[0], op.inputs[1]
    rank = len(nbytes.shape(operand))
    per_index = nbytes.count(source) * 4  # s32 per window winner and dimension
    at = producer.get(operand)
    pool = next((u for u, o in enumerate(graph.ops) if o.name == "reduce_window_max" and operand in o.inputs),
                t if at is None else at)
    extras = [
        # The pooling writes the winners' indices beside its result; they are kept until the gradient.
        (rank * per_index, pool, t),
        # The index iotas, and the zeros the gradient is scattered into, depend on nothing:
        # XLA makes them at the step's start.
        (rank * nbytes.count(operand) * 4, None, pool),
        (nbytes(op.outputs[0]), None, t),
    ]
    return extras, {(t, operand)}  # the gradient scatters by the winners' indices, not the operand


def on_chip_values(program: CapturedProgram, profile: BackendProfile | None) -> frozenset:
    """Values the backend keeps on chip, with no buffer: attention scores where it fuses attention
    (``BackendProfile.fused_attention``, :func:`autoshard.attention.attention_scores`); none without a profile."""
    if profile is None or not profile.fused_attention:
        return frozenset()
    return attention_scores(program)


def _widened_operands(graph: OpGraph, avals, value_specs: dict, operand_specs: dict, mesh, *,
                      profile: BackendProfile) -> tuple[list, dict, set]:
    """The f32 copies of 2-byte float dot operands on a backend without mixed-precision dots
    (``BackendProfile.mixed_precision_dots`` False: XLA:CPU upcasts a bf16 dot's operands and computes it in f32).

    XLA converts each operand once (CSE) for every dot that reads it in one layout, so the f32 copy of a weight or of
    a softmax lives from its first dot in the forward to its last in the backward, where the 2-byte value itself no
    longer needs to. Returns ``(extras, transient, covered)`` as :func:`_lowering_buffers`: the copies (made at
    their first reader), the f32 result a 2-byte dot writes before its conversion (op position -> bytes), and the
    reads (op position, operand position) the copies serve instead of the 2-byte value."""
    if profile.mixed_precision_dots:
        return [], {}, set()
    spans: dict = {}
    transient: dict[int, float] = {}
    for t, op in enumerate(graph.ops):
        if op.name != "dot_general":
            continue
        for pos, x in enumerate(op.inputs[:2]):
            if isinstance(x, int) and _half_float(getattr(avals[x], "dtype", None)):
                spec = operand_specs.get((op.index, pos), value_specs.get(x))
                lo, _, reads = spans.get((x, spec), (t, t, []))
                spans[(x, spec)] = (lo, t, reads + [(t, pos)])
        y = op.outputs[0]
        if _half_float(getattr(avals[y], "dtype", None)):
            transient[t] = 2 * value_bytes(avals[y], value_specs.get(y), mesh)
    extras, covered = [], set()
    for (x, spec), (lo, hi, reads) in spans.items():
        extras.append((2 * value_bytes(avals[x], spec, mesh), lo, hi))
        covered.update(reads[1:])
    return extras, transient, covered


def _half_float(dtype) -> bool:
    """Whether ``dtype`` is a 2-byte float (bfloat16, whose numpy kind is "V", or float16)."""
    if dtype is None:
        return False
    dtype = np.dtype(dtype)
    return dtype.itemsize == 2 and (dtype.kind == "f" or dtype.name == "bfloat16")


def _resharded_buffers(program: CapturedProgram, value_specs: dict, operand_specs: dict, mesh,
                       skip=frozenset(), *, at_start: bool = True, served=frozenset()) -> list:
    """Buffers the plan's resharding collectives write: ``(bytes, op made at or None, op last read at)``.

    An operand a reader needs in a larger layout (an all-gather) is a new buffer, shared by
    every top-level reader that needs that layout (XLA merges identical collectives), from the
    first such reader to the last; with ``at_start`` (``BackendProfile.inputs_gathered_at_start``) one of a
    program input is gathered at the step's start, as XLA:CPU schedules it. A remat fence (an
    ``optimization_barrier``) reads its operand as stored and is resharded behind the barrier
    (:meth:`autoshard.lower.Evaluator.fence`), so its gather is its own, made there. Smaller layouts are
    slices that fuse into the reader. ``served``: (op position, operand position) reads that another buffer serves
    (:func:`_widened_operands`), which do not keep the gathered copy."""
    position = {op.index: t for t, op in enumerate(program.graph.ops)}
    invars = set(program.graph.invars)
    spans: dict = {}
    for (index, pos), spec in operand_specs.items():
        t = position.get(index)
        if t is None:
            continue
        op = program.graph.ops[t]
        x = op.inputs[pos]
        if not isinstance(x, int) or x in skip or (t, pos) in served:
            continue
        b = value_bytes(program.avals[x], spec, mesh)
        if b <= value_bytes(program.avals[x], value_specs.get(x), mesh):
            continue
        fence = t if op.name == "optimization_barrier" else None  # a fence's gather is not shared
        lo, hi, _ = spans.get((x, spec, fence), (t, t, b))
        spans[(x, spec, fence)] = (min(lo, t), max(hi, t), b)
    return [(b, None if at_start and fence is None and x in invars else lo, hi)
            for (x, _, fence), (lo, hi, b) in spans.items()]


def _fresh_id(size: dict, nodes) -> int:
    """A negative id below every fake value (``size``), added node and the step's start (-1) of a liveness graph."""
    return min([v for v in size if v < 0] + [n for n in nodes if n < 0] + [-1]) - 1


def combine_all_reduces(nodes, reads, made, size, reduced) -> None:
    """XLA's all-reduce combiner, applied to a liveness graph in place.

    ``nodes`` (op positions in order; negative ids are not ops), ``reads``/``made`` (node -> value
    ids it reads / writes), ``size`` (value id -> bytes) and ``reduced`` (values all-reduced where
    they are made) are the inputs of the estimate's sweep.

    XLA merges all-reduces that do not depend on one another (up to ``COMBINE_THRESHOLD``
    bytes) into one tuple all-reduce, run where its last operand is ready: every partial sum
    of a group stays live until then, and every reduced result is written there, so all of
    a data-parallel step's gradient partials and sums are live at once. A combined group
    becomes one extra node (a negative id, placed after its last member) that reads the
    partials and makes the reduced values."""
    group_of: dict[int, int] = {}  # value -> newest group it (transitively) depends on
    groups: list[list[tuple[int, int]]] = []  # (member op, reduced value)
    group_bytes: list[float] = []
    for t in nodes:
        dep = max((group_of.get(v, -1) for v in reads[t]), default=-1)
        for v in made[t]:
            if v in reduced and v in size:
                open_ = groups and dep < len(groups) - 1 and group_bytes[-1] + size[v] <= COMBINE_THRESHOLD
                if not open_:
                    groups.append([])
                    group_bytes.append(0.0)
                groups[-1].append((t, v))
                group_bytes[-1] += size[v]
                group_of[v] = len(groups) - 1
            else:
                group_of[v] = dep
    fake = _fresh_id(size, nodes)  # below the step's start node (-1) and every fake value
    for members in groups:
        if len(members) < 2:
            continue
        node = fake
        fake -= 1
        made[node], reads[node] = (), ()
        for t, v in members:
            partial = fake
            fake -= 1
            size[partial] = size[v]
            made[t] = tuple(partial if x == v else x for x in made[t])
            reads[node] += (partial,)
            made[node] += (v,)
        nodes.insert(nodes.index(members[-1][0]) + 1, node)


def estimate_memory(program: CapturedProgram, value_specs: dict, mesh: MeshInfo, *, donated=(),
                    out_specs=None, ties=None, offloaded=(), operand_specs=None,
                    reduced=frozenset(), profile: BackendProfile | None = None, held_specs=None) -> MemoryEstimate:
    """Per-device peak as XLA accounts it: arguments + outputs + the peak of live temporaries.

    XLA allocates the entry's arguments and results apart from its temporaries, for the whole
    step; a result aliased to a donated argument shares that argument's buffer. Temporaries
    are the materialised intermediates, live from the op that writes them to their last
    reader, in the lower-peak of two orders (XLA also keeps the best of several schedulers):
    program order, and a greedy order that runs first what frees the most bytes (it moves
    each optimizer update next to the gradient it consumes). Scan bodies add their own peak
    while the scan runs.

    Args:
      donated: flat input indices whose buffers are donated.
      out_specs: the layout of each flat output (defaults to the producer's).
      ties: flat output index -> flat input index it replaces (the carried state).
      offloaded: flat input indices kept in host memory; they and their replacements count on
        the device only while in use (:func:`autoshard.offload.device_intervals`).
      operand_specs: (op index, operand position) -> the layout that op reads the operand in,
        where it differs from the value's (``Plan.operand_specs``).
      reduced: value ids the plan all-reduces where they are made (partial sums); XLA
        combines the independent ones (:func:`combine_all_reduces`).
      profile: the backend that compiles the plan (:mod:`autoshard.backends`); None: the
        default backend's (``jax.default_backend()``).
      held_specs: value id -> the layout of its running sum, for the values of ``program.held`` held
        unreduced (``Plan.deferred``); the others' running sums take their own layout. A held value's
        running sum lives from the step's start until its first reader, where it is reduced into the
        value (:func:`hold_running_sums`), as the pipeline runtime does.
    """
    if profile is None:
        import jax

        profile = profile_for(jax.default_backend())
    entry = _entry_buffers(program, value_specs, mesh, donated=set(donated), out_specs=out_specs,
                           ties=ties or {}, offloaded=set(offloaded))
    live = _liveness(program, value_specs, mesh, entry, operand_specs=operand_specs or {}, reduced=reduced,
                     profile=profile, held_specs=held_specs or {})
    best = _sweep(live.nodes, live)
    best = min(best, _sweep(_list_schedule(live), live), key=lambda r: r[0])
    temp, at = best
    if at < -1:  # a combined all-reduce: report the op after which it runs
        at = max((n for n in live.nodes[:live.nodes.index(at)] if n >= -1), default=-1)
    fixed = dict(entry.fixed)
    if program.held:   # results made by an op count among the temporaries, from that op on (see _liveness)
        fixed["outputs"] = fixed.get("outputs", 0.0) - sum(b for v, b in entry.out_bytes.items()
                                                           if v in live.size and v not in live.kept)
    breakdown = {k: fixed.get(k, 0.0) for k in ("parameters", "optimizer_state", "inputs", "outputs")}
    breakdown["intermediates"] = temp
    return MemoryEstimate(sum(fixed.values()) + temp, breakdown, at + 1, entry.host_bytes)


@dataclasses.dataclass(frozen=True, eq=False)
class _Entry:
    """The entry computation's own buffers: arguments and results, allocated for the whole step.

    Attributes:
      fixed: bytes per breakdown category (parameters, optimizer_state, inputs, outputs).
      size: offloaded inputs -> bytes of their device copy (temporaries, copied in when read).
      host_bytes: bytes kept in host memory.
      out_bytes: result value -> bytes of its own buffer (results not aliased to a donated argument).
      host_values: result values that move to host memory.
    """

    fixed: dict
    size: dict
    host_bytes: float
    out_bytes: dict
    host_values: set


def _entry_buffers(program: CapturedProgram, value_specs, mesh, *, donated, out_specs, ties, offloaded) -> _Entry:
    graph = program.graph
    host_outputs = {o for o, i in ties.items() if i in offloaded}
    aliased_outputs = {o for o, i in ties.items() if i in donated} - host_outputs
    host_bytes = 0.0
    roles = program_roles(program, ties)

    def category(i: int) -> str:
        if i not in ties.values():
            return "inputs"
        return "optimizer_state" if roles[i] == "optimizer_state" else "parameters"

    fixed: dict[str, float] = {}
    size: dict[int, float] = {}  # offloaded inputs' device copies
    for i, v in enumerate(graph.invars):
        b = value_bytes(program.avals[v], value_specs.get(v), mesh)
        if i in offloaded:  # a host buffer (two unless donated), and a device copy while in use
            host_bytes += b if i in donated else 2 * b
            size[v] = b
            continue
        fixed[category(i)] = fixed.get(category(i), 0.0) + b
    for v in program.consts:
        fixed["parameters"] = fixed.get("parameters", 0.0) + value_bytes(program.avals[v], value_specs.get(v), mesh)
    out_bytes: dict[int, float] = {}  # result buffers not aliased to a donated argument
    for j, x in enumerate(graph.outvars):
        if j in aliased_outputs or j in host_outputs:
            continue
        if isinstance(x, int):
            spec = out_specs[j] if out_specs is not None else value_specs.get(x)
            b = value_bytes(program.avals[x], spec, mesh)
            fixed["outputs"] = fixed.get("outputs", 0.0) + b
            out_bytes[x] = out_bytes.get(x, 0.0) + b
        else:
            fixed["outputs"] = fixed.get("outputs", 0.0) + float(np.asarray(x.value).nbytes)
    return _Entry(fixed, size, host_bytes, out_bytes, {graph.outvars[o] for o in host_outputs})


def _liveness(program: CapturedProgram, value_specs, mesh, entry: _Entry, *, operand_specs, reduced,
              profile: BackendProfile, held_specs) -> _Liveness:
    """The temporaries and the ops that write and read them, with the buffers lowering adds."""
    graph = program.graph
    ops = graph.ops
    size = dict(entry.size)  # temporaries: value id -> bytes
    alloc_at = set(entry.size)  # offloaded inputs: copied in before their first reader
    kept: set = set()  # results: live from their op to the end
    outputs = {x for x in graph.outvars if isinstance(x, int)}
    materialised = _materialised(graph, program.avals, profile)
    reads = _fused_reads(graph, materialised)
    nodes = [t for t, op in enumerate(ops) if not _fusible(op) or any(v in materialised for v in op.outputs)]
    made = {t: tuple(v for v in ops[t].outputs if v in materialised) for t in nodes}
    for t in nodes:
        for v in made[t]:
            if v not in outputs or v in entry.host_values:
                size[v] = _aligned(value_bytes(program.avals[v], value_specs.get(v), mesh), profile)
            elif v in entry.out_bytes:  # the result's buffer, which holds other temporaries before it is written
                size[v] = entry.out_bytes[v]
                if not program.held:   # a microbatched stage's update is a program of its own (below)
                    kept.add(v)
    inplace = {t: _loop_fused(ops[t]) for t in nodes}
    scores = on_chip_values(program, profile)
    transient = {t: _graph_peak(ops[t].body, program, value_specs, mesh, profile=profile, on_chip=scores)
                 for t in nodes if ops[t].body is not None}
    extras, lowering, covered = _lowering_buffers(graph, materialised, _ShardBytes(program, value_specs, mesh),
                                                  profile)
    widened, results, served = _widened_operands(graph, program.avals, value_specs, operand_specs, mesh, profile=profile)
    extras += widened
    for t, b in results.items():
        lowering[t] = lowering.get(t, 0.0) + b
    covered |= {(t, ops[t].inputs[pos]) for t, pos in served}
    if covered:
        dropped: dict[int, set] = {}
        for t, v in covered:
            dropped.setdefault(t, set()).add(v)
        reads = [tuple(v for v in r if v not in dropped[t]) if t in dropped else r for t, r in enumerate(reads)]
    for v in scores & size.keys():
        size[v] = 0.0
    extras += _resharded_buffers(program, value_specs, operand_specs, mesh, skip=scores,
                                 at_start=profile.inputs_gathered_at_start, served=served)

    def scheduled(t):  # a fused op runs inside the next op that is not fused
        return nodes[min(bisect.bisect_left(nodes, t), len(nodes) - 1)]

    for t, b in lowering.items():
        transient[scheduled(t)] = transient.get(scheduled(t), 0.0) + b
    reads = dict(enumerate(reads))
    start = -1  # a step before the first op, for buffers XLA makes from the arguments first
    reads[start], made[start], inplace[start] = (), (), False
    for k, (b, at, last_reader) in enumerate(extras):
        fake = -2 - k
        size[fake] = _aligned(b, profile)
        at = start if at is None else scheduled(at)
        made[at] = made[at] + (fake,)
        reads[scheduled(last_reader)] = reads[scheduled(last_reader)] + (fake,)
    nodes = [start] + nodes
    if reduced - program.held:
        combine_all_reduces(nodes, reads, made, size, reduced - program.held)
    if program.held:
        reducing = hold_running_sums(nodes, reads, made, size, {
            v: _aligned(value_bytes(program.avals[v], held_specs.get(v, value_specs.get(v)), mesh), profile)
            for v in program.held})
        if reducing and program.in_flight_bytes:  # other microbatches' activations, until the update
            first = min(reducing, key=nodes.index)
            fake = _fresh_id(size, nodes)
            size[fake] = float(program.in_flight_bytes)
            made[nodes[0]] = made[nodes[0]] + (fake,)
            reads[first] = reads[first] + (fake,)
        # The update runs after the last microbatch, as a program of its own: its results are allocated
        # when it runs, not for the whole step, and stay to the end.
        end = _fresh_id(size, nodes)
        nodes.append(end)
        reads[end], made[end] = tuple(v for v in entry.out_bytes if v in size), ()
    inplace.update({n: False for n in nodes if n not in inplace})  # the nodes added above
    return _Liveness(nodes, reads, made, size, inplace, transient, alloc_at, kept)


def hold_running_sums(nodes, reads, made, size, held: dict) -> list:
    """The running sums of a microbatched stage (``CapturedProgram.held``: value id -> bytes of its running
    sum), applied to a liveness graph in place (its arguments as :func:`combine_all_reduces`'s).

    The pipeline runtime keeps a running sum of each over the microbatches for the whole step (its first
    node, ``nodes[0]``, makes them) and reduces it into the value before the value's first reader: an extra
    node (a negative id) reads the running sum and makes the value. Where the op that makes it was, a
    token of no bytes keeps the order. Returns the nodes added."""
    fake = _fresh_id(size, nodes)
    position = {n: k for k, n in enumerate(nodes)}
    maker = {v: n for n in nodes for v in made[n] if v in held}
    added = []
    for v, at in maker.items():
        first = next((n for n in nodes[position[at] + 1:] if v in reads[n]), None)
        if first is None:
            continue
        node, acc, token = fake, fake - 1, fake - 2
        fake -= 3
        size[acc], size[token] = held[v], 0.0
        made[nodes[0]] = made[nodes[0]] + (acc,)
        made[at] = tuple(token if x == v else x for x in made[at])
        reads[node], made[node] = (acc, token), (v,)
        nodes.insert(nodes.index(first), node)
        added.append(node)
    return added
