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
from isa.fields import QUEUES, Cond, DramRef, Until
from isa.instructions import OPCODE_BITS, Barrier, DmaLoad, DmaStore, Gather, Instr, NocMove, Wait
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
        self._codes = {q: n for n, q in enumerate(QUEUES)}
        n_src = len(source)
        fields = _word_fields(words, n_src) if words is not None else self._object_fields(source)
        barrier, span, start, queue, conds = fields
        self.barrier = barrier        # per instruction
        self.first = np.concatenate([[0], np.cumsum(span)[:-1]]).astype(np.int64) if n_src else span
        self.origin = np.repeat(np.arange(n_src, dtype=np.int64), span)
        rank = np.arange(len(self.origin), dtype=np.int64) - self.first[self.origin]
        self.legion = np.where(barrier[self.origin], NONE, start[self.origin] + rank)
        self.queue = queue[self.origin]
        self.cond = _conditions(self, barrier, legions, conds)
        self._made: list = [None] * len(self.origin)
        self._alike = None
        self._in_order: dict = {}     # legions -> in_program_order's answer for these tasks

    def _object_fields(self, source: list[Instr]):
        """Per instruction, from its object (one pass): whether it is a barrier, its span (1
        alone), first Legion and queue code (NONE for a barrier), and its condition as a
        [n, 4] array: own Legion (NONE: the task's), queue code, absolute count (NONE:
        relative), back; or None when no instruction has one. Queue names are coded
        instructions' first, then conditions', in program order."""
        # Lists of ints and strings only: tuples would set off the cycle collector, which
        # walks every instruction object.
        barriers, spans, legions, queues, at, conds = [], [], [], [], [], []
        for o, i in enumerate(source):
            if isinstance(i, Barrier):
                barriers.append(o)
                spans.append(1)
                legions.append(NONE)
                queues.append(None)
                continue
            spans.append(getattr(i, "span", None) or 1)
            legions.append(i.legion)
            queues.append(i.queue())
            c = i.condition()
            if c is not None:
                at.append(o)
                conds.append(c)
        n = len(source)
        barrier = np.zeros(n, dtype=bool)
        barrier[barriers] = True
        code = self.code
        queue = np.array([NONE if q is None else code(q) for q in queues], dtype=np.int64)
        cond = None
        if conds:
            cond = np.full((n, 4), NONE, dtype=np.int64)
            cond[:, 3] = 0
            cond[at, 0] = [NONE if c.legion is None else c.legion for c in conds]
            cond[at, 1] = [code(c.queue) for c in conds]
            cond[at, 2] = [NONE if c.count is None else c.count for c in conds]
            cond[at, 3] = [c.back for c in conds]
        return barrier, np.array(spans, dtype=np.int64), np.array(legions, dtype=np.int64), queue, cond

    def __len__(self) -> int:
        return len(self.origin)

    def code(self, queue: str) -> int:
        n = self._codes.get(queue)
        if n is None:
            n = self._codes[queue] = len(self.names)
            self.names.append(queue)
        return n

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


def _conditions(tasks: Tasks, barrier: np.ndarray, legions: int, conds: np.ndarray | None) -> np.ndarray:
    """Each task's condition as (Legion, queue, absolute count), from its instruction's
    (``conds``, per instruction: own Legion or NONE, queue, count or NONE, back; a NONE queue
    for none): a relative one counted as the tasks given to that queue by the instructions
    before its own (the ranks of a span do not wait on each other)."""
    out = np.full((len(tasks), 3), NONE, dtype=np.int64)
    out[:, 2] = 0
    if conds is None or not len(tasks):
        return out
    at = np.flatnonzero(conds[tasks.origin, 1] != NONE)
    if not len(at):
        return out
    o = tasks.origin[at]
    own, queue, count, back = conds[o, 0], conds[o, 1], conds[o, 2], conds[o, 3]
    legion = np.where(own == NONE, tasks.legion[at], own)
    counted = count.copy()
    relative = counted == NONE
    if relative.any():
        r = np.flatnonzero(relative)
        given = Queues(tasks, barrier, legions).before(legion[r], queue[r], o[r])
        counted[r] = np.maximum(0, given - back[r])
    out[at, 0], out[at, 1], out[at, 2] = legion, queue, counted
    return out


