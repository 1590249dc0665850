"""Fair comparisons: each baseline against its D-Legion on the footings of ``isa/normalize.py``
(as published, at D-Legion's PE count, at its peak w8 TOPS), every row naming its footing.

Used by ``dlegion-dse --compare`` on a user's model and by ``bench/bench_compare.py`` on the
paper's attention workloads. A ratio is the baseline's figure over its D-Legion's on the same
workload: above 1, D-Legion is faster, moves less, or does more per mm^2.
"""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from isa import arch as arch_mod
from isa.arch import Arch
from isa.normalize import footings

# Each D-Legion machine and the baselines its paper compares it with.
PAIRS = {"dlegion-8x8": ("ws-64", "dip-64", "adip-64"), "dlegion-32x8": ("tpuv4i",)}
REFERENCE = "reference"
# (the row's figure, the ratio's key)
RATIOS = (("time_us", "latency_x"), ("dram_bytes", "dram_x"), ("psum_bytes", "psum_x"),
          ("time_area", "per_mm2_x"))


def machines(load=arch_mod.load) -> list[tuple[Arch, str, str]]:
    """(machine, the D-Legion it is compared with, its footing) of each machine to run, every
    D-Legion first as the reference; ``load`` makes a machine of a preset name."""
    out = []
    for ref_name, bases in PAIRS.items():
        ref = load(ref_name)
        out.append((ref, ref_name, REFERENCE))
        for base in bases:
            out += [(m, ref_name, label) for m, label in footings(load(base), ref)]
    return out


def add_ratios(rows: list[dict], workload=lambda r: ()) -> None:
    """Set each row's ratios to the row of its D-Legion (``ref``) on the same ``workload``."""
    ok = {(workload(r), r["name"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        ref = ok.get((workload(r), r["ref"]))
        if r["status"] == "ok":
            r["time_area"] = r["time_us"] * r["area_mm2"]     # its inverse is work per second per mm^2
        for key, ratio in RATIOS:
            good = r["status"] == "ok" and ref is not None and ref.get(key)
            r[ratio] = r[key] / ref[key] if good else None


def ratio_text(v) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def print_compare(rows: list[dict], console: Console, title: str) -> None:
    """One row per machine, grouped by the D-Legion it is compared with."""
    t = Table(title=title, title_justify="left")
    for col in ("machine", "footing", "vs", "cycles", "us", "DRAM MiB", "psum MiB", "mm^2", "bound",
                "latency", "DRAM", "psum", "latency x mm^2"):
        t.add_column(col, justify="left" if col in ("machine", "footing", "vs", "bound") else "right",
                     no_wrap=True)
    order = {name: i for i, name in enumerate(PAIRS)}
    for r in sorted(rows, key=lambda r: (order.get(r["ref"], len(order)), r["footing"] != REFERENCE)):
        if r["status"] != "ok":
            t.add_row(r["name"], r["footing"], r["ref"], *[""] * 5, "[red]failed[/red]", "", "", "", "")
            continue
        t.add_row(r["name"] + ("*" if r["warning"] else ""), r["footing"], r["ref"], f"{r['cycles']:,}",
                  f"{r['time_us']:,.1f}", f"{r['dram_bytes'] / 2**20:,.1f}", f"{r['psum_bytes'] / 2**20:,.1f}",
                  f"{r['area_mm2']:,.1f}", r["bound"], *(ratio_text(r[k]) for _, k in RATIOS))
    console.print(t)
