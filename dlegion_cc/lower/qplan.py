"""Choosing how one quantized matmul is cut: a search over schedules ranked by a cost model.

A schedule (:class:`Plan`) deals the output columns to the Legions in equal slices and cuts
each Legion's work into output tiles of ``rows`` x ``cols`` (one accumulator buffer each),
visited row blocks outer (``order="rows"``: a block of activation rows stays in ``act`` while
the Legion's weights stream past it, once per row block) or column tiles outer
(``order="cols"``: a tile's weights stay in ``wgt`` while the activation rows stream past,
once per column tile). Each tile contracts K in chunks of ``depth`` weight rows; every
operand lives in a ring of equal *slots* of its scratchpad, so the next chunk loads while
the current one is in the arrays (double buffering) and a chunk still in a slot is not
loaded again.

The cost model replays the schedule chunk by chunk for every Legion with the machine's own
figures: an ``mm``'s time is ``runtime.costs``' (passes of M + pass_overhead cycles on the
busiest core, the block mask compacting partially-sparse windows), after its first weight
window's load unless the matrix queue was still busy when its operands arrived; a load takes
its bytes at the Legion's share of DRAM bandwidth plus the DRAM latency, a drain ``M*N / lanes``
cycles; each operation starts when its queue is free and what it depends on is done. The
total is the latest Legion's finish, and never less than all DRAM bytes at the DRAM rate.
A matmul run several times over in the same slots (``Problem.batches``: the batches of a
run-time B) is replayed batch by batch.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache

import numpy as np

from isa.arch import MODE_BITS, MODE_TILES, Arch
from dlegion_cc.lower.context import Switches
from runtime.costs import Blocks, block_stats, pass_cycles, weight_lead

ORDERS = ("rows", "cols")


@dataclass(frozen=True, eq=False)
class Problem:
    """One quantized matmul, its operands already in DRAM (tensor indices)."""

    a8: int                  # i8 [M, K] activations - offset
    rscale: "RowScale | None"
    weights: tuple           # ((tensor [K, n_pad], mode), ...): pieces summed into the accumulators
    scales: int | None       # f32 [groups, n_pad]
    groups: int
    block: int
    bias: int | None         # f32 [n_pad]
    corr_row: int | None     # i8 [k2]: the activation zero point minus the offset
    corr_weight: int | None  # [groups * k2, n_pad] at ``corr_mode``
    k2: int
    corr_mode: str
    requant: tuple | None
    exact: bool              # store the int32 accumulators as they are
    out: int
    rows: range              # the activation (and output) rows this weight multiplies
    K: int
    N: int
    n_pad: int
    nonzero: tuple = ()      # per weight piece: bool [ceil(K/array), n_pad/array] nonzero blocks
    segments: tuple = ()     # of a fused matmul (``Segment``): where its columns are stored
    w_offset: int = 0        # where the weights start in their tensors (one batch of a run-time B)
    s_offset: int = 0        # where the column scales start in theirs (one batch of run-time scales)
    legions: range | None = None    # the Legions it runs on, column slices in order (None: all)
    batches: int = 1         # run this many times over in the same slots (``emit_tiles``' ``more``)
    # Per activation row (over every batch's rows): how many leading weight rows it needs, the
    # rest of its activations being exact zeros (a causal P: ``passes/causal.py``); None: all.
    k_reach: np.ndarray | None = None
    # Per activation row (likewise): how many leading output columns anything looks at, the
    # rest being dead (a causal QK^T: ``passes/causal.py``); None: all. A tile of dead columns
    # only is neither loaded, passed, drained nor stored.
    n_reach: np.ndarray | None = None
    # Output row m is stored at DRAM element ``o_offset + m * o_stride`` of ``out`` (a batch of
    # attention's P.V straight into its heads' place in the merged rows); 0: at ``m * N``.
    o_offset: int = 0
    o_stride: int = 0
    # Elements of ``vec`` the plan may take from address 0 (0: all); a row kernel interleaved
    # with it runs in the rest (``rowblocks.py``).
    vec_room: int = 0
    # One row block of a chain (``rowblocks.py``), whose row kernels share the matmul's vector
    # queue and DRAM: with ``pass_overlap`` its tiles take all its rows (``tile_rows``).
    row_block: bool = False
    # A gated matmul (``passes/gated.py``): its columns are pairs of granules of this many up
    # and gate columns (``qmatmul.gated_major``), a tile drains both and stores ReLU(gate)^2 *
    # up, half its columns; 0: a plain matmul.
    gated: int = 0
    # A sum of products of pieces (``--attention int8x2``): further int8 activation pieces
    # [M, K] beside ``a8`` (piece 0), and the products, each (activation piece, weight piece,
    # scale group): its chunks accumulate into the unit of that group, drained with that row of
    # ``scales``. (): every weight piece against ``a8``, in the groups ``block`` cuts K into.
    a_pieces: tuple = ()
    terms: tuple = ()
    # Per column, the output column it is (columns dealt to the Legions in another order: a
    # causal QK^T's interleaved, ``qmatmul``), which ``n_reach`` counts in; None: itself.
    n_origin: np.ndarray | None = None
    # f32 [M, N], laid out as the output: loaded into each tile's result slot, which its one
    # drain adds to (a residual Add, ``passes/residual.py``); None: none.
    residual: int | None = None


def room(arch: Arch, p: Problem) -> dict[str, int]:
    """The scratchpad elements a plan of ``p`` may take, by space."""
    cap = arch.derived.spad_elems
    return {**cap, "vec": min(cap["vec"], p.vec_room)} if p.vec_room else cap


def legion_range(arch: Arch, p: Problem) -> range:
    return p.legions if p.legions is not None else range(arch.legions)


def rank(p: Problem, legion: int) -> int:
    """Which column slice ``legion`` holds: its place among the Legions ``p`` runs on."""
    return legion - (p.legions.start if p.legions is not None else 0)


@dataclass(frozen=True)
class Segment:
    """Columns ``offset`` .. ``offset + width - 1`` of every Legion's slice are that Legion's
    ``width`` columns of output ``tensor`` [rows, N]: Legion l holds its columns l * width on.
    A fused matmul's weight is laid out so (``qmatmul.legion_major``); any other matmul has
    one segment, its output, with every Legion's slice ``per_legion`` columns of it."""

    tensor: int
    N: int
    width: int
    offset: int = 0
    at: int = 0             # DRAM elements from the tensor's start to the segment's first column


@dataclass(frozen=True)
class RowScale:
    """The drain's per-row scale: DRAM ``tensor[offset + row * stride]`` (stride 0: one for all
    rows), turned into the multiplier on the vector unit: kept, inverted, or times ``factor``."""

    tensor: int
    offset: int
    stride: int
    op: str = "mov"               # "mov", "recip" or "mul"
    factor: float = 1.0


@dataclass(frozen=True)
class Plan:
    order: str          # "rows" or "cols" (see the module docstring)
    rows: int           # activation rows per tile (M of each pass)
    cols: int           # output columns per tile (one drain)
    depth: int          # weight rows per chunk (never across a scale group)
    whole_rows: bool    # an activation slot holds all K columns of its rows (else one chunk)
    per_legion: int     # output columns each Legion owns
    w_slots: int
    a_slots: int
    acc_slots: int
    res_slots: int      # result buffers in ``vec``
    split: str          # how an mm spreads its passes over the cores
    multicast: bool
    sparse: bool
    corr_depth: int = 0
    # Activations held across the Legions (``homes``): each chunk is read from DRAM once into
    # one Legion's ``act`` and sent from there to every Legion's slot over the NoC (``noc.mv``)
    # each time a tile needs it, instead of being read from DRAM again.
    forward: bool = False
    homes: int = 0      # home slots of forwarded chunks in each Legion's ``act`` (``Homes``)


