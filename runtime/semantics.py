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
from isa.instructions import (Barrier, DmaLoad, DmaStore, Drain, Gather, Instr, MatMul, VBinary,
                              VMatMul, VReduce, VSelect, VUnary, Wait)
from isa.program import LOADS, STORAGE, STORES, UNPACK, Tensor
from runtime.fdot import rounded_matmul
from runtime.state import Machine, Trap, move

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

def _check_pair(allowed: dict, space: str, t: Tensor, verb: str) -> None:
    if t.dtype not in allowed[space]:
        raise Trap(f"cannot {verb} {space} a {t.dtype} tensor ({t.name}); "
                   f"allowed: {', '.join(sorted(allowed[space]))}")


@handles(DmaLoad)
def dma_load(m: Machine, i: DmaLoad) -> None:
    _check_pair(LOADS, i.dst.space, m.tensor(i.src.tensor), "load into")
    values = move(m.dram_read(i.src, i.rows, i.cols), SPACE_DTYPE[i.dst.space])
    # One DRAM read, delivered to every destination Legion (multicast).
    for legion in sorted(i.dests):
        m.write(legion, i.dst, values)


@handles(DmaStore)
def dma_store(m: Machine, i: DmaStore) -> None:
    t = m.tensor(i.dst.tensor)
    _check_pair(STORES, i.src.space, t, "store from")
    m.dram_write(i.dst, move(m.read(i.legion, i.src, i.rows, i.cols), STORAGE[t.dtype]))


def _table_rows(i: Gather, t: Tensor) -> float:
    """How many rows of ``cols`` elements the table reference reaches inside its tensor."""
    room = t.storage_elems - i.table.offset - i.cols
    if room < 0:
        return 0
    return room // i.table.rs + 1 if i.table.rs else math.inf


def _row_ids(m: Machine, i: Gather, t: Tensor) -> np.ndarray:
    ids = m.read(i.legion, i.ids, i.rows, 1)[:, 0]
    rows = _table_rows(i, t)
    ok = np.isfinite(ids) & (ids == np.floor(ids)) & (ids >= 0) & (ids < rows)
    if not ok.all():
        k = int(np.argmin(ok))
        raise Trap(f"gather id {ids[k]:g} (row {k}) is not a row of table {t.name}, "
                   f"which has {rows} rows")
    return ids.astype(np.int64)


@handles(Gather)
def gather(m: Machine, i: Gather) -> None:
    t = m.tensor(i.table.tensor)
    _check_pair(LOADS, i.dst.space, t, "gather into")
    ids = _row_ids(m, i, t)
    index = i.table.offset + ids[:, None] * i.table.rs + np.arange(i.cols)
    m.write(i.legion, i.dst, move(m.dram[i.table.tensor][index], SPACE_DTYPE[i.dst.space]))


# --- matrix ----------------------------------------------------------------------------------

# fp32 value of every weight a w2/w4 byte packs, lowest bits first: row b of a (256, 8/bits) table.
_WEIGHT_LUT = {mode: UNPACK[mode].astype(np.float32) for mode in ("w4", "w2")}
# Every integer of magnitude up to 2**24 is an fp32 value.
FP32_EXACT = 2 ** 24


