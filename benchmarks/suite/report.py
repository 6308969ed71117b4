"""Tables, plots and a progress bar for the benchmark results (plain dicts, as written to JSON)."""

from __future__ import annotations

import sys
import time

from benchmarks.suite.cases import BASELINES, METHOD_LABELS, METHODS


class Progress:
    """tqdm when it is installed, else one line per step on stderr."""

    def __init__(self, total: int, desc: str = "benchmarks"):
        self.total, self.n, self.t0 = total, 0, time.perf_counter()
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)

    def update(self, label: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(label[:60])
            self.bar.update(1)
        else:
            print(
                f"[{self.n}/{self.total} {time.perf_counter() - self.t0:6.0f}s] {label}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _ms(s) -> str:
    return "—" if s is None else f"{s * 1e3:.2f}"


def _gb(b) -> str:
    return "—" if b is None else f"{b / 2**30:.1f}"


def _mesh(m) -> str:
    return "—" if not m else f"{m[0]}×{m[1]}"


def grouped(rows: list[dict]) -> dict[tuple[str, str], dict[str, dict]]:
    """``{(model, preset): {method: row}}`` in suite order."""
    out: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        out.setdefault((r["model"], r["preset"]), {})[r["method"]] = r
    return out


def best_baseline(methods: dict[str, dict]) -> dict | None:
    """The fastest baseline that compiled and fits in memory."""
    fits = [methods[m] for m in BASELINES if m in methods and methods[m]["status"] == "ok"]
    return min(fits, key=lambda r: r["step_time_s"], default=None)


def comparisons(rows: list[dict]) -> list[dict]:
    """Per (model, preset): autoshard's step time against the best baseline's."""
    out = []
    for (model, preset), methods in grouped(rows).items():
        auto, best = methods.get("autoshard"), best_baseline(methods)
        ok = auto is not None and auto["status"] == "ok"
        out.append(
            {
                "model": model,
                "preset": preset,
                "best_baseline": None if best is None else best["method"],
                "best_baseline_s": None if best is None else best["step_time_s"],
                "autoshard_s": auto["step_time_s"] if ok else None,
                "speedup": best["step_time_s"] / auto["step_time_s"] if ok and best else None,
                "autoshard_oom_while_baseline_fits": bool(auto and auto["status"] == "oom" and best),
            }
        )
    return out


def _cell(r: dict | None) -> str:
    if r is None:
        return "—"
    if r["status"] == "error":
        return "error"
    text = _ms(r["step_time_s"])
    if r["method"] in ("megatron", "autoshard"):
        text += f" ({_mesh(r['mesh'])})"
    return text + (" **OOM**" if r["oom"] else "")


def step_time_table(rows: list[dict]) -> str:
    """Estimated step time (ms) per method; the last column is best baseline ÷ autoshard."""
    head = [
        "model",
        "params",
        "batch",
        "preset",
        *(METHOD_LABELS[m] for m in METHODS),
        "best baseline ÷ autoshard",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    speed = {(c["model"], c["preset"]): c for c in comparisons(rows)}
    for (model, preset), methods in grouped(rows).items():
        any_row = next(iter(methods.values()))
        c = speed[(model, preset)]
        ratio = "—" if c["speedup"] is None else f"{c['speedup']:.2f}× vs {METHOD_LABELS[c['best_baseline']]}"
        cells = [
            model,
            f"{any_row['params'] / 1e6:.0f}M",
            str(any_row["batch"]),
            preset,
            *(_cell(methods.get(m)) for m in METHODS),
            ratio,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail_table(rows: list[dict]) -> str:
    """Per row: flops, communication, memory, compile time."""
    head = [
        "model",
        "preset",
        "method",
        "mesh",
        "TFLOP/dev",
        "compute ms",
        "comm ms",
        "AR/AG/RS/A2A/CP count",
        "comm GiB/dev",
        "peak GiB/dev",
        "compile s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["status"] == "error":
            lines.append(
                f"| {r['model']} | {r['preset']} | {r['method']} | {_mesh(r['mesh'])} | error: "
                f"{(r.get('error') or '')[:80]} |" + " |" * (len(head) - 5)
            )
            continue
        col = r["collectives"]
        counts = "/".join(
            str(col.get(k, {}).get("count", 0))
            for k in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
        )
        lines.append(
            "| "
            + " | ".join(
                [
                    r["model"],
                    r["preset"],
                    METHOD_LABELS[r["method"]],
                    _mesh(r["mesh"]),
                    f"{r['flops_per_device'] / 1e12:.2f}",
                    _ms(r["compute_s"]),
                    _ms(r["communication_s"]),
                    counts,
                    _gb(r["collective_bytes"]),
                    _gb(r["peak_bytes"]) + (" OOM" if r["oom"] else ""),
                    f"{r['compile_s']:.1f}",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def fidelity_table(rows: list[dict]) -> str:
    """autoshard's planning time per pass, XLA compile time, and predicted vs compiled cost."""
    head = [
        "model",
        "preset",
        "mesh",
        "meshes planned",
        "planning s (all meshes)",
        "chosen: capture/strategies/problem/solve s",
        "XLA compile s",
        "comm GiB pred → compiled",
        "peak GiB pred → compiled",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["method"] != "autoshard" or "autoshard" not in r:
            continue
        a = r["autoshard"]
        t = a.get("timings", {})
        passes = "/".join(f"{t.get(k, 0):.1f}" for k in ("capture", "strategies", "problem", "solve"))
        v, p = a.get("verify"), a.get("predicted")
        comm = (
            "—"
            if v is None
            else f"{_gb(v['predicted_bytes'])} → {_gb(v['compiled_bytes'])} ({v['ratio']:.2f}×)"
        )
        peak = (
            "—"
            if p is None or r["status"] == "error"
            else (f"{_gb(p['peak_memory_bytes'])} → {_gb(r['peak_bytes'])} ({a['memory_ratio']:.2f}×)")
        )
        compile_s = f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "—"
        lines.append(
            "| "
            + " | ".join(
                [
                    r["model"],
                    r["preset"],
                    _mesh(r["mesh"]),
                    str(len(a["planning_by_mesh"])),
                    f"{a['planning_s']:.1f}",
                    passes,
                    compile_s,
                    comm,
                    peak,
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def execution_table(records: list[dict]) -> str:
    head = ["model", "method", "preset", "mesh", "losses", "reference", "max rel err", "ok"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in records:
        losses = "error: " + e["error"][:60] if e["error"] else ", ".join(f"{x:.6f}" for x in e["losses"])
        err = "—" if e["max_rel_err"] is None else f"{e['max_rel_err']:.1e}"
        lines.append(
            "| "
            + " | ".join(
                [
                    e["model"],
                    METHOD_LABELS[e["method"]],
                    e["preset"] or "—",
                    _mesh(e["mesh"]),
                    losses,
                    ", ".join(f"{x:.6f}" for x in e["reference_losses"]),
                    err,
                    "yes" if e["ok"] else "**NO**",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def markdown(result: dict) -> str:
    meta = result["meta"]
    parts = [
        f"jax {meta['jax_version']}, {meta['devices']} simulated {meta['device_kind']} devices "
        f"(compile-only; tiny configs also execute), wall time {meta['wall_s']:.0f} s",
        "",
        "Estimated step time per device in ms (mesh data×model in brackets):",
        "",
        step_time_table(result["rows"]),
        "",
        "autoshard: planning and cost-model fidelity:",
        "",
        fidelity_table(result["rows"]),
    ]
    if result["executions"]:
        parts += [
            "",
            "Execution on simulated devices vs single-device jax.jit (tiny configs):",
            "",
            execution_table(result["executions"]),
        ]
    return "\n".join(parts)


def plot(rows: list[dict], path: str) -> str | None:
    """A grouped bar chart of estimated step time per method; returns None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups = grouped(rows)
    keys = list(groups)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(keys) + 2), 4.5))
    width = 0.8 / len(METHODS)
    for i, m in enumerate(METHODS):
        xs, ys, oom = [], [], []
        for j, k in enumerate(keys):
            r = groups[k].get(m)
            if r is not None and r.get("step_time_s") is not None:
                xs.append(j + (i - len(METHODS) / 2 + 0.5) * width)
                ys.append(r["step_time_s"] * 1e3)
                oom.append(r["oom"])
        bars = ax.bar(xs, ys, width, label=METHOD_LABELS[m])
        for b, o in zip(bars, oom, strict=True):
            if o:
                b.set_hatch("//")
                b.set_alpha(0.4)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{m}\n{p}" for m, p in keys], fontsize=7)
    ax.set_ylabel("estimated step time (ms)")
    ax.set_yscale("log")
    ax.set_title("Estimated step time per method (hatched: out of memory)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
