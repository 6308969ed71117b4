"""Reports on a :class:`~autoshard.Plan`: an HTML view for notebooks, rich tables, PNG figures.

All three show the same three things:

- every argument leaf (parameters, optimizer state, inputs): pytree path, shape, spec, bytes per device;
- the predicted step time, split into compute and one bar per collective kind;
- predicted peak memory per device, against the memory budget when it is known.

The cost model prices each collective when it solves, but a ``Plan`` keeps only the
collectives and their bytes, not their seconds. The per-kind times shown here therefore
split ``plan.cost.communication_seconds`` in proportion to each kind's bytes
(:func:`time_breakdown`): exact in total, approximate per kind (latency terms and
per-axis bandwidths are spread evenly over bytes).

rich and matplotlib are optional: :func:`plan_html` needs neither, :func:`rich_summary`
needs rich, :func:`visualize` needs matplotlib.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import io
import math
import re
from collections.abc import Callable
from typing import Any

from autoshard.collectives import CollectiveKind
from autoshard.spec import dtype_itemsize

KIND_ORDER = tuple(k.value for k in CollectiveKind)  # the order tables list collectives in
COLORS = {
    "compute": "#4c72b0",
    "all-reduce": "#dd8452",
    "all-gather": "#55a868",
    "reduce-scatter": "#c44e52",
    "all-to-all": "#8172b3",
    "collective-permute": "#937860",
    "communication": "#da8bc3",
    "arguments": "#4c72b0",
    "activations": "#8c8c8c",
    "budget": "#c44e52",
}
PART_COLORS = {
    "arguments": "#4c72b0",
    "parameters": "#4c72b0",
    "optimizer state": "#64b5cd",
    "inputs": "#55a868",
    "outputs": "#ccb974",
    "intermediates": "#8c8c8c",
    "activations and temporaries": "#8c8c8c",
}
ROLES = ("parameter", "optimizer state", "model state", "rng key", "input", "other")


class Report:
    """The report surface of every plan a user can get back (:class:`~autoshard.Plan`,
    :class:`~autoshard.pipeline.PipelinePlan`): ``summary()``, ``_repr_html_`` (Jupyter),
    ``visualize(path)``, ``to_json``/``from_json`` and ``verify``.

    A plan type defines ``summary``, ``html``, ``figure``, ``to_json``, ``from_json`` and ``verify``;
    the notebook view and the PNG come from here, the same for all of them."""

    __slots__ = ()

    def summary(self) -> str:  # pragma: no cover - every plan type defines it
        raise NotImplementedError

    def html(self) -> str:  # pragma: no cover
        raise NotImplementedError

    def figure(self, *, budget: float | None = None):  # pragma: no cover
        raise NotImplementedError

    def to_json(self) -> str:  # pragma: no cover
        raise NotImplementedError

    def _repr_html_(self) -> str:
        """Jupyter's view: :meth:`html`."""
        return self.html()

    def visualize(self, path=None, *, budget: float | None = None, dpi: int = 100):
        """Draw the plan (:meth:`figure`, a ``matplotlib.figure.Figure``) and, with ``path``, save it as a PNG."""
        fig = self.figure(budget=budget)
        if path is not None:
            fig.savefig(path, dpi=dpi, format="png", facecolor="white")
        return fig


@dataclasses.dataclass(frozen=True, slots=True)
class LeafRow:
    """One argument leaf of a plan."""

    path: str
    role: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    bytes_per_device: int
    bytes_total: int


def leaf_rows(plan) -> list[LeafRow]:
    """Every argument leaf with its role, spec and bytes per device (and unsharded)."""
    rows = []
    roles = tuple(getattr(plan, "in_roles", ()))
    for i, (path, shape, dtype, spec, nbytes) in enumerate(plan.parameter_table()):
        total = math.prod(shape) * dtype_itemsize(dtype)
        rows.append(LeafRow(path, leaf_role(roles[i] if roles else "other"), shape, dtype, spec, nbytes, int(total)))
    return rows


def leaf_role(role: str) -> str:
    """The label of a role the planner classified (``Plan.in_roles``, see :mod:`autoshard.roles`):
    ``optimizer_state`` reads "optimizer state"."""
    return role.replace("_", " ")


