"""A program as the Legions run it: one task per (instruction, Legion of its span).

An instruction with ``span=S`` runs on Legions L..L+S-1; rank r of the span moves its DMA's DRAM
offset by ``r * lstride`` and its multicast destinations by r. A relative condition (``dma``,
``L0.mat~1``) becomes the absolute count it stands for at that point of the program. The
verifier, the emulator and the timing model all work on the expanded program, so they handle
single-Legion instructions with absolute conditions only; ``origin`` maps each task back to the
instruction (and so the text line) it came from.

A whole model runs as millions of tasks. What the verifier's counting and the timing model need
of each (its Legion, queue and absolute condition) is computed for all of them at once, as
arrays (:class:`Tasks`); a task is made as an instruction object only when something reads it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from isa import encoding
from isa.fields import QUEUES, Cond, DramRef
from isa.instructions import Barrier, DmaLoad, DmaStore, Gather, Instr, NocMove, Wait
from isa.program import Program

DRAM_FIELD = {DmaLoad: "src", DmaStore: "dst", Gather: "table"}
NONE = -1         # no Legion, queue or condition


@dataclass
class Expanded:
    program: Program          # single-Legion instructions, absolute conditions
    origin: list[int]         # task index -> instruction index in the source program


def is_flat(program: Program) -> bool:
    """True when no instruction spans Legions or waits relatively: expansion changes nothing."""
    for i in program.instrs:
        if getattr(i, "span", None) is not None:
            return False
        cond = i.condition()
        if cond is not None and (cond.legion is None or cond.count is None):
            return False
    return True


def expand(program: Program, legions: int) -> Expanded:
    """One task per (instruction, Legion); ``legions`` is the machine's (a barrier counts in each)."""
    if program.origin is not None:          # expanded already (its instructions are Tasks)
        return Expanded(program, program.origin)
    tasks = Tasks(program.instrs, legions, encoding.kept_words(program))
    origin = tasks.origin.tolist()
    first, n = tasks.first.tolist(), len(tasks)
    flat = replace(program, instrs=tasks, origin=origin,
                   regions=[(first[at] if at < len(first) else n, name) for at, name in program.regions])
    return Expanded(flat, origin)


class Tasks(Sequence):
    """The tasks of a list of instructions, each made when first read.

    Arrays, per task: ``origin`` (its instruction), ``legion`` and ``queue`` (an index in
    ``names``: QUEUES, then any other name an unverified program uses; NONE for a barrier),
    ``cond`` ([n, 3]: Legion, queue index and absolute count of its condition; NONE rows for
    none); per instruction: ``first`` (its first task)."""

    def __init__(self, source: list[Instr], legions: int, words: bytes | None = None):
        self.source = source
        self.words = words            # the source's words, when it was read from a file
        self.names = list(QUEUES)
        n_src = len(source)
        barrier = np.array([isinstance(i, Barrier) for i in source], dtype=bool)
        span = np.array([1 if b else (getattr(i, "span", None) or 1) for i, b in zip(source, barrier)], dtype=np.int64)
        self.first = np.concatenate([[0], np.cumsum(span)[:-1]]).astype(np.int64) if n_src else span
        self.origin = np.repeat(np.arange(n_src, dtype=np.int64), span)
        rank = np.arange(len(self.origin), dtype=np.int64) - self.first[self.origin]
        start = np.array([NONE if b else i.legion for i, b in zip(source, barrier)], dtype=np.int64)
        queue = np.array([NONE if b else self.code(i.queue()) for i, b in zip(source, barrier)], dtype=np.int64)
        self.legion = np.where(barrier[self.origin], NONE, start[self.origin] + rank)
        self.queue = queue[self.origin]
        self.cond = _conditions(source, self, barrier, legions)
        self._made: list = [None] * len(self.origin)
        self._alike = None
        self._in_order: dict = {}     # legions -> in_program_order's answer for these tasks

    def __len__(self) -> int:
        return len(self.origin)

    def code(self, queue: str) -> int:
        if queue not in self.names:
            self.names.append(queue)
        return self.names.index(queue)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        task = self._made[k]
        if task is None:
            task = self._made[k] = self._make(k)
        return task

    def __iter__(self):
        for k in range(len(self)):
            yield self[k]

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def alike(self) -> "Alike":
        """Values computed once per distinct instruction of this program (shared by its users)."""
        if self._alike is None:
            self._alike = Alike(self.source, self.words)
        return self._alike

    def _make(self, k: int) -> Instr:
        o = int(self.origin[k])
        ins = self.source[o]
        if isinstance(ins, Barrier):
            return ins
        return _task(ins, k - int(self.first[o]), self.cond[k])


