"""``Plan.explain(path)``: why an argument leaf has its layout.

The chosen layout is compared with every other layout the leaf could take: for each, the step is
planned again with the leaf pinned to it (the pinned-spec mechanism that ``hints=`` uses), and the
table lists the best predicted step of each. The leaves of the same shape that belong to it (its
optimizer moments: ``opt_state ... mu[...]`` for ``params[...]``) are shown with their layout in
each plan, so a kernel kept whole while its moments are split reads as what it is: ZeRO-1.

The re-planning needs the captured program, which a plan keeps only in the process that planned it
(:func:`autoshard.driver.plan` stores a function on the plan; JSON does not carry it).
"""

from __future__ import annotations

import dataclasses
import difflib
import html
import re
import warnings

from jax.sharding import PartitionSpec

from autoshard.errors import AutoshardError, PlanError
from autoshard.spec import ShardingSpec, candidate_specs

_SEGMENT = re.compile(r"\[[^\]]*\]|\.[A-Za-z_]\w*")
_REPLICATED = str(PartitionSpec())
TIE = 1e-5
"""Relative step difference below which two layouts tie: the planner's tie-break nudges (intent.TIE_BREAK) add
about 1e-7 of the step per leaf."""


@dataclasses.dataclass(frozen=True, slots=True)
class LayoutOption:
    """One layout of the explained leaf and the best plan found with it.

    Attributes:
      spec: the leaf's layout, as a ``PartitionSpec`` string.
      objective: that plan's predicted step in seconds (what the planner minimises); None when no
        plan with this layout was found (``note`` says why).
      delta: ``objective`` minus the chosen plan's; 0 for the chosen layout.
      related: ``(path, spec)`` of the leaf's optimizer-state leaves in that plan.
      chosen: whether this is the plan's own layout.
      note: why no plan was found, or other remarks.
    """

    spec: str
    objective: float | None
    delta: float | None
    related: tuple[tuple[str, str], ...] = ()
    chosen: bool = False
    note: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Explanation:
    """Why an argument leaf has its layout: the chosen layout against each alternative.

    ``str()`` gives a table; in Jupyter it renders as HTML.

    Attributes:
      path: the leaf's pytree path (as in ``plan.in_paths``).
      shape, dtype: the leaf's.
      options: the chosen layout first, then the alternatives from cheapest to dearest.
      verdict: one or two sentences: what the table shows (e.g. ZeRO-1 by choice).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    options: tuple[LayoutOption, ...]
    verdict: str

    @property
    def chosen(self) -> LayoutOption:
        return self.options[0]

    @property
    def alternatives(self) -> tuple[LayoutOption, ...]:
        return self.options[1:]

    def __str__(self) -> str:
        related = [p for p, _ in self.chosen.related]
        rows = [["layout", "predicted step", "delta", *related]]
        for o in self.options:
            step = _ms(o.objective) if o.objective is not None else "—"
            delta = "chosen" if o.chosen else _delta(o.delta, self.chosen.objective)
            rows.append([o.spec, step, delta, *_related_specs(o, related)])
        widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
        lines = [f"why {self.path} {self.shape} {self.dtype} has layout {self.chosen.spec}"]
        for n, r in enumerate(rows):
            mark = "* " if n == 1 else "  "
            cells = [c.rjust(w) if k in (1, 2) else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths, strict=True))]
            note = self.options[n - 1].note if n else ""
            lines.append((mark + "   ".join(cells)).rstrip() + (f"   ({note})" if note else ""))
        lines.append(self.verdict)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        related = [p for p, _ in self.chosen.related]
        head = "".join(_html_cell(h, "th") for h in ("layout", "predicted step", "delta", *related, ""))
        rows = []
        for o in self.options:
            step = _ms(o.objective) if o.objective is not None else "—"
            delta = "chosen" if o.chosen else _delta(o.delta, self.chosen.objective)
            cells = [_html_cell(o.spec, code=True), _html_cell(step, right=True), _html_cell(delta, right=True),
                     *(_html_cell(spec, code=True) for spec in _related_specs(o, related)), _html_cell(o.note)]
            rows.append(f'<tr style="{"font-weight: bold" if o.chosen else ""}">{"".join(cells)}</tr>')
        return ('<div class="autoshard-explain" style="font-family: sans-serif; font-size: 13px">'
                f"<div>why <code>{html.escape(self.path)}</code> {self.shape} {html.escape(self.dtype)} has layout "
                f"<code>{html.escape(self.chosen.spec)}</code></div>"
                f'<table style="border-collapse: collapse"><tr>{head}</tr>{"".join(rows)}</table>'
                f"<div>{html.escape(self.verdict)}</div></div>")


def _html_cell(text: str, tag: str = "td", *, right: bool = False, code: bool = False) -> str:
    body = f"<code>{html.escape(text)}</code>" if code else html.escape(text)
    return f'<{tag} style="padding: 2px 8px; text-align: {"right" if right else "left"}">{body}</{tag}>'


def explain(plan, path: str, *, layouts=None) -> Explanation:
    """Why ``path``'s leaf has its layout in ``plan``: see :meth:`autoshard.Plan.explain`."""
    replan = plan.replan
    if replan is None:
        raise PlanError(
            "this plan cannot be explained: explain() plans the step again with the leaf pinned, and this plan "
            "has no program to plan (it was loaded with Plan.from_json, or passed as parallelize(plan=...)). "
            "Fix: plan in this process, e.g. step.plan(*args).explain(path), with parallelize(...) and no plan=.")
    i = resolve_path(plan.in_paths, path, plan.out_paths)
    path = plan.in_paths[i]
    shape, dtype = tuple(plan.in_avals[i][0]), str(plan.in_avals[i][1])
    info = plan.mesh_info
    chosen = plan.in_specs[i]
    specs = _layouts(shape, info, layouts)
    related = _related(plan.in_paths, plan.in_avals, i)

    def option(p, spec):
        rel = tuple((plan.in_paths[j], _pspec(p.in_specs[j], info)) for j in related)
        return LayoutOption(_pspec(spec, info), p.cost.objective, p.cost.objective - plan.cost.objective, rel,
                            spec == chosen)

    options = [option(plan, chosen)]
    for spec in specs:
        if spec == chosen:
            continue
        pin = {"^" + re.escape(path) + "$": spec.to_partition_spec(info)}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the plan's own warnings were given when it was made
                alt = replan(pin)
        except AutoshardError as e:  # InfeasibleError (the budget), MeshError (a hint it contradicts)
            options.append(LayoutOption(_pspec(spec, info), None, None, (), False, _first_line(e)))
            continue
        options.append(option(alt, spec))
    options[1:] = sorted(options[1:], key=lambda o: (o.objective is None, o.objective or 0.0))
    return Explanation(path, shape, dtype, tuple(options), _verdict(path, options))