def _weights(m: Machine, i: MatMul) -> np.ndarray:
    """The K x N weights as fp32 (exact small integers), unpacked from the weight scratchpad."""
    row_bytes = -(-i.N * MODE_BITS[i.mode] // 8)
    packed = m.read(i.legion, i.wgt, i.K, row_bytes)
    if i.mode == "w8":
        return packed.view(np.int8).astype(np.float32)
    w = np.take(_WEIGHT_LUT[i.mode], packed, axis=0)
    return w.reshape(i.K, -1)[:, :i.N]


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
    """int8 ``a`` (M x K) times integer-valued fp32 ``w`` (K x N) exactly, wrapped to int32.

    With |a| <= a_max and |w| <= w_max, every partial sum over a K-slice of depth d is at most
    a_max * w_max * d, so fp32 BLAS sums the slice exactly, in whatever order, while that stays
    within 2**24. Deeper products run as a batch of such slices (one BLAS call, as fast as
    fp32) whose results are added in fp64, exact far beyond any K the encoding allows.
    """
    M, K = a.shape
    a_max = max(-int(a.min()), int(a.max())) if a.size else 0
    depth = FP32_EXACT // max(a_max * w_max, 1)
    if K <= depth:
        return np.matmul(a.astype(np.float32), w).astype(np.int32)
    slices = -(-K // depth)
    depth = -(-K // slices)
    pad = slices * depth - K
    a = np.pad(a, ((0, 0), (0, pad))) if pad else a
    w = np.pad(w, ((0, pad), (0, 0))) if pad else w
    a3 = np.ascontiguousarray(a.reshape(M, slices, depth).transpose(1, 0, 2), np.float32)
    partial = np.matmul(a3, w.reshape(slices, depth, -1))
    return partial.sum(axis=0, dtype=np.float64).astype(np.int64).astype(np.int32)


@handles(MatMul)
def matmul(m: Machine, i: MatMul) -> None:
    if i.mode not in m.arch.modes:
        raise Trap(f"mode {i.mode} is not supported by {m.arch.name} "
                   f"(modes: {', '.join(m.arch.modes)})")
    a = m.read(i.legion, i.act, i.M, i.K)
    w = _weights(m, i)
    kept = _kept_blocks(m, i)
    if kept is not None:
        w = w * kept
    out = exact_matmul(a, w, 1 << (MODE_BITS[i.mode] - 1))
    if i.accumulate == "add":
        out = m.read(i.legion, i.acc, i.M, i.N) + out      # int32 arrays wrap around
    m.write(i.legion, i.acc, out)


# --- vector ----------------------------------------------------------------------------------

def _operand(m: Machine, legion: int, x: View | float, rows: int, cols: int):
    """A vector operand as fp32: a view (any space converts), or an fp32 immediate."""
    if isinstance(x, View):
        return np.asarray(m.read(legion, x, rows, cols), np.float32)
    return np.float32(x)


def _drain_vector(m: Machine, i: Drain, space: str, addr: int | None, per_row: bool):
    """An optional per-row or per-column vector at ``space[addr]`` as an M x N view whose
    0 stride broadcasts it; None when the operand is absent."""
    if addr is None:
        return None
    rs, cs = (1, 0) if per_row else (0, 1)
    return m.read(i.legion, View(space, addr, rs, cs), i.M, i.N)


def _plus(v: np.ndarray, x: np.ndarray | None) -> np.ndarray:
    return v if x is None else v + x


def _times(v: np.ndarray, x: np.ndarray | None) -> np.ndarray:
    return v if x is None else v * x


@handles(Drain)
def drain(m: Machine, i: Drain) -> None:
    acc = m.read(i.legion, i.acc, i.M, i.N)
    # The zero-point correction is an int32 add (wrapping); the rest is fp32, in this order.
    v = _plus(acc, _drain_vector(m, i, "acc", i.zp, per_row=False)).astype(np.float32)
    v = _times(v, _drain_vector(m, i, "vec", i.rscale, per_row=True))
    v = _times(v, _drain_vector(m, i, "vec", i.cscale, per_row=False))
    v = _plus(v, _drain_vector(m, i, "vec", i.bias, per_row=False))
    if i.accumulate == "add":
        v = _operand(m, i.legion, i.dst, i.M, i.N) + v
    m.write(i.legion, i.dst, v)


@handles(VUnary)
def vunary(m: Machine, i: VUnary) -> None:
    a = _operand(m, i.legion, i.a, i.rows, i.cols)
    m.write(i.legion, i.dst, np.asarray(type(i).FUNC(a), np.float32))


@handles(VBinary)
def vbinary(m: Machine, i: VBinary) -> None:
    a = _operand(m, i.legion, i.a, i.rows, i.cols)
    b = _operand(m, i.legion, i.b, i.rows, i.cols)
    out = np.asarray(type(i).FUNC(a, b), np.float32)
    if out.shape != (i.rows, i.cols):                 # two immediates, or a broadcasting view
        out = np.broadcast_to(out, (i.rows, i.cols))
    m.write(i.legion, i.dst, out)


@handles(VReduce)
def vreduce(m: Machine, i: VReduce) -> None:
    if i.cols == 0:
        raise Trap("reduction over 0 columns")
    a = _operand(m, i.legion, i.a, i.rows, i.cols)
    out = np.asarray(type(i).FUNC(a), np.float32).reshape(i.rows, 1)
    m.write(i.legion, i.dst, out)


@handles(VSelect)
def vselect(m: Machine, i: VSelect) -> None:
    cond = _operand(m, i.legion, i.cond, i.rows, i.cols)
    a = np.broadcast_to(_operand(m, i.legion, i.a, i.rows, i.cols), (i.rows, i.cols))
    # Elements where cond is 0 keep their value: they are neither read nor written.
    m.write(i.legion, i.dst, a, where=cond != 0)


@handles(VMatMul)
def vmatmul(m: Machine, i: VMatMul) -> None:
    a = _operand(m, i.legion, i.a, i.M, i.K)
    b = _operand(m, i.legion, i.b, i.K, i.N)
    m.write(i.legion, i.dst, rounded_matmul(a, b))


# --- synchronization -------------------------------------------------------------------------

@handles(Barrier)
@handles(Wait)
def no_effect(m: Machine, i: Instr) -> None:
    """Ordering is the timing model's job; the functional state does not change."""