class Alike:
    """Values computed once per distinct instruction: a model's layers repeat every instruction
    but their DMAs. Each instruction is hashed once (a hash walks every field), compared only
    when its hash meets an earlier one's, and so resolved once to the first instruction equal
    to it (``ids``), which every table of values shares."""

    def __init__(self, source: list[Instr], words: bytes | None = None):
        self.source = source
        self.ids = _first_equal(source) if words is None else _first_equal_words(words)
        self.tables: dict = {}

    def get(self, table: str, o: int, make):
        """``make()`` for instruction ``o``, or what it gave for an equal instruction before."""
        seen = self.tables.setdefault(table, {})
        i = self.ids[o]
        if i in seen:
            return seen[i]
        value = seen[i] = make()
        return value


def _first_equal(source: list[Instr]) -> list[int]:
    """Per instruction, the index of the first instruction equal to it (a dict hashes each
    once and compares it only with the earlier ones its hash meets)."""
    firsts: dict = {}
    first = firsts.setdefault
    return [first(ins, o) for o, ins in enumerate(source)]


def _first_equal_words(words: bytes) -> list[int]:
    """:func:`_first_equal` from the instructions' words: the encoding is one to one, and a
    word hashes as 40 bytes where an instruction hashes field by field (about 14x slower on a
    30-layer model). Immediates equal but for their bits (0.0 and -0.0) are told apart, which
    only costs their values computed twice."""
    size = encoding.WORD_BYTES
    firsts: dict = {}
    first = firsts.setdefault
    return [first(words[at:at + size], o) for o, at in enumerate(range(0, len(words), size))]


def _task(ins: Instr, rank: int, cond_row) -> Instr:
    """Rank ``rank`` of ``ins``, its condition absolute (``cond_row``). Built without
    ``__init__`` (instructions, conditions and DRAM references have no ``__post_init__``)."""
    cond = ins.condition()
    relative = cond is not None and (cond.legion is None or cond.count is None)
    if getattr(ins, "span", None) is None and not relative:
        return ins
    fields = dict(ins.__dict__)
    fields["legion"] = ins.legion + rank
    if getattr(ins, "span", None) is not None:
        fields["span"] = None
    if relative:
        fields["until" if isinstance(ins, Wait) else "wait"] = _new(
            Cond, {"legion": int(cond_row[0]), "queue": cond.queue, "count": int(cond_row[2]), "back": 0})
    name = DRAM_FIELD.get(type(ins))
    if name is not None and ins.lstride is not None:
        fields["lstride"] = None
        fields[name] = dram_of(ins, rank)
    if isinstance(ins, (DmaLoad, NocMove)) and rank:
        fields["dests"] = frozenset(d + rank for d in ins.dests)
    return _new(type(ins), fields)


def dram_of(ins: Instr, rank: int) -> DramRef:
    """The DRAM reference rank ``rank`` of a DMA's span reads or writes: moved by ``lstride``."""
    ref = getattr(ins, DRAM_FIELD[type(ins)])
    if not rank or ins.lstride is None:
        return ref
    return _new(DramRef, {"tensor": ref.tensor, "offset": ref.offset + rank * ins.lstride, "rs": ref.rs})


def _new(cls, fields: dict):
    """An instance of the frozen dataclass ``cls`` holding ``fields``, without ``__init__``."""
    obj = object.__new__(cls)
    object.__setattr__(obj, "__dict__", fields)
    return obj


