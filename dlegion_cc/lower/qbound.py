"""Floors under what any schedule of a quantized matmul costs, from the architecture alone.

The schedules ``qplan`` searches keep each output tile in a Legion's accumulators until it has
summed all of K, and stream the tile's rows through the arrays in passes of ``rows +
pass_overhead`` cycles. Two figures pull against each other:

- **Pass overhead.** Cutting the rows into ``bands`` (row blocks of a Legion, or parts of the
  rows on Legions of their own) makes passes shorter, so the arrays spend more of their time
  on the overhead.
- **Re-reads.** A tile of ``h`` rows is at most ``acc / h`` columns wide. All of its ``h x K``
  activations stream through the Legion's ``act`` scratchpad and all of its weights through
  ``wgt``, which can keep at most their capacity for the next tile. Taller tiles mean more
  tiles per Legion, each reading again the activations the scratchpad could not keep; more
  row blocks mean reading the weights again.

A schedule could also keep partial sums outside the accumulators: drained (``drain`` adding
into ``vec``) as fp32 integers, exact below 2**24, and scaled once complete. The arrays still
make them in the accumulators: a column of the tile held in ``vec`` also needs room there for
what the current pass adds to it, at least one window of the tile's rows. ``vec=True`` gives
the floors of such schedules: their tiles hold ``acc + vec`` elements less one such window.

``reread_floor`` gives the fewest bytes read beyond the compulsory ones for a number of bands;
``fewest_cycles`` the fewest pass cycles of several matmuls whose re-reads together
stay within a number of bytes. Both are lower bounds, checked against emitted schedules in
the tests: any real schedule does at least as badly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from isa.arch import MODE_BITS, MODE_TILES, Arch


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


def psum_room(arch: Arch, s: Shape, rows: int, vec: bool = False) -> int:
    """Partial sums a Legion can hold for a tile of ``rows`` rows: the accumulators, or (``vec``)
    the accumulators and ``vec`` less the window of rows the arrays add into."""
    cap = arch.derived.spad_elems
    return cap["acc"] + cap["vec"] - rows * arch.array * MODE_TILES[s.mode] if vec else cap["acc"]


def reread_floor(arch: Arch, s: Shape, bands: int, vec: bool = False) -> int:
    """Bytes beyond the compulsory ``M x K`` activations and ``K x N`` weights that any schedule
    whose rows are cut into ``bands`` reads from DRAM: ``parts`` of the rows on Legions of their
    own (their activations are their own), each part's rows in ``bands / parts`` blocks. The
    best of the ways to factor ``bands`` and of the tile widths.

    A Legion with ``n`` columns, blocks of ``h`` rows and tiles ``w`` columns wide (``h x w`` at
    most ``psum_room``) visits each block once per column tile and each
    column tile once per block. A tile streams all of K: each visit but a block's first reads
    its ``h x K`` activations again, but for what ``act`` kept; each but a column tile's first
    its ``K x w`` weights, but for what ``wgt`` kept. A multicast serves a part's Legions with
    one read of the activations, and the Legions of every part with the same columns with one
    read of the weights."""
    cap = arch.derived.spad_elems
    per_weight = MODE_BITS[s.mode] / 8
    best = math.inf
    for parts in range(1, bands + 1):
        if bands % parts or arch.legions % parts:
            continue
        blocks, legions = bands // parts, arch.legions // parts
        rows = -(-s.M // parts)
        h = max(1, rows // blocks)
        n = -(-s.N // (arch.array * legions)) * arch.array
        for w in range(arch.array, max(arch.array, min(n, psum_room(arch, s, h, vec) // h)) + 1, arch.array):
            columns = -(-n // w)
            again = blocks * columns
            act = (again - blocks) * max(0, h * s.K - cap["act"])
            wgt = (again - columns) * max(0, w * s.K * per_weight - cap["wgt"])
            best = min(best, parts * act + legions * wgt)
    return int(best)


def fewest_cycles(arch: Arch, shapes: list[Shape], allowance: float, most_bands: int = 4,
                  vec: bool = False) -> float:
    """The fewest pass cycles of ``shapes`` together whose re-reads (``reread_floor``)
    add up to at most ``allowance`` bytes, each matmul's work split between band counts up to
    ``most_bands`` in any proportion (the linear relaxation: a floor for whole choices too).
    ``inf`` if not even ``most_bands`` bands everywhere keep within it."""
    options = [[(reread_floor(arch, s, b, vec), pass_floor(arch, s, b)) for b in range(1, most_bands + 1)]
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
