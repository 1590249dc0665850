"""Row reductions and softmax on the vector unit.

The vector unit reduces along rows, so an op over other axes first copies its input with those
axes moved last (a transpose through DRAM); reduced axes that are already last and contiguous
merge into one row.
"""
from __future__ import annotations

import math

import numpy as np

from isa.fields import DramRef, View
from isa.instructions import BY_MNEMONIC, DmaLoad, DmaStore
from dlegion_cc.ir import DLEGION
from dlegion_cc.lower.context import Lowering, lowers, row_view
from dlegion_cc.lower.layout import Operand, broadcast, contiguous_strides, whole
from dlegion_cc.lower.movement import nd_copy
from dlegion_cc.lower.quant import ABSMAX_FLOOR, V, int_result
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
    src, (rows, n) = to_rows(low, x, axes, where)
    dst = low.result(out)      # the kept axes in order: the output's layout whether or not keepdims
    cls = BY_MNEMONIC[REDUCE[node.op]]

    def body(em, legion, v, r, c):
        em.emit(cls(legion, v["out"], v["x"], r, c))
        if node.op == "ReduceMean":
            em.emit(BY_MNEMONIC["vdiv"](legion, v["out"], v["out"], float(n), r, 1))
    args = [Arg("x", src), Arg("out", Operand(dst.tensor, dst.offset, (1, 0)), out=True)]
    rowwise(low.em, (rows, n), args, body, keep_last=True, where=where)


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
def smooth_absmax_quantize(low: Lowering, node) -> None:
    """q = round(s / r) with s = x - mean, r = max(max|s|, floor) / 127 per row (int8), and r:
    the instructions of Sub then AbsmaxQuantize, without storing s."""
    (x, mean), (q, r) = node.inputs, node.outputs
    shape = low.shape(x)

    def body(e, l, v, rows, cols):
        e.emit(V("vsub")(l, v["x"], v["x"], v["mean"], rows, cols))
        _absmax_rows(e, l, v["q"], v["r"], v["x"], rows, cols)
    r_op = low.result(r)
    args = [Arg("x", low.operand(x)), Arg("mean", broadcast(low.operand(mean), low.shape(mean), shape)),
            Arg("q", int_result(low, q), out=True),
            Arg("r", Operand(r_op.tensor, r_op.offset, r_op.strides[:-1] + (0,)), out=True)]
    rowwise(low.em, shape, args, body, keep_last=True, where=f"node '{node.name}': ")


def _absmax_rows(e, legion: int, q, r, x, rows: int, cols: int) -> None:
    """AbsmaxQuantize's instructions (``quant.absmax_quantize``) on a block of rows."""
    e.emit(V("vabs")(legion, q, x, rows, cols))
    e.emit(V("vrmax")(legion, r, q, rows, cols))
    e.emit(V("vmax")(legion, r, r, ABSMAX_FLOOR, rows, 1))
    e.emit(V("vdiv")(legion, r, r, 127.0, rows, 1))
    e.emit(V("vdiv")(legion, q, x, r, rows, cols))
    e.emit(V("vround")(legion, q, q, rows, cols))


@lowers("ColumnAbsmaxQuantize", domain=DLEGION, views=row_view)
def column_absmax_quantize(low: Lowering, node) -> None:
    """q = round(x / r) with r = max(max|x|, floor) / 127 per column of each matrix of x
    (int8, x's layout), and r [.., cols, 1]: AbsmaxQuantize of x's transpose, bit for bit, with
    nothing transposed. Strips of columns as tall as the matrix: each column's maximum is a row
    reduction of the strip read transposed in the scratchpad, and the quotients are row-wise
    with r broadcast down the rows."""
    x, (q, r) = node.inputs[0], node.outputs
    shape = low.shape(x)
    S, D = shape[-2:]
    width = _strip_width(low.em, math.prod(shape[:-2]), S, D, f"node '{node.name}': ")
    src, q_op, r_op = low.operand(x), int_result(low, q), low.result(r)
    strips = _Strips(low.em, S, width)
    for idx in np.ndindex(*shape[:-2]):
        at = (src.at(idx), q_op.at(idx), r_op.at(idx))
        for c0 in range(0, D, width):
            strips.emit(*at, c0, min(width, D - c0))
    strips.finish()


def _strip_width(em, batches: int, S: int, D: int, where: str) -> int:
    """Columns per strip: two strips of S x width fit the scratchpad with a temp (one loading
    while one computes), and the busiest Legion's columns are fewest (wider first on a tie)."""
    most = min(D, em.capacity("vec") // (3 * S + 2))
    if most < 1 or S > em.extent():
        raise ValueError(f"{where}columns of {S} elements do not fit a strip of the vector scratchpad")
    legions = em.arch.legions
    return min(range(most, 0, -1), key=lambda w: -(-batches * -(-D // w) // legions) * w)


class _Strips:
    """Strips of columns dealt to the Legions in turn; each Legion alternates two buffers. A
    DMA queue runs in order, so a strip's stores are issued after the next strip's load (which
    then streams in while the strip computes), and a buffer's next load waits for the stores
    of the strip it held."""

    def __init__(self, em, S: int, width: int):
        self.em, self.S, self.width = em, S, width
        self.size = S * width + width             # a strip, then its column scales
        self.temp = 2 * self.size
        self.used: dict = {}                      # (Legion, buffer) -> DMAs issued when its stores were
        self.turns: dict = {}
        self.stores: dict = {}                    # Legion -> (buffer, its pending stores)

    def emit(self, src: Operand, q: Operand, r: Operand, c0: int, w: int) -> None:
        em, S, W = self.em, self.S, self.width
        legion = em.next_legion()
        buf = self.turns.get(legion, 0)
        self.turns[legion] = 1 - buf
        xa = buf * self.size
        ra, dma, vec = xa + S * W, (legion, "dma"), (legion, "vec")
        x_view, t_view, r_col = View("vec", xa, W, 1), View("vec", self.temp, W, 1), View("vec", ra, 1, 0)
        if (legion, buf) in self.used:
            em.depend(dma, dma, upto=self.used[(legion, buf)])
        em.emit(DmaLoad(legion, frozenset({legion}), x_view, DramRef(src.tensor, src.offset + c0, src.strides[0]), S, w))
        loaded = em.issued[dma]
        self._flush(legion)
        em.depend(dma, vec, upto=loaded)
        em.emit(V("vabs")(legion, t_view, x_view, S, w))
        em.emit(V("vrmax")(legion, r_col, View("vec", self.temp, 1, W), w, S))
        em.emit(V("vmax")(legion, r_col, r_col, ABSMAX_FLOOR, w, 1))
        em.emit(V("vdiv")(legion, r_col, r_col, 127.0, w, 1))
        em.emit(V("vdiv")(legion, x_view, x_view, View("vec", ra, 0, 1), S, w))
        em.emit(V("vround")(legion, x_view, x_view, S, w))
        self.stores[legion] = (buf, [DmaStore(legion, DramRef(q.tensor, q.offset + c0, q.strides[0]), x_view, S, w),
                                     DmaStore(legion, DramRef(r.tensor, r.offset + c0 * r.strides[0], w),
                                              View("vec", ra, w, 1), 1, w)])

    def _flush(self, legion: int) -> None:
        if legion not in self.stores:
            return
        buf, stores = self.stores.pop(legion)
        self.em.depend((legion, "vec"), (legion, "dma"))
        for store in stores:
            self.em.emit(store)
        self.used[(legion, buf)] = self.em.issued[(legion, "dma")]

    def finish(self) -> None:
        for legion in sorted(self.stores):
            self._flush(legion)
