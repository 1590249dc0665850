"""Float matrix products (MatMul, Gemm) in fp32 on the vector unit (``vmm``).

Graphs keep activation x activation products (QK^T, PV) and unquantized heads in float; ONNX
semantics ask for fp32, so they run on the vector lanes, not the int8 systolic arrays.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from isa.fields import DramRef, View
from isa.instructions import BY_MNEMONIC, DmaLoad, DmaStore, VMatMul
from dlegion_cc.lower import carry
from dlegion_cc.lower.context import Lowering, lowers
from dlegion_cc.lower.emitter import Emitter
from dlegion_cc.lower.layout import Operand, broadcast, outer_indices, reshaped
from dlegion_cc.lower.rowwise import Arg, rowwise
from dlegion_cc.passes.causal import reach

TILE = 64       # rows and columns of an output block, before the scratchpad limits them
# A block the causal mask cuts through is computed in this many strips of rows, each only as
# wide (QK^T) or as deep (P.V) as its rows reach: the lanes skip half of the masked triangle,
# and a block costs up to this many products, sums and stores instead of one. (2B4T at 512 on
# dlegion-8x8: 1 strip 3,880,331 cycles in 18,400 instructions, 2 strips 3,797,798 in 18,710,
# 4 strips 3,756,478 in 19,330 of the 20,000 the program may have.)
STRIPS = 2


def _load_matrix(em: Emitter, legion: int, addr: int, op: Operand, r0: int, c0: int,
                 rows: int, cols: int, lstride: int | None = None) -> tuple[View, list]:
    """Load op[r0:r0+rows, c0:c0+cols] into a row-major block at ``addr``; transposed
    sources (unit row stride) are turned around by the scratchpad view. Also returns the
    stores of a concat's copy the load carries (``carry.load``), to issue once it has landed."""
    rs, cs = op.strides[-2:]
    base = op.offset + r0 * rs + c0 * cs
    dests = frozenset({legion})
    if cs in (0, 1) and not (cs == 0 and cols > 1):
        i = DmaLoad(legion, dests, View("vec", addr, cols, 1), DramRef(op.tensor, base, rs), rows, cols,
                    lstride=lstride)
    elif rs in (0, 1) and not (rs == 0 and rows > 1):
        i = DmaLoad(legion, dests, View("vec", addr, 1, cols), DramRef(op.tensor, base, cs), cols, rows,
                    lstride=lstride)
    else:
        raise ValueError("a matrix operand with neither unit row nor unit column stride")
    return View("vec", addr, cols, 1), carry.load(em, i)


@dataclass(frozen=True)
class Layout:
    """A float matmul's blocks in a Legion's vector scratchpad: ``buffers`` output blocks of
    ``mb`` x ``nb`` (two: one block's store reads one while the next block sums into the other),
    a product buffer, and ``buffers`` buffers of one K-chunk's a and b, ``size`` rows of b each
    (two: the next chunk loads while the current one multiplies, the next block's first chunk
    too)."""

    mb: int
    nb: int
    size: int
    buffers: int

    def out(self, block: int) -> int:
        return (block % self.buffers) * self.mb * self.nb

    @property
    def tmp(self) -> int:
        return self.buffers * self.mb * self.nb

    def chunk(self, j: int) -> int:
        """Where chunk ``j`` of the stream puts its a and b."""
        return (self.buffers + 1) * self.mb * self.nb + (j % self.buffers) * (self.mb + self.nb) * self.size


