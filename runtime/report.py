"""What users read: the run's numbers (``--json``), the printed report, the Chrome trace.

Beside the timing model's counters the report gives four estimates:

- **Roofline.** The fewest cycles the work could take: its MACs at each mode's peak rate
  (``derived.macs_per_cycle``), or its *compulsory* DRAM traffic at the DRAM bandwidth,
  whichever is longer. Compulsory traffic reads every input and constant tensor once and writes
  every output once; scratch tensors that go to DRAM and back are the program's own choice.
- **Per matmul.** The same bound for each region (``.region``: one ONNX node's instructions,
  in one entry or several, as a matmul's weights loaded during the node before it) that runs
  ``mm`` instructions, or ``vmm`` ones (fp32 products, mode ``f32``, whose peak is one
  multiply-add per vector lane), against the cycles from its first start to its last completion. A
  region's compulsory traffic is every DRAM tensor its loads read plus every one its stores
  write, each tensor counted once per direction.
- **Energy**, reported as MLPerf Power does: joules per run and average watts (energy / time).
  Each counter times its per-operation energy from the ``[energy]`` table of the architecture,
  plus the static power over the run's time.
- **Area.** The chip's mm^2 from the ``[area]`` table (``Arch.derived``), and the achieved
  TOPS per mm^2 beside each mode's peak per mm^2.

MACs are the useful ones, by unit: the arrays' by mode (``macs_by_mode``) and the vector unit's
fp32 products (``vector_macs``); ``macs`` and the achieved TOPS count both. The array MAC slots
of the passes that carry no useful product (edge blocks narrower than the array, windows with
fewer blocks than the mode holds) are ``padded_macs``, counted apart (runtime/costs.py).
"""
from __future__ import annotations

import heapq
from collections import defaultdict

import numpy as np
from rich.console import Console
from rich.table import Table

from isa.bulk import no_cycle_collection
from isa.instructions import DMA_CLASSES, QUEUES, MatMul, VMatMul
from isa.console import table_console
from runtime.costs import DMA_SIDE, ceil_cycles

FAMILIES = ("dma", "matrix", "drain", "vector", "sync")
COMPULSORY_KINDS = ("input", "const", "output")
PJ = 1e-12


def summarize(result) -> dict:
    """Every number of the report, JSON-ready."""
    with no_cycle_collection():      # a whole model's program holds millions of objects
        return _summarize(result)


def _summarize(result) -> dict:
    arch, tl = result.arch, result.timeline
    c, d = tl.counters, arch.derived
    seconds = tl.cycles / (arch.clock_ghz * 1e9)
    macs_by_mode = _macs_by_mode(c.get("per_instr", []))
    heads = instructions(result.program)
    numbers = {
        "arch": arch.name,
        "cycles": int(tl.cycles),
        "time_s": seconds,
        "clock_ghz": arch.clock_ghz,
        "macs": _useful_macs(c),
        "array_macs": int(c["macs"]),
        "vector_macs": int(c["vector_macs"]),
        "padded_macs": int(c["padded_macs"]),
        "dense_macs": int(c["dense_macs"]),
        "achieved_tops": _tops(_useful_macs(c), seconds),
        "peak_tops": dict(d.peak_tops),
        "macs_by_mode": dict(macs_by_mode),
        "padded_macs_by_mode": _macs_by_mode(c.get("per_instr", []), "padded_macs"),
        "dram_read_bytes": int(c["dram_read_bytes"]),
        "dram_write_bytes": int(c["dram_write_bytes"]),
        "multicast_saved_bytes": int(c["multicast_saved_bytes"]),
        "psum_bytes": int(c["psum_bytes"]),
        "spad_bytes": int(c["spad_bytes"]),
        "vector_elems": int(c["vector_elems"]),
        "sparsity": {"passes": int(c["passes"]), "dense_passes": int(c["dense_passes"]),
                     "windows_skipped": int(c["windows_skipped"]),
                     "cycles_saved": int(c["sparsity_cycles_saved"]), **_mask_numbers(result.program, heads),
                     **_causal_numbers(result.program, arch)},
        "program_instructions": _source_count(result.program),
        "instructions": {f: int(c[f"count_{f}"]) for f in FAMILIES},
        "busy_cycles": {f: int(c[f"busy_{f}"]) for f in FAMILIES},
        "utilization": _utilization(result),
        "vector_ops": int(c["vector_ops"]),
        "aliases": aliases(result.program),
    }
    numbers |= _roofline_numbers(result, macs_by_mode)
    numbers |= _energy_numbers(arch, c, macs_by_mode, seconds)
    numbers |= _area_numbers(arch, numbers["achieved_tops"])
    numbers["matmuls"] = matmul_table(result, heads)
    return numbers


