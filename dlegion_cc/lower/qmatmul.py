"""Quantized matmuls on the systolic arrays (``dlegion.QMatMul``, and the ONNX integer matmuls).

``y = scale((A - zp) . W)``: the activations A are integers (int8 as they are, uint8 stored as
A - 128), the weight W is a constant of 2, 4 or 8 bits. Each Legion owns a slice of output
columns (of a part of the rows, where the cost model finds parts faster: ``qparts.py``); the
activations are multicast to every Legion (of the part), the packed weights stream through
passes split over the cores' K-slices (summed by the parallel accumulators), and the int32
accumulators drain with the per-row and per-column scales into fp32. How the work is cut and
ordered is chosen by a cost model (``qplan.py``) and emitted by ``qtiles.py``; all-zero weight
blocks are skipped (``Switches.sparsity``).

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
from dataclasses import dataclass, replace

import numpy as np

from isa.arch import MODE_BITS, MODE_TILES, Arch
from isa.instructions import BY_MNEMONIC
from dlegion_cc.ir import DLEGION
from dlegion_cc.lower.context import Lowering, lowers
from dlegion_cc.lower.emitter import Emitter
from dlegion_cc.lower import qlong, qrest
from dlegion_cc.lower.layout import Operand, is_contiguous, whole
from dlegion_cc.lower.movement import nd_copy
from dlegion_cc.lower.rowwise import Arg, rowwise
from dlegion_cc.lower.qparts import part_widths, pick_width, row_parts, split_rows
from dlegion_cc.lower.qplan import GATE_OPS
from dlegion_cc.lower.qtiles import Problem, RowScale, Segment, emit_tiles
from dlegion_cc.passes.attention import LOW_STEPS
from dlegion_cc.passes.causal import reach
from dlegion_cc.passes.gated import gate_granule

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
    if _fits_int8(values):
        return [values.astype(np.int8, copy=False)]
    pieces, rest = [], values.astype(np.int64)
    while not pieces or rest.any():
        if len(pieces) == MAX_PIECES:
            raise ValueError(f"weights spanning [{values.min()}, {values.max()}] need more than "
                             f"{MAX_PIECES} int8 pieces")
        pieces.append(np.clip(rest, -128, 127))
        rest = rest - pieces[-1]
    return pieces


def _fits_int8(values: np.ndarray) -> bool:
    if values.dtype == np.int8:
        return True
    if not np.issubdtype(values.dtype, np.integer):
        return False            # a float weight is truncated as the general case does
    return not values.size or (-128 <= values.min() and values.max() <= 127)


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
    residual: str | None = None        # a graph value of the output's shape added before the store


@lowers("QMatMul", domain=DLEGION)
def qmatmul(low: Lowering, node) -> None:
    for _ in qmatmul_blocks(low, node):
        pass


def qmatmul_blocks(low: Lowering, node, blocks: list[range] | None = None, vec_room: int = 0,
                   rings: dict | None = None, defer: bool = False, beside: float = 0,
                   cut: tuple[int, int] = (0, 0)):
    """``qmatmul``, a generator that emits the rows of each of ``blocks`` in turn (all the rows
    when None) and yields after each: a caller interleaves them with other nodes' row blocks
    (``rowblocks.py``), whose kernels run in ``vec`` past the plans' ``vec_room`` (0: all).
    ``rings``: the scratchpad slots the matmul emitted before it left (``emit_tiles``), handed
    on from block to block and to the matmul after it. ``defer``: columns split off (``qrest``)
    are emitted after the last yield, when the caller asks once more, not with the last block.
    ``beside``: the vector cycles of the row kernels beside its first block (``qlong``). ``cut``:
    a gated matmul's first and last windows a Legion block by block (``gated_cut``), in the
    steps ``GATED_STEPS``; (0, 0): none."""
    a = node.attrs
    q, s, zp, residual = (node.inputs + ["", "", ""])[:4]
    scales = a.get("scales")
    if scales is None and a.get("cscale") is not None:
        scales = np.asarray(a["cscale"], np.float32)[None, :]
    acts = Activations(q, a.get("act_offset", 0), zp or a.get("act_zero_point", 0), s or None,
                       a.get("row_divisor", False), a.get("rscale_factor"))
    weights = Weights(np.asarray(a["weight"]), scales, a.get("block", 0), a.get("bias"))
    requant = None if a.get("requant") is None else tuple(a["requant"])
    outs = [Output(o, requant, residual or None) for o in node.outputs]
    yield from _qmatmul_steps(low, node.name, acts, weights, outs[0] if len(outs) == 1 else outs,
                              a.get("segments"), blocks, vec_room, rings, a.get("gated"), defer, beside, cut)


def gated_cut(low: Lowering, node, blocks: list[range], before: float, after: float, late: int) -> tuple[int, int]:
    """``qlong.gated_windows`` of the chained gated matmul ``node`` in ``blocks``, beside row
    kernels of ``before`` and ``after`` vector cycles a block, starting ``late`` passes into
    their steps; (0, 0) for any other matmul. Its drains take an operation an element and the
    gate's on half of them (``qtiles._gate``)."""
    a, arch = node.attrs, low.em.arch
    if a.get("gated") is None or len(blocks) != qlong.GATED_BLOCKS:    # no cut: its weights' range unread
        return 0, 0
    w = np.asarray(a["weight"])
    mode = pick_mode(arch, mode_for(w) or "w8")
    K, N = w.shape
    return qlong.gated_windows(arch, mode, K, N, MODE_TILES[mode], blocks, before, after, 1 + GATE_OPS / 2,
                               late)


def lower_qmatmul(low: Lowering, name: str, acts: Activations, w: Weights, out: Output | list[Output],
                  segments: list[int] | None = None) -> None:
    """Emit ``out = scale((acts - zp) . w)`` (see the module docstring).

    Batched weights [batches, K, N] multiply consecutive equal slices of the activation rows.
    A fused matmul (``passes/siblings.py``) has several outputs, output i the next
    ``segments[i]`` columns of ``w``. The rows may be cut into parts, each on Legions of its
    own (``qparts``).
    """
    for _ in _qmatmul_steps(low, name, acts, w, out, segments, None, 0):
        pass