def word_matrix(words: bytes, n: int) -> np.ndarray:
    """The words as an [n, WORD_BITS / 64] array of little-endian 64-bit pieces."""
    return np.frombuffer(words, dtype="<u8", count=n * (encoding.WORD_BYTES // 8)).reshape(n, -1)


def opcodes(u: np.ndarray) -> np.ndarray:
    """Each row's opcode (the word's lowest OPCODE_BITS) of :func:`word_matrix`."""
    return (u[:, 0] & np.uint64((1 << OPCODE_BITS) - 1)).astype(np.int64)


def bits_at(u: np.ndarray, shift: int, width: int) -> np.ndarray:
    """Bits ``shift .. shift + width - 1`` (width <= 64) of each row of :func:`word_matrix`."""
    j, r = divmod(shift, 64)
    v = u[:, j] >> np.uint64(r)
    if r + width > 64:
        v = v | (u[:, j + 1] << np.uint64(64 - r))
    if width < 64:
        v = v & np.uint64((1 << width) - 1)
    return v


_QUEUE_CODE = {cls: (QUEUES.index(cls.QUEUE) if cls.QUEUE in QUEUES else NONE) for cls in encoding.LAYOUT}


def _word_fields(words: bytes, n: int):
    """What ``Tasks._object_fields`` reads of the instruction objects, read from their words
    at once, grouped by opcode (the words of a program read from a file, each checked)."""
    u = word_matrix(words, n)
    op = opcodes(u)
    barrier = op == Barrier.OPCODE
    start, span, _ = word_spans(u, op)
    queue = np.full(n, NONE, dtype=np.int64)
    cond = np.full((n, 4), NONE, dtype=np.int64)
    cond[:, 3] = 0
    by = encoding.BY_OPCODE
    for code in np.unique(op).tolist():
        cls = by[code]
        at = encoding.FIELD_AT[cls]
        rows = np.flatnonzero(op == code)
        w = u[rows]
        if cls is Wait:
            queue[rows] = bits_at(w, *_width(at["queue_name"])).astype(np.int64)
            c = bits_at(w, *_width(at["until"])).astype(np.int64)
            present = np.ones(len(rows), dtype=bool)
        elif "wait" in at:
            queue[rows] = _QUEUE_CODE[cls]
            c = bits_at(w, *_width(at["wait"])).astype(np.int64)
            present, c = (c & 1).astype(bool), c >> 1
        else:
            queue[rows] = _QUEUE_CODE[cls]
            continue
        if not present.any():
            continue
        rows, c = rows[present], c[present]
        kind = Until
        n_mask = (1 << kind.count_bits) - 1
        relative = (c >> kind.rel_at & 1).astype(bool)
        number = c >> kind.count_at & n_mask
        cond[rows, 0] = np.where(c & 1, NONE, c >> kind.legion_at & ((1 << kind.legion_bits) - 1))
        cond[rows, 1] = c >> kind.queue_at & ((1 << (kind.rel_at - kind.queue_at)) - 1)
        cond[rows, 2] = np.where(relative, NONE, number)
        cond[rows, 3] = np.where(relative, number, 0)
    return barrier, span, start, queue, cond


def word_spans(u: np.ndarray, op: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of :func:`word_matrix` (``op``: its :func:`opcodes`), its first Legion (NONE
    without one), its span (1 where it names none) and whether it names one: an optional
    span's lowest bit says it is given, the span stands above it."""
    n = len(op)
    start, span, named = np.full(n, NONE, dtype=np.int64), np.ones(n, dtype=np.int64), np.zeros(n, dtype=bool)
    for code in np.unique(op).tolist():
        at = encoding.FIELD_AT[encoding.BY_OPCODE[code]]
        rows = np.flatnonzero(op == code)
        if "legion" in at:
            start[rows] = bits_at(u[rows], *_width(at["legion"])).astype(np.int64)
        if "span" in at:
            s = bits_at(u[rows], *_width(at["span"])).astype(np.int64)
            named[rows] = (s & 1).astype(bool)
            span[rows] = np.where(s & 1, s >> 1, 1)
    return start, span, named


def _width(shift_kind) -> tuple[int, int]:
    shift, kind = shift_kind
    return shift, kind.bits


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