def resolve_path(in_paths, query: str, out_paths=()) -> int:
    """The index of the one argument leaf ``query`` names: an exact path, else a unique substring
    or regex match. Raises PlanError listing the candidates."""
    if query in in_paths:
        return in_paths.index(query)
    matched = [k for k, p in enumerate(in_paths) if query in p]
    if len(matched) != 1:  # paths are full of brackets: a substring first, then a regex
        try:
            rx = re.compile(query)
            matched = [k for k, p in enumerate(in_paths) if rx.search(p)] or matched
        except re.error:
            pass
    if len(matched) == 1:
        return matched[0]
    if matched:
        shown = "\n  ".join(in_paths[k] for k in matched[:12])
        more = f"\n  ... and {len(matched) - 12} more" if len(matched) > 12 else ""
        raise PlanError(f"{query!r} matches {len(matched)} argument leaves:\n  {shown}{more}\n"
                        f"Fix: pass one exact path, e.g. plan.explain({in_paths[matched[0]]!r}).")
    close = difflib.get_close_matches(query, in_paths, n=5, cutoff=0.4)
    where = " It is an output path: explain() takes argument leaves (plan.in_paths)." if query in out_paths else ""
    hint = ("\n  " + "\n  ".join(close)) if close else " (none close; plan.in_paths lists them all)"
    raise PlanError(f"{query!r} names no argument leaf of this plan.{where} Close matches:{hint}\n"
                    f"Fix: pass a path from plan.in_paths, or a regex that matches exactly one.")


