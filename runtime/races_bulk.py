"""The race check of a whole run at once: every access recorded as the emulator makes it, then
every pair of them that shares an element, one of them writing, tested against
:class:`runtime.races.Order` in a few numpy operations.

This proves a run free of races, not where one is: when some pair is not ordered (or the run
traps), the emulator runs again with :class:`runtime.races.RaceCheck`, which names the first
race the way it always has. Its test of a pair is the same (``known[k, q]``, a task's own
accesses, the DMA queue's order of transfers); where it compares an access only with the kept
ones, which a later access may replace, this compares it with every earlier one, so whatever
that check finds, this finds too."""
from __future__ import annotations

import numpy as np

from isa.fields import QUEUES
from runtime.races import DMA, UNTRACKED, Order, _first_shared

# Columns of a recorded access: its first task, its space (a scratchpad space and first
# Legion, or a DRAM tensor), how many ranks (tasks, Legions) it spans, how far each rank moves
# in DRAM, its window, and whether it writes.
K, SPACE, SPAN, LSTRIDE, ADDR, ROWS, COLS, RS, CS, WRITE = range(10)
COLUMNS = 10


class AccessLog:
    """The watch the machine tells of every access (as :class:`runtime.races.RaceCheck` is
    told), recording them only; :meth:`ordered` checks them all."""

    def __init__(self, program, arch, unchecked=None):
        self.program, self.arch, self.unchecked = program, arch, unchecked
        self.spaces = list(arch.derived.spad_elems)
        self._space_id = {s: n for n, s in enumerate(self.spaces)}
        self._space_base = {s: n * arch.legions for n, s in enumerate(self.spaces)}    # its Legion 0's id
        self.tracked = {i for i, t in enumerate(program.tensors) if t.kind not in UNTRACKED}
        # The accesses' columns one after the other, a flat list: numpy reads it into a table
        # in half the time a list of tuples takes.
        self.rows: list[int] = []
        self._now = 0

    def start(self, k: int, span: int = 1) -> None:
        self._now = k

    def forget(self, tensor: int) -> None:
        """No later task touches the tensor: nothing to do, no ledger is kept."""

    def spad(self, legion: int, span: int, view, rows: int, cols: int, write: bool) -> None:
        if rows and cols:
            self.rows.extend((self._now, self._space_base[view.space] + legion, span, 0, view.addr, rows, cols,
                              view.rs, view.cs, write))

    def dram_access(self, tensor: int, offset: int, rs: int, rows: int, cols: int, write: bool,
                    span: int = 1, lstride: int = 0) -> None:
        if rows and cols and tensor in self.tracked:
            space = -1 - tensor          # DRAM tensors below the scratchpads' ids
            self.rows.extend((self._now, space, span, lstride, offset, rows, cols, rs, 1, write))

    def ordered(self, order: Order | None = None) -> bool:
        """Whether every two recorded accesses sharing an element, one writing, are ordered."""
        if not self.rows:
            return True
        order = order or Order(self.program, self.arch, self.unchecked)
        return _unordered_pairs(self._ranks(), order) == []

    def _ranks(self) -> dict:
        """One access per rank: its task, space (a scratchpad rank on Legion first + r, a DRAM
        rank ``r * lstride`` further), time (the record's index), rank and bounds; its window
        is :func:`_windows`'s to make, for the few pairs that need it. Bounds are computed per
        record and shifted per rank."""
        t = np.array(self.rows, np.int64).reshape(-1, COLUMNS)
        span = t[:, SPAN]
        rec = np.repeat(np.arange(len(t)), span)
        rank = _runs(np.zeros(len(t), np.int64), span)
        rows, cols, rs, cs = t[:, ROWS], t[:, COLS], t[:, RS], t[:, CS]
        low = np.minimum(0, (rows - 1) * rs) + np.minimum(0, (cols - 1) * cs)
        width = np.maximum(0, (rows - 1) * rs) + np.maximum(0, (cols - 1) * cs) - low
        spad = (t[:, SPACE] >= 0)[rec]
        shift = np.where(spad, 0, rank * t[:, LSTRIDE][rec])        # a DRAM rank's offset
        lo = (t[:, ADDR] + low)[rec] + shift
        return {"task": t[:, K][rec] + rank, "space": t[:, SPACE][rec] + np.where(spad, rank, 0), "time": rec,
                "rank": rank, "write": (t[:, WRITE] != 0)[rec], "lo": lo, "hi": lo + width[rec],
                "windows": t[:, [ADDR, ROWS, COLS, RS, CS]], "shift": shift}


