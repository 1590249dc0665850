"""What users read: the run's numbers (``--json``), the printed report, the Chrome trace."""
from __future__ import annotations

from collections import defaultdict

from rich.console import Console
from rich.table import Table

from isa.instructions import DMA_CLASSES, MatMul, QUEUES

FAMILIES = ("dma", "matrix", "drain", "vector", "sync")


def summarize(result) -> dict:
    """Every number of the report, JSON-ready."""
    arch, tl = result.arch, result.timeline
    c, d = tl.counters, arch.derived
    seconds = tl.cycles / (arch.clock_ghz * 1e9)
    macs_by_mode = defaultdict(int)
    for row in c.get("per_instr", []):
        macs_by_mode[row["mode"]] += row["macs"]
    return {
        "arch": arch.name,
        "cycles": int(tl.cycles),
        "time_s": seconds,
        "clock_ghz": arch.clock_ghz,
        "macs": int(c["macs"]),
        "dense_macs": int(c["dense_macs"]),
        "achieved_tops": _tops(c["macs"], seconds),
        "peak_tops": dict(d.peak_tops),
        "macs_by_mode": dict(macs_by_mode),
        "dram_read_bytes": int(c["dram_read_bytes"]),
        "dram_write_bytes": int(c["dram_write_bytes"]),
        "multicast_saved_bytes": int(c["multicast_saved_bytes"]),
        "psum_bytes": int(c["psum_bytes"]),
        "spad_bytes": int(c["spad_bytes"]),
        "vector_elems": int(c["vector_elems"]),
        "sparsity": {"passes": int(c["passes"]), "dense_passes": int(c["dense_passes"]),
                     "windows_skipped": int(c["windows_skipped"]),
                     "cycles_saved": int(c["sparsity_cycles_saved"])},
        "instructions": {f: int(c[f"count_{f}"]) for f in FAMILIES},
        "busy_cycles": {f: int(c[f"busy_{f}"]) for f in FAMILIES},
        "utilization": _utilization(result),
    }


def _tops(macs: float, seconds: float) -> float:
    return 2.0 * macs / seconds / 1e12 if seconds > 0 else 0.0


def _utilization(result) -> list[dict]:
    """Per Legion: the busy fraction of each queue and the MAC utilization of its cores."""
    arch, tl = result.arch, result.timeline
    macs = defaultdict(int)
    for row in tl.counters.get("per_instr", []):
        macs[row["legion"]] += row["macs"]
    best = max(arch.derived.macs_per_cycle.values()) / arch.legions
    rows = []
    for legion in range(arch.legions):
        row = {"legion": legion}
        for q in QUEUES:
            row[q] = tl.busy.get((legion, q), 0) / tl.cycles if tl.cycles else 0.0
        row["mac"] = macs[legion] / (tl.cycles * best) if tl.cycles else 0.0
        rows.append(row)
    return rows


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def print_report(n: dict, console: Console | None = None) -> None:
    console = console or Console()
    console.print(f"[bold]{n['arch']}[/bold]: {n['cycles']:,} cycles = {n['time_s'] * 1e6:.3f} us "
                  f"at {n['clock_ghz']:g} GHz")
    peaks = ", ".join(f"{m} {t:.2f}" for m, t in n["peak_tops"].items())
    console.print(f"throughput: {n['achieved_tops']:.3f} TOPS achieved ({n['macs']:,} MACs); "
                  f"peak TOPS {peaks}")
    console.print(f"DRAM: read {_bytes(n['dram_read_bytes'])}, written {_bytes(n['dram_write_bytes'])}; "
                  f"multicast saved {_bytes(n['multicast_saved_bytes'])}")
    console.print(f"scratchpad traffic: {_bytes(n['spad_bytes'])}; accumulator (psum) traffic: "
                  f"{_bytes(n['psum_bytes'])}; vector elements: {n['vector_elems']:,}")
    sp = n["sparsity"]
    console.print(f"passes: {sp['passes']:,} of {sp['dense_passes']:,} dense; windows skipped "
                  f"{sp['windows_skipped']:,}, cycles saved {sp['cycles_saved']:,}")
    console.print(_family_table(n))
    console.print(_legion_table(n))