def _layouts(shape, info, layouts) -> tuple[ShardingSpec, ...]:
    if layouts is None:
        return candidate_specs(tuple(shape), info)
    out = []
    for p in layouts:
        try:
            spec = ShardingSpec.from_partition_spec(p, len(shape), info)
        except ValueError as e:
            raise PlanError(f"layout {p} cannot be explained: {e}. Fix: name axes of the plan's mesh "
                            f"{info.names}.") from None
        if any(n % info.axes_size(d) for n, d in zip(shape, spec.dims, strict=True)):
            raise PlanError(f"layout {p} does not divide shape {tuple(shape)} on mesh "
                            f"{dict(zip(info.names, info.shape, strict=True))}. Fix: pass layouts that divide it.")
        out.append(spec)
    return tuple(out)


def _segments(path: str) -> list[str]:
    return _SEGMENT.findall(path)


def _related(in_paths, in_avals, i: int) -> tuple[int, ...]:
    """Other leaves of the same shape whose path ends like this one's below its top two keys
    (``[0]['opt_state'][0].mu['w']`` for ``[0]['params']['w']``): its optimizer state."""
    tail = _segments(in_paths[i])[2:]
    if not tail:
        return ()
    shape = tuple(in_avals[i][0])
    return tuple(j for j, p in enumerate(in_paths)
                 if j != i and tuple(in_avals[j][0]) == shape and _segments(p)[-len(tail):] == tail)


def _verdict(path: str, options: list[LayoutOption]) -> str:
    chosen, rest = options[0], [o for o in options[1:] if o.objective is not None]
    lines = []
    split_state = [(p, s) for p, s in chosen.related if s != _REPLICATED]
    if chosen.spec == _REPLICATED and split_state:
        lines.append(f"ZeRO-1 by choice: {path} is kept whole on every device while its optimizer state is split "
                     f"({', '.join(f'{_short(p)} {s}' for p, s in split_state)}): the moments are split, and "
                     "the parameter stays replicated for the forward and backward passes.")
    if not rest:
        lines.append("No other layout could be planned." if len(options) > 1 else
                     "The leaf has no other layout on this mesh.")
        return " ".join(lines)
    best = rest[0]
    if best.delta is not None and best.delta < 0 and not _ties(best.delta, chosen.objective):
        lines.append(f"Pinned to {best.spec}, the solver found a cheaper step ({_delta(best.delta, chosen.objective)}): "
                     "the original solve stopped before proving optimality (raise solver_time_limit).")
    elif _ties(best.delta, chosen.objective):
        lines.append(f"{best.spec} predicts the same step: the planner breaks such ties toward what the mesh axis "
                     "names say (a batch axis carries the batch, model axes split parameters).")
    else:
        lines.append(f"The next best layout, {best.spec}, predicts a step {_delta(best.delta, chosen.objective)} "
                     "slower.")
    return " ".join(lines)


def _related_specs(option: LayoutOption, paths) -> list[str]:
    specs = dict(option.related)
    return [specs.get(p, "—") for p in paths]


def _pspec(spec: ShardingSpec, info) -> str:
    return str(spec.to_partition_spec(info))


def _short(path: str) -> str:
    return path if len(path) <= 24 else "…" + path[-23:]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4f} ms"


def _ties(delta: float | None, base: float | None) -> bool:
    """Within the planner's tie-break nudges (autoshard/intent.py), far below any real difference."""
    return delta is not None and abs(delta) <= TIE * abs(base or 0.0)


def _delta(delta: float | None, base: float | None) -> str:
    if delta is None:
        return "—"
    if _ties(delta, base):
        return "tie"
    rel = f" ({delta / base:+.2%})" if base else ""
    return f"{delta * 1e3:+.4f} ms{rel}"


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0]}"
