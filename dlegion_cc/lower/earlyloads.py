"""A float product's first loads issued during the row kernel before it.

At decode attention's QK^T and PV run on the vector lanes, each Legion taking slices of the
cache, and a row kernel runs before each (the rotaries, the softmax) with DRAM all but idle:
a few rows on a few Legions, then a DRAM round trip in and out. The product's first cache
slices do not depend on the kernel (the past is an input; only the new row is the kernel's),
yet they wait for its barrier, and the product's first passes then wait a round trip for them.
This pass issues them in the kernel, so they land before the barrier.

- **Which loads.** On each Legion, the product's loads in order while its DMA queue has met
  nothing that waits, but only those that share no element with anything the kernel touches,
  nor with what the product does before them (``footprint``, one of the two writing): a slice
  holding the new row, or the query the kernel rotates, stays.
- **Where.** On the DMA queues the kernel uses, just after its last load there (its own
  inputs come first; its stores queue behind them), placed in the program after the kernel's
  work there, so that what waits for the kernel's loads does not wait for them too. A Legion
  whose queue the kernel leaves idle has its loads issued, in row pieces, by those (a load
  may deliver to another Legion's scratchpad): one flow more would slow the kernel's own
  loads, which the kernel's round trip waits for.
- **How much.** What the issuing queues carry between the kernel's last load and its stores:
  the loads' round trip and the work after them, at each queue's share of DRAM.
- **When not.** A kernel that loads on every Legion (a prefill kernel, block after block)
  keeps DRAM busy: there is no time to fill.
- **The kernel's own Legions.** Where the kernel's scratchpad holds the product's first slice
  (the rotary and that slice share the space), the loads the product's first pass there reads
  go last, on that Legion's queue (after the kernel's transfers there, which read or land
  before a later one starts), waiting for its vector unit. They hold the barrier back by a
  round trip, so only where the product's passes there, not its transfers, set its pace
  (``_paced``): the first pass, which the rest follow back to back, then waits for them no
  more after the barrier.

The barrier at the kernel's end orders the moved loads before everything of the product, as
before; relative conditions are rewritten for the new order (``prefetch._Counts``).
"""
from __future__ import annotations

from dataclasses import replace

from isa.arch import Arch
from isa.fields import Cond
from isa.instructions import Barrier, DmaLoad, DmaStore, Gather, MatMul, VMatMul, Wait
from isa.program import Program
from dlegion_cc.lower.overlap import _meet, accesses, add_accesses, conflicting, footprint, layer_ends
from dlegion_cc.lower.prefetch import _Counts, _cut, _legions, _part, _regions, _runs
from runtime.costs import Env, cost

LOADS = (DmaLoad, Gather)


def load_early(program: Program, arch: Arch) -> Program:
    """``program`` with the first loads of each float product that follows a row kernel
    issued during the kernel."""
    nodes = _nodes(program)
    ends = layer_ends(program)
    items = [[(k, program.instrs[k]) for k in node] for node in nodes]
    moved = False
    for n in range(1, len(nodes)):
        kernel, product = nodes[n - 1], nodes[n]
        if kernel.stop - 1 in ends or not _is_product(program, product) or _is_matmul(program, kernel):
            continue
        if len(_room(program, arch, kernel)) == arch.legions:   # DRAM busy through the kernel: no time to fill
            continue
        pieces, after, kept = _pick(program, arch, kernel, product)
        if any(pieces.values()) or any(after.values()):
            items[n - 1], items[n] = _at_end(_interleave(items[n - 1], pieces), after), kept
            moved = True
    if not moved:
        return program
    order = [item for node in items for item in node]
    return replace(program, instrs=_Counts(program.instrs, arch).rewrite(order),
                   regions=_regions(order, program.region_ranges(), program.regions))


def _nodes(program: Program) -> list[range]:
    """The stretches of the program each barrier ends (the last may end without one)."""
    out, start = [], 0
    for k, i in enumerate(program.instrs):
        if isinstance(i, Barrier):
            out.append(range(start, k + 1))
            start = k + 1
    if start < len(program.instrs):
        out.append(range(start, len(program.instrs)))
    return out


