"""Row reductions and softmax on the vector unit.

The vector unit reduces along rows, so an op over other axes first copies its input with those
axes moved last (a transpose through DRAM); reduced axes that are already last and contiguous
merge into one row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from isa.fields import DramRef, View
from isa.instructions import BY_MNEMONIC, DmaLoad, DmaStore
from dlegion_cc.ir import DLEGION
from dlegion_cc.lower.context import Lowering, lowers, perm_of, row_view
from dlegion_cc.lower.layout import Operand, broadcast, contiguous_strides, reshaped, transposed, whole
from dlegion_cc.lower.movement import nd_copy
from dlegion_cc.lower.quant import V, absmax_rows, absmax_scale, int_result
from dlegion_cc.lower.rowwise import Arg, rowwise

REDUCE = {"ReduceSum": "vrsum", "ReduceMean": "vrsum", "ReduceMax": "vrmax", "ReduceMin": "vrmin"}
# What each reduction yields over no elements (ONNX: the op's identity; the mean is 0/0).
EMPTY = {"ReduceSum": 0.0, "ReduceMean": float("nan"), "ReduceMax": float("-inf"), "ReduceMin": float("inf")}


def _axes(low: Lowering, node) -> list[int]:
    rank = len(low.shape(node.inputs[0]))
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1]:
        axes = low.const(node.inputs[1])
        if axes is None:
            raise ValueError("reduction axes computed at run time are not supported")
    if axes is None or len(axes) == 0:
        if node.attrs.get("noop_with_empty_axes", 0):
            return []
        return list(range(rank))
    return sorted({int(a) % rank for a in axes})


def to_rows(low: Lowering, name: str, axes: list[int], where: str) -> tuple[Operand, tuple[int, int]]:
    """``name`` as a [rows, n] matrix whose rows run over ``axes`` (the other axes, in order,
    number the rows); copied with the axes moved last unless they already are."""
    shape, op = low.shape(name), low.operand(name)
    kept = [d for d in range(len(shape)) if d not in axes]
    rows, n = math.prod(shape[d] for d in kept), math.prod(shape[d] for d in axes)
    trailing = axes == list(range(len(shape) - len(axes), len(shape)))
    if trailing and op.strides == contiguous_strides(shape):
        return Operand(op.tensor, op.offset, (n, 1)), (rows, n)
    perm = kept + axes
    moved = tuple(shape[d] for d in perm)
    tmp = whole(low.em.tensor(f"{name}_moved", "f32", moved, "scratch"), moved)
    nd_copy(low.em, tmp, Operand(op.tensor, op.offset, tuple(op.strides[d] for d in perm)), moved, where)
    low.em.barrier()
    return Operand(tmp.tensor, 0, (n, 1)), (rows, n)


def fill(low: Lowering, name: str, value: float) -> None:
    """The result ``name`` with every element ``value``."""
    const = low.em.const(f"{name}_fill", np.array([value], np.float32), "f32")
    shape = low.shape(name)
    nd_copy(low.em, low.result(name), Operand(const, 0, (0,) * len(shape)), shape)


@lowers(*REDUCE)
def reduction(low: Lowering, node) -> None:
    x, out = node.inputs[0], node.outputs[0]
    shape, where = low.shape(x), f"node '{node.name}': "
    axes = [a for a in _axes(low, node) if shape[a] != 1]
    if not axes:
        _copy(low, node)
        return
    if math.prod(shape) == 0:
        fill(low, out, EMPTY[node.op])
        return
    if _down_columns(low, x, axes):
        column_reduce(low, node, x, _column_result(low, out, shape))
        return
    src, (rows, n) = to_rows(low, x, axes, where)
    dst = low.result(out)      # the kept axes in order: the output's layout whether or not keepdims
    cls = BY_MNEMONIC[REDUCE[node.op]]

    def body(em, legion, v, r, c):
        em.emit(cls(legion, v["out"], v["x"], r, c))
        if node.op == "ReduceMean":
            em.emit(BY_MNEMONIC["vdiv"](legion, v["out"], v["out"], float(n), r, 1))
    args = [Arg("x", src), Arg("out", Operand(dst.tensor, dst.offset, (1, 0)), out=True)]
    rowwise(low.em, (rows, n), args, body, keep_last=True, where=where)


def _column_result(low: Lowering, out: str, shape: tuple) -> Operand:
    """Where a reduction down the columns of ``shape`` writes ``out`` [.., D], made once (a
    node lowered in parts of its matrices writes the one tensor)."""
    dst = low.operands.get(out) or low.result(out)
    return Operand(dst.tensor, dst.offset, contiguous_strides((*shape[:-2], shape[-1])))


def down_columns_in_parts(low: Lowering, node) -> bool:
    """Whether ``node`` may be lowered in parts of the matrices of its input
    (``lower_matrices``): a mean down the columns (K's over the tokens) or K's smoothed
    quantization."""
    if (node.domain, node.op) == (DLEGION, "SmoothAbsmaxQuantize"):
        return True
    return node.op == "ReduceMean" and not node.domain and _down_columns(low, node.inputs[0], _axes(low, node))


def lower_matrices(low: Lowering, node, part: range) -> None:
    """``node`` (``down_columns_in_parts``) over the matrices ``part`` of its input only (the
    leading dimensions flattened), so that attention's first head group waits only for the
    heads it reads."""
    if node.op == "ReduceMean":
        x = node.inputs[0]
        column_reduce(low, node, x, _column_result(low, node.outputs[0], low.shape(x)), part)
    else:
        smooth_absmax_quantize(low, node, part)


def _copy(low: Lowering, node) -> None:
    from dlegion_cc.lower.elementwise import unary
    unary(low, type(node)("Identity", node.name, node.inputs[:1], node.outputs))


@lowers("Softmax")
def softmax(low: Lowering, node) -> None:
    x, out = node.inputs[0], node.outputs[0]
    shape, where = low.shape(x), f"node '{node.name}': "
    if math.prod(shape) == 0:
        return
    axis = node.attrs.get("axis", -1) % len(shape)
    src, (rows, n) = to_rows(low, x, [axis], where)
    last = axis == len(shape) - 1
    dst = low.result(out) if last else whole(low.em.tensor(f"{out}_moved", "f32", (rows, n), "scratch"), (rows, n))
    _softmax_rows(low, src, Operand(dst.tensor, dst.offset, (n, 1)), rows, n, where)
    if last:
        return
    low.em.barrier()
    # Move the axis back: dst holds [other axes..., axis]; the output wants it at ``axis``.
    perm = [d for d in range(len(shape)) if d != axis] + [axis]
    moved = contiguous_strides(tuple(shape[d] for d in perm))
    back = tuple(moved[perm.index(d)] for d in range(len(shape)))
    nd_copy(low.em, low.result(out), Operand(dst.tensor, 0, back), shape, where)


def _softmax_rows(low: Lowering, src: Operand, dst: Operand, rows: int, n: int, where: str) -> None:
    def body(em, legion, v, r, c):
        stat = v["stat"]
        em.emit(BY_MNEMONIC["vrmax"](legion, stat, v["x"], r, c))
        em.emit(BY_MNEMONIC["vsub"](legion, v["out"], v["x"], stat, r, c))
        em.emit(BY_MNEMONIC["vexp"](legion, v["out"], v["out"], r, c))
        em.emit(BY_MNEMONIC["vrsum"](legion, stat, v["out"], r, c))
        em.emit(BY_MNEMONIC["vdiv"](legion, v["out"], v["out"], stat, r, c))
    args = [Arg("x", src), Arg("out", dst, out=True), Arg("stat", col=True)]
    rowwise(low.em, (rows, n), args, body, keep_last=True, where=where)


# --- attention's K and V quantized in place (passes/attnoperands.py) ------------------------

@lowers("SmoothAbsmaxQuantize", domain=DLEGION, views=row_view)
def smooth_absmax_quantize(low: Lowering, node, part: range | None = None) -> None:
    """q = round(s / r) with s = x - mean, r = max(max|s|, floor) / 127 per row (int8), and r:
    the instructions of Sub then AbsmaxQuantize, without storing s; with ``part``, of those
    matrices of x only (its leading dimensions flattened)."""
    (x, mean), (q, r) = node.inputs, node.outputs
    shape = low.shape(x)

    def body(e, l, v, rows, cols):
        e.emit(V("vsub")(l, v["x"], v["x"], v["mean"], rows, cols))
        absmax_rows(e, l, v["q"], v["r"], v["x"], rows, cols)
    r_op = low.operands.get(r) or low.result(r)
    q_op = low.operands.get(q) or _codes(low, q)
    ops = [low.operand(x), broadcast(low.operand(mean), low.shape(mean), shape), q_op,
           Operand(r_op.tensor, r_op.offset, r_op.strides[:-1] + (0,))]
    if part is not None:
        shape, ops = _matrices(shape, ops, part)
    args = [Arg("x", ops[0]), Arg("mean", ops[1]), Arg("q", ops[2], out=True), Arg("r", ops[3], out=True)]
    rowwise(low.em, shape, args, body, keep_last=True, where=f"node '{node.name}': ")


def _matrices(shape: tuple, ops: list[Operand], part: range) -> tuple[tuple, list[Operand]]:
    """The matrices ``part`` of the frame ``shape`` (its leading dimensions flattened) and of
    each of ``ops`` in it."""
    flat = (math.prod(shape[:-2]), *shape[-2:])
    flat_ops = [reshaped(op, shape, flat) for op in ops]
    if any(op is None for op in flat_ops):
        raise AssertionError("the matrices of a frame whose leading dimensions do not merge")
    return (len(part), *shape[-2:]), [Operand(op.tensor, op.offset + part.start * op.strides[0], op.strides)
                                      for op in flat_ops]


def _codes(low: Lowering, q: str) -> Operand:
    """K's int8 codes stored transposed when a transpose of the last two axes is their one
    reader (the arrays read K^T, ``passes/attention.py``): the transpose is then the codes as
    they lie, and nothing copies them between this kernel and QK^T."""
    readers, shape = low.graph.consumers(q), low.shape(q)
    rank = len(shape)
    swap = list(range(rank - 2)) + [rank - 1, rank - 2]
    if (q in low.graph.outputs or len(readers) != 1 or readers[0].domain or readers[0].op != "Transpose"
            or rank < 2 or perm_of(readers[0], rank) != swap):
        return int_result(low, q)
    flipped = (*shape[:-2], shape[-1], shape[-2])
    t = low.em.tensor(q, "i8", flipped, "scratch")
    low.operands[q] = transposed(whole(t, flipped), swap)
    return low.operands[q]


@lowers("ColumnAbsmaxQuantize", domain=DLEGION, views=row_view)
def column_absmax_quantize(low: Lowering, node) -> None:
    """q = round(x / r) with r = max(max|x|, floor) / 127 per column of each matrix of x
    (int8, x's layout), and r [.., cols, 1]: AbsmaxQuantize of x's transpose, bit for bit, with
    nothing transposed. Each column's maximum is a row reduction of its strip read transposed in
    the scratchpad (a maximum is the same in any order); the quotients are taken row by row, r
    broadcast down the rows."""
    x, (q, r) = node.inputs[0], node.outputs
    q_op, r_op = int_result(low, q), low.result(r)

    def body(e, legion, v, S, w):
        col, t = View("vec", v.r, 1, 0), View("vec", v.temp, v.width, 1)
        e.emit(V("vabs")(legion, t, v.x, S, w))
        e.emit(V("vrmax")(legion, col, View("vec", v.temp, 1, v.width), w, S))
        absmax_scale(e, legion, col, w)
        e.emit(V("vdiv")(legion, v.x, v.x, View("vec", v.r, 0, 1), S, w))
        e.emit(V("vround")(legion, v.x, v.x, S, w))

    def stores(legion, v, idx, c0, S, w):
        qb, rb = q_op.at(idx), r_op.at(idx)
        return [DmaStore(legion, DramRef(qb.tensor, qb.offset + c0, qb.strides[0]), v.x, S, w),
                _row_store(legion, rb, c0 * rb.strides[0], v.r, w)]
    _strips(low, node, x, False, body, stores)


def _down_columns(low: Lowering, x: str, axes: list[int]) -> bool:
    """Whether a reduction of ``x`` over ``axes`` runs down the columns of its matrices, whose
    rows are contiguous, in strips that fit the scratchpad (``column_reduce``)."""
    shape, op = low.shape(x), low.operand(x)
    rank = len(shape)
    return axes == [rank - 2] and shape[-1] > 1 and op.strides[-1] == 1 and strips_fit(low.em, shape[-2])


def strips_fit(em, S: int, reserve: int = 0) -> bool:
    """Whether strips of columns ``S`` long fit the vector scratchpad (``_strip_width``), with
    ``reserve`` elements of it kept for another."""
    return 3 * S + 2 <= em.capacity("vec") - reserve and S <= em.extent()


def column_reduce(low: Lowering, node, x: str, out: Operand, part: range | None = None) -> None:
    """A reduction over the next-to-last axis of ``x`` (rows contiguous) into ``out`` [.., D]:
    each strip of columns is loaded transposed into the scratchpad, where its columns are
    contiguous rows, reduced as the copy through DRAM that ``to_rows`` makes would have them,
    bit for bit, without that copy (K's mean over the tokens)."""
    def body(e, legion, v, S, w):
        col = View("vec", v.r, 1, 0)
        e.emit(BY_MNEMONIC[REDUCE[node.op]](legion, col, v.x, w, S))
        if node.op == "ReduceMean":
            e.emit(BY_MNEMONIC["vdiv"](legion, col, col, float(S), w, 1))

    def stores(legion, v, idx, c0, S, w):
        return [_row_store(legion, out.at(idx), c0 * out.strides[-1], v.r, w)]
    _strips(low, node, x, True, body, stores, part, temp=False)


def _row_store(legion: int, op: Operand, offset: int, addr: int, w: int) -> DmaStore:
    """``w`` consecutive values of a strip's column vector to ``op`` from ``offset`` on."""
    return DmaStore(legion, DramRef(op.tensor, op.offset + offset, w), View("vec", addr, w, 1), 1, w)


@dataclass(frozen=True)
class _Buffer:
    """A strip's scratchpad: its values (``x``: rows of the strip, or of its columns when loaded
    transposed), its column vector at ``r``, the temp shared by the Legion's strips."""

    x: View
    r: int
    temp: int
    width: int


def _strips(low: Lowering, node, x: str, transposed: bool, body, stores, part: range | None = None,
            temp: bool = True) -> None:
    """Run ``body`` on strips of whole columns of every matrix of ``x`` [.., S, D] (of the
    matrices ``part``, in the order of ``np.ndindex``), then ``stores(legion, buffer, batch
    index, first column, S, columns)``; ``temp``: whether ``body`` uses the buffers' temp."""
    shape, src = low.shape(x), low.operand(x)
    S, D = shape[-2:]
    matrices = list(np.ndindex(*shape[:-2]))
    matrices = matrices if part is None else matrices[part.start:part.stop]
    width = _strip_width(low.em, len(matrices), S, D, f"node '{node.name}': ")
    per_legion = -(-len(matrices) * -(-D // width) // low.em.arch.legions)
    strips = _Strips(low.em, S, width, transposed, per_legion, S * width if temp else 0)
    for idx in matrices:
        for c0 in range(0, D, width):
            strips.emit(src.at(idx), c0, min(width, D - c0), body,
                        lambda legion, v, w, idx=idx, c0=c0: stores(legion, v, idx, c0, S, w))
    strips.finish()


def _strip_width(em, batches: int, S: int, D: int, where: str) -> int:
    """Columns per strip: two strips of S x width fit the scratchpad with a temp (one loading
    while one computes), and the busiest Legion's columns are fewest (wider first on a tie)."""
    most = min(D, em.capacity("vec") // (3 * S + 2))
    if most < 1 or S > em.extent():
        raise ValueError(f"{where}columns of {S} elements do not fit a strip of the vector scratchpad")
    legions = em.arch.legions
    return min(range(most, 0, -1), key=lambda w: -(-batches * -(-D // w) // legions) * w)


def ring(em, size: int, strips: int, temp: int) -> int:
    """Buffers of ``size`` elements a Legion takes in turn for its ``strips``: one a strip where
    they fit the vector scratchpad with ``temp`` elements after them, two at least (one loading
    while one computes). K's mean at sequence 128 on dlegion-8x8 takes 5 strips a Legion: with
    two buffers each strip's load waited for the stores of the strip two before, a DRAM round
    trip each (the 2B4T layer at 128: 211,377 -> 210,756 cycles with a buffer a strip)."""
    return max(2, min(strips, (em.capacity("vec") - temp) // size))


class _Strips:
    """Strips of columns dealt to the Legions in turn; each Legion takes its buffers in turn
    (``ring``). A DMA queue runs in order, so a strip's stores are issued after the loads of the
    strips that fill the other buffers (which then stream in while it computes), and a buffer's
    next load waits for the stores of the strip it held: with a buffer a strip, every load is
    issued before the first store, and the strips' DRAM round trips overlap, not follow each
    other."""

    def __init__(self, em, S: int, width: int, transposed: bool, per_legion: int, temp: int):
        self.em, self.S, self.width, self.transposed = em, S, width, transposed
        self.size = S * width + width             # a strip, then its column vector
        self.buffers = ring(em, self.size, per_legion, temp)
        self.used: dict = {}                      # (Legion, buffer) -> DMAs issued when its stores were
        self.turns: dict = {}
        self.stores: dict = {}                    # Legion -> [(buffer, vec issued after it, its stores)]

    def emit(self, src: Operand, c0: int, w: int, body, stores) -> None:
        em, S, W = self.em, self.S, self.width
        legion = em.next_legion()
        buf = self.turns.get(legion, 0)
        self.turns[legion] = (buf + 1) % self.buffers
        xa, dma = buf * self.size, (legion, "dma")
        # Loaded transposed, column j of the strip is row j of the buffer.
        into, x = (View("vec", xa, 1, S), View("vec", xa, S, 1)) if self.transposed else (View("vec", xa, W, 1),) * 2
        v = _Buffer(x, xa + S * W, self.buffers * self.size, W)
        if (legion, buf) in self.used:
            em.depend(dma, dma, upto=self.used[(legion, buf)])
        em.emit(DmaLoad(legion, frozenset({legion}), into, DramRef(src.tensor, src.offset + c0, src.strides[0]), S, w))
        loaded = em.issued[dma]
        self._flush(legion, self.buffers - 2)
        em.depend(dma, (legion, "vec"), upto=loaded)
        body(em, legion, v, S, w)
        self.stores.setdefault(legion, []).append((buf, em.issued[(legion, "vec")], stores(legion, v, w)))

    def _flush(self, legion: int, keep: int = 0) -> None:
        """Issue the stores of ``legion``'s strips but its last ``keep``."""
        pending = self.stores.get(legion, [])
        while len(pending) > keep:
            buf, computed, stores = pending.pop(0)
            self.em.depend((legion, "vec"), (legion, "dma"), upto=computed)
            for store in stores:
                self.em.emit(store)
            self.used[(legion, buf)] = self.em.issued[(legion, "dma")]

    def finish(self) -> None:
        for legion in sorted(self.stores):
            self._flush(legion)