def time_breakdown(plan) -> dict[str, float]:
    """Predicted seconds per step: ``compute``, then one entry per collective kind.

    ``plan.cost.communication_seconds`` is split over the kinds in proportion to their bytes,
    because a plan does not keep the cost model's seconds per collective. With no bytes at
    all, the communication time appears as one ``communication`` entry.
    """
    cost = plan.cost
    out = {"compute": float(cost.compute_seconds)}
    by_kind = plan.predicted_bytes_by_kind()
    total = sum(by_kind.values())
    if total > 0:
        for kind in sorted(by_kind, key=_kind_rank):
            if by_kind[kind] > 0:
                out[kind] = float(cost.communication_seconds) * by_kind[kind] / total
    elif cost.communication_seconds > 0:
        out["communication"] = float(cost.communication_seconds)
    return out


def memory_breakdown(plan, budget: float | None = None) -> dict:
    """Per-device bytes: ``peak`` (predicted), ``arguments`` (state + inputs in device memory),
    ``budget`` (or None), ``host`` (offloaded state in host memory), and ``parts``: what makes up the peak.

    ``parts`` is the plan's own breakdown at the peak (``plan.memory.breakdown``: parameters,
    optimizer state, inputs, outputs, intermediates) when planning recorded one; otherwise the
    arguments and the rest of the peak. ``budget`` defaults to ``plan.stats["memory_budget"]``.
    """
    host_inputs = set(getattr(plan, "host_inputs", ()))
    args = float(sum(r[4] for i, r in enumerate(plan.parameter_table()) if i not in host_inputs))
    peak = float(plan.cost.peak_memory_bytes)
    if budget is None:
        budget = plan.stats.get("memory_budget") if isinstance(plan.stats, dict) else None
    estimate = getattr(plan, "memory", None)
    breakdown = getattr(estimate, "breakdown", None)
    if breakdown:
        parts = {k.replace("_", " "): float(v) for k, v in breakdown.items() if v}
    else:
        parts = {"arguments": min(args, peak), "activations and temporaries": max(peak - args, 0.0)}
    host = float(getattr(estimate, "host_bytes", 0.0) or 0.0)
    return {"peak": peak, "arguments": args, "budget": None if budget is None else float(budget), "parts": parts,
            "host": host}


def collective_rows(plan) -> list[tuple[str, str, int, float]]:
    """(kind, mesh axes, count per step, bytes per device per step), costliest first."""
    info = plan.mesh_info
    agg: dict[tuple[str, str], list[float]] = {}
    for col, times in plan.collectives:
        key = (col.kind, ",".join(info.names[a] for a in col.axes))
        e = agg.setdefault(key, [0, 0.0])
        e[0] += times
        e[1] += col.bytes * times
    return [(k, a, int(n), b) for (k, a), (n, b) in sorted(agg.items(), key=lambda kv: -kv[1][1])]


# ---------------------------------------------------------------------------------------------------
# HTML


def plan_html(plan, *, budget: float | None = None, max_rows: int | None = None) -> str:
    """A self-contained HTML report (inline styles, no scripts): what ``Plan._repr_html_`` shows.

    The leaf table lists every argument leaf (``max_rows`` caps it) inside a ``<details>`` block.
    """
    info = plan.mesh_info
    cost = plan.cost
    mesh = " × ".join(f"{n} <b>{html.escape(a)}</b>" for a, n in zip(info.names, info.shape, strict=True))
    parts = [
        '<div class="autoshard-plan" style="font-family: sans-serif; font-size: 13px; max-width: 60em">',
        f"<div><b>autoshard plan</b> on mesh {mesh} ({info.size} devices)</div>",
        f"<div>predicted step {format_ms(cost.total_seconds)} = compute {format_ms(cost.compute_seconds)} + communication "
        f"{format_ms(cost.communication_seconds)} ({_fmt_bytes(cost.communication_bytes)}/device); peak memory "
        f"{_fmt_bytes(cost.peak_memory_bytes)}/device</div>",
        _html_time(plan),
        _html_memory(memory_breakdown(plan, budget)),
        _html_collectives(plan),
        _html_leaves(leaf_rows(plan), max_rows),
    ]
    if plan.warnings:
        parts.append("<div>replicated for lack of a rule: " + html.escape(", ".join(plan.warnings)) + "</div>")
    parts.append("</div>")
    return "\n".join(parts)


