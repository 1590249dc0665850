"""Building a program: DRAM tensors, constant data, scratchpad space, dependencies.

Dependencies between queues go through *channels*: one counting semaphore per ordered pair
of (Legion, queue). ``depend(src, dst)`` makes ``dst`` wait for everything ``src`` has issued so
far, with a signal on the source queue and a wait on the destination queue. Semaphore counts
only grow, so a channel serves any number of dependencies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from isa.arch import Arch
from isa.instructions import QUEUES, Signal, Wait
from isa.program import Program, Tensor, pack

Queue = tuple[int, str]          # (Legion, queue name)
DATA_ALIGN = 64


@dataclass
class Region:
    """A block of one Legion scratchpad handed out by :class:`Emitter.alloc`."""

    space: str
    addr: int
    size: int


@dataclass
class Emitter:
    arch: Arch
    source: str
    tensors: list[Tensor] = field(default_factory=list)
    instrs: list = field(default_factory=list)
    data: bytearray = field(default_factory=bytearray)
    channels: dict = field(default_factory=dict)        # (src, dst) -> [sem, signals so far]
    barrier_sem: int | None = None
    barriers: int = 0
    next_sem: int = 0
    spad_top: dict = field(default_factory=dict)        # (legion, space) -> next free element
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
        self.instrs.append(instr)

    def sem(self) -> int:
        self.next_sem += 1
        return self.next_sem - 1

    def depend(self, src: Queue, dst: Queue) -> None:
        """``dst`` issues nothing further until everything issued on ``src`` so far is done."""
        if src == dst:
            return  # a queue is in order
        chan = self.channels.setdefault((src, dst), [self.sem(), 0])
        chan[1] += 1
        self.emit(Signal(src[0], src[1], chan[0]))
        self.emit(Wait(dst[0], dst[1], chan[0], chan[1]))

    def next_legion(self) -> int:
        """Deal independent blocks of work to the Legions in turn."""
        self.turn = (self.turn + 1) % self.arch.legions
        return self.turn

    def fence(self, queue: Queue) -> None:
        """``queue`` waits until its own earlier work is done (a DMA's data has landed)."""
        chan = self.channels.setdefault((queue, queue), [self.sem(), 0])
        chan[1] += 1
        self.emit(Signal(queue[0], queue[1], chan[0]))
        self.emit(Wait(queue[0], queue[1], chan[0], chan[1]))

    def barrier(self) -> None:
        """Every queue of every Legion waits until every queue has finished its work so far."""
        if self.barrier_sem is None:
            self.barrier_sem = self.sem()
        queues = [(l, q) for l in range(self.arch.legions) for q in QUEUES]
        self.barriers += 1
        for legion, q in queues:
            self.emit(Signal(legion, q, self.barrier_sem))
        for legion, q in queues:
            self.emit(Wait(legion, q, self.barrier_sem, self.barriers * len(queues)))

    # --- scratchpads ------------------------------------------------------------------------
    def capacity(self, space: str) -> int:
        return self.arch.derived.spad_elems[space]

    def alloc(self, legion: int, space: str, size: int) -> Region:
        """Bump-allocate ``size`` elements; callers free everything at once with ``release``."""
        top = self.spad_top.get((legion, space), 0)
        if top + size > self.capacity(space):
            raise MemoryError(f"{space} scratchpad of Legion {legion} full: need {size} elements "
                              f"at {top}, capacity {self.capacity(space)}")
        self.spad_top[(legion, space)] = top + size
        return Region(space, top, size)

    def release(self) -> None:
        self.spad_top.clear()

    def program(self, data_file: str | None) -> Program:
        return Program(self.arch.name, list(self.tensors), list(self.instrs),
                       data_file if self.data else None, source=self.source,
                       data=bytes(self.data) if self.data else None)
