"""How one quantized matmul is cut into tiles and emitted.

Each row block of the int8 activations is multicast to every Legion with one DRAM read; each
Legion owns a slice of output columns, streams its weight pieces through passes (plus the
zero-point correction pass), drains the accumulators once per weight block with that block's
scales, and stores the result.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from isa.arch import MODE_BITS, Arch
from isa.fields import DramRef, View
from isa.instructions import BY_MNEMONIC, DmaLoad, DmaStore, Drain, MatMul
from dlegion_cc.lower.emitter import Emitter


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