def _is_product(program: Program, node: range) -> bool:
    return any(isinstance(program.instrs[k], VMatMul) for k in node)


def _is_matmul(program: Program, node: range) -> bool:
    return any(isinstance(program.instrs[k], (MatMul, VMatMul)) for k in node)


def _pick(program: Program, arch: Arch, kernel: range, product: range) -> tuple[dict, dict, list]:
    """Per issuing Legion, the product's loads (or row pieces of them) it issues during the
    kernel, and those it issues once the kernel is done with it (``_after``); and the
    product's instructions (old index, instruction) less those."""
    instrs, tensors = program.instrs, program.tensors
    env = Env(tuple(tensors), {})
    room = _room(program, arch, kernel)
    open_ = dict.fromkeys(range(arch.legions), bool(room))
    first = _first_reads(program, product, _paced(program, arch, product, room))
    kernel_seen = _Seen(accesses(program, kernel))
    seen = _Seen({})
    pieces: dict = {l: [] for l in room}
    after: dict = {l: [] for l in room}
    kept = []
    for k in product:
        i = instrs[k]
        if isinstance(i, Barrier) or not _free_load(i):
            if isinstance(i, Barrier) or (i.queue() == "dma" and i.condition() is not None):
                open_ = {l: open_[l] and not (isinstance(i, Barrier) or l in _legions(i)) for l in open_}
            seen.add(i, tensors)
            kept.append((k, i))
            continue
        stays = {}                          # Legion -> whether its part stays whole in the product
        for l in _legions(i):
            part = _part(i, range(l, l + 1))
            stays[l] = not open_[l] or seen.meets(part, tensors)
            if stays[l]:
                pass
            elif not kernel_seen.meets(part, tensors):
                left = _issue(part, l, room, pieces, cost(part, arch, env).flow_bytes // part.rows, k)
                if left is not None:
                    open_[l] = False
                    kept.append((k, left))
            elif _meets_any(part, first.get(l, []), tensors) and _after_ok(program, kernel, part, l):
                after[l].append((k, replace(part, wait=Cond(None, "vec", None, 0))))
            else:
                stays[l] = True
        kept += [(k, _part(i, run)) for run, stay in _runs(i, stays) if stay]
        seen.add(i, tensors)
    return pieces, after, kept


def _first_reads(program: Program, product: range, legions) -> dict[int, list]:
    """Per Legion, what the product's first work there (not a transfer) reads: the loads it
    waits for straight away."""
    out: dict = {}
    for k in product:
        i = program.instrs[k]
        if isinstance(i, (Barrier, Wait)) or i.queue() == "dma":
            continue
        for r, l in enumerate(_legions(i)):
            if l in legions and l not in out:
                out[l] = [(space, win) for space, win, write, _ in footprint(i, r, program.tensors) if not write]
    return out


def _paced(program: Program, arch: Arch, product: range, legions) -> set[int]:
    """The Legions whose work in the product takes longer than their share of DRAM needs for
    the product's own transfers there: their passes, not DRAM, set when the product ends."""
    env = Env(tuple(program.tensors), {})
    share = arch.derived.dram_bytes_per_cycle / arch.legions
    work: dict = dict.fromkeys(legions, 0.0)
    dram: dict = dict.fromkeys(legions, 0.0)
    for k in product:
        i = program.instrs[k]
        if isinstance(i, (Barrier, Wait)) or (isinstance(i, DmaLoad) and i.dst.space != "vec"):
            continue                    # another matmul's weights, loaded early
        c = cost(i, arch, env)
        for l in _legions(i):
            if l in work and c.flow_bytes is not None:
                dram[l] += c.flow_bytes / share
            elif l in work:
                work[l] += c.cycles
    return {l for l in legions if work[l] > dram[l]}


def _meets_any(load: DmaLoad, reads: list, tensors) -> bool:
    return any(space == s and _meet(win, b) for space, win, _, _ in footprint(load, 0, tensors) for s, b in reads)


def _after_ok(program: Program, kernel: range, load: DmaLoad, legion: int) -> bool:
    """Whether ``load`` (to ``legion``) meets nothing of the kernel but that Legion's
    scratchpad, through its vector unit or its own DMA queue: issued by that queue after all
    the kernel put on it (a transfer starts once the one before has read what it moves) and
    waiting for its vector unit, it comes after both."""
    mine = footprint(load, 0, program.tensors)
    for k in kernel:
        i = program.instrs[k]
        if isinstance(i, (Barrier, Wait)):
            continue
        for r in range(i.span or 1):
            for space, win, write, _ in footprint(i, r, program.tensors):
                if not any(space == s and (write or w) and _meet(win, b) for s, b, w, _ in mine):
                    continue
                if not (i.legion + r == legion and space == (legion, load.dst.space) and i.queue() in ("vec", "dma")):
                    return False
    return True


def _issue(part: DmaLoad, dest: int, room: dict, pieces: dict, row_bytes: int, k: int) -> DmaLoad | None:
    """Hand ``part`` (to Legion ``dest``) to the issuing Legions in whole rows, its own first,
    then the one with most room left; returns the rows none has room for (None: all went)."""
    while part is not None:
        issuer = dest if room.get(dest, 0) >= row_bytes else max(room, key=room.get)
        rows = min(part.rows, int(room[issuer] // row_bytes))
        if rows <= 0:
            return part
        piece, part = (part, None) if rows == part.rows else _cut(part, rows)
        pieces[issuer].append((k, replace(piece, legion=issuer)))
        room[issuer] -= rows * row_bytes
    return None


def _free_load(i) -> bool:
    return (isinstance(i, DmaLoad) and i.dst.space == "vec" and i.wait is None
            and i.dests == frozenset({i.legion}))


class _Seen:
    """The accesses a moved load must not meet: the kernel's, the product's before it, and the
    moved ones'."""

    def __init__(self, spaces: dict):
        self.spaces = spaces

    def add(self, i, tensors) -> None:
        add_accesses(self.spaces, i, tensors)

    def meets(self, load: DmaLoad, tensors) -> bool:
        return conflicting(add_accesses({}, load, tensors), self.spaces)


def _room(program: Program, arch: Arch, kernel: range) -> dict[int, float]:
    """Per Legion whose DMA queue the kernel uses, the bytes it may issue after the kernel's
    last load there and before the kernel's stores: its share of DRAM while the loads land
    and its work after them runs."""
    env = Env(tuple(program.tensors), {})
    work: dict = {}
    for k in kernel:
        i = program.instrs[k]
        if isinstance(i, (Barrier, Wait, DmaStore)):
            continue
        for l in _legions(i):
            if isinstance(i, LOADS):
                work[l] = 0
            elif l in work:
                work[l] += cost(i, arch, env).cycles
    d = arch.derived
    rate = min(d.link_bytes_per_cycle, d.dram_bytes_per_cycle / max(1, len(work)))
    return {l: rate * (arch.dram_latency_cycles + w) for l, w in work.items()}


def _interleave(items: list, pieces: dict) -> list:
    """``items`` with each Legion's ``pieces`` on its DMA queue just after its last load: in
    the program just before what it stores after that load (else at the end, before the
    barrier), so that what waits for the loads on the queue does not wait for them too."""
    at = {l: None for l in pieces}
    for j, (_, i) in enumerate(items):
        if isinstance(i, Barrier):
            continue
        for l in _legions(i):
            if l in at and isinstance(i, LOADS):
                at[l] = None
            elif l in at and at[l] is None and isinstance(i, DmaStore):
                at[l] = j
    end = len(items) - (1 if items and isinstance(items[-1][1], Barrier) else 0)
    out = list(items)
    for j, l in sorted(((end if at[l] is None else at[l], l) for l in pieces), reverse=True):
        out[j:j] = pieces[l]
    return out


def _at_end(items: list, after: dict) -> list:
    """``items`` with the ``after`` loads last, before the barrier."""
    end = len(items) - (1 if items and isinstance(items[-1][1], Barrier) else 0)
    return items[:end] + [x for l in sorted(after) for x in after[l]] + items[end:]
