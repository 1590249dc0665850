"""Nodes that share nothing run side by side: the barrier between them goes.

Every node ends in a barrier. At decode some nodes are a few rows' work on one Legion each
(the query's and the key's rotary, the new value row copied into the cache), one after the
other: each pays a DRAM round trip in and out while the other Legions and DRAM idle. When a
node runs on Legions the nodes since the last barrier kept never touch, and none of its accesses
meets one of theirs (``footprint``: a scratchpad element, a DRAM tensor's element, one of the two
writing), the barrier before it is dropped and it runs beside them.

What the dropped barrier ordered stays ordered: the barrier before the run orders every node of
the run after what came before it, the barrier after the run orders what follows after all of
them, and inside the run nothing conflicts. Relative conditions (``dma~2``) are rewritten for
the barrier's absence (``prefetch._Counts``). The barriers between layers stay (``layer_ends``).
"""
from __future__ import annotations

from dataclasses import replace

from isa.arch import Arch
from isa.instructions import Barrier
from isa.program import Program
from dlegion_cc.lower.overlap import accesses, conflicting, layer_ends
from dlegion_cc.lower.prefetch import _Counts, _legions


def side_by_side(program: Program, arch: Arch) -> Program:
    """``program`` without the barriers between neighbouring nodes that share nothing."""
    dropped = _dropped(program)
    if not dropped:
        return program
    order = [(k, i) for k, i in enumerate(program.instrs) if k not in dropped]
    new_at = _new_index(len(program.instrs), dropped)
    regions = [(new_at[at], name) for at, name in program.regions]
    return replace(program, instrs=_Counts(program.instrs, arch).rewrite(order), regions=regions)


def _dropped(program: Program) -> set[int]:
    """The barriers to drop: each ends a node whose successor shares nothing with the run of
    nodes since the last barrier kept."""
    instrs, keep = program.instrs, layer_ends(program)
    dropped, run, start = set(), None, 0
    for span in program.region_ranges():
        end = span.stop
        if not (len(span) and isinstance(instrs[end - 1], Barrier)):
            run = None
            continue
        # the node since the last barrier: later passes leave a node in several region entries
        node, start = range(start, end), end
        mine = _Accesses(program, node)
        if run is not None and run.apart(mine):
            dropped.add(node.start - 1)
            run.add(mine)
        else:
            run = mine
        if end - 1 in keep:
            run = None
    return dropped


class _Accesses:
    """The Legions a run of nodes uses (its queues, the Legions it sends to or waits for) and
    every access it makes (``footprint``), by space."""

    def __init__(self, program: Program, node: range):
        self.program, self.node = program, node
        self.legions: set[int] = set()
        for k in node:
            i = program.instrs[k]
            if isinstance(i, Barrier):
                continue
            self.legions.update(_legions(i))
            self.legions.update(d + r for d in getattr(i, "dests", ()) for r in range(i.span or 1))
            cond = i.condition()
            if cond is not None and cond.legion is not None:
                self.legions.add(cond.legion)
        self._spaces: dict | None = None

    @property
    def spaces(self) -> dict:
        """Space -> [(window, write)], made when first asked for: most nodes use every Legion
        and never get that far."""
        if self._spaces is None:
            self._spaces = accesses(self.program, self.node)
        return self._spaces

    def apart(self, other: "_Accesses") -> bool:
        """Whether the two share no Legion and no element one of them writes."""
        return not self.legions & other.legions and not conflicting(self.spaces, other.spaces)

    def add(self, other: "_Accesses") -> None:
        self.legions |= other.legions
        for space, theirs in other.spaces.items():
            self.spaces.setdefault(space, []).extend(theirs)


def _new_index(count: int, dropped: set[int]) -> list[int]:
    """Old index -> index once the ``dropped`` instructions are gone (one past the end too)."""
    out, gone = [], 0
    for k in range(count + 1):
        out.append(k - gone)
        gone += k in dropped
    return out