class Queues:
    """How many tasks each queue was given before an instruction: its own tasks, and the
    barriers, which every queue of the machine runs."""

    def __init__(self, tasks: Tasks, barrier: np.ndarray, legions: int):
        self.n = max(len(tasks.source), 1)
        self.names = tasks.names
        own = tasks.legion != NONE
        self.keys = np.sort(self.key(tasks.legion[own], tasks.queue[own]) * self.n + tasks.origin[own])
        self.barriers = np.flatnonzero(barrier)
        self.legions = legions

    def key(self, legion, queue):
        return legion * len(self.names) + queue

    def before(self, legion: np.ndarray, queue: np.ndarray, origin: np.ndarray) -> np.ndarray:
        """Tasks queue (legion, queue) was given by the instructions before ``origin``; only the
        machine's queues run barriers."""
        at = self.key(legion, queue) * self.n
        own = np.searchsorted(self.keys, at + origin) - np.searchsorted(self.keys, at)
        machine = (legion < self.legions) & (queue < len(QUEUES))
        return own + np.where(machine, np.searchsorted(self.barriers, origin), 0)

    def lengths(self, legion: np.ndarray, queue: np.ndarray) -> np.ndarray:
        """Tasks queue (legion, queue) runs in all."""
        return self.before(legion, queue, np.full(len(legion), self.n, dtype=np.int64))


def _conditions(source: list[Instr], tasks: Tasks, barrier: np.ndarray, legions: int) -> np.ndarray:
    """Each task's condition as (Legion, queue, absolute count): a relative one counted as the
    tasks given to that queue by the instructions before its own (the ranks of a span do not
    wait on each other)."""
    out = np.full((len(tasks), 3), NONE, dtype=np.int64)
    out[:, 2] = 0
    conds = [i.condition() for i in source]
    has = np.array([c is not None for c in conds], dtype=bool)
    at = np.flatnonzero(has[tasks.origin]) if len(tasks) else np.zeros(0, np.int64)
    if not len(at):
        return out
    own = np.array([NONE if c is None or c.legion is None else c.legion for c in conds], dtype=np.int64)
    queue = np.array([NONE if c is None else tasks.code(c.queue) for c in conds], dtype=np.int64)
    count = np.array([NONE if c is None or c.count is None else c.count for c in conds], dtype=np.int64)
    back = np.array([0 if c is None else c.back for c in conds], dtype=np.int64)
    o = tasks.origin[at]
    legion = np.where(own[o] == NONE, tasks.legion[at], own[o])
    counted = count[o]
    relative = counted == NONE
    if relative.any():
        r = np.flatnonzero(relative)
        given = Queues(tasks, barrier, legions).before(legion[r], queue[o][r], o[r])
        counted[r] = np.maximum(0, given - back[o][r])
    out[at, 0], out[at, 1], out[at, 2] = legion, queue[o], counted
    return out


def absolute(cond: Cond, legion: int, issued) -> Cond:
    """``cond`` as seen by a task on ``legion``, given ``issued``, the tasks issued to each
    queue before it (a Counter keyed (legion, queue))."""
    target = legion if cond.legion is None else cond.legion
    count = cond.count if cond.count is not None else max(0, issued[(target, cond.queue)] - cond.back)
    return Cond(target, cond.queue, count)


def in_program_order(tasks: Tasks, legions: int) -> bool:
    """Whether every condition waits only for instructions before its own: program order is
    then an order to compute in (compiled programs are; a hand-written one may wait ahead)."""
    known = getattr(tasks, "_in_order", {})
    if legions not in known:
        known[legions] = _in_program_order(tasks, legions)
    return known[legions]


def _in_program_order(tasks: Tasks, legions: int) -> bool:
    waits = np.flatnonzero(tasks.cond[:, 2] > 0)
    if not len(waits):
        return True
    barrier = np.zeros(len(tasks.source), np.bool_)
    barrier[tasks.origin[tasks.legion == NONE]] = True
    cond = tasks.cond[waits]
    given = Queues(tasks, barrier, legions).before(cond[:, 0], cond[:, 1], tasks.origin[waits])
    return bool(np.all(cond[:, 2] <= given))