def bar_html(fraction: float, color: str, label: str) -> str:
    """An inline HTML bar, ``fraction`` of 24em filled with ``color``."""
    width = max(0.0, min(1.0, fraction)) * 100
    return (f'<div style="background: #eee; width: 24em; height: 1em; display: inline-block; vertical-align: middle">'
            f'<div style="background: {color}; width: {width:.2f}%; height: 100%" title="{html.escape(label)}">'
            "</div></div>")


def _html_time(plan) -> str:
    parts = time_breakdown(plan)
    total = sum(parts.values()) or 1.0
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td style='text-align: right'>{format_ms(v)}</td>"
        f"<td>{bar_html(v / total, COLORS.get(k, '#999'), k)}</td></tr>"
        for k, v in parts.items())
    return ("<h4 style='margin: 0.8em 0 0.2em'>Predicted time per step</h4>"
            f"<table>{rows}</table>"
            "<div style='color: #666'>Per-kind communication time is the plan's total communication time "
            "split in proportion to each kind's bytes.</div>")


def _html_memory(mem: dict) -> str:
    peak, budget = mem["peak"], mem["budget"]
    scale = max(peak, mem["arguments"], budget or 0.0) or 1.0
    rows = [f"<tr><td>predicted peak</td><td style='text-align: right'>{_fmt_bytes(peak)}</td>"
            f"<td>{_stacked(mem['parts'], scale)}</td></tr>"]
    rows += [f"<tr><td style='padding-left: 1.5em'>{html.escape(k)}</td><td style='text-align: right'>"
             f"{_fmt_bytes(v)}</td><td>{bar_html(v / scale, _part_color(k), k)}</td></tr>" for k, v in mem["parts"].items()]
    if budget is not None:
        rows.append(f"<tr><td>budget</td><td style='text-align: right'>{_fmt_bytes(budget)}</td>"
                    f"<td>{bar_html(budget / scale, COLORS['budget'], 'budget')}</td></tr>")
    if mem.get("host"):
        rows.append(f"<tr><td>host memory (offloaded)</td><td style='text-align: right'>{_fmt_bytes(mem['host'])}"
                    "</td><td></td></tr>")
    note = "" if budget is not None else "<div style='color: #666'>memory budget: not given</div>"
    return f"<h4 style='margin: 0.8em 0 0.2em'>Memory per device</h4><table>{''.join(rows)}</table>{note}"


def _stacked(parts: dict, scale: float) -> str:
    segments = "".join(
        f'<div style="background: {_part_color(k)}; width: {max(0.0, min(1.0, v / scale)) * 100:.2f}%; '
        f'height: 100%; display: inline-block" title="{html.escape(k)}"></div>' for k, v in parts.items())
    return ('<div style="background: #eee; width: 24em; height: 1em; display: inline-block; vertical-align: '
            f'middle; white-space: nowrap; overflow: hidden">{segments}</div>')


def _part_color(part: str) -> str:
    return PART_COLORS.get(part, COLORS["activations"])


def _html_collectives(plan) -> str:
    rows = collective_rows(plan)
    if not rows:
        return "<div>no collectives</div>"
    body = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(a)}</td><td style='text-align: right'>{n}</td>"
                   f"<td style='text-align: right'>{_fmt_bytes(b)}</td></tr>" for k, a, n, b in rows)
    return ("<h4 style='margin: 0.8em 0 0.2em'>Collectives</h4><table><tr><th>kind</th><th>mesh axes</th>"
            f"<th>count</th><th>bytes/device</th></tr>{body}</table>")


def _html_leaves(rows: list[LeafRow], max_rows: int | None) -> str:
    shown = rows if max_rows is None else rows[:max_rows]
    body = "".join(
        f"<tr><td><code>{html.escape(r.path)}</code></td><td>{r.role}</td><td>{r.shape}</td>"
        f"<td>{html.escape(r.dtype)}</td><td><code>{html.escape(r.spec)}</code></td>"
        f"<td style='text-align: right'>{_fmt_bytes(r.bytes_per_device)}</td></tr>" for r in shown)
    more = f"<tr><td colspan=6>... and {len(rows) - len(shown)} more</td></tr>" if len(shown) < len(rows) else ""
    total = sum(r.bytes_per_device for r in rows)
    return (f"<details><summary><b>{len(rows)} argument leaves</b>, {_fmt_bytes(total)}/device</summary>"
            "<table><tr><th>path</th><th>role</th><th>shape</th><th>dtype</th><th>spec</th><th>bytes/device</th>"
            f"</tr>{body}{more}</table></details>")