def _source_count(program) -> int:
    """Instructions of the program as written (it runs as one task per Legion of a span)."""
    return len(program.instrs.source)


def instructions(program) -> list[tuple]:
    """Per instruction of the program as written: the instruction, its first task and how many
    tasks it runs as (one per Legion of a span; its first task runs on the instruction's Legion
    and every task reads and writes its tensors). ``program`` is an expansion (isa/expand.py)."""
    tasks = program.instrs
    return list(zip(tasks.source, tasks.first.tolist(), np.diff(np.r_[tasks.first, len(tasks)]).tolist()))


def _mask_numbers(program, heads: list) -> dict:
    """The ``mm`` tasks that carry a block mask and the weight blocks those masks mark zero
    (all-zero weight chunks the compiler left out entirely are not counted: they are not in the
    program)."""
    masked = [(i, n) for i, _, n in heads if isinstance(i, MatMul) and i.mask is not None]
    zeros: dict[int, int] = {}
    for i, _ in masked:
        if i.mask not in zeros:
            raw = np.frombuffer(program.const_bytes(program.tensors[i.mask]), np.uint8)
            zeros[i.mask] = int((raw == 0).sum())
    return {"masked_mm": sum(n for _, n in masked), "masked_zero_blocks": sum(zeros[i.mask] * n for i, n in masked)}