# --- the schedule's shape, shared by the emitter and the model ------------------------------

def owners(arch: Arch, p: Problem, plan: Plan) -> list[int]:
    return [l for l in legion_range(arch, p) if rank(p, l) * plan.per_legion < p.n_pad]


def legion_tiles(p: Problem, plan: Plan, legion: int) -> list[tuple[int, int]]:
    """(first column, width) of each column tile of ``legion``."""
    start = rank(p, legion) * plan.per_legion
    stop = min(start + plan.per_legion, p.n_pad)
    return [(n0, min(plan.cols, stop - n0)) for n0 in range(start, stop, plan.cols)]


def weights_wait(plan: Plan, first: bool, legions: int, nb: int, mode: str) -> bool:
    """Whether a weight chunk's load waits for the chunk's activations. Activations cut in K
    chunks are loaded again with every chunk, and every Legion's passes wait for them: weight
    loads behind them never compete with them for DRAM, and a pass that waits for its weights
    needs no second condition. Activations held whole are loaded once, before everything:
    then the weights start streaming at once (each pass waits for both). A Legion's ``first``
    weight load never waits: before the first pass both loads are on the critical path.
    Forwarded activations come over the NoC, not from DRAM: the weights never wait for them.
    Nor do ``legions`` weight tiles of ``nb`` columns in ``mode`` light against multicast
    activations (``light_weights``)."""
    return not plan.whole_rows and not first and not plan.forward \
        and not (plan.multicast and light_weights(plan, legions, nb, mode))


# Weights whose bytes over every Legion are at most this share of the multicast activations'
# of a chunk take little of DRAM beside them; waiting for the multicast to complete put their
# load's round trip after it, and every Legion's pass waited for both in turn (attention's P.V
# at 512 on dlegion-8x8: 256 rows of V's codes, 16 columns a Legion, against 512 rows of P).
LIGHT_WEIGHTS = 2
# The fewest activation rows a tile for that: below, the multicast is short and the weights'
# wait costs little (a chain of 64-row blocks of the BitLinear stack kept its loads' order).
LIGHT_ROWS = 256


def light_weights(plan: Plan, legions: int, nb: int, mode: str) -> bool:
    """Whether ``legions`` weight tiles of ``nb`` columns in ``mode`` are light against the
    activations of a row block (``LIGHT_WEIGHTS``, ``LIGHT_ROWS``), per row of K."""
    return plan.rows >= LIGHT_ROWS and legions * nb * MODE_BITS[mode] // 8 * LIGHT_WEIGHTS <= plan.rows


def segments(p: Problem, plan: Plan) -> tuple:
    return p.segments or (Segment(p.out, p.N, plan.per_legion),)


def stores(p: Problem, plan: Plan, legion: int, n0: int, nb: int) -> list[tuple[Segment, int, int, int]]:
    """Where ``legion``'s output tile of columns ``n0`` .. ``n0 + nb - 1`` goes: per segment it
    meets, (segment, first column within the tile, first output column, columns)."""
    local, out = n0 - rank(p, legion) * plan.per_legion, []
    if p.gated:
        return _gated_stores(p, plan, legion, local, nb)
    for s in segments(p, plan):
        lo, hi = max(local, s.offset), min(local + nb, s.offset + s.width)
        col = rank(p, legion) * s.width + lo - s.offset
        cols = min(hi - lo, s.N - col)
        if cols > 0:
            out.append((s, lo - local, col, cols))
    return out


def _gated_stores(p: Problem, plan: Plan, legion: int, local: int, nb: int) -> list:
    """``stores`` of a gated tile: each pair's product, left in its up granule."""
    s, g = segments(p, plan)[0], p.gated
    out = []
    for j in range(0, nb, 2 * g):
        col = rank(p, legion) * s.width + (local + j) // 2
        cols = min(g, s.N - col)
        if cols > 0:
            out.append((s, j, col, cols))
    return out


# Vector operations a gated tile's gate columns take after the drain: ReLU, square, product.
GATE_OPS = 3


def gated_ops(p: Problem) -> int:
    """Vector operations a gated tile's outputs take after the drain (``GATE_OPS``)."""
    return GATE_OPS if p.gated else 0


@dataclass(frozen=True)
class Group:
    """Legions ``base`` .. ``base + count - 1``, whose work is the same up to a DRAM offset of
    ``per_legion`` columns a Legion: their instructions are emitted once, with ``span=count``."""

    base: int
    count: int

    @property
    def legions(self) -> range:
        return range(self.base, self.base + self.count)


def groups(arch: Arch, p: Problem, plan: Plan) -> list[Group]:
    """Runs of adjacent Legions that do the same work (tile widths, stored columns and, with
    sparsity, weight block maps): one span each. A Legion whose work differs (a shorter last
    slice, other zero blocks) starts a run of its own."""
    out: list[Group] = []
    for legion in owners(arch, p, plan):
        if out and _same_work(arch, p, plan, out[-1].base, legion):
            out[-1] = Group(out[-1].base, out[-1].count + 1)
        else:
            out.append(Group(legion, 1))
    return out


