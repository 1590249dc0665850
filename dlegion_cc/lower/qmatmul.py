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
per block, accumulating into fp32. A weight wider than int8 (8-bit codes minus a zero point
span [-255, 255]) is the sum of two or three int8 pieces, each streamed into the same
accumulators; every piece runs in the narrowest mode that holds it.
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


MAX_PIECES = 3


def weight_pieces(values: np.ndarray) -> list[np.ndarray]:
    """int8 matrices summing to ``values`` (just ``values`` when it is int8 already)."""
    pieces, rest = [], values.astype(np.int64)
    while not pieces or rest.any():
        if len(pieces) == MAX_PIECES:
            raise ValueError(f"weights spanning [{values.min()}, {values.max()}] need more than "
                             f"{MAX_PIECES} int8 pieces")
        pieces.append(np.clip(rest, -128, 127))
        rest = rest - pieces[-1]
    return pieces


@dataclass(frozen=True)
class Weights:
    """The constant operand as the arrays hold it, and the scales applied when draining."""

    values: np.ndarray                 # int [K, N] or [batches, K, N]; the narrowest mode holding
                                       # each piece is used
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
    factor: float | None = None        # ... or by rscale * factor, rounded once to fp32


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
                       a.get("row_divisor", False), a.get("rscale_factor"))
    weights = Weights(np.asarray(a["weight"]), scales, a.get("block", 0), a.get("bias"))
    requant = None if a.get("requant") is None else tuple(a["requant"])
    lower_qmatmul(low, node.name, acts, weights, Output(node.outputs[0], requant))


@dataclass(frozen=True)
class Problem:
    """One quantized matmul, its operands already in DRAM (tensor indices)."""

    a8: int                  # i8 [M, K] activations - offset
    rscale: int | None       # f32 [M]
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


def lower_qmatmul(low: Lowering, name: str, acts: Activations, w: Weights, out: Output) -> None:
    """Emit ``out = scale((acts - zp) . w)`` (see the module docstring).

    Batched weights [batches, K, N] multiply consecutive equal slices of the activation rows.
    """
    em, arch = low.em, low.em.arch
    values = w.values if w.values.ndim == 3 else w.values[None]
    batches, K, N = values.shape
    shape = low.shape(acts.name)
    M = math.prod(shape[:-1])
    if not shape or shape[-1] != K:
        raise ValueError(f"activations '{acts.name}' of shape {list(shape)} do not have K={K} columns")
    if batches > 1 and math.prod(shape[:-2]) != batches:
        raise ValueError(f"{batches} batches of weights but activations of shape {list(shape)}")
    block = w.block or K
    a8 = int8_rows(low, acts.name, acts.offset)
    rscale = row_scales(low, acts, M) if acts.rscale else None
    corrs = [correction(low, f"{name}_{b}" if batches > 1 else name, acts, v, block) for b, v in enumerate(values)]
    em.barrier()                                        # every Legion reads what the vector unit wrote
    n_pad = math.ceil(N / arch.array) * arch.array
    groups = math.ceil(K / block)
    scales = None if w.scales is None else em.const(f"{name}_scales", _pad_cols(
        np.broadcast_to(np.asarray(w.scales, np.float32).reshape(-1, N), (groups, N)), n_pad), "f32")
    bias = None if w.bias is None else em.const(f"{name}_bias", _pad_cols(
        np.asarray(w.bias, np.float32).reshape(1, N), n_pad)[0], "f32")
    dst = low.result(out.name)
    exact = (low.dtype(out.name) == np.int32 and em.tensors[dst.tensor].dtype == "i32"
             and rscale is None and scales is None and bias is None and out.requant is None)
    per = M // batches
    for b, v in enumerate(values):
        weights = tuple(_weight_const(em, f"{name}_w{b or ''}{i or ''}", piece, n_pad)
                        for i, piece in enumerate(weight_pieces(v)))
        p = Problem(a8, rscale, weights, scales, groups, block, bias, *corrs[b], out.requant, exact,
                    dst.tensor, range(b * per, (b + 1) * per), K, N, n_pad)
        emit_tiles(em, p, plan_tiles(arch, p))


def _pad_cols(a: np.ndarray, n_pad: int) -> np.ndarray:
    return np.pad(a, ((0, 0), (0, n_pad - a.shape[1])))


def _weight_const(em: Emitter, name: str, piece: np.ndarray, n_pad: int) -> tuple[int, str]:
    mode = pick_mode(em.arch, mode_for(piece))
    return em.const(name, _pad_cols(piece, n_pad).astype(np.int8), WEIGHT_DTYPE[mode]), mode


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


