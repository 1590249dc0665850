"""The sweep's plots as PNG bytes: latency per configuration, achieved TOPS against each roofline,
latency against area and against energy with their Pareto fronts, and a Legions x cores heatmap
of latency.

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


# (row flag, x column, x label) of each Pareto panel: latency against area, against energy.
PARETO_PANELS = (("pareto", "area_mm2", "area (mm$^2$)"), ("pareto_energy", "energy_uj", "energy (uJ)"))
FRONT_LABELS = 12       # front points named on a panel at most
LABEL_GAP = 0.08        # fraction of a panel's width or height between two named points


def pareto_png(rows: list[dict], title: str) -> bytes:
    """Latency against area and against energy, one point per configuration: each panel's
    Pareto front (rows marked ``pareto`` / ``pareto_energy``) joined by a step line, drawn
    strong and named; the dominated configurations faded."""
    ok = _ok(rows)
    fig = Figure(figsize=(13, 5.5))
    for i, (flag, x, label) in enumerate(PARETO_PANELS):
        ax = fig.add_subplot(1, 2, i + 1)
        _pareto_panel(ax, ok, flag, x)
        ax.set_xlabel(label)
        ax.set_ylabel("latency (us)")
        ax.set_title(f"latency against {label.split(' ')[0]}")
        ax.grid(alpha=0.3)
    fig.suptitle(title + f" ({len(ok)} configurations)")
    return _png(fig)


def _pareto_panel(ax, ok: list[dict], flag: str, x: str) -> None:
    dominated = [r for r in ok if not r[flag]]
    front = sorted((r for r in ok if r[flag]), key=lambda r: r[x])
    if dominated:
        ax.scatter([r[x] for r in dominated], [r["time_us"] for r in dominated], color="0.55", alpha=0.35,
                   s=18, zorder=2, label=f"dominated ({len(dominated)})")
    if not front:
        return
    ax.step([r[x] for r in front], [r["time_us"] for r in front], where="post", color="tab:red", lw=1.2, zorder=3)
    ax.scatter([r[x] for r in front], [r["time_us"] for r in front], color="tab:red", s=32, zorder=4,
               label=f"Pareto front ({len(front)})")
    for k, r in enumerate(_named(front, ok, x)):
        # Neighbours on a front are close: names alternate above and below their points.
        ax.annotate(r["name"], (r[x], r["time_us"]), fontsize=7, xytext=(5, 5) if k % 2 == 0 else (5, -10),
                    textcoords="offset points")
    ax.legend(fontsize=8, loc="best")


def _named(front: list[dict], ok: list[dict], x: str) -> list[dict]:
    """The front's points that get a name: at most FRONT_LABELS, none closer to a named one than
    LABEL_GAP of the plot's width or height (the legend counts them all)."""
    def span(key):
        lo, hi = min(r[key] for r in ok), max(r[key] for r in ok)
        return lo, (hi - lo) or 1.0
    (x0, dx), (y0, dy) = span(x), span("time_us")
    named: list[tuple[float, float, dict]] = []
    for r in front:
        u, v = (r[x] - x0) / dx, (r["time_us"] - y0) / dy
        if len(named) < FRONT_LABELS and all(max(abs(u - a), abs(v - b)) >= LABEL_GAP for a, b, _ in named):
            named.append((u, v, r))
    return [r for _, _, r in named]


def heatmap_png(rows: list[dict], title: str) -> bytes:
    """Latency (us) of each Legions x cores per Legion pair, each cell the fastest configuration
    with that pair (over array sizes and scratchpads) and printed in it; a pair none ran is blank."""
    ok = _ok(rows)
    legions, cores, cells = latency_grid(ok)
    grid = np.array(cells, dtype=float)        # None: nan, drawn blank
    fig = Figure(figsize=(max(5.0, 1.1 * len(cores) + 2.5), max(4.0, 0.7 * len(legions) + 2)))
    ax = fig.add_subplot()
    if ok:
        fig.colorbar(ax.imshow(grid, cmap="viridis_r", origin="lower", aspect="auto"), ax=ax, label="latency (us)")
    for (i, j), v in np.ndenumerate(grid):
        if not np.isnan(v):
            ax.text(j, i, f"{v:.3g}", ha="center", va="center", fontsize=8,
                    color="white" if v > np.nanmean(grid) else "black")
    ax.set_xticks(range(len(cores)), [str(c) for c in cores])
    ax.set_yticks(range(len(legions)), [str(n) for n in legions])
    ax.set_xlabel("cores per Legion")
    ax.set_ylabel("Legions")
    fastest = " (fastest of each cell's configurations)" if len(ok) > np.count_nonzero(~np.isnan(grid)) else ""
    ax.set_title(title + fastest, fontsize=10)
    return _png(fig)


def latency_grid(rows: list[dict]) -> tuple[list[int], list[int], np.ndarray]:
    """The Legion counts and core counts the rows that ran have, and the least latency (us) of
    each pair (None where no row has it)."""
    ok = _ok(rows)
    legions = sorted({r["legions"] for r in ok})
    cores = sorted({r["cores"] for r in ok})
    grid = np.full((len(legions), len(cores)), None, dtype=object)
    for r in ok:
        i, j = legions.index(r["legions"]), cores.index(r["cores"])
        grid[i, j] = r["time_us"] if grid[i, j] is None else min(grid[i, j], r["time_us"])
    return legions, cores, grid


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
