"""What each instruction does to the machine state: one handler per instruction class.

Handlers are registered explicitly with :func:`handles`; a class without its own handler uses
the nearest registered base class, so every vector function shares the handler of ``VUnary``,
``VBinary`` or ``VReduce``, which calls the class's numpy ``FUNC``. Timing is not modelled
here: the timing model decides *when* :func:`execute` runs each instruction.
"""
from __future__ import annotations

import math
from functools import cache
from typing import Callable

import numpy as np

from isa.arch import MODE_BITS
from isa.fields import SPACE_DTYPE, View
from isa.instructions import (Barrier, DmaLoad, DmaStore, Drain, Gather, Instr, MatMul, NocAdd, NocMove, VBinary,
                              VMatMul, VReduce, VSelect, VUnary, Wait)
from isa.program import LOADS, STORAGE, STORES, UNPACK, Tensor
from runtime.fdot import rounded_matmul
from runtime.intdot import exact_int8, int8_matmul
from runtime.state import Machine, Trap, convert, move

Handler = Callable[[Machine, Instr], None]
HANDLERS: dict[type, Handler] = {}


def handles(cls: type) -> Callable[[Handler], Handler]:
    """Register the decorated function as the semantics of ``cls`` (and its subclasses)."""
    def register(fn: Handler) -> Handler:
        HANDLERS[cls] = fn
        return fn
    return register


@cache
def handler_for(cls: type) -> Handler:
    for base in cls.__mro__:
        if base in HANDLERS:
            return HANDLERS[base]
    raise Trap(f"no semantics for instruction class {cls.__name__}")


def execute(machine: Machine, instr: Instr) -> None:
    """Apply ``instr``'s functional effect; a fault raises :class:`Trap`."""
    # IEEE inf/NaN results are defined behaviour of the vector unit, not faults.
    with np.errstate(all="ignore"):
        handler_for(type(instr))(machine, instr)


def execute_unguarded(machine: Machine, instr: Instr) -> None:
    """:func:`execute` for a caller that already ignores numpy's floating-point errors
    around a whole run (entering ``np.errstate`` per task is a measurable part of its cost)."""
    handler_for(type(instr))(machine, instr)


# --- DMA -------------------------------------------------------------------------------------
#
# An instruction with ``span=S`` is S tasks, one per Legion L..L+S-1 (isa/expand.py); each
# handler performs all of them at once on span x rows x cols arrays (a task is a span of 1).

def _span(i: Instr) -> int:
    return getattr(i, "span", None) or 1


def _lstride(i: Instr) -> int:
    return getattr(i, "lstride", None) or 0


def _check_pair(allowed: dict, space: str, t: Tensor, verb: str) -> None:
    if t.dtype not in allowed[space]:
        raise Trap(f"cannot {verb} {space} a {t.dtype} tensor ({t.name}); "
                   f"allowed: {', '.join(sorted(allowed[space]))}")


@handles(DmaLoad)
def dma_load(m: Machine, i: DmaLoad) -> None:
    _check_pair(LOADS, i.dst.space, m.tensor(i.src.tensor), "load into")
    values = move(m.dram_read(i.src, i.rows, i.cols, _span(i), _lstride(i)), SPACE_DTYPE[i.dst.space])
    # One DRAM read, delivered to every destination Legion (multicast); rank r's are moved by r.
    _deliver(m, i, values)


def _deliver(m: Machine, i: Instr, values: np.ndarray) -> None:
    """``values`` written to every destination of ``i``, in Legion order: a single rank's at
    once when no destination window holds what they were read from (a load's never does),
    else one destination after the other."""
    if values.shape[0] == 1 and len(i.dests) > 1 and not _rewrites_source(i):
        m.multicast(i.dests, i.dst, values)
        return
    for legion in sorted(i.dests):
        m.write(legion, i.dst, values)


def _rewrites_source(i: Instr) -> bool:
    """Whether a move's destination window on its own Legion may share an element with its
    source window, other than being that window (which a store of its own values leaves as
    it was)."""
    if not isinstance(i, NocMove) or i.legion not in i.dests or i.src.space != i.dst.space or i.src == i.dst:
        return False
    (lo, hi), (dst_lo, dst_hi) = (_extent(v, i.rows, i.cols) for v in (i.src, i.dst))
    return lo <= dst_hi and dst_lo <= hi


