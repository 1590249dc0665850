"""Quantized matmuls on the systolic arrays (``dlegion.QMatMul``, and the ONNX integer matmuls).

``y = scale((A - zp) . W)``: the activations A are integers (int8 as they are, uint8 stored as
A - 128), the weight W is a constant of 2, 4 or 8 bits. Each row block of the int8 activations
is multicast to every Legion with one DRAM read; each Legion owns a slice of output columns,
streams its packed weights through passes split over its cores' K-slices (summed by the
parallel accumulators) and drains the int32 accumulators with the per-row and per-column
scales into fp32.

A zero point is the compiler's job, not the array's: (A - zp) . W = (A - offset) . W
+ (offset - zp) . colsum(W). The correction is exact int32 arithmetic done by the arrays
themselves: one more pass streams a row holding e = zp - offset (always an int8) against a
few constant weight rows whose column sums are -colsum(W), adding into the same accumulators.

Per-block weight scales (``scales`` [groups, N], one row per ``block`` rows of W) drain once
per block, accumulating into fp32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from isa.arch import MODE_BITS, Arch
from isa.fields import DramRef, View
from isa.instructions import BY_MNEMONIC, DmaLoad, DmaStore, Drain, MatMul
from dlegion_cc.ir import DLEGION
from dlegion_cc.lower.context import Lowering, lowers
from dlegion_cc.lower.emitter import Emitter
from dlegion_cc.lower.layout import Operand, whole
from dlegion_cc.lower.rowwise import Arg, rowwise

WEIGHT_DTYPE = {"w2": "w2", "w4": "w4", "w8": "i8"}


def mode_range(mode: str) -> tuple[int, int]:
    bits = MODE_BITS[mode]
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def mode_for(values: np.ndarray) -> str | None:
    """The narrowest weight mode whose two's complement range holds ``values``, or None."""
    lo, hi = (int(values.min()), int(values.max())) if values.size else (0, 0)
    for mode in sorted(MODE_BITS, key=MODE_BITS.get):
        m_lo, m_hi = mode_range(mode)
        if m_lo <= lo and hi <= m_hi:
            return mode
    return None


def pick_mode(arch: Arch, wanted: str) -> str:
    """The narrowest mode the machine has that holds weights of ``wanted``'s width."""
    fits = [m for m in arch.modes if MODE_BITS[m] >= MODE_BITS[wanted]]
    if not fits:
        raise ValueError(f"{arch.name} has no mode that holds {wanted} weights")
    return min(fits, key=lambda m: MODE_BITS[m])


@dataclass(frozen=True)
class Weights:
    """The constant operand as the arrays hold it, and the scales applied when draining."""

    values: np.ndarray                 # int [K, N], inside ``mode``'s range
    mode: str
    scales: np.ndarray | None = None   # fp32 [groups, N]: column scales of each group of rows
    block: int = 0                     # rows per group; 0: one group of all K rows
    bias: np.ndarray | None = None     # fp32 [N], added once


@dataclass(frozen=True)
class Activations:
    """The integer operand: a graph value holding exact integers."""

    name: str
    offset: int = 0                    # stored as the int8 value - offset (128 for uint8)
    zero_point: str | int = 0          # a graph value (scalar) or a constant
    rscale: str | None = None          # per-row or per-tensor scale applied when draining
    divisor: bool = False              # the drain multiplies by 1 / rscale


@dataclass(frozen=True)
class Output:
    name: str
    requant: tuple[float, int, int] | None = None   # (zero point, lo, hi): clip(round(v) + zp)


@lowers("QMatMul", domain=DLEGION)
def qmatmul(low: Lowering, node) -> None:
    a = node.attrs
    q, s, zp = (node.inputs + ["", ""])[:3]
    scales = a.get("scales")
    if scales is None and a.get("cscale") is not None:
        scales = np.asarray(a["cscale"], np.float32)[None, :]
    acts = Activations(q, a.get("act_offset", 0), zp or a.get("act_zero_point", 0), s or None,
                       a.get("row_divisor", False))
    weights = Weights(np.asarray(a["weight"]), a["mode"], scales, a.get("block", 0), a.get("bias"))
    requant = a.get("requant")
    lower_qmatmul(low, node.name, acts, weights, Output(node.outputs[0], None if requant is None else tuple(requant)))


