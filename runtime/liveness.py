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

import numpy as np

from isa import encoding
from isa.expand import DRAM_FIELD, bits_at, opcodes, word_matrix
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


def last_uses(program: Program) -> dict[int, list[int]]:
    """:meth:`Liveness.last_uses` of a verified, expanded program run instruction by
    instruction in program order. One read from a file names its tensors in its words: found
    there at once (a pass over the instruction objects costs 7 ms on a layer). Each transfer
    names one DRAM tensor; a matmul's block mask is a constant (the verifier holds it so),
    never freed."""
    tasks = program.instrs
    if tasks.words is None:
        return Liveness(program, tasks.source).last_uses()
    named = _named(tasks.words, len(tasks.source))
    scratch = np.array([t.kind == "scratch" for t in program.tensors] + [False])
    at = np.flatnonzero(scratch[named])              # none (-1) reads the False after the tensors
    tensors, latest = np.unique(named[at][::-1], return_index=True)
    last = at[len(at) - 1 - latest]
    return {k: [n] for k, n in sorted(zip(last.tolist(), tensors.tolist()))}


def _named(words: bytes, n: int) -> np.ndarray:
    """Per instruction, the DRAM tensor its transfer names, -1 for none."""
    u = word_matrix(words, n)
    op = opcodes(u)
    out = np.full(n, -1, np.int64)
    for cls, name in DRAM_FIELD.items():
        rows = np.flatnonzero(op == cls.OPCODE)
        shift, kind = encoding.FIELD_AT[cls][name]
        out[rows] = bits_at(u[rows], shift, kind.tensor_bits).astype(np.int64)
    return out
