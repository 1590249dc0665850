"""Data races: an element two instructions touch, one of them writing, with neither waiting for
the other.

The timing model runs a program in one order; the machine may run it in any order its
conditions allow. An instruction is ordered after another only by what it waits for:

- its queue: ``mat`` and ``vec`` run one instruction at a time, so each starts after the one
  before it is done. A DMA queue starts its next transfer as soon as the last one's data has
  left DRAM, before it has landed: the next transfer is ordered after the last one's reads and
  after the data it delivers (transfers land in order), not before what it reads;
- its condition, or a ``wait`` before it: the named queue's first ``count`` instructions are
  done, and so is everything they were ordered after;
- a barrier: everything before it, on every queue.

:class:`Order` folds these into a vector per instruction: per queue, how many of its
instructions are known done when it starts. :class:`RaceCheck` keeps a shadow of every
scratchpad element and of every DRAM tensor the program writes: its last writer and, per
queue, its last reader. The emulator calls it for each access, in completion order; an access
whose earlier conflicting access is not known done is a race, reported with both instructions.
(A gather's table rows and a matmul's block mask are read-only constants in the programs the
compiler writes and are not tracked.)
"""
from __future__ import annotations

import numpy as np

from isa.arch import Arch
from isa.fields import QUEUES, View
from isa.instructions import Barrier
from isa.program import Program
from runtime.state import Trap, window

DMA = QUEUES.index("dma")
NONE = -1


class Order:
    """Per instruction of an expanded program: its queue, its place there, and ``known[k, q]``,
    how many instructions of queue ``q`` are done before ``k`` starts."""

    def __init__(self, program: Program, arch: Arch):
        self.nq = arch.legions * len(QUEUES)
        self.items: list[list[int]] = [[] for _ in range(self.nq)]     # queue -> its instructions
        n = len(program.instrs)
        self.queue = np.full(n, NONE, np.int64)
        self.place = np.zeros(n, np.int64)                             # position in its queue
        self.barrier_places: dict[int, np.ndarray] = {}
        self.prev: list[list[int]] = [[] for _ in range(n)]            # (instruction, done?) pairs
        self.conds: list[int | None] = [None] * n
        for k, ins in enumerate(program.instrs):
            self._dispatch(k, ins)
        self.known = self._knowledge(program)

    def qid(self, legion: int, queue: str) -> int:
        return legion * len(QUEUES) + QUEUES.index(queue)

    def _dispatch(self, k: int, ins) -> None:
        if isinstance(ins, Barrier):
            places = np.array([len(q) for q in self.items], np.int64)
            self.barrier_places[k] = places
            self.prev[k] = [(q[-1], True) for q in self.items if q]
            for q in self.items:
                q.append(k)
            return
        q = self.qid(ins.legion, ins.queue())
        self.queue[k], self.place[k] = q, len(self.items[q])
        if self.items[q]:
            # What came before on a DMA queue has left DRAM, not landed; a barrier is done.
            last = self.items[q][-1]
            self.prev[k] = [(last, q % len(QUEUES) != DMA or last in self.barrier_places)]
        self.items[q].append(k)
        cond = ins.condition()
        if cond is not None and cond.count:
            self.conds[k] = (self.qid(cond.legion, cond.queue), cond.count)

    def _deps(self, k: int) -> list:
        deps = list(self.prev[k])
        if self.conds[k] is not None:
            q, count = self.conds[k]
            if count <= len(self.items[q]):
                deps.append((self.items[q][count - 1], True))
        return deps

    def _knowledge(self, program: Program) -> np.ndarray:
        n = len(program.instrs)
        known = np.zeros((n, self.nq), np.int64)
        state = np.zeros(n, np.int8)             # 0 unvisited, 1 on the stack, 2 computed
        for root in range(n):
            stack = [root]
            while stack:
                k = stack[-1]
                if state[k] == 2:
                    stack.pop()
                    continue
                todo = [d for d, _ in self._deps(k) if state[d] != 2]
                if todo and state[k] == 0:
                    state[k] = 1
                    stack.extend(todo)
                    continue
                for d, done in self._deps(k):
                    np.maximum(known[k], self.done_vector(known, d) if done else known[d], out=known[k])
                state[k] = 2
                stack.pop()
        return known

    def done_vector(self, known: np.ndarray, k: int) -> np.ndarray:
        """What is known done once ``k`` is: what it knew, and its queue(s) up to it."""
        out = known[k].copy()
        if k in self.barrier_places:
            return np.maximum(out, self.barrier_places[k] + 1)
        out[self.queue[k]] = max(out[self.queue[k]], self.place[k] + 1)
        return out


