"""One design point: compile a model for a machine, time it, and keep the few numbers a sweep compares.

Timing model only (no functional emulation): the compiler's output is checked elsewhere, and the
timing model alone is what makes a sweep of many machines affordable.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from isa.arch import Arch
from isa.program import Program, ProgramError
from runtime.emulator import RunResult
from runtime.report import summarize
from runtime.timing import simulate

# The columns of a row, in the order of the CSV file.
COLUMNS = ("name", "status", "reason", "warning", "legions", "cores", "array", "dataflow", "clock_ghz",
           "cycles", "time_us", "macs", "achieved_tops", "peak_tops", "peak_mode", "peak_fraction",
           "dram_read_bytes", "dram_write_bytes", "dram_bytes", "dram_gbps", "intensity", "roof_tops",
           "psum_bytes", "energy_uj", "area_mm2", "tops_per_mm2", "pareto", "pareto_energy", "instructions",
           "compute_cycles", "dram_cycles", "vector_cycles", "bound")
# The lower bounds on a run's cycles, each from one resource; the largest says what bounds it.
BOUNDS = ("compute", "DRAM", "vector")


@dataclass(frozen=True)
class Config:
    """A machine to evaluate; ``arch`` is None when the parameters themselves are invalid (``error``)."""

    name: str
    legions: int
    cores: int
    array: int
    arch: Arch | None
    error: str = ""


def config_of(arch: Arch) -> Config:
    return Config(arch.name, arch.legions, arch.cores, arch.array, arch)


def failed_row(config: Config, reason: str) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update(name=config.name, status="failed", reason=reason, legions=config.legions,
               cores=config.cores, array=config.array)
    return row


def evaluate(model: str | Path, config: Config, dims: dict[str, int], switches: dict | None = None) -> dict:
    """Compile and time ``model`` on ``config`` (``switches``: Options fields such as
    ``multicast=False``, for ablations); a configuration that fails is a row with the reason.

    Runs in a worker process, so it returns plain data and never raises for one bad machine."""
    from dlegion_cc.pipeline import Options, compile_model
    if config.arch is None:
        return failed_row(config, config.error)
    try:
        _, program = compile_model(model, Options(config.arch, dims, **(switches or {})))
        return measure(program, config.arch)
    except Exception as e:  # noqa: BLE001 - one machine's failure must not end the sweep
        return failed_row(config, _reason(e))


def _reason(e: Exception) -> str:
    from dlegion_cc.errors import CompileError
    from isa.arch import ArchError
    from runtime.timing import Deadlock, TimingError
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, (CompileError, ArchError, ProgramError, Deadlock, TimingError)):
        return first
    return f"internal error: {type(e).__name__}: {first}"   # a compiler bug, named as such


def measure(program: Program, arch: Arch) -> dict:
    """The row of a compiled program: cycles, throughput against its roofline, traffic, bounds."""
    tl = simulate(program, arch)
    n = summarize(RunResult(outputs={}, timeline=tl, arch=arch, program=tl.program, machine=None))
    mode = _busiest_mode(n)
    peak = n["peak_tops"][mode]
    dram = n["dram_read_bytes"] + n["dram_write_bytes"]
    intensity = 2.0 * n["macs"] / dram if dram else None
    terms = bound_terms(tl, arch, dram)
    return {
        "name": arch.name, "status": "ok", "reason": "", "warning": verify_warning(program, arch),
        "legions": arch.legions, "cores": arch.cores,
        "array": arch.array, "dataflow": arch.dataflow, "clock_ghz": arch.clock_ghz,
        "cycles": n["cycles"], "time_us": n["time_s"] * 1e6, "macs": n["macs"],
        "achieved_tops": n["achieved_tops"], "peak_tops": peak, "peak_mode": mode,
        "peak_fraction": n["achieved_tops"] / peak if peak else 0.0,
        "dram_read_bytes": n["dram_read_bytes"], "dram_write_bytes": n["dram_write_bytes"],
        "dram_bytes": dram, "dram_gbps": arch.dram_gbps, "intensity": intensity,
        "roof_tops": roof(peak, arch.dram_gbps, intensity),
        "psum_bytes": n["psum_bytes"], "energy_uj": n["energy_joules"] * 1e6,
        "area_mm2": n["area_mm2"], "tops_per_mm2": n["achieved_tops_per_mm2"],
        "pareto": False, "pareto_energy": False,     # set over the whole sweep (dse.mark_pareto)
        "instructions": len(program.instrs),
        "compute_cycles": terms["compute"], "dram_cycles": terms["DRAM"], "vector_cycles": terms["vector"],
        "bound": max(BOUNDS, key=lambda b: terms[b]),
        # Matmuls whose passes ran on fewer Legions than the machine has (JSON only): their
        # output columns fill fewer array-wide tiles than there are Legions.
        "narrow_matmuls": [{"region": m["region"], "legions": m["legions"]}
                           for m in n["matmuls"] if m["legions"] < arch.legions],
    }


def verify_warning(program: Program, arch: Arch) -> str:
    """The first problem ``isa.verify`` finds, or "": the timing model costs a program whose fields
    do not encode or whose views overrun a scratchpad, so its numbers are flagged, not dropped."""
    from isa.verify import verify
    try:
        verify(program, arch)
    except ProgramError as e:
        lines = str(e).strip().splitlines()
        more = f" (and {len(lines) - 1} more problem line(s))" if len(lines) > 1 else ""
        return f"does not verify: {lines[0]}{more}"
    return ""


def _busiest_mode(n: dict) -> str:
    """The mode most MACs ran in: its peak is the one the run is measured against."""
    used = {m: v for m, v in n["macs_by_mode"].items() if v > 0 and m in n["peak_tops"]}
    if used:
        return max(used, key=used.get)
    return max(n["peak_tops"], key=n["peak_tops"].get)


def roof(peak_tops: float, dram_gbps: float, intensity: float | None) -> float:
    """Attainable TOPS at ``intensity`` ops per DRAM byte: min(peak, intensity x bandwidth)."""
    if intensity is None:
        return peak_tops
    return min(peak_tops, intensity * dram_gbps / 1000.0)


def bound_terms(tl, arch: Arch, dram_bytes: int) -> dict[str, int]:
    """Lower bounds on the cycles: the busiest Legion's matrix queue, DRAM bytes at full
    bandwidth, and the busiest Legion's vector queue (vector instructions and drains)."""
    def busiest(queue: str) -> int:
        return max((tl.busy.get((legion, queue), 0) for legion in range(arch.legions)), default=0)
    return {"compute": busiest("mat"), "vector": busiest("vec"),
            "DRAM": math.ceil(dram_bytes / arch.derived.dram_bytes_per_cycle)}