def _extent(v: View, rows: int, cols: int) -> tuple[int, int]:
    """The lowest and highest element a rows x cols window of ``v`` touches."""
    steps = ((rows - 1) * v.rs, (cols - 1) * v.cs)
    return v.addr + sum(min(0, x) for x in steps), v.addr + sum(max(0, x) for x in steps)


@handles(NocMove)
def noc_move(m: Machine, i: NocMove) -> None:
    # One read of each rank's source window, the same values written into every destination
    # (rank r's moved by r).
    span = _span(i)
    values = m.read(i.legion, i.src, i.rows, i.cols, span).reshape(span, i.rows, i.cols)
    _deliver(m, i, values)


@handles(NocAdd)
def noc_add(m: Machine, i: NocAdd) -> None:
    # Each destination reads its own partial sums and adds the sent ones (int32 wraps, as the
    # accumulators do): the reduction of a K split.
    span = _span(i)
    values = m.read(i.legion, i.src, i.rows, i.cols, span).reshape(span, i.rows, i.cols)
    for legion in sorted(i.dests):
        mine = m.read(legion, i.dst, i.rows, i.cols, span).reshape(span, i.rows, i.cols)
        m.write(legion, i.dst, mine + values)


@handles(DmaStore)
def dma_store(m: Machine, i: DmaStore) -> None:
    t = m.tensor(i.dst.tensor)
    _check_pair(STORES, i.src.space, t, "store from")
    values = m.read(i.legion, i.src, i.rows, i.cols, _span(i))
    m.dram_write(i.dst, move(values, STORAGE[t.dtype]), _lstride(i))


def _table_rows(i: Gather, t: Tensor, offset: int) -> float:
    """How many rows of ``cols`` elements a table reference at ``offset`` reaches inside its tensor."""
    room = t.storage_elems - offset - i.cols
    if room < 0:
        return 0
    return room // i.table.rs + 1 if i.table.rs else math.inf


def _row_ids(m: Machine, i: Gather, t: Tensor, offsets: np.ndarray) -> np.ndarray:
    ids = m.read(i.legion, i.ids, i.rows, 1, _span(i))[:, :, 0]
    for r, offset in enumerate(offsets.tolist()):
        rows = _table_rows(i, t, offset)
        ok = np.isfinite(ids[r]) & (ids[r] == np.floor(ids[r])) & (ids[r] >= 0) & (ids[r] < rows)
        if not ok.all():
            k = int(np.argmin(ok))
            raise Trap(f"gather id {ids[r, k]:g} (row {k}) is not a row of table {t.name}, "
                       f"which has {rows} rows")
    return ids.astype(np.int64)


@handles(Gather)
def gather(m: Machine, i: Gather) -> None:
    t = m.tensor(i.table.tensor)
    _check_pair(LOADS, i.dst.space, t, "gather into")
    offsets = i.table.offset + np.arange(_span(i), dtype=np.int64) * _lstride(i)
    ids = _row_ids(m, i, t, offsets)
    index = offsets[:, None, None] + ids[:, :, None] * i.table.rs + np.arange(i.cols)
    m.write(i.legion, i.dst, move(m.dram[i.table.tensor][index], SPACE_DTYPE[i.dst.space]))


# --- matrix ----------------------------------------------------------------------------------

# The weights a w2/w4 byte packs, lowest bits first, as one unsigned integer per byte (a row of
# 8/bits int8 as raw bytes): unpacking is one flat take of a plain integer type, which numpy
# copies faster than a row or a void record.
_WEIGHT_LUT = {mode: np.ascontiguousarray(UNPACK[mode], np.int8).view(f"u{UNPACK[mode].shape[1]}").ravel()
               for mode in ("w4", "w2")}