def row_scales(low: Lowering, acts: Activations, M: int) -> int:
    """f32 [M]: the drain's per-row scale: s, 1 / s (the graph divides by s) or s * factor."""
    em, s = low.em, acts.rscale
    rs = em.tensor(f"{s}_rscale", "f32", (M,), "scratch")

    def body(e, l, v, r, c):
        if acts.factor is not None:
            e.emit(BY_MNEMONIC["vmul"](l, v["out"], v["s"], float(np.float32(acts.factor)), r, c))
        else:
            e.emit(BY_MNEMONIC["vrecip" if acts.divisor else "vmov"](l, v["out"], v["s"], r, c))
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
        if (c.size if c is not None else math.prod(low.shape(zp))) != 1:
            raise ValueError(f"zero point '{zp}' is not per tensor (per-row zero points are not supported)")
        zp = zp if c is None else int(c.reshape(()))
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
    corr_depth: int    # correction weight rows loaded at once
    per_legion: int    # output columns owned by each Legion


def _depth(arch: Arch, cols: int, mode: str, most: int) -> int:
    """Weight rows of ``cols`` columns the wgt scratchpad holds, whole arrays unless all ``most``."""
    depth = min(most, arch.derived.spad_elems["wgt"] * 8 // (cols * MODE_BITS[mode]))
    depth = depth if depth == most else depth // arch.array * arch.array
    if depth < 1:
        raise ValueError(f"a weight chunk of {cols} columns does not fit the wgt scratchpad of {arch.name}")
    return depth


def plan_tiles(arch: Arch, p: Problem) -> Tiles:
    d, na = arch.derived, arch.array
    cap = d.spad_elems
    per_legion = math.ceil(p.n_pad / na / arch.legions) * na
    rows = min(len(p.rows), (cap["act"] - p.k2) // p.K, cap["acc"] // na)
    if rows < 1:
        raise ValueError(f"an activation row of {p.K} int8 does not fit the act scratchpad of {arch.name}")
    per_col = rows + p.groups + 1                      # result, group scales, bias
    cols = min(per_legion, cap["acc"] // rows, (cap["vec"] - rows) // per_col) // na * na
    if cols < na:
        raise ValueError(f"a {na}-column tile of {rows} rows does not fit the scratchpads of {arch.name}")
    corr_depth = _depth(arch, cols, p.corr_mode, p.k2) if p.k2 else 0
    widest = max((mode for _, mode in p.weights), key=MODE_BITS.get)
    return Tiles(rows, cols, _depth(arch, cols, widest, p.block), corr_depth, per_legion)


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
    for m0 in range(p.rows.start, p.rows.stop, t.rows):
        m = min(t.rows, p.rows.stop - m0)
        if m0:                              # earlier blocks are done with act and rscale
            for l in sorted(owners):
                em.depend((l, "mat"), (0, "dma"))
                em.depend((l, "vec"), (0, "dma"))
        if m0 == p.rows.start and p.corr_row is not None:   # it stays after the activation rows
            em.emit(DmaLoad(0, owners, View("act", t.rows * p.K, p.k2, 1), DramRef(p.corr_row, 0, p.k2), 1, p.k2))
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
    g0, g1 = g * p.block, min(p.K, (g + 1) * p.block)
    for i, (weight, mode) in enumerate(p.weights):
        _stream(em, l, m, n0, nb, weight, mode, p.n_pad, range(g0, g1), 0, p.K, t.depth, i == 0)
    if p.corr_row is not None:
        # The row e = zp - offset, streamed to every accumulator row (row stride 0).
        rows = range(g * p.k2, (g + 1) * p.k2)
        _stream(em, l, m, n0, nb, p.corr_weight, p.corr_mode, p.n_pad, rows, t.rows * p.K - rows.start, 0,
                t.corr_depth, False)


def _stream(em: Emitter, l: int, m: int, n0: int, nb: int, weight: int, mode: str, n_pad: int, rows: range,
            act_base: int, act_rs: int, depth: int, first_sets: bool) -> None:
    """acc (+)= act . weight[rows, n0:n0+nb], loading ``depth`` weight rows at a time; weight row k
    meets the activations at act[act_base + k]."""
    bits = MODE_BITS[mode]
    row_bytes = n_pad * bits // 8
    wgt = View("wgt", 0, nb * bits // 8, 1)
    for k0 in range(rows.start, rows.stop, depth):
        kc = min(depth, rows.stop - k0)
        em.depend((l, "mat"), (l, "dma"))          # the weight buffer is free again
        em.emit(DmaLoad(l, frozenset({l}), wgt, DramRef(weight, k0 * row_bytes + n0 * bits // 8, row_bytes),
                        kc, nb * bits // 8))
        em.depend((l, "dma"), (l, "mat"))
        accumulate = "set" if first_sets and k0 == rows.start else "add"
        em.emit(MatMul(l, View("acc", 0, nb, 1), View("act", act_base + k0, act_rs, 1), wgt, m, kc, nb, mode,
                       _split(em), accumulate, None))


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


def _finish_and_store(em: Emitter, p: Problem, layout: VecLayout, l: int, m0: int, m: int, n0: int,
                      nb: int) -> None:
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
