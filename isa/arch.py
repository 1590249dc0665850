"""The architecture description: independent parameters from TOML, derived figures in one place.

A preset is a TOML file in ``isa/presets``; a user passes ``--arch NAME`` or ``--arch FILE.toml``.
Nothing else in the code base reads a machine number from anywhere but an :class:`Arch` handed
to it explicitly.
"""
from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field, fields
from functools import cached_property
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

from isa.fields import ADDR_BITS
from isa.files import check_readable

MODES = ("w8", "w4", "w2")
MODE_BITS = {"w8": 8, "w4": 4, "w2": 2}
# Resident N x N weight tiles one pass holds in each mode (ADiP asymmetric multi-matrix).
MODE_TILES = {"w8": 1, "w4": 2, "w2": 4}
DATAFLOWS = ("dip", "ws")


ENERGY = ("pj_per_mac_w8", "pj_per_mac_w4", "pj_per_mac_w2", "pj_per_dram_byte", "pj_per_sram_byte",
          "pj_per_vector_op", "static_watts")
# Silicon area, in square micrometres at the process node ``area_node_nm`` (see the presets for
# their sources): a PE by each mode it may support, each KiB of scratchpad
# (single-ported) and of accumulator scratchpad (read-modify-write every cycle), each int32
# adder of the accumulators, each fp32 vector lane, and each byte a cycle of a Legion's link.
AREA = ("um2_per_pe_w8", "um2_per_pe_w4", "um2_per_pe_w2", "um2_per_sram_kib", "um2_per_acc_kib",
        "um2_per_adder", "um2_per_vector_lane", "um2_per_link_byte")


class ArchError(ValueError):
    """A malformed or unknown architecture description."""


@dataclass(frozen=True)
class Arch:
    """Independent parameters of one machine (see docs/MACHINE.md for their meaning)."""

    name: str
    description: str
    # chip
    legions: int
    clock_ghz: float
    dram_gbps: float
    dram_latency_cycles: int
    noc_link_gbps: float
    multicast: bool
    # Legion
    cores: int
    parallel_accumulators: bool
    acc_port_words: int           # int32 psum words a cycle the accumulator scratchpad reads or writes
    act_kib: int
    wgt_kib: int
    acc_kib: int
    vec_kib: int
    vector_lanes: int
    vector_transcendental_cycles: int
    # core
    array: int
    modes: tuple[str, ...]
    dataflow: str
    double_buffered_weights: bool
    pass_overlap: bool            # consecutive passes of one MatMul pipeline their fill and drain
    # energy (picojoules per operation or per byte moved; see the presets for their sources).
    # Every description gives all three MAC figures; a mode the machine lacks never uses its own.
    pj_per_mac_w8: float
    pj_per_mac_w4: float
    pj_per_mac_w2: float
    pj_per_dram_byte: float
    pj_per_sram_byte: float       # scratchpad and accumulator (psum) traffic
    pj_per_vector_op: float       # one lane-op of the vector unit (fp32)
    static_watts: float           # leakage and clock tree, drawn for the whole run
    # area (square micrometres at ``area_node_nm``; see AREA). Every description gives all
    # three PE figures; a PE is as large as the largest figure of the modes it supports.
    area_node_nm: int
    um2_per_pe_w8: float
    um2_per_pe_w4: float
    um2_per_pe_w2: float
    um2_per_sram_kib: float       # act, wgt and vec scratchpads
    um2_per_acc_kib: float        # the accumulator scratchpad
    um2_per_adder: float          # one int32 adder of a core's accumulation (or of the adder tree)
    um2_per_vector_lane: float
    um2_per_link_byte: float      # a Legion's NoC link and router, per byte a cycle of its width
    # published figures to compare with (not parameters: nothing is computed from them)
    published_peak_tops: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        why = problem({f.name: getattr(self, f.name) for f in fields(self)})
        if why:
            raise ArchError(f"{self.name}: {why}")

    @cached_property
    def derived(self) -> "Derived":
        return derive(self)