def _pair_table(mode: str) -> np.ndarray:
    """The weights two consecutive bytes pack (a little-endian u2, the first byte's lowest), as
    one unsigned integer per pair: half the indices of :data:`_WEIGHT_LUT`'s take."""
    pair = np.arange(1 << 16)
    rows = np.ascontiguousarray(np.concatenate([UNPACK[mode][pair & 0xFF], UNPACK[mode][pair >> 8]], axis=1), np.int8)
    return rows.view(f"u{rows.shape[1]}").ravel()


_PAIR_LUT = {mode: _pair_table(mode) for mode in ("w4", "w2")}

# Every integer of magnitude up to 2**24 is an fp32 value.
FP32_EXACT = 2 ** 24
# Rows from which a spanned matmul with shared activations runs as one wide product.
WIDE_ROWS = 8


def _weights(m: Machine, i: MatMul) -> np.ndarray:
    """Each rank's K x N int8 weights, unpacked from the weight scratchpad."""
    row_bytes = -(-i.N * MODE_BITS[i.mode] // 8)
    packed = m.read(i.legion, i.wgt, i.K, row_bytes, _span(i))
    if i.mode == "w8":
        return packed.view(np.int8)
    w = unpack_weights(packed, i.mode, m.unpacked)
    return w.reshape(packed.shape[0], i.K, -1)[:, :, :i.N]


def unpack_weights(packed: np.ndarray, mode: str, buffers: dict | None = None) -> np.ndarray:
    """``packed`` (... x row bytes, u8) unpacked to int8, 8/bits per byte (rows padded as packed),
    into ``buffers``' array of its shape when given (made there the first time): the caller
    reads the result before it unpacks again.

    Weights are read once each and unpacked into fresh memory, whose first touch costs as much
    as the take; a reused buffer is taken into directly (``mode="clip"``: a table of 256 or
    65,536 entries has no index out of range, and "raise" would buffer ``out``). Byte pairs
    take half the indices where a row has an even count of bytes."""
    pairs = packed.shape[-1] % 2 == 0 and packed.strides[-1] == 1
    lut, index = (_PAIR_LUT[mode], packed.view("<u2")) if pairs else (_WEIGHT_LUT[mode], packed)
    if buffers is None:
        return lut.take(index).view(np.int8)
    key = (index.shape, lut.dtype)
    out = buffers.get(key)
    if out is None:
        out = buffers[key] = np.empty(index.shape, lut.dtype)
    return lut.take(index, out=out, mode="clip").view(np.int8)


def _kept_blocks(m: Machine, i: MatMul) -> np.ndarray | None:
    """K x N booleans, False inside the weight blocks the mask marks all-zero; None keeps all."""
    if i.mask is None:
        return None
    t = m.tensor(i.mask)
    n = m.arch.array
    shape = (-(-i.K // n), -(-i.N // n))
    if t.dtype != "u8" or tuple(t.shape) != shape:
        raise Trap(f"mask {t.name} is {t.dtype}{list(t.shape)}, want u8{list(shape)} "
                   f"(K={i.K}, N={i.N} in {n}x{n} blocks)")
    blocks = m.dram[i.mask].reshape(shape) != 0
    if blocks.all():
        return None
    return np.repeat(np.repeat(blocks, n, axis=0), n, axis=1)[:i.K, :i.N]


def exact_matmul(a: np.ndarray, w: np.ndarray, w_max: int) -> np.ndarray:
    """int8 ``a`` (... x M x K) times integer-valued fp32 ``w`` (... x K x N) exactly, wrapped
    to int32 (leading axes: a batch, as np.matmul).

    With |a| <= a_max and |w| <= w_max, every partial sum over a K-slice of depth d is at most
    a_max * w_max * d, so fp32 BLAS sums the slice exactly, in whatever order, while that stays
    within 2**24. Deeper products run as a batch of such slices (one BLAS call, as fast as
    fp32) whose results are added in fp64, exact far beyond any K the encoding allows.
    """
    K = a.shape[-1]
    a_max = max(-int(a.min()), int(a.max())) if a.size else 0
    depth = FP32_EXACT // max(a_max * w_max, 1)
    if K <= depth:
        return np.matmul(a.astype(np.float32), w).astype(np.int32)
    slices = -(-K // depth)
    depth = -(-K // slices)
    pad = slices * depth - K
    a = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]) if pad else a
    w = np.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, pad), (0, 0)]) if pad else w
    # slices x ... x M x depth times slices x ... x depth x N, summed over the slices
    a3 = np.ascontiguousarray(np.moveaxis(a.reshape(*a.shape[:-1], slices, depth), -2, 0), np.float32)
    w3 = np.moveaxis(w.reshape(*w.shape[:-2], slices, depth, w.shape[-1]), -3, 0)
    partial = np.matmul(a3, w3)
    return partial.sum(axis=0, dtype=np.float64).astype(np.int64).astype(np.int32)