@dataclass(frozen=True)
class Problem:
    """One quantized matmul, its operands already in DRAM (tensor indices)."""

    a8: int                  # i8 [M, K] activations - offset
    rscale: int | None       # f32 [M]
    weight: int              # [K, n_pad] at ``mode``
    mode: str
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
    M: int
    K: int
    N: int
    n_pad: int


def lower_qmatmul(low: Lowering, name: str, acts: Activations, w: Weights, out: Output) -> None:
    """Emit ``out = scale((acts - zp) . w)`` (see the module docstring)."""
    em, arch = low.em, low.em.arch
    K, N = w.values.shape
    shape = low.shape(acts.name)
    if not shape or shape[-1] != K:
        raise ValueError(f"activations '{acts.name}' of shape {list(shape)} do not have K={K} columns")
    M = math.prod(shape[:-1])
    mode = pick_mode(arch, w.mode)
    block = w.block or K
    groups = math.ceil(K / block)
    a8 = int8_rows(low, acts.name, acts.offset)
    rscale = row_scales(low, acts.rscale, acts.divisor, M) if acts.rscale else None
    corr = correction(low, name, acts, w.values, block)
    em.barrier()                                        # every Legion reads what the vector unit wrote
    n_pad = math.ceil(N / arch.array) * arch.array
    weight = em.const(f"{name}_w", _pad_cols(w.values, n_pad).astype(np.int8), WEIGHT_DTYPE[mode])
    scales = None if w.scales is None else em.const(f"{name}_scales", _pad_cols(
        np.broadcast_to(np.asarray(w.scales, np.float32).reshape(-1, N), (groups, N)), n_pad), "f32")
    bias = None if w.bias is None else em.const(f"{name}_bias", _pad_cols(
        np.asarray(w.bias, np.float32).reshape(1, N), n_pad)[0], "f32")
    dst = low.result(out.name)
    exact = (low.dtype(out.name) == np.int32 and em.tensors[dst.tensor].dtype == "i32"
             and rscale is None and scales is None and bias is None and out.requant is None)
    p = Problem(a8, rscale, weight, mode, scales, groups, block, bias, *corr, out.requant, exact,
                dst.tensor, M, K, N, n_pad)
    emit_tiles(em, p, plan_tiles(arch, p))


def _pad_cols(a: np.ndarray, n_pad: int) -> np.ndarray:
    return np.pad(a, ((0, 0), (0, n_pad - a.shape[1])))


# --- operands ------------------------------------------------------------------------------

def int8_rows(low: Lowering, name: str, offset: int) -> int:
    """An i8 DRAM copy of ``name`` - ``offset`` (shared by every matmul reading it)."""
    key = f"{name}:int8-{offset}"
    if key in low.operands:
        return low.operands[key].tensor
    src, shape, em = low.operand(name), low.shape(name), low.em
    if offset == 0 and em.tensors[src.tensor].dtype == "i8" and src == whole(src.tensor, shape):
        low.operands[key] = src
        return src.tensor
    t = em.tensor(f"{name}_i8", "i8", shape, "scratch")

    def body(e, legion, v, rows, cols):
        if offset:
            e.emit(BY_MNEMONIC["vadd"](legion, v["out"], v["x"], float(-offset), rows, cols))
        else:
            e.emit(BY_MNEMONIC["vmov"](legion, v["out"], v["x"], rows, cols))
    rowwise(em, shape, [Arg("x", src), Arg("out", whole(t, shape), out=True)], body)
    low.operands[key] = whole(t, shape)
    return t


def _per_row(low: Lowering, name: str, M: int) -> Operand:
    """``name`` (one value, or one per row) seen in an (M, 1) frame."""
    op, n = low.operand(name), math.prod(low.shape(name))
    if n == 1:
        return Operand(op.tensor, op.offset, (0, 0))
    if n == M and op == whole(op.tensor, low.shape(name)):
        return Operand(op.tensor, op.offset, (1, 0))
    raise ValueError(f"scale '{name}' of shape {list(low.shape(name))} is neither per tensor nor per row")


