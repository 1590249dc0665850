"""How one quantized matmul is emitted, following a :class:`~dlegion_cc.lower.qplan.Plan`.

Every Legion owns a slice of output columns and computes its output tiles in the plan's
order, all Legions in step. Legions whose work is the same up to a DRAM offset (dense weights,
equal slices) form a *group* (:func:`~dlegion_cc.lower.qplan.groups`): each of the group's
instructions is emitted once, spanning its Legions, each DMA stepping ``per_legion`` columns
per Legion (``lstride``); a Legion whose work differs is a group of its own.

A tile contracts K chunk by chunk: the chunk's activations (multicast to every Legion by one
DRAM read, unless multicast is off) and each group's weight chunk go to a free slot of ``act``
and ``wgt``, and the ``mm`` waits for exactly the loads it reads; a load into a slot waits for
exactly the passes that still read the slot's old chunk, so the next chunks load while the
arrays work (double buffering). Accumulators and results rotate over their slots the same way,
so a drain and a store overlap the next tile's passes. A condition that another one already
implies is left out (:class:`Sync`), so most instructions carry a single ``wait=``; a ``wait``
instruction remains where one truly needs two, above all before a multicast into a slot that
every Legion's passes read (one condition per Legion).

Sparsity: a weight chunk whose blocks are all zero is neither loaded nor multiplied; the
all-zero rows of blocks of any other chunk are not loaded, and its ``mm`` carries a block
mask (``mask=@tensor``), so the arrays skip zero blocks and pack the rest into fewer windows.
"""
from __future__ import annotations

from bisect import bisect_right

import numpy as np

from isa.arch import MODE_BITS
from isa.fields import DramRef, View
from isa.instructions import BY_MNEMONIC, DmaLoad, DmaStore, Drain, MatMul, NocMove
from dlegion_cc.lower.emitter import Emitter
from dlegion_cc.lower.qplan import (CV_SLOTS, RS_SLOTS, Chunk, Group, Homes, Plan, Problem, RowScale, Segment, Slots,
                                    Switches, act_key, act_slot_elems, choose, chunk_blocks, dead_tile, find_weights,
                                    groups, in_order, last_visit, legion_tiles, multicaster, owners, pieces, products, reach_blocks,
                                    row_blocks, stores, column_runs, legion_step, tail_pieces, tile_order, units, weight_key, weights_wait, wgt_slot_bytes)

__all__ = ["Plan", "Problem", "RowScale", "Segment", "emit_tiles", "plan_tiles"]

Mark = tuple[tuple[int, str, int], ...]   # per Legion an instruction ran on: (Legion, queue, count there)


def plan_tiles(arch, p: Problem, switches: Switches = Switches()) -> Plan:
    return choose(arch, p, switches)


class Sync:
    """Exact-count dependencies, and what each queue already knows.

    An instruction waits for the very instructions it needs, not for everything issued before
    it (which would serialize loads and passes). A queue that has completed an instruction
    knows that instruction's conditions held (it started after them), so a condition the
    waiting queue already knows, or that another condition of the same instruction implies, is
    left out: most instructions then need one condition, which rides in their ``wait=`` field.
    """

    def __init__(self, em: Emitter):
        self.em = em
        self.counts: dict = {}       # (Legion, queue) -> counts at which its knowledge grew
        self.facts: dict = {}        # (Legion, queue) -> per count: {(Legion, queue): count known}

    def mark(self, g: Group, q: str) -> Mark:
        """The instructions issued on queue ``q`` of each Legion of ``g`` so far."""
        return tuple((l, q, self.em.issued.get((l, q), 0)) for l in g.legions)

    def emit(self, g: Group, instr, marks) -> Mark:
        """Emit ``instr`` once for the Legions of ``g``, after every mark; returns its mark."""
        q = instr.queue()
        needs = {l: self._needs(g, l, q, marks) for l in g.legions}
        with self.em.spanning(g.base, g.count):     # a wait the conditions need spans as well
            self._depend(g, q, needs)
            self.em.emit(instr)
        for l in g.legions:
            self._learn((l, q), {(s, qs): c for (_, s, qs), c in needs[l].items()})
        return self.mark(g, q)

    def knows(self, queue, count: int) -> dict:
        """What ``queue`` knows once it has completed ``count`` instructions."""
        at = bisect_right(self.counts.get(queue, []), count)
        return self.facts[queue][at - 1] if at else {}

    def _needs(self, g: Group, l: int, q: str, marks) -> dict:
        """Legion ``l``'s conditions: {(kind, Legion, queue): count}, kind "own" for a mark of
        the same span (each Legion its own queue), "fixed" for one Legion's queue."""
        out: dict = {}
        for mark in marks:
            for kind, s, qs, c in _entries(g, l, mark):
                key = (kind, s, qs)
                out[key] = max(out.get(key, 0), c)
        return self._prune(l, q, out)

    def _prune(self, l: int, q: str, needs: dict) -> dict:
        mine = self.knows((l, q), self.em.issued.get((l, q), 0))
        keep = {}
        for key, c in needs.items():
            src = key[1:]
            if c <= 0 or mine.get(src, 0) >= c or (src == (l, q) and q != "dma"):
                continue            # known, or a matrix or vector queue's own earlier work
            keep[key] = c
        return {key: c for key, c in keep.items() if not self._implied(key, c, keep)}

    def _implied(self, key, c: int, keep: dict) -> bool:
        src = key[1:]
        for other, oc in keep.items():
            if other == key:
                continue
            if other[1:] == src and (oc > c or (oc == c and key[0] == "own")):
                return True     # the same queue under the other kind, as far or further
            if self.knows(other[1:], oc).get(src, 0) >= c:
                return True
        return False

    def _depend(self, g: Group, q: str, needs: dict) -> None:
        if g.count == 1:
            for (_, s, qs), c in needs[g.base].items():
                self.em.depend((s, qs), (g.base, q), upto=c)
            return
        own: dict = {}
        for l, conds in needs.items():
            for (kind, s, qs), c in conds.items():
                if kind == "fixed":
                    self.em.depend((s, qs), (g.base, q), across=True, upto=c)
                    continue
                # Relative to program order, the condition must hold on every Legion of the
                # span: keep the fewest instructions left out (a Legion that issued more, such
                # as one that multicasts, may wait for a little more than it needs).
                back = self.em.issued.get((l, qs), 0) - c
                own[qs] = min(own.get(qs, back), back)
        for qs, back in own.items():
            upto = self.em.issued.get((g.base, qs), 0) - back
            if upto <= 0:
                raise ValueError(f"internal: L{g.base}.{qs} has not issued what its span waits for")
            self.em.depend((g.base, qs), (g.base, q), upto=upto)

    def _learn(self, queue, needs: dict) -> None:
        """``queue``'s next instruction started after ``needs`` held, and after all they imply."""
        count = self.em.issued.get(queue, 0)
        known = dict(self.knows(queue, count))
        for src, c in needs.items():
            for fact in [(src, c), *self.knows(src, c).items()]:
                if known.get(fact[0], 0) < fact[1]:
                    known[fact[0]] = fact[1]
        self.counts.setdefault(queue, []).append(count)
        self.facts.setdefault(queue, []).append(known)