def _family_table(n: dict) -> Table:
    t = Table(title="instructions", title_justify="left")
    for col in ("family", "count", "busy cycles"):
        t.add_column(col, justify="right" if col != "family" else "left")
    for f in FAMILIES:
        t.add_row(f, f"{n['instructions'][f]:,}", f"{n['busy_cycles'][f]:,}")
    return t


def _legion_table(n: dict) -> Table:
    t = Table(title="utilization per Legion (fraction of the run each queue is busy)", title_justify="left")
    for col in ("Legion", "dma", "mat", "vec", "MACs/peak"):
        t.add_column(col, justify="right")
    for row in n["utilization"]:
        t.add_row(str(row["legion"]), *(f"{row[k]:.1%}" for k in ("dma", "mat", "vec", "mac")))
    return t


def print_comparisons(rows, tol: float, console: Console | None = None) -> None:
    console = console or Console()
    t = Table(title=f"check against onnxruntime (float: relative L2 <= {tol:g}; integers exact)",
              title_justify="left")
    for col in ("output", "dtype", "rel L2", "max |diff|", "mismatches", "result"):
        t.add_column(col)
    for r in rows:
        rel = "exact" if r.exact and r.ok else f"{r.rel_l2:.3e}"
        t.add_row(r.name, r.dtype, rel, f"{r.max_abs:.3e}", str(r.mismatches),
                  "[green]ok[/green]" if r.ok else "[red]MISMATCH[/red]")
    console.print(t)


def chrome_trace(result) -> dict:
    """Chrome/Perfetto trace: a process per Legion with a thread per queue, and one for DRAM."""
    program, tl, arch = result.program, result.timeline, result.arch
    us = 1.0 / (arch.clock_ghz * 1e3)           # microseconds per cycle
    dram_pid = arch.legions
    events = _trace_names(arch.legions, dram_pid)
    for i, ins in enumerate(program.instrs):
        queue = ins.queue()
        if queue == "*":            # a barrier: a moment, not a span
            events.append({"name": "barrier", "ph": "i", "s": "g", "pid": 0, "tid": 0,
                           "ts": float(tl.start[i]) * us})
            continue
        start, done = float(tl.start[i]), float(tl.done[i])
        events.append({"name": ins.MNEMONIC, "ph": "X", "pid": ins.legion, "tid": QUEUES.index(queue),
                       "ts": start * us, "dur": max(done - start, 0.0) * us,
                       "args": {"line": program.where(i)}})
        if type(ins) in DMA_CLASSES:
            events.append({"name": ins.MNEMONIC, "ph": "X", "pid": dram_pid, "tid": ins.legion,
                           "ts": start * us, "dur": max(float(tl.free[i]) - start, 0.0) * us})
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"arch": arch.name, "cycles": int(tl.cycles)}}


def _trace_names(legions: int, dram_pid: int) -> list[dict]:
    events = []
    for legion in range(legions):
        events.append({"ph": "M", "name": "process_name", "pid": legion, "args": {"name": f"Legion {legion}"}})
        for k, q in enumerate(QUEUES):
            events.append({"ph": "M", "name": "thread_name", "pid": legion, "tid": k, "args": {"name": q}})
    events.append({"ph": "M", "name": "process_name", "pid": dram_pid, "args": {"name": "DRAM"}})
    for legion in range(legions):
        events.append({"ph": "M", "name": "thread_name", "pid": dram_pid, "tid": legion,
                       "args": {"name": f"flows of Legion {legion}"}})
    return events


def print_intermediates(rows, tol: float, console: Console | None = None, most: int = 20) -> None:
    """Summary of the intermediate comparison: the first divergence and the worst ones."""
    console = console or Console()
    bad = [r for r in rows if not r.ok]
    if not bad:
        console.print(f"intermediates: all {len(rows)} within tolerance of onnxruntime")
        return
    console.print(f"intermediates: {len(bad)} of {len(rows)} diverge; the first is "
                  f"[bold]{bad[0].name}[/bold] (relative L2 {bad[0].rel_l2:.3e}, "
                  f"{bad[0].mismatches} element(s) differing)")
    print_comparisons(bad[:most], tol, console)
