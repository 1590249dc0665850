"""Row reductions and softmax on the vector unit.

The vector unit reduces along rows, so an op over other axes first copies its input with those
axes moved last (a transpose through DRAM); reduced axes that are already last and contiguous
merge into one row.
"""
from __future__ import annotations

import math

import numpy as np

from isa.instructions import BY_MNEMONIC
from dlegion_cc.lower.context import Lowering, lowers
from dlegion_cc.lower.layout import Operand, contiguous_strides, whole
from dlegion_cc.lower.movement import nd_copy
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