def _qmatmul_steps(low: Lowering, name: str, acts: Activations, w: Weights, out: Output | list[Output],
                   segments: list[int] | None, blocks: list[range] | None, vec_room: int,
                   rings: dict | None = None, gated: int | None = None, defer: bool = False,
                   beside: float = 0, cut: tuple[int, int] = (0, 0)):
    """``lower_qmatmul``, yielding after each of ``blocks`` (row ranges of a plain matmul, each
    scheduled for its own rows; the constants are made once). ``gated``: which of the two
    segments is the gate of the one output ReLU(gate)^2 * up (``passes/gated.py``); ``defer``,
    ``beside``, ``cut``: as ``qmatmul_blocks``."""
    em, arch = low.em, low.em.arch
    outs = out if isinstance(out, list) else [out]
    layouts = _Layouts(low, w, segments, gated)
    w, lay = layouts.laid(arch.legions)
    values = _batches(w)
    batches, K, N = values.shape
    shape = low.shape(acts.name)
    M = math.prod(shape[:-1])
    if not shape or shape[-1] != K:
        raise ValueError(f"activations '{acts.name}' of shape {list(shape)} do not have K={K} columns")
    if batches > 1 and math.prod(shape[:-2]) != batches:
        raise ValueError(f"{batches} batches of weights but activations of shape {list(shape)}")
    block = w.block or K
    groups = math.ceil(K / block)
    before = len(em.instrs)
    a8 = int8_rows(low, acts.name, acts.offset)
    rscale = row_scale(low, acts, M) if acts.rscale else None
    dsts = [low.result(o.name) for o in outs]
    dst, out = dsts[0], outs[0]
    exact = (low.dtype(out.name) == np.int32 and em.tensors[dst.tensor].dtype == "i32"
             and rscale is None and w.scales is None and w.bias is None and out.requant is None)
    per, chained = M // batches, blocks is not None
    if blocks is not None and batches > 1:
        raise ValueError("row blocks of a batched matmul")
    blocks = blocks or [range(b * per, (b + 1) * per) for b in range(batches)]
    per = len(blocks[0])
    corr = None if zero_point(low, acts) == acts.offset else correction_shape(arch, values[0], block)
    shapes = _Shapes(low, layouts, segments, rscale, block, corr, out.requant, exact, per, K, layouts.granule,
                     out.residual is not None)
    width = low.schedules.width(arch, per, lambda: pick_width(arch, low.switches, shapes.widths(), shapes.part))
    rest = None
    if width == arch.legions and gated is None and batches == 1 and corr is None and not exact:
        rest = qrest.split(arch, segments, shapes.tiles(), per)
    if rest:
        n, out_cols = np.shape(layouts.raw.values)[-1], low.shape(outs[-1].name)[-1]
        rest_part = _plain_part(low, f"{name}_rest", layouts.raw, n - rest.columns, n, groups, dsts[-1].tensor,
                                out_cols, out_cols - rest.columns, rest.width)
        segments = qrest.kept(segments, rest)
        layouts = _Layouts(low, _columns(layouts.raw, slice(0, sum(segments))), segments)
    if width != arch.legions or rest:
        w, lay = layouts.laid(width)
        values = _batches(w)
        N = values.shape[-1]
    corrs = [correction(low, f"{name}_{b}" if batches > 1 else name, acts, v, block) for b, v in enumerate(values)]
    resid = residual_rows(low, out, dst)
    if len(em.instrs) > before:
        em.barrier()                                    # every Legion reads what the vector unit wrote
    n_pad = math.ceil(N / arch.array) * arch.array
    plain = chained and defer and width == arch.legions and not segments and lay is None and not rest
    head = 0
    if plain and corr is None and not exact:        # the weights' range is read only where a cut may apply
        mode = pick_mode(arch, mode_for(np.asarray(layouts.raw.values)) or "w8")
        head = qlong.head_columns(arch, mode, K, N, shapes.tiles(), blocks, beside)
    if head:
        p = Problem(a8, rscale, (), None, groups, block, None, *corrs[0], out.requant, exact, dst.tensor,
                    blocks[0], K, N, n_pad, vec_room=vec_room, row_block=chained)
        yield from _long_steps(low, name, layouts.raw, head, p, blocks, {} if rings is None else rings)
        return
    segs = () if lay is None else lay.segments(low, outs, dsts, segments, rest is not None)
    if any(cut) and width == arch.legions:
        p = Problem(a8, rscale, (), None, groups, block, None, *corrs[0], out.requant, exact, dst.tensor,
                    blocks[0], K, N, n_pad, vec_room=vec_room, row_block=chained, gated=layouts.granule,
                    residual=resid)
        parts = _gated_parts(low, name, w, cut, arch.array * shapes.tiles(), groups, segs[0])
        yield from _gated_steps(low, parts, p, blocks, {} if rings is None else rings)
        return
    scales, bias = _drain_consts(em, name, w, groups, n_pad)
    made, plans, rings = {}, {}, {} if rings is None else rings
    for j, rows in enumerate(blocks):
        b = j if batches > 1 else 0
        if j:
            em.barrier()        # each block's plan reuses the scratchpad slots of the one before
        if b not in made:
            pieces, nonzero = layouts.pieces(width, b)
            made[b] = tuple(_weight_const(em, f"{name}_w{b or ''}{i or ''}", piece)
                            for i, piece in enumerate(pieces)), nonzero
            plans = {}          # a batch's own weights: its own plans
        weights, nonzero = made[b]
        p = Problem(a8, rscale, weights, scales, groups, block, bias, *corrs[b], out.requant, exact,
                    dst.tensor, rows, K, N, n_pad, nonzero, segs, vec_room=vec_room, row_block=chained,
                    gated=layouts.granule, residual=resid)
        _emit_parts(low, p, width, plans, rings if batches == 1 else None)
        if j < len(blocks) - 1 or defer or not rest:
            yield rows
        if not j and any(cut):      # a cut the deal of the Legions leaves no room for: its steps empty
            yield from [rows] * (len(GATED_STEPS) - len(blocks))
    if rest:
        em.barrier()
        rest_part.emit(replace(p, rows=range(blocks[0].start, blocks[-1].stop)), rings)
        if not defer:
            yield blocks[-1]