def row_scales(low: Lowering, s: str, divisor: bool, M: int) -> int:
    """f32 [M]: the drain's per-row scale (1 / s when the graph divides by s)."""
    em = low.em
    rs = em.tensor(f"{s}_rscale", "f32", (M,), "scratch")
    mnemonic = "vrecip" if divisor else "vmov"
    body = lambda e, l, v, r, c: e.emit(BY_MNEMONIC[mnemonic](l, v["out"], v["s"], r, c))
    rowwise(em, (M, 1), [Arg("s", _per_row(low, s, M)), Arg("out", Operand(rs, 0, (1, 0)), out=True)], body)
    return rs


def correction_weights(values: np.ndarray, block: int, lo: int, hi: int) -> tuple[np.ndarray, int]:
    """Rows whose sum over each group of ``block`` rows is -colsum(W) of that group.

    Returns [groups * k2, N] ints inside [lo, hi] and k2, the rows per group: spreading a sum
    over k2 rows keeps every entry inside the weight range.
    """
    K, N = values.shape
    sums = np.stack([-values[g:g + block].astype(np.int64).sum(axis=0) for g in range(0, K, block)])
    top = max(hi, -lo - 1)
    k2 = max(1, int(-(-np.abs(sums).max() // top)) if sums.size else 1)
    base = np.floor_divide(sums, k2)                       # [groups, N]
    extra = sums - base * k2                               # rows that take base + 1
    rows = base[:, None, :] + (np.arange(k2)[None, :, None] < extra[:, None, :])
    return rows.reshape(-1, N), k2


def correction(low: Lowering, name: str, acts: Activations, values: np.ndarray, block: int):
    """(row, weights, k2, mode) of the zero-point correction pass, or Nones when it is 0."""
    em, arch = low.em, low.em.arch
    zp = acts.zero_point
    if isinstance(zp, str):
        c = low.const(zp)
        if c is not None and c.size != 1 or c is None and math.prod(low.shape(zp)) != 1:
            raise ValueError(f"zero point '{zp}' is not per tensor (per-row zero points are not supported)")
        zp = int(c.reshape(())) if c is not None else zp
    if zp == acts.offset:
        return None, None, 0, "w8"
    mode = max(arch.modes, key=lambda m: MODE_BITS[m])
    rows, k2 = correction_weights(values, block, *mode_range(mode))
    n_pad = math.ceil(values.shape[1] / arch.array) * arch.array
    weight = em.const(f"{name}_zp_w", _pad_cols(rows, n_pad).astype(np.int8), WEIGHT_DTYPE[mode])
    if isinstance(zp, int):
        e = zp - acts.offset
        if not -128 <= e <= 127:
            raise ValueError(f"zero point {zp} is outside the range of the activations")
        return em.const(f"{name}_zp_row", np.full(k2, e, np.int8), "i8"), weight, k2, mode
    row = em.tensor(f"{name}_zp_row", "i8", (k2,), "scratch")
    z = low.operand(zp)
    body = lambda e, l, v, r, c: e.emit(BY_MNEMONIC["vadd"](l, v["out"], v["z"], float(-acts.offset), r, c))
    rowwise(em, (1, k2), [Arg("z", Operand(z.tensor, z.offset, (0, 0))),
                          Arg("out", Operand(row, 0, (k2, 1)), out=True)], body)
    return row, weight, k2, mode


# --- tiles ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tiles:
    """How one quantized matmul is cut: row blocks, column steps and weight chunks."""

    rows: int          # activation rows multicast at once (Mb)
    cols: int          # output columns one Legion handles per drain (nb)
    depth: int         # weight rows loaded at once (Kc), never across a scale group
    per_legion: int    # output columns owned by each Legion


def plan_tiles(arch: Arch, p: Problem) -> Tiles:
    d, na = arch.derived, arch.array
    cap = d.spad_elems
    per_legion = math.ceil(p.n_pad / na / arch.legions) * na
    rows = min(p.M, (cap["act"] - p.k2) // p.K, cap["acc"] // na)
    if rows < 1:
        raise ValueError(f"an activation row of {p.K} int8 does not fit the act scratchpad of {arch.name}")
    per_col = rows + p.groups + 1                      # result, group scales, bias
    cols = min(per_legion, cap["acc"] // rows, (cap["vec"] - rows) // per_col) // na * na
    if cols < na:
        raise ValueError(f"a {na}-column tile of {rows} rows does not fit the scratchpads of {arch.name}")
    corr_bytes = p.k2 * cols * MODE_BITS[p.corr_mode] // 8
    depth = min(p.block, (cap["wgt"] - corr_bytes) * 8 // (cols * MODE_BITS[p.mode]))
    depth = depth if depth == p.block else depth // na * na
    if depth < 1:
        raise ValueError(f"a weight chunk of {cols} columns does not fit the wgt scratchpad of {arch.name}")
    return Tiles(rows, cols, depth, per_legion)


@dataclass(frozen=True)
class VecLayout:
    """Where a Legion keeps its operands in the vector scratchpad."""

    rows: int
    cols: int
    groups: int

    @property
    def rscale(self) -> int:
        return 0

    @property
    def result(self) -> int:
        return self.rows

    @property
    def scales(self) -> int:
        return self.rows + self.rows * self.cols

    @property
    def bias(self) -> int:
        return self.scales + self.groups * self.cols


def emit_tiles(em: Emitter, p: Problem, t: Tiles) -> None:
    owners = frozenset(l for l in range(em.arch.legions) if l * t.per_legion < p.n_pad)
    layout = VecLayout(t.rows, t.cols, p.groups)
    if p.corr_row is not None:              # the zero-point row stays after the activation rows
        em.emit(DmaLoad(0, owners, View("act", t.rows * p.K, p.k2, 1), DramRef(p.corr_row, 0, p.k2), 1, p.k2))
    for m0 in range(0, p.M, t.rows):
        m = min(t.rows, p.M - m0)
        for l in sorted(owners):            # the previous block is done with act and rscale
            if m0:
                em.depend((l, "mat"), (0, "dma"))
                em.depend((l, "vec"), (0, "dma"))
        em.emit(DmaLoad(0, owners, View("act", 0, p.K, 1), DramRef(p.a8, m0 * p.K, p.K), m, p.K))
        if p.rscale is not None:
            em.emit(DmaLoad(0, owners, View("vec", layout.rscale, 1, 1), DramRef(p.rscale, m0, 1), m, 1))
        for l in sorted(owners):
            em.depend((0, "dma"), (l, "mat"))
            em.depend((0, "dma"), (l, "vec"))
            _legion_block(em, p, t, layout, l, m0, m)


def _legion_block(em: Emitter, p: Problem, t: Tiles, layout: VecLayout, l: int, m0: int, m: int) -> None:
    start = l * t.per_legion
    for n0 in range(start, min(start + t.per_legion, p.n_pad), t.cols):
        nb = min(t.cols, start + t.per_legion - n0, p.n_pad - n0)
        _load_column_vectors(em, p, layout, l, n0, nb)
        for g in range(p.groups):
            _group_passes(em, p, t, l, m, n0, nb, g)
            if not p.exact:
                _drain_group(em, p, layout, l, m, nb, g)
        if p.exact:
            _store_accumulators(em, p, l, m0, m, n0, nb)
        else:
            _finish_and_store(em, p, layout, l, m0, m, n0, nb)


def _load_column_vectors(em: Emitter, p: Problem, layout: VecLayout, l: int, n0: int, nb: int) -> None:
    """This column tile's group scales and bias, once the previous tile's drains are done."""
    if p.scales is None and p.bias is None:
        return
    em.depend((l, "vec"), (l, "dma"))
    if p.scales is not None:
        em.emit(DmaLoad(l, frozenset({l}), View("vec", layout.scales, nb, 1),
                        DramRef(p.scales, n0, p.n_pad), p.groups, nb))
    if p.bias is not None:
        em.emit(DmaLoad(l, frozenset({l}), View("vec", layout.bias, nb, 1), DramRef(p.bias, n0, p.n_pad), 1, nb))


def _split(em: Emitter) -> str:
    return "k" if em.arch.parallel_accumulators and em.arch.cores > 1 else "n"


def _group_passes(em: Emitter, p: Problem, t: Tiles, l: int, m: int, n0: int, nb: int, g: int) -> None:
    """acc = (act rows of group g) . W_g [+ the zero-point correction of group g]."""
    bits = MODE_BITS[p.mode]
    row_bytes = p.n_pad * bits // 8
    g0, g1 = g * p.block, min(p.K, (g + 1) * p.block)
    wgt = View("wgt", 0, nb * bits // 8, 1)
    for k0 in range(g0, g1, t.depth):
        kc = min(t.depth, g1 - k0)
        em.depend((l, "mat"), (l, "dma"))          # the weight buffer is free again
        em.emit(DmaLoad(l, frozenset({l}), wgt, DramRef(p.weight, k0 * row_bytes + n0 * bits // 8, row_bytes),
                        kc, nb * bits // 8))
        em.depend((l, "dma"), (l, "mat"))
        em.emit(MatMul(l, View("acc", 0, nb, 1), View("act", k0, p.K, 1), wgt, m, kc, nb, p.mode, _split(em),
                       "set" if k0 == g0 else "add", None))
    if p.corr_row is None:
        return
    cbits = MODE_BITS[p.corr_mode]
    cwgt = View("wgt", 0, nb * cbits // 8, 1)
    crow_bytes = p.n_pad * cbits // 8
    em.depend((l, "mat"), (l, "dma"))
    em.emit(DmaLoad(l, frozenset({l}), cwgt, DramRef(p.corr_weight, g * p.k2 * crow_bytes + n0 * cbits // 8,
                                                     crow_bytes), p.k2, nb * cbits // 8))
    em.depend((l, "dma"), (l, "mat"))
    # One row of e = zp - offset, streamed to every accumulator row (row stride 0).
    em.emit(MatMul(l, View("acc", 0, nb, 1), View("act", t.rows * p.K, 0, 1), cwgt, m, p.k2, nb,
                   p.corr_mode, _split(em), "add", None))


def _drain_group(em: Emitter, p: Problem, layout: VecLayout, l: int, m: int, nb: int, g: int) -> None:
    em.depend((l, "mat"), (l, "vec"))
    if g == 0:
        em.depend((l, "dma"), (l, "vec"))              # column vectors loaded, previous store done
    rscale = None if p.rscale is None else layout.rscale
    cscale = None if p.scales is None else layout.scales + g * nb
    bias = layout.bias if p.bias is not None and g == 0 else None
    em.emit(Drain(l, View("vec", layout.result, nb, 1), View("acc", 0, nb, 1), m, nb,
                  None, rscale, cscale, bias, "set" if g == 0 else "add"))
    em.depend((l, "vec"), (l, "mat"))                  # the accumulators may be overwritten


def _finish_and_store(em: Emitter, p: Problem, layout: VecLayout, l: int, m0: int, m: int, n0: int, nb: int) -> None:
    res = View("vec", layout.result, nb, 1)
    if p.requant is not None:
        zp, lo, hi = p.requant
        em.emit(BY_MNEMONIC["vround"](l, res, res, m, nb))
        em.emit(BY_MNEMONIC["vadd"](l, res, res, float(zp), m, nb))
        em.emit(BY_MNEMONIC["vmax"](l, res, res, float(lo), m, nb))
        em.emit(BY_MNEMONIC["vmin"](l, res, res, float(hi), m, nb))
    em.depend((l, "vec"), (l, "dma"))
    cols = min(nb, p.N - n0)
    if cols > 0:
        em.emit(DmaStore(l, DramRef(p.out, m0 * p.N + n0, p.N), res, m, cols))


def _store_accumulators(em: Emitter, p: Problem, l: int, m0: int, m: int, n0: int, nb: int) -> None:
    """Exact int32 results go from the accumulators to DRAM without a conversion."""
    em.depend((l, "mat"), (l, "dma"))
    cols = min(nb, p.N - n0)
    if cols > 0:
        em.emit(DmaStore(l, DramRef(p.out, m0 * p.N + n0, p.N), View("acc", 0, nb, 1), m, cols))