def _entries(g: Group, l: int, mark: Mark):
    """The conditions of Legion ``l`` of ``g`` that one mark stands for."""
    if len(mark) == 1:
        (s, qs, c), = mark
        yield ("own" if s == l and g.count == 1 else "fixed"), s, qs, c
        return
    legions = [s for s, _, _ in mark]
    if legions == list(g.legions):
        yield from (("own", s, qs, c) for s, qs, c in mark if s == l)
        return
    if g.count > 1:
        raise ValueError(f"internal: a span from L{g.base} waits for another span from L{legions[0]}")
    yield from (("fixed", s, qs, c) for s, qs, c in mark)


class _Tiles:
    """The state of emitting one plan: groups, slots, what each slot holds, who reads it."""

    def __init__(self, em: Emitter, p: Problem, plan: Plan, written: dict, spans: bool):
        self.em, self.p, self.plan, self.arch = em, p, plan, em.arch
        self.written = written
        self.sync = Sync(em)
        self.legions = owners(em.arch, p, plan)
        self.groups = groups(em.arch, p, plan) if spans else [Group(l, 1) for l in self.legions]
        self.lead = Group(multicaster(p, self.legions), 1)          # issues the multicasts
        self.tiles = {g: legion_tiles(p, plan, g.base) for g in self.groups}
        self.blocks = row_blocks(p, plan)
        self.units = units(p, plan)
        tile = plan.rows * plan.cols
        self.addr = {"act": act_slot_elems(p, plan), "wgt": wgt_slot_bytes(p, plan), "acc": tile,
                     "res": tile}
        self.corr_at = plan.a_slots * self.addr["act"]
        self.home_at = self.corr_at + p.k2
        self.homes = Homes(self.legions, plan.homes)
        self.home_loaded: dict = {}   # chunk key -> the mark of its copy into its home
        self.uncopied: dict = {}      # act slot -> (chunk key, view, rows, width) not yet copied home
        self.rscale_at = plan.res_slots * tile
        self.cv_at = self.rscale_at + RS_SLOTS * plan.rows
        self.cv_size = (p.groups + 1) * plan.cols
        who = [None] if plan.multicast else self.groups
        self.a = {w: Slots(plan.a_slots) for w in who}
        self.w = {g: Slots(plan.w_slots) for g in self.groups}
        self.rs = {w: Slots(RS_SLOTS) for w in who}
        self.cv = {g: Slots(CV_SLOTS) for g in self.groups}
        self.loaded: dict = {}        # (space, owner, slot) -> the load's mark
        self.readers: dict = {}       # (space, owner, slot) -> marks of the work still reading it
        self.turn = {(k, g): 0 for k in ("acc", "res") for g in self.groups}
        self.deferred: dict = {g: [] for g in self.groups}
        self.masks: dict = {}
        self.corr_loaded: dict = {}   # group -> the load of its zero-point row
        self.cv_slot: dict = {}       # group -> column-vector slot of its current tile
        self.res_slot: dict = {}      # group -> result slot of its current tile

    def next_problem(self, p: Problem) -> None:
        """Go on with ``p``, of the same shapes: what the slots hold is no longer wanted, but
        who still reads them is kept, and the slots least recently used are taken first."""
        if p.corr_row is not None or self.p.corr_row is not None:
            raise ValueError("internal: batches with zero-point rows are emitted one by one")
        self.p = p
        self.blocks = row_blocks(p, self.plan)
        for ring in (*self.a.values(), *self.w.values(), *self.rs.values(), *self.cv.values()):
            ring.forget()

    def rings(self) -> dict:
        """Which slot of each ring the next block should take first, and the accumulator and
        result turns: the block's state that ``continue_rings`` hands on."""
        out = {"turn": dict(self.turn)}
        for kind in ("a", "w", "rs", "cv"):
            out[kind] = {}
            for owner, ring in getattr(self, kind).items():
                ring.forget()
                out[kind][owner] = list(ring.free)
        return out

    def act_windows(self) -> list[tuple[int, int]]:
        """The ``act`` windows of the activation slots, the least recently used first."""
        size = self.addr["act"]
        order = [s for ring in self.a.values() for s in ring.free + list(ring.held.values())]
        return [(s * size, (s + 1) * size) for s in dict.fromkeys(order)]

    def act_after(self, windows: list[tuple[int, int]]) -> None:
        """Take first the activation slots that meet none of ``windows`` (another plan's, the
        least recently used first) or only those it used least recently."""
        size = self.addr["act"]
        def last_use(s: int) -> int:
            met = [n for n, (lo, hi) in enumerate(windows) if lo < (s + 1) * size and s * size < hi]
            return max(met, default=-1)
        for ring in self.a.values():
            ring.free.sort(key=last_use)

    def last_windows(self) -> dict:
        """(kind, Legion) -> the window of ``acc`` or ``vec`` its last tile took (``slots_after``)."""
        out = {}
        for (kind, g), turn in self.turn.items():
            s = (turn - 1) % _slot_count(self.plan, kind)
            out |= {(kind, legion): (s * self.addr[kind], (s + 1) * self.addr[kind]) for legion in g.legions if turn}
        return out

    def slots_after(self, last: dict) -> None:
        """Start each accumulator and result ring at its first slot that meets none of the
        window another plan's last tile took on that Legion (``last_windows``): its drain may
        still read it when this plan's first passes start."""
        for kind, g in self.turn:
            lo, hi = last.get((kind, g.base), (0, 0))
            size = self.addr[kind]
            free = (s for s in range(_slot_count(self.plan, kind)) if not (lo < (s + 1) * size and s * size < hi))
            self.turn[(kind, g)] = next(free, 0)

    def continue_rings(self, rings: dict) -> None:
        self.turn.update({k: v for k, v in rings["turn"].items() if k in self.turn})
        for kind in ("a", "w", "rs", "cv"):
            for owner, ring in getattr(self, kind).items():
                if owner in rings[kind]:
                    ring.free = list(rings[kind][owner])

    def lstride(self, g: Group, bits: int | None = None) -> int | None:
        """DRAM elements from one Legion's columns to the next one's: ``per_legion`` columns,
        in bytes for weights packed at ``bits`` a weight."""
        if g.count == 1:
            return None
        step = legion_step(self.p, self.plan)
        return step if bits is None else step * bits // 8

    def emit(self, g: Group, instr, marks=()) -> Mark:
        return self.sync.emit(g, instr, marks)

    def acc_readers(self, g: Group, acc: int) -> list:
        """What a pass that overwrites accumulator slot ``acc`` waits for. A store from the slot
        (exact results) still pending is emitted now: after the first loads of the tile that
        reuses the slot, which so never wait in the DMA queue behind it."""
        if any(slot == ("acc", g, acc) for _, _, slot in self.deferred[g]):
            _flush(self, g)
        return self.readers.pop(("acc", g, acc), [])

    def read_by(self, slot, mark: Mark) -> None:
        self.readers.setdefault(slot, []).append(mark)

    # --- loads -------------------------------------------------------------------------------
    def _load(self, space: str, owner, slot: int, g: Group, instrs, after=()) -> None:
        """Emit ``instrs`` (loads into one slot) after the slot's readers are done (and the
        marks ``after``)."""
        readers = self.readers.pop((space, owner, slot), []) + list(after)
        for i in instrs:
            self.loaded[(space, owner, slot)] = self.emit(g, i, readers)

    def activations(self, b: int, c: Chunk, here: list) -> dict:
        """Each group's act address of chunk ``c`` of row block ``b``, loading it if needed."""
        p, plan = self.p, self.plan
        m0, mb = self.blocks[b]
        key = act_key(plan, b, c)
        k0a, width = (0, p.K) if plan.whole_rows else (c.k0, c.kc)
        out = {}
        for owner, slots in self.a.items():
            if owner is not None and owner not in here:
                continue
            s = slots.find(key)
            if s is None:
                s = slots.take(key)
                self._copy_home(s)
                g = self.lead if owner is None else owner
                dests = frozenset(self.legions) if owner is None else frozenset({g.base})
                view = View("act", s * self.addr["act"], width, 1)
                src = DramRef(p.a_pieces[c.a - 1] if c.a else p.a8, m0 * p.K + k0a, p.K)
                if not (plan.forward and self._forward(key, s, view, mb, width)):
                    self._load("act", owner, s, g, [DmaLoad(g.base, dests, view, src, mb, width)])
                    if plan.forward and self.homes.home(key)[0] is not None:
                        self.uncopied[s] = (key, view, mb, width)
            for g in (self.groups if owner is None else [owner]):
                out[g] = (owner, s, s * self.addr["act"] + c.k0 - k0a, width)
        return out

    def _home_view(self, home: tuple[int, int], width: int) -> View:
        return View("act", self.home_at + home[1] * self.addr["act"], width, 1)

    def _forward(self, key, s: int, view: View, mb: int, width: int) -> bool:
        """Send chunk ``key`` from its home to every Legion's slot ``s`` (``Plan.forward``);
        False if it has no home yet (its first visit) or none at all."""
        home, new = self.homes.home(key)
        if home is None or new:
            return False
        send = NocMove(home[0], frozenset(self.legions), view, self._home_view(home, width), mb, width)
        self._load("act", None, s, Group(home[0], 1), [send], [self.home_loaded[key]])
        return True

    def _copy_home(self, s: int) -> None:
        """On its first visit a chunk is read from DRAM into every Legion's slot as without
        forwarding; its home Legion copies it home before slot ``s`` is reused for another
        (not at once: the copy waits for the load, and so would the DMA queue behind it)."""
        if s not in self.uncopied:
            return
        key, view, mb, width = self.uncopied.pop(s)
        home, _ = self.homes.home(key)
        copy = NocMove(home[0], frozenset({home[0]}), self._home_view(home, width), view, mb, width)
        mark = self.emit(Group(home[0], 1), copy, [self.loaded[("act", None, s)]])
        self.home_loaded[key] = mark
        self.read_by(("act", None, s), mark)

    def weights(self, g: Group, piece: int, c: Chunk, n0: int, nb: int, nz, act: Mark, reached=None) -> int:
        """wgt address of a weight chunk of ``g``, loading its nonzero rows of blocks (of those
        a causal reach leaves, ``reached``: part of what the slot holds, ``qplan.weight_key``).

        The load may wait for the chunk's activations (``act``, their load's mark; see
        ``qplan.weights_wait``): then a pass that waits for its weights needs no second
        condition for its activations, and the load needs none for its slot's readers when the
        activation load waited for later ones (weight slots outnumber activation slots)."""
        key = weight_key(piece, c, n0, reached)
        s = find_weights(self.w[g], key)
        if s is not None:
            return s
        first = not self.w[g].held
        s = self.w[g].take(key)
        tensor, mode = self.p.weights[piece]
        # Zero blocks are left out of the load only where the slot holds earlier bytes: the
        # arrays never use them, but every byte an instruction reads must have been written.
        span = (s * self.addr["wgt"], s * self.addr["wgt"] + c.kc * nb * MODE_BITS[mode] // 8)
        written = [self.written.setdefault((l, "wgt"), Intervals()) for l in g.legions]
        if not all(w.covers(*span) for w in written):
            nz = None
            for w in written:
                w.add(*span)
        # Where the activations came by this very queue, the pass's wait for its weights covers
        # them (a queue completes in order): waiting here would only serialize the two loads.
        same_queue = {(l, q) for l, q, _ in act} == {(l, "dma") for l in g.legions}
        self._load("wgt", g, s, g, self._weight_loads(g, s, tensor, mode, c.k0, c.kc, n0, nb, nz),
                   [act] if weights_wait(self.plan, first, len(self.legions), nb, mode) and not same_queue else [])
        return s

    def _weight_loads(self, g, s, tensor, mode, k0, kc, n0, nb, nz) -> list:
        bits, na = MODE_BITS[mode], self.arch.array
        row_bytes, tile_bytes = self.p.n_pad * bits // 8, nb * bits // 8
        base = s * self.addr["wgt"]
        out = []
        for r0, r1, c0, c1 in _rectangles(nz, kc, nb, na):
            for at, col, n in column_runs(self.p, n0 + c0, c1 - c0):
                b0, b1 = (c0 + at) * bits // 8, n * bits // 8
                out.append(DmaLoad(g.base, frozenset({g.base}), View("wgt", base + r0 * tile_bytes + b0, tile_bytes, 1),
                                   DramRef(tensor, self.p.w_offset + (k0 + r0) * row_bytes + col * bits // 8, row_bytes),
                                   r1 - r0, b1, lstride=self.lstride(g, bits)))
        return out

    def row_scales(self, b: int) -> None:
        """The drain's per-row scales of row block ``b`` in every Legion's vec."""
        rs, (m0, mb) = self.p.rscale, self.blocks[b]
        if rs is None:
            return
        for owner, slots in self.rs.items():
            if slots.find(b) is not None:
                continue
            s = slots.take(b)
            g = self.lead if owner is None else owner
            dests = frozenset(self.legions) if owner is None else frozenset({g.base})
            view = View("vec", self.rscale_at + s * self.plan.rows, 1, 1)
            src = DramRef(rs.tensor, rs.offset + m0 * rs.stride, rs.stride)
            self._load("rs", owner, s, g, [DmaLoad(g.base, dests, view, src, mb, 1)])
            for grp in (self.groups if owner is None else [owner]):
                self._scale_op(grp, view, mb, ("rs", owner, s))

    def _scale_op(self, g: Group, view: View, mb: int, slot: tuple) -> None:
        loaded = self.loaded[slot]
        op = self.p.rscale.op
        if op == "mov":
            return
        if op == "recip":
            done = self.emit(g, BY_MNEMONIC["vrecip"](g.base, view, view, mb, 1), [loaded])
        else:
            factor = float(np.float32(self.p.rscale.factor))
            done = self.emit(g, BY_MNEMONIC["vmul"](g.base, view, view, factor, mb, 1), [loaded])
        # It rewrites the slot in place: the next load into the slot waits for it too (on a
        # Legion with no tile in this row block, no drain would order them).
        self.read_by(slot, done)

    def rscale_addr(self, g: Group, b: int) -> tuple[int | None, list]:
        """vec address of row block ``b``'s scales in ``g`` and the marks a drain needs."""
        if self.p.rscale is None:
            return None, []
        owner = None if self.plan.multicast else g
        s = self.rs[owner].find(b)
        return self.rscale_at + s * self.plan.rows, [self.loaded[("rs", owner, s)]]

    # --- passes ------------------------------------------------------------------------------
    def mask(self, nz) -> int | None:
        if nz is None or nz.all():
            return None
        raw = np.ascontiguousarray(nz, dtype=np.uint8)
        key = (raw.shape, raw.tobytes())
        if key not in self.masks:
            self.masks[key] = self.em.const(f"{self.em.tensors[self.p.weights[0][0]].name}_mask", raw, "u8")
        return self.masks[key]

    def matmul(self, g: Group, acc: int, act, wgt: View, mb: int, kc: int, nb: int, mode: str,
               first: bool, nz, needs: list) -> Mark:
        return self.emit(g, MatMul(legion=g.base, acc=View("acc", acc, nb, 1), act=act, wgt=wgt, M=mb, K=kc,
                                   N=nb, mode=mode, split=self.plan.split, accumulate="set" if first else "add",
                                   mask=self.mask(nz)), needs)


class Intervals:
    """Address ranges of a scratchpad known to have been written (merged, sorted)."""

    def __init__(self):
        self.spans: list[tuple[int, int]] = []

    def covers(self, a: int, b: int) -> bool:
        return any(x <= a and b <= y for x, y in self.spans)

    def add(self, a: int, b: int) -> None:
        keep = [(x, y) for x, y in self.spans if y < a or x > b]
        merged = [(x, y) for x, y in self.spans if not (y < a or x > b)]
        lo = min([a] + [x for x, _ in merged])
        hi = max([b] + [y for _, y in merged])
        self.spans = sorted(keep + [(lo, hi)])


def _rectangles(nz, kc: int, nb: int, na: int) -> list[tuple[int, int, int, int]]:
    """(row0, row1, col0, col1) of the loads that cover every nonzero block of a chunk: runs of
    nonzero column blocks, merged over consecutive rows of blocks that have the same runs."""
    if nz is None:
        return [(0, kc, 0, nb)]
    out, prev, start = [], None, 0
    rows = [tuple(_runs(r)) for r in nz] + [None]
    for i, runs in enumerate(rows):
        if runs == prev:
            continue
        for j0, j1 in prev or ():
            out.append((start * na, min(i * na, kc), j0 * na, min(j1 * na, nb)))
        prev, start = runs, i
    return out


def _runs(row: np.ndarray) -> list[tuple[int, int]]:
    out, j = [], 0
    while j < row.size:
        if not row[j]:
            j += 1
            continue
        j1 = j
        while j1 < row.size and row[j1]:
            j1 += 1
        out.append((j, j1))
        j = j1
    return out


# --- the schedule ---------------------------------------------------------------------------

def emit_tiles(em: Emitter, p: Problem, plan: Plan, written: dict | None = None, spans: bool = True,
               more: tuple = (), rings: dict | None = None) -> None:
    """Emit ``p`` as ``plan`` cuts it; ``written`` (kept across matmuls) records which
    scratchpad bytes earlier instructions wrote. ``spans=False`` emits every Legion's work on
    its own (the program the spans stand for). ``more``: further problems of ``p``'s shapes
    (the batches of one matmul), emitted after it in the same slots: each one's first loads
    wait only for the slots they reuse, and go ahead of the last stores of the one before.
    ``rings``, kept across the row blocks of one matmul emitted apart (``rowblocks.py``): a
    block takes first the slots the block before it used least recently, not those its last
    passes and drains still read, so that its first loads can run ahead of them."""
    st = _Tiles(em, p, plan, {} if written is None else written, spans)
    if rings is not None and rings.get("plan") == plan:
        st.continue_rings(rings)
    elif rings is not None and "act" in rings:
        st.act_after(rings["act"])
        st.slots_after(rings.get("last", {}))
    for i, problem in enumerate((p, *more)):
        if i:
            st.next_problem(problem)
        _emit_problem(st)
    for g in st.groups:
        _flush(st, g)
    if rings is not None:
        windows = st.act_windows()
        rings.update(st.rings(), plan=plan, act=windows, last=st.last_windows())


def _emit_problem(st: _Tiles) -> None:
    p, plan = st.p, st.plan
    _zero_point_row(st)
    count = max(len(t) for t in st.tiles.values())
    order = tile_order(p, plan, count)
    last = {g: last_visit(order, len(st.tiles[g])) for g in st.groups}
    for k, (b, t, backwards) in enumerate(order):
        here = [g for g in st.groups if t < len(st.tiles[g]) and not _dead(st, b, g, t)]
        if not here:
            continue
        for g in here:
            _column_vectors(st, g, t)
        for u, unit in enumerate(st.units):
            acc = {g: _next(st, "acc", g) for g in here}   # its pending store: ``acc_readers``
            first = {g: True for g in here}
            for n, c in enumerate(in_order(unit, backwards)):
                _chunk(st, b, t, c, here, acc, first)
                if u == 0 and n == 0 and plan.res_slots > 1:
                    for g in here:
                        _residual_rows(st, b, t, g)
            if u == 0:
                # The drains' row scales after the first unit's loads, not before them: a
                # multicast into every Legion's vec waits for every vector unit, and the loads
                # behind it in the in-order DMA queue with it (2B4T layer on dlegion-8x8: at 512
                # 833,355 -> 831,753 cycles, at 128 239,920 -> 238,806; its BitLinear stack at 256
                # 288,547 -> 288,462).
                st.row_scales(b)
            for g in here:
                _finish_unit(st, b, t, u, g, acc[g], first[g], unit)
        for g in here:
            # The last unit's drain goes with the store: by row pieces in the group's last tile.
            for rows in tail_pieces(p, st.blocks[b][1], last[g] == k):
                if not p.exact:
                    _drain(st, b, t, len(st.units) - 1, g, acc[g], st.units[-1][0].group, rows)
                _end_tile(st, b, t, g, acc[g], rows)


def _zero_point_row(st: _Tiles) -> None:
    """One zero-point row for the whole matmul, after the activation slots."""
    p = st.p
    if p.corr_row is None:
        return
    everyone = frozenset(st.legions)
    issuers = ([(st.lead, everyone, st.groups)] if st.plan.multicast
               else [(g, frozenset({g.base}), [g]) for g in st.groups])
    for g, dests, users in issuers:
        load = DmaLoad(g.base, dests, View("act", st.corr_at, p.k2, 1), DramRef(p.corr_row, 0, p.k2), 1, p.k2)
        mark = st.emit(g, load)
        st.corr_loaded |= {u: mark for u in users}


def _slot_count(plan: Plan, kind: str) -> int:
    return {"acc": plan.acc_slots, "res": plan.res_slots}[kind]


def _next(st: _Tiles, kind: str, g: Group) -> int:
    s = st.turn[(kind, g)] % _slot_count(st.plan, kind)
    st.turn[(kind, g)] += 1
    return s


def _chunk(st: _Tiles, b: int, t: int, c: Chunk, here: list, acc: dict, first: dict) -> None:
    p, plan = st.p, st.plan
    m0, mb = st.blocks[b]
    work = []
    for g in here:
        n0, nb = st.tiles[g][t]
        for i in pieces(p, c):
            mode = p.weights[i][1]
            nz = chunk_blocks(st.arch, p, i, c, n0, nb) if plan.sparse else None
            reached = reach_blocks(st.arch, p, m0, mb, c, nb, n0) if plan.sparse else None
            nz = _reached(st, nz, reached, g, mb, c, nb)
            if nz is not None and not nz.any():
                continue                    # a fully-sparse chunk: no load, no pass
            work.append((g, i, mode, nz, reached, n0, nb))
    if not work:
        return
    # Forwarded activations are sent after the chunk's weight loads: a send waiting for its
    # slot then holds up no weight load behind it in its Legion's DMA queue.
    early = {(g, i): st.weights(g, i, c, n0, nb, nz, (), reached)
             for g, i, _, nz, reached, n0, nb in work} if plan.forward else {}
    act = st.activations(b, c, here)
    for g, i, mode, nz, reached, n0, nb in work:
        owner, a_slot, a_addr, width = act[g]
        loaded = st.loaded[("act", owner, a_slot)]
        s = early[(g, i)] if plan.forward else st.weights(g, i, c, n0, nb, nz, loaded, reached)
        needs = [loaded, st.loaded[("wgt", g, s)]]
        if first[g]:
            needs += st.acc_readers(g, acc[g])
        wgt = View("wgt", s * st.addr["wgt"], nb * MODE_BITS[mode] // 8, 1)
        done = st.matmul(g, acc[g] * st.addr["acc"], View("act", a_addr, width, 1), wgt, mb, c.kc, nb, mode,
                         first[g], nz, needs)
        first[g] = False
        st.read_by(("act", owner, a_slot), done)
        st.read_by(("wgt", g, s), done)


def _dead(st: _Tiles, b: int, g: Group, t: int) -> bool:
    """Whether ``g``'s tile ``t`` of row block ``b`` is all dead outputs (a causal QK^T's above
    the diagonal): its MACs are counted for the report, as the vector lanes' causal skips are."""
    (m0, mb), (n0, nb) = st.blocks[b], st.tiles[g][t]
    if not (st.plan.sparse and dead_tile(st.p, m0, mb, n0, nb)):
        return False
    st.em.skipped["causal_skipped_macs"] += g.count * mb * nb * st.p.K * len(products(st.p))
    return True


def _reached(st: _Tiles, nz, reach, g: Group, mb: int, c: Chunk, nb: int):
    """A chunk's block map with the blocks past its rows' causal reach left out (and counted
    for the report, as the vector lanes' causal skips are)."""
    if reach is None:
        return nz
    na = st.arch.array
    live = min(c.kc, int(reach.any(1).sum()) * na) * min(nb, int(reach.any(0).sum()) * na)
    st.em.skipped["causal_skipped_macs"] += g.count * mb * (c.kc * nb - live)
    return reach if nz is None else nz & reach


def _finish_unit(st: _Tiles, b: int, t: int, u: int, g: Group, acc: int, first: bool, unit: list) -> None:
    """The zero-point correction passes of one accumulation unit, and its drain unless it is
    the tile's last (drained with the tile's store, ``emit_tiles``)."""
    p = st.p
    m0, mb = st.blocks[b]
    n0, nb = st.tiles[g][t]
    for grp in sorted({c.group for c in unit}):
        if p.corr_row is not None:
            first = _correction(st, g, acc, grp, mb, n0, nb, first)
    if first:
        _zero_pass(st, b, t, g, acc, unit[0])
    if p.exact:
        return
    if u == 0:
        _flush(st, g)
        if st.plan.res_slots == 1:
            _residual_rows(st, b, t, g)
    if u < len(st.units) - 1:
        _drain(st, b, t, u, g, acc, unit[0].group, range(mb))


def _zero_pass(st: _Tiles, b: int, t: int, g: Group, acc: int, c: Chunk) -> None:
    """Every weight block of a unit is zero: one pass with an all-zero mask (no work) sets the
    accumulators to 0. It reads a chunk loaded as usual, so it reads only written bytes."""
    m0, mb = st.blocks[b]
    n0, nb = st.tiles[g][t]
    owner, a_slot, a_addr, width = st.activations(b, c, [g])[g]
    s = st.weights(g, 0, c, n0, nb, None, st.loaded[("act", owner, a_slot)])
    mode = st.p.weights[0][1]
    zero = np.zeros((-(-c.kc // st.arch.array), -(-nb // st.arch.array)), bool)
    needs = [st.loaded[("act", owner, a_slot)], st.loaded[("wgt", g, s)]] + st.acc_readers(g, acc)
    wgt = View("wgt", s * st.addr["wgt"], nb * MODE_BITS[mode] // 8, 1)
    done = st.matmul(g, acc * st.addr["acc"], View("act", a_addr, width, 1), wgt, mb, c.kc, nb, mode, True, zero,
                     needs)
    st.read_by(("act", owner, a_slot), done)
    st.read_by(("wgt", g, s), done)


def _correction(st: _Tiles, g: Group, acc: int, grp: int, mb: int, n0: int, nb: int, first: bool) -> bool:
    """acc += e . corr_weight rows of group ``grp``: the zero-point correction (qmatmul's docstring)."""
    p, plan = st.p, st.plan
    rows = range(grp * p.k2, (grp + 1) * p.k2)
    bits = MODE_BITS[p.corr_mode]
    for k0 in range(rows.start, rows.stop, plan.corr_depth):
        kc = min(plan.corr_depth, rows.stop - k0)
        key = ("corr", k0, n0)
        s = st.w[g].find(key)
        if s is None:
            s = st.w[g].take(key)
            loads = st._weight_loads(g, s, p.corr_weight, p.corr_mode, k0, kc, n0, nb, None)
            st._load("wgt", g, s, g, loads, [st.corr_loaded[g]])       # as ``weights`` does
        needs = [st.corr_loaded[g], st.loaded[("wgt", g, s)]]
        if first:
            needs += st.acc_readers(g, acc)
        act = View("act", st.corr_at + k0 - rows.start, 0, 1)
        wgt = View("wgt", s * st.addr["wgt"], nb * bits // 8, 1)
        done = st.matmul(g, acc * st.addr["acc"], act, wgt, mb, kc, nb, p.corr_mode, first, None, needs)
        first = False
        st.read_by(("wgt", g, s), done)
    return first


def _column_vectors(st: _Tiles, g: Group, t: int) -> None:
    """This tile's group scales and bias, loaded before its weights: the passes wait for those,
    so a drain that waits for the passes needs no condition of its own for these."""
    p = st.p
    n0, nb = st.tiles[g][t]
    if p.exact:
        return
    s = st.cv[g].find(n0)
    if s is not None:
        st.cv_slot[g] = s
        return
    s = st.cv_slot[g] = st.cv[g].take(n0)
    base = st.cv_at + s * st.cv_size
    loads = []
    for at, col, n in column_runs(p, n0, nb):      # the columns as they lie in DRAM
        if p.scales is not None:
            loads.append(DmaLoad(g.base, frozenset({g.base}), View("vec", base + at, nb, 1),
                                 DramRef(p.scales, p.s_offset + col, p.n_pad), p.groups, n, lstride=st.lstride(g)))
        if p.bias is not None:
            loads.append(DmaLoad(g.base, frozenset({g.base}), View("vec", base + p.groups * nb + at, nb, 1),
                                 DramRef(p.bias, col, p.n_pad), 1, n, lstride=st.lstride(g)))
    st._load("cv", g, s, g, loads)


def _drain(st: _Tiles, b: int, t: int, u: int, g: Group, acc: int, grp: int, rows: range) -> None:
    """Rows ``rows`` of the tile's accumulators, scaled, into its result slot."""
    p = st.p
    nb = st.tiles[g][t][1]
    if u == 0 and rows.start == 0 and p.residual is None:
        st.res_slot[g] = _next(st, "res", g)
    res = st.res_slot[g]
    cv = st.cv_slot[g]
    rscale, rs_needs = st.rscale_addr(g, b)
    if rscale is not None:
        rscale += rows.start
    needs = [st.sync.mark(g, "mat")] + rs_needs
    if u == 0:
        needs += st.readers.pop(("res", g, res), [])
    if p.residual is not None:
        needs.append(st.loaded[("res", g, res)])
    if ("cv", g, cv) in st.loaded:
        needs.append(st.loaded[("cv", g, cv)])
    base = st.cv_at + cv * st.cv_size
    cscale = None if p.scales is None else base + grp * nb
    bias = base + p.groups * nb if p.bias is not None and u == 0 else None
    at = rows.start * nb
    done = st.emit(g, Drain(legion=g.base, dst=View("vec", res * st.addr["res"] + at, nb, 1),
                            acc=View("acc", acc * st.addr["acc"] + at, nb, 1), M=len(rows), N=nb, zp=None,
                            rscale=rscale, cscale=cscale, bias=bias, accumulate="set" if u == 0 and p.residual is None else "add"),
                   needs)
    st.read_by(("acc", g, acc), done)
    st.read_by(("cv", g, cv), done)
    if rscale is not None:
        owner = None if st.plan.multicast else g
        st.read_by(("rs", owner, st.rs[owner].find(b)), done)


def _end_tile(st: _Tiles, b: int, t: int, g: Group, acc: int, rows: range) -> None:
    """Requantize rows ``rows`` of the tile on the vector unit, then store them (emitted later:
    see ``_flush``)."""
    p = st.p
    n0, nb = st.tiles[g][t]
    m0, mb, at = st.blocks[b][0] + rows.start, len(rows), rows.start * nb
    if p.exact:
        src, space_slot, queue = View("acc", acc * st.addr["acc"] + at, nb, 1), ("acc", g, acc), "mat"
    else:
        res = st.res_slot[g]
        src, space_slot, queue = View("vec", res * st.addr["res"] + at, nb, 1), ("res", g, res), "vec"
        if p.requant is not None:
            zp, lo, hi = p.requant
            for name, arg in (("vround", None), ("vadd", float(zp)), ("vmax", float(lo)), ("vmin", float(hi))):
                args = (src, src) if arg is None else (src, src, arg)
                st.emit(g, BY_MNEMONIC[name](g.base, *args, mb, nb))
        if p.gated:
            _gate(st, g, src, mb * nb)
    ready = st.sync.mark(g, queue)
    for seg, j, col, cols in stores(p, st.plan, g.base, n0, nb):
        piece = View(src.space, src.addr + j, src.rs, 1)
        stride = p.o_stride or seg.N
        store = DmaStore(g.base, DramRef(seg.tensor, p.o_offset + seg.at + m0 * stride + col, stride), piece, mb, cols,
                         lstride=seg.width if g.count > 1 else None)
        st.deferred[g].append((store, ready, space_slot))


def _residual_rows(st: _Tiles, b: int, t: int, g: Group) -> None:
    """The residual's rows of the tile into its result slot, which its one drain adds to, from
    where the tile's stores put the output (the residual is laid out as the output:
    ``passes/residual.py``). Emitted after the tile's first chunk where the slot was last read
    by the stores of a tile before the one before (they are long done), else after the tile's
    loads and the stores of the tile before, which it waits for: ahead of the loads it held
    them back in the in-order DMA queue (2B4T layer at sequence 128 on dlegion-8x8, one result
    slot: 216,733 cycles, 223,878 after the first chunk; a decode step, two slots: 38,472,
    38,637 after the loads)."""
    p = st.p
    if p.residual is None:
        return
    if len(st.units) > 1:
        raise ValueError("internal: a residual added in the drain of a matmul of several scale groups")
    n0, nb = st.tiles[g][t]
    m0, mb = st.blocks[b]
    res = st.res_slot[g] = _next(st, "res", g)
    if any(slot == ("res", g, res) for _, _, slot in st.deferred[g]):
        _flush(st, g)
    loads = []
    for seg, j, col, cols in stores(p, st.plan, g.base, n0, nb):
        stride = p.o_stride or seg.N
        loads.append(DmaLoad(g.base, frozenset({g.base}), View("vec", res * st.addr["res"] + j, nb, 1),
                             DramRef(p.residual, p.o_offset + seg.at + m0 * stride + col, stride), mb, cols,
                             lstride=seg.width if g.count > 1 else None))
    st._load("res", g, res, g, loads)


def _gate(st: _Tiles, g: Group, src: View, elems: int) -> None:
    """ReLU(gate)^2 * up over a drained tile of ``elems`` elements in ``src``: taken as rows of
    one pair of granules (its up columns, then its gate columns), the product written over the
    up columns. The graph's operations in its order (``passes/gated.py``): the gate's ReLU, its
    square as a product (``elementwise.squares``), then the product with up."""
    k = st.p.gated
    up, gate = View("vec", src.addr, 2 * k, 1), View("vec", src.addr + k, 2 * k, 1)
    rows = elems // (2 * k)
    st.emit(g, BY_MNEMONIC["vrelu"](g.base, gate, gate, rows, k))
    st.emit(g, BY_MNEMONIC["vmul"](g.base, gate, gate, gate, rows, k))
    st.emit(g, BY_MNEMONIC["vmul"](g.base, up, gate, up, rows, k))


def _flush(st: _Tiles, g: Group) -> None:
    """Emit the group's pending stores. They wait until the next tile's first loads are
    issued, so a store waiting for its drain never holds those loads back in the queue."""
    for store, ready, space_slot in st.deferred[g]:
        st.read_by(space_slot, st.emit(g, store, [ready]))
    st.deferred[g] = []