def _long_steps(low: Lowering, name: str, raw: Weights, head: int, p: Problem, blocks: list[range], rings: dict):
    """``qlong``'s cut of the plain matmul ``p``: its first ``head`` columns block by block, all
    but the last block's rows yielded after each; the rest of its columns over all the rows
    with the last block; then, when the caller asks once more (a step of its own at the chain's
    end, whose first loads go ahead of the long passes' last), the first columns' last block."""
    legions, out, N = low.em.arch.legions, p.out, p.N
    first = _plain_part(low, f"{name}_head", raw, 0, head, p.groups, out, N, 0, legions)
    rest = _plain_part(low, f"{name}_long", raw, head, N, p.groups, out, N, head, legions)
    for j, rows in enumerate(blocks):
        if j:
            low.em.barrier()    # each block's plan reuses the scratchpad slots of the one before
        if j < len(blocks) - 1:
            first.emit(replace(p, rows=rows), rings)
        else:                   # nothing of the chain reads its rows: no kernel beside it needs ``vec``
            rest.emit(replace(p, rows=range(blocks[0].start, rows.stop), vec_room=0), rings)
        yield rows
    low.em.barrier()
    first.emit(replace(p, rows=blocks[-1]), rings)


# The steps of a gated matmul's cut (``qlong.gated_windows``), in order: (its windows, row
# block; None: all the rows). The first windows' last block right after their first, before
# the middle windows rather than after them: the arrays pass one window set's two blocks in a
# row (2B4T BitLinear stack at 256 on dlegion-8x8, gate/up 3 and 7 windows: 275,482 ->
# 275,255 cycles; the last windows' first block before the first windows' last, 275,487).
GATED_STEPS = (("first", 0), ("first", 1), ("middle", None), ("last", 0), ("last", 1))


def _gated_steps(low: Lowering, parts: dict, p: Problem, blocks: list[range], rings: dict):
    """The gated matmul ``p`` in two row blocks cut into ``parts`` (``_gated_parts``), a step
    each (``GATED_STEPS``): its first windows a Legion over the first block (beside the kernel
    before it, which makes the last block's rows) and over the last block, its middle windows
    over all the rows, its last windows over the first block, which the kernel after it then
    has whole, and over the last block, beside that kernel's first block."""
    for j, (part, block) in enumerate(GATED_STEPS):
        if j:
            low.em.barrier()    # each step's plan reuses the scratchpad slots of the one before
        rows = range(blocks[0].start, blocks[-1].stop) if block is None else blocks[block]
        # No kernel runs beside the middle windows: their tiles of all the rows take all of ``vec``.
        parts[part].emit(replace(p, rows=rows, vec_room=p.vec_room if block is not None else 0), rings)
        yield rows


