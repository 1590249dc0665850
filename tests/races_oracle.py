"""The race check's ``known`` table computed as runtime/races.py first did, instruction by
instruction in program order: the reference the computation by chains is compared with."""
import numpy as np

from isa.expand import NONE


def known_by_instructions(order, tasks) -> np.ndarray:
    """``order.known`` of a program in program order (``order.unchecked`` segments left 0)."""
    n = len(order.queue)
    table = np.zeros((2 * n + 1, order.nq), np.int32)
    via_prev = np.where(order.prev == NONE, 2 * n, order.prev + n * order.prev_done)
    via_target = np.where(order.target == NONE, 2 * n, order.target + n)
    ends = np.append(tasks.first[1:], n)
    los, his = tasks.first.astype(np.int64), ends.astype(np.int64)
    own = order.queue != NONE
    place = np.where(own, order.place + 1, 0)
    at = np.where(own, order.queue, 0) + (np.arange(n) - np.repeat(los, his - los)) * order.nq
    skip = np.zeros(len(los), np.bool_)
    if order.unchecked is not None:
        skip = order.unchecked[tasks.origin[los]] & own[los]
    after_skip = np.concatenate([[False], skip[:-1]])
    for j in np.flatnonzero(~skip):
        lo, hi = los[j], his[j]
        if not own[lo]:
            _barrier(order, table, lo, after_skip[j])
            continue
        row = np.maximum(table[via_prev[lo:hi]], table[via_target[lo:hi]])
        table[lo:hi] = row
        flat, mine = row.reshape(-1), at[lo:hi]
        flat[mine] = np.maximum(flat[mine], place[lo:hi])
        table[n + lo:n + hi] = row
    return table[:n]


def _barrier(order, table, k, exact) -> None:
    n = len(order.queue)
    places = order.bar_place[order.bar_index[k]]
    deps = [order.items[q][places[q] - 1] + n for q in range(order.nq) if places[q]]
    if exact:
        table[k] = places
    else:
        table[k] = table[np.array(deps, np.int64)].max(axis=0) if deps else 0
    table[n + k] = np.maximum(table[k], places + 1)
