"""Barriers give way to waits for what the next instructions actually share with earlier ones.

Every node ends in a barrier, and some kernels order their phases with one: every queue of
every Legion then idles until the slowest is done, so a row kernel's norm or quantization
cannot run on the vector unit while the arrays multiply, nor the next matmul's weights stream
in during the previous matmul. This pass drops the barriers and, instruction by instruction,
adds the waits that order it after every earlier instruction it conflicts with: one touching
an element of the same scratchpad or DRAM tensor, one of the two writing (``footprint``).

- **What is known ordered** is what the race check proves (runtime/races.py), folded into a
  vector per queue (:class:`_Known`): a queue's task knows done what its condition's target
  knew once done, and what the task before it on the queue knew (done, for ``mat`` and
  ``vec``; only started, for a DMA queue, whose next transfer may start before the last has
  landed). A conflict already known ordered needs no wait; so the waits a kernel writes
  between its own phases stay, and only what crossed a barrier is added.
- **Footprints are bounds**: the first to the last element an operand touches. A strided
  window may thus wait for a neighbour it never touches; never the other way round. Only a
  contiguous write replaces what it covers in the ledger (a later access is ordered after it,
  hence after what it replaced); a strided or masked one leaves the older accesses there.
- **Conditions** are kept relative to program order. A kernel's own conditions are first
  turned into the instructions they name (a barrier they named: the queue up to it, the rest
  of its meaning recovered by the conflicts), then written again for the new order.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

import numpy as np

from isa.arch import MODE_BITS, Arch
from isa.encoding import renamed_tensors
from isa.expand import absolute
from isa.fields import QUEUES, Cond, View
from isa.instructions import (Barrier, DmaLoad, DmaStore, Drain, Gather, MatMul, NocAdd, NocMove, VBinary, VMatMul,
                              VReduce, VSelect, VUnary, Wait)
from isa.program import Program

DMA = QUEUES.index("dma")
UNTRACKED = ("const", "input")      # never written: no ordering to keep


def overlap(program: Program, arch: Arch) -> Program:
    """``program`` with its barriers replaced by the waits that keep it ordered, but those
    between the layers of a model (``layer_ends``)."""
    if not any(isinstance(i, Barrier) for i in program.instrs):
        return program
    instrs, starts = _Rewrite(program, arch, layer_ends(program)).run()
    regions = [(starts[at] if at < len(starts) else len(instrs), name) for at, name in program.regions]
    return replace(program, instrs=instrs, regions=regions)


def reused(program: Program, seen: dict, how, make) -> tuple[list, object]:
    """``make(program)``: the instructions of ``program`` rewritten (overlap's ``_Rewrite`` in
    an order of the caller's) and what else the caller derives of them, naming no DRAM tensor.
    A program that repeats one met before (``seen``) but for the DRAM tensors it names (the
    same kernels in each layer of a decoder), made the same way (``how``, hashable), takes the
    earlier result with its own tensors: of a tensor, the rewrite and the costs that order it
    see its kind, type and shape, not its index."""
    instrs, named = _renamed(program.instrs, None)
    tensors = tuple((t.kind, t.dtype, t.shape) for t in map(program.tensors.__getitem__, named))
    key = (instrs, tensors, how)
    if key in seen:
        out, derived = seen[key]
        return list(_renamed(out, dict(enumerate(named)))[0]), derived
    out, derived = make(program)
    seen[key] = _renamed(out, {t: j for j, t in enumerate(named)})[0], derived
    return out, derived


def _renamed(instrs, rename: dict | None) -> tuple[tuple, list[int]]:
    """``instrs`` with each DRAM tensor they name renamed by ``rename``, or (None) numbered in
    the order of first use; and the tensors in that order."""
    first: dict = {}
    number = (lambda t: first.setdefault(t, len(first))) if rename is None else rename.__getitem__
    return tuple(renamed_tensors(i, number) for i in instrs), list(first)


LAYER = re.compile(r"(?:^|[./_])layers?[._](\d+)[./_]")


def layer_ends(program: Program) -> set[int]:
    """The barriers where the regions move on to the next layer of the model (by the layer
    index in the ONNX node names, ``model.layers.3.mlp/...``; a region named otherwise is of
    the layer before it). They stay: the timing model and the race check take each stretch
    between barriers that repeats an earlier one (a decoder's layers) once, and what a node
    could overlap across a layer's end is one node's worth in a layer's dozens."""
    keep, layer = set(), None
    for at, name in program.regions:
        m = LAYER.search(name)
        now = m.group(1) if m else layer
        if layer is not None and now != layer and at > 0 and isinstance(program.instrs[at - 1], Barrier):
            keep.add(at - 1)
        layer = now
    return keep


# --- footprints -------------------------------------------------------------------------------

def _span(i) -> int:
    return getattr(i, "span", None) or 1


def _window(addr: int, rows: int, cols: int, rs: int, cs: int) -> tuple | None:
    """(first element, one past the last, whether the window is every element between, its
    rectangle): the window's rows as rows of a matrix of row length ``rs`` (first row, end
    row, first column, end column), None when they do not lie so (a strided or wrapping one)."""
    if rows <= 0 or cols <= 0:
        return None
    last = addr + (rows - 1) * rs + (cols - 1) * cs
    whole = (cols == 1 or cs == 1) and (rows == 1 or rs == cols * (cs if cols > 1 else 1))
    rect = None
    width = (cols - 1) * cs + 1
    if (cols == 1 or cs == 1) and rs > 0 and addr % rs + width <= rs:
        rect = (rs, addr // rs, addr // rs + rows, addr % rs, addr % rs + width)
    return addr, last + 1, whole, rect


def _meet(a: tuple, b: tuple) -> bool:
    """Whether two accesses (first, end, ..., rectangle last) may share an element."""
    if a[0] >= b[1] or b[0] >= a[1]:
        return False
    ra, rb = a[-1], b[-1]
    if ra is None or rb is None or ra[0] != rb[0]:
        return True
    return ra[1] < rb[2] and rb[1] < ra[2] and ra[3] < rb[4] and rb[3] < ra[4]


def _covers(new: tuple, old: tuple) -> bool:
    """Whether every element of ``old`` is one ``new`` writes (``new``: first, end, whole, rect)."""
    if new[2] and new[0] <= old[0] and old[1] <= new[1]:
        return True
    rn, ro = new[3], old[-1]
    return (rn is not None and ro is not None and rn[0] == ro[0] and rn[1] <= ro[1] and ro[2] <= rn[2]
            and rn[3] <= ro[3] and ro[4] <= rn[4])


def accesses(program: Program, ks) -> dict:
    """Space -> [(window, write)] of every access the instructions ``ks`` of ``program`` make,
    rank by rank (``footprint``; a barrier makes none)."""
    out: dict = {}
    for k in ks:
        add_accesses(out, program.instrs[k], program.tensors)
    return out


def add_accesses(out: dict, i, tensors) -> dict:
    """``out`` (space -> [(window, write)]) with the accesses of instruction ``i`` added."""
    for r in range(0 if isinstance(i, Barrier) else _span(i)):
        for space, win, write, _ in footprint(i, r, tensors):
            out.setdefault(space, []).append((win, write))
    return out


def conflicting(a: dict, b: dict) -> bool:
    """Whether two collections of accesses (``accesses``) may share an element one of them
    writes (by the bounds of their windows)."""
    for space, theirs in b.items():
        for win, write in a.get(space, ()):
            if any((write or wb) and _meet(win, other) for other, wb in theirs):
                return True
    return False


def footprint(i, rank: int, tensors) -> list[tuple]:
    """Rank ``rank``'s accesses: (space, window, write, whole) where space is (Legion,
    scratchpad space) or a DRAM tensor's index (only those the program writes), window as
    ``_window`` gives it, and whole whether a write sets every element of it."""
    L = i.legion + rank
    out: list = []

    def spad(legion, v, rows, cols, write=False, partial=False):
        w = _window(v.addr, rows, cols, v.rs, v.cs) if isinstance(v, View) else None
        if w is not None:
            out.append(((legion, v.space), w, write, not partial))

    def dram(ref, rows, cols, write=False):
        if tensors[ref.tensor].kind in UNTRACKED:
            return
        w = _window(ref.offset + rank * (getattr(i, "lstride", None) or 0), rows, cols, ref.rs, 1)
        if w is not None:
            out.append((ref.tensor, w, write, True))

    if isinstance(i, DmaLoad):
        dram(i.src, i.rows, i.cols)
        for d in i.dests:
            spad(d + rank, i.dst, i.rows, i.cols, write=True)
    elif isinstance(i, NocMove):
        spad(L, i.src, i.rows, i.cols)
        for d in i.dests:
            if isinstance(i, NocAdd):            # a reducing transfer reads what it adds to
                spad(d + rank, i.dst, i.rows, i.cols)
            spad(d + rank, i.dst, i.rows, i.cols, write=True)
    elif isinstance(i, DmaStore):
        spad(L, i.src, i.rows, i.cols)
        dram(i.dst, i.rows, i.cols, write=True)
    elif isinstance(i, Gather):
        spad(L, i.ids, i.rows, 1)
        if tensors[i.table.tensor].kind not in UNTRACKED:
            out.append((i.table.tensor, _window(0, 1, tensors[i.table.tensor].storage_elems, 1, 1), False, True))
        spad(L, i.dst, i.rows, i.cols, write=True)
    elif isinstance(i, MatMul):
        spad(L, i.act, i.M, i.K)
        spad(L, i.wgt, i.K, -(-i.N * MODE_BITS[i.mode] // 8))
        if i.accumulate == "add":
            spad(L, i.acc, i.M, i.N)
        spad(L, i.acc, i.M, i.N, write=True)
    elif isinstance(i, Drain):
        spad(L, i.acc, i.M, i.N)
        for space, addr, n in (("acc", i.zp, i.N), ("vec", i.rscale, i.M), ("vec", i.cscale, i.N),
                               ("vec", i.bias, i.N)):
            if addr is not None:
                spad(L, View(space, addr, 1), 1, n)
        if i.accumulate == "add":
            spad(L, i.dst, i.M, i.N)
        spad(L, i.dst, i.M, i.N, write=True)
    elif isinstance(i, VMatMul):
        spad(L, i.a, i.M, i.K)
        spad(L, i.b, i.K, i.N)
        spad(L, i.dst, i.M, i.N, write=True)
    elif isinstance(i, VSelect):
        spad(L, i.cond, i.rows, i.cols)
        spad(L, i.a, i.rows, i.cols)
        spad(L, i.dst, i.rows, i.cols, write=True, partial=True)
    elif isinstance(i, VReduce):
        spad(L, i.a, i.rows, i.cols)
        spad(L, i.dst, i.rows, 1, write=True)
    elif isinstance(i, (VUnary, VBinary)):
        spad(L, i.a, i.rows, i.cols)
        spad(L, getattr(i, "b", None), i.rows, i.cols)
        spad(L, i.dst, i.rows, i.cols, write=True)
    elif not isinstance(i, Wait):
        raise ValueError(f"internal: no footprint for {i.MNEMONIC}")
    return out


# --- the ledger of accesses ---------------------------------------------------------------------

class _Ledger:
    """One space's accesses a later one may conflict with: (first, end, queue, count, write,
    instruction, rectangle), count being the queue's completed count that has the access done.

    A DRAM tensor's accesses are filed by address in ``BLOCKS`` blocks (an access in every
    block it spans), so that one row's access looks at the rows near it, not at the thousands
    of rows the other Legions wrote; a scratchpad's few are one list."""

    PRUNE_AT, PRUNE_EVERY = 16, 16         # (what pruning drops would never be waited for)
    BLOCKS, NARROW, WIDE = 64, 2, -1

    def __init__(self, size: int | None = None):
        self.block = -(-size // self.BLOCKS) if size else None
        self.blocks: dict[int, list] = {}

    def _keys(self, lo: int, end: int) -> tuple:
        """The blocks an access is filed in: those it spans, or ``WIDE`` past ``NARROW`` of them
        (a column of every row would else be in all of them, and met once per block)."""
        if not self.block:
            return (0,)
        last = self.BLOCKS - 1      # (a strided window may end past the tensor: the last block)
        first, end = min(lo // self.block, last), min((end - 1) // self.block, last) + 1
        return tuple(range(first, end)) if end - first <= self.NARROW else (self.WIDE,)

    def _near(self, keys: tuple):
        """The lists an access filed in ``keys`` may meet an access of."""
        if keys == (self.WIDE,):
            return list(self.blocks.values())
        return [self.blocks[key] for key in keys + (self.WIDE,) if key in self.blocks]

    def __len__(self) -> int:
        return sum(map(len, self.blocks.values()))

    def need(self, win: tuple, write: bool, k: int, known: list, q: int, need: dict) -> None:
        """Raise ``need`` (queue -> count) to every access conflicting with ``win`` that ``known``
        does not have done. A later transfer of the same DMA queue needs none when the earlier
        one read, or when it writes (it is sent after the earlier one and lands after what that
        wrote); it is not ordered after a write it reads. Inlined: this loop is most of the
        pass's time."""
        lo, end, _, rw = win
        dma = q % len(QUEUES) == DMA
        for items in self._near(self._keys(lo, end)):
            for e in items:
                if e[0] < end and lo < e[1] and (write or e[4]) and e[5] != k:
                    t, c = e[2], e[3]
                    if known[t] >= c or (dma and t == q and (write or not e[4])):
                        continue
                    re = e[6]
                    if rw is not None and re is not None and rw[0] == re[0] and not (
                            rw[1] < re[2] and re[1] < rw[2] and rw[3] < re[4] and re[3] < rw[4]):
                        continue
                    if need.get(t, 0) < c:
                        need[t] = c

    def add(self, win: tuple, q: int, count: int, write: bool, k: int, whole: bool) -> None:
        lo, end = win[0], win[1]
        keys = self._keys(lo, end)
        if whole:
            # Whatever is ordered after this access is ordered after the ones it covers:
            # a write covers every access, a read the reads of its own queue (an access it
            # covers lies within its bounds: in its blocks, or any when it is wide).
            for key, items in list(self.blocks.items()):
                if keys == (self.WIDE,) or key in keys:
                    self.blocks[key] = [
                        e for e in items if e[1] <= lo or e[0] >= end
                        or not ((write or (not e[4] and e[2] == q)) and _covers(win, e))]
        entry = (lo, end, q, count, write, k, win[3])
        for key in keys:
            self.blocks.setdefault(key, []).append(entry)

    def prune(self, floor: np.ndarray) -> None:
        """Drop the accesses every queue that may still touch the space knows done."""
        floor = floor.tolist()
        for key, items in list(self.blocks.items()):
            kept = [e for e in items if floor[e[2]] < e[3]]
            if kept:
                self.blocks[key] = kept
            else:
                del self.blocks[key]


class _Rewrite:
    """``order``, when given: the instructions (no barriers) in a new order, each after those its
    own condition names; what it shares with the others is ordered as the new order has it
    (``rowblocks.py`` interleaves kernels that share nothing)."""

    def __init__(self, program: Program, arch: Arch, keep: set[int] = frozenset(), order: list[int] | None = None):
        self.program, self.arch, self.keep, self.order = program, arch, keep, order
        self.targets = None if order is None else _targets(program, arch)     # (k, Legion) -> (Legion, queue, k)
        self.placed: dict = {}                      # (k, Legion) -> its new count on its queue
        self.nq = arch.legions * len(QUEUES)
        self.issued: Counter = Counter()            # new order: (Legion, queue) -> items
        self.old_issued: Counter = Counter()        # old order, barriers counted everywhere
        self.renumber: dict = {}                    # (Legion, queue) -> new count after each old item
        self.done: dict = {}                        # qid -> each item's known vector once done
        self.start = np.zeros((self.nq, self.nq), np.int64)   # what the next task of each queue knows
        self.ledgers: dict = {}
        # An instruction's place in the order the rewrite runs; space -> (queues touching it,
        # the place of the last instruction of each there).
        self.place = np.arange(len(program.instrs)) if order is None else _places(order, len(program.instrs))
        self.users = self._users()
        self.out: list = []

    def qid(self, legion: int, queue: str) -> int:
        return legion * len(QUEUES) + QUEUES.index(queue)

    def _users(self) -> dict:
        users: dict = {}
        for k, i in enumerate(self.program.instrs):
            if isinstance(i, (Barrier, Wait)):
                continue
            # Rank r touches rank 0's scratchpads r Legions on, and the same DRAM tensors.
            spaces = {space for space, *_ in footprint(i, 0, self.program.tensors)}
            for r in range(_span(i)):
                q = self.qid(i.legion + r, i.queue())
                for space in spaces:
                    last = users.setdefault((space[0] + r, space[1]) if isinstance(space, tuple) else space, {})
                    last[q] = max(last.get(q, -1), self.place[k])
        return {s: (np.array(list(last)), np.array(list(last.values()))) for s, last in users.items()}

    def run(self) -> tuple[list, list[int]]:
        if self.order is not None:
            return self._run_in_order()
        starts = []
        for k, i in enumerate(self.program.instrs):
            starts.append(len(self.out))
            if isinstance(i, Barrier) and k in self.keep:
                self._barrier()
            elif isinstance(i, Barrier):
                self._count_old_barrier()
            else:
                self._place(k, i)
            if k % _Ledger.PRUNE_EVERY == 0:
                self._prune(k)
        return self.out, starts

    def _run_in_order(self) -> tuple[list, list[int]]:
        starts = [0] * len(self.program.instrs)
        for at, k in enumerate(self.order):
            starts[k] = len(self.out)
            self._place(k, self.program.instrs[k])
            if at % _Ledger.PRUNE_EVERY == 0:
                self._prune(at)
        return self.out, starts

    def _barrier(self) -> None:
        """A barrier kept: every queue knows done all that came before it, and it."""
        self.out.append(Barrier())
        keys = [(legion, q) for legion in range(self.arch.legions) for q in QUEUES]
        for key in keys:
            self.issued[key] += 1
            self.old_issued[key] += 1
            self.renumber.setdefault(key, []).append(self.issued[key])
        known = np.array([self.issued[key] for key in keys], np.int64)
        for key in keys:
            self.done.setdefault(self.qid(*key), []).append(known)
        self.start[:] = known
        self.ledgers.clear()

    def _count_old_barrier(self) -> None:
        for legion in range(self.arch.legions):
            for q in QUEUES:
                key = (legion, q)
                self.old_issued[key] += 1
                self.renumber.setdefault(key, []).append(self.issued[key])

    # -- one instruction ----------------------------------------------------------------------
    def _place(self, k: int, i) -> None:
        queue, span = i.queue(), _span(i)
        ranks = [i.legion + r for r in range(span)]
        own = self._own_targets(k, i, ranks)
        needs, prints = [], [footprint(i, r, self.program.tensors) for r in range(span)]
        for r, legion in enumerate(ranks):
            q = self.qid(legion, queue)
            known = self._knowing(q, own[r]).tolist()
            need = dict(own[r])
            for space, win, write, _ in prints[r]:
                ledger = self.ledgers.get(space)
                if ledger is not None:
                    ledger.need(win, write, k, known, q, need)
            needs.append(need)
        conds, alone = self._conditions(ranks, needs)
        for legion, cond in alone:
            self._emit(Wait(legion, queue, cond), [legion])
        if isinstance(i, Wait):         # its own condition is among them; none left: not needed
            for cond in conds:
                self._emit(replace(i, until=cond), ranks)
        else:
            for cond in conds[1:]:
                self._emit(Wait(i.legion, queue, cond, span=i.span if span > 1 else None), ranks)
            self._emit(replace(i, wait=conds[0] if conds else None), ranks, k, prints)
        for legion in ranks:
            key = (legion, queue)
            self.old_issued[key] += 1
            self.renumber.setdefault(key, []).append(self.issued[key])

    def _own_targets(self, k: int, i, ranks: list[int]) -> list[dict]:
        """Per rank, the items (qid -> new count) its own condition waited for."""
        cond = i.condition()
        out = []
        for legion in ranks:
            need = {}
            if self.targets is not None:
                target = self.targets.get((k, legion))
                if target is not None:
                    tl, tq, tk = target
                    need[self.qid(tl, tq)] = self.placed[(tk, tl)]     # KeyError: placed too early
            elif cond is not None:
                c = absolute(cond, legion, self.old_issued)
                if c.count > 0:
                    new = self.renumber[(c.legion, c.queue)][c.count - 1]
                    if new > 0:
                        need[self.qid(c.legion, c.queue)] = new
            out.append(need)
        return out

    def _knowing(self, q: int, need: dict) -> np.ndarray:
        known = self.start[q].copy()
        for t, c in need.items():
            np.maximum(known, self.done[t][c - 1], out=known)
        return known

    def _conditions(self, ranks: list[int], needs: list[dict]) -> tuple[list[Cond], list]:
        """Conditions that make each rank wait for what it needs: a queue of another Legion
        by name (the most any rank needs), one of the rank's own Legion by a relative
        condition on its own queue when every rank needs as far back; else a ``wait`` of
        that rank alone, (Legion, condition), so that no rank waits for more than it needs."""
        own, other, alone = {}, {}, []
        for legion, need in zip(ranks, needs):
            for t, c in need.items():
                tl, tq = divmod(t, len(QUEUES))
                if tl == legion and len(ranks) > 1:
                    own.setdefault(tq, {})[legion] = self.issued[(legion, QUEUES[tq])] - c
                else:
                    other[(tl, tq)] = max(other.get((tl, tq), 0), c)
        conds = []
        for tq, backs in sorted(own.items()):
            if len(backs) == len(ranks) and len(set(backs.values())) == 1:
                conds.append(Cond(None, QUEUES[tq], None, next(iter(backs.values()))))
            else:
                alone += [(legion, Cond(legion, QUEUES[tq], None, back)) for legion, back in sorted(backs.items())]
        conds += [Cond(tl, QUEUES[tq], None, self.issued[(tl, QUEUES[tq])] - c) for (tl, tq), c in sorted(other.items())]
        return conds, alone

    def _emit(self, i, ranks: list[int], k: int | None = None, prints: list | None = None) -> None:
        """Append ``i`` (a Wait when ``k`` is None; else each rank's ``footprint``, ``prints``)
        and fold what its tasks know."""
        self.out.append(i)
        queue, cond = i.queue(), i.condition()
        for r, legion in enumerate(ranks):
            q = self.qid(legion, queue)
            known = self.start[q]           # the next task of a DMA queue knows what this one did
            if cond is not None:
                c = absolute(cond, legion, self.issued)
                if c.count > 0:
                    np.maximum(known, self.done[self.qid(c.legion, c.queue)][c.count - 1], out=known)
            place = self.issued[(legion, queue)]
            if k is not None:
                self.placed[(k, legion)] = place + 1
            done = known.copy()
            done[q] = max(done[q], place + 1)
            self.done.setdefault(q, []).append(done)
            if q % len(QUEUES) != DMA:      # ... and that of another queue, what this one did done
                known[q] = done[q]
            if k is not None:
                for space, win, write, whole in prints[r]:
                    self._ledger(space).add(win, q, place + 1, write, k, whole)
        for legion in ranks:        # after all: a relative condition counts what came before
            self.issued[(legion, queue)] += 1

    def _ledger(self, space) -> _Ledger:
        ledger = self.ledgers.get(space)
        if ledger is None:
            size = None if isinstance(space, tuple) else self.program.tensors[space].storage_elems
            ledger = self.ledgers[space] = _Ledger(size)
        return ledger

    def _prune(self, at: int) -> None:
        """Drop, from the large ledgers, the accesses that the next task of every queue that
        touches the space after the instruction placed ``at``-th knows done (what a queue's
        tasks know only grows along it); a space none touches again, whole."""
        for space, ledger in list(self.ledgers.items()):
            if len(ledger) > _Ledger.PRUNE_AT:
                queues, last = self.users[space]
                later = queues[last > at]
                if len(later):
                    ledger.prune(self.start[later].min(axis=0))
                else:
                    del self.ledgers[space]


def _places(order: list[int], n: int) -> np.ndarray:
    """Per instruction, its place in ``order`` (-1: a barrier, left out)."""
    place = np.full(n, -1, np.int64)
    place[np.asarray(order, np.int64)] = np.arange(len(order))
    return place


def _targets(program: Program, arch: Arch) -> dict:
    """(k, Legion) -> (Legion, queue, k') of the instruction k' the condition of instruction k
    names on that Legion, in program order (none when it names a barrier: what crossed a
    barrier is ordered by the conflicts)."""
    issued: Counter = Counter()
    on: dict = {}                       # (Legion, queue) -> instructions in order, -1 a barrier
    out = {}
    for k, i in enumerate(program.instrs):
        if isinstance(i, Barrier):
            for key in ((legion, q) for legion in range(arch.legions) for q in QUEUES):
                on.setdefault(key, []).append(-1)
                issued[key] += 1
            continue
        cond, queue = i.condition(), i.queue()
        ranks = [i.legion + r for r in range(_span(i))]
        for legion in ranks:
            if cond is not None:
                c = absolute(cond, legion, issued)
                if c.count > 0:
                    t = on[(c.legion, c.queue)][c.count - 1]
                    out[(k, legion)] = (c.legion, c.queue, t) if t >= 0 else None
        for legion in ranks:
            on.setdefault((legion, queue), []).append(k)
            issued[(legion, queue)] += 1
    return out
