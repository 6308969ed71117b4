"""Reading what XLA compiled: collectives, memory and flops (the step-time score is :mod:`autoshard.hlo_schedule`).

``compiled.as_text()`` (for ``compiled = jax.jit(f, ...).lower(*args).compile()``)
is the per-device HLO module after SPMD partitioning. :func:`collective_stats`
parses it and lists every collective with its per-device bytes, its replica
groups and how many times it runs: a collective inside a ``while`` body runs
``known_trip_count`` times, and nested loops multiply.

HLO patterns handled:

* opcodes ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all``,
  ``collective-permute``, ``collective-broadcast``, ``ragged-all-to-all``, and
  their async ``-start`` forms (the ``-done`` is not counted). A collective
  wrapped in an ``async-start`` is found inside the computation it calls.
* ``replica_groups={{0,1},{2,3}}`` (explicit), ``replica_groups=[2,4]<=[8]`` and
  ``[4,2]<=[2,4]T(1,0)`` (iota), ``replica_groups={}`` (all devices), and the
  Shardy mesh form ``mesh['a'=2,'b'=4], device_ids=([2,4]T(1,0)) {'b'}`` or
  ``@mesh<a=2,b=4> {b:(1)2}`` (sub-axes included);
  ``source_target_pairs={{0,1},...}`` for permutes, whose groups are the cycles.
* call edges ``body=``/``condition=`` (times the while's trip count),
  ``calls=``, ``to_apply=``, ``branch_computations=``,
  ``true_computation=``/``false_computation=``.

Device ids in the groups are logical ids: positions in the flattened device
array of the mesh the program was compiled for.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from autoshard.collectives import CollectiveKind

__all__ = [
    "COLLECTIVE_KINDS",
    "CompiledCollective",
    "CollectiveStats",
    "HloInstr",
    "collective_record",
    "collective_stats",
    "dot_shape",
    "instruction_attr",
    "instruction_callees",
    "parse_module",
    "shape_bytes",
    "trip_count",
    "flops",
    "memory_stats",
]

COLLECTIVE_KINDS = (*(k.value for k in CollectiveKind), "collective-broadcast", "ragged-all-to-all")
"""The collective opcodes of HLO (without ``-start``): every :class:`CollectiveKind`, and two that
are priced as one of them (:meth:`CollectiveKind.parse`)."""

_DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0,
}  # fmt: skip


def _dtype_bytes(dtype: str) -> float:
    if dtype in _DTYPE_BYTES:
        return _DTYPE_BYTES[dtype]
    if dtype.startswith(("f8", "f6", "f4")):  # f8e4m3fn, f8e5m2, f6e2m3fn, f4e2m1fn, ...
        return {"f8": 1, "f6": 0.75, "f4": 0.5}[dtype[:2]]
    raise ValueError(f"unknown HLO element type {dtype!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class CompiledCollective:
    """One collective instruction of a compiled HLO module.

    Attributes:
      kind: the collective, without ``-start``: one of ``COLLECTIVE_KINDS``.
      name: the instruction name, e.g. ``"all-reduce.3"``.
      computation: the computation it lives in.
      opcode: the opcode as written, e.g. ``"all-gather-start"``.
      shapes: the result arrays, e.g. ``("f32[64,32]",)``; a tuple-shaped result
        lists every element.
      dtypes: the element type of each of ``shapes``.
      bytes: per-device result bytes of one execution.
      operand_bytes: per-device operand bytes, or None if an operand's shape is
        not visible in the text.
      groups: the device groups (logical ids), or None when not written and the
        device count is unknown.
      multiplicity: how many times one step executes it (loop trip counts).
      in_unknown_loop: it sits in a ``while`` without a known trip count, which
        is counted once.
    """

    kind: str
    name: str
    computation: str
    opcode: str
    shapes: tuple[str, ...]
    dtypes: tuple[str, ...]
    bytes: float
    operand_bytes: float | None
    groups: tuple[tuple[int, ...], ...] | None
    multiplicity: int = 1
    in_unknown_loop: bool = False

    @property
    def group_size(self) -> int | None:
        """Devices per group, or None if unknown."""
        if not self.groups:
            return None
        return len(self.groups[0])

    @property
    def is_async(self) -> bool:
        return self.opcode.endswith("-start")


def _kind_filter(kind: str | None) -> str | None:
    if kind is None:
        return None
    k = kind.replace("_", "-").lower().removesuffix("-start")
    if k not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
    return k


@dataclasses.dataclass(frozen=True, slots=True)
class CollectiveStats:
    """Every collective in a compiled module, with multiplicity-weighted totals.

    Attributes:
      collectives: one record per collective instruction in the text.
      num_devices: ``num_partitions × replica_count`` from the module header, or
        None for a header-less snippet.
      dot_flops: flops of the ``dot`` instructions, weighted by multiplicity.
      dot_flops_once: the same with every loop body counted once, as
        ``cost_analysis()`` counts it.
    """

    collectives: tuple[CompiledCollective, ...]
    num_devices: int | None = None
    dot_flops: float = 0.0
    dot_flops_once: float = 0.0

    def _select(self, kind: str | None) -> list[CompiledCollective]:
        k = _kind_filter(kind)
        return [c for c in self.collectives if k is None or c.kind == k]

    def count(self, kind: str | None = None, *, weighted: bool = True) -> int:
        """Executions per step of collectives of ``kind`` (all if None).

        With ``weighted=False``, the number of instructions in the text instead.
        """
        return sum(c.multiplicity if weighted else 1 for c in self._select(kind))

    def bytes(self, kind: str | None = None) -> float:
        """Per-device result bytes of ``kind`` per step, weighted by multiplicity."""
        return float(sum(c.bytes * c.multiplicity for c in self._select(kind)))

    def by_kind(self) -> dict[str, dict[str, float]]:
        """``{kind: {"count": ..., "bytes": ...}}`` for the kinds present."""
        out: dict[str, dict[str, float]] = {}
        for c in self.collectives:
            d = out.setdefault(c.kind, {"count": 0, "bytes": 0.0})
            d["count"] += c.multiplicity
            d["bytes"] += c.bytes * c.multiplicity
        return out

    def __len__(self) -> int:
        return len(self.collectives)

    def __str__(self) -> str:
        head = ("kind", "name", "shape", "bytes", "group", "x", "computation")
        rows = [head]
        for c in self.collectives:
            shape = ",".join(c.shapes) if len(c.shapes) <= 2 else f"{c.shapes[0]},...({len(c.shapes)})"
            mult = f"{c.multiplicity}{'?' if c.in_unknown_loop else ''}"
            rows.append(
                (c.kind, c.name, shape, _fmt_bytes(c.bytes), str(c.group_size or "?"), mult, c.computation)
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        total = ", ".join(f"{k}: {int(v['count'])}× {_fmt_bytes(v['bytes'])}" for k, v in self.by_kind().items())
        lines.append(f"total per step: {total or 'no collectives'}")
        return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# ---------------------------------------------------------------------------------
# Text parsing.

_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_COMP_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([^\s(]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')


def _split_shape(rest: str) -> tuple[str, str]:
    """Splits ``'f32[2]{0} add(%a, %b), ...'`` into the shape and what follows."""
    rest = rest.lstrip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
        return rest, ""
    m = re.match(r"\S+", rest)
    end = m.end() if m else 0
    return rest[:end], rest[end:].lstrip()


def _parse_shape(text: str) -> Any:
    """A shape string to nested lists of ``(dtype, dims)`` arrays."""
    text = _COMMENT.sub("", text).strip()
    if text.startswith("("):
        items, depth, start = [], 0, 1
        for i, ch in enumerate(text):
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth -= 1
                if depth == 0:
                    if text[start:i].strip():
                        items.append(_parse_shape(text[start:i]))
                    break
            elif ch == "," and depth == 1:
                items.append(_parse_shape(text[start:i]))
                start = i + 1
        return items
    m = _ARRAY.match(text)
    if not m:  # token[], opaque[] or an empty string: no bytes
        return ("token", ())
    dims = tuple(int(d.strip().lstrip("<=")) for d in m.group(2).split(",") if d.strip())
    return (m.group(1), dims)


def _leaves(shape: Any) -> list[tuple[str, tuple[int, ...]]]:
    if isinstance(shape, list):
        return [leaf for item in shape for leaf in _leaves(item)]
    return [shape]


def _shape_bytes(shape: Any) -> float:
    return float(sum(_dtype_bytes(dt) * math.prod(dims) for dt, dims in _leaves(shape) if dt != "token"))


def _leaf_str(leaf: tuple[str, tuple[int, ...]]) -> str:
    return f"{leaf[0]}[{','.join(map(str, leaf[1]))}]"


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Splits on ``sep`` outside brackets, braces, parens and quotes."""
    out, depth, start, quote = [], 0, 0, None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote and text[i - 1] != "\\":
                quote = None
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == sep and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return [s.strip() for s in out if s.strip()]


