"""How one quantized matmul is emitted, following a :class:`~dlegion_cc.lower.qplan.Plan`.

Every Legion owns a slice of output columns and computes its output tiles in the plan's
order, all Legions in step. A tile contracts K chunk by chunk: the chunk's activations
(multicast to every Legion by one DRAM read, unless multicast is off) and each Legion's
weight chunk go to a free slot of ``act`` and ``wgt``, and the ``mm`` waits for exactly the
loads it reads; a load into a slot waits for exactly the passes that still read the slot's
old chunk, so the next chunks load while the arrays work (double buffering). Accumulators
and results rotate over their slots the same way, so a drain and a store overlap the next
tile's passes.

Sparsity: a weight chunk whose blocks are all zero is neither loaded nor multiplied; the
all-zero rows of blocks of any other chunk are not loaded, and its ``mm`` carries a block
mask (``mask=@tensor``), so the arrays skip zero blocks and pack the rest into fewer windows.
"""
from __future__ import annotations

import numpy as np

from isa.arch import MODE_BITS
from isa.fields import DramRef, View
from isa.instructions import BY_MNEMONIC, DmaLoad, DmaStore, Drain, MatMul
from dlegion_cc.lower.emitter import Emitter
from dlegion_cc.lower.qplan import (Chunk, Plan, Problem, RowScale, Slots, Switches, act_key,  # noqa: F401
                                    act_slot_elems, choose, chunk_blocks, legion_tiles, owners,
                                    row_blocks, tile_order, units, wgt_slot_bytes)

Queue = tuple[int, str]
Mark = tuple[Queue, int]          # (queue, count): that queue's first ``count`` instructions


def plan_tiles(arch, p: Problem, switches: Switches = Switches()) -> Plan:
    return choose(arch, p, switches)


class Sync:
    """Waits on exact progress counts: an instruction waits for the very instructions it needs,
    not for everything issued before it (which would serialize loads and passes)."""

    def __init__(self, em: Emitter):
        self.em = em
        self.held: dict = {}          # (waiting queue, source queue) -> count already waited for

    def mark(self, q: Queue) -> Mark:
        """The instructions issued on ``q`` so far (call right after emitting one)."""
        return q, self.em.issued.get(q, 0)

    def need(self, dst: Queue, marks) -> None:
        """The next instruction on ``dst`` starts only once every mark is reached."""
        for src, count in marks:
            self._one(dst, src, count)

    def _one(self, dst: Queue, src: Queue, count: int) -> None:
        if count <= 0 or self.held.get((dst, src), 0) >= count:
            return
        if src == dst and src[1] != "dma":
            return              # a matrix or vector queue finishes its work in order
        self.held[(dst, src)] = count
        self.em.depend(src, dst, upto=count)