# ---------------------------------------------------------------------------------------------------
# rich


def rich_summary(plan, *, max_rows: int = 40, width: int = 110, color: bool | None = None,
                 budget: float | None = None) -> str:
    """The plan as rich tables, rendered to a string (ANSI colours when ``color``; default: a terminal)."""
    import sys

    from rich.console import Console

    if color is None:
        color = sys.stdout.isatty()
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=color, color_system="auto" if color else None)
    for renderable in rich_renderables(plan, max_rows=max_rows, budget=budget):
        console.print(renderable)
    return buf.getvalue().rstrip("\n")


def rich_renderables(plan, *, max_rows: int = 40, budget: float | None = None) -> list:
    """The rich objects :func:`rich_summary` prints: header, time, memory, collectives, leaves."""
    from rich.table import Table
    from rich.text import Text

    info = plan.mesh_info
    cost = plan.cost
    header = Text.assemble(
        ("autoshard plan", "bold"), f" on mesh {dict(zip(info.names, info.shape, strict=True))}\n",
        f"predicted step {format_ms(cost.total_seconds)} = compute {format_ms(cost.compute_seconds)} + communication "
        f"{format_ms(cost.communication_seconds)} ({_fmt_bytes(cost.communication_bytes)}/device)")
    out: list = [header]
    if plan.stats.get("timings"):
        out.append(Text("planning: " + ", ".join(f"{k} {v:.2f}s" for k, v in plan.stats["timings"].items()),
                        style="dim"))

    parts = time_breakdown(plan)
    total = sum(parts.values()) or 1.0
    t = Table(title="time per step", caption="communication split over kinds by bytes", title_justify="left",
              caption_justify="left")
    t.add_column("part")
    t.add_column("time", justify="right")
    t.add_column("share")
    for k, v in parts.items():
        t.add_row(k, format_ms(v), Text("█" * max(1, round(30 * v / total)) if v else "", style=COLORS.get(k)))
    out.append(t)

    mem = memory_breakdown(plan, budget)
    m = Table(title="memory per device", title_justify="left")
    m.add_column("")
    m.add_column("bytes", justify="right")
    m.add_row("predicted peak", _fmt_bytes(mem["peak"]))
    for part, nbytes in mem["parts"].items():
        m.add_row(f"  {part}", _fmt_bytes(nbytes))
    m.add_row("budget", "not given" if mem["budget"] is None else _fmt_bytes(mem["budget"]))
    if mem.get("host"):
        m.add_row("host memory (offloaded)", _fmt_bytes(mem["host"]))
    out.append(m)

    rows = collective_rows(plan)
    if rows:
        c = Table(title="collectives", title_justify="left")
        for name, justify in (("kind", "left"), ("mesh axes", "left"), ("count", "right"), ("bytes/device", "right")):
            c.add_column(name, justify=justify)
        for k, a, n, b in rows[:10]:
            c.add_row(k, a, str(n), _fmt_bytes(b))
        out.append(c)

    leaves = leaf_rows(plan)
    p = Table(title=f"{len(leaves)} argument leaves", title_justify="left")
    for name, justify in (("path", "left"), ("role", "left"), ("shape", "left"), ("spec", "left"),
                          ("bytes/device", "right")):
        p.add_column(name, justify=justify, overflow="fold")
    for r in leaves[:max_rows]:
        p.add_row(r.path, r.role, str(r.shape), r.spec, _fmt_bytes(r.bytes_per_device))
    if len(leaves) > max_rows:
        p.add_row(f"... and {len(leaves) - max_rows} more", "", "", "", "")
    out.append(p)
    if plan.warnings:
        out.append(Text("replicated for lack of a rule: " + ", ".join(plan.warnings), style="yellow"))
    return out


# ---------------------------------------------------------------------------------------------------
# matplotlib


