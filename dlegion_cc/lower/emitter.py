"""Building a program: DRAM tensors, constant data, scratchpad space, dependencies, spans.

``depend(src, dst)`` makes the next instruction on ``dst`` wait until ``src`` has completed what
was issued on it so far. It is written relative to program order (``wait=dma``: this Legion's
DMA queue; ``wait=L0.dma~2``: all of Legion 0's DMAs but the last two issued since), so the same
condition holds for every Legion of a span. A second pending dependency of the same instruction
becomes a ``wait`` instruction.

Inside ``with em.spanning(base, count)``, every instruction is emitted once with ``span=count``
and runs on Legions base..base+count-1: the kernels that deal equal blocks of work to the Legions
emit each group of blocks once, not once per Legion.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import IO, Iterable

import numpy as np

from isa.arch import Arch
from isa.fields import QUEUES, Cond, ViewKind
from isa.instructions import Barrier, VUnary, Wait
from isa.program import PACK, STORAGE, Program, Tensor, pack
from dlegion_cc.ir import Mapped

Queue = tuple[int, str]          # (Legion, queue name)
DATA_ALIGN = 64
COUNT_BITS = next(f.metadata['kind'].bits for f in VUnary.fields() if f.name == 'rows')


class ConstData:
    """The data file's bytes: each constant at the next ``DATA_ALIGN``-aligned offset, kept in
    memory, or written to ``out`` (anything with ``write``) as it is packed, so a model's
    weights pass through once and are never all held."""

    def __init__(self, out: IO[bytes] | None = None):
        self.out, self.size = out, 0
        self.kept = bytearray() if out is None else None

    def append(self, pieces: Iterable[np.ndarray]) -> int:
        """Add the bytes of ``pieces`` (contiguous arrays), one after the other, each dropped
        once written; their offset."""
        self._write(bytes(-self.size % DATA_ALIGN))
        offset = self.size
        for raw in pieces:
            self._write(memoryview(raw).cast("B"))
        return offset

    def _write(self, chunk) -> None:
        if self.kept is not None:
            self.kept.extend(chunk)
        elif len(chunk):
            self.out.write(chunk)
        self.size += len(chunk)

    def __bool__(self) -> bool:
        return self.size > 0

    def bytes(self) -> bytes | None:
        """What was kept in memory; None when nothing was, or it went to a file."""
        return bytes(self.kept) if self.kept else None


@dataclass
class Emitter:
    arch: Arch
    source: str
    tensors: list[Tensor] = field(default_factory=list)
    instrs: list = field(default_factory=list)
    data: ConstData = field(default_factory=ConstData)
    issued: dict = field(default_factory=dict)          # queue -> instructions issued on it
    pending: dict = field(default_factory=dict)         # queue -> (source, its count then, across)
    reserved: dict = field(default_factory=dict)        # space -> elements from 0 kept for another kernel
    above: dict = field(default_factory=dict)           # space -> elements at its end kept for another kernel
    turn: int = 0                                       # round-robin position over Legions
    span: tuple[int, int] = (0, 1)                      # (base Legion, Legions) of what is emitted
    skipped: Counter = field(default_factory=Counter)   # work left out, by kind (Program.skipped)
    # What is computed instead of ONNX's semantics, each with the model's values it is made in
    # (Program.approximations).
    approximations: dict = field(default_factory=dict)
    carried: list = field(default_factory=list)         # concat copies left to a matmul's loads (carry.py)
    aliases: dict = field(default_factory=dict)         # inputs inside outputs (Program.aliases)

    # --- DRAM -----------------------------------------------------------------------------
    def tensor(self, name: str, dtype: str, shape, kind: str, io_name: str | None = None,
               rng: tuple[int, int] | None = None) -> int:
        self.tensors.append(Tensor(self._unique(name), dtype, tuple(int(d) for d in shape), kind,
                                   io_name=io_name, range=rng))
        return len(self.tensors) - 1

    def const(self, name: str, values: np.ndarray, dtype: str) -> int:
        """A constant DRAM tensor holding ``values`` (packed for w2/w4). A mapped constant
        already in its storage type is copied a piece at a time."""
        if isinstance(values, Mapped) and dtype not in PACK and values.dtype == STORAGE[dtype]:
            offset = self.data.append(values.pieces())
        else:
            offset = self.data.append([pack(values, dtype)])
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
        base, count = self.span
        if count > 1:
            if instr.legion != base:
                raise ValueError(f"internal: {instr.MNEMONIC} on L{instr.legion} inside a span from L{base}")
            instr = replace(instr, span=count)
        q = (instr.legion, instr.queue())
        dep = self.pending.pop(q, None)
        if dep is not None:
            instr = replace(instr, wait=self._cond(dep, instr.legion))
        self._append(instr)

    def _append(self, instr) -> None:
        self.instrs.append(instr)
        base, count = instr.legion, instr.span or 1
        for legion in range(base, base + count):
            q = (legion, instr.queue())
            self.issued[q] = self.issued.get(q, 0) + 1

    def _cond(self, dep, legion: int) -> Cond:
        """The condition for ``dep`` = (source queue, its count when depended on, across),
        relative to the instruction about to be emitted on ``legion`` (and its span)."""
        (src_legion, queue), need, across = dep
        back = self.issued.get((src_legion, queue), 0) - need
        if across or src_legion != legion:
            return Cond(src_legion, queue, None, back)
        # Counted on the span's first Legion: every Legion of a span is issued the same
        # instructions, so what came after the needed ones is the same on each.
        return Cond(None, queue, None, back)

    def depend(self, src: Queue, dst: Queue, across: bool = False, upto: int | None = None) -> None:
        """``dst`` starts nothing further until ``src`` has completed the first ``upto`` of the
        instructions issued on it (default: all of them so far).

        Inside a span, a queue of the span's first Legion stands for each Legion's own queue;
        ``across`` makes it that one Legion's queue, which every Legion of the span waits for
        (a multicast it sent)."""
        need = self.issued.get(src, 0) if upto is None else upto
        if need <= 0:
            return
        cur = self.pending.get(dst)
        if cur is not None and (cur[0], cur[2]) == (src, across):
            need = max(need, cur[1])
        elif cur is not None:
            # The older dependency waits alone.
            self._append(self._spanned(Wait(dst[0], dst[1], self._cond(cur, dst[0]))))
        self.pending[dst] = (src, need, across)

    def _spanned(self, instr):
        base, count = self.span
        return replace(instr, span=count) if count > 1 and instr.legion == base else instr

    def fence(self, queue: Queue) -> None:
        """``queue`` waits until its own earlier work is done (a DMA's data has landed)."""
        self.depend(queue, queue)

    def next_legion(self) -> int:
        """Deal independent blocks of work to the Legions in turn."""
        self.turn = (self.turn + 1) % self.arch.legions
        return self.turn

    def take_legions(self, count: int) -> int:
        """The first of ``count`` adjacent Legions for the next blocks of work, in turn."""
        base = self.turn + 1 if self.turn + 1 + count <= self.arch.legions else 0
        self.turn = (base + count - 1) % self.arch.legions
        return base

    @contextmanager
    def spanning(self, base: int, count: int):
        """Everything emitted inside runs on Legions base..base+count-1 (``span=count``)."""
        outer, self.span = self.span, (base, count)
        try:
            yield
        finally:
            self.span = outer

    @contextmanager
    def reserving(self, space: str, count: int):
        """Kernels emitted inside leave the first ``count`` elements of ``space`` to another."""
        self.reserved[space] = count
        try:
            yield
        finally:
            self.reserved.pop(space, 0)

    def barrier(self) -> None:
        """Every queue of every Legion waits until every queue has finished its work so far."""
        self.pending.clear()           # the barrier orders everything before it
        self.instrs.append(Barrier())
        for legion in range(self.arch.legions):
            for q in QUEUES:
                self.issued[(legion, q)] = self.issued.get((legion, q), 0) + 1

    # --- scratchpads ------------------------------------------------------------------------
    def capacity(self, space: str) -> int:
        """Elements of ``space`` a kernel may use (less what ``reserved`` keeps for another)."""
        return self.arch.derived.spad_elems[space] - self.reserved.get(space, 0) - self.above.get(space, 0)

    @staticmethod
    def extent() -> int:
        """The longest row or column one instruction can name: the narrower of the rows/cols
        count fields and a view's row stride (a block's row stride is its width)."""
        return min(1 << ViewKind.rs_bits, 1 << COUNT_BITS) - 1

    def program(self, data_file: str | None) -> Program:
        return Program(self.arch.name, list(self.tensors), list(self.instrs),
                       data_file if self.data else None, skipped=dict(self.skipped),
                       approximations=dict(sorted(self.approximations.items())),
                       aliases=dict(self.aliases),
                       source=self.source,
                       data=self.data.bytes())
