"""Floors under what any schedule of a quantized matmul costs, from the architecture alone.

The schedules ``qplan`` searches keep each output tile in a Legion's accumulators until it has
summed all of K, and stream the tile's rows through the arrays in passes of ``rows +
pass_overhead`` cycles. Two figures pull against each other:

- **Pass overhead.** Cutting the rows into ``bands`` (row blocks of a Legion, or parts of the
  rows on Legions of their own) makes passes shorter, so the arrays spend more of their time
  on the overhead.
- **Activation re-reads.** A tile of ``h`` rows is at most ``acc / h`` columns wide. All of its
  ``h x K`` activations stream through the Legion's ``act`` scratchpad, which can keep at most
  its capacity of them for the next tile. Taller tiles mean more tiles per Legion, each
  reading again what the scratchpad could not keep.

A schedule could also keep partial sums outside the accumulators: drained (``drain`` adding
into ``vec``) as fp32 integers, exact below 2**24, and scaled once complete. ``psums`` gives
the elements a Legion holds partial sums in, so the floors of such schedules follow too.

``reread_floor`` gives the fewest activation bytes beyond the compulsory ``M x K`` for a number
of bands; ``fewest_cycles`` the fewest pass cycles of several matmuls whose re-reads together
stay within a number of bytes. Both are lower bounds, checked against emitted schedules in
the tests: any real schedule does at least as badly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from isa.arch import Arch


@dataclass(frozen=True)
class Shape:
    M: int
    K: int
    N: int
    mode: str


def pass_floor(arch: Arch, s: Shape, bands: int) -> float:
    """Cycles of the arrays if every pass streams the rows of one of ``bands`` row blocks:
    the compute bound stretched by a pass overhead per block, on all the arrays at once."""
    d = arch.derived
    return s.M * s.K * s.N / d.macs_per_cycle[s.mode] * (s.M + bands * d.pass_overhead) / s.M


def reread_floor(arch: Arch, s: Shape, bands: int, psums: int | None = None) -> int:
    """Activation bytes beyond ``M x K`` read from DRAM by any schedule whose rows are cut into
    ``bands``: ``parts`` of the rows on Legions of their own (their activations are their own),
    each part's rows in ``bands / parts`` blocks. The best of the ways to factor ``bands``.

    A Legion with ``n`` columns and tiles of ``h`` rows has at least ``blocks * ceil(n / w)``
    tiles, ``w = psums / h`` (default: the accumulators); each after the first reads its
    ``h x K`` activations but for what ``act`` kept. A multicast serves a part's Legions with
    one read."""
    cap = arch.derived.spad_elems
    psums = psums or cap["acc"]
    best = math.inf
    for parts in range(1, bands + 1):
        if bands % parts or arch.legions % parts:
            continue
        blocks, legions = bands // parts, arch.legions // parts
        rows = -(-s.M // parts)
        h = max(1, rows // blocks)
        n = -(-s.N // (arch.array * legions)) * arch.array
        tiles = blocks * -(-n // min(n, max(1, psums // h)))
        legion = max(rows * s.K, h * s.K + (tiles - 1) * max(0, h * s.K - cap["act"]))
        best = min(best, max(0, parts * legion - s.M * s.K))
    return int(best)


def fewest_cycles(arch: Arch, shapes: list[Shape], allowance: float, most_bands: int = 4,
                  psums: int | None = None) -> float:
    """The fewest pass cycles of ``shapes`` together whose activation re-reads (``reread_floor``)
    add up to at most ``allowance`` bytes, each matmul's work split between band counts up to
    ``most_bands`` in any proportion (the linear relaxation: a floor for whole choices too).
    ``inf`` if not even ``most_bands`` bands everywhere keep within it."""
    options = [[(reread_floor(arch, s, b, psums), pass_floor(arch, s, b)) for b in range(1, most_bands + 1)]
               for s in shapes]
    return mix(options, allowance)


def mix(options: list[list[tuple[float, float]]], allowance: float) -> float:
    """min sum(cost) over one convex combination of each item's (bytes, cost) options, with
    sum(bytes) <= ``allowance``. Each item starts at its cheapest option; bytes are then saved
    along the items' convex hulls, the segments that cost least per byte saved first."""
    total, excess, segments = 0.0, -allowance, []
    for points in options:
        hull = _hull(points)
        total += hull[0][1]
        excess += hull[0][0]
        segments += [((c1 - c0) / (b0 - b1), b0 - b1) for (b0, c0), (b1, c1) in zip(hull, hull[1:])]
    for per_byte, saved in sorted(segments):
        if excess <= 0:
            break
        take = min(saved, excess)
        total += per_byte * take
        excess -= take
    return total if excess <= 1e-9 else math.inf


def _hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """From the cheapest point, the lower convex hull towards fewer bytes: each step saves
    bytes at a higher cost per byte than the step before."""
    start = min(points, key=lambda p: (p[1], p[0]))
    hull = [start]
    while True:
        rest = [p for p in points if p[0] < hull[-1][0]]
        if not rest:
            return hull
        b0, c0 = hull[-1]
        hull.append(min(rest, key=lambda p: ((p[1] - c0) / (b0 - p[0]), p[0])))