class _Tiles:
    """The state of emitting one plan: slots, what each holds, who reads it."""

    def __init__(self, em: Emitter, p: Problem, plan: Plan, written: dict):
        self.em, self.p, self.plan, self.arch = em, p, plan, em.arch
        self.written = written
        self.sync = Sync(em)
        self.legions = owners(em.arch, p, plan)
        self.lead = self.legions[0]
        self.tiles = {l: legion_tiles(p, plan, l) for l in self.legions}
        self.blocks = row_blocks(p, plan)
        self.units = units(p, plan)
        tile = plan.rows * plan.cols
        self.addr = {"act": act_slot_elems(p, plan), "wgt": wgt_slot_bytes(p, plan), "acc": tile,
                     "res": tile}
        self.corr_at = plan.a_slots * self.addr["act"]
        self.rscale_at = plan.res_slots * tile
        self.cv_at = self.rscale_at + 2 * plan.rows
        self.cv_size = (p.groups + 1) * plan.cols
        who = [None] if plan.multicast else self.legions
        self.a = {w: Slots(plan.a_slots) for w in who}
        self.w = {l: Slots(plan.w_slots) for l in self.legions}
        self.rs = {w: Slots(2) for w in who}
        self.loaded: dict = {}        # (space, owner, slot) -> the load's mark
        self.readers: dict = {}       # (space, owner, slot) -> marks of the work still reading it
        self.turn = {(k, l): 0 for k in ("acc", "res", "cv") for l in self.legions}
        self.deferred: dict = {l: [] for l in self.legions}
        self.masks: dict = {}
        self.corr_loaded: dict = {}   # Legion -> the load of its zero-point row
        self.cv_slot: dict = {}       # Legion -> column-vector slot of its current tile
        self.res_slot: dict = {}      # Legion -> result slot of its current tile

    # --- loads -------------------------------------------------------------------------------
    def _load(self, space: str, owner, slot: int, issuer: int, dests, instrs) -> None:
        """Emit ``instrs`` (loads into one slot) after the slot's readers are done."""
        q = (issuer, "dma")
        self.sync.need(q, self.readers.pop((space, owner, slot), []))
        for i in instrs:
            self.em.emit(i)
        self.loaded[(space, owner, slot)] = self.sync.mark(q)

    def activations(self, b: int, c: Chunk, here: list) -> dict:
        """Each Legion's act address of chunk ``c`` of row block ``b``, loading it if needed."""
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
                issuer = self.lead if owner is None else owner
                dests = frozenset(self.legions) if owner is None else frozenset({owner})
                view = View("act", s * self.addr["act"], width, 1)
                load = DmaLoad(issuer, dests, view, DramRef(p.a8, m0 * p.K + k0a, p.K), mb, width)
                self._load("act", owner, s, issuer, dests, [load])
            for l in (self.legions if owner is None else [owner]):
                out[l] = (owner, s, s * self.addr["act"] + c.k0 - k0a, width)
        return out

    def weights(self, l: int, piece: int, c: Chunk, n0: int, nb: int, nz) -> int:
        """wgt address of a weight chunk on Legion ``l``, loading its nonzero rows of blocks."""
        key = (piece, c.k0, n0)
        s = self.w[l].find(key)
        if s is not None:
            return s
        s = self.w[l].take(key)
        tensor, mode = self.p.weights[piece]
        # Zero blocks are left out of the load only where the slot holds earlier bytes: the
        # arrays never use them, but every byte an instruction reads must have been written.
        span = (s * self.addr["wgt"], s * self.addr["wgt"] + c.kc * nb * MODE_BITS[mode] // 8)
        written = self.written.setdefault((l, "wgt"), Intervals())
        if not written.covers(*span):
            nz = None
            written.add(*span)
        self._load("wgt", l, s, l, None, self._weight_loads(l, s, tensor, mode, c.k0, c.kc, n0, nb, nz))
        return s

    def _weight_loads(self, l, s, tensor, mode, k0, kc, n0, nb, nz) -> list:
        bits, na = MODE_BITS[mode], self.arch.array
        row_bytes, tile_bytes = self.p.n_pad * bits // 8, nb * bits // 8
        base = s * self.addr["wgt"]
        out = []
        for r0, r1, c0, c1 in _rectangles(nz, kc, nb, na):
            b0, b1 = c0 * bits // 8, c1 * bits // 8
            out.append(DmaLoad(l, frozenset({l}), View("wgt", base + r0 * tile_bytes + b0, tile_bytes, 1),
                               DramRef(tensor, (k0 + r0) * row_bytes + n0 * bits // 8 + b0, row_bytes),
                               r1 - r0, b1 - b0))
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
            issuer = self.lead if owner is None else owner
            dests = frozenset(self.legions) if owner is None else frozenset({owner})
            view = View("vec", self.rscale_at + s * self.plan.rows, 1, 1)
            src = DramRef(rs.tensor, rs.offset + m0 * rs.stride, rs.stride)
            self._load("rs", owner, s, issuer, dests, [DmaLoad(issuer, dests, view, src, mb, 1)])
            for l in (self.legions if owner is None else [owner]):
                self._scale_op(l, view, mb, self.loaded[("rs", owner, s)])

    def _scale_op(self, l: int, view: View, mb: int, loaded) -> None:
        op = self.p.rscale.op
        if op == "mov":
            return
        self.sync.need((l, "vec"), [loaded])
        if op == "recip":
            self.em.emit(BY_MNEMONIC["vrecip"](l, view, view, mb, 1))
        else:
            self.em.emit(BY_MNEMONIC["vmul"](l, view, view, float(np.float32(self.p.rscale.factor)), mb, 1))

    def rscale_addr(self, l: int, b: int) -> tuple[int | None, list]:
        """vec address of row block ``b``'s scales on Legion ``l`` and the marks a drain needs."""
        if self.p.rscale is None:
            return None, []
        owner = None if self.plan.multicast else l
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

    def matmul(self, l: int, acc: int, act, wgt: View, mb: int, kc: int, nb: int, mode: str,
               first: bool, nz, needs: list) -> None:
        q = (l, "mat")
        self.sync.need(q, needs)
        self.em.emit(MatMul(legion=l, acc=View("acc", acc, nb, 1), act=act, wgt=wgt, M=mb, K=kc, N=nb,
                            mode=mode, split=self.plan.split, accumulate="set" if first else "add",
                            mask=self.mask(nz)))


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

def emit_tiles(em: Emitter, p: Problem, plan: Plan, written: dict | None = None) -> None:
    """Emit ``p`` as ``plan`` cuts it; ``written`` (kept across matmuls) records which
    scratchpad bytes earlier instructions wrote."""
    st = _Tiles(em, p, plan, {} if written is None else written)
    if p.corr_row is not None:          # one zero-point row for the whole matmul, after the slots
        issuers = [(st.lead, frozenset(st.legions))] if plan.multicast else [(l, frozenset({l})) for l in st.legions]
        for issuer, dests in issuers:
            em.emit(DmaLoad(issuer, dests, View("act", st.corr_at, p.k2, 1), DramRef(p.corr_row, 0, p.k2), 1, p.k2))
            st.corr_loaded |= {l: st.sync.mark((issuer, "dma")) for l in dests}
    count = max(len(t) for t in st.tiles.values())
    for b, t in tile_order(p, plan, count):
        here = [l for l in st.legions if t < len(st.tiles[l])]
        st.row_scales(b)
        for u, unit in enumerate(st.units):
            acc = {l: _acc_slot(st, l) for l in here}
            first = {l: True for l in here}
            for c in unit:
                _chunk(st, b, t, c, here, acc, first)
            for l in here:
                _finish_unit(st, b, t, u, l, acc[l], first[l], unit)
        for l in here:
            _end_tile(st, b, t, l, acc[l])
    for l in st.legions:
        _flush(st, l)


def _acc_slot(st: _Tiles, l: int) -> int:
    """The next accumulator slot, its pending store (exact results) emitted first."""
    s = _next(st, "acc", l)
    if any(slot == ("acc", l, s) for _, _, slot in st.deferred[l]):
        _flush(st, l)
    return s


def _next(st: _Tiles, kind: str, l: int) -> int:
    slots = {"acc": st.plan.acc_slots, "res": st.plan.res_slots, "cv": 2}[kind]
    s = st.turn[(kind, l)] % slots
    st.turn[(kind, l)] += 1
    return s


def _chunk(st: _Tiles, b: int, t: int, c: Chunk, here: list, acc: dict, first: dict) -> None:
    p, plan = st.p, st.plan
    m0, mb = st.blocks[b]
    act = None
    for l in here:
        n0, nb = st.tiles[l][t]
        for i, (_, mode) in enumerate(p.weights):
            nz = chunk_blocks(st.arch, p, i, c, n0, nb) if plan.sparse else None
            if nz is not None and not nz.any():
                continue                    # a fully-sparse chunk: no load, no pass
            if act is None:
                act = st.activations(b, c, here)
            owner, a_slot, a_addr, width = act[l]
            s = st.weights(l, i, c, n0, nb, nz)
            needs = [st.loaded[("act", owner, a_slot)], st.loaded[("wgt", l, s)]]
            if first[l]:
                needs += st.readers.pop(("acc", l, acc[l]), [])
            wgt = View("wgt", s * st.addr["wgt"], nb * MODE_BITS[mode] // 8, 1)
            st.matmul(l, acc[l] * st.addr["acc"], View("act", a_addr, width, 1), wgt, mb, c.kc, nb, mode,
                      first[l], nz, needs)
            first[l] = False
            done = st.sync.mark((l, "mat"))
            st.readers.setdefault(("act", owner, a_slot), []).append(done)
            st.readers.setdefault(("wgt", l, s), []).append(done)


def _finish_unit(st: _Tiles, b: int, t: int, u: int, l: int, acc: int, first: bool, unit: list) -> None:
    """The zero-point correction passes and the drain of one accumulation unit."""
    p = st.p
    m0, mb = st.blocks[b]
    n0, nb = st.tiles[l][t]
    for g in sorted({c.group for c in unit}):
        if p.corr_row is not None:
            first = _correction(st, l, acc, g, mb, n0, nb, first)
    if first:
        _zero_pass(st, b, t, l, acc, unit[0])
    if p.exact:
        return
    if u == 0:
        _flush(st, l)
        _column_vectors(st, l, t, n0, nb)
    _drain(st, b, t, u, l, acc, unit[0].group, mb, nb)


def _zero_pass(st: _Tiles, b: int, t: int, l: int, acc: int, c: Chunk) -> None:
    """Every weight block of a unit is zero: one pass with an all-zero mask (no work) sets the
    accumulators to 0. It reads a chunk loaded as usual, so it reads only written bytes."""
    m0, mb = st.blocks[b]
    n0, nb = st.tiles[l][t]
    owner, a_slot, a_addr, width = st.activations(b, c, [l])[l]
    s = st.weights(l, 0, c, n0, nb, None)
    mode = st.p.weights[0][1]
    zero = np.zeros((-(-c.kc // st.arch.array), -(-nb // st.arch.array)), bool)
    needs = [st.loaded[("act", owner, a_slot)], st.loaded[("wgt", l, s)]] + st.readers.pop(("acc", l, acc), [])
    wgt = View("wgt", s * st.addr["wgt"], nb * MODE_BITS[mode] // 8, 1)
    st.matmul(l, acc * st.addr["acc"], View("act", a_addr, width, 1), wgt, mb, c.kc, nb, mode, True, zero, needs)
    done = st.sync.mark((l, "mat"))
    st.readers.setdefault(("act", owner, a_slot), []).append(done)
    st.readers.setdefault(("wgt", l, s), []).append(done)


def _correction(st: _Tiles, l: int, acc: int, g: int, mb: int, n0: int, nb: int, first: bool) -> bool:
    """acc += e . corr_weight rows of group g: the zero-point correction (qmatmul's docstring)."""
    p, plan = st.p, st.plan
    rows = range(g * p.k2, (g + 1) * p.k2)
    for k0 in range(rows.start, rows.stop, plan.corr_depth):
        kc = min(plan.corr_depth, rows.stop - k0)
        key = ("corr", k0, n0)
        s = st.w[l].find(key)
        if s is None:
            s = st.w[l].take(key)
            st._load("wgt", l, s, l, None, st._weight_loads(l, s, p.corr_weight, p.corr_mode, k0, kc, n0, nb, None))
        needs = [st.corr_loaded[l], st.loaded[("wgt", l, s)]]
        if first:
            needs += st.readers.pop(("acc", l, acc), [])
        act = View("act", st.corr_at + k0 - rows.start, 0, 1)
        wgt = View("wgt", s * st.addr["wgt"], nb * MODE_BITS[p.corr_mode] // 8, 1)
        st.matmul(l, acc * st.addr["acc"], act, wgt, mb, kc, nb, p.corr_mode, first, None, needs)
        first = False
        st.readers.setdefault(("wgt", l, s), []).append(st.sync.mark((l, "mat")))
    return first


def _column_vectors(st: _Tiles, l: int, t: int, n0: int, nb: int) -> None:
    """This tile's group scales and bias, once the drains two tiles back are done with the slot."""
    p = st.p
    s = _next(st, "cv", l)
    st.cv_slot[l] = s
    if p.scales is None and p.bias is None:
        return
    base = st.cv_at + s * st.cv_size
    loads = []
    if p.scales is not None:
        loads.append(DmaLoad(l, frozenset({l}), View("vec", base, nb, 1), DramRef(p.scales, n0, p.n_pad), p.groups, nb))
    if p.bias is not None:
        loads.append(DmaLoad(l, frozenset({l}), View("vec", base + p.groups * nb, nb, 1),
                             DramRef(p.bias, n0, p.n_pad), 1, nb))
    st._load("cv", l, s, l, None, loads)


def _drain(st: _Tiles, b: int, t: int, u: int, l: int, acc: int, g: int, mb: int, nb: int) -> None:
    p = st.p
    q = (l, "vec")
    if u == 0:
        st.res_slot[l] = _next(st, "res", l)
    res = st.res_slot[l]
    cv = st.cv_slot[l]
    rscale, rs_needs = st.rscale_addr(l, b)
    needs = [st.sync.mark((l, "mat"))] + rs_needs
    if u == 0:
        needs += st.readers.pop(("res", l, res), [])
    if ("cv", l, cv) in st.loaded:
        needs.append(st.loaded[("cv", l, cv)])
    st.sync.need(q, needs)
    base = st.cv_at + cv * st.cv_size
    cscale = None if p.scales is None else base + g * nb
    bias = base + p.groups * nb if p.bias is not None and u == 0 else None
    st.em.emit(Drain(legion=l, dst=View("vec", res * st.addr["res"], nb, 1), acc=View("acc", acc * st.addr["acc"], nb, 1),
                     M=mb, N=nb, zp=None, rscale=rscale, cscale=cscale, bias=bias,
                     accumulate="set" if u == 0 else "add"))
    done = st.sync.mark(q)
    st.readers.setdefault(("acc", l, acc), []).append(done)
    st.readers.setdefault(("cv", l, cv), []).append(done)
    if rscale is not None:
        owner = None if st.plan.multicast else l
        st.readers.setdefault(("rs", owner, st.rs[owner].find(b)), []).append(done)


def _end_tile(st: _Tiles, b: int, t: int, l: int, acc: int) -> None:
    """Requantize on the vector unit, then store the tile (emitted later: see ``_flush``)."""
    p = st.p
    m0, mb = st.blocks[b]
    n0, nb = st.tiles[l][t]
    cols = min(nb, p.N - n0)
    if p.exact:
        src, space_slot, wait = View("acc", acc * st.addr["acc"], nb, 1), ("acc", l, acc), (l, "mat")
    else:
        res = st.res_slot[l]
        src, space_slot, wait = View("vec", res * st.addr["res"], nb, 1), ("res", l, res), (l, "vec")
        if p.requant is not None:
            zp, lo, hi = p.requant
            for name, arg in (("vround", None), ("vadd", float(zp)), ("vmax", float(lo)), ("vmin", float(hi))):
                args = (src, src) if arg is None else (src, src, arg)
                st.em.emit(BY_MNEMONIC[name](l, *args, mb, nb))
    ready = st.sync.mark(wait)
    if cols > 0:
        store = DmaStore(l, DramRef(p.out, m0 * p.N + n0, p.N), src, mb, cols)
        st.deferred[l].append((store, ready, space_slot))


def _flush(st: _Tiles, l: int) -> None:
    """Emit the Legion's pending stores. They wait until the next tile's first loads are
    issued, so a store waiting for its drain never holds those loads back in the queue."""
    q = (l, "dma")
    for store, ready, space_slot in st.deferred[l]:
        st.sync.need(q, [ready])
        st.em.emit(store)
        st.readers.setdefault(space_slot, []).append(st.sync.mark(q))
    st.deferred[l] = []


# --- what sparsity saved, for the run report ------------------------------------------------

def sparsity_report(result) -> dict:
    """Weight sparsity as a run used it (``result``: a ``runtime.emulator.RunResult``): the
    ``mm`` instructions and those carrying a block mask, the weight blocks the masks mark zero,
    the bytes loaded into ``wgt``, and the timing model's pass counts (passes skipped inside
    masked windows and the cycles that saved). Chunks whose blocks are all zero are not in the
    program at all: compare ``mm`` and ``wgt_bytes`` with a ``--no-sparsity`` build."""
    program, counters = result.program, result.timeline.counters
    mms = [i for i in program.instrs if isinstance(i, MatMul)]
    masked = [i for i in mms if i.mask is not None]
    zero_blocks = 0
    for i in masked:
        t = program.tensors[i.mask]
        zero_blocks += int((np.frombuffer(program.const_bytes(t), np.uint8) == 0).sum())
    wgt = sum(i.rows * i.cols for i in program.instrs if isinstance(i, DmaLoad) and i.dst.space == "wgt")
    return {"mm": len(mms), "masked_mm": len(masked), "masked_zero_blocks": zero_blocks, "wgt_bytes": wgt,
            "passes": int(counters["passes"]), "dense_passes": int(counters["dense_passes"]),
            "windows_skipped": int(counters["windows_skipped"]),
            "cycles_saved": int(counters["sparsity_cycles_saved"])}
