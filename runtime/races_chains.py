""":class:`runtime.races.Order`'s ``known`` table for a program that waits only on earlier work,
computed by chains instead of task by task.

A queue's tasks between two barriers form a chain: each knows what the one before it knew
(started, on a DMA queue; done, elsewhere, which adds only its own queue's count). What a task
knows is then the most of what its chain's start knew (the barrier before it, done) and of what
each task of the chain up to it waits for by its condition. Only the tasks with a condition (and
the barriers) need a row of their own, ``S``, kept in a small table:

- row 0: nothing known (no chain start, or one a skipped segment left uncomputed);
- a row per barrier: what it knows once done;
- a row per task with a condition: the most of its chain's start and of the conditions of its
  chain up to it (its own queue's count aside).

Those rows are computed in batches of tasks with a condition, in program order: a batch ends
before a task whose condition names work whose row the batch computes itself. A batch's rows of
one chain are a running maximum (numpy's ``maximum.accumulate``). Every other task's row is then
its chain's last such row before it, with its own queue's count once its predecessor is done.
"""
from __future__ import annotations

import numpy as np

from isa.expand import NONE

SEGMENT = 1 << 32       # above any count: offsets rows of one chain above those of the chain before


def known_by_chains(order, tasks) -> np.ndarray:
    """``order.known`` (see :meth:`runtime.races.Order._knowledge`) for a program in program
    order, with ``order.unchecked`` segments left 0."""
    n, nq = len(order.queue), order.nq
    own = order.queue != NONE
    skip = own & order.unchecked[tasks.origin] if order.unchecked is not None else np.zeros(n, np.bool_)
    cond = own & ~skip & (order.target != NONE)
    bars = np.flatnonzero(~own)
    ks = np.flatnonzero(cond)
    cid = np.full(n, -1, np.int64)
    cid[ks] = np.arange(len(ks))
    base = 1 + len(bars)                      # the first row of a task with a condition
    anchor, before = _anchors(order, own, skip, cond, cid, base)
    # What a task's condition gives: the row its target's chain reached, its target's count.
    ta, tq, tp = _done_rows(order, order.target[ks], own, skip, anchor)
    pa = before[ks]
    steps = _batches(ks, bars, ta - base)
    S = np.zeros((base + len(ks), nq), np.int64)
    # Rows of a batch by chain: sorted by (batch, queue); a row follows its chain's row before
    # it unless its predecessor's row comes from outside the batch.
    batch_of = np.zeros(len(ks), np.int64)
    lows = np.zeros(len(ks), np.int64)     # per row, its batch's first
    for j, (kind, lo, hi) in enumerate(steps):
        if kind:
            batch_of[lo:hi] = j
            lows[lo:hi] = lo
    perm = np.lexsort((ks, order.queue[ks], batch_of))
    row = np.empty(len(ks), np.int64)
    row[perm] = base + np.arange(len(ks))

    def remap(r):
        return np.where(r >= base, row[np.clip(r - base, 0, len(row) - 1)], r) if len(row) else r

    ta, pa, anchor = remap(ta)[perm], remap(pa)[perm], remap(anchor)
    tq, tp = tq[perm], tp[perm]
    bo = batch_of[perm]
    chained = (pa == base + np.arange(len(ks)) - 1) & (bo == np.concatenate([[-1], bo[:-1]]))
    pa = np.where(chained, 0, pa)
    offset = (np.cumsum(~chained) * SEGMENT)[:, None]
    bump = (np.arange(len(ks)) - lows) * nq + tq        # a row's own place in its batch's rows, flat
    bar_start = np.zeros((len(bars), nq), np.int64)
    bar_deps = _barrier_deps(order, bars, own, skip, anchor)
    # Per batch: whether a row reads its chain's row from before the batch, or the one before it.
    cuts = np.array([lo for kind, lo, _ in steps if kind], np.int64)
    from_before = iter(np.add.reduceat(pa != 0, cuts).tolist() if len(cuts) else [])
    along = iter(np.add.reduceat(chained, cuts).tolist() if len(cuts) else [])
    for kind, lo, hi in steps:
        if not kind:
            _barrier(S, order, bars[lo], lo, bar_deps[lo], bar_start, skip)
            continue
        # Computed in place: a batch's targets' rows are all before its own.
        rows = S[base + lo:base + hi]
        S.take(ta[lo:hi], axis=0, out=rows, mode="clip")
        flat, mine = rows.reshape(-1), bump[lo:hi]
        flat[mine] = np.maximum(flat[mine], tp[lo:hi])
        if next(from_before):
            np.maximum(rows, S[pa[lo:hi]], out=rows)
        if next(along):
            rows += offset[lo:hi]
            np.maximum.accumulate(rows, axis=0, out=rows)
            rows -= offset[lo:hi]
    # The chains' offsets are taken off again: every row is counts, which int32 holds. Row 0
    # (nothing known) stands for the tasks not computed, barriers set below.
    live = np.flatnonzero(own & ~skip)
    known = S.astype(np.int32).take(np.where(own & ~skip, anchor, 0), axis=0)
    # Its predecessor done (not a DMA transfer's, nor one left uncomputed): its own queue's count.
    prev = order.prev[live]
    counts = order.prev_done[live] & (prev != NONE) & ~skip[np.maximum(prev, 0)]
    k = live[counts]
    known[k, order.queue[k]] = np.maximum(known[k, order.queue[k]], order.place[k])
    known[bars] = bar_start
    return known