@dataclass(frozen=True)
class Derived:
    """Figures computed from an :class:`Arch`; the only place they are computed."""

    pes_per_core: int
    macs_per_cycle: dict          # mode -> MACs per cycle for the whole chip
    peak_tops: dict               # mode -> tera-ops per second (2 ops per MAC)
    dram_bytes_per_cycle: float
    link_bytes_per_cycle: float
    spad_elems: dict              # space -> capacity in elements per Legion
    pass_overhead: int            # cycles a pass adds to its M streamed rows: N (DiP) or 2N (WS)
    weight_load_cycles: int       # cycles to load one window of weight tiles
    pj_per_mac: dict              # mode -> picojoules per MAC
    area_mm2: dict                # part -> square millimetres for the whole chip (see ``area``)
    total_mm2: float
    tops_per_mm2: dict            # mode -> peak tera-ops per second per square millimetre


ELEM_BYTES = {"act": 1, "wgt": 1, "acc": 4, "vec": 4}


def derive(a: Arch) -> Derived:
    pes = a.array * a.array
    parts = area(a)
    total = sum(parts.values())
    macs = {m: a.legions * a.cores * pes * MODE_TILES[m] for m in a.modes}
    kib = {"act": a.act_kib, "wgt": a.wgt_kib, "acc": a.acc_kib, "vec": a.vec_kib}
    return Derived(
        pes_per_core=pes,
        macs_per_cycle=macs,
        peak_tops={m: 2 * v * a.clock_ghz / 1000.0 for m, v in macs.items()},
        dram_bytes_per_cycle=a.dram_gbps / a.clock_ghz,
        link_bytes_per_cycle=a.noc_link_gbps / a.clock_ghz,
        spad_elems={s: kib[s] * 1024 // ELEM_BYTES[s] for s in kib},
        pass_overhead=a.array if a.dataflow == "dip" else 2 * a.array,
        weight_load_cycles=a.array,
        pj_per_mac={m: getattr(a, f"pj_per_mac_{m}") for m in a.modes},
        area_mm2=parts,
        total_mm2=total,
        tops_per_mm2={m: 2 * v * a.clock_ghz / 1000.0 / total for m, v in macs.items()},
    )


def area(a: Arch) -> dict:
    """The chip's area by part, in mm^2: the arrays' PEs (each the largest figure of the modes
    it supports: an adaptive PE is built for its narrowest mode), the accumulators (a core's int32 adders, one per output lane of a pass:
    ``array`` columns times the windows its mode holds; with parallel accumulators the same
    count forms the adder tree across the cores, plus the accumulator scratchpad), the other
    scratchpads, the vector lanes, and the NoC (one link and router per Legion, as wide as the
    link's bytes a cycle; a one-Legion machine has none: its link is the DRAM port). DRAM, its
    PHY and the host interface are the same for every machine and left out."""
    pe = max(getattr(a, f"um2_per_pe_{m}") for m in a.modes)
    lanes = a.array * max(MODE_TILES[m] for m in a.modes)
    per_legion = {
        "PEs": a.cores * a.array * a.array * pe,
        "accumulators": a.cores * lanes * a.um2_per_adder + a.acc_kib * a.um2_per_acc_kib,
        "scratchpads": (a.act_kib + a.wgt_kib + a.vec_kib) * a.um2_per_sram_kib,
        "vector": a.vector_lanes * a.um2_per_vector_lane,
        "NoC": a.noc_link_gbps / a.clock_ghz * a.um2_per_link_byte if a.legions > 1 else 0.0,
    }
    return {k: a.legions * v / 1e6 for k, v in per_legion.items()}


# --- validation: a description gives every parameter a value of its type and range --------------
# Counts and sizes are positive integers; the clock and bandwidths divide other figures, so they
# are positive; a latency or an energy may be 0. TOML's integers are numbers too.

POSITIVE = {"legions", "cores", "array", "vector_lanes", "vector_transcendental_cycles", "act_kib", "wgt_kib",
            "acc_port_words", "acc_kib", "vec_kib", "clock_ghz", "dram_gbps", "noc_link_gbps", "area_node_nm",
            "um2_per_pe_w8", "um2_per_pe_w4", "um2_per_pe_w2"}
NOT_NEGATIVE = {"dram_latency_cycles", *ENERGY, *AREA}
# The timing and energy models divide and multiply by these numbers: a subnormal clock or
# bandwidth, or an energy near the float maximum, makes cycles or joules infinite (or NaN). Every
# real number of a description lies within FLOATS (0 allowed where NOT_NEGATIVE), and a DMA moves
# between 1/1024 and 2**40 bytes a cycle, far beyond any machine's either way.
FLOATS = (1e-6, 1e6)
BYTES_PER_CYCLE = (2.0 ** -10, 2.0 ** 40)


def _number(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


# By annotation: (test of the value's type, what it must be).
_TYPES = {
    "int": (lambda v: type(v) is int, "an integer"),
    "float": (_number, "a number"),
    "bool": (lambda v: type(v) is bool, "true or false"),
    "str": (lambda v: type(v) is str, "a string"),
    "tuple[str, ...]": (lambda v: type(v) is tuple and all(type(m) is str for m in v), "a list of strings"),
    "dict": (lambda v: type(v) is dict and all(_number(x) and x > 0 for x in v.values()),
             "a table of positive numbers"),
}


def _shown(v) -> str:
    """A value as the TOML file spells it."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, int) and v.bit_length() > 128:     # printing it in full may pass int()'s limit
        return f"an integer of {v.bit_length()} bits"
    return json.dumps(list(v) if isinstance(v, tuple) else v, default=str)


def _value_problem(name: str, annotation: str, v) -> str | None:
    is_type, what = _TYPES[annotation]
    if name in POSITIVE:
        what = "a positive " + what.split(" ", 1)[1]
    if not is_type(v) or (name in POSITIVE and v <= 0):
        return f"{name} must be {what}, not {_shown(v)}"
    if type(v) is int and v.bit_length() > 63:     # no machine has one; the checks below would print it
        return f"{name} is out of range ({_shown(v)})"
    if name in NOT_NEGATIVE and v < 0:
        return f"{name} must not be negative (is {_shown(v)})"
    if annotation == "float" and not (v == 0 or FLOATS[0] <= v <= FLOATS[1]):
        zero = "0 or " if name in NOT_NEGATIVE else ""
        return f"{name} must be {zero}between {FLOATS[0]:g} and {FLOATS[1]:g}, not {_shown(v)}"
    if annotation == "dict" and not all(FLOATS[0] <= x <= FLOATS[1] for x in v.values()):
        return f"{name} values must be between {FLOATS[0]:g} and {FLOATS[1]:g}"
    return None


def _rate_problem(values: dict) -> str | None:
    """A bandwidth over the clock, in bytes per cycle, outside BYTES_PER_CYCLE."""
    lo, hi = BYTES_PER_CYCLE
    for name in ("dram_gbps", "noc_link_gbps"):
        rate = values[name] / values["clock_ghz"]
        if not lo <= rate <= hi:
            return (f"{name} / clock_ghz is {rate:g} bytes per cycle; a DMA moves between 1/1024 and 2**40 "
                    f"bytes a cycle")
    return None


def problem(values: dict) -> str | None:
    """Why no machine has these parameter values (a dict by :class:`Arch` field), or None."""
    for f in fields(Arch):
        why = _value_problem(f.name, f.type, values[f.name])
        if why:
            return why
    why = _rate_problem(values)
    if why:
        return why
    modes, dataflow = values["modes"], values["dataflow"]
    if not modes or any(m not in MODES for m in modes):
        return f"modes must be a non-empty subset of {MODES}, got {modes}"
    if dataflow not in DATAFLOWS:
        return f"dataflow must be one of {DATAFLOWS}, got {dataflow!r}"
    # A pass can only start while the previous one drains if its weights are already resident.
    if values["pass_overlap"] and not values["double_buffered_weights"]:
        return "pass_overlap needs double_buffered_weights = true (the next window loads during a pass)"
    # The weights of a mode pack a row of the array into whole bytes: the packed weight layout,
    # the DMA and the verifier all address them by the byte, so a part-byte row cannot be stored.
    for m in modes:
        bits = values["array"] * MODE_BITS[m]
        if bits % 8:
            return (f"array {values['array']}: a row of {values['array']} {m} weights is {bits} bits, "
                    f"not whole bytes")
    if values["legions"] > 64:
        return "at most 64 Legions (the multicast set is a 64-bit mask)"
    too_big = [s for s, n in derive(SimpleNamespace(**values)).spad_elems.items() if n > 1 << ADDR_BITS]
    if too_big:
        return (f"{', '.join(f'{s}_kib' for s in too_big)} holds more than the "
                f"{1 << (ADDR_BITS - 20)} Mi elements a {ADDR_BITS}-bit address reaches")
    return None


SECTIONS = ("chip", "legion", "core", "energy", "area")


def _flatten(doc: dict, source: str) -> dict:
    """The parameters of a description, whatever table holds them (unknown keys are kept, to be
    reported)."""
    flat = {k: v for k, v in doc.items() if k not in SECTIONS and k != "published"}
    flat.setdefault("description", "")
    published = doc.get("published", {})
    if not isinstance(published, dict):
        raise ArchError(f"{source}: [published] must be a table")
    flat["published_peak_tops"] = published.get("peak_tops", {})
    for section in SECTIONS:
        part = doc.get(section)
        if not isinstance(part, dict):
            raise ArchError(f"{source}: missing table [{section}]")
        flat.update(part)
    return flat


def from_toml_text(text: str, source: str) -> Arch:
    """The machine a description's text describes; every error names ``source``."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ArchError(f"{source}: {e}") from None
    except ValueError:      # an integer past int()'s 4,300 digits, which tomllib does not catch
        raise ArchError(f"{source}: a number out of range (more than 4,300 digits)") from None
    flat = _flatten(doc, source)
    names = {f.name for f in fields(Arch)}
    unknown = sorted(set(flat) - names)
    missing = sorted(names - set(flat))
    if unknown:
        raise ArchError(f"{source}: unknown parameter(s) {', '.join(unknown)}")
    if missing:
        raise ArchError(f"{source}: missing parameter(s) {', '.join(missing)}")
    if isinstance(flat["modes"], list):
        flat["modes"] = tuple(flat["modes"])
    why = problem(flat)
    if why:
        raise ArchError(f"{source}: {why}")
    return Arch(**flat)


def preset_names() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in resources.files("isa.presets").iterdir()
                  if p.name.endswith(".toml"))


def load(spec: str | Path, base: Path | None = None) -> Arch:
    """Load a preset by name, or a TOML file (relative paths resolved against ``base``)."""
    spec = str(spec)
    if not spec.endswith(".toml"):
        if spec not in preset_names():
            raise ArchError(f"unknown architecture {spec!r}; presets: {', '.join(preset_names())}")
        text = resources.files("isa.presets").joinpath(spec + ".toml").read_text()
        return from_toml_text(text, spec)
    path = Path(spec) if base is None or Path(spec).is_absolute() else base / spec
    try:
        check_readable(path)        # a FIFO or a device would block or never end
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ArchError(f"{path}: cannot read architecture file ({getattr(e, 'strerror', None) or e})") from None
    return from_toml_text(text, str(path))


def summary(a: Arch) -> str:
    """Derived figures of a machine, for users to check against the published ones."""
    d = a.derived
    lines = [f"{a.name}: {a.description}",
             f"  {a.legions} Legions x {a.cores} cores x {a.array}x{a.array} PEs, {a.dataflow}, "
             f"{a.clock_ghz:g} GHz",
             f"  DRAM {d.dram_bytes_per_cycle:g} B/cycle, latency {a.dram_latency_cycles} cycles; "
             f"link {d.link_bytes_per_cycle:g} B/cycle; multicast {'on' if a.multicast else 'off'}; "
             f"parallel accumulators {'on' if a.parallel_accumulators else 'off'}; "
             f"pass overlap {'on' if a.pass_overlap else 'off'}"]
    lines.append(f"  energy: DRAM {a.pj_per_dram_byte:g} pJ/B, SRAM {a.pj_per_sram_byte:g} pJ/B, "
                 f"vector {a.pj_per_vector_op:g} pJ/lane-op, static {a.static_watts:g} W")
    parts = ", ".join(f"{k} {v:.2f}" for k, v in d.area_mm2.items())
    lines.append(f"  area: {d.total_mm2:.2f} mm^2 at {a.area_node_nm} nm ({parts})")
    for m in a.modes:
        line = (f"  {m}: {d.macs_per_cycle[m]} MACs/cycle, {d.pj_per_mac[m]:g} pJ/MAC, "
                f"peak {d.peak_tops[m]:.2f} TOPS, {d.tops_per_mm2[m]:.3f} TOPS/mm^2")
        if m in a.published_peak_tops:
            pub = a.published_peak_tops[m]
            line += f" (published {pub:g}; ours {100 * (d.peak_tops[m] / pub - 1):+.1f}%, reports use ours)"
        lines.append(line)
    return "\n".join(lines)