def _windows(acc: dict, at: np.ndarray) -> np.ndarray:
    """The windows (addr, rows, cols, rs, cs) of rank accesses ``at``, one a row."""
    out = acc["windows"][acc["time"][at]]
    out[:, 0] += acc["shift"][at]
    return out


def _unordered_pairs(acc: dict, order: Order) -> list[tuple[int, int]] | None:
    """(earlier, later) rank accesses sharing an element, one writing, the later not ordered
    after the earlier; None when they cannot be found this way (see :func:`_not_known_done`)."""
    blocks = _not_known_done(acc, order)
    if blocks is None:
        return None
    # Most pairs are told apart by their bounds: those go first, a block at a time, so the
    # rest of the tests gather from the few that meet.
    met = [_meeting(acc, a, b) for a, b in blocks]
    a, b = np.concatenate([a for a, _ in met] or [_NO_PAIRS]), np.concatenate([b for _, b in met] or [_NO_PAIRS])
    # A task's own accesses are ordered; so are a DMA queue's (see _not_known_done), which the
    # search leaves out.
    other = acc["task"][a] != acc["task"][b]
    a, b = a[other], b[other]
    if not len(a):
        return []
    a, b = _not_apart(acc, a, b)
    win_a, win_b = _windows(acc, a).tolist(), _windows(acc, b).tolist()
    return [(x, y) for x, y, wx, wy in zip(a.tolist(), b.tolist(), win_a, win_b)
            if _first_shared(tuple(wy), tuple(wx)) is not None]