def plan_figure(plan, *, budget: float | None = None, top: int = 12):
    """A ``matplotlib.figure.Figure`` with three panels: time per step, memory per device, largest leaves.

    Made without pyplot, so it touches no global matplotlib state; it still shows itself in a
    notebook (as a PNG).
    """
    fig = figure_class()(figsize=(17, 4.2), layout="constrained")
    ax_time, ax_mem, ax_role, ax_leaf = fig.subplots(1, 4, width_ratios=(1.1, 0.7, 1.0, 1.6))
    rows = leaf_rows(plan)
    _plot_time(ax_time, plan)
    _plot_memory(ax_mem, memory_breakdown(plan, budget))
    _plot_roles(ax_role, rows)
    params = [r for r in rows if r.role == "parameter"]
    _plot_leaves(ax_leaf, params or rows, top, "parameters" if params else "argument leaves")
    info = plan.mesh_info
    fig.suptitle(f"autoshard plan on mesh {dict(zip(info.names, info.shape, strict=True))}: "
                 f"{format_ms(plan.cost.total_seconds)} per step, peak {_fmt_bytes(plan.cost.peak_memory_bytes)}/device")
    return fig


def visualize(plan, path=None, *, budget: float | None = None, dpi: int = 100):
    """Draw the plan (its ``figure()``: :func:`plan_figure`, :func:`pipeline_figure`) and, with ``path``,
    save it as a PNG.

    Args:
      plan: an :class:`autoshard.Plan` or a :class:`~autoshard.pipeline.PipelinePlan`.
      path: a file name (``"plan.png"``); None: only return the figure.
      budget: memory budget per device in bytes, drawn as a line (default: what planning recorded).
      dpi: resolution of the PNG.

    Returns:
      The ``matplotlib.figure.Figure``.

    Example:
      >>> fig = autoshard.visualize(plan, "plan.png")    # doctest: +SKIP
    """
    return plan.visualize(path, budget=budget, dpi=dpi)


@functools.cache
def figure_class():
    """A ``matplotlib.figure.Figure`` subclass that shows itself as a PNG in a notebook (no pyplot)."""
    from matplotlib.figure import Figure

    class PlanFigure(Figure):
        """A Figure that IPython displays as a PNG even when pyplot was never imported."""

        def _repr_png_(self) -> bytes:
            buf = io.BytesIO()
            self.savefig(buf, format="png", dpi=100, facecolor="white")
            return buf.getvalue()

    return PlanFigure


def _plot_time(ax, plan) -> None:
    parts = time_breakdown(plan)
    names = list(parts)
    values = [parts[k] * 1e3 for k in names]
    ax.barh(names, values, color=[COLORS.get(k, "#999") for k in names])
    ax.invert_yaxis()
    ax.set_xlabel("predicted ms per step")
    ax.set_title("time (communication split by bytes)", fontsize=10)
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:.3g}", va="center", fontsize=8)
    ax.margins(x=0.25)


def _plot_memory(ax, mem: dict) -> None:
    peak, budget = mem["peak"], mem["budget"]
    unit, scale = _unit(max(peak, budget or 0.0))
    bottom = 0.0
    for part, nbytes in mem["parts"].items():
        ax.bar([0], [nbytes / scale], bottom=[bottom], color=_part_color(part), label=part)
        bottom += nbytes / scale
    if budget is not None:
        ax.axhline(budget / scale, color=COLORS["budget"], linestyle="--", label=f"budget {_fmt_bytes(budget)}")
    ax.set_xticks([0], ["peak per device"])
    ax.set_xlim(-1, 1)
    ax.set_ylabel(unit)
    ax.set_ylim(0, max(peak, budget or 0.0) / scale * 1.6 or 1)
    ax.set_title("memory" + ("" if budget is not None else " (budget not given)"), fontsize=10)
    ax.legend(fontsize=7, loc="upper right")