def _same_work(arch: Arch, p: Problem, plan: Plan, a: int, b: int) -> bool:
    ta, tb = legion_tiles(p, plan, a), legion_tiles(p, plan, b)
    def stored(legion, tiles):
        return [(nb, [(s, j, cols) for s, j, _, cols in stores(p, plan, legion, n0, nb)]) for n0, nb in tiles]
    if stored(a, ta) != stored(b, tb):
        return False
    if not plan.sparse:
        return True
    if p.n_reach is not None and any(_reached_columns(p, m0, mb, ta) != _reached_columns(p, m0, mb, tb)
                                     for m0, mb in row_blocks(p, plan)):
        return False
    na, width = arch.array, sum(nb for _, nb in ta)
    cols = lambda tiles: slice(tiles[0][0] // na, (tiles[0][0] + width) // na)
    return all(np.array_equal(nz[:, cols(ta)], nz[:, cols(tb)]) for nz in p.nonzero)


def column_runs(p: Problem, n0: int, nb: int) -> list[tuple[int, int, int]]:
    """(first column within the tile, its column in DRAM, columns) of each run of the tile's
    columns ``n0`` .. ``n0 + nb - 1`` that lie side by side in DRAM (``Problem.n_origin``)."""
    if p.n_origin is None:
        return [(0, n0, nb)]
    cols = p.n_origin[n0:n0 + nb]
    cut = np.flatnonzero(np.diff(cols) != 1) + 1
    return [(int(a), int(cols[a]), int(b - a)) for a, b in zip(np.r_[0, cut], np.r_[cut, nb])]


def legion_step(p: Problem, plan: Plan) -> int:
    """DRAM columns from one Legion's columns to the next one's."""
    if p.n_origin is None or p.n_origin.size <= plan.per_legion:
        return plan.per_legion
    return int(p.n_origin[plan.per_legion] - p.n_origin[0])


def _reached_columns(p: Problem, m0: int, mb: int, tiles: list) -> list[int]:
    """How many of each tile's columns rows ``m0`` .. ``m0 + mb - 1`` look at."""
    need = int(p.n_reach[m0:m0 + mb].max(initial=0))
    if p.n_origin is not None:
        return [int((p.n_origin[n0:n0 + nb] < need).sum()) for n0, nb in tiles]
    return [min(max(need - n0, 0), nb) for n0, nb in tiles]


# A Legion's last tile is drained and stored in this many row pieces: the first piece's store
# starts after a quarter of the drain, not all of it. Nothing hides a matmul's last store.
TAIL_PIECES = 4


def tail_pieces(p: Problem, rows: int, final: bool) -> list[range]:
    """The row pieces a tile of ``rows`` rows is drained and stored in (``final``: a Legion's
    last tile; results stored straight from the accumulators are ready all at once)."""
    size = -(-rows // (TAIL_PIECES if final and not p.exact else 1))
    return [range(r, min(r + size, rows)) for r in range(0, rows, size)]


def row_blocks(p: Problem, plan: Plan) -> list[tuple[int, int]]:
    return [(m0, min(plan.rows, p.rows.stop - m0)) for m0 in range(p.rows.start, p.rows.stop, plan.rows)]


def tile_order(p: Problem, plan: Plan, tiles: int) -> list[tuple[int, int, bool]]:
    """(row block, column tile index, backwards) in the order the tiles are computed.

    A tile runs its chunks backwards when the one before it ran them forwards, so the chunks
    the last tile left in the activation slots are the next one's first, and are not loaded
    again (for that, order "cols" also visits the row blocks backwards on odd tiles). The
    accumulators sum a unit's chunks exactly, in any order."""
    blocks = list(range(len(row_blocks(p, plan))))
    if plan.order == "rows":
        order = [(b, t) for b in blocks for t in range(tiles)]
    else:
        order = [(b, t) for t in range(tiles) for b in (blocks[::-1] if t % 2 else blocks)]
    return [(b, t, k % 2 == 1) for k, (b, t) in enumerate(order)]


def last_visit(order: list, tiles: int) -> int:
    """The position in ``order`` (``tile_order``) of the last tile of a Legion with ``tiles``."""
    return max(k for k, (_, t, _) in enumerate(order) if t < tiles)


def in_order(unit: list, backwards: bool) -> list:
    """A unit's chunks in the order a tile runs them."""
    return unit[::-1] if backwards else unit


@dataclass(frozen=True)
class Chunk:
    """One contraction step: weight rows [k0, k0 + kc) of scale group ``group``; of a product
    of pieces (``Problem.terms``), activation piece ``a`` against weight piece ``w`` alone."""

    k0: int
    kc: int
    group: int
    a: int = 0
    w: int | None = None


def pieces(p: Problem, c: Chunk) -> range:
    """The weight pieces chunk ``c`` multiplies: its term's, else every one."""
    return range(len(p.weights)) if c.w is None else range(c.w, c.w + 1)


def products(p: Problem) -> list[str]:
    """The mode of each product over all of K the matmul sums (a term, or a weight piece)."""
    return [p.weights[w][1] for _, w, _ in p.terms] if p.terms else [mode for _, mode in p.weights]


def units(p: Problem, plan: Plan) -> list[list[Chunk]]:
    """The chunks of each accumulation (one per scale group; all of K for exact results)."""
    if p.terms:
        per = [[] for _ in range(p.groups)]
        for a, w, g in p.terms:
            per[g] += [Chunk(k0, min(plan.depth, p.K - k0), g, a, w) for k0 in range(0, p.K, plan.depth)]
        return per
    out = []
    for g in range(p.groups):
        g0, g1 = g * p.block, min(p.K, (g + 1) * p.block)
        out.append([Chunk(k0, min(plan.depth, g1 - k0), g) for k0 in range(g0, g1, plan.depth)])
    return [[c for u in out for c in u]] if p.exact else out


def reach_blocks(arch: Arch, p: Problem, m0: int, mb: int, c: Chunk, nb: int, n0: int = 0) -> np.ndarray | None:
    """Which ``array`` x ``array`` blocks of the weight chunk of columns ``n0`` .. ``n0 + nb - 1``
    the activation rows ``m0`` .. ``m0 + mb - 1`` reach: the rows of blocks past the last
    weight row any of them needs multiply exact zeros (``Problem.k_reach``), the columns of
    blocks past the last output column any of them needs are dead (``Problem.n_reach``).
    None when they reach all."""
    na = arch.array
    rows = _live(p.k_reach, m0, mb, c.k0, -(-c.kc // na), na)
    cols = _live(p.n_reach, m0, mb, n0, -(-nb // na), na)
    if p.n_origin is not None and p.n_reach is not None:      # each block's own output columns
        cols = p.n_origin[n0:n0 + nb:na] < int(p.n_reach[m0:m0 + mb].max(initial=0))
    return None if rows.all() and cols.all() else rows[:, None] & cols[None, :]


def _live(reach: np.ndarray | None, m0: int, mb: int, start: int, blocks: int, na: int) -> np.ndarray:
    """Which of ``blocks`` blocks from ``start`` on rows ``m0`` .. ``m0 + mb - 1`` reach."""
    if reach is None:
        return np.ones(blocks, bool)
    return np.arange(blocks) * na < int(reach[m0:m0 + mb].max(initial=0)) - start


def dead_tile(p: Problem, m0: int, mb: int, n0: int, nb: int) -> bool:
    """Whether the output tile of columns ``n0`` .. ``n0 + nb - 1`` of rows ``m0`` .. ``m0 + mb - 1``
    is all dead."""
    if p.n_reach is None:
        return False
    need = int(p.n_reach[m0:m0 + mb].max(initial=0))
    return need <= (n0 if p.n_origin is None else int(p.n_origin[n0:n0 + nb].min()))


def weight_key(piece: int, c: Chunk, n0: int, reached: np.ndarray | None) -> tuple:
    """What a weight slot holds: a chunk of one piece and, under a causal reach
    (``reach_blocks``), how many of its rows of blocks were loaded. A slot loaded for a row
    block of a shorter reach lacks the rows past it, so it does not serve one of a longer reach
    (their bytes would be whatever the slot held before)."""
    return piece, c.k0, n0, None if reached is None else (int(reached.any(1).sum()), int(reached.any(0).sum()))


def find_weights(slots: "Slots", key: tuple) -> int | None:
    """The slot holding weight chunk ``key``, or the whole chunk (which serves any reach)."""
    s = slots.find(key)
    return s if s is not None or key[3] is None else slots.find((*key[:3], None))


def act_key(plan: Plan, block: int, c: Chunk) -> tuple:
    return (block, c.a, 0) if plan.whole_rows else (block, c.a, c.k0)


def act_keys(p: Problem, plan: Plan) -> int:
    """How many distinct activation chunks (``act_key``) the matmul reads."""
    k0s = {(c.a, 0 if plan.whole_rows else c.k0) for u in units(p, plan) for c in u}
    return len(row_blocks(p, plan)) * len(k0s)


class Homes:
    """Where forwarded activation chunks live (``Plan.forward``): the n-th chunk first needed
    is read from DRAM into Legion ``legions[n % L]``, at home slot ``n // L`` of its ``act``
    (after the slots and the zero-point row), and stays there for the whole matmul. Chunks
    past the ``slots`` homes of every Legion have none: they are read from DRAM each time."""

    def __init__(self, legions: list[int], slots: int):
        self.legions, self.slots = legions, slots
        self.at: dict = {}             # chunk key -> (Legion, home slot), or None: no home

    def home(self, key) -> tuple[tuple[int, int] | None, bool]:
        """The chunk's home, or None; and whether it was given just now (to be loaded)."""
        if key in self.at:
            return self.at[key], False
        n = len(self.at)
        self.at[key] = (self.legions[n % len(self.legions)], n // len(self.legions)) if n < self.slots * len(
            self.legions) else None
        return self.at[key], self.at[key] is not None


def home_slots(arch: Arch, p: Problem, plan: Plan, spare: int) -> int:
    """Home slots each Legion can keep for forwarded chunks: enough for every chunk, or as
    many as leave room for ``spare`` activation slots."""
    size = act_slot_elems(p, plan)
    room = (arch.derived.spad_elems["act"] - p.k2) // size - spare
    return max(0, min(-(-act_keys(p, plan) // len(owners(arch, p, plan))), room))


# Activation slots a forwarding plan keeps beside its homes: few leave the most homes (fewer
# DRAM reads), more let the sends run further ahead of the passes.
SPARE_SLOTS = (2, 4)
# A chain's row block (``Problem.row_block``) keeps at least this many. The next block's loads
# for its first passes go ahead of this block's last pass (``rowblocks._hoisted``), into slots
# that pass does not read; with fewer spares the chunk after them waits for that pass's slot,
# and the weight loads queued behind it on the DMA queue idle the arrays for a DRAM round trip
# at every block boundary, which the model, replaying one block alone, does not see (2B4T
# BitLinear stack at 256 on dlegion-8x8, loads of 3 passes hoisted: 2 or 4 spares, as the model
# picks, 291,105 cycles; 3 289,833; 4 288,794; 5 288,803). With pipelined passes
# (``pass_overlap``) the homes the spares leave out cost more in DRAM reads than the stall: the
# same stack 277,327 cycles with them, 275,437 without.
CHAIN_SPARE_SLOTS = 4


def spare_slots(arch: Arch, p: Problem) -> tuple[int, ...]:
    """The spare activation slot counts the forwarding variants of ``p``'s plans are tried with."""
    if p.row_block and not arch.pass_overlap:
        return tuple(s for s in SPARE_SLOTS if s >= CHAIN_SPARE_SLOTS)
    return SPARE_SLOTS


def forwards(arch: Arch, p: Problem, plan: Plan) -> bool:
    """Whether forwarding can apply to ``p``: activations multicast to several Legions, one
    batch (a batch's chunks would need homes of their own), and some chunk read again."""
    tiles = -(-plan.per_legion // plan.cols)
    return (plan.multicast and p.batches == 1 and len(owners(arch, p, plan)) > 1
            and tiles > 1 and act_keys(p, plan) > plan.a_slots)


def chunk_blocks(arch: Arch, p: Problem, piece: int, c: Chunk, n0: int, nb: int) -> np.ndarray | None:
    """Nonzero blocks of one weight chunk [ceil(kc/array), ceil(nb/array)], or None when
    unknown (dense: no sparsity data, or a chunk that does not start on a block edge)."""
    na = arch.array
    if not p.nonzero or c.k0 % na:
        return None
    nz = p.nonzero[piece]
    return nz[c.k0 // na: -(-(c.k0 + c.kc) // na), n0 // na: -(-(n0 + nb) // na)]


class Slots:
    """A ring of equal buffers, each holding one keyed chunk; least recently used goes first."""

    def __init__(self, count: int):
        self.free = list(range(count))
        self.held: OrderedDict = OrderedDict()        # key -> slot, least recently used first

    def find(self, key) -> int | None:
        s = self.held.get(key)
        if s is not None:
            self.held.move_to_end(key)
        return s

    def take(self, key) -> int:
        s = self.free.pop(0) if self.free else self.held.popitem(last=False)[1]
        self.held[key] = s
        return s

    def forget(self) -> None:
        """Hold nothing findable; the slots used least recently are taken first."""
        self.free += list(self.held.values())
        self.held.clear()


# --- scratchpad budget ----------------------------------------------------------------------

def widest_bits(p: Problem) -> int:
    return max(MODE_BITS[mode] for _, mode in p.weights)


def wgt_slot_bytes(p: Problem, plan: Plan) -> int:
    return plan.depth * plan.cols * widest_bits(p) // 8


def act_slot_elems(p: Problem, plan: Plan) -> int:
    return plan.rows * (p.K if plan.whole_rows else plan.depth)


# Buffers in ``vec`` besides the results: row scales (one row block each) and column vectors
# (one tile's scales and bias each). A tile's column vector loads into the slot the tile two
# before drained from, so with two slots its load waited in the in-order DMA queue for that
# drain, and the next pass's operands queued behind it (attention's last P.V at 128: its passes
# idled some 300 cycles each); the row scales likewise. Three of each: the 2B4T layer on
# dlegion-8x8 at 128 210,639 -> 209,666 cycles, at 512 788,058 -> 787,603 (a fourth of either
# moves them by less than 200 cycles, and is slower at 256 or 512).
RS_SLOTS = 3
CV_SLOTS = 3


def vec_fixed(p: Problem, plan: Plan) -> int:
    """vec elements besides the results: the row-scale and column-vector buffers."""
    return RS_SLOTS * plan.rows + CV_SLOTS * (p.groups + 1) * plan.cols


def needs(p: Problem, plan: Plan) -> dict[str, int]:
    """Elements of each scratchpad ``plan`` takes (``wgt`` in bytes, as it holds packed weights)."""
    return {"wgt": plan.w_slots * wgt_slot_bytes(p, plan),
            "act": plan.a_slots * act_slot_elems(p, plan) + p.k2 + plan.homes * act_slot_elems(p, plan),
            "acc": plan.acc_slots * plan.rows * plan.cols,
            "vec": plan.res_slots * plan.rows * plan.cols + vec_fixed(p, plan)}


def fits(arch: Arch, p: Problem, plan: Plan) -> bool:
    cap = room(arch, p)
    return all(n <= cap[space] for space, n in needs(p, plan).items())


def _most_slots(cap: int, size: int, useful: int) -> int:
    return max(0, min(cap // max(size, 1), useful))


def with_slots(arch: Arch, p: Problem, plan: Plan) -> Plan | None:
    """``plan`` with as many slots of each kind as fit and help, or None when one does not fit."""
    cap = room(arch, p)
    chunks = sum(len(u) for u in units(p, plan))
    tiles = -(-plan.per_legion // plan.cols)
    # Batches run in the same slots: the next one's chunks load into the slots left over.
    w_useful = (chunks * (1 if p.terms else len(p.weights)) + 1) * (tiles if plan.order == "rows" else 1) * p.batches
    a_chunks = 1 if plan.whole_rows else chunks
    a_useful = a_chunks * len(row_blocks(p, plan)) * p.batches + 1
    # A drain frees its accumulators at once; a store from them (exact results) frees them one
    # DRAM round trip later, which more slots hide: the slot is reused that many tiles on.
    acc_useful = tiles * len(row_blocks(p, plan)) * len(units(p, plan)) * p.batches if p.exact else 2
    homes = plan.homes if plan.forward else 0
    plan = replace(plan, homes=homes,
                   w_slots=_most_slots(cap["wgt"], wgt_slot_bytes(p, plan), max(2, w_useful)),
                   a_slots=_most_slots(cap["act"] - p.k2 - homes * act_slot_elems(p, plan), act_slot_elems(p, plan),
                                       max(2, a_useful)),
                   acc_slots=_most_slots(cap["acc"], plan.rows * plan.cols, max(2, acc_useful)),
                   res_slots=_most_slots(cap["vec"] - vec_fixed(p, plan), plan.rows * plan.cols, 2))
    if min(plan.w_slots, plan.a_slots, plan.acc_slots, plan.res_slots) < 1:
        return None
    return replace(plan, corr_depth=correction_depth(p, plan))


def correction_depth(p: Problem, plan: Plan) -> int:
    if not p.k2:
        return 0
    return max(1, min(p.k2, wgt_slot_bytes(p, plan) * 8 // (plan.cols * MODE_BITS[p.corr_mode])))


# --- candidates -----------------------------------------------------------------------------

def split_for(arch: Arch, switches: Switches) -> str:
    """K-slices over the cores when the parallel accumulators sum them for free; otherwise
    output windows over the cores, so no psum ever crosses a core (``--no-accumulators``)."""
    if arch.parallel_accumulators and arch.cores > 1 and switches.accumulators:
        return "k"
    return "n"


def _multiples(unit: int, most: int) -> list[int]:
    """unit, 2 unit, 4 unit, ... up to ``most``, and ``most`` itself rounded up to ``unit``."""
    out, v = [], unit
    while v < most:
        out.append(v)
        v *= 2
    out.append(-(-most // unit) * unit)
    return sorted(set(out))


def _even_parts(total: int, most: int) -> list[int]:
    """Sizes that cut ``total`` into 1, 2, 3, ... near-equal parts, none above ``most``."""
    out = set()
    for parts in range(1, total + 1):
        size = -(-total // parts)
        if size <= most:
            out.add(size)
        if len(out) >= 4:
            break
    return sorted(out)


def columns_per_legion(arch: Arch, p: Problem) -> int:
    """The deal: the output columns, in array-wide slices, shared out evenly over the Legions."""
    return math.ceil(p.n_pad / arch.array / len(legion_range(arch, p))) * arch.array


def skips(p: Problem, switches: Switches) -> bool:
    """Whether a plan of ``p`` leaves out blocks: zero weight blocks, or weight rows past a
    causal reach."""
    return switches.sparsity and (bool(p.nonzero) or p.k_reach is not None or p.n_reach is not None)


def tile_rows(arch: Arch, p: Problem, most: list[int]) -> list[int]:
    """The rows a tile may have: parts of ``p``'s rows, each at most one of ``most``. With
    pipelined passes (``pass_overlap``) tiles of a few rows cost the arrays hardly more than
    tiles of all of them, and the model, which times the matmul alone, may pick them; in a
    chain's row block (``Problem.row_block``) their many drains and stores then wait behind the
    row kernel's on the vector and DMA queues (2B4T BitLinear stack at 256 on dlegion-8x8 with
    ``pass_overlap``: tiles of 32 to 64 rows 297,431 cycles, of the block's 128 rows 275,766).
    There the tiles take all the block's rows where they fit."""
    rows = sorted({r for m in most for r in _even_parts(len(p.rows), m)})
    whole = [r for r in rows if r >= len(p.rows)]
    return whole if p.row_block and arch.pass_overlap and whole else rows


def candidates(arch: Arch, p: Problem, switches: Switches) -> list[Plan]:
    na, cap = arch.array, arch.derived.spad_elems
    window = na * max(MODE_TILES[m] for _, m in p.weights)
    split = split_for(arch, switches)
    per_legion = columns_per_legion(arch, p)
    group = min(p.block, p.K)
    depths = {d for d in _multiples(na * arch.cores, group) if d <= group} | {group}
    vec_room = room(arch, p)["vec"]
    out = []
    for cols in _multiples(window if window <= per_legion else na, per_legion):
        cols = min(cols, per_legion)
        if p.gated and cols % (2 * p.gated):
            continue                    # a tile of whole pairs of gate and up granules
        # Exact results are stored straight from the accumulators: tiles of half of them let
        # one slot's store overlap the other's passes.
        most = [cap["acc"] // cols] + ([cap["acc"] // cols // 2] if p.exact else [])
        # The fewest row blocks under the accumulators' bound may leave a tile's results more than
        # the vector scratchpad's room (the head groups' part of it): parts under that bound too
        # (2B4T attention's QK^T at 4096 on dlegion-8x8: 820 rows of 16 columns, room 12,288).
        most.append(max(1, vec_room // cols))
        for rows in tile_rows(arch, p, most):
            # With one row block or one column tile per Legion the two orders are the same
            # schedule, and so are both activation slot shapes when one chunk is all of K.
            one = rows >= len(p.rows) or cols >= per_legion
            for depth in sorted(depths):
                for order in ORDERS[:1] if one else ORDERS:
                    for whole in (True,) if depth >= p.K else (True, False):
                        plan = Plan(order, rows, cols, depth, whole, per_legion, 0, 0, 0, 0, split,
                                    switches.multicast, skips(p, switches))
                        out += _fitting(arch, p, plan, switches.transfers)
    return out


def _fitting(arch: Arch, p: Problem, plan: Plan, transfers: bool) -> list[Plan]:
    """``plan`` with its slots, if it fits, and then its variant that forwards activations
    over the NoC, where the plan reads some chunk from DRAM again (``forwards``) and it fits."""
    plain = with_slots(arch, p, plan)
    if plain is None or not fits(arch, p, plain):
        return []
    if not transfers or not forwards(arch, p, plain):
        return [plain]
    out = [plain]
    for homes in sorted({home_slots(arch, p, plan, spare) for spare in spare_slots(arch, p)} - {0}):
        shared = with_slots(arch, p, replace(plan, forward=True, homes=homes))
        if shared is not None and fits(arch, p, shared):
            out.append(shared)
    return out


# Schedules whose estimates are this close count as equally good. Of the equally good by the
# objective, the equally fast; of those the one that moves the fewest DRAM bytes (energy), then
# the one with the fewest instructions, as programs are held to an instruction budget.
EQUAL = 0.025
# What a schedule is chosen for: fewest cycles, fewest joules, or the least energy x delay.
OBJECTIVES = ("latency", "energy", "edp")


def choose(arch: Arch, p: Problem, switches: Switches = Switches()) -> Plan:
    """The candidate the cost model finds best for ``switches.objective`` (see ``EQUAL``)."""
    return search(arch, p, switches)[1]


def search(arch: Arch, p: Problem, switches: Switches = Switches()) -> tuple["Estimate", Plan]:
    """The chosen plan and its estimate (shared: not to be changed). Matmuls alike but for
    where their operands are (every layer of a decoder has the same ones) share one search:
    ``_search`` is cached by all that the search reads (:class:`Alike`), so sharing never
    changes a pick."""
    return _search(arch, Alike(p), switches)


# Searches kept: a model's distinct matmul shapes, for the few machines of a sweep.
SEARCHES_KEPT = 256


@lru_cache(maxsize=SEARCHES_KEPT)
def _search(arch: Arch, alike: "Alike", switches: Switches) -> tuple["Estimate", Plan]:
    """For latency, candidates are modelled in order of their compute bound, and the search
    stops where that bound rules out the rest; energy has no such bound, so every one is
    modelled."""
    p = alike.problem
    plans = candidates(arch, p, switches)
    if not plans:
        raise ValueError(f"no tiling of a {len(p.rows)}x{p.K}x{p.N} matmul fits the scratchpads of {arch.name}")
    goal = switches.objective
    scored = _fastest(arch, p, plans) if goal == "latency" else [(estimate(arch, p, plan), plan) for plan in plans]
    costs = [score(arch, p, plan, e, goal) for e, plan in scored]
    near = [(e, plan) for (e, plan), c in zip(scored, costs) if c <= min(costs) * (1 + EQUAL)]
    fastest = min(e.cycles for e, _ in near)
    return min(((e.dram_bytes, e.instructions, e.cycles), k, e, plan) for k, (e, plan) in enumerate(near)
               if e.cycles <= fastest * (1 + EQUAL))[2:]


class Alike:
    """A problem as the search sees it: equal to another when every field is, block maps by
    their bits, DRAM tensor indices up to renaming (the search only tells one tensor from
    another, as a fused matmul's segments). ``problem``: the one searched."""

    __slots__ = ("problem", "key")

    def __init__(self, p: Problem):
        self.problem = p
        names: dict = {}
        tensor = lambda t: None if t is None else names.setdefault(t, len(names))
        rscale = None if p.rscale is None else replace(p.rscale, tensor=tensor(p.rscale.tensor))
        self.key = _hashable(replace(
            p, a8=tensor(p.a8), a_pieces=tuple(tensor(t) for t in p.a_pieces), rscale=rscale,
            weights=tuple((tensor(t), mode) for t, mode in p.weights), scales=tensor(p.scales),
            bias=tensor(p.bias), corr_row=tensor(p.corr_row), corr_weight=tensor(p.corr_weight),
            out=tensor(p.out), segments=tuple(replace(s, tensor=tensor(s.tensor)) for s in p.segments),
            residual=tensor(p.residual)))

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, Alike) and self.key == other.key


def _hashable(v):
    """``v`` as nested tuples that compare by value (a Problem compares by identity, an array
    is not hashable)."""
    if isinstance(v, np.ndarray):
        return v.dtype.str, v.shape, v.tobytes()
    if isinstance(v, (tuple, list)):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, Problem):
        return tuple(_hashable(getattr(v, f.name)) for f in fields(v))
    return v


def _fastest(arch: Arch, p: Problem, plans: list[Plan]) -> list[tuple["Estimate", Plan]]:
    """The plans that may be within ``EQUAL`` of the fastest, modelled: in order of their
    compute bound, up to the first whose bound rules it out."""
    scored, best = [], math.inf
    for bound, plan in sorted(((compute_bound(arch, p, plan), plan) for plan in plans), key=lambda x: x[0]):
        if bound > best * (1 + EQUAL):
            break
        e = estimate(arch, p, plan)
        best = min(best, e.cycles)
        scored.append((e, plan))
    return scored


def score(arch: Arch, p: Problem, plan: Plan, e: "Estimate", objective: str, copies: int = 1) -> float:
    """What ``objective`` ranks schedules by: cycles, picojoules, or picojoule-cycles; of
    ``copies`` of ``p`` running alongside each other on Legions of their own, alike."""
    if objective == "latency":
        return e.cycles
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; known: {', '.join(OBJECTIVES)}")
    pj = copies * picojoules(arch, p, plan, e)
    return pj if objective == "energy" else pj * e.cycles


def picojoules(arch: Arch, p: Problem, plan: Plan, e: "Estimate") -> float:
    """The energy of a schedule by the architecture's ``[energy]`` table: its DRAM bytes, its
    MACs in the arrays (fewer where all-zero windows are skipped), and the static power of the
    Legions it runs on over its cycles. Scratchpad and vector terms, which vary little between
    schedules, are left out."""
    share = _nonzero_share(p) if plan.sparse else 1.0
    macs = sum(len(p.rows) * p.K * p.N * arch.derived.pj_per_mac[mode] for mode in products(p))
    legions = len(legion_range(arch, p)) / arch.legions
    static = arch.static_watts * legions * e.cycles / arch.clock_ghz * 1e3       # W x ns = 1e3 pJ
    return e.dram_bytes * arch.pj_per_dram_byte + macs * share * p.batches + static


def _nonzero_share(p: Problem) -> float:
    """The share of weight blocks that hold a nonzero, times the share of the weight rows the
    activation rows reach (no more is skipped: a bound on what the passes take)."""
    share = sum(float(nz.mean()) for nz in p.nonzero) / len(p.nonzero) if p.nonzero else 1.0
    share *= 1.0 if p.k_reach is None else float(np.mean(p.k_reach)) / p.K
    return share * (1.0 if p.n_reach is None else float(np.mean(p.n_reach)) / p.N)


def compute_bound(arch: Arch, p: Problem, plan: Plan) -> float:
    """The first Legion's matrix-queue time if no pass ever waited (dense passes scaled by the
    share of nonzero weight blocks, when blocks are skipped), over all batches."""
    share = _nonzero_share(p) if plan.sparse else 1.0
    total = 0
    for _, nb in legion_tiles(p, plan, legion_range(arch, p).start):
        for _, mb in row_blocks(p, plan):
            for unit in units(p, plan):
                total += sum(_mm_cycles(arch, plan, mb, c.kc, nb, p.weights[i][1], None)
                             for c in unit for i in pieces(p, c))
    return total * share * p.batches


# --- the cost model -------------------------------------------------------------------------

@dataclass
class Estimate:
    cycles: int
    dram_bytes: int
    instructions: int      # as emitted: passes, loads, stores, drains, a multicast's waits
    detail: dict = field(default_factory=dict)


def dram_rate(arch: Arch, p: Problem) -> float:
    """DRAM bytes a cycle the matmul has. One on some of the Legions (a part of its rows)
    shares DRAM with the other parts, which run alongside it with work of the same size."""
    return arch.derived.dram_bytes_per_cycle * len(legion_range(arch, p)) / arch.legions


def multicaster(p: Problem, legions: list[int]) -> int:
    """The Legion whose DMA queue issues the multicast loads: the first; for a causal QK^T
    whose columns are dealt in order the last, whose arrays the triangle leaves the fewest
    passes, so its queue holds the other Legions' passes back the least (2B4T layer on
    dlegion-8x8: at 512 799,561 -> 798,572 cycles, at 128 217,933 -> 217,880; int8x2, whose
    columns are dealt interleaved, at 512 and 256 unchanged, at 128 245,105 -> 245,155). For a
    causal P.V (``k_reach``) the last too: by head groups it runs beside the next group's QK^T,
    and from the first Legion, the one with the most QK^T passes, its multicasts took that
    Legion's DMA queue half as long again as the others' (2B4T layer: at 512 774,784 -> 769,701,
    at 256 378,660 -> 378,491, at 128 unchanged; int8x2 at 512 and 128 unchanged, at 256 436,928
    -> 436,892)."""
    causal = (p.n_reach is not None and p.n_origin is None) or p.k_reach is not None
    return legions[-1 if causal else 0]


class _Model:
    """The schedule replayed on per-Legion queue clocks (see the module docstring)."""

    def __init__(self, arch: Arch, p: Problem, plan: Plan):
        self.arch, self.p, self.plan = arch, p, plan
        self.legions = owners(arch, p, plan)
        self.lead = multicaster(p, self.legions)
        # One instruction stands for a group's Legions (qtiles emits it once, spanned).
        self.emitted = {g.base for g in groups(arch, p, plan)}
        self.lat = arch.dram_latency_cycles
        d = arch.derived
        self.link, self.dram_rate = d.link_bytes_per_cycle, dram_rate(arch, p)
        self.dma = {l: 0.0 for l in self.legions}
        self.mat = dict(self.dma)
        self.vec = dict(self.dma)
        self.bytes = 0
        self.noc_bytes = 0
        self.instructions = 0

    def loads(self, flows: list) -> list[float]:
        """Transfers issued together, each (issuer, bytes, free): when each one's data is there.
        DRAM shares its rate fairly among the flows, each at most at the link rate, so a flow of
        b bytes is done once DRAM has moved min(b, b_i) of every flow i."""
        sizes = [n for _, n, _ in flows]
        out = []
        for issuer, nbytes, free in flows:
            served = sum(min(nbytes, n) for n in sizes)
            start = max(self.dma[issuer], free)
            self.dma[issuer] = start + max(nbytes / self.link, served / self.dram_rate)
            self.bytes += nbytes
            self.instructions += issuer in self.emitted
            out.append(self.dma[issuer] + self.lat)
        return out

    def send(self, issuer: int, nbytes: int, free: float) -> float:
        """A ``noc.mv`` of ``nbytes`` from ``issuer`` once ``free``: it holds the issuer's DMA
        queue while its link sends them (once for every receiver); when they are there."""
        self.dma[issuer] = max(self.dma[issuer], free) + nbytes / self.link
        self.noc_bytes += nbytes
        self.instructions += 1
        return self.dma[issuer]


# Batches modelled one by one; the rest are taken to cost what the last one modelled did.
MODELLED_BATCHES = 3


def estimate(arch: Arch, p: Problem, plan: Plan) -> Estimate:
    """The cost model's figures for ``plan``; of all ``p.batches`` batches."""
    runs = _estimates(arch, p, plan, min(p.batches, MODELLED_BATCHES))
    if p.batches <= MODELLED_BATCHES:
        return runs[-1]
    last, before = runs[-1], runs[-2]
    more = p.batches - MODELLED_BATCHES
    nbytes = last.dram_bytes + more * (last.dram_bytes - before.dram_bytes)
    cycles = max(last.cycles + more * (last.cycles - before.cycles), math.ceil(nbytes / dram_rate(arch, p)))
    return Estimate(cycles, nbytes, last.instructions + more * (last.instructions - before.instructions),
                    last.detail)


def _estimates(arch: Arch, p: Problem, plan: Plan, batches: int) -> list[Estimate]:
    """The estimate of the first 1, 2, ... ``batches`` batches, from one replay."""
    m = _Model(arch, p, plan)
    tiles = {l: legion_tiles(p, plan, l) for l in m.legions}
    count = max(len(t) for t in tiles.values())
    st = _State(m, plan)
    order = tile_order(p, plan, count)
    last = {l: last_visit(order, len(tiles[l])) for l in m.legions}
    final = len(units(p, plan)) - 1
    out = []
    for batch in range(batches):
        if batch:
            st.forget()
        _model_batch(m, st, tiles, order, last, final)
        out.append(_ended(m, st, _vector_loads(p, plan, tiles, m.emitted) * (batch + 1)))
    return out


def _ended(m: _Model, st: _State, vector_loads: int) -> Estimate:
    """The estimate if the schedule ended here: the pending stores issued. The replay itself
    goes on where it was (the stores stay pending: ``_model_stores`` replaces a Legion's list
    of them, so a shallow copy of the dict keeps them)."""
    saved = (dict(m.dma), m.bytes, m.instructions, dict(st.acc_free), dict(st.res_free), dict(st.stores), st.finish)
    for l in m.legions:
        _model_stores(m, st, l)
    floor = m.bytes / m.dram_rate
    e = Estimate(math.ceil(max(st.finish, floor)), m.bytes, m.instructions + vector_loads,
                 {"dram_floor": floor, "finish": st.finish, "noc_bytes": m.noc_bytes})
    m.dma, m.bytes, m.instructions, st.acc_free, st.res_free, st.stores, st.finish = saved
    return e


def _model_batch(m: _Model, st: _State, tiles: dict, order: list, last: dict, final: int) -> None:
    """One batch's tiles in ``order`` (``last``: each Legion's last; ``final``: the last unit)."""
    p, plan = m.p, m.plan
    blocks = row_blocks(p, plan)
    for k, (b, t, backwards) in enumerate(order):
        m0, mb = blocks[b]
        here = [l for l in m.legions
                if t < len(tiles[l]) and not (plan.sparse and dead_tile(p, m0, mb, *tiles[l][t]))]
        for u, unit in enumerate(units(p, plan)):
            acc = {l: st.next("acc", l) for l in here}
            begin = {l: st.acc_free[(l, acc[l])] for l in here}
            for i, c in enumerate(in_order(unit, backwards)):
                _model_chunk(m, st, b, t, c, here, tiles, begin, acc if p.exact and i == 0 else None)
            for l in here:
                if u == 0 and not p.exact:
                    _model_stores(m, st, l)       # the previous tile's store, as the emitter places it
                _model_unit_end(m, st, l, mb, tiles[l][t][1], acc[l], begin[l], u == final)
        for l in here:
            _model_tile_end(m, st, l, mb, tiles[l][t], acc[l], last[l] == k)


def _vector_loads(p: Problem, plan: Plan, tiles: dict, emitted: set) -> int:
    """Instructions of the row-scale loads (and the vector op that turns each into the drain's
    multiplier) and of the column-vector loads, as qtiles emits them."""
    per_tile = 0 if p.exact else (p.scales is not None) + (p.bias is not None)
    rs, cv = Slots(RS_SLOTS), {l: Slots(CV_SLOTS) for l in emitted}
    loaders = 1 if plan.multicast else len(emitted)
    ops = len(emitted) if p.rscale is not None and p.rscale.op != "mov" else 0
    n = 0
    for b, t, _ in tile_order(p, plan, max(len(x) for x in tiles.values())):
        if p.rscale is not None and rs.find(b) is None:
            rs.take(b)
            n += loaders + ops
        for l in emitted:
            if t < len(tiles[l]) and cv[l].find(tiles[l][t][0]) is None:
                cv[l].take(tiles[l][t][0])
                n += per_tile
    return n


class _State:
    """What the model tracks of the slots: which chunk each holds, when it is ready and free."""

    def __init__(self, m: _Model, plan: Plan):
        who = [None] if plan.multicast else m.legions
        self.a = {w: Slots(plan.a_slots) for w in who}
        self.w = {l: Slots(plan.w_slots) for l in m.legions}
        self.ready: dict = {}
        self.free: dict = {}
        self.acc_free = {(l, s): 0.0 for l in m.legions for s in range(plan.acc_slots)}
        self.res_free = {(l, s): 0.0 for l in m.legions for s in range(plan.res_slots)}
        self.turn: dict = {}
        self.homes = Homes(m.legions, plan.homes)
        self.home_ready: dict = {}    # chunk key -> when its copy is home
        self.uncopied: dict = {}      # act slot -> (chunk key, its home, when it is in the slot)
        self.slots = {"acc": plan.acc_slots, "res": plan.res_slots}
        self.stores: dict = {l: [] for l in m.legions}     # deferred: (ready, bytes, slot)
        self.finish = 0.0

    def forget(self) -> None:
        """The next batch: what the slots hold is no longer wanted (``qtiles``' ``next_problem``)."""
        for ring in (*self.a.values(), *self.w.values()):
            ring.forget()

    def next(self, kind: str, l: int) -> int:
        n = self.turn.get((kind, l), 0)
        self.turn[(kind, l)] = n + 1
        return n % self.slots[kind]


def _model_chunk(m: _Model, st: _State, b: int, t: int, c: Chunk, here: list, tiles: dict, begin: dict,
                 acc: dict | None = None) -> None:
    """Chunk ``c`` of tile ``t`` in row block ``b``: its loads, then its passes. Given the
    tile's accumulator slots ``acc`` (its first chunk, exact results), a store pending from
    one of them goes out between the two, as the emitter places it (``acc_readers``)."""
    p, plan = m.p, m.plan
    # Forwarded activations are sent after the chunk's weight loads are issued (as the emitter
    # places them): a send that waits for its slot then holds up no weight load behind it.
    a_slot = None if plan.forward else _model_activations(m, st, b, c, here)
    m0, mb = row_blocks(p, plan)[b]
    flows, where, work = [], [], []
    for l in here:
        n0, nb = tiles[l][t]
        for i in pieces(p, c):
            mode = p.weights[i][1]
            nz = chunk_blocks(m.arch, p, i, c, n0, nb) if plan.sparse else None
            reached = reach_blocks(m.arch, p, m0, mb, c, nb, n0) if plan.sparse else None
            if reached is not None:
                nz = reached if nz is None else nz & reached
            if nz is not None and not nz.any():
                continue
            key_w = weight_key(i, c, n0, reached)
            s = find_weights(st.w[l], key_w)
            if s is None:
                first = not st.w[l].held
                s = st.w[l].take(key_w)
                free = st.free.get(("w", l, s), 0.0)
                if weights_wait(plan, first, len(m.legions), nb, mode):
                    free = max(free, st.ready[("a", *a_slot[l])])
                flows.append((l, _loaded_bytes(m.arch, c.kc, nb, mode, nz), free))
                where.append(("w", l, s))
            work.append((l, s, _mm_cycles(m.arch, plan, mb, c.kc, nb, mode, nz)))
    for key_r, ready in zip(where, m.loads(flows)):
        st.ready[key_r] = ready
    if a_slot is None:
        a_slot = _model_activations(m, st, b, c, here)
    for l in here if acc is not None else ():
        # As the emitter places it: after the loads of the tile that reuses its slot.
        if any(slot == acc[l] for _, _, slot in st.stores[l]):
            _model_stores(m, st, l)
            begin[l] = st.acc_free[(l, acc[l])]
    lead = weight_lead(m.arch, 1)
    for l, s, cycles in work:
        owner, sa = a_slot[l]
        ready = max(begin[l], st.ready[("a", owner, sa)], st.ready[("w", l, s)])
        m.mat[l] = max(m.mat[l], ready + lead) + cycles
        m.instructions += l in m.emitted
        st.free[("w", l, s)] = m.mat[l]
        st.free[("a", owner, sa, l)] = m.mat[l]


def _model_activations(m: _Model, st: _State, b: int, c: Chunk, here: list) -> dict:
    """Load chunk ``c`` of row block ``b`` where it is not in a slot; each Legion's slot."""
    p, plan = m.p, m.plan
    mb = row_blocks(p, plan)[b][1]
    width = p.K if plan.whole_rows else c.kc
    key = act_key(plan, b, c)
    flows, where, a_slot = [], [], {}
    for owner, slots in st.a.items():
        if owner is not None and owner not in here:
            continue
        s = slots.find(key)
        users = m.legions if owner is None else [owner]
        if s is None:
            s = slots.take(key)
            if ("a", owner, s, users[-1]) in st.free:
                m.instructions += len(users) - 1     # a wait for each reader's matrix queue
            free = max([st.free.get(("a", owner, s, l), 0.0) for l in users] + [_model_copy_home(m, st, s)])
            home, new = st.homes.home(key) if plan.forward else (None, False)
            if home is not None and not new:
                st.ready[("a", owner, s)] = m.send(home[0], mb * width, max(free, st.home_ready[key]))
            else:
                flows.append((m.lead if owner is None else owner, mb * width, free))
                where.append(("a", owner, s))
        a_slot |= {l: (owner, s) for l in users}
    for key_r, ready in zip(where, m.loads(flows)):
        st.ready[key_r] = ready
        home, _ = st.homes.home(key) if plan.forward else (None, False)
        if home is not None and key not in st.home_ready:
            st.uncopied[key_r[2]] = (key, home, ready, mb * width)
    return a_slot


def _model_copy_home(m: _Model, st: _State, s: int) -> float:
    """A chunk read from DRAM on its first visit is copied home before its slot ``s`` is
    reused (``qtiles._copy_home``); when the copy is done (0 without one)."""
    if s not in st.uncopied:
        return 0.0
    key, home, ready, nbytes = st.uncopied.pop(s)
    st.home_ready[key] = m.send(home[0], nbytes, ready)
    return st.home_ready[key]


def _model_unit_end(m: _Model, st: _State, l: int, mb: int, nb: int, acc: int, begin: float,
                    last: bool) -> None:
    """Correction passes, then the drain, unless the unit is the tile's ``last`` (drained with
    the tile's store, ``_model_tile_end``)."""
    p, plan = m.p, m.plan
    m.mat[l] = max(m.mat[l], begin)
    if p.corr_row is not None:
        m.mat[l] += -(-p.k2 // max(plan.corr_depth, 1)) * pass_cycles(m.arch, mb, 1)
    if p.exact:
        st.acc_free[(l, acc)] = m.mat[l]
    elif not last:
        _model_drain(m, st, l, mb * nb, acc)


def _model_drain(m: _Model, st: _State, l: int, elems: int, acc: int) -> None:
    """A drain into the current result slot; the accumulators are free after it."""
    res = _res_slot(m, st, l)
    start = max(m.vec[l], m.mat[l], st.res_free[(l, res)] + _residual_load(m, elems))
    m.vec[l] = start + -(-elems // m.arch.vector_lanes)
    m.instructions += l in m.emitted
    st.acc_free[(l, acc)] = m.vec[l]


def _residual_load(m: _Model, elems: int) -> float:
    """Cycles from a result slot's last store to its residual rows in it (none without one):
    the load waits for the store, every Legion loading alike."""
    if m.p.residual is None:
        return 0.0
    nbytes = elems * 4
    return max(nbytes / m.link, nbytes * len(m.legions) / m.dram_rate) + m.lat


def _res_slot(m: _Model, st: _State, l: int) -> int:
    """The result slot of Legion ``l``'s current tile (``st.next`` moves on to the next)."""
    return st.turn.get(("res", l), 0) % m.plan.res_slots


def _model_tile_end(m: _Model, st: _State, l: int, mb: int, tile: tuple, acc: int, final: bool) -> None:
    """The last unit's drain, requantization and the store, by row pieces in the Legion's
    ``final`` tile; the stores are issued later (see ``_model_stores``)."""
    p = m.p
    n0, nb = tile
    cols = sum(piece[3] for piece in stores(p, m.plan, l, n0, nb))
    slot = acc if p.exact else _res_slot(m, st, l)
    for rows in tail_pieces(p, mb, final):
        if not p.exact:
            _model_drain(m, st, l, len(rows) * nb, acc)
        if p.requant is not None:
            m.vec[l] += 4 * -(-len(rows) * nb // m.arch.vector_lanes)
        m.vec[l] += gated_ops(p) * -(-len(rows) * nb // 2 // m.arch.vector_lanes)
        if p.residual is not None:          # its rows loaded into the result slot, the drain adds
            m.bytes += len(rows) * cols * 4
        ready = m.mat[l] if p.exact else m.vec[l]
        st.stores[l].append((ready, len(rows) * cols * 4, slot))
    if not p.exact:
        st.next("res", l)


def _model_stores(m: _Model, st: _State, l: int) -> None:
    for ready, nbytes, slot in st.stores[l]:
        start = max(m.dma[l], ready)
        # Every Legion stores its tile alike, at about the same time: they share DRAM.
        m.dma[l] = start + max(nbytes / m.link, nbytes * len(m.legions) / m.dram_rate)
        m.bytes += nbytes
        m.instructions += l in m.emitted
        done = m.dma[l] + m.lat
        (st.acc_free if m.p.exact else st.res_free)[(l, slot)] = done
        st.finish = max(st.finish, done)
    st.stores[l] = []


def _loaded_bytes(arch: Arch, kc: int, nb: int, mode: str, nz: np.ndarray | None) -> int:
    bits = MODE_BITS[mode]
    if nz is None:
        return kc * nb * bits // 8
    na = arch.array
    rows = np.minimum(na, kc - np.arange(nz.shape[0]) * na)
    cols = np.minimum(na, nb - np.arange(nz.shape[1]) * na)
    return int(rows @ nz.astype(np.int64) @ cols) * bits // 8


def _mm_cycles(arch: Arch, plan: Plan, M: int, K: int, N: int, mode: str, nz: np.ndarray | None) -> int:
    kreduce = plan.split == "k" and arch.parallel_accumulators
    blocks = None if nz is None or nz.all() else Blocks.from_mask(nz)
    s = block_stats(K, N, arch.array, MODE_TILES[mode], arch.cores, plan.split, kreduce, blocks)
    return pass_cycles(arch, M, s.passes_max)