def _balanced(text: str, start: int) -> int:
    """Index one past the bracket group that opens at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{<":
            depth += 1
        elif text[i] in ")]}>":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


@dataclasses.dataclass(frozen=True, slots=True)
class _Instr:
    name: str
    shape: Any
    opcode: str
    operands: tuple[str, ...]
    attrs: str


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    shape_text, rest = _split_shape(m.group(2))
    om = re.match(r"([\w\-]+)\(", rest)
    if not om:
        return None
    close = _balanced(rest, om.end() - 1)
    operands = tuple(
        tok.split()[-1].lstrip("%") for tok in _split_top(_COMMENT.sub("", rest[om.end() : close - 1]))
    )
    return _Instr(m.group(1).lstrip("%"), _parse_shape(shape_text), om.group(1), operands, rest[close:])


def _parse_module(text: str) -> tuple[dict[str, list[_Instr]], str | None, dict[str, int]]:
    comps: dict[str, list[_Instr]] = {}
    entry = None
    current = None
    header: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("HloModule"):
            for key in ("num_partitions", "replica_count"):
                hm = re.search(rf"\b{key}=(\d+)", line)
                if hm:
                    header[key] = int(hm.group(1))
            continue
        if current is None:
            hm = _COMP_HEADER.match(line)
            if hm:
                current = hm.group(2).lstrip("%")
                comps[current] = []
                if hm.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        instr = _parse_instr(line)
        if instr is not None:
            comps[current].append(instr)
    return comps, entry, header


def _attr(attrs: str, key: str) -> str | None:
    """The raw value of ``key=`` in an attribute list, brackets balanced."""
    m = re.search(rf"(?:^|[,\s]){re.escape(key)}=", attrs)
    if not m:
        return None
    i = m.end()
    if i < len(attrs) and attrs[i] in "([{<":
        return attrs[i : _balanced(attrs, i)]
    j = i
    while j < len(attrs) and attrs[j] not in ", ":
        j += 1
    return attrs[i:j]


def _callees(instr: _Instr) -> list[tuple[str, str]]:
    """``(role, computation)`` pairs this instruction calls."""
    if instr.opcode in ("async-done", "async-update"):
        return []  # the async-start already accounts for the wrapped computation
    out = []
    for key in ("body", "condition", "calls", "to_apply", "branch_computations",
                "true_computation", "false_computation"):  # fmt: skip
        v = _attr(instr.attrs, key)
        if v:
            for name in re.findall(r"%?([^\s,{}%]+)", v):
                out.append((key, name))
    return out


def _iota(dims: Sequence[int], reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    a = np.arange(math.prod(reshape)).reshape(tuple(reshape))
    if perm is not None:
        a = a.transpose(tuple(perm))
    return a.reshape(tuple(dims))


_IOTA = re.compile(r"\[([\d,\s]*)\]\s*(?:<=\s*\[([\d,\s]*)\])?\s*(?:T\(([\d,\s]*)\))?")


def _ints(s: str | None) -> list[int]:
    return [int(x) for x in (s or "").split(",") if x.strip()]


def _parse_iota(text: str) -> np.ndarray | None:
    m = _IOTA.match(text.strip())
    if not m:
        return None
    dims = _ints(m.group(1))
    reshape = _ints(m.group(2)) if m.group(2) is not None else [math.prod(dims)]
    perm = _ints(m.group(3)) if m.group(3) is not None else None
    if perm is not None and m.group(2) is None:
        # ``[2,4]T(1,0)``: iota over dims, transposed, flattened.
        return _iota([math.prod(dims)], dims, perm)
    return _iota(dims, reshape, perm)


def _parse_mesh_groups(attrs: str, start: int) -> list[list[int]] | None:
    """Shardy's ``mesh['a'=2,'b'=4], device_ids=(...) {'b'}`` or ``@mesh<a=2>(...) {a:(1)2}``."""
    text = attrs[start:]
    m = re.match(r"@?mesh\s*([\[<])", text)
    if not m:
        return None
    end = _balanced(text, m.end() - 1)
    axes = []
    for item in _split_top(text[m.end() : end - 1]):
        am = re.match(r"""['"]?([^'"=]+)['"]?\s*=\s*(\d+)""", item)
        if am:
            axes.append((am.group(1).strip(), int(am.group(2))))
    rest = text[end:]
    device_ids = None
    dm = re.match(r"\s*(?:,\s*device_ids\s*=\s*)?\(", rest)
    if dm:
        close = _balanced(rest, dm.end() - 1)
        inner = rest[dm.end() : close - 1].strip()
        if inner.startswith("["):
            device_ids = _parse_iota(inner)
        else:
            device_ids = np.array(_ints(inner.strip("{}")))
        rest = rest[close:]
    gm = re.match(r"\s*\{([^}]*)\}", rest)
    if not gm:
        return None
    sizes = [s for _, s in axes]
    index = {n: i for i, (n, _) in enumerate(axes)}
    devices = np.arange(math.prod(sizes)) if device_ids is None else np.asarray(device_ids).reshape(-1)
    # Split every mesh axis into (pre, size, post) pieces as the sub-axes demand.
    pieces: dict[int, list[tuple[int, int]]] = {}
    for ref in _split_top(gm.group(1)):
        rm = re.match(r"""['"]?([^'":]+)['"]?\s*(?::\s*\((\d+)\)\s*(\d+))?""", ref)
        if not rm or rm.group(1).strip() not in index:
            return None
        i = index[rm.group(1).strip()]
        if rm.group(2):
            pieces.setdefault(i, []).append((int(rm.group(2)), int(rm.group(3))))
        else:
            pieces.setdefault(i, []).append((1, sizes[i]))
    dims, grouped = [], []
    for i, full in enumerate(sizes):
        if i not in pieces:
            dims.append(full)
            continue
        prefix = 1
        for pre, size in sorted(pieces[i]):
            if pre != prefix:
                dims.append(pre // prefix)
                prefix = pre
            grouped.append(len(dims))
            dims.append(size)
            prefix *= size
        if prefix != full:
            dims.append(full // prefix)
    keep = [d for d in range(len(dims)) if d not in grouped]
    arr = devices.reshape(dims).transpose(keep + grouped)
    n = math.prod(dims[d] for d in grouped)
    return arr.reshape(-1, n).tolist()


def _parse_groups(attrs: str, num_devices: int | None) -> list[list[int]] | None:
    pairs = _attr(attrs, "source_target_pairs")
    if pairs is not None:
        return _permute_cycles([tuple(_ints(p)) for p in re.findall(r"\{([\d,\s]+)\}", pairs)])
    m = re.search(r"(?:^|[,\s])replica_groups=", attrs)
    if not m:
        return [list(range(num_devices))] if num_devices else None
    start = m.end()
    value = attrs[start:]
    if value.lstrip().startswith(("mesh", "@mesh")):
        return _parse_mesh_groups(attrs, start + len(value) - len(value.lstrip()))
    if value.lstrip().startswith("["):
        iota = _parse_iota(value)
        return iota.tolist() if iota is not None and iota.ndim == 2 else None
    raw = _attr(attrs, "replica_groups") or ""
    groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", raw[1:-1] if raw.startswith("{") else raw)]
    groups = [g for g in groups if g]
    if not groups:
        return [list(range(num_devices))] if num_devices else None
    return groups


def _permute_cycles(pairs: Iterable[tuple[int, ...]]) -> list[list[int]]:
    """Connected components of a permute's source→target pairs."""
    parent: dict[int, int] = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for p in pairs:
        if len(p) == 2:
            parent[find(p[0])] = find(p[1])
    comps: dict[int, list[int]] = {}
    for x in sorted(parent):
        comps.setdefault(find(x), []).append(x)
    return list(comps.values())


def _collective_kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    if opcode.endswith("-done") or base not in COLLECTIVE_KINDS:
        return None
    return base


def _result_shape(instr: _Instr) -> Any:
    """The collective's result, dropping the operand/context parts of ``-start`` tuples."""
    if instr.opcode in ("all-gather-start", "collective-permute-start") and isinstance(instr.shape, list):
        if len(instr.shape) >= 2:
            return instr.shape[1]
    return instr.shape


def _dot_flops(instr: _Instr, shapes: dict[str, Any]) -> float:
    lhs = shapes.get(instr.operands[0]) if instr.operands else None
    if lhs is None or isinstance(lhs, list) or isinstance(instr.shape, list):
        return 0.0
    contracting = _ints((_attr(instr.attrs, "lhs_contracting_dims") or "").strip("{}"))
    k = math.prod(lhs[1][d] for d in contracting if d < len(lhs[1]))
    return 2.0 * math.prod(instr.shape[1]) * k


def collective_stats(compiled_or_text: Any) -> CollectiveStats:
    """Lists the collectives of a compiled program, with loop multiplicities.

    Args:
      compiled_or_text: a ``jax.stages.Compiled`` (anything with ``as_text()``)
        or the HLO text itself.

    Returns:
      A :class:`CollectiveStats`. Bytes are per device.

    Example:
        >>> stats = collective_stats(jax.jit(f, in_shardings=...).lower(x).compile())  # doctest: +SKIP
        >>> stats.count("all-reduce"), stats.bytes("all-reduce")  # doctest: +SKIP
    """
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    comps, entry, header = _parse_module(text)
    num_devices = None
    if header:
        num_devices = header.get("num_partitions", 1) * header.get("replica_count", 1)

    multiplicity = _multiplicities(comps, entry)
    records = []
    dot_flops = dot_once = 0.0
    for cname, instrs in comps.items():
        shapes = {i.name: i.shape for i in instrs}
        mult, unknown = multiplicity(cname)
        for instr in instrs:
            if instr.opcode == "dot":
                f = _dot_flops(instr, shapes)
                dot_flops += f * mult
                dot_once += f
                continue
            kind = _collective_kind(instr.opcode)
            if kind is not None:
                records.append(_record(instr, kind, cname, shapes, num_devices=num_devices, times=(mult, unknown)))
    return CollectiveStats(tuple(records), num_devices, dot_flops, dot_once)


def _multiplicities(comps: dict, entry: str):
    """``multiplicity(computation) -> (executions per step, inside a loop of unknown trip count)``,
    from the call graph (a ``while`` body counts its trip count)."""
    calls: dict[str, list[tuple[str, int, bool]]] = {c: [] for c in comps}
    for cname, instrs in comps.items():
        for instr in instrs:
            trip = None
            if instr.opcode == "while":
                tm = _TRIP.search(instr.attrs)
                trip = int(tm.group(1)) if tm else None
            for role, callee in _callees(instr):
                if callee not in comps:
                    continue
                if role in ("body", "condition"):
                    calls[callee].append((cname, trip if trip is not None else 1, trip is None))
                else:
                    calls[callee].append((cname, 1, False))
    memo: dict[str, tuple[int, bool]] = {}

    def multiplicity(c: str, stack: tuple[str, ...] = ()) -> tuple[int, bool]:
        if c in memo:
            return memo[c]
        callers = calls.get(c, [])
        if c == entry or not callers or c in stack:
            result = (1, False)
        else:
            total, unknown = 0, False
            for caller, factor, unk in callers:
                m, u = multiplicity(caller, (*stack, c))
                total += m * factor
                unknown = unknown or u or unk
            result = (max(total, 1), unknown)
        memo[c] = result
        return result

    return multiplicity


def _record(instr, kind: str, computation: str, shapes: dict, *, num_devices, times: tuple[int, bool]):
    """The :class:`CompiledCollective` of one collective instruction."""
    result = _result_shape(instr)
    leaves = [leaf for leaf in _leaves(result) if leaf[0] != "token"]
    op_shapes = [shapes.get(o) for o in instr.operands]
    operand_bytes = None if any(s is None for s in op_shapes) else sum(map(_shape_bytes, op_shapes))
    groups = _parse_groups(instr.attrs, num_devices)
    return CompiledCollective(
        kind=kind,
        name=instr.name,
        computation=computation,
        opcode=instr.opcode,
        shapes=tuple(_leaf_str(leaf) for leaf in leaves),
        dtypes=tuple(leaf[0] for leaf in leaves),
        bytes=_shape_bytes(result),
        operand_bytes=operand_bytes,
        groups=None if groups is None else tuple(tuple(int(d) for d in g) for g in groups),
        multiplicity=times[0],
        in_unknown_loop=times[1],
    )


# ---------------------------------------------------------------------------------
# The parsing API other readers of compiled HLO use (autoshard.hlo_score).

HloInstr = _Instr


def parse_module(text: str) -> tuple[dict[str, list[HloInstr]], str | None, dict[str, int]]:
    """``(computations, entry name, header)`` of an HLO module's text: each computation's instructions in
    the module's (scheduled) order; the header's ``num_partitions`` and ``replica_count``."""
    return _parse_module(text)


def instruction_callees(instr: HloInstr) -> list[tuple[str, str]]:
    """``(role, computation)`` pairs an instruction calls (``body``, ``calls``, ``to_apply``, ...)."""
    return _callees(instr)


def instruction_attr(instr: HloInstr, key: str) -> str | None:
    """The raw value of attribute ``key=`` of an instruction."""
    return _attr(instr.attrs, key)


def shape_bytes(shape: Any) -> float:
    """Bytes of a parsed shape (tuples summed)."""
    return _shape_bytes(shape)


def trip_count(instr: HloInstr) -> int | None:
    """A ``while``'s ``known_trip_count``, or None."""
    tm = _TRIP.search(instr.attrs)
    return int(tm.group(1)) if tm else None


def collective_record(instr: HloInstr, computation: str, shapes: dict, num_devices) -> CompiledCollective | None:
    """The :class:`CompiledCollective` of a collective instruction (one execution), or None for others."""
    kind = _collective_kind(instr.opcode)
    if kind is None:
        return None
    return _record(instr, kind, computation, shapes, num_devices=num_devices, times=(1, False))


def dot_shape(instr: HloInstr, shapes: dict) -> tuple[float, tuple[int, int, int, int] | None]:
    """``(flops, (batch, m, n, k))`` of a ``dot`` instruction (its local matmul), ``(0.0, None)`` when its
    operands' shapes are not visible."""
    if not instr.operands or len(instr.operands) < 2:
        return 0.0, None
    lhs, rhs = shapes.get(instr.operands[0]), shapes.get(instr.operands[1])
    if lhs is None or rhs is None or isinstance(lhs, list) or isinstance(rhs, list) or isinstance(instr.shape, list):
        return 0.0, None
    lc = _ints((_attr(instr.attrs, "lhs_contracting_dims") or "").strip("{}"))
    rc = _ints((_attr(instr.attrs, "rhs_contracting_dims") or "").strip("{}"))
    lb = _ints((_attr(instr.attrs, "lhs_batch_dims") or "").strip("{}"))
    rb = _ints((_attr(instr.attrs, "rhs_batch_dims") or "").strip("{}"))
    ld, rd = lhs[1], rhs[1]
    k = math.prod(ld[d] for d in lc if d < len(ld))
    b = math.prod(ld[d] for d in lb if d < len(ld))
    m = math.prod(ld[d] for d in range(len(ld)) if d not in lc and d not in lb)
    n = math.prod(rd[d] for d in range(len(rd)) if d not in rc and d not in rb)
    return 2.0 * b * m * n * k, (int(b), int(m), int(n), int(k))


# ---------------------------------------------------------------------------------
# Memory and flops.


def memory_stats(compiled: Any) -> dict[str, float]:
    """Per-device memory of a compiled program, in bytes.

    Keys: ``argument``, ``output``, ``temp``, ``alias``, ``generated_code``, the
    ``host_*`` variants when the backend reports them, and ``peak`` =
    argument + output + temp − alias (an upper bound on live device memory; XLA
    may free arguments early).
    """
    ma = compiled.memory_analysis()
    if ma is None:
        raise ValueError("this backend gives no memory_analysis() for the compiled program")
    out: dict[str, float] = {}
    for key in ("argument", "output", "temp", "alias", "generated_code"):
        out[key] = float(getattr(ma, f"{key}_size_in_bytes", 0) or 0)
        host = getattr(ma, f"host_{key}_size_in_bytes", None)
        if host is not None:
            out[f"host_{key}"] = float(host)
    if not out.get("host_argument") and not out.get("host_output"):
        # The CPU backend keeps host-memory (S(5)) buffers in the device numbers: move them out.
        host = _host_entry_bytes(compiled.as_text())
        for key in ("argument", "output", "alias"):
            out[key] -= host[key]
            out[f"host_{key}"] = out.get(f"host_{key}", 0.0) + host[key]
    out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


_HOST_MEMORY_SPACE = ":S(5)"  # XLA's layout annotation of a host-memory buffer
_ENTRY_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_ALIAS = re.compile(r"\{\d*\}:\s*\((\d+),")


def _braced(text: str, key: str) -> str:
    """The text inside ``key={...}`` (braces nested), or ''."""
    at = text.find(key + "={")
    if at < 0:
        return ""
    start, depth = at + len(key) + 1, 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    return ""


def _host_entry_bytes(text: str) -> dict[str, float]:
    """Bytes of the entry parameters and outputs whose layout puts them in host memory (``S(5)``)."""
    found = {"argument": 0.0, "output": 0.0, "alias": 0.0}
    header = text.split("\n", 1)[0]
    if _HOST_MEMORY_SPACE not in header:
        return found
    params, _, results = _COMMENT.sub("", _braced(header, "entry_computation_layout")).partition(")->")
    host_param_bytes = []
    for key, part in (("argument", params), ("output", results)):
        for m in _ENTRY_ARRAY.finditer(part):
            on_host = _HOST_MEMORY_SPACE in (m.group(3) or "")
            nbytes = _dtype_bytes(m.group(1)) * math.prod(int(d) for d in m.group(2).split(",") if d)
            if key == "argument":
                host_param_bytes.append(nbytes if on_host else 0.0)
            found[key] += nbytes if on_host else 0.0
    for m in _ALIAS.finditer(_braced(header, "input_output_alias")):
        p = int(m.group(1))
        found["alias"] += host_param_bytes[p] if p < len(host_param_bytes) else 0.0
    return found


def flops(compiled: Any) -> float:
    """Per-device flops of one step as ``compiled.cost_analysis()`` counts them.

    A ``while`` body is counted once there; :func:`autoshard.hlo_schedule.estimate_step_time` corrects
    for the matmuls inside loops.
    """
    ca = compiled.cost_analysis()
    if ca is None:
        return 0.0
    if isinstance(ca, dict):
        ca = [ca]
    return float(sum(float(d.get("flops", 0.0) or 0.0) for d in ca if d))


def permutes_in_branches(compiled_or_text: Any) -> list[str]:
    """The collective-permutes a ``conditional`` branch runs (directly or through what it calls).

    In an SPMD program whose branch index differs between devices (a pipeline's ``lax.switch`` on the
    stage), such a permute waits for devices that never reach it: XLA:CPU's rendezvous counts every
    device of the program, and XLA:GPU acquires its clique over them all. Returns their names.
    """
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    comps, _, _ = _parse_module(text)
    todo = [callee for instrs in comps.values() for instr in instrs if instr.opcode == "conditional"
            for role, callee in _callees(instr) if role in ("branch_computations", "true_computation",
                                                              "false_computation")]
    seen: set[str] = set()
    found = []
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for instr in comps[c]:
            if instr.opcode.startswith("collective-permute") and instr.opcode != "collective-permute-done":
                found.append(instr.name)
            todo.extend(callee for _, callee in _callees(instr))
    return sorted(found)