def _plot_roles(ax, rows: list[LeafRow]) -> None:
    roles = [role for role in ROLES if any(r.role == role for r in rows)]
    total = {role: sum(r.bytes_total for r in rows if r.role == role) for role in roles}
    per_device = {role: sum(r.bytes_per_device for r in rows if r.role == role) for role in roles}
    unit, scale = _unit(max(total.values(), default=0))
    y = range(len(roles))
    ax.barh(y, [total[k] / scale for k in roles], color="#dddddd", label="unsharded")
    ax.barh(y, [per_device[k] / scale for k in roles], color=COLORS["arguments"], label="per device")
    ax.set_yticks(list(y), roles)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title("argument bytes by role", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")


def _plot_leaves(ax, rows: list[LeafRow], top: int, what: str) -> None:
    rows = sorted(rows, key=lambda r: -r.bytes_total)[:top]
    if not rows:
        ax.set_axis_off()
        return
    unit, scale = _unit(max(r.bytes_total for r in rows))
    labels = [f"{_short(r.path)}  {r.spec}" for r in rows]
    y = range(len(rows))
    ax.barh(y, [r.bytes_total / scale for r in rows], color="#dddddd", label="unsharded")
    ax.barh(y, [r.bytes_per_device / scale for r in rows], color=COLORS["arguments"], label="per device")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(f"largest {len(rows)} {what} and their specs", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")


def _short(path: str, n: int = 38) -> str:
    text = re.sub(r"[\[\]']+", ".", path).strip(".").replace("..", ".")
    return text if len(text) <= n else "…" + text[-(n - 1):]


def _unit(n: float) -> tuple[str, float]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return unit, float(scale)
    return "B", 1.0


# ---------------------------------------------------------------------------------------------------
# progress


def planning_progress(progress) -> Callable[[str, int, int], None] | None:
    """``parallelize(progress=...)`` as a ``callback(stage, done, total)``, or None when silent.

    ``"auto"`` draws a bar only in a terminal or a notebook; a callable is used as it is."""
    if progress is None or progress is False or callable(progress):
        return progress or None
    if progress == "auto":
        import sys

        interactive = "ipykernel" in sys.modules or (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
        if not interactive:
            return None
    return progress_callback(progress)


def progress_callback(kind: str | None = "auto") -> Callable[[str, int, int], None] | None:
    """A ``callback(stage, done, total)`` that draws planning progress, or None when silenced.

    ``kind``: ``"tqdm"``, ``"rich"``, ``"auto"`` (tqdm if installed, else rich, else None) or None
    (silent). The callback is what a planner calls after each unit of work (a pass, a candidate
    mesh); ``done == total`` closes the bar.
    """
    if kind is None or kind is False:
        return None
    if kind in ("auto", "tqdm"):
        try:
            from tqdm.auto import tqdm
        except ImportError:
            if kind == "tqdm":
                raise
        else:
            return _TqdmProgress(tqdm)
    if kind in ("auto", "rich"):
        try:
            import rich.progress  # noqa: F401
        except ImportError:
            if kind == "rich":
                raise
            return None
        return _RichProgress()
    raise ValueError(f"progress kind must be 'auto', 'tqdm', 'rich' or None, got {kind!r}")


class _TqdmProgress:
    def __init__(self, tqdm):
        self._tqdm = tqdm
        self._bar = None

    @property
    def is_open(self) -> bool:
        """Whether a bar is drawn (between the first call and ``done == total``)."""
        return self._bar is not None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self._bar is None:
            self._bar = self._tqdm(total=total, desc="autoshard", leave=False)
        self._bar.total = total
        self._bar.set_description(f"autoshard: {stage}")
        self._bar.n = done
        self._bar.refresh()
        if done >= total:
            self._bar.close()
            self._bar = None


class _RichProgress:
    def __init__(self):
        self._progress: Any = None
        self._task = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        from rich.progress import Progress

        if self._progress is None:
            self._progress = Progress(transient=True)
            self._progress.start()
            self._task = self._progress.add_task("autoshard", total=total)
        self._progress.update(self._task, completed=done, total=total, description=f"autoshard: {stage}")
        if done >= total:
            self._progress.stop()
            self._progress = None


# ---------------------------------------------------------------------------------------------------


def _kind_rank(kind: str) -> int:
    return KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)


def format_ms(seconds: float) -> str:
    """Seconds as milliseconds, ``"1.234 ms"``."""
    return f"{seconds * 1e3:.3f} ms"


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.50 KiB"``: bytes in binary units, as every report prints them."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


_fmt_bytes = format_bytes