def _anchors(order, own, skip, cond, cid, base):
    """Per task, ``anchor``: the row of the last chain mark at or before it on its queue (a
    task with a condition, a barrier, a skipped task or its queue's start; row 0 for the last
    two), and ``before``: the same for the item before it."""
    flat, starts = order._flat, order._starts
    m = len(flat)
    first = np.zeros(m, np.bool_)
    first[starts[:-1][starts[:-1] < m]] = True
    f_own = own[flat]
    mark = first | ~f_own | skip[flat] | cond[flat]
    f_row = np.where(~f_own, 1 + order.bar_index[flat], np.where(cond[flat], base + cid[flat], 0))
    last = np.maximum.accumulate(np.where(mark, np.arange(m), -1)) if m else np.zeros(0, np.int64)
    reach = f_row[last] if m else last
    n = len(order.queue)
    at = np.zeros(n, np.int64)
    at[flat[f_own]] = np.flatnonzero(f_own)
    anchor = np.zeros(n, np.int64)
    anchor[flat[f_own]] = reach[f_own]
    before = np.zeros(n, np.int64)
    inner = f_own & ~first
    before[flat[inner]] = reach[np.flatnonzero(inner) - 1]
    return anchor, before


def _done_rows(order, items, own, skip, anchor):
    """What each of ``items`` (queue items) knows once done, as (row, queue, count): the row's
    queue ``queue`` raised to ``count`` (0: nothing to raise)."""
    items = np.asarray(items, np.int64)
    bar = ~own[items]
    dead = skip[items]
    row = np.where(bar, 1 + order.bar_index[items], np.where(dead, 0, anchor[items]))
    q = np.where(bar | dead, 0, order.queue[items])
    count = np.where(bar | dead, 0, order.place[items] + 1)
    return row, q, count


def _batches(ks, bars, dep) -> list[tuple[int, int, int]]:
    """The steps in program order: (1, lo, hi) a batch of the tasks with a condition lo..hi-1
    (by program order) whose targets' rows are all computed before it; (0, b, b + 1) barrier
    ``b``. ``dep``: per task with a condition, the index of the one whose row its target's
    chain reached (negative for none)."""
    steps, lo = [], 0
    events = np.concatenate([ks, bars])
    kinds = np.concatenate([np.ones(len(ks), np.int64), np.zeros(len(bars), np.int64)])
    at = np.concatenate([np.arange(len(ks)), np.arange(len(bars))])
    by = np.argsort(events, kind="stable")
    deps = dep.tolist()
    i = 0
    for kind, j in zip(kinds[by].tolist(), at[by].tolist()):
        if not kind:
            if i > lo:
                steps.append((1, lo, i))
            steps.append((0, j, j + 1))
            lo = i
            continue
        if deps[j] >= lo and i > lo:
            steps.append((1, lo, i))
            lo = i
        i += 1
    if i > lo:
        steps.append((1, lo, i))
    return steps


def _barrier_deps(order, bars, own, skip, anchor) -> list:
    """Per barrier, the done rows of the last item of every queue before it."""
    out = []
    for b in range(len(bars)):
        places = order.bar_place[b]
        qs = np.flatnonzero(places > 0)
        items = order._flat[order._starts[qs] + places[qs] - 1]
        out.append(_done_rows(order, items, own, skip, anchor))
    return out


def _barrier(S, order, k, b, deps, bar_start, skip) -> None:
    """Barrier ``b`` (task ``k``): what the last item of every queue knew once done (exactly
    every queue's items before it, after a skipped segment); once done, every queue up to it."""
    place = order.bar_place[b]
    if k > 0 and skip[k - 1]:
        start = place
    else:
        row, q, count = deps
        rows = S[row]
        rows[np.arange(len(row)), q] = np.maximum(rows[np.arange(len(row)), q], count)
        start = rows.max(axis=0) if len(row) else np.zeros(order.nq, np.int64)
    bar_start[b] = start
    S[1 + b] = np.maximum(start, place + 1)
