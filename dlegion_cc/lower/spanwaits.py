"""Waits of consecutive Legions on their own queues, one instruction for them all.

The passes that reorder a program (prefetch, early loads, overlap) rewrite each Legion's
conditions on its own, and leave runs of waits such as ``wait L0 dma L0.vec~5``, ``wait L1 dma
L1.vec~5``, ... : the same wait on every Legion of a run, each on its own. One wait spanning
the run, its condition on each Legion's own queue (``vec~5``), expands to the same tasks in the
same order (isa/expand.py), so the machine does exactly what it did; the program is shorter
(some 2,400 of a 2B4T layer's 22,000 instructions at sequence 256).
"""
from __future__ import annotations

from dataclasses import replace

from isa.fields import Cond
from isa.instructions import Wait
from isa.program import Program


def span_waits(program: Program) -> Program:
    """``program`` with each run of per-Legion waits (:func:`_own`) that :func:`_follows` links
    made one spanning wait; a run does not cross the start of a region."""
    instrs, starts = program.instrs, {start for start, _ in program.regions}
    out: list = []
    new_index = [0] * (len(instrs) + 1)
    k = 0
    while k < len(instrs):
        first = instrs[k]
        end = k + 1
        if _own(first):
            while end < len(instrs) and end not in starts and _follows(instrs[end - 1], instrs[end]):
                end += 1
        for j in range(k, end):
            new_index[j] = len(out)
        out.append(first if end == k + 1 else
                   replace(first, until=replace(first.until, legion=None), span=end - k))
        k = end
    if len(out) == len(instrs):
        return program
    new_index[len(instrs)] = len(out)
    regions = [(new_index[start], name) for start, name in program.regions]
    return replace(program, instrs=out, regions=regions)


def _own(i) -> bool:
    """A wait of one Legion on a condition on that Legion's own queue."""
    return type(i) is Wait and (i.span or 1) == 1 and isinstance(i.until, Cond) and i.until.legion == i.legion


def _follows(prev: Wait, i) -> bool:
    """``i`` is ``prev`` on the next Legion."""
    return _own(i) and i.legion == prev.legion + 1 and i.queue_name == prev.queue_name \
        and replace(i.until, legion=None) == replace(prev.until, legion=None)