def _layout(em: Emitter, M: int, K: int, N: int) -> Layout:
    """Two of everything where a chunk of at least one row fits; a long K in chunks of whole row
    blocks, so a causal P skips all the K its rows do not reach (the chunks do not depend on the
    skips: with or without them the sums are the same, bit for bit)."""
    cap = em.capacity("vec")
    mb, nb = min(M, TILE), min(N, TILE)
    room = (cap - 3 * mb * nb) // (2 * (mb + nb))
    if room >= 1:
        return Layout(mb, nb, min(K, room // mb * mb or room), 2)
    room = (cap - 2 * mb * nb) // (mb + nb)
    if room < 1:
        raise ValueError(f"a {mb}x{nb} output block and one step of K need {2 * mb * nb + mb + nb} vector "
                         f"scratchpad elements, more than its {cap}")
    return Layout(mb, nb, min(K, room), 1)


@dataclass(frozen=True)
class Skip:
    """Work a matmul may leave out (marked by ``passes/causal.py``): ``dead`` [M, N] outputs
    nothing looks at, ``zero_a`` [M, K] entries of the left operand that are exact zeros."""

    dead: np.ndarray | None = None
    zero_a: np.ndarray | None = None

    def block(self, m0: int, m: int, n0: int, n: int) -> bool:
        return self.dead is not None and bool(self.dead[m0:m0 + m, n0:n0 + n].all())

    def chunk(self, m0: int, m: int, k0: int, k: int) -> bool:
        return self.zero_a is not None and bool(self.zero_a[m0:m0 + m, k0:k0 + k].all())

    @property
    def any(self) -> bool:
        return self.dead is not None or self.zero_a is not None

    def columns(self, m0: int, m: int, n0: int, n: int) -> int:
        """How many of the block's columns its rows need: up to the last one not wholly dead."""
        return _block_reach(self.dead, m0, m, n0, n)

    def depth(self, m0: int, m: int, k0: int, k: int) -> int:
        """How many of a chunk's K rows the block's rows need: up to the last not wholly zero."""
        return _block_reach(self.zero_a, m0, m, k0, k)


def _block_reach(mask: np.ndarray | None, r0: int, rows: int, c0: int, cols: int) -> int:
    return cols if mask is None else int(reach(~mask[r0:r0 + rows, c0:c0 + cols].all(axis=0)))


NO_SKIP = Skip()


def matmul_blocks(em: Emitter, a: Operand, b: Operand, out: Operand, M: int, K: int, N: int,
                  skip: Skip = NO_SKIP, span: tuple[int, tuple] | None = None) -> None:
    """out[M, N] = a[M, K] @ b[K, N] for 2-D operands (strided views).

    With ``span`` = (Legions, DRAM steps of a, b, out), the same product for that many
    matrices one step apart runs on a span of Legions (the heads of attention), block by block.
    Otherwise equal output blocks go to spans of Legions along the rows or the columns of
    ``out``, whichever has more of them, unless blocks are skipped, which differ from block to
    block."""
    lay = _layout(em, M, K, N)
    mb, nb = lay.mb, lay.nb
    streams = _Streams(em, lay)
    if span is not None or skip.any:
        count, step = span or (1, (0, 0, 0))
        for m0 in range(0, M, mb):
            for n0 in range(0, N, nb):
                m, n = min(mb, M - m0), min(nb, N - n0)
                if not skip.block(m0, m, n0, n):
                    streams.add(_job(em, lay, a, b, out, m0, n0, m, K, n, count, step, skip), count)
                else:
                    em.skipped["causal_skipped_blocks"] += count
                    em.skipped["causal_skipped_macs"] += count * m * K * n
    elif M // mb > N // nb:
        for n0 in range(0, N, nb):
            for m0, m, count in _runs(M, mb, em.arch.legions):
                step = (m * a.strides[-2], 0, m * out.strides[-2])
                streams.add(_job(em, lay, a, b, out, m0, n0, m, K, min(nb, N - n0), count, step), count)
    else:
        for m0 in range(0, M, mb):
            for n0, n, count in _runs(N, nb, em.arch.legions):
                step = (0, n * b.strides[-1], n * out.strides[-1])
                streams.add(_job(em, lay, a, b, out, m0, n0, min(mb, M - m0), K, n, count, step), count)
    streams.flush()


def _runs(size: int, block: int, legions: int):
    """(start, block, blocks) of each run: full blocks by up to ``legions``, then the last one."""
    full = size // block
    for j in range(0, full, legions):
        yield j * block, block, min(legions, full - j)
    if size % block:
        yield full * block, size % block, 1


@dataclass(frozen=True)
class _Job:
    """The m x n output block at (m0, n0), and on each further Legion of its span the one
    ``steps`` = (a, b, out) DRAM elements further on; ``chunks``: the K offsets it sums."""

    a: Operand
    b: Operand
    out: Operand
    m0: int
    n0: int
    m: int
    n: int
    K: int
    chunks: tuple
    steps: tuple
    skip: Skip = NO_SKIP


def _job(em, lay: Layout, a, b, out, m0, n0, m, K, n, count, step, skip: Skip = NO_SKIP) -> _Job:
    """A block's job; K-chunks whose rows of ``a`` are all zero are left out (the first is kept
    when all are: it zeroes the block)."""
    chunks = [k0 for k0 in range(0, K, lay.size) if not skip.chunk(m0, m, k0, min(lay.size, K - k0))] or [0]
    kept = sum(min(lay.size, K - k0) for k0 in chunks)
    if kept < K:
        em.skipped["causal_skipped_macs"] += count * m * (K - kept) * n
    return _Job(a, b, out, m0, n0, m, n, K, tuple(chunks), tuple(s if count > 1 else None for s in step), skip)


@dataclass(frozen=True)
class _Strip:
    """Rows ``r0`` .. ``r0 + rows - 1`` of a block: ``n`` columns of it from ``k`` K rows of a chunk."""

    r0: int
    rows: int
    n: int
    k: int


def _strips(job: _Job, k0: int, k: int, first: bool) -> list[_Strip]:
    """The strips of rows the product of K rows ``k0 .. k0 + k - 1`` of ``job``'s block is cut
    into: one strip where the skips cut nothing. Columns nothing looks at are left out (not
    stored: the DRAM result keeps its zeros there, as under a skipped block), and so are K rows
    whose activations are exact zeros, whose products add nothing. A strip left no K rows in a
    block's first chunk still computes them all: that product sets the block's result."""
    if not job.skip.any:
        return [_Strip(0, job.m, job.n, k)]
    size, out = -(-job.m // STRIPS), []     # the same rows and columns in every chunk
    for r0 in range(0, job.m, size):
        rows = min(size, job.m - r0)
        n = job.skip.columns(job.m0 + r0, rows, job.n0, job.n)
        depth = job.skip.depth(job.m0 + r0, rows, k0, k) or (k if first else 0)
        if n and depth:
            if out and (out[-1].n, out[-1].k) == (n, depth) and out[-1].r0 + out[-1].rows == r0:
                out[-1] = _Strip(out[-1].r0, out[-1].rows + rows, n, depth)
            else:
                out.append(_Strip(r0, rows, n, depth))
    return out


def _stored(job: _Job) -> list[_Strip]:
    """The strips of a block its store writes: each as wide as its rows reach."""
    return _strips(job, 0, 1, first=True)


def _rows(v: View, r0: int) -> View:
    return View(v.space, v.addr + r0 * v.rs, v.rs, v.cs)


@dataclass(frozen=True)
class _Chunk:
    """Chunk ``j`` of a stream: K rows ``k`` of ``job``'s block number ``block``, loaded to
    ``a`` and ``b``."""

    job: _Job
    j: int
    block: int
    first: bool
    last: bool
    a: View
    b: View
    k0: int
    k: int


class _Streams:
    """The open streams, one per span of Legions: a block on Legions an open stream of another
    span uses closes that one first (they would share scratchpad buffers)."""

    def __init__(self, em: Emitter, lay: Layout, defer: bool = False):
        self.em, self.lay, self.open, self.defer = em, lay, {}, defer

    def add(self, job: _Job, count: int) -> None:
        legion = self.em.take_legions(count)
        here = set(range(legion, legion + count))
        for key in [k for k in self.open if k != (legion, count) and here & set(range(k[0], k[0] + k[1]))]:
            self.open.pop(key).flush()
        self.open.setdefault((legion, count), _Stream(self.em, self.lay, legion, count, self.defer)).add(job)

    def flush(self) -> None:
        for stream in self.open.values():
            stream.flush()
        self.open.clear()


class _Stream:
    """Consecutive blocks on one span of Legions as one stream of K-chunks: each chunk's loads
    are issued before the product of the chunk before it, across blocks too. Each Legion loads
    its own tiles: a multicast would have to wait for every Legion of the span to be done with
    the previous tile, which one condition cannot say."""

    def __init__(self, em: Emitter, lay: Layout, legion: int, count: int, defer: bool = False):
        self.em, self.lay, self.legion, self.count = em, lay, legion, count
        # Stores of a block's result issued after the next chunk's loads, not before them: the
        # DMA queue then runs its loads ahead while the product the store waits for runs.
        self.defer, self.results = defer, None      # (vec count they wait for, the stores)
        self.loaded, self.done, self.stored = [], [], []   # DMA/vec/DMA counts after each chunk/product/block
        self.blocks = 0
        self.pending: _Chunk | None = None
        self.carried: tuple[int, list] | None = None     # (DMA count once they may go, the stores)

    def add(self, job: _Job) -> None:
        with self.em.spanning(self.legion, self.count):
            block, self.blocks = self.blocks, self.blocks + 1
            for k0 in job.chunks:
                item = self._load(job, k0, block, k0 == job.chunks[0], k0 == job.chunks[-1])
                if self.lay.buffers == 1:
                    self._product(item)
                    continue
                if self.pending is not None:
                    self._product(self.pending)
                self.pending = item

    def flush(self) -> None:
        with self.em.spanning(self.legion, self.count):
            if self.pending is not None:
                self._product(self.pending)
            self._store_results()
            self._store_carried()
        self.pending = None

    def _store_carried(self) -> None:
        """Issue the carried stores of the chunk before (``carry``): after the next chunk's
        loads, so the DMA queue streams on while the earlier loads land; the buffer they read
        is loaded again only after them, on the same queue."""
        if self.carried is None:
            return
        upto, stores = self.carried
        self.carried = None
        self.em.depend((self.legion, "dma"), (self.legion, "dma"), upto=upto)
        for i in stores:
            self.em.emit(i)

    def _load(self, job: _Job, k0: int, block: int, first: bool, last: bool) -> "_Chunk":
        em, lay, legion, j = self.em, self.lay, self.legion, len(self.loaded)
        if j >= lay.buffers:                # its buffer is free once chunk j - buffers is multiplied
            em.depend((legion, "vec"), (legion, "dma"), upto=self.done[j - lay.buffers])
        k, at = min(lay.size, job.K - k0), lay.chunk(j)
        if lay.buffers == 1:             # the next load overwrites what the stores read
            self._store_carried()
        va, sa = _load_matrix(em, legion, at, job.a, job.m0, k0, job.m, k, lstride=job.steps[0])
        vb, sb = _load_matrix(em, legion, at + job.m * k, job.b, k0, job.n0, k, job.n, lstride=job.steps[1])
        self.loaded.append(em.issued[(legion, "dma")])
        self._store_results()
        self._store_carried()
        if sa or sb:
            self.carried = (self.loaded[-1], sa + sb)
        return _Chunk(job, j, block, first, last, va, vb, k0, k)

    def _product(self, c: "_Chunk") -> None:
        """A chunk's product, summed into its block's result; the block's store after its last."""
        em, lay, legion = self.em, self.lay, self.legion
        job, block, first = c.job, c.block, c.first
        need = self.loaded[c.j]
        if first and block >= lay.buffers:   # its result buffer is free once that block is stored
            need = max(need, self.stored[block - lay.buffers])
        em.depend((legion, "dma"), (legion, "vec"), upto=need)
        o, tmp = View("vec", lay.out(block), job.n, 1), View("vec", lay.tmp, job.n, 1)
        strips = _strips(job, c.k0, c.k, first)
        for s in strips:
            dst = _rows(o if first else tmp, s.r0)
            em.emit(VMatMul(legion, dst, _rows(c.a, s.r0), c.b, s.rows, s.k, s.n))
            if not first:
                em.emit(BY_MNEMONIC["vadd"](legion, _rows(o, s.r0), _rows(o, s.r0), dst, s.rows, s.n))
        left_out = job.m * c.k * job.n - sum(s.rows * s.k * s.n for s in strips)
        if left_out:
            em.skipped["causal_skipped_macs"] += self.count * left_out
        self.done.append(em.issued[(legion, "vec")])
        if c.last:
            self._store_results()          # a block before it no load came after (at a flush)
            rs = job.out.strides[-2]
            self.results = (em.issued[(legion, "vec")], [
                DmaStore(legion, DramRef(job.out.tensor, job.out.offset + (job.m0 + s.r0) * rs + job.n0, rs),
                         _rows(o, s.r0), s.rows, s.n, lstride=job.steps[2]) for s in _stored(job)])
            if not self.defer:
                self._store_results()

    def _store_results(self) -> None:
        """Issue the stores of the last block's result, once its last product is done."""
        if self.results is None:
            return
        upto, stores = self.results
        self.results = None
        self.em.depend((self.legion, "vec"), (self.legion, "dma"), upto=upto)
        for i in stores:
            self.em.emit(i)
        self.stored.append(self.em.issued[(self.legion, "dma")])


def _as_matrix(low: Lowering, name: str, batch: tuple[int, ...], vector_as_row: bool):
    """The operand as [*batch, rows, cols] strides (1-D operands become a row or a column)."""
    shape, op = low.shape(name), low.operand(name)
    if len(shape) == 1:
        shape = (1, shape[0]) if vector_as_row else (shape[0], 1)
        op = Operand(op.tensor, op.offset, (0, op.strides[0]) if vector_as_row else (op.strides[0], 0))
    return _batched(op, shape, batch), shape[-2:]


def matrix_view(node, name: str, op: Operand) -> bool:
    """A matrix operand loads by rows or by columns: one of its last two strides is 1."""
    return 1 in op.strides[-2:]


def _batched(op: Operand, shape, batch) -> Operand:
    lead = broadcast(Operand(op.tensor, op.offset, op.strides[:-2]), shape[:-2], batch)
    return Operand(op.tensor, op.offset, lead.strides + op.strides[-2:])


def row_major_out(node, name: str, op: Operand) -> bool:
    """Output blocks are stored by rows: consecutive elements along the last dimension."""
    return bool(op.strides) and op.strides[-1] == 1


@lowers("MatMul", views=matrix_view, writes=row_major_out)
def matmul(low: Lowering, node) -> None:
    a_name, b_name = node.inputs
    a_shape, b_shape = low.shape(a_name), low.shape(b_name)
    batch = _batch_shape(a_shape, b_shape)
    a, (M, K) = _as_matrix(low, a_name, batch, vector_as_row=True)
    b, (_, N) = _as_matrix(low, b_name, batch, vector_as_row=False)
    name = node.outputs[0]
    # The output may be strided (its part of a concat, heads merged in place): its operand
    # read as [*batch, M, N], a vector operand's dimension put back.
    out = reshaped(low.result(name), low.shape(name), batch + (M, N))
    skip = Skip(node.attrs.get("dead"), node.attrs.get("zero_a"))
    if not batch or batch[-1] == 1:
        for idx in outer_indices(batch + (1, 1)):
            matmul_blocks(low.em, a.at(idx), b.at(idx), out.at(idx), M, K, N, skip)
        return
    if _spread(low.em, M, K, N, batch[-1], skip):
        for idx in outer_indices(batch[:-1] + (1, 1)):
            spread_heads(low.em, a, b, out, idx, M, K, N, batch[-1])
        return
    # The innermost batch dimension (attention's heads) goes to spans of Legions.
    inner = len(batch) - 1
    step = (a.strides[inner], b.strides[inner], out.strides[inner])
    for idx in outer_indices(batch[:-1] + (1, 1)):
        for h0, _, count in _runs(batch[-1], 1, low.em.arch.legions):
            at = idx + (h0,)
            matmul_blocks(low.em, a.at(at), b.at(at), out.at(at), M, K, N, skip, (count, step))


def _spread(em: Emitter, M: int, K: int, N: int, heads: int, skip: Skip) -> bool:
    """Whether a batched product goes to Legions by parts of its heads' columns: fewer heads
    than Legions and rows that fit one block (a decode step's few query rows per key/value head),
    where a span of one Legion per head would leave the others idle for the whole product.
    Not when a head's product takes the lanes less time than a DRAM round trip, which each part
    of it pays again (a first token's P.V, one key deep): the others then idle for less than
    the parts would cost, and the heads' products are one instruction of each kind, not one
    per part."""
    lanes_cycles = M * K * N / em.arch.vector_lanes
    return heads < em.arch.legions and M <= TILE and not skip.any and lanes_cycles > em.arch.dram_latency_cycles


def spread_heads(em: Emitter, a: Operand, b: Operand, out: Operand, idx: tuple, M: int, K: int, N: int,
                 heads: int) -> None:
    """out[h] = a[h] @ b[h] for the ``heads`` matrices of batch index ``idx``, each head's output
    columns cut into equal parts so that heads x parts is a multiple of the Legions (each then
    sums as many), every part a block of its own on the next Legion in turn."""
    legions = em.arch.legions
    per = legions // math.gcd(heads, legions)
    parts = per
    while -(-N // parts) > TILE:
        parts += per
    width = -(-N // min(parts, N))
    lay = _deeper(em, _layout(em, M, K, width))
    streams = _Streams(em, lay, defer=True)
    for h in range(heads):
        at = idx + (h,)
        ah, bh, oh = a.at(at), b.at(at), out.at(at)
        for n0 in range(0, N, width):
            streams.add(_job(em, lay, ah, bh, oh, 0, n0, M, K, min(width, N - n0), 1, (0, 0, 0)), 1)
    streams.flush()


def _deeper(em: Emitter, lay: Layout) -> Layout:
    """``lay`` with a third buffer of each kind where the scratchpad holds it: a block's product
    is short next to one DRAM latency, so two loads ahead keep the lanes fed."""
    three = Layout(lay.mb, lay.nb, lay.size, 3)
    fits = three.chunk(2) + (lay.mb + lay.nb) * lay.size <= em.capacity("vec")
    return three if lay.buffers == 2 and fits else lay


def _batch_shape(a_shape, b_shape) -> tuple[int, ...]:
    a_b = a_shape[:-2] if len(a_shape) > 1 else ()
    b_b = b_shape[:-2] if len(b_shape) > 1 else ()
    rank = max(len(a_b), len(b_b))
    a_b, b_b = (1,) * (rank - len(a_b)) + a_b, (1,) * (rank - len(b_b)) + b_b
    return tuple(max(x, y) for x, y in zip(a_b, b_b))


@lowers("Gemm")
def gemm(low: Lowering, node) -> None:
    a_name, b_name = node.inputs[:2]
    c_name = node.inputs[2] if len(node.inputs) > 2 else ""
    alpha, beta = node.attrs.get("alpha", 1.0), node.attrs.get("beta", 1.0)
    a, b = low.operand(a_name), low.operand(b_name)
    if node.attrs.get("transA", 0):
        a = Operand(a.tensor, a.offset, a.strides[::-1])
    if node.attrs.get("transB", 0):
        b = Operand(b.tensor, b.offset, b.strides[::-1])
    out_name = node.outputs[0]
    M, N = low.shape(out_name)
    K = low.shape(a_name)[0 if node.attrs.get("transA", 0) else 1]
    dst = low.result(out_name)
    matmul_blocks(low.em, a, b, dst, M, K, N)
    if alpha == 1.0 and (not c_name or beta == 0.0):
        return
    low.em.barrier()
    _scale_and_add(low, node, dst, c_name, float(alpha), float(beta))


def _scale_and_add(low: Lowering, node, dst: Operand, c_name: str, alpha: float, beta: float) -> None:
    shape = low.shape(node.outputs[0])
    args = [Arg("y", dst), Arg("out", dst, out=True)]
    if c_name and beta != 0.0:
        args.insert(1, Arg("c", broadcast(low.operand(c_name), low.shape(c_name), shape)))

    def body(em, legion, v, rows, cols):
        em.emit(BY_MNEMONIC["vmul"](legion, v["out"], v["y"], alpha, rows, cols))
        if "c" not in v:
            return
        em.emit(BY_MNEMONIC["vmul"](legion, v["c_scaled"], v["c"], beta, rows, cols))
        em.emit(BY_MNEMONIC["vadd"](legion, v["out"], v["out"], v["c_scaled"], rows, cols))
    if c_name and beta != 0.0:
        args.append(Arg("c_scaled"))
    rowwise(low.em, shape, args, body, where=f"node '{node.name}': ")
