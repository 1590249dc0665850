"""The sweep's plots as PNG bytes: latency per configuration, achieved TOPS against each roofline,
and latency against area with the Pareto front.

Figures are built without pyplot (no global figure state, no display): ``Figure.savefig``
renders PNG with the Agg canvas.
"""
from __future__ import annotations

import io

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from dlegion_cc.dse_measure import BOUNDS, roof

BOUND_COLORS = {"compute": "tab:blue", "DRAM": "tab:red", "vector": "tab:green"}


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    return buf.getvalue()


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["status"] == "ok"]


def latency_png(rows: list[dict], title: str) -> bytes:
    """Bars of latency (us) per configuration, fastest first, colored by the term that bounds it."""
    ok = sorted(_ok(rows), key=lambda r: r["time_us"])
    failed = len(rows) - len(ok)
    fig = Figure(figsize=(max(6.0, 0.45 * len(ok) + 2), 4.5))
    ax = fig.add_subplot()
    ax.bar(range(len(ok)), [r["time_us"] for r in ok], color=[BOUND_COLORS[r["bound"]] for r in ok])
    ax.set_xticks(range(len(ok)), [r["name"] for r in ok], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("latency (us)")
    ax.set_title(title + (f" ({failed} configuration(s) failed)" if failed else ""))
    ax.legend(handles=[Patch(color=BOUND_COLORS[b], label=f"{b}-bound") for b in BOUNDS], fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def roofline_png(rows: list[dict], title: str) -> bytes:
    """Achieved TOPS at each configuration's operational intensity (MACs x 2 / DRAM bytes), over the
    rooflines min(peak, intensity x DRAM bandwidth); configurations sharing a roofline share a line."""
    ok = [r for r in _ok(rows) if r["intensity"] and r["achieved_tops"] > 0]
    fig = Figure(figsize=(8, 5.5))
    ax = fig.add_subplot()
    if ok:
        _rooflines(ax, ok)
        colors = _palette(len(ok))
        for r, color in zip(ok, colors):
            ax.scatter(r["intensity"], r["achieved_tops"], color=color, s=28, zorder=3, label=r["name"])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.legend(fontsize=7, ncol=2 if len(ok) > 12 else 1, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_xlabel("operational intensity (ops / DRAM byte)")
    ax.set_ylabel("TOPS")
    ax.set_title(title)
    ax.grid(which="major", alpha=0.3)
    return _png(fig)


def pareto_png(rows: list[dict], title: str) -> bytes:
    """Latency against area, one point per configuration; the latency-area Pareto front (rows
    marked ``pareto``) joined by a step line and named."""
    ok = _ok(rows)
    fig = Figure(figsize=(8, 5.5))
    ax = fig.add_subplot()
    ax.scatter([r["area_mm2"] for r in ok], [r["time_us"] for r in ok], color="0.6", s=22, zorder=2)
    front = sorted((r for r in ok if r["pareto"]), key=lambda r: r["area_mm2"])
    if front:
        ax.step([r["area_mm2"] for r in front], [r["time_us"] for r in front], where="post", color="tab:red",
                zorder=3)
        for r in front:
            ax.scatter(r["area_mm2"], r["time_us"], color="tab:red", s=30, zorder=4)
            ax.annotate(r["name"], (r["area_mm2"], r["time_us"]), fontsize=7, xytext=(4, 4),
                        textcoords="offset points")
    ax.set_xlabel("area (mm^2)")
    ax.set_ylabel("latency (us)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return _png(fig)


def _rooflines(ax, rows: list[dict]) -> None:
    lo = min(r["intensity"] for r in rows) / 4
    hi = max(r["intensity"] for r in rows) * 4
    roofs = sorted({(r["peak_tops"], r["dram_gbps"]) for r in rows})
    for peak, gbps in roofs:
        # Extend the range past the ridge point so each roof's knee is visible.
        xs = np.geomspace(min(lo, peak * 1000.0 / gbps / 4), max(hi, peak * 1000.0 / gbps * 4), 200)
        ax.plot(xs, [roof(peak, gbps, x) for x in xs], color="0.55", lw=1, zorder=1)
        ax.annotate(f"{peak:.3g} TOPS", (xs[-1], peak), fontsize=7, color="0.35", ha="right", va="bottom")


def _palette(n: int) -> list:
    from matplotlib import colormaps
    cmap = colormaps["tab20" if n > 10 else "tab10"]
    return [cmap(i % cmap.N) for i in range(n)]