@handles(MatMul)
def matmul(m: Machine, i: MatMul) -> None:
    if i.mode not in m.arch.modes:
        raise Trap(f"mode {i.mode} is not supported by {m.arch.name} "
                   f"(modes: {', '.join(m.arch.modes)})")
    span = _span(i)
    a = m.read(i.legion, i.act, i.M, i.K, span)
    w = _weights(m, i)
    kept = _kept_blocks(m, i)
    if kept is not None:
        w = w * kept
    w_max = 1 << (MODE_BITS[i.mode] - 1)
    if exact_int8(w_max):
        out = int8_matmul(a, w)
    elif span > 1 and i.M >= WIDE_ROWS and (a == a[:1]).all():
        # Multicast activations: the ranks' weights side by side make one wide product, which
        # BLAS runs faster than a batch of narrow ones (exact either way); worth the copy of
        # the weights only for enough rows.
        wide = np.moveaxis(w, 0, 1).reshape(i.K, span * i.N).astype(np.float32)
        out = exact_matmul(a[0], wide, w_max).reshape(i.M, span, i.N).transpose(1, 0, 2)
    else:
        out = exact_matmul(a, w.astype(np.float32), w_max)
    if i.accumulate == "add" and out.dtype == SPACE_DTYPE["acc"] and out.shape == (span, i.M, i.N):
        m.add_into(i.legion, i.acc, out)      # int32 adds wrap around, as the accumulator does
        return
    if i.accumulate == "add":
        out = m.read(i.legion, i.acc, i.M, i.N, span) + out
    m.write(i.legion, i.acc, out)


# --- vector ----------------------------------------------------------------------------------

def _operand(m: Machine, i: Instr, x: View | float, rows: int, cols: int):
    """A vector operand as fp32, span x rows x cols: a view (any space converts), or an fp32
    immediate."""
    if isinstance(x, View):
        return np.asarray(m.read(i.legion, x, rows, cols, _span(i)), np.float32)
    return np.float32(x)


def _drain_vector(m: Machine, i: Drain, space: str, addr: int | None, per_row: bool):
    """An optional per-row or per-column vector at ``space[addr]`` as an M x N view whose
    0 stride broadcasts it; None when the operand is absent."""
    if addr is None:
        return None
    rs, cs = (1, 0) if per_row else (0, 1)
    return m.read(i.legion, View(space, addr, rs, cs), i.M, i.N, _span(i))


def _plus(v: np.ndarray, x: np.ndarray | None) -> np.ndarray:
    return v if x is None else v + x


def _times(v: np.ndarray, x: np.ndarray | None) -> np.ndarray:
    return v if x is None else v * x


@handles(Drain)
def drain(m: Machine, i: Drain) -> None:
    acc = m.read(i.legion, i.acc, i.M, i.N, _span(i))
    # The zero-point correction is an int32 add (wrapping); the rest is fp32, in this order.
    v = _plus(acc, _drain_vector(m, i, "acc", i.zp, per_row=False)).astype(np.float32)
    v = _times(v, _drain_vector(m, i, "vec", i.rscale, per_row=True))
    v = _times(v, _drain_vector(m, i, "vec", i.cscale, per_row=False))
    v = _plus(v, _drain_vector(m, i, "vec", i.bias, per_row=False))
    if i.accumulate == "add":
        v = _operand(m, i, i.dst, i.M, i.N) + v
    m.write(i.legion, i.dst, v)


def _shaped(m: Machine, i: Instr, out, rows: int, cols: int) -> np.ndarray:
    """``out`` as the span x rows x cols fp32 result (two immediates, or a broadcasting view,
    give fewer axes)."""
    out = np.asarray(out, np.float32)
    shape = (_span(i), rows, cols)
    return out if out.shape == shape else np.broadcast_to(out, shape)


