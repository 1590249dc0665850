"""Building a program: DRAM tensors, constant data, scratchpad space, dependencies.

Every queue counts its completed instructions. ``depend(src, dst)`` makes the next instruction
on ``dst`` wait (``wait=src>=n``) until ``src`` has completed the ``n`` instructions issued on it
so far; a second pending dependency of the same instruction becomes a ``wait`` instruction.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from isa.arch import Arch
from isa.fields import QUEUES, Cond, ViewKind
from isa.instructions import Barrier, VUnary, Wait
from isa.program import Program, Tensor, pack

Queue = tuple[int, str]          # (Legion, queue name)
DATA_ALIGN = 64
COUNT_BITS = next(f.metadata['kind'].bits for f in VUnary.fields() if f.name == 'rows')


@dataclass
class Emitter:
    arch: Arch
    source: str
    tensors: list[Tensor] = field(default_factory=list)
    instrs: list = field(default_factory=list)
    data: bytearray = field(default_factory=bytearray)
    issued: dict = field(default_factory=dict)          # queue -> instructions issued on it
    pending: dict = field(default_factory=dict)         # queue -> Cond for its next instruction
    turn: int = 0                                       # round-robin position over Legions

    # --- DRAM -----------------------------------------------------------------------------
    def tensor(self, name: str, dtype: str, shape, kind: str, io_name: str | None = None,
               rng: tuple[int, int] | None = None) -> int:
        self.tensors.append(Tensor(self._unique(name), dtype, tuple(int(d) for d in shape), kind,
                                   io_name=io_name, range=rng))
        return len(self.tensors) - 1

    def const(self, name: str, values: np.ndarray, dtype: str) -> int:
        """A constant DRAM tensor holding ``values`` (packed for w2/w4)."""
        self.data.extend(bytes(-len(self.data) % DATA_ALIGN))
        offset = len(self.data)
        self.data.extend(pack(values, dtype).tobytes())
        idx = self.tensor(name, dtype, values.shape, "const")
        self.tensors[idx].offset = offset
        return idx

    def _unique(self, name: str) -> str:
        base = "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "t"
        if not (base[0].isalpha() or base[0] == "_"):
            base = "t_" + base
        taken = {t.name for t in self.tensors}
        cand, i = base, 0
        while cand in taken:
            i += 1
            cand = f"{base}_{i}"
        return cand

    # --- instructions and ordering ----------------------------------------------------------
    def emit(self, instr) -> None:
        q = (instr.legion, instr.queue())
        cond = self.pending.pop(q, None)
        if cond is not None:
            instr = replace(instr, wait=cond)
        self._append(q, instr)

    def _append(self, q: Queue, instr) -> None:
        self.instrs.append(instr)
        self.issued[q] = self.issued.get(q, 0) + 1

    def depend(self, src: Queue, dst: Queue) -> None:
        """``dst`` starts nothing further until everything issued on ``src`` so far is done."""
        need = self.issued.get(src, 0)
        if need == 0:
            return
        cond = Cond(src[0], src[1], need)
        cur = self.pending.get(dst)
        if cur is not None and (cur.legion, cur.queue) != src:
            self._append(dst, Wait(dst[0], dst[1], cur))     # the older dependency waits alone
        self.pending[dst] = cond

    def fence(self, queue: Queue) -> None:
        """``queue`` waits until its own earlier work is done (a DMA's data has landed)."""
        self.depend(queue, queue)

    def next_legion(self) -> int:
        """Deal independent blocks of work to the Legions in turn."""
        self.turn = (self.turn + 1) % self.arch.legions
        return self.turn

    def barrier(self) -> None:
        """Every queue of every Legion waits until every queue has finished its work so far."""
        self.pending.clear()           # the barrier orders everything before it
        self.instrs.append(Barrier())
        for legion in range(self.arch.legions):
            for q in QUEUES:
                self.issued[(legion, q)] = self.issued.get((legion, q), 0) + 1

    # --- scratchpads ------------------------------------------------------------------------
    def capacity(self, space: str) -> int:
        return self.arch.derived.spad_elems[space]

    @staticmethod
    def extent() -> int:
        """The longest row or column one instruction can name: the narrower of the rows/cols
        count fields and a view's row stride (a block's row stride is its width)."""
        return min(1 << ViewKind.rs_bits, 1 << COUNT_BITS) - 1

    def program(self, data_file: str | None) -> Program:
        return Program(self.arch.name, list(self.tensors), list(self.instrs),
                       data_file if self.data else None, source=self.source,
                       data=bytes(self.data) if self.data else None)