class Shadow:
    """Per element: its last writer (queue + 1, 0 for none, and that queue's count after it) and,
    per reading queue, the count after its last read. Zeros, so untouched pages cost nothing."""

    def __init__(self, elems: int, reader_queues: list[int]):
        self.wq = np.zeros(elems, np.int32)
        self.wc = np.zeros(elems, np.int32)
        self.rc = np.zeros((len(reader_queues), elems), np.int32)
        self.reader_queues = reader_queues


class RaceCheck:
    """The machine's accesses, checked against :class:`Order` as the emulator performs them."""

    def __init__(self, program: Program, arch: Arch):
        self.program, self.order = program, Order(program, arch)
        nq = len(QUEUES)
        self.spads = [{s: Shadow(n, [legion * nq + r for r in range(nq)])
                       for s, n in arch.derived.spad_elems.items()} for legion in range(arch.legions)]
        # DRAM is read only by DMA queues: a reader per Legion.
        dma = [legion * nq + DMA for legion in range(arch.legions)]
        self.dram = {i: Shadow(t.storage_elems, dma) for i, t in enumerate(program.tensors)
                     if t.kind not in ("const", "input")}
        self.now = 0

    # The machine calls these for every access of the instruction ``now``.
    def spad(self, legion: int, view: View, rows: int, cols: int, write: bool) -> None:
        self._access(self.spads[legion][view.space], (view.addr, rows, cols, view.rs, view.cs), write,
                     lambda e: f"L{legion} {view.space}[{e}]")

    def dram_access(self, tensor: int, offset: int, rs: int, rows: int, cols: int, write: bool) -> None:
        shadow = self.dram.get(tensor)
        if shadow is not None:
            self._access(shadow, (offset, rows, cols, rs, 1), write,
                         lambda e: f"@{self.program.tensors[tensor].name}[{e}]")

    def _access(self, s: Shadow, win: tuple, write: bool, where) -> None:
        if win[1] == 0 or win[2] == 0:
            return
        k, order = self.now, self.order
        q, count = int(order.queue[k]), int(order.place[k]) + 1
        wq, wc, rc = (window(a, *win, writeable=True) for a in (s.wq, s.wc, s.rc))
        known = order.known[k]
        top = int(wq.max())
        # One earlier writer queue (the usual case): its highest count answers for the window,
        # and it is mostly known done (the full rule, ``_unordered``, is slower).
        if top and (top != int(wq.min()) or (known[top - 1] < int(wc.max())
                                             and self._unordered(top - 1, int(wc.max()), write, "wrote"))):
            self._check(wq - 1, wc, write, win, where, "wrote")
        if not write:
            reads = rc[s.reader_queues.index(q)]
            np.maximum(reads, count, out=reads)
            return
        for r, rq in enumerate(s.reader_queues):
            last = int(rc[r].max())
            if last and known[rq] < last and self._unordered(rq, last, write, "read"):
                self._check(np.where(rc[r] > 0, rq, NONE), rc[r], write, win, where, "read")
            if last:
                rc[r] = 0
        wq[...], wc[...] = q + 1, count

    def _unordered(self, qs, counts, write: bool, verb: str):
        """Per earlier access (queue ``qs``, NONE for none, and its count; arrays or scalars)
        that ``verb`` (wrote or read), whether instruction ``now`` is not ordered after it: it
        neither knows it done, nor is that instruction itself (a read, then a write), nor comes
        later on the same DMA queue (ordered after its reads, done when it left, and after its
        writes when writing too: transfers land in order; not when reading what it wrote)."""
        k, order = self.now, self.order
        q, place = order.queue[k], order.place[k]
        qs, counts = np.asarray(qs), np.asarray(counts)
        out = (qs != NONE) & (order.known[k][np.clip(qs, 0, None)] < counts) & ~((qs == q) & (counts == place + 1))
        if q % len(QUEUES) == DMA and (verb == "read" or write):
            out &= ~((qs == q) & (counts <= place))
        return out

    def _check(self, qs: np.ndarray, counts: np.ndarray, write: bool, win: tuple, where, verb: str) -> None:
        """Element by element, for a window the one-comparison test did not clear."""
        racy = self._unordered(qs, counts, write, verb)
        if racy.any():
            at = np.unravel_index(np.argmax(racy), racy.shape)
            addr, _, _, rs, cs = win
            other = self.order.items[int(qs[at])][int(counts[at]) - 1]
            raise Trap(f"race on {where(addr + at[-2] * rs + at[-1] * cs)}: {self._name(other)} {verb} it, "
                       f"and this instruction is not ordered after it")

    def _name(self, k: int) -> str:
        """``line 12 (dma.ld)``: where instruction ``k`` is, without the file named again."""
        p = self.program
        loc = p.where(k).removeprefix(f"{p.source}:").strip()
        return f"{'line ' + loc if loc.isdigit() else loc} ({p.instrs[k].MNEMONIC})"

