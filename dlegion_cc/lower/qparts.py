"""Cutting a matmul's rows into parts, each on Legions of its own.

Output columns are dealt to the Legions in array-wide slices. Where that deal keeps Legions
idle (a product narrower than the Legions), or fills a Legion's passes badly (the slices of a
Legion do not fill the last of its w2 or w4 passes, which hold 4 or 2 windows), the rows are
cut into parts instead, each on a share of the Legions with wider slices. Each part
multicasts its own activation rows and reads the weights itself.
"""
from __future__ import annotations

from typing import Callable

from isa.arch import Arch
from dlegion_cc.lower.context import Switches
from dlegion_cc.lower.qplan import EQUAL, Problem, score, search

# A part of the rows given Legions of their own is at least this many array heights of rows.
PART_ROWS = 4
# Parts worth modelling for a matmul with constant weights.
PART_COUNTS = (2, 4)


def row_parts(arch: Arch, rows: int, n_pad: int) -> tuple[int, int]:
    """(Legions per part, parts): a matmul whose output columns fill fewer array-wide slices
    than there are Legions is cut into parts of its rows, each on Legions of its own (their
    activation rows are their own; each part reads the weights). Of the ways to deal the
    Legions, the one that keeps the most of them busy, then the one with the fewest parts."""
    slices, legions = n_pad // arch.array, arch.legions
    most = max(1, rows // (PART_ROWS * arch.array))
    deals = [(width, min(legions // width, most)) for width in range(1, legions + 1) if legions % width == 0]

    def busy(deal: tuple[int, int]) -> int:
        width, parts = deal
        per = -(-slices // width)                  # slices per Legion
        return parts * -(-slices // per)
    width, parts = max(deals, key=lambda d: (busy(d), -d[1], d[0]))
    return (width, parts) if parts > 1 else (legions, 1)


def part_widths(arch: Arch, rows: int, slices: int, tiles: int) -> list[int]:
    """Legions per part worth modelling for a matmul of ``rows`` rows whose columns fill
    ``slices`` array-wide slices, in a mode whose passes hold ``tiles`` windows: all the
    Legions, and parts of fewer where a Legion's slices leave its last pass part empty."""
    if -(-slices // arch.legions) % tiles == 0:
        return [arch.legions]
    return [arch.legions] + [arch.legions // k for k in PART_COUNTS
                             if arch.legions % k == 0 and rows // k >= PART_ROWS * arch.array]


def pick_width(arch: Arch, switches: Switches, widths: list[int], part: Callable[[int], Problem]) -> int:
    """Of ``widths`` (the first: all the Legions), the one whose first part (``part(width)``)
    the cost model finds better than all the others by more than ``EQUAL``, by the objective
    of ``switches``; the parts run alongside each other, alike (their energy adds up, their
    time does not). One width needs no model: its plan is chosen when emitted."""
    best, cost = widths[0], None
    if len(widths) == 1:
        return best
    for width in widths:
        p = part(width)
        e, plan = search(arch, p, switches)
        c = score(arch, p, plan, e, switches.objective, arch.legions // width)
        if cost is None or c < cost * (1 - EQUAL):
            best, cost = width, c
    return best


def split_rows(rows: range, parts: int) -> list[range]:
    """``rows`` cut into ``parts`` near-equal runs."""
    n = len(rows)
    return [range(rows.start + j * n // parts, rows.start + (j + 1) * n // parts) for j in range(parts)]
