"""PNG plots of run_all's normalized rows (matplotlib, Agg backend; no GPU needed).

    roofline_plot  fraction of roofline of our kernels, per op and M (grouped bars)
    speedup_plot   speed-up of ours vs each anchor, per op and M (log y, a line at 1x)
    prefill_plot   time per layer per backend and M, the 'outside MoE + attention core' part stacked in

Each takes the rows, a path and a title suffix (device, date), writes the PNG and returns its path,
or None when the rows hold nothing to plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.run_all import ANCHORS, summarize  # noqa: E402

OUTSIDE = ("outside_moe_attn", "outside")  # scope names of the part outside MoE and the attention core


def _bars(ax, groups: list[str], series: dict[str, list[float | None]], colors: dict[str, str] | None = None) -> None:
    """Grouped bars: one group per entry of ``groups``, one bar per series (None: no bar)."""
    n = max(len(series), 1)
    width = 0.8 / n
    for i, (label, vals) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g, v in enumerate(vals) if v]
        ax.bar(xs, [v for v in vals if v], width, label=label, color=(colors or {}).get(label, f"C{i}"))
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def roofline_plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    summ = summarize(rows)
    ms = sorted({m for per_m in summ.values() for m in per_m}, reverse=True)
    ops = [op for op, per_m in summ.items() if any(s["frac_roofline"] for s in per_m.values())]
    if not ops:
        return None
    series = {f"M={m}": [summ[op].get(m, {}).get("frac_roofline") for op in ops] for m in ms}
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(ops) + 2), 4.5))
    _bars(ax, ops, series)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_ylabel("roofline ms / ours ms")
    ax.set_title(f"Our kernels, fraction of roofline ({title})")
    ax.legend(fontsize=8)
    return _save(fig, path)


def speedup_plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    summ = {op: per_m for op, per_m in summarize(rows).items() if any(s["speedup"] for s in per_m.values())}
    if not summ:
        return None
    ncol = min(3, len(summ))
    nrow = -(-len(summ) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4 * ncol + 1, 3.6 * nrow + 0.6), squeeze=False, sharey=True)
    colors = {a: f"C{i}" for i, a in enumerate(ANCHORS)}  # one color per anchor in every panel
    for ax in axes.flat[len(summ):]:
        ax.set_visible(False)
    for ax, (op, per_m) in zip(axes.flat, summ.items()):
        ms = sorted(per_m, reverse=True)
        anchors = [a for a in ANCHORS if any(a in per_m[m]["speedup"] for m in ms)]
        _bars(ax, [str(m) for m in ms], {a: [per_m[m]["speedup"].get(a) for m in ms] for a in anchors}, colors)
        ax.set_yscale("log")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(op, fontsize=9)
        ax.set_xlabel("M")
        ax.legend(fontsize=7)
    for row in axes:
        row[0].set_ylabel("anchor ms / ours ms")
    fig.suptitle(f"Speed-up vs anchors ({title})")
    return _save(fig, path)


def prefill_plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    pre = [r for r in rows if r["family"] == "prefill" and r["ms"] and r["M"] is not None]
    if not pre:
        return None
    by = {(r["M"], r["impl"], r["op"]): r["ms"] for r in pre}
    ms = sorted({r["M"] for r in pre}, reverse=True)
    backends = sorted({r["impl"] for r in pre}, key=lambda b: (b != "eager", b != "inductor", b))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(ms) + 2), 4.5))
    n, width = len(backends), 0.8 / len(backends)
    for i, b in enumerate(backends):
        color = f"C{i}"
        for g, m in enumerate(ms):
            x = g + (i - (n - 1) / 2) * width
            part = next((by[(m, b, s)] for s in OUTSIDE if (m, b, s) in by), None)
            total = by.get((m, b, "layer"), part)
            if total is None:
                continue
            if part is not None:  # the part outside MoE + attention core, solid; the rest hatched above it
                ax.bar(x, part, 0.9 * width, color=color, label=f"{b}: outside MoE + attn core" if g == 0 else None)
                ax.bar(x, max(total - part, 0), 0.9 * width, bottom=part, color=color, alpha=0.35, hatch="//",
                       label=f"{b}: MoE + attn core" if g == 0 else None)
            else:
                ax.bar(x, total, 0.9 * width, color=color, alpha=0.6, label=f"{b}: layer" if g == 0 else None)
    ax.set_xticks(range(len(ms)), [f"M={m}" for m in ms])
    ax.set_ylabel("ms per layer")
    ax.set_title(f"Prefill, time per layer ({title})")
    ax.legend(fontsize=7)
    return _save(fig, path)


def render_all(rows: list[dict[str, Any]], out: Path, stem: str, title: str) -> list[Path]:
    """All three plots as <out>/<stem>-{roofline,speedup,prefill}.png; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    made = [roofline_plot(rows, out / f"{stem}-roofline.png", title),
            speedup_plot(rows, out / f"{stem}-speedup.png", title),
            prefill_plot(rows, out / f"{stem}-prefill.png", title)]
    return [p for p in made if p is not None]