def _gated_parts(low: Lowering, name: str, laid: Weights, cut: tuple[int, int], window: int, groups: int,
                 seg: Segment) -> dict:
    """The first, middle and last windows of ``window`` columns of every Legion's slice of a
    gated weight ``laid`` out (``gated_major``: whole pairs of granules), ``cut`` first and
    last, each stored where it is in output ``seg``: half as many columns, from half its first
    on in each Legion's."""
    legions, (first, last) = low.em.arch.legions, cut
    per = np.shape(laid.values)[-1] // legions
    windows = per // window
    bounds = {"first": (0, first), "middle": (first, windows - last), "last": (windows - last, windows)}
    parts = {}
    for part, (lo, hi) in bounds.items():
        cols = (np.arange(legions)[:, None] * per + np.arange(lo * window, hi * window)).reshape(-1)
        parts[part] = _ColumnPart(low, f"{name}_{part}", _columns(laid, cols), groups,
                                  replace(seg, at=seg.at + lo * window // 2), legions)
    return parts


def _plain_part(low: Lowering, name: str, raw: Weights, lo: int, hi: int, groups: int, out: int, out_cols: int,
                at: int, width: int) -> "_ColumnPart":
    """Columns ``lo`` .. ``hi - 1`` of a plain weight on parts of ``width`` Legions, stored from
    column ``at`` of output ``out`` [rows, ``out_cols``]."""
    na = low.em.arch.array
    per_legion = math.ceil(math.ceil((hi - lo) / na) / width) * na
    return _ColumnPart(low, name, _columns(raw, slice(lo, hi)), groups, Segment(out, out_cols, per_legion, 0, at), width)


def _drain_consts(em: Emitter, name: str, w: Weights, groups: int, n_pad: int) -> tuple:
    """The drains' scales (one row per group of K) and bias of weight ``w``, columns padded to
    ``n_pad``; None where it has none."""
    N = np.shape(w.values)[-1]
    scales = None if w.scales is None else em.const(f"{name}_scales", _pad_cols(
        np.broadcast_to(np.asarray(w.scales, np.float32).reshape(-1, N), (groups, N)), n_pad), "f32")
    bias = None if w.bias is None else em.const(f"{name}_bias", _pad_cols(
        np.asarray(w.bias, np.float32).reshape(1, N), n_pad)[0], "f32")
    return scales, bias


def _columns(w: Weights, cols) -> Weights:
    """Columns ``cols`` (a slice or indices) of a plain weight, with their scales and bias."""
    n = np.shape(w.values)[-1]
    scales = None if w.scales is None else np.asarray(w.scales, np.float32).reshape(-1, n)[:, cols]
    bias = None if w.bias is None else np.asarray(w.bias, np.float32).reshape(-1)[cols]
    return Weights(np.asarray(w.values)[:, cols], scales, w.block, bias)


class _ColumnPart:
    """Some of a matmul's columns as a matmul of their own, on parts of ``width`` Legions: ``w``
    (laid out for them) stored as ``segment`` says; its constants (named ``name``) and its
    emission (``qrest``'s split-off columns, ``qlong``'s cuts)."""

    def __init__(self, low: Lowering, name: str, w: Weights, groups: int, segment: Segment, width: int):
        em, na = low.em, low.em.arch.array
        self.low, self.width, self.plans, self.segment = low, width, {}, segment
        self.N = np.shape(w.values)[-1]
        self.n_pad = math.ceil(self.N / na) * na
        pieces, self.nonzero = _pieces(low, w.values, self.n_pad)
        self.weights = tuple(_weight_const(em, f"{name}_w{i or ''}", piece) for i, piece in enumerate(pieces))
        self.scales, self.bias = _drain_consts(em, name, w, groups, self.n_pad)

    def emit(self, p: Problem, rings: dict | None) -> None:
        """These columns of ``p``'s rows; ``rings`` (``emit_tiles``): what the matmul before
        left, whose activation slots read least recently each part takes first."""
        arch, schedules = self.low.em.arch, self.low.schedules
        parts = arch.legions // self.width
        if rings is not None and parts > 1:
            act = rings.get(0, {}).get("act", [])
            rings = {j: {"act": act} for j in range(parts)}
        part = replace(p, weights=self.weights, scales=self.scales, bias=self.bias, out=self.segment.tensor,
                       N=self.N, n_pad=self.n_pad, nonzero=self.nonzero, segments=(self.segment,))
        with schedules.dealt((self.width, parts)):
            _emit_parts(self.low, part, self.width, self.plans, rings)


def _laid_out(w: Weights, segments: list[int] | None, legions: int, na: int, gated: int | None = None,
              granule: int = 0) -> tuple:
    """(weights, layout) of a fused matmul's weights laid out for ``legions`` Legions (the gate
    ``gated`` and the up segment in pairs of ``granule`` columns, ``gated_major``)."""
    if segments and gated is not None:
        lay = gated_major(segments[0], gated, legions, granule)
    else:
        lay = legion_major(segments, legions, na) if segments else None
    return (w if lay is None else lay.weights(w)), lay


class _Layouts:
    """A constant weight laid out for parts of each width, and each batch's int8 pieces with
    their block maps: made once, for the cost model's comparison of widths and the emission of
    the width picked (a layer's largest arrays: a copy costs more than a schedule search)."""

    def __init__(self, low: Lowering, raw: Weights, segments: list[int] | None, gated: int | None = None):
        self.low, self.raw, self.segments, self.gated = low, raw, segments, gated
        self.granule = 0 if gated is None else gate_granule(low.em.arch)
        self.made: dict = {}

    def laid(self, width: int) -> tuple:
        """(weights, layout) for parts of ``width`` Legions (``_laid_out``)."""
        key = ("laid", width if self.segments else None)     # only a fused weight moves
        if key not in self.made:
            self.made[key] = _laid_out(self.raw, self.segments, width, self.low.em.arch.array, self.gated,
                                       self.granule)
        return self.made[key]

    def pieces(self, width: int, batch: int) -> tuple[list, tuple]:
        """``_pieces`` of batch ``batch`` laid out for ``width``."""
        key = ("pieces", width if self.segments else None, batch)
        if key not in self.made:
            v = _batches(self.laid(width)[0])[batch]
            na = self.low.em.arch.array
            self.made[key] = _pieces(self.low, v, math.ceil(v.shape[1] / na) * na)
        return self.made[key]


def _batches(w: Weights) -> np.ndarray:
    """The weight values as [batches, K, N] (one batch for a plain matmul)."""
    return w.values if w.values.ndim == 3 else w.values[None]


def _pieces(low: Lowering, v: np.ndarray, n_pad: int) -> tuple[list, tuple]:
    """The int8 pieces of weights ``v`` (columns padded to ``n_pad``), and their nonzero block
    maps when zero blocks are skipped."""
    pieces = [_pad_cols(piece, n_pad) for piece in weight_pieces(v)]
    return pieces, block_maps(pieces, low.em.arch.array) if low.switches.sparsity else ()


def _emit_parts(low: Lowering, p: Problem, width: int, plans: dict, rings: dict | None = None) -> None:
    """``p`` on all the Legions, or its rows in parts of ``width`` Legions each (one plan for
    parts of the same rows, kept in ``plans`` by their count; ``rings``: the slots the row block
    before left, by part, ``emit_tiles``)."""
    arch, parts = low.em.arch, low.em.arch.legions // width
    for j, rows in enumerate(split_rows(p.rows, parts)):
        part = p if parts == 1 else replace(p, rows=rows, legions=range(j * width, (j + 1) * width))
        if len(rows) not in plans:
            plans[len(rows)] = low.schedules.plan(arch, part, low.switches)
        if low.schedules.k_split(arch, part, plans[len(rows)], low.switches, low.em):
            continue
        emit_tiles(low.em, part, plans[len(rows)], low.written,
                   rings=None if rings is None else rings.setdefault(j, {}))


@dataclass(frozen=True)
class _Shapes:
    """What the cost model needs of a constant-weight matmul to compare cuts of its rows: a
    part of the first batch, for each number of Legions a part may have."""

    low: Lowering
    layouts: _Layouts
    segments: list | None
    rscale: RowScale | None
    block: int
    corr: tuple | None          # (k2, mode) of the zero-point correction
    requant: tuple | None
    exact: bool
    rows: int
    K: int
    granule: int = 0
    residual: bool = False

    def widths(self) -> list[int]:
        arch = self.low.em.arch
        p = self.part(arch.legions)
        return part_widths(arch, self.rows, p.n_pad // arch.array, self.tiles())

    def tiles(self) -> int:
        """Windows a pass of the widest mode of the weight's pieces holds."""
        return max(MODE_TILES[m] for _, m in self.part(self.low.em.arch.legions).weights)

    def part(self, width: int) -> Problem:
        arch = self.low.em.arch
        w, lay = self.layouts.laid(width)
        N = w.values.shape[-1]
        n_pad = math.ceil(N / arch.array) * arch.array
        pieces, nonzero = self.layouts.pieces(width, 0)
        weights = tuple((0, _piece_mode(arch, piece)) for piece in pieces)
        segs = () if lay is None else tuple(Segment(0, n, wd, off) for n, wd, off in
                                            zip(self.segments, lay.widths, lay.offsets))
        rows = range(self.rows * width // arch.legions)
        # Tensor indices are placeholders (0): the model reads shapes, modes and block maps.
        return Problem(0, self.rscale, weights, None if w.scales is None else 0, math.ceil(self.K / self.block),
                       self.block, None if w.bias is None else 0, *((None, None, 0, "w8") if self.corr is None
                                                                     else (0, 0, *self.corr)), self.requant, self.exact,
                       0, rows, self.K, N, n_pad, nonzero, segs, legions=range(width), gated=self.granule,
                       residual=0 if self.residual else None)


def lower_run_time_weights(low: Lowering, a: str, b: str, out: str, ra: str | None = None,
                           rb: str | None = None, zero_a: np.ndarray | None = None,
                           dead: np.ndarray | None = None, lo: tuple | None = None) -> None:
    """``out = a . b``: ``run_time_weights_groups`` with every batch in one go."""
    for _ in run_time_weights_groups(low, a, b, out, ra, rb, zero_a, dead, lo=lo):
        pass


# The products of two operands in two int8 pieces each (hi, lo), as (activation piece, weight
# piece, scale group): hi.hi drained with the column scales rb, lo.hi + hi.lo summed exactly
# in the accumulators and drained with rb / LOW_STEPS (a's lo piece has the scale
# ra / LOW_STEPS, b's rb / LOW_STEPS: either way ra . rb / LOW_STEPS). lo.lo is left out.
TWO_PIECE_TERMS = ((0, 0, 0), (1, 0, 1), (0, 1, 1))


def run_time_weights_groups(low: Lowering, a: str, b: str, out: str, ra: str | None = None,
                            rb: str | None = None, zero_a: np.ndarray | None = None,
                            dead: np.ndarray | None = None, groups: list[range] | None = None,
                            vec_room: int = 0, lo: tuple | None = None):
    """``out = a . b`` in int32 for int8 operands both computed at run time (a graph that
    quantizes attention's QK^T or PV): b's rows, as they are in DRAM, are the weight rows the
    arrays load in mode w8. Each batch of b multiplies its slice of a's rows; the weights'
    zero blocks are unknown when compiling, so every window is passed. With ``ra`` and ``rb``
    (fp32 [.., M, 1] and [.., N, 1]: attention quantized by the compiler), the drain multiplies
    row i by ``ra[i]`` and column j of each batch by ``rb[j]`` into an fp32 ``out``. ``zero_a``
    [M / batches, K]: entries of each batch's a that are exact zeros (a causal P); the weight
    rows past a row block's last nonzero are neither loaded nor passed. ``dead`` [M / batches,
    N]: outputs nothing looks at (a causal QK^T); the weight columns past a row block's last
    live output are neither loaded nor passed, nor its all-dead tiles drained or stored.
    A generator: it emits the batches of each of ``groups`` (equal ranges of batches; all of
    them when None) in turn and yields after each, its drains planned in the first
    ``vec_room`` elements of ``vec`` (0: all), so a caller interleaves them with row kernels
    (``heads.py``). ``lo``: (a_lo, b_lo), the operands' second int8 pieces (``passes/attention.py``:
    scales ``ra / LOW_STEPS`` and ``rb / LOW_STEPS``): the sum of the products ``TWO_PIECE_TERMS``
    (``--attention int8x2``), drained into one fp32 ``out`` (hi.hi first, then the sum of the
    cross products added)."""
    em, arch = low.em, low.em.arch
    shape, bshape = low.shape(a), low.shape(b)
    if len(bshape) < 2 or not shape or shape[-1] != bshape[-2]:
        raise ValueError(f"A of shape {list(shape)} and B of shape {list(bshape)} do not multiply")
    K, N = bshape[-2:]
    batches, M = math.prod(bshape[:-2]), math.prod(shape[:-1])
    if batches > 1 and math.prod(shape[:-2]) != batches:
        raise ValueError(f"B of shape {list(bshape)} is not one matrix per batch of A {list(shape)}")
    n_pad = math.ceil(N / arch.array) * arch.array
    per = M // batches
    width, parts = low.schedules.deal(arch, per, lambda: row_parts(arch, per, n_pad))
    before = len(em.instrs)
    a8 = int8_rows(low, a, 0)
    if ra is None:
        w, w_offsets = int8_rows(low, b, 0, width=n_pad), [i * K * n_pad for i in range(batches)]
        ops = _RunTime(a8, None, ((w, "w8"),), w_offsets, None, [0] * batches)
    elif lo is None:
        w, w_offsets = _distinct(low, b, low.operand(b), low.shape(b), n_pad, "i8")
        scales, s_offsets = _run_time_column_scales(low, rb, N, n_pad)
        ops = _RunTime(a8, _run_time_row_scale(low, ra, M), ((w, "w8"),), w_offsets, scales, s_offsets)
    else:
        deal = _interleave(arch, dead, lo, N, width, parts, low.switches.sparsity)
        ops = _two_pieces(low, a8, ra, b, rb, lo, M, N, n_pad, deal)
    if len(em.instrs) > before:
        em.barrier()                                    # the arrays load what the vector unit wrote
    dst = low.result(out)
    exact = ops.rscale is None
    if exact and em.tensors[dst.tensor].dtype != "i32":
        raise ValueError(f"output '{out}' is not stored as int32")
    places = _row_places(dst, low.shape(out), batches, per)
    if ops.n_origin is not None:        # stored by segments, at the output's own row stride
        places = [(o, s or N) for o, s in places]
    k_reach = _reach_of(zero_a, (per, K), batches, low.switches.sparsity)
    n_reach = _reach_of(dead, (per, N), batches, low.switches.sparsity)
    plans: dict = {}            # by the rows of a part: parts alike have one plan
    for g, group in enumerate(groups or [range(batches)]):
        if g:
            em.barrier()        # each group's plans reuse the scratchpad slots of the one before
        _emit_run_time_group(low, ops, exact, dst, group, per, K, N, n_pad,
                             places, k_reach, n_reach, width, parts, plans, vec_room)
        yield group


@dataclass(frozen=True)
class _RunTime:
    """A run-time product's operands in DRAM: a's int8 pieces (the first, ``a8``, and the rest),
    b's as the weight pieces with each batch's offset in them, the row scales and each batch's
    column scales (a row per scale group) with their offsets, and the products of pieces."""

    a8: int
    rscale: RowScale | None
    weights: tuple
    w_offsets: list
    scales: int | None
    s_offsets: list
    a_pieces: tuple = ()
    terms: tuple = ()
    segments: tuple = ()
    n_origin: np.ndarray | None = None


def _interleave(arch: Arch, dead, lo: tuple | None, N: int, width: int, parts: int,
                sparsity: bool) -> tuple | None:
    """How a causal QK^T of pieces deals its columns: (Legions, blocks a Legion, block width),
    Legion l taking the array-wide blocks l, l + Legions, ..., so that every Legion's tiles
    reach as far into the causal triangle; None: in order. Dealt in order, the Legion of the
    first columns, which every row looks at, passes them all while the last ones skip most, and
    the busiest Legion does the dense product (2B4T layer at 512 on dlegion-8x8, int8x2: QK^T's
    passes 131k cycles on Legions 0-3 and 66k on 4-7 in order, 99k on each interleaved; the
    layer 1,014,058 -> 996,017 cycles). Products of one piece keep the order: their head groups
    wait on the vector unit and DMA, not on the arrays (the int8 layer 838,397 -> 847,720)."""
    na = arch.array
    if lo is None or dead is None or not sparsity or parts != 1 or N % (na * width) or N // (na * width) < 2:
        return None
    return width, N // (na * width), na


def _origin(deal: tuple) -> np.ndarray:
    """Per column in the order ``deal`` gives them, the output column it is."""
    legions, blocks, na = deal
    cols = np.arange(legions * blocks * na).reshape(legions, blocks, na)
    return (((cols // na % blocks) * legions + cols // (blocks * na)) * na + cols % na).reshape(-1)


def _two_pieces(low: Lowering, a8: int, ra: str, b: str, rb: str, lo: tuple, M: int, N: int,
                n_pad: int, deal: tuple | None = None) -> _RunTime:
    """The operands of ``TWO_PIECE_TERMS``: b's pieces at the same offsets in their tensors
    (each batch's offset serves both), the column scales rb and rb / LOW_STEPS as two scale groups; with
    ``deal`` (``_interleave``) the columns dealt in its order (``Problem.n_origin``: read where
    they are, the output stored by segments)."""
    a_lo, b_lo = lo
    laid = lambda copy: [_distinct(low, x, low.operand(x), low.shape(x), n_pad, "i8", copy=copy)  # noqa: E731
                         for x in (b, b_lo)]
    (w, w_offsets), (w_lo, lo_offsets) = laid(False)
    if lo_offsets != w_offsets:        # copies of both, laid out alike
        (w, w_offsets), (w_lo, lo_offsets) = laid(True)
    if lo_offsets != w_offsets:
        raise ValueError(f"b's pieces '{b}' and '{b_lo}' are not repeated alike")
    scales, s_offsets = _run_time_column_scales(low, rb, N, n_pad, LOW_STEPS)
    segs, origin = (), None
    if deal is not None:
        legions, blocks, na = deal
        # Segment j: output columns j * legions * na on, na of them a Legion (the tensor: the output's)
        segs = tuple((legions * na, na, j * na, j * legions * na) for j in range(blocks))
        origin = _origin(deal)
    return _RunTime(a8, _run_time_row_scale(low, ra, M), ((w, "w8"), (w_lo, "w8")), w_offsets, scales, s_offsets,
                    (int8_rows(low, a_lo, 0),), TWO_PIECE_TERMS, segs, origin)


def _emit_run_time_group(low, ops: _RunTime, exact, dst, group, per, K, N, n_pad,
                         places, k_reach, n_reach, width, parts, plans, vec_room) -> None:
    em, arch = low.em, low.em.arch
    groups = 1 + max((g for *_, g in ops.terms), default=0)
    for j, rows in enumerate(split_rows(range(per), parts)):
        batch = [Problem(ops.a8, ops.rscale, ops.weights, ops.scales, groups, K, None, None, None, 0, "w8", None,
                         exact, dst.tensor, range(i * per + rows.start, i * per + rows.stop), K, N, n_pad,
                         w_offset=ops.w_offsets[i], s_offset=ops.s_offsets[i], legions=range(j * width, (j + 1) * width),
                         k_reach=k_reach, n_reach=n_reach, o_offset=places[i][0], o_stride=places[i][1],
                         vec_room=vec_room, a_pieces=ops.a_pieces, terms=ops.terms,
                         segments=tuple(Segment(dst.tensor, *seg) for seg in ops.segments), n_origin=ops.n_origin)
                 for i in group]
        if len(rows) not in plans:
            # The schedule searched for the product without its causal skips, which then skips
            # what it can: the cost model does not see what splitting the Legions' spans costs,
            # and the schedules it chose for the skips made the 2B4T layer slower (281,395 ->
            # 283,267 cycles at sequence 128; 1,197,565 -> 1,199,963 at 512). Columns dealt
            # interleaved (``_interleave``) skip alike on every Legion, and the search sees them
            # (2B4T layer at 512, int8x2: 988,221 -> 982,051 cycles).
            dense = replace(batch[0], batches=len(group), k_reach=None,
                            n_reach=None if ops.n_origin is None else n_reach)
            plans[len(rows)] = replace(low.schedules.plan(arch, dense, low.switches),
                                       sparse=k_reach is not None or n_reach is not None)
        emit_tiles(em, batch[0], plans[len(rows)], low.written, more=tuple(batch[1:]))


def _matrices_in_place(node, name: str, op: Operand) -> bool:
    """Attention's quantized K/V and their scales are read as views (``_distinct``): every
    input but the activation pieces (the first and, of two pieces, the fifth)."""
    return name in node.inputs[2:4] + node.inputs[5:]


def _rows_in_place(node, name: str, op: Operand) -> bool:
    """The product's rows are stored wherever a view puts them, each row's columns
    consecutive: P.V's heads straight into the merged rows the projection after it reads."""
    return bool(op.strides) and op.strides[-1] == 1


def _row_places(dst: Operand, shape: tuple, batches: int, per: int) -> list[tuple[int, int]]:
    """Per batch of ``per`` output rows, (offset, row stride) such that row m of the product
    (counted over every batch) is stored at ``offset + m * stride``; (0, 0) for every batch of a
    contiguous output, stored as the rows of one matrix."""
    if is_contiguous(dst, shape) and dst.offset == 0:
        return [(0, 0)] * batches
    if math.prod(shape[:-2]) != batches:
        raise ValueError(f"output of shape {list(shape)} is placed by a view but is not {batches} matrices")
    stride = dst.strides[-2]
    return [(dst.at(idx).offset - i * per * stride, stride)
            for i, idx in enumerate(np.ndindex(*shape[:-2]))]


def _distinct(low: Lowering, name: str, op: Operand, shape: tuple, width: int, dtype: str,
              copy: bool = False) -> tuple[int, list[int]]:
    """``op`` [.., rows, n] as a tensor of matrices whose rows are ``width`` apart, and the
    offset of each batch's matrix: the value where it is when it is laid out so (unless
    ``copy``), else a copy of each distinct matrix (a batch axis with a 0 stride repeats one:
    grouped-query attention's K/V heads are copied once, not once per query head)."""
    em = low.em
    rows, n = shape[-2:]
    if (not copy and em.tensors[op.tensor].dtype == dtype and n == width and op.strides[-1] == 1
            and (rows == 1 or op.strides[-2] == n)):
        return op.tensor, [op.at(idx).offset for idx in np.ndindex(*shape[:-2])]
    batch = shape[:-2]
    kept = tuple(1 if s == 0 else d for d, s in zip(batch, op.strides[:-2]))
    t = em.tensor(f"{name}_{dtype}", dtype, (*kept, rows, width), "scratch")
    dst = whole(t, (*kept, rows, width))
    nd_copy(em, dst, op, (*kept, rows, n))
    return t, [dst.at(tuple(0 if s == 0 else i for i, s in zip(idx, op.strides))).offset
               for idx in np.ndindex(*batch)]


@lowers("AttnMatMul", domain=DLEGION, views=_matrices_in_place, writes=_rows_in_place)
def attn_matmul(low: Lowering, node) -> None:
    """``a8 . b8`` scaled per row by ``ra`` and per column by ``rb`` (``passes/attention.py``)."""
    a8, ra, b8, rb, *lo = node.inputs
    lower_run_time_weights(low, a8, b8, node.outputs[0], ra, rb, node.attrs.get("zero_a"), node.attrs.get("dead"),
                           tuple(lo) or None)


def _reach_of(mask: np.ndarray | None, shape: tuple, batches: int, sparsity: bool) -> np.ndarray | None:
    """Per row of every batch, 1 + the last entry of ``mask`` [rows, n] (the same for every
    batch) that is false: the leading columns the row needs. None when nothing is skipped."""
    if mask is None or not sparsity or np.shape(mask) != shape:
        return None
    return np.tile(reach(~np.asarray(mask)), batches)


def _run_time_row_scale(low: Lowering, ra: str, M: int) -> RowScale:
    op = low.operand(ra)
    if math.prod(low.shape(ra)) != M or op != whole(op.tensor, low.shape(ra)):
        raise ValueError(f"row scale '{ra}' of shape {list(low.shape(ra))} is not one contiguous value per row")
    return RowScale(op.tensor, op.offset, 1)


def _run_time_column_scales(low: Lowering, rb: str, N: int, n_pad: int,
                            low_steps: float | None = None) -> tuple[int, list[int]]:
    """An f32 tensor of each batch's column scales (``rb`` [.., N, 1], read as [.., 1, N]) and
    each batch's offset; with ``low_steps``, a second row (scale group) of each, ``rb /
    low_steps``, the scales of b's second int8 piece (divided as ``passes/attention.py``'s
    graph divides them), both rows copied together."""
    op, shape = low.operand(rb), low.shape(rb)
    if shape[-2:] != (N, 1):
        raise ValueError(f"column scale '{rb}' of shape {list(shape)} is not one value per column of each batch")
    row, batch = Operand(op.tensor, op.offset, (*op.strides[:-2], 0, op.strides[-2])), shape[:-2]
    if low_steps is None:
        return _distinct(low, rb, row, (*batch, 1, N), n_pad, "f32")
    kept = tuple(1 if s == 0 else d for d, s in zip(batch, row.strides[:-2]))
    t = low.em.tensor(f"{rb}_groups", "f32", (*kept, 2, n_pad), "scratch")
    dst = whole(t, (*kept, 2, n_pad))
    nd_copy(low.em, dst, row, (*kept, 1, N))
    body = lambda e, l, v, r, c: e.emit(BY_MNEMONIC["vdiv"](l, v["out"], v["src"], float(low_steps), r, c))  # noqa: E731
    rowwise(low.em, (*kept, 1, N), [Arg("src", row), Arg("out", Operand(t, dst.offset + n_pad, dst.strides), out=True)],
            body)
    return t, [dst.at(tuple(0 if s == 0 else i for i, s in zip(idx, row.strides[:-2]))).offset
               for idx in np.ndindex(*batch)]


# --- fused matmuls ------------------------------------------------------------------------

@dataclass(frozen=True)
class LegionMajor:
    """How a fused weight's columns are laid out: every Legion's slice holds ``widths[i]``
    columns of segment i (``ceil(N_i / legions)``) from ``offsets[i]`` on, so every Legion does
    the same work and each segment's columns are stored with a span."""

    columns: np.ndarray      # int [legions * per_legion]: the source column, -1 for padding
    widths: tuple
    offsets: tuple
    per_legion: int

    def weights(self, w: Weights) -> Weights:
        """``w`` (its scales and bias too) laid out."""
        scales = None if w.scales is None else self.take(np.asarray(w.scales, np.float32).reshape(
            -1, np.shape(w.values)[-1]))
        bias = None if w.bias is None else self.take(np.asarray(w.bias, np.float32).reshape(-1))
        return Weights(self.take(np.asarray(w.values)), scales, w.block, bias)

    def segments(self, low: Lowering, outs: list[Output], dsts: list, sizes: list[int], cut: bool = False) -> tuple:
        """The outputs' segments; ``cut``: the last output's last columns are stored by another
        matmul (``qrest``), its segment only the first ``sizes[-1]``."""
        widths = [low.shape(o.name)[-1] for o in outs]
        for o, n, wide in zip(outs, sizes, widths):
            if wide != n and not (cut and o is outs[-1] and wide > n):
                raise ValueError(f"output '{o.name}' of shape {list(low.shape(o.name))} is not {n} columns wide")
        return tuple(Segment(d.tensor, wide, width, offset)
                     for d, wide, width, offset in zip(dsts, widths, self.widths, self.offsets))

    def take(self, a: np.ndarray) -> np.ndarray:
        """``a``'s last axis in this layout, zero at padding. Copied by runs of consecutive
        columns (a Legion's share of a segment): a slice copies far faster than a gather."""
        out = np.zeros(a.shape[:-1] + self.columns.shape, a.dtype)
        for dst, src, n in _runs(self.columns):
            out[..., dst:dst + n] = a[..., src:src + n]
        return out


def _runs(columns: np.ndarray) -> list[tuple[int, int, int]]:
    """(first place, first source column, length) of each run of consecutive source columns."""
    at = np.flatnonzero(columns >= 0)
    cut = np.flatnonzero((np.diff(at) != 1) | (np.diff(columns[at]) != 1)) + 1
    starts, stops = np.r_[0, cut], np.r_[cut, at.size]
    return [(int(at[i]), int(columns[at[i]]), int(j - i)) for i, j in zip(starts, stops) if j > i]


def gated_major(n: int, gate: int, legions: int, granule: int) -> LegionMajor:
    """The layout of a gated matmul (``passes/gated.py``) of two ``n``-column segments, the
    gate segment ``gate``: Legion l holds output columns l * n / legions on, in granules, each
    granule's up columns followed by its gate columns, so that a tile of whole pairs drains
    both halves of its outputs; one output segment, ``n / legions`` columns a Legion."""
    width = n // legions
    if n % legions or width % granule:
        raise ValueError(f"a gated matmul of {n} columns on {legions} Legions in granules of {granule}")
    up_start, gate_start = (n, 0) if gate == 0 else (0, n)
    pairs = np.arange(width // granule)
    at = (2 * granule * pairs[:, None] + np.arange(granule)).reshape(-1)
    local = np.arange(width)
    columns = np.empty(legions * 2 * width, np.int64)
    for legion in range(legions):
        base = legion * 2 * width
        columns[base + at] = up_start + legion * width + local
        columns[base + at + granule] = gate_start + legion * width + local
    return LegionMajor(columns, (width,), (0,), 2 * width)


def legion_major(segments: list[int], legions: int, na: int) -> LegionMajor:
    widths = [-(-n // legions) for n in segments]
    offsets = np.cumsum([0] + widths[:-1]).tolist()
    per_legion = -(-sum(widths) // na) * na
    starts = np.cumsum([0] + list(segments[:-1]))
    columns = np.full(legions * per_legion, -1, np.int64)
    for legion in range(legions):
        for n, width, offset, start in zip(segments, widths, offsets, starts):
            src = legion * width + np.arange(width)
            ok = src < n
            columns[legion * per_legion + offset + np.flatnonzero(ok)] = start + src[ok]
    return LegionMajor(columns, tuple(widths), tuple(offsets), per_legion)


def block_maps(pieces: list[np.ndarray], na: int) -> tuple:
    """Per piece, which ``na`` x ``na`` blocks hold a nonzero weight; () when all of them do."""
    maps = []
    for piece in pieces:
        K, N = piece.shape
        nonzero = piece != 0
        if K % na or N % na:
            nonzero = np.pad(nonzero, ((0, -K % na), (0, -N % na)))
        maps.append(nonzero.reshape(-(-K // na), na, -(-N // na), na).any(axis=(1, 3)))
    return () if all(m.all() for m in maps) else tuple(maps)


def _pad_cols(a: np.ndarray, n_pad: int) -> np.ndarray:
    return a if a.shape[1] == n_pad else np.pad(a, ((0, 0), (0, n_pad - a.shape[1])))


def _piece_mode(arch: Arch, piece: np.ndarray) -> str:
    return pick_mode(arch, mode_for(piece))


def _weight_const(em: Emitter, name: str, piece: np.ndarray) -> tuple[int, str]:
    mode = _piece_mode(em.arch, piece)
    return em.const(name, piece.astype(np.int8), WEIGHT_DTYPE[mode]), mode


# --- operands ------------------------------------------------------------------------------

def residual_rows(low: Lowering, out: Output, dst: Operand) -> int | None:
    """The DRAM tensor of ``out``'s residual, laid out as ``dst`` (a whole fp32 tensor of the
    output's shape, a copy where it is not); None when it has none."""
    if out.residual is None:
        return None
    shape, em = low.shape(out.name), low.em
    if dst != whole(dst.tensor, shape) or tuple(low.shape(out.residual)) != tuple(shape):
        raise ValueError(f"residual '{out.residual}' of '{out.name}': the output is not a whole tensor of its shape")
    src = low.operand(out.residual)
    if em.tensors[src.tensor].dtype == "f32" and src == whole(src.tensor, shape):
        return src.tensor
    t = em.tensor(f"{out.residual}_rows", "f32", shape, "scratch")
    rowwise(em, shape, [Arg("x", src), Arg("out", whole(t, shape), out=True)],
            lambda e, legion, v, rows, cols: e.emit(BY_MNEMONIC["vmov"](legion, v["out"], v["x"], rows, cols)))
    return t


def int8_rows(low: Lowering, name: str, offset: int, width: int | None = None) -> int:
    """An i8 DRAM copy of ``name`` - ``offset`` (shared by every matmul reading it), its rows
    ``width`` elements apart when given (zero past its own columns: weights padded to whole
    arrays)."""
    src, shape, em = low.operand(name), low.shape(name), low.em
    padded = width is not None and width != shape[-1]
    key = f"{name}:int8-{offset}" + (f"-{width}" if padded else "")
    if key in low.operands:
        return low.operands[key].tensor
    if not padded and offset == 0 and em.tensors[src.tensor].dtype == "i8" and src == whole(src.tensor, shape):
        low.operands[key] = src
        return src.tensor
    rows = (*shape[:-1], width) if padded else shape
    t = em.tensor(f"{name}_w8" if padded else f"{name}_i8", "i8", rows, "scratch")

    def body(e, legion, v, rows, cols):
        if offset:
            e.emit(BY_MNEMONIC["vadd"](legion, v["out"], v["x"], float(-offset), rows, cols))
        else:
            e.emit(BY_MNEMONIC["vmov"](legion, v["out"], v["x"], rows, cols))
    rowwise(em, shape, [Arg("x", src), Arg("out", whole(t, rows), out=True)], body)
    low.operands[key] = whole(t, rows)
    return t


def row_scale(low: Lowering, acts: Activations, M: int) -> RowScale:
    """Where the drain's per-row scale comes from and how the vector unit turns it into the
    multiplier: s, 1 / s (the graph divides by s) or s * factor (rounded once to fp32)."""
    s = acts.rscale
    op, n = low.operand(s), math.prod(low.shape(s))
    kind = "mul" if acts.factor is not None else "recip" if acts.divisor else "mov"
    factor = 1.0 if acts.factor is None else float(acts.factor)
    if n == 1:
        return RowScale(op.tensor, op.offset, 0, kind, factor)
    if n == M and op == whole(op.tensor, low.shape(s)):
        return RowScale(op.tensor, op.offset, 1, kind, factor)
    raise ValueError(f"scale '{s}' of shape {list(low.shape(s))} is neither per tensor nor per row")


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


def zero_point(low: Lowering, acts: Activations) -> int | str:
    """The activations' zero point: an int, or the graph value holding it at run time."""
    zp = acts.zero_point
    if isinstance(zp, str):
        c = low.const(zp)
        if (c.size if c is not None else math.prod(low.shape(zp))) != 1:
            raise ValueError(f"zero point '{zp}' is not per tensor (per-row zero points are not supported)")
        zp = zp if c is None else int(c.reshape(()))
    return zp


def _correction_mode(arch: Arch) -> str:
    """The correction pass runs in the widest mode: its weights are column sums."""
    return max(arch.modes, key=lambda m: MODE_BITS[m])


def correction_shape(arch: Arch, values: np.ndarray, block: int) -> tuple[int, str]:
    """(k2, mode) of the correction pass of weights ``values`` (whatever their column order)."""
    mode = _correction_mode(arch)
    return correction_weights(values, block, *mode_range(mode))[1], mode


def correction(low: Lowering, name: str, acts: Activations, values: np.ndarray, block: int):
    """(row, weights, k2, mode) of the zero-point correction pass, or Nones when it is 0."""
    em, arch = low.em, low.em.arch
    zp = zero_point(low, acts)
    if zp == acts.offset:
        return None, None, 0, "w8"
    mode = _correction_mode(arch)
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

