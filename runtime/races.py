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
instructions are known done when it starts. :class:`RaceCheck` keeps, per scratchpad and per
DRAM tensor the program writes, a ledger of the accesses (windows) a later task might not be
ordered after. The emulator calls it for each access, in an order that respects every
dependency (program order, an instruction's tasks together, for a compiled program); an access
whose earlier conflicting access is not known done is a race, reported with both instructions.
(A gather's table rows and a matmul's block mask are read-only constants in the programs the
compiler writes and are not tracked.)
"""
from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from operator import gt

import numpy as np

from isa.arch import Arch
from isa.expand import DRAM_FIELD, NONE, Tasks, in_program_order
from isa.fields import QUEUES, View
from isa.instructions import DmaStore
from isa.program import Program
from runtime.races_chains import known_by_chains
from runtime.state import Trap

DMA = QUEUES.index("dma")
UNTRACKED = ("const", "input")      # tensors no program writes: no ordering to prove


class Order:
    """Per task of an expanded program: its queue, its place there, and ``known[k, q]``, how
    many tasks of queue ``q`` are done before ``k`` starts. A queue's items are its own tasks
    and every barrier, in program order."""

    def __init__(self, program: Program, arch: Arch, unchecked=None):
        """``unchecked``: per source instruction, True where no access will be checked (a
        segment the emulator skips, see :func:`segment_key`); its tasks' ``known`` rows are
        left 0, which only a task of that segment would read."""
        tasks = program.instrs if isinstance(program.instrs, Tasks) else Tasks(list(program.instrs), arch.legions)
        self.unchecked = unchecked
        self.nq = arch.legions * len(QUEUES)
        barrier = tasks.legion == NONE
        self.queue = np.where(barrier, NONE, tasks.legion * len(QUEUES) + tasks.queue)
        self._items(np.flatnonzero(~barrier), np.flatnonzero(barrier))
        self._dependencies(tasks)
        self.known = self._knowledge(tasks, arch.legions)
        self.origin = tasks.origin
        self._tasks = tasks

    def own_bounds(self) -> tuple[list, list, list]:
        """Per instruction: ``own_known[o][q]``, the fewest tasks of queue kind ``q`` on its
        own Legion any of its tasks knows done; ``top_place[o]``, the highest place of its
        tasks on their queues; and per queue kind, per task, the count of that kind of queue of
        its own Legion it knows (``own_by_kind``). A rank of one instruction on Legion L is
        ordered after a rank of another there when the first's bound exceeds the second's top
        place: one comparison for the whole span instead of one per Legion. Only the check
        access by access uses them: computed when it asks."""
        tasks, n, kinds = self._tasks, len(self.queue), len(QUEUES)
        if not n:
            return [], [], [array("i") for _ in QUEUES]
        own = (tasks.legion != NONE) & (tasks.queue >= 0) & (tasks.queue < kinds)
        cols = np.clip(tasks.legion, 0, None)[:, None] * kinds + np.arange(kinds)
        diag = np.take_along_axis(self.known, np.clip(cols, 0, self.nq - 1), axis=1).astype(np.int64)
        diag[~own] = -1                       # no shortcut for a task off the machine's queues
        own_known = np.minimum.reduceat(diag, tasks.first, axis=0).tolist()
        # own_by_kind as machine integers: sliced like lists, without an int object per element.
        own_by_kind = [array("i", np.ascontiguousarray(diag[:, q], np.int32).tobytes()) for q in range(kinds)]
        place = np.where(own, self.place, np.iinfo(np.int64).max)
        return own_known, np.maximum.reduceat(place, tasks.first).tolist(), own_by_kind

    def qid(self, legion: int, queue: str) -> int:
        return legion * len(QUEUES) + QUEUES.index(queue)

    def _items(self, own: np.ndarray, bars: np.ndarray) -> None:
        """Each queue's items (``items[q]``), each task's place on its queue, each barrier's
        place on every queue (``bar_place[b]``), each task's item before it on its queue."""
        nq, n = self.nq, len(self.queue)
        q_of = np.concatenate([self.queue[own], np.repeat(np.arange(nq), len(bars))])
        k_of = np.concatenate([own, np.tile(bars, nq)])
        by = np.lexsort((k_of, q_of))
        q_of, k_of = q_of[by], k_of[by]
        starts = np.searchsorted(q_of, np.arange(nq + 1))
        self.items = [k_of[starts[q]:starts[q + 1]] for q in range(nq)]
        place = np.arange(len(k_of)) - starts[q_of]
        self.place = np.zeros(n, np.int64)
        is_own = self.queue[k_of] != NONE
        self.place[k_of[is_own]] = place[is_own]
        self.bar_index = np.full(n, NONE, np.int64)
        self.bar_index[bars] = np.arange(len(bars))
        self.bar_place = np.zeros((len(bars), nq), np.int64)
        self.bar_place[self.bar_index[k_of[~is_own]], q_of[~is_own]] = place[~is_own]
        self.prev = np.full(n, NONE, np.int64)
        earlier = is_own & (place > 0)
        self.prev[k_of[earlier]] = k_of[np.flatnonzero(earlier) - 1]
        self._starts, self._flat = starts, k_of

    def _dependencies(self, tasks: Tasks) -> None:
        """``prev_done``: whether a task waits for its queue's item before it to be done (a DMA
        queue's last transfer has only left DRAM, unless it is a barrier); ``target``: the
        task its condition names, NONE for none."""
        prev = self.prev
        dma = (self.queue % len(QUEUES) == DMA) & (self.queue != NONE)
        self.prev_done = ~dma | ((prev != NONE) & (self.bar_index[np.maximum(prev, 0)] != NONE))
        legion, queue, count = tasks.cond.T
        q = legion * len(QUEUES) + queue
        size = np.where(legion == NONE, 0, self._starts[np.clip(q + 1, 0, self.nq)] - self._starts[np.clip(q, 0, self.nq)])
        named = (count >= 1) & (count <= size)
        self.target = np.full(len(prev), NONE, np.int64)
        self.target[named] = self._flat[self._starts[q[named]] + count[named] - 1]

    def _deps(self, k: int) -> list:
        """(task, whether it must be done) pairs task ``k`` waits for."""
        if self.queue[k] == NONE:
            return [(int(items[self.bar_place[self.bar_index[k], q] - 1]), True)
                    for q, items in enumerate(self.items) if self.bar_place[self.bar_index[k], q]]
        deps = [] if self.prev[k] == NONE else [(int(self.prev[k]), bool(self.prev_done[k]))]
        return deps + ([] if self.target[k] == NONE else [(int(self.target[k]), True)])

    def _knowledge(self, tasks: Tasks, legions: int) -> np.ndarray:
        """``known``. A compiled program waits only for earlier instructions: program order is
        an order to compute in, by chains (runtime/races_chains.py). A hand-written one may
        wait for a later one: task by task, depth first then, in a table of 2n + 1 rows: what
        each task knows done when it starts (rows 0..n-1), once it is done (rows n..2n-1: its
        queue(s) up to it as well), and nothing (row 2n, for an absent dependency)."""
        if (ordered := in_program_order(tasks, legions)):
            self.in_program_order = ordered
            return known_by_chains(self, tasks)
        self.in_program_order = False
        n = len(self.queue)
        table = np.zeros((2 * n + 1, self.nq), np.int32)
        # A task reads its queue's item before it as started or done, and its condition's as done.
        via_prev = np.where(self.prev == NONE, 2 * n, self.prev + n * self.prev_done)
        via_target = np.where(self.target == NONE, 2 * n, self.target + n)
        own = self.queue != NONE
        place = np.where(own, self.place + 1, 0)
        at = np.where(own, self.queue, 0)
        for k in _depth_first([self._deps(k) for k in range(n)]):
            if not own[k]:
                self._barrier(table, k)
                continue
            row = np.maximum(table[via_prev[k]], table[via_target[k]])
            table[k] = row
            row[at[k]] = max(row[at[k]], place[k])
            table[n + k] = row
        return table[:n]

    def _barrier(self, table: np.ndarray, k: int) -> None:
        """A barrier knows done what the last item of every queue knew once done; once done
        itself, every queue up to it."""
        n = len(self.queue)
        deps = [d for d, _ in self._deps(k)]
        table[k] = table[np.array(deps, np.int64) + n].max(axis=0) if deps else 0
        table[n + k] = np.maximum(table[k], self.bar_place[self.bar_index[k]] + 1)


def _depth_first(deps: list) -> list[int]:
    """The instructions in an order where each comes after those it depends on (in a cycle,
    which deadlocks anyway, after those that do not depend on it in turn)."""
    out, state = [], [0] * len(deps)          # 0 unvisited, 1 on the stack, 2 placed
    for root in range(len(deps)):
        stack = [root]
        while stack:
            k = stack[-1]
            if state[k] == 2:
                stack.pop()
                continue
            todo = [d for d, _ in deps[k] if state[d] != 2]
            if todo and state[k] == 0:
                state[k] = 1
                stack.extend(todo)
                continue
            state[k] = 2
            out.append(k)
            stack.pop()
    return out


# An access the ledger keeps: its bounds (lowest, highest element), task, queue, the queue's
# count once the task is done, whether it writes, its window (addr, rows, cols, rs, cs) and
# that window as a rectangle (or None, see _rectangle).
Access = tuple

PRUNE_EVERY = 256       # tasks between two sweeps that drop accesses every later task is ordered after


class Ledger:
    """The kept accesses of one scratchpad space of every Legion, by lowest element: those an
    access's bounds can meet are found by bisection, the widest access bounding how far back
    to look. An access is one per instruction and operand, for all the Legions of its span
    (a :class:`SpanAccess`): its ranks touch the same window, each in its own Legion."""

    __slots__ = ("items", "los", "span")

    def __init__(self):
        self.items: list[SpanAccess] = []
        self.los: list[int] = []
        self.span = 0

    def __len__(self) -> int:
        return len(self.items)

    def meeting(self, lo: int, hi: int, rect, first: int, end: int) -> list[int]:
        """Indices, by lowest element, of the kept accesses that may share an element with an
        access of bounds [lo, hi] and rectangle ``rect`` on Legions first..end-1."""
        items, out = self.items, []
        for n in range(bisect_left(self.los, lo - self.span), bisect_right(self.los, hi)):
            old = items[n]
            if old.hi >= lo and old.first < end and first < old.end:
                # _apart(rect, old.rect), inlined: this loop runs for every access checked
                o = old.rect
                if (rect is not None and o is not None and rect[0] == o[0]
                        and (rect[2] <= o[1] or o[2] <= rect[1] or rect[4] <= o[3] or o[4] <= rect[3])):
                    continue
                out.append(n)
        return out

    def add(self, access: "SpanAccess") -> None:
        n = bisect_right(self.los, access.lo)
        self.los.insert(n, access.lo)
        self.items.insert(n, access)
        if access.hi - access.lo > self.span:
            self.span = access.hi - access.lo

    def drop(self, indices: list[int]) -> None:
        for n in reversed(indices):
            del self.items[n], self.los[n]

    def keep(self, pending) -> None:
        """Keep the accesses some task of the space may not know done (``pending(access)``)."""
        self.items = [old for old in self.items if pending(old)]
        self.los = [old.lo for old in self.items]
        self.span = max((old.hi - old.lo for old in self.items), default=0)


class SpanAccess:
    """One instruction's access to a scratchpad window on Legions first..end-1: rank r (task
    k + r) touches it on Legion first + r."""

    __slots__ = ("lo", "hi", "k", "first", "end", "write", "win", "rect", "kind", "top")

    def __init__(self, lo, hi, k, first, end, write, win, rect, kind, top):
        """``kind``: its tasks' queue kind; ``top``: their highest place on their queues
        (Order._own_bounds), kept for the one-comparison test of a whole span."""
        self.lo, self.hi, self.k, self.first, self.end = lo, hi, k, first, end
        self.write, self.win, self.rect, self.kind, self.top = write, win, rect, kind, top


# Columns of WideLedger's table: an access's bounds, rectangle (row stride -1: none), queue,
# the queue's count once it is done, whether it writes, and its task.
LO, HI, RS, R0, R1, C0, C1, Q, COUNT, WRITE, TASK = range(11)
NO_RECT = (-2, 0, 0, 0, 0)      # a probe without a rectangle: a row stride no kept access has


class WideLedger:
    """The kept accesses of a DRAM tensor, as a table searched by numpy. The row blocks and
    column tiles of a matrix are windows whose bounds span most of the tensor, so bounds alone
    leave hundreds of candidates; their rectangles tell them apart in one vector operation."""

    __slots__ = ("items", "table", "live", "n")

    def __init__(self):
        self.items: list[Access] = []
        self.table = np.zeros((11, 16), np.int64)       # a column per access: LO, HI, ... TASK
        self.live = np.zeros(16, np.bool_)
        self.n = 0

    def __len__(self) -> int:
        return int(self.live[:self.n].sum())

    def meeting(self, lo: int, hi: int, rect) -> list[int]:
        """Indices, by lowest element (ties: the older first), of the kept accesses that may
        share an element with an access of bounds [lo, hi] and rectangle ``rect``."""
        return [n for _, n in self.meeting_many([(lo, hi, rect)])]

    def meeting_many(self, shapes: list) -> list[tuple[int, int]]:
        """:meth:`meeting` for several accesses (the ranks of a span) in one vector operation:
        (access, index) pairs, by access, then as :meth:`meeting` orders them."""
        which, found = self.near(np.array([(lo, hi, *(rect or NO_RECT)) for lo, hi, rect in shapes]))
        return list(zip(*self.in_order(which, found))) if len(found) else []

    def near(self, probes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(probe, index) arrays of the kept accesses that may share an element with each of
        ``probes`` (rows: LO, HI and rectangle, as the table's columns), by probe."""
        n, t = self.n, self.table
        lo, hi, rs, r0, r1, c0, c1 = probes.T[:, :, None]
        near = self.live[:n] & (t[HI, :n] >= lo) & (t[LO, :n] <= hi)
        apart = (t[R1, :n] <= r0) | (t[R0, :n] >= r1) | (t[C1, :n] <= c0) | (t[C0, :n] >= c1)
        near &= ~(apart & (t[RS, :n] == rs))
        return np.nonzero(near)

    def in_order(self, which: np.ndarray, found: np.ndarray) -> tuple[list, list]:
        """The pairs by probe, then by lowest element (ties: the older first)."""
        by = np.lexsort((found, self.table[LO, found], which))
        return which[by].tolist(), found[by].tolist()

    def add(self, access: Access) -> None:
        if self.n == len(self.live):
            self.table = np.concatenate([self.table, np.zeros_like(self.table)], axis=1)
            self.live = np.concatenate([self.live, np.zeros_like(self.live)])
        rect = access[7] or (-1, 0, 0, 0, 0)
        self.table[:, self.n] = (access[0], access[1], *rect, access[3], access[4], access[5], access[2])
        self.live[self.n] = True
        self.items.append(access)
        self.n += 1

    def drop(self, indices: list[int]) -> None:
        self.live[indices] = False

    def keep(self, floor: list[int]) -> None:
        """Keep the accesses some task of the tensor may not know done (``floor``: per queue,
        the count they all know)."""
        if not self.n:
            return
        t = self.table[:, :self.n]
        kept = np.flatnonzero(self.live[:self.n] & (np.asarray(floor)[t[Q]] < t[COUNT]))
        self.items = [self.items[n] for n in kept]
        self.n = len(kept)
        self.table[:, :self.n] = t[:, kept]
        self.live[:] = False
        self.live[:self.n] = True


class RaceCheck:
    """The machine's accesses, checked against :class:`Order` as the emulator performs them.

    Per space (a scratchpad space of every Legion, a DRAM tensor the program writes) it keeps a
    ledger of accesses, one per instruction and operand (for all the Legions of its span in a
    scratchpad, per rank in DRAM, where ranks move by the Legion stride): a window of rows x
    cols elements, not an entry per element. A new access is compared with each kept one whose bounds it meets; only a
    conflicting pair that is not ordered is compared element by element, to tell a race from
    interleaved windows. An access leaves the ledger once a later one of the same elements
    replaces it (a write covering it, which was checked against it, or a read of the same queue
    covering an earlier read: whatever is ordered after the newer is ordered after the older)
    or once every task still to run is known to be ordered after it."""

    def __init__(self, program: Program, arch: Arch, unchecked=None):
        self.program, self.order = program, Order(program, arch, unchecked)
        self.spads = {s: Ledger() for s in arch.derived.spad_elems}
        self.dram = {i: WideLedger() for i, t in enumerate(program.tensors) if t.kind not in UNTRACKED}
        self.spad_queues, self.dram_queues = _accessors(program, arch, self.order)
        self.head = np.zeros(self.order.nq, np.int64)   # per queue: its first task that may not have run
        self._now, self._span, self._known, self._ran = None, 0, None, []
        self._own, self._top, self._kind = (), 0, 0      # the started instruction's (see start)
        self._next = np.zeros(0, np.int64)               # per queue, its next task (a sweep's)
        self._queue, self._place = self.order.queue.tolist(), self.order.place.tolist()
        self._origin = self.order.origin.tolist()
        self._own_known, self._top_place, self._own_by_kind = self.order.own_bounds()
        self._shapes: dict[tuple, tuple] = {}           # window -> its bounds and rectangle
        # Run in program order, a read after a tensor's last store meets no later write: it is
        # checked against the writes kept, and not kept itself.
        self._last_store = _last_stores(program) if self.order.in_program_order else {}

    def start(self, k: int, span: int = 1) -> None:
        """The emulator is about to run tasks k..k+span-1 (the ranks of one instruction); the
        tasks before them have run."""
        if self._now is not None:
            self._ran.extend(range(self._now, self._now + self._span))
        self._now, self._span = k, span
        self._known = None       # the tasks' rows of Order.known, made when a pair needs them
        o = self._origin[k]
        self._own, self._top, self._kind = self._own_known[o], self._top_place[o], self._queue[k] % len(QUEUES)
        if len(self._ran) >= PRUNE_EVERY:
            self._prune()

    def _known_rows(self) -> list:
        """``Order.known`` of the tasks started, as lists (most instructions need none: the
        shortcuts of :meth:`spad` settle all their pairs)."""
        if self._known is None:
            self._known = self.order.known[self._now:self._now + self._span].tolist()
        return self._known

    def forget(self, tensor: int) -> None:
        """A tensor no later task touches (runtime/liveness.py) needs no ledger."""
        self.dram.pop(tensor, None)

    # The machine calls these for every access of the tasks started, rank r on Legion legion + r.
    def spad(self, legion: int, span: int, view: View, rows: int, cols: int, write: bool) -> None:
        """The tasks' access to one window, rank r's on Legion legion + r: checked against each
        kept access it meets once, rank by rank only where both touch a Legion."""
        if rows == 0 or cols == 0:
            return
        win = (view.addr, rows, cols, view.rs, view.cs)
        lo, hi, rect = self._shape(win)
        ledger, end, k, own, queue = self.spads[view.space], legion + span, self._now, self._own, self._queue
        replaced, unordered, items = [], [], ledger.items
        here = queue[k] // len(QUEUES) == legion     # not a transfer into another Legion
        by_kind, place = self._own_by_kind, self._place
        # The tests that settle most pairs at once are inlined (this runs once per kept access
        # met, the hottest loop of the check): the same tasks' own earlier access, and, when
        # both run on the Legions they access, an instruction every rank of which knows every
        # rank of ``old`` done (see Order._own_bounds), or each rank old's rank on its Legion.
        for n in ledger.meeting(lo, hi, rect, legion, end):
            old = items[n]
            if (write or old.write) and not (old.k == k and old.first == legion) and (
                    not here or queue[old.k] // len(QUEUES) != old.first or (
                        own[old.kind] <= old.top and not all(map(
                            gt, by_kind[old.kind][k + max(0, old.first - legion):k + min(end, old.end) - legion],
                            place[old.k + max(0, legion - old.first):old.k + min(end, old.end) - old.first])))):
                r = self._first_unordered(old, write, legion, end)
                if r is not None:
                    unordered.append((r, n))
            if legion <= old.first and old.end <= end and self._replaces_span(win, write, old, lo, hi, legion, end):
                replaced.append(n)
        if unordered:
            self._raise_first_shared(win, sorted(unordered), items, legion, view.space)
        if replaced:
            ledger.drop(replaced)
        ledger.add(SpanAccess(lo, hi, k, legion, end, write, win, rect, self._kind, self._top))

    def _shape(self, win: tuple) -> tuple:
        """A window's bounds and rectangle, computed once per window."""
        shape = self._shapes.get(win)
        if shape is None:
            shape = self._shapes[win] = (*_bounds(win), _rectangle(win))
        return shape

    def _first_unordered(self, old: SpanAccess, write: bool, legion: int, end: int) -> int | None:
        """The first rank of the tasks started (on Legions legion..end-1) that shares a Legion
        with ``old`` and is not ordered after its access there; None when all are."""
        known, queue, place, k = self._known_rows(), self._queue, self._place, self._now
        if old.k == k and old.first == legion:
            return None                      # the same tasks' own earlier access
        # Every rank knows every rank of old's done: what a task knows of its own Legion's
        # queues, so only when both run on the Legion they access (not a transfer's receiver).
        if (queue[k] // len(QUEUES) == legion and queue[old.k] // len(QUEUES) == old.first
                and self._own[old.kind] > old.top):
            return None
        for at in range(max(legion, old.first), min(end, old.end)):
            kn, ko = k + at - legion, old.k + at - old.first
            if known[at - legion][queue[ko]] > place[ko] or ko == kn:
                continue                     # known done (the common case, tested first)
            if not _ordered(known[at - legion], queue[ko], place[ko] + 1, old.write, write, queue[kn], place[kn]):
                return at - legion
        return None

    def _replaces_span(self, win: tuple, write: bool, old: SpanAccess, lo: int, hi: int,
                       legion: int, end: int) -> bool:
        """Whether the new access makes ``old`` redundant on all of its Legions (see
        :func:`_replaces`); one that does on some only is kept, which changes no verdict."""
        if legion > old.first or end < old.end:
            return False
        if not (old.win == win or (lo <= old.lo and old.hi <= hi and _contiguous(win))):
            return False
        if write:
            return True
        queue, k = self._queue, self._now
        return not old.write and all(queue[k + at - legion] == queue[old.k + at - old.first]
                                     for at in range(old.first, old.end))

    def _raise_if_span_shared(self, win: tuple, old: SpanAccess, legion: int, r: int, space: str) -> None:
        """A race when the windows share an element, on rank ``r``'s Legion (``old``'s rank there)."""
        e = _first_shared(win, old.win)
        if e is not None:
            at = legion + r
            verb = "wrote" if old.write else "read"
            raise Trap(f"race on {self._space_name((at, space))}[{e}]: {self._name(old.k + at - old.first)} "
                       f"{verb} it, and this instruction is not ordered after it")

    def _raise_first_shared(self, win: tuple, unordered: list, items: list, legion: int, space: str) -> None:
        """A race on the first (rank, then lowest element) unordered access sharing an element."""
        for r, n in unordered:
            self._raise_if_span_shared(win, items[n], legion, r, space)

    def dram_access(self, tensor: int, offset: int, rs: int, rows: int, cols: int, write: bool,
                    span: int = 1, lstride: int = 0) -> None:
        """The tasks' accesses to a DRAM tensor, rank r's window ``r * lstride`` further: the
        kept accesses each meets are found for all ranks at once, and each rank is checked
        against them and against the ranks before it (two ranks of one store may race)."""
        ledger = self.dram.get(tensor)
        if ledger is None or rows == 0 or cols == 0:
            return
        k = self._now
        wins = [(offset + r * lstride, rows, cols, rs, 1) for r in range(span)]
        shapes = [self._shape(win) for win in wins]
        made = [(lo, hi, k + r, self._queue[k + r], self._place[k + r] + 1, write, win, rect)
                for r, ((lo, hi, rect), win) in enumerate(zip(shapes, wins))]
        if ledger.n:
            self._check_table(ledger, made, write, tensor)
        if write and span > 1 and abs(lstride) <= shapes[0][1] - shapes[0][0]:
            self._check_ranks(made, tensor)
        if not write and self._origin[k] > self._last_store.get(tensor, len(self._origin)):
            return
        for access in made:
            ledger.add(access)

    def _check_table(self, ledger: "WideLedger", made: list, write: bool, tensor: int) -> None:
        """Each rank's access (``made``) against the kept ones it meets, as vectors: a race on
        the first (rank, then lowest element) unordered one sharing an element; the kept ones
        a rank's access replaces (see :func:`_replaces`) are dropped."""
        probes = np.array([(a[0], a[1], *(a[7] or NO_RECT)) for a in made])
        which, found = ledger.near(probes)
        if not len(found):
            return
        t, order, k = ledger.table, self.order, self._now
        oq, count, owrite, task = t[Q, found], t[COUNT, found], t[WRITE, found] != 0, t[TASK, found]
        kn = k + which
        q, place = order.queue[kn], order.place[kn]
        ordered = (order.known[kn, oq] >= count) | (task == kn) | (
            (oq == q) & (q % len(QUEUES) == DMA) & (~owrite | write) & (count <= place))
        bad = ~ordered & (owrite | write)
        if bad.any():
            for r, n in zip(*ledger.in_order(which[bad], found[bad])):
                self._raise_if_shared(made[r][6], ledger.items[n], tensor)
        lo, hi = probes[which, 0], probes[which, 1]
        same = (probes[which, 2] >= 0) & (t[RS:C1 + 1, found] == probes[which, 2:].T).all(axis=0)
        unit = np.array([_contiguous(a[6]) for a in made])[which]
        covers = same | ((lo <= t[LO, found]) & (t[HI, found] <= hi) & unit)
        replaced = covers & (write | (~owrite & (oq == q)))
        if replaced.any():
            ledger.drop(np.unique(found[replaced]).tolist())

    def _access_ordered(self, r: int, old: Access, write: bool) -> bool:
        """Whether rank ``r`` of the tasks started is ordered after the kept access ``old``."""
        k = self._now + r
        return old[2] == k or _ordered(self._known_rows()[r], old[3], old[4], old[5], write, self._queue[k], self._place[k])

    def _check_ranks(self, made: list, tensor: int) -> None:
        """The ranks of one DMA store whose windows meet: a race unless ordered (they are not:
        each rank is its own Legion's task)."""
        for r, access in enumerate(made):
            for old in made[:r]:
                if old[1] >= access[0] and old[0] <= access[1] and not _apart(access[7], old[7]) \
                        and not self._access_ordered(r, old, True):
                    self._raise_if_shared(access[6], old, tensor)

    def _raise_if_shared(self, win: tuple, old: Access, where: tuple | int) -> None:
        """A race when the two windows share an element; the first of ``win``'s is named."""
        e = _first_shared(win, old[6])
        if e is not None:
            verb = "wrote" if old[5] else "read"
            raise Trap(f"race on {self._space_name(where)}[{e}]: {self._name(old[2])} {verb} it, "
                       f"and this instruction is not ordered after it")

    def _prune(self) -> None:
        """Drop the accesses every task still to run on the space is known to be ordered
        after: those the next task of each queue that touches the space knows done (what a
        queue's tasks know only grows along it)."""
        self._advance_heads()
        self._next = self._next_tasks()
        floors: dict = {}
        for space, ledger in self.spads.items():
            if ledger.items:
                ledger.keep(lambda old: self._pending(old, space, floors))
        for tensor, ledger in self.dram.items():
            if ledger.items:
                ledger.keep(self._floor(self.dram_queues.get(tensor, ()), floors))

    def _pending(self, old: SpanAccess, space: str, floors: dict) -> bool:
        """Whether some rank's access may not be known done by every next task of its space."""
        queue, place = self._queue, self._place
        for r in range(old.end - old.first):
            floor = self._floor(self.spad_queues[old.first + r][space], floors)
            if floor[queue[old.k + r]] < place[old.k + r] + 1:
                return True
        return False

    def _advance_heads(self) -> None:
        """The tasks that ran are done, and so is everything they knew done."""
        ran, order = np.array(self._ran, np.int64), self.order
        self._ran = []
        own = order.queue[ran] != NONE
        np.maximum.at(self.head, order.queue[ran][own], order.place[ran][own] + 1)
        np.maximum(self.head, order.known[ran].max(axis=0), out=self.head)

    def _floor(self, queues: tuple, floors: dict) -> list:
        """Per queue, the count every next task of ``queues`` knows done."""
        # Keyed by identity: the same few tuples of spad_queues and dram_queues come back
        # for every access of a sweep, and hashing a tuple of queues each time costs more.
        floor = floors.get(id(queues))
        if floor is not None:
            return floor
        nxt = self._next[np.array(queues, np.int64)] if queues else self._next[:0]
        nxt = nxt[nxt != NONE]
        if len(nxt):
            floor = self.order.known[nxt].min(axis=0).tolist()
        else:
            floor = [np.iinfo(np.int64).max] * self.order.nq
        floors[id(queues)] = floor
        return floor

    def _next_tasks(self) -> np.ndarray:
        """Per queue, its next task that may not have run (``head``); NONE past its end."""
        order = self.order
        starts, flat = order._starts, order._flat
        if not len(flat):
            return np.full(order.nq, NONE, np.int64)
        inside = self.head < np.diff(starts)
        at = np.minimum(starts[:-1] + self.head, len(flat) - 1)
        return np.where(inside, flat[at], NONE)

    def _space_name(self, where: tuple | int) -> str:
        if isinstance(where, tuple):
            return f"L{where[0]} {where[1]}"
        return f"@{self.program.tensors[where].name}"

    def _name(self, k: int) -> str:
        """``line 12 (dma.ld)``: where instruction ``k`` is, without the file named again."""
        p = self.program
        loc = p.where(k).removeprefix(f"{p.source}:").strip()
        return f"{'line ' + loc if loc.isdigit() else loc} ({p.instrs[k].MNEMONIC})"


def _last_stores(program: Program) -> dict[int, int]:
    """Per DRAM tensor a store writes, the last instruction (of the source program) that does."""
    out = {}
    for o, ins in enumerate(program.instrs.source):
        if isinstance(ins, DmaStore):
            out[ins.dst.tensor] = o
    return out


def _accessors(program: Program, arch: Arch, order: Order) -> tuple[list, dict]:
    """The queues whose tasks touch each Legion's scratchpads (by space), and each DRAM tensor:
    a Legion's own queues, and the DMA queues of the loads that deliver to it (rank r of a
    span delivers to each destination moved by r)."""
    from runtime.liveness import tensors_of
    tasks = program.instrs
    own = [{order.qid(legion, q) for q in QUEUES} for legion in range(arch.legions)]
    spads = [{s: set(own[legion]) for s in arch.derived.spad_elems} for legion in range(arch.legions)]
    dram: dict = {}
    spans = np.diff(np.append(tasks.first, len(tasks))).tolist()
    ids = tasks.alike().ids
    for o, (ins, first, span) in enumerate(zip(tasks.source, tasks.first.tolist(), spans)):
        if ids[o] != o:
            continue             # an equal instruction before it added the same queues
        queues = order.queue[first:first + span].tolist()
        if queues[0] == NONE:
            continue
        for legion in getattr(ins, "dests", ()):
            for r, q in enumerate(queues):
                if legion + r < arch.legions:
                    spads[legion + r][ins.dst.space].add(q)
        for tensor in tensors_of(ins):
            dram.setdefault(tensor, set()).update(queues)
    return ([{s: tuple(sorted(qs)) for s, qs in by_space.items()} for by_space in spads],
            {t: tuple(sorted(qs)) for t, qs in dram.items()})


def _ordered(known: list, oq: int, ocount: int, owrite: bool, write: bool, q: int, place: int) -> bool:
    """Whether a task (on queue ``q``, at ``place`` there, knowing ``known`` done) is ordered
    after an earlier access (by a task on queue ``oq`` whose count once done is ``ocount``,
    writing or not): it knows it done, or comes later on the same DMA queue (ordered after its
    reads, done when it left, and after its writes when writing too: transfers land in order;
    not when reading what it wrote)."""
    if known[oq] >= ocount:
        return True
    return oq == q and q % len(QUEUES) == DMA and (not owrite or write) and ocount <= place


def _apart(a, b) -> bool:
    """Whether rectangles ``a`` and ``b`` (or None) are of one row stride and share no element."""
    return (a is not None and b is not None and a[0] == b[0]
            and (a[2] <= b[1] or b[2] <= a[1] or a[4] <= b[3] or b[4] <= a[3]))


def _bounds(win: tuple) -> tuple[int, int]:
    addr, rows, cols, rs, cs = win
    ends = (addr + (rows - 1) * rs, addr + (cols - 1) * cs, addr + (rows - 1) * rs + (cols - 1) * cs)
    return min(addr, *ends), max(addr, *ends)


def _elements(win: tuple) -> np.ndarray:
    """A window's element addresses, row by row."""
    addr, rows, cols, rs, cs = win
    return (addr + np.arange(rows, dtype=np.int64)[:, None] * rs + np.arange(cols, dtype=np.int64) * cs).ravel()


def _rectangle(win: tuple):
    """A window of consecutive columns as (row stride, first row, last row + 1, first column,
    last column + 1) of the matrix with that row stride (a single row: stride 0, its elements
    as columns); None for any other window."""
    addr, rows, cols, rs, cs = win
    if cols > 1 and cs != 1:
        return None
    if rows == 1:
        return 0, 0, 1, addr, addr + cols
    if rs <= 0 or addr % rs + cols > rs:
        return None
    return rs, addr // rs, addr // rs + rows, addr % rs, addr % rs + cols


def _first_shared(a: tuple, b: tuple) -> int | None:
    """The first element of window ``a`` (row by row) that window ``b`` has too, or None."""
    rect = _rectangles(a, b)
    if rect is not None:
        (ar, ac, arows, acols), (br, bc, brows, bcols), rs = rect
        row, col = max(ar, br), max(ac, bc)
        if row < min(ar + arows, br + brows) and col < min(ac + acols, bc + bcols):
            return row * rs + col
        return None
    # Any other pair of strided windows: mark one's elements between the common bounds.
    lo = max(_bounds(a)[0], _bounds(b)[0])
    hi = min(_bounds(a)[1], _bounds(b)[1])
    if lo > hi:
        return None
    mine, theirs = _elements(a), _elements(b)
    marked = np.zeros(hi - lo + 1, np.bool_)
    marked[theirs[(theirs >= lo) & (theirs <= hi)] - lo] = True
    inside = (mine >= lo) & (mine <= hi)
    hit = np.zeros(mine.size, np.bool_)
    hit[inside] = marked[mine[inside] - lo]
    return int(mine[np.argmax(hit)]) if hit.any() else None


def _rectangles(a: tuple, b: tuple):
    """Both windows as rectangles of one matrix (rows of consecutive elements, one row stride,
    no row wrapping into the next): ((row, col, rows, cols) of each, row stride); else None."""
    ra, rb = _unit_columns(a), _unit_columns(b)
    if ra is None or rb is None:
        return None
    # a single row takes the other's row stride; two single rows, one wider than both
    rs = ra[3] or rb[3] or max(ra[0] + ra[2], rb[0] + rb[2]) + 1
    if (ra[3] and ra[3] != rs) or (rb[3] and rb[3] != rs) or rs <= 0:
        return None
    out = []
    for addr, rows, cols, _ in (ra, rb):
        if addr % rs + cols > rs:
            return None
        out.append((addr // rs, addr % rs, rows, cols))
    return out[0], out[1], rs


def _unit_columns(win: tuple):
    """``win`` as (addr, rows, cols, row stride) with consecutive columns (row stride 0 when it
    has one row), or None."""
    addr, rows, cols, rs, cs = win
    if cols > 1 and cs != 1:
        return None
    if rows == 1:
        return addr, 1, cols, 0
    return (addr, rows, cols, rs) if rs > 0 else None


def _contiguous(win: tuple) -> bool:
    _, rows, cols, rs, cs = win
    return (cols == 1 or cs == 1) and (rows == 1 or rs == cols)


def _replaces(win: tuple, write: bool, q: int, old: Access, lo: int, hi: int) -> bool:
    """Whether the new access makes ``old`` redundant: it covers ``old``'s elements and is a
    write, or a read of the same queue replacing a read."""
    if not (write or (not old[5] and old[3] == q)):
        return False
    if old[6] == win:
        return True
    return lo <= old[0] and old[1] <= hi and _contiguous(win)


# --- segments checked once -------------------------------------------------------------------

def segment_key(instrs: list, tensors: list, ids: list | None = None) -> tuple:
    """What the race check of the instructions between two barriers depends on: the
    instructions, each DRAM tensor renamed by its first use in the segment (and marked tracked
    or not). Every access before a barrier is known done by every task after it, so a segment
    that repeats an earlier one in this form (a decoder's layers) has its races, and so its
    verdict: checked once. ``ids``: per instruction, the index of the first instruction of the
    program equal to it (isa/expand.py's Alike), which stands for one that names no tensor."""
    names: dict = {}

    def local(tensor: int) -> tuple:
        kind = tensors[tensor].kind
        return names.setdefault(tensor, (len(names), kind not in UNTRACKED))

    out = []
    for j, ins in enumerate(instrs):
        field = DRAM_FIELD.get(type(ins))
        mask = getattr(ins, "mask", None)
        if field is None and mask is None:
            out.append(ins if ids is None else ids[j])
            continue
        fields = dict(ins.__dict__)
        if field is not None:
            ref = fields[field]
            fields[field] = (local(ref.tensor), ref.offset, ref.rs)
        if mask is not None:
            fields["mask"] = local(mask)
        out.append((type(ins), tuple(fields.items())))
    return tuple(out)
