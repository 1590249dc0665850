"""Legions in lockstep: what the timing model simulates of a program, and what it copies.

**Segments.** When a barrier releases, every queue is idle, no DRAM flow is in flight and
every queue's ``ready`` is the barrier's time, so nothing after a barrier depends on what came
before it but that time. The program is cut at its barriers into segments, each timed from 0
and shifted by the time of the barrier before it.

**Classes.** In a segment, two Legions whose tasks are the same sequence (queues, kinds, costs,
and conditions naming either their own queue or the same other Legion's queue, at the same
count from the segment's start) move in lockstep: by induction over events, each task of one
starts, frees its queue and completes when the same task of the other does, their DMA flows
starting and ending together as equal shares of DRAM. One Legion of each class, its
representative, is simulated, its flows counted once per member, and its times copied to the
others. On a decoder, the Legions that share a matmul's columns evenly form one class, the
Legion that issues the multicast loads another.

**Repeats.** Two segments with the same classes and the same representative tasks have the
same times (the thirty layers of a model): the second is not simulated again.

Signatures are compared as bytes of per-task integer rows, so a program of millions of tasks
costs a few numpy operations per segment, not Python work per task.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from isa.fields import QUEUES
from isa.instructions import Barrier, Wait

TASK, WAIT, BARRIER = 0, 1, 2
NONE = -1              # no Legion, queue or condition
OWN = -2               # a condition on the task's own Legion, in a signature


@dataclass
class Part:
    """Tasks for the event loop, numbered from 0. A queue is named by an integer id,
    ``legion * len(names) + queue`` (a barrier's, on no Legion, is -1)."""

    queue: np.ndarray  # per task: its queue's id; a barrier's is unused
    kind: np.ndarray   # TASK, WAIT or BARRIER
    conds: list        # per task: (queue id, count) it waits for, or None
    timing: list       # per task: (cycles, lead, flow_bytes) of its cost
    flows: list        # per task: whether it is a DRAM flow (a flow_bytes)
    mult: list         # per task: how many tasks it stands for (its DRAM flow counts that often)
    parties: list      # the ids of the queues a barrier holds: the machine's
    names: list        # queue names by index

    def key(self, queue: int) -> tuple[int, str]:
        """The (legion, queue name) queue id ``queue`` stands for."""
        return queue // len(self.names), self.names[queue % len(self.names)]


@dataclass
class Tasks:
    """What the timing model needs of each task of an expanded program, as integer arrays."""

    legion: np.ndarray    # NONE for a barrier
    queue: np.ndarray     # index in ``names``; NONE for a barrier
    kind: np.ndarray
    timing: np.ndarray    # index in ``timings``
    cond: np.ndarray      # [n, 3]: Legion, queue index, absolute count; NONE rows: no condition
    timings: list         # distinct (cycles, lead, flow_bytes)
    names: list           # queue names by index


def tasks_of(program, costed) -> Tasks:
    """``costed``: each instruction's cost and the instruction of each task (runtime/timing.py).
    The tasks of an instruction share its kind and cost; the expansion (isa/expand.py Tasks)
    holds their Legions, queues and conditions as arrays."""
    instrs, origin, ids = program.instrs, costed.origin, costed.ids
    kind_of, timing_of = np.zeros(len(ids), dtype=np.int64), np.zeros(len(ids), dtype=np.int64)
    timings = {}
    for o in np.flatnonzero(ids == np.arange(len(ids))).tolist():    # once per distinct instruction
        c = costed.costs[o]
        kind_of[o] = _kind(instrs.source[o])
        timing_of[o] = timings.setdefault((c.cycles, c.lead, c.flow_bytes), len(timings))
    return Tasks(instrs.legion, instrs.queue, kind_of[ids][origin], timing_of[ids][origin], instrs.cond,
                 list(timings), instrs.names)


def _kind(i) -> int:
    return BARRIER if isinstance(i, Barrier) else WAIT if isinstance(i, Wait) else TASK


def fits(tasks: Tasks, legions: int) -> bool:
    """Every task and condition names a Legion of the machine (a verified program does)."""
    named = max(int(tasks.legion.max(initial=NONE)), int(tasks.cond[:, 0].max(initial=NONE)))
    queues = max(int(tasks.queue.max(initial=NONE)), int(tasks.cond[:, 1].max(initial=NONE)))
    return named < legions and queues < len(QUEUES)


def whole(tasks: Tasks, parties: list) -> Part:
    """Every task as it is, barriers included: for programs :func:`fits` refuses."""
    return _part(tasks, np.arange(len(tasks.kind)), tasks.cond, None, None, parties)


def _part(tasks: Tasks, order: np.ndarray, cond: np.ndarray, rep, size, parties: list) -> Part:
    """The tasks ``order`` for the event loop, with conditions ``cond`` (a row for each);
    ``rep`` and ``size`` map a Legion to its class's representative and member count. Built
    as arrays: only the tasks with a condition get a Python object of their own."""
    names = list(tasks.names) + ["*"]           # a barrier's queue, NONE, names the last
    width = len(names)
    legion = tasks.legion[order]
    on = cond[:, 0]
    if rep is not None and len(on):
        on = np.where(on == NONE, NONE, np.asarray(rep, dtype=np.int64)[on])
    conds = [None] * len(order)
    named = np.flatnonzero(on != NONE)
    for k, q, count in zip(named.tolist(), (on[named] * width + cond[named, 1]).tolist(), cond[named, 2].tolist()):
        conds[k] = (q, count)
    timings, timing = tasks.timings, tasks.timing[order]
    flows = np.array([flow is not None for _, _, flow in timings] or [False], dtype=bool)[timing]
    table = np.empty(len(timings), dtype=object)        # indexed in numpy: one lookup per task in C
    table[:] = timings
    return Part(legion * width + tasks.queue[order] % width, tasks.kind[order], conds,
                table[timing].tolist(), flows.tolist(), _mult(legion, size).tolist(),
                [at * width + names.index(q) for at, q in parties], names)


def _mult(legion: np.ndarray, size) -> np.ndarray:
    """Per task, its class's member count (``size``, by representative), or 1 for none."""
    if size is None or not len(legion):
        return np.ones(len(legion), np.int64)
    per_legion = np.zeros(max(size) + 1, np.int64)
    per_legion[list(size)] = list(size.values())
    return per_legion[legion]


@dataclass
class Segment:
    lo: int             # its tasks are lo..hi-1 (maybe none); task hi is the barrier after it, if any
    hi: int
    key: tuple          # equal keys, equal times
    order: np.ndarray   # the tasks simulated: the representatives', in program order
    dst: np.ndarray     # tasks that take a simulated task's times ...
    src: np.ndarray     # ... and the simulated task (its position in ``order``) they take them from
    part: object        # () -> the Part to simulate

    def in_order(self, completed: list) -> np.ndarray:
        """The tasks ``completed`` (simulated tasks, by position in ``order``) stand for, in
        that order, each one's in task order: what :meth:`copies` lists, as one sort."""
        at = np.full(len(self.order), -1, dtype=np.int64)
        at[np.asarray(completed, dtype=np.int64)] = np.arange(len(completed))
        task = np.concatenate([self.order, self.dst])
        rank = at[np.concatenate([np.arange(len(self.order)), self.src])]
        keep = rank >= 0
        task, rank = task[keep], rank[keep]
        return task[np.lexsort((task, rank))]

    def copies(self) -> list[list[int]]:
        """Per simulated task, in order, the tasks it stands for (itself included)."""
        out = [[k] for k in self.order.tolist()]
        for k, j in zip(self.dst.tolist(), self.src.tolist()):
            out[j].append(k)
        for c in out:
            c.sort()
        return out


def segments(tasks: Tasks, legions: int, parties: list):
    """The program's segments in order."""
    base = np.zeros((legions, len(QUEUES)), dtype=np.int64)     # tasks each queue ran before
    bounds = np.flatnonzero(tasks.kind == BARRIER).tolist() + [len(tasks.kind)]
    lo = 0
    for hi in bounds:
        yield _segment(tasks, lo, hi, base, legions, parties)
        seg = slice(lo, hi)
        np.add.at(base, (tasks.legion[seg], tasks.queue[seg]), 1)
        base += 1                       # the barrier after it counts in every queue
        lo = hi + 1


def _segment(tasks: Tasks, lo: int, hi: int, base: np.ndarray, legions: int, parties: list) -> Segment:
    legion, cond = tasks.legion[lo:hi], _relative(tasks.cond[lo:hi], base)
    rows = np.stack([tasks.queue[lo:hi], tasks.kind[lo:hi], tasks.timing[lo:hi],
                     cond[:, 0], cond[:, 1], cond[:, 2]], axis=1)
    # the rows by Legion, each Legion's in order: its signature is one slice of them
    by_legion = np.argsort(legion, kind="stable")
    cut = np.searchsorted(legion[by_legion], np.arange(legions + 1))
    own = [by_legion[cut[l]:cut[l + 1]] for l in range(legions)]
    sigs = rows[by_legion]
    sigs[:, 3] = np.where(sigs[:, 3] == legion[by_legion], OWN, sigs[:, 3])
    classes: dict = {}                      # signature -> its Legions
    for l in range(legions):
        classes.setdefault(sigs[cut[l]:cut[l + 1]].tobytes(), []).append(l)
    rep = np.empty(legions, dtype=np.int64)
    size = {}
    for members in classes.values():
        rep[members], size[members[0]] = members[0], len(members)
    reps = sorted(size)
    is_rep = np.zeros(legions, dtype=bool)
    is_rep[reps] = True
    order = np.flatnonzero(is_rep[legion])
    at = np.full(hi - lo, -1, dtype=np.int64)
    at[order] = np.arange(len(order))
    dst, src = [], []
    for members in classes.values():
        for m in members[1:]:
            dst.append(own[m]), src.append(at[own[members[0]]])
    layout = [tuple(m) for m in classes.values()]
    key = (tuple(layout), *classes, rep[legion[order]].tobytes())     # (the signatures' hashes are kept)
    glob = order + lo

    def part() -> Part:
        return _part(tasks, glob, cond[order], rep.tolist(), size, parties)

    cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64))
    return Segment(lo, hi, key, glob, cat(dst) + lo, cat(src), part)


def _relative(cond: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Conditions counted from the segment's start (``base``); NONE rows where none is left
    to wait for (met before the segment began)."""
    out = np.full_like(cond, NONE)
    some = cond[:, 0] != NONE
    count = cond[some, 2] - base[cond[some, 0], cond[some, 1]]
    keep = np.flatnonzero(some)[count > 0]
    out[keep, 0], out[keep, 1], out[keep, 2] = cond[keep, 0], cond[keep, 1], count[count > 0]
    return out
