"""A fused matmul's last, part-empty window taken off its Legions and shared by a few of them.

A fused matmul deals its columns evenly to the Legions (``qmatmul.legion_major``). Where each
Legion's share leaves its last pass part empty, every Legion pays that pass in full: 2B4T's
Q/K/V, 480 columns a Legion on dlegion-8x8, are 7.5 w2 windows of 64, and the half-empty eighth
costs a pass of all the rows for half a window's work. The last segment's columns past the
Legions' whole windows (the last 256 of V) become a matmul of their own over all the rows, after
the rest's last row block (in a chain, a step of its own at the chain's end, which nothing in the
chain reads), its rows cut into parts, each on as few Legions as its columns fill a window of (2
parts of 4 Legions there, ``qparts``): each Legion then passes half the rows through one window
instead of all of them through a half-empty one.
"""
from __future__ import annotations

from dataclasses import dataclass

from isa.arch import Arch
from dlegion_cc.lower.qparts import PART_ROWS

@dataclass(frozen=True)
class Rest:
    """The last ``columns`` columns of the last segment, on parts of ``width`` Legions."""

    columns: int
    width: int


def split(arch: Arch, segments: list[int] | None, tiles: int, rows: int) -> Rest | None:
    """The columns of ``segments`` (a fused matmul's, in a mode whose passes hold ``tiles``
    windows) split off to fill the Legions' last windows, for blocks of ``rows`` rows; None
    where every Legion's share fills its windows, or where the split has no parts to cut."""
    if not segments or len(segments) < 2:
        return None
    legions, window = arch.legions, arch.array * tiles
    widths = [-(-n // legions) for n in segments]
    per = -(-sum(widths) // arch.array) * arch.array
    kept = min(segments[-1], (per - per % window - sum(widths[:-1])) * legions)
    columns = segments[-1] - kept
    if not per % window or kept <= 0 or columns <= 0:
        return None
    width = next(w for w in range(1, legions + 1) if legions % w == 0 and w * window >= columns)
    parts = legions // width
    if parts < 2 or rows // parts < PART_ROWS * arch.array:
        return None
    return Rest(columns, width)


def kept(segments: list[int], rest: Rest) -> list[int]:
    """The segments of the matmul left after ``rest`` is split off."""
    return segments[:-1] + [segments[-1] - rest.columns]