def _store(m: Machine, i: Instr, out) -> None:
    """A vector result stored into ``i``'s destination: ``out`` as :func:`_shaped` makes it,
    whose fewer axes (two immediates, a broadcasting view) numpy broadcasts as it stores, with
    no view made to the full shape first."""
    out = np.asarray(out, np.float32)
    span = _span(i)
    if out.shape == (span, i.rows, i.cols):
        m.write(i.legion, i.dst, out)
        return
    target = m.target(i.legion, i.dst, i.rows, i.cols, span)
    if target is not None:
        target[...] = convert(out[(None,) * (3 - out.ndim)], target.dtype)     # as 3-d: convert takes no scalar


# Functions that round each element once, exactly: their bits are the same whichever loop numpy
# runs them with, into a fresh array or into a strided window.
EXACT_UFUNCS = frozenset({np.add, np.subtract, np.multiply, np.divide, np.negative, np.absolute, np.rint,
                          np.floor, np.ceil, np.trunc, np.sqrt})


def _into_dst(m: Machine, i: Instr, fn, *operands) -> bool:
    """``fn(*operands)`` computed straight into ``i``'s destination window (no result to copy),
    when that stores what :meth:`Machine.write` of it would: ``fn`` is exact, the window holds
    fp32 and an operand is a window (the result has its full shape). numpy reads operands that
    share memory with the destination before writing it, as a separate result does."""
    if fn not in EXACT_UFUNCS or SPACE_DTYPE[i.dst.space] != "float32" \
            or not any(isinstance(x, np.ndarray) for x in operands):
        return False
    target = m.target(i.legion, i.dst, i.rows, i.cols, _span(i))
    if target is not None:
        fn(*operands, out=target)
    return True


@handles(VUnary)
def vunary(m: Machine, i: VUnary) -> None:
    a = _operand(m, i, i.a, i.rows, i.cols)
    if not _into_dst(m, i, type(i).FUNC, a):
        _store(m, i, type(i).FUNC(a))


@handles(VBinary)
def vbinary(m: Machine, i: VBinary) -> None:
    a = _operand(m, i, i.a, i.rows, i.cols)
    b = _operand(m, i, i.b, i.rows, i.cols)
    if not _into_dst(m, i, type(i).FUNC, a, b):
        _store(m, i, type(i).FUNC(a, b))


@handles(VReduce)
def vreduce(m: Machine, i: VReduce) -> None:
    if i.cols == 0:
        raise Trap("reduction over 0 columns")
    a = _operand(m, i, i.a, i.rows, i.cols)
    if i.a.cs == 1:
        # Rows contiguous: numpy reduces each in one inner loop, whatever axes surround it,
        # so every rank at once rounds as each alone does.
        out = np.asarray(type(i).FUNC(a), np.float32)
    else:
        # Rank by rank: a row's fp32 sum is rounded in the order numpy gives its rows x cols view.
        out = np.stack([np.asarray(type(i).FUNC(x), np.float32) for x in a])
    m.write(i.legion, i.dst, out.reshape(-1, i.rows, 1))


@handles(VSelect)
def vselect(m: Machine, i: VSelect) -> None:
    cond = _operand(m, i, i.cond, i.rows, i.cols)
    a = _shaped(m, i, _operand(m, i, i.a, i.rows, i.cols), i.rows, i.cols)
    # Elements where cond is 0 keep their value: they are neither read nor written.
    m.write(i.legion, i.dst, a, where=cond != 0)


@handles(VMatMul)
def vmatmul(m: Machine, i: VMatMul) -> None:
    a = _operand(m, i, i.a, i.M, i.K)
    b = _operand(m, i, i.b, i.K, i.N)
    m.write(i.legion, i.dst, rounded_matmul(a, b))


# --- synchronization -------------------------------------------------------------------------

@handles(Barrier)
@handles(Wait)
def no_effect(m: Machine, i: Instr) -> None:
    """Ordering is the timing model's job; the functional state does not change."""