def _meeting(acc: dict, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pairs whose bounds meet (one of each pair writes: a read is paired only with writes)."""
    meet = (acc["hi"][a] >= acc["lo"][b]) & (acc["lo"][a] <= acc["hi"][b])
    return a[meet], b[meet]


# Keys (a group and a later access) searched at once: the arrays of a block, and of the pairs
# it finds, stay in the CPU's cache between the steps.
KEYS_PER_BLOCK = 1 << 16
_NO_PAIRS = np.zeros(0, np.int64)


def _not_known_done(acc: dict, order: Order):
    """Every (earlier, later) pair of rank accesses of one space, one of them writing, where
    the later one's task does not know the earlier one's done, as (earlier, later) arrays in
    blocks; but for the pairs a DMA queue orders. Per space, queue and kind (read or write),
    the accesses in time order are in order on the queue too: those a task does not know done
    are a run of them, from the first at or past what it knows done on that queue to the last
    before it (None if they were not in order: a run out of program order, which the emulator
    does not check this way).

    A DMA queue starts a transfer once the last one's data has left DRAM, and transfers land
    in order, so a transfer is ordered after every earlier transfer of its queue when it
    writes (after their reads and their landing): the writes of a DMA queue are left out of
    the accesses searched against that queue's groups. Its reads are not: a store's read of
    what a load on its queue brings needs a wait."""
    write = acc["write"].astype(np.int64)
    kind = acc["space"] * 2 + write             # a space's reads, then its writes
    queue, place = order.queue[acc["task"]], order.place[acc["task"]]
    # By space, kind, queue, then time: one stable sort of one key (a queue is -1 and up).
    by = np.argsort(kind * (int(queue.max(initial=0)) + 2) + queue, kind="stable")
    s, q = kind[by], queue[by]
    new = np.concatenate([[True], (s[1:] != s[:-1]) | (q[1:] != q[:-1])])
    group = np.cumsum(new) - 1                 # per sorted access, its (space, kind, queue) group
    g_kind, g_queue = s[new], q[new]
    by_place = (group << 32) + place[by]
    if np.any(by_place[1:] < by_place[:-1]):
        return None                # not in order on their queue: no run to search for
    by_time = (group << 32) + by
    # Per group, the accesses that may conflict with it, a run of them in sorted order: a
    # write group's, every access of its space; a read group's, the space's writes. Taken
    # group by group, each search below gets its keys in runs that rise (an access's time,
    # and what it knows of a queue, only grow along its own queue's group), which binary
    # search over sorted keys runs several times faster than over keys in any order.
    g_write = g_kind & 1
    run_lo = np.searchsorted(s, g_kind + 1 - 2 * g_write, side="left")
    run_hi = np.searchsorted(s, g_kind | 1, side="right")
    at = np.append(np.flatnonzero(new), len(by))          # each group's first access in ``by``, and the end
    cut_lo, cut_hi = _own_dma_writes(g_kind, g_queue, at, run_hi)
    # Each group's run as two pieces, before and after its DMA queue's writes.
    piece_lo = np.stack([run_lo, cut_hi], axis=1)
    pieces = np.stack([cut_lo - run_lo, run_hi - cut_hi], axis=1)
    runs = pieces.sum(axis=1)
    ends = np.cumsum(runs)

    def blocks():
        start = 0
        while start < len(runs):     # groups start..stop-1: about KEYS_PER_BLOCK keys, at least one group
            stop = max(start + 1, int(np.searchsorted(ends, ends[start] - runs[start] + KEYS_PER_BLOCK, "right")))
            counts = runs[start:stop]
            g = np.repeat(np.arange(start, stop), counts)
            b = by[_runs(piece_lo[start:stop].reshape(-1), pieces[start:stop].reshape(-1))]
            # known[task, queue], flat
            known = order.known.reshape(-1).take(acc["task"][b] * order.nq + np.repeat(g_queue[start:stop], counts))
            first, last = at[start], at[stop]      # searched among the block's groups' accesses only
            lo = first + np.searchsorted(by_place[first:last], (g << 32) + known, side="left")
            # Most keys know done every access of the group before them: a run is empty unless
            # the first access not known done came before the key, so only those search for
            # where it ends.
            some = (lo < at[g + 1]) & (by[np.minimum(lo, len(by) - 1)] < b)
            g, b, lo = g[some], b[some], lo[some]
            hi = first + np.searchsorted(by_time[first:last], (g << 32) + b, side="left")
            yield by[_runs(lo, hi - lo)], np.repeat(b, hi - lo)
            start = stop
    return blocks()


def _own_dma_writes(g_kind: np.ndarray, g_queue: np.ndarray, at: np.ndarray, run_hi: np.ndarray):
    """Per group, the writes of its space on its queue (a range of ``by``) when that queue is
    a DMA queue, else an empty range at the end of its run (``run_hi``)."""
    span = int(g_queue.max(initial=0)) + 2         # groups are sorted by kind * span + queue
    keys = g_kind * span + g_queue
    writes = (g_kind | 1) * span + g_queue
    found = np.minimum(np.searchsorted(keys, writes), len(keys) - 1)
    own = (keys[found] == writes) & (g_queue >= 0) & (g_queue % len(QUEUES) == DMA)
    return np.where(own, at[found], run_hi), np.where(own, at[found + 1], run_hi)


def _runs(lo: np.ndarray, count: np.ndarray) -> np.ndarray:
    """lo[i], lo[i] + 1, .., lo[i] + count[i] - 1 for each i, one after the other: one repeat
    of each run's start less its place in the output, not one of each."""
    starts = np.cumsum(count) - count
    return np.arange(starts[-1] + count[-1] if len(count) else 0) + np.repeat(lo - starts, count)


def _not_apart(acc: dict, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pairs not told apart by their rectangles (runtime/races.py's _apart)."""
    ra, rb = _rectangles(_windows(acc, a)), _rectangles(_windows(acc, b))
    apart = (ra[:, 0] >= 0) & (ra[:, 0] == rb[:, 0]) & (
        (ra[:, 2] <= rb[:, 1]) | (rb[:, 2] <= ra[:, 1]) | (ra[:, 4] <= rb[:, 3]) | (rb[:, 4] <= ra[:, 3]))
    return a[~apart], b[~apart]


def _rectangles(wins: np.ndarray) -> np.ndarray:
    """runtime/races.py's _rectangle of each window (rows of ``wins``), a row stride of -1 for
    None."""
    addr, rows, cols, rs, cs = wins.T
    one_row = rows == 1
    stride = np.where(one_row, 0, rs)
    safe = np.maximum(stride, 1)
    row, col = np.where(one_row, 0, addr // safe), np.where(one_row, addr, addr % safe)
    none = ((cols > 1) & (cs != 1)) | (~one_row & ((rs <= 0) | (addr % safe + cols > rs)))
    out = np.stack([np.where(none, -1, stride), row, row + rows, col, col + cols], axis=1)
    return out
