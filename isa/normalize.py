"""A baseline machine scaled to a reference machine, so that a comparison says what it holds equal.

Three footings: the baseline **as published**; at **equal PEs**, with as many arrays as it takes
to reach the reference's PE count (more cores in its one Legion, sharing its scratchpads and
DRAM, each array with its own row of the psum port); and at **equal peak w8 TOPS**, the equal-PE
machine clocked to the reference's w8 peak (DRAM keeps its bytes a second). Each is an
:class:`Arch` built with ``dataclasses.replace``, which checks it as a description file is checked.
"""
from __future__ import annotations

import dataclasses
import math

from isa.arch import Arch

PUBLISHED, EQUAL_PES, EQUAL_PEAK = "as published", "equal PEs", "equal w8 peak"


def pe_count(a: Arch) -> int:
    return a.legions * a.cores * a.derived.pes_per_core


def equal_pes(base: Arch, ref: Arch) -> Arch:
    """``base`` with ceil(ref PEs / base PEs) times its arrays (itself when that is 1)."""
    k = -(-pe_count(ref) // pe_count(base))
    if k == 1:
        return base
    return dataclasses.replace(base, name=f"{base.name} x{k}", cores=base.cores * k,
                               acc_port_words=base.acc_port_words * k,
                               description=f"{base.description}, {k} times its arrays")


def equal_peak(base: Arch, ref: Arch) -> Arch:
    """The equal-PE machine clocked to ``ref``'s peak w8 TOPS (itself when already equal)."""
    scaled = equal_pes(base, ref)
    clock = scaled.clock_ghz * ref.derived.peak_tops["w8"] / scaled.derived.peak_tops["w8"]
    if math.isclose(clock, scaled.clock_ghz, rel_tol=1e-9):
        return scaled
    return dataclasses.replace(scaled, name=f"{scaled.name} @{clock:.3g}GHz", clock_ghz=clock,
                               description=f"{scaled.description}, at {clock:.4g} GHz")


def footings(base: Arch, ref: Arch) -> list[tuple[Arch, str]]:
    """Each distinct machine of the three footings, with the footings it stands for."""
    out: list[tuple[Arch, list[str]]] = []
    for label, machine in ((PUBLISHED, base), (EQUAL_PES, equal_pes(base, ref)), (EQUAL_PEAK, equal_peak(base, ref))):
        same = next((names for m, names in out if m == machine), None)
        if same is None:
            out.append((machine, [label]))
        else:
            same.append(label)
    return [(m, " = ".join(names)) for m, names in out]
