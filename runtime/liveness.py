"""When a scratch tensor's DRAM can be given back: after the last task that touches it has run.

Liveness is derived from the program: every task that names a tensor (a DMA's or gather's DRAM
operand, a matmul's block mask) is one use of it. The emulator runs tasks in an order their
dependencies allow (program order or the timing model's completion order), so a tensor is freed when
the count of its uses that have not run yet falls to zero, whichever of them runs last. Inputs, outputs and constants
are never freed: the caller reads outputs, and inputs and constants are views of the caller's
arrays and of the data file, which cost no memory of their own.
"""
from __future__ import annotations

from collections import Counter

from isa.expand import DRAM_FIELD
from isa.program import Program


def tensors_of(ins) -> tuple[int, ...]:
    """The DRAM tensors task ``ins`` reads or writes."""
    field = DRAM_FIELD.get(type(ins))
    mask = getattr(ins, "mask", None)
    out = () if field is None else (getattr(ins, field).tensor,)
    return out if mask is None else out + (mask,)


class Liveness:
    """Counts down each scratch tensor's remaining uses as the tasks run."""

    def __init__(self, program: Program, instrs=None):
        """Uses counted over ``instrs``: the program's tasks (default), or its source
        instructions when each is run whole."""
        scratch = {i for i, t in enumerate(program.tensors) if t.kind == "scratch"}
        instrs = program.instrs if instrs is None else instrs
        if instrs is getattr(program.instrs, "source", None):
            self.uses = self._alike_uses(program, scratch)
        else:
            self.uses = [tuple(n for n in tensors_of(ins) if n in scratch) for ins in instrs]
        self.left = Counter(n for used in self.uses for n in used)

    @staticmethod
    def _alike_uses(program: Program, scratch: set) -> list[tuple]:
        """The uses of each source instruction, found once per distinct instruction."""
        source, ids = program.instrs.source, program.instrs.alike().ids
        uses = []
        for o, ins in enumerate(source):
            i = ids[o]
            uses.append(uses[i] if i != o else tuple(n for n in tensors_of(ins) if n in scratch))
        return uses

    def last_uses(self) -> dict[int, list[int]]:
        """For a run of every instruction once, in program order: per instruction, the
        tensors it is the last use of (what :meth:`ran` would give it), where there are any."""
        last = {n: k for k, used in enumerate(self.uses) for n in used}
        out: dict[int, list[int]] = {}
        for n, k in sorted(last.items(), key=lambda nk: (nk[1], self.uses[nk[1]].index(nk[0]))):
            out.setdefault(k, []).append(n)
        return out

    def ran(self, k: int) -> list[int]:
        """Task ``k`` has run: the tensors it was the last use of."""
        dead = []
        for n in self.uses[k]:
            self.left[n] -= 1
            if not self.left[n]:
                dead.append(n)
        return dead