def _causal_numbers(program, arch) -> dict:
    """Attention work the compiler left out under a causal mask (``Program.skipped``): blocks,
    multiply-adds, the softmax's lane operations, and the vector-lane cycles they would have
    held the Legions (summed over them)."""
    macs = program.skipped.get("causal_skipped_macs", 0)
    ops = program.skipped.get("causal_skipped_vector_ops", 0)
    return {"causal_blocks_skipped": program.skipped.get("causal_skipped_blocks", 0), "causal_macs_skipped": macs,
            "causal_vector_ops_skipped": ops, "causal_cycles_saved": -(-(macs + ops) // arch.vector_lanes)}


def _useful_macs(counters: dict) -> int:
    """Useful MACs of the arrays and the vector unit's fp32 products."""
    return int(counters["macs"] + counters["vector_macs"])


def _macs_by_mode(rows, key: str = "macs") -> dict:
    out = defaultdict(int)
    for row in rows:
        out[row["mode"]] += row.get(key, 0)
    return dict(out)


# --- roofline --------------------------------------------------------------------------------

def compulsory_bytes(program) -> int:
    """Bytes of the input and const tensors (read once) and the output tensors (written once),
    but for the parts of outputs where an input lies (``Program.aliases``): nothing writes them."""
    aliased = sum(t.nbytes for t in program.tensors if t.name in program.aliases)
    return sum(t.nbytes for t in program.tensors if t.kind in COMPULSORY_KINDS) - aliased


def aliases(program) -> dict[str, str]:
    """Inputs bound inside outputs, by graph name: input -> output."""
    io = {t.name: t.io_name or t.name for t in program.tensors}
    return {io[name]: io[out] for name, (out, _, _) in program.aliases.items()}


def roofline(arch, macs_by_mode: dict, nbytes: int) -> dict:
    """The compute bound (each mode's MACs at its peak rate, summed), the DRAM bound (``nbytes``
    at the DRAM bandwidth), and the roofline: the larger, in cycles."""
    d = arch.derived
    compute = sum(macs / macs_per_cycle(arch, mode) for mode, macs in macs_by_mode.items())
    dram = nbytes / d.dram_bytes_per_cycle
    return {"compute_cycles": compute, "dram_cycles": dram, "cycles": max(compute, dram),
            "bound": "compute" if compute >= dram else "dram"}


# fp32 products on the vector lanes (``vmm``): a mode of the per-matmul table beside the arrays'.
VECTOR_MODE = "f32"


def macs_per_cycle(arch, mode: str) -> float:
    """The chip's peak rate in ``mode``: the arrays', or one multiply-add per vector lane."""
    if mode == VECTOR_MODE:
        return arch.vector_lanes * arch.legions
    return arch.derived.macs_per_cycle[mode]


def _fraction(best: float, cycles: float) -> float:
    return best / cycles if cycles > 0 else 0.0


def _roofline_numbers(result, macs_by_mode: dict) -> dict:
    nbytes = compulsory_bytes(result.program)
    roof = roofline(result.arch, macs_by_mode, nbytes)
    return {"compulsory_dram_bytes": nbytes, "roofline_cycles": roof["cycles"],
            "roofline_bound": roof["bound"],
            "roofline_fraction": _fraction(roof["cycles"], result.timeline.cycles)}


# --- regions and the per-matmul table --------------------------------------------------------

def region_of(program) -> np.ndarray:
    """Per instruction, the index in ``program.regions`` of its region (-1: before the first)."""
    starts = np.array([at for at, _ in program.regions], dtype=np.int64)
    return np.searchsorted(starts, np.arange(len(program.instrs)), side="right") - 1


def region_ranges(program) -> list[range]:
    """The instructions of each region: from its start to the next region's."""
    return program.region_ranges()


def regions_by_name(program) -> dict[str, list[int]]:
    """The instructions of each region, by name in order of first appearance: the entries that
    share a name are one region."""
    out: dict[str, list[int]] = {}
    for (_, name), members in zip(program.regions, region_ranges(program)):
        out.setdefault(name, []).extend(members)
    return out


def _span(tl, members) -> tuple[float, float]:
    """First start and last completion of the instructions ``members`` (not empty)."""
    at = np.asarray(members, dtype=np.int64)
    return float(np.nanmin(tl.start[at])), float(np.nanmax(tl.done[at]))


def region_dram_bytes(program, members) -> int:
    """Compulsory traffic of instructions ``members``: the DRAM tensors their loads read plus
    those their stores write, each tensor counted once per direction."""
    moved = {"dram_read_bytes": set(), "dram_write_bytes": set()}
    at = np.asarray(members, dtype=np.int64)
    tasks = program.instrs
    o = tasks.origin[at]
    for n in np.unique(o).tolist():       # an instruction's tasks all move the same tensors
        i = tasks.source[n]
        side = DMA_SIDE.get(type(i))
        if side is not None:
            moved[side[1]].add(getattr(i, side[0]).tensor)
    return sum(program.tensors[t].nbytes for ts in moved.values() for t in ts)


def matmul_table(result, heads: list | None = None) -> list[dict]:
    """One row per region that runs ``mm`` instructions (on the arrays, by mode) or ``vmm``
    (fp32 products on the vector lanes, mode ``f32``), in program order."""
    program, tl = result.program, result.timeline
    owner, members = region_of(program), regions_by_name(program)
    rows_of = defaultdict(list)
    for row in tl.counters.get("per_instr", []):
        if owner[row["index"]] >= 0:
            rows_of[program.regions[owner[row["index"]]][1]].append(row)
    for i, k, n in heads if heads is not None else instructions(program):
        if isinstance(i, VMatMul) and owner[k] >= 0:        # a span's tasks: Legions i.legion on
            rows_of[program.regions[owner[k]][1]].append({"mode": VECTOR_MODE, "macs": i.M * i.K * i.N * n,
                                                          "legions": range(i.legion, i.legion + n)})
    return [_matmul_row(result, name, rows_of[name], members[name]) for name in members if name in rows_of]


def _matmul_row(result, name: str, mm_rows: list[dict], members: list[int]) -> dict:
    macs_by_mode = _macs_by_mode(mm_rows)
    roof = roofline(result.arch, macs_by_mode, region_dram_bytes(result.program, members))
    start, done = _span(result.timeline, members)
    cycles = ceil_cycles(done - start)
    return {"region": name, "nodes": name.split("+"), "mode": "+".join(sorted(macs_by_mode)),
            "macs": int(sum(macs_by_mode.values())),
            "padded_macs": int(sum(r.get("padded_macs", 0) for r in mm_rows)),
            "legions": len({legion for r in mm_rows for legion in r.get("legions", (r.get("legion"),))}),
            "cycles": cycles,
            "roofline_cycles": roof["cycles"], "roofline_bound": roof["bound"],
            "roofline_fraction": _fraction(roof["cycles"], cycles)}


# --- energy ----------------------------------------------------------------------------------

def energy(arch, counters: dict, macs_by_mode: dict, seconds: float) -> dict:
    """Joules by part: MACs per mode, DRAM, scratchpad and psum traffic, vector lane-ops, and
    static power over ``seconds``."""
    parts = {f"mac_{m}": macs_by_mode.get(m, 0) * arch.derived.pj_per_mac[m] * PJ for m in arch.modes}
    dram = counters["dram_read_bytes"] + counters["dram_write_bytes"]
    parts["dram"] = dram * arch.pj_per_dram_byte * PJ
    parts["scratchpad"] = counters["spad_bytes"] * arch.pj_per_sram_byte * PJ
    parts["psum"] = counters["psum_bytes"] * arch.pj_per_sram_byte * PJ
    parts["vector"] = counters["vector_ops"] * arch.pj_per_vector_op * PJ
    parts["static"] = arch.static_watts * seconds
    return parts


def _energy_numbers(arch, counters: dict, macs_by_mode: dict, seconds: float) -> dict:
    parts = energy(arch, counters, macs_by_mode, seconds)
    joules = sum(parts.values())
    return {"energy_joules": joules, "average_watts": joules / seconds if seconds > 0 else 0.0,
            "tops_per_watt": 2.0 * _useful_macs(counters) / joules / 1e12 if joules > 0 else 0.0,
            "energy": parts}


def _area_numbers(arch, achieved_tops: float) -> dict:
    """The chip's area (``Arch.derived``) and performance per mm^2: achieved and peak TOPS."""
    d = arch.derived
    return {"area_mm2": d.total_mm2, "area_node_nm": arch.area_node_nm, "area_by_part_mm2": dict(d.area_mm2),
            "achieved_tops_per_mm2": achieved_tops / d.total_mm2, "peak_tops_per_mm2": dict(d.tops_per_mm2)}


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


def _joules(j: float) -> str:
    for unit, scale in (("J", 1.0), ("mJ", 1e-3), ("uJ", 1e-6)):
        if abs(j) >= scale:
            return f"{j / scale:.4g} {unit}"
    return f"{j / 1e-9:.4g} nJ"


# Printed to a file or a pipe, tables are this wide (a terminal gives its own width): node
# names stay readable in logs.
LOG_WIDTH = 140


def report_console() -> Console:
    return table_console(LOG_WIDTH)


def headline(n: dict) -> str:
    """The run in a line: the machine, its cycles and their time at its clock."""
    return f"{n['arch']}: {n['cycles']:,} cycles = {n['time_s'] * 1e6:.3f} us at {n['clock_ghz']:g} GHz"


def print_report(n: dict, console: Console | None = None) -> None:
    console = console or report_console()
    console.print(headline(n), markup=False, highlight=False)
    peaks = ", ".join(f"{m} {t:.2f}" for m, t in n["peak_tops"].items())
    console.print(f"throughput: {n['achieved_tops']:.3f} TOPS achieved ({n['macs']:,} useful MACs); "
                  f"peak TOPS {peaks}")
    console.print(_macs_lines(n))
    console.print(f"DRAM: read {_bytes(n['dram_read_bytes'])}, written {_bytes(n['dram_write_bytes'])}; "
                  f"multicast saved {_bytes(n['multicast_saved_bytes'])}")
    if n["aliases"]:
        console.print("inputs bound inside outputs (only the rest is written): "
                      + ", ".join(f"{i} in {o}" for i, o in n["aliases"].items()))
    console.print(f"scratchpad traffic: {_bytes(n['spad_bytes'])}; accumulator (psum) traffic: "
                  f"{_bytes(n['psum_bytes'])}; vector elements: {n['vector_elems']:,}")
    sp = n["sparsity"]
    console.print(f"passes: {sp['passes']:,} of {sp['dense_passes']:,} dense; windows skipped "
                  f"{sp['windows_skipped']:,}, cycles saved {sp['cycles_saved']:,}; {sp['masked_zero_blocks']:,} zero "
                  f"weight blocks skipped by {sp['masked_mm']:,} masked mm")
    if sp["causal_macs_skipped"]:
        console.print(f"causal attention: {sp['causal_blocks_skipped']:,} blocks above the diagonal not computed, "
                      f"{sp['causal_macs_skipped']:,} multiply-adds and {sp['causal_vector_ops_skipped']:,} softmax "
                      f"lane operations left out in all (vector cycles saved "
                      f"{sp['causal_cycles_saved']:,}, summed over Legions)")
    console.print(f"roofline: {n['roofline_cycles']:,.0f} cycles, {n['roofline_bound']}-bound (compulsory "
                  f"DRAM traffic {_bytes(n['compulsory_dram_bytes'])}); the run reaches "
                  f"{n['roofline_fraction']:.1%} of it")
    console.print(f"energy: {_joules(n['energy_joules'])} per run, average power "
                  f"{n['average_watts']:.4g} W, {n['tops_per_watt']:.3g} TOPS/W")
    console.print(f"area: {n['area_mm2']:.2f} mm^2 at {n['area_node_nm']} nm; "
                  f"{n['achieved_tops_per_mm2']:.4g} TOPS/mm^2 achieved")
    for table in (_family_table(n), _legion_table(n), _energy_table(n)) + ((_matmul_table(n),) if n["matmuls"] else ()):
        print_table(table, console)


def _macs_lines(n: dict) -> str:
    """Useful MACs by unit, and the array MAC slots spent on padding."""
    modes = ", ".join(f"{m} {v:,}" for m, v in n["macs_by_mode"].items())
    share = _fraction(n["padded_macs"], n["array_macs"] + n["padded_macs"])
    return (f"useful MACs: arrays {n['array_macs']:,}{f' ({modes})' if modes else ''}, vector unit fp32 "
            f"{n['vector_macs']:,}\npadding: {n['padded_macs']:,} array MAC slots ({share:.1%} of the "
            "arrays' passes) not counted: edge blocks narrower than the array, part-filled windows")


def print_table(t: Table, console: Console) -> None:
    """A table under its title as a line of its own: rich would wrap a title wider than the
    table's columns."""
    title, t.title = t.title, None
    if title:
        console.print(title, highlight=False)
    console.print(t)


def _family_table(n: dict) -> Table:
    t = Table(title=f"instructions: {n['program_instructions']:,} in the program, run as one task per "
                    "Legion of a span", title_justify="left")
    for col in ("family", "tasks", "busy cycles"):
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


ENERGY_PARTS = {"dram": "DRAM", "scratchpad": "scratchpads", "psum": "accumulators (psum)",
                "vector": "vector lane-ops", "static": "static"}


def _energy_table(n: dict) -> Table:
    t = Table(title="energy per run", title_justify="left")
    for col in ("part", "energy", "share"):
        t.add_column(col, justify="left" if col == "part" else "right")
    total = n["energy_joules"]
    for part, joules in n["energy"].items():
        label = ENERGY_PARTS.get(part, part.replace("mac_", "MACs "))
        t.add_row(label, _joules(joules), f"{joules / total:.1%}" if total else "-")
    return t


def _matmul_table(n: dict) -> Table:
    t = Table(title="matmuls against their roofline (compute at peak, compulsory DRAM traffic)",
              title_justify="left")
    t.add_column("nodes", overflow="fold")
    for col in ("mode", "MACs", "Legions", "cycles", "roofline", "bound", "of roofline"):
        t.add_column(col, justify="left" if col in ("mode", "bound") else "right", no_wrap=True)
    for m in n["matmuls"]:
        t.add_row("\n".join(m["nodes"]), m["mode"], f"{m['macs']:,}", str(m["legions"]), f"{m['cycles']:,}",
                  f"{m['roofline_cycles']:,.0f}", m["roofline_bound"], f"{m['roofline_fraction']:.1%}")
    return t


def print_comparisons(rows, tol: float, console: Console | None = None) -> None:
    console = console or report_console()
    t = Table(title=f"check against onnxruntime (float: relative L2 <= {tol:g}; integers exact)",
              title_justify="left")
    own = any(r.tolerance not in (None, tol) for r in rows)     # some judged at an approximation's
    for col in ("output", "dtype", "rel L2", "max |diff|", "mismatches", *(["tolerance"] if own else []), "result"):
        t.add_column(col)
    for r in rows:
        rel = "exact" if r.exact and r.ok else f"{r.rel_l2:.3e}"
        at = [f"{r.tolerance if r.tolerance is not None else tol:g}"] if own else []
        t.add_row(r.name, r.dtype, rel, f"{r.max_abs:.3e}", str(r.mismatches), *at,
                  "[green]ok[/green]" if r.ok else "[red]MISMATCH[/red]")
    print_table(t, console)


def print_verdict(verdict, tol: float, console: Console | None = None) -> None:
    """The table of ``dlegion-run --check`` (runtime.check.judge), with the float64 figures when
    they were evaluated, and what else a user needs to read it."""
    from runtime.check import FP64_MULTIPLE
    console = console or report_console()
    fp64 = verdict.fp64 == "evaluated"
    against = "onnxruntime" + (" (exact integer kernels)" if verdict.reference == "exact" else "")
    rule = f"relative L2 <= {tol:g}" + (f", or from fp64 at most {FP64_MULTIPLE:g}x onnxruntime's" if fp64 else "")
    t = Table(title=f"check against {against} (float: {rule}; integers exact)", title_justify="left")
    cols = ["output", "dtype", "rel L2", "max |diff|", "mismatches"]
    cols += ["fp64: dlegion", "fp64: onnxruntime", "positions off (dlegion / onnxruntime)"] if fp64 else []
    for col in [*cols, "result"]:
        t.add_column(col)
    for r in verdict.rows:
        rel = "exact" if r.exact and r.ok else f"{r.rel_l2:.3e}"
        row = [r.name, r.dtype, rel, f"{r.max_abs:.3e}", str(r.mismatches)]
        if fp64:
            f = r.fp64
            row += ([f"{f.ours:.3e}", f"{f.reference:.3e}", f"{f.off_ours} / {f.off_reference} of {f.positions}"]
                    if f else ["", "", ""])
        t.add_row(*row, "[green]ok[/green]" if r.ok else "[red]MISMATCH[/red]")
    print_table(t, console)
    if not fp64:
        console.print(f"fp64 evaluation: {verdict.fp64}")
    for r in verdict.rows:
        if r.fp64 and r.fp64.approximation is not None:
            console.print(f"{r.name}: the compiler's approximations ({'; '.join(verdict.approximations)}) are "
                          f"{r.fp64.approximation:.3e} from fp64 (bound {r.fp64.bound:g}); dlegion is measured "
                          f"from fp64 with them")
        if r.top1:
            where = f" (differs at {', '.join(map(str, r.top1.differing[:10]))}" \
                    f"{', ...' if len(r.top1.differing) > 10 else ''})" if r.top1.differing else ""
            console.print(f"{r.name}: top-1 token agrees with onnxruntime at {r.top1.agree} of "
                          f"{r.top1.positions} positions{where}")


def chrome_trace(result) -> dict:
    """Chrome/Perfetto trace in the trace-event format: a process per Legion with a track per
    queue, one for DRAM with a track per Legion's flows, and one for the regions (which node
    the machine runs).

    Times are whole nanoseconds, written in microseconds (the format's unit). The format wants
    the complete slices of one thread disjoint or nested; a track whose slices overlap in time
    (pipelined DMAs: a load's data lands after the next load has started; interleaved regions)
    is drawn as lanes: each slice goes on the lowest-numbered lane whose slices have all ended
    by its start, and each lane is a thread named after its track ("dma", "dma #2", ...)."""
    program, tl, arch = result.program, result.timeline, result.arch
    ns = 1.0 / arch.clock_ghz                   # nanoseconds per cycle
    dram_pid, regions_pid = arch.legions, arch.legions + 1
    flows = [f"flows of Legion {legion}" for legion in range(arch.legions)]
    tracks: dict[tuple, list] = {(legion, q): [] for legion in range(arch.legions) for q in QUEUES}
    tracks |= {(dram_pid, name): [] for name in flows} | {(regions_pid, "regions"): []}
    owner = region_of(program)
    barriers = []
    for i, ins in enumerate(program.instrs):
        start = _ns(tl.start[i], ns)
        if ins.queue() == "*":            # a barrier: a moment, not a span
            barriers.append({"name": "barrier", "ph": "i", "s": "g", "pid": 0, "tid": 0, "ts": start / 1e3})
            continue
        args = _trace_args(program, owner, i)
        tracks[(ins.legion, ins.queue())].append((ins.MNEMONIC, start, _ns(tl.done[i], ns), args))
        if type(ins) in DMA_CLASSES:
            tracks[(dram_pid, flows[ins.legion])].append((ins.MNEMONIC, start, _ns(tl.free[i], ns), args))
    for (_, name), members in zip(program.regions, region_ranges(program)):
        if members:
            start, done = _span(tl, members)
            tracks[(regions_pid, "regions")].append((name, _ns(start, ns), _ns(done, ns), {"region": name}))
    processes = {legion: f"Legion {legion}" for legion in range(arch.legions)}
    processes |= {dram_pid: "DRAM", regions_pid: "regions"}
    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
              for pid, name in processes.items()]
    return {"traceEvents": events + _track_events(tracks) + barriers, "displayTimeUnit": "ns",
            "otherData": {"arch": arch.name, "cycles": int(tl.cycles)}}


def _ns(cycles: float, ns_per_cycle: float) -> int:
    return round(float(cycles) * ns_per_cycle)


def _trace_args(program, owner: np.ndarray, i: int) -> dict:
    args = {"line": program.where(i)}
    if owner[i] >= 0:
        args["region"] = program.regions[owner[i]][1]
    return args


def lanes(spans: list[tuple[int, int]]) -> list[int]:
    """Per (start, end) span, taken in order of start, the lowest-numbered lane whose spans have
    all ended by its start: no two spans of a lane overlap, and there are as many lanes as the
    most spans that overlap at one time. A span of no length (a wait) overlaps none: with every
    lane busy, it goes on the lowest, nested in that lane's span."""
    out = [0] * len(spans)
    free: list[int] = []                        # lanes whose spans have ended
    busy: list[tuple[int, int]] = []            # (end of its last span, lane)
    for k in sorted(range(len(spans)), key=lambda k: spans[k][0]):
        start, end = spans[k]
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if end <= start and busy and not free:
            out[k] = min(lane for _, lane in busy)
            continue
        out[k] = heapq.heappop(free) if free else len(busy)
        heapq.heappush(busy, (end, out[k]))
    return out


def _track_events(tracks: dict) -> list[dict]:
    """Each (pid, name) track's slices on lanes; a process's threads number its tracks' lanes in
    turn, each lane named (a track without slices keeps one)."""
    names, slices = [], []
    next_tid: dict[int, int] = defaultdict(int)
    for (pid, name), spans in tracks.items():
        lane_of = lanes([(start, end) for _, start, end, _ in spans])
        first = next_tid[pid]
        next_tid[pid] += max(lane_of, default=0) + 1
        for tid in range(first, next_tid[pid]):
            lane = f" #{tid - first + 1}" if tid > first else ""
            names += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name + lane}},
                      {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}]
        slices += [{"name": label, "ph": "X", "pid": pid, "tid": first + lane, "ts": start / 1e3,
                    "dur": max(end - start, 0) / 1e3, "args": args}
                   for (label, start, end, args), lane in zip(spans, lane_of)]
    return names + slices


def print_intermediates(rows, tol: float, console: Console | None = None, most: int = 20) -> None:
    """Summary of the intermediate comparison: the first divergence and the worst ones."""
    console = console or report_console()
    for r in rows:
        if r.not_the_value:
            console.print(f"intermediates: {r.name} not compared: {r.not_the_value}")
    rows = [r for r in rows if not r.not_the_value]
    for kinds, at in sorted({(tuple(r.approximated), r.tolerance) for r in rows if r.approximated}):
        n = sum(1 for r in rows if r.approximated and tuple(r.approximated) == kinds)
        console.print(f"intermediates: {n} computed from {' and '.join(kinds)}, judged at relative L2 <= {at:g}")
    bad = [r for r in rows if not r.ok]
    if not bad:
        console.print(f"intermediates: all {len(rows)} within tolerance of onnxruntime")
        return
    console.print(f"intermediates: {len(bad)} of {len(rows)} diverge; the first is "
                  f"[bold]{bad[0].name}[/bold] (relative L2 {bad[0].rel_l2:.3e}, "
                  f"{bad[0].mismatches} element(s) differing)")
    print_comparisons(bad[:most], tol, console)
