"""Row reductions and softmax over the last axis, on the vector unit."""
from __future__ import annotations

from isa.instructions import BY_MNEMONIC
from dlegion_cc.lower.context import Lowering, lowers
from dlegion_cc.lower.layout import Operand
from dlegion_cc.lower.rowwise import Arg, rowwise

REDUCE = {"ReduceSum": "vrsum", "ReduceMean": "vrsum", "ReduceMax": "vrmax", "ReduceMin": "vrmin"}


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
    return sorted(int(a) % rank for a in axes)


def _column(op: Operand) -> Operand:
    """The output of a row reduction, seen in the input's frame: one value per row."""
    return Operand(op.tensor, op.offset, op.strides[:-1] + (0,))


@lowers(*REDUCE)
def reduction(low: Lowering, node) -> None:
    x, out = node.inputs[0], node.outputs[0]
    shape = low.shape(x)
    axes = _axes(low, node)
    reduced = [a for a in axes if shape[a] != 1]
    if reduced != [len(shape) - 1][:len(reduced)] or not reduced:
        if not reduced:
            _copy(low, node)
            return
        raise ValueError(f"reducing axes {axes} of a rank-{len(shape)} tensor; only the last axis is supported")
    dst = low.result(out)
    # The output has the input's rank with the last dimension 1 (or dropped: same layout).
    frame_dst = Operand(dst.tensor, 0, _row_strides(shape))
    cls, n = BY_MNEMONIC[REDUCE[node.op]], shape[-1]

    def body(em, legion, v, rows, cols):
        em.emit(cls(legion, v["out"], v[x], rows, cols))
        if node.op == "ReduceMean":
            em.emit(BY_MNEMONIC["vdiv"](legion, v["out"], v["out"], float(n), rows, 1))
    args = [Arg(x, low.operand(x)), Arg("out", frame_dst, out=True)]
    rowwise(low.em, shape, args, body, keep_last=True, where=f"node '{node.name}': ")


def _row_strides(shape) -> tuple[int, ...]:
    """Strides of a contiguous tensor of ``shape[:-1]``, viewed in ``shape`` with a 0 last stride."""
    strides, acc = [], 1
    for d in reversed(shape[:-1]):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides)) + (0,)


def _copy(low: Lowering, node) -> None:
    from dlegion_cc.lower.elementwise import unary
    unary(low, type(node)("Identity", node.name, node.inputs[:1], node.outputs))


@lowers("Softmax")
def softmax(low: Lowering, node) -> None:
    x, out = node.inputs[0], node.outputs[0]
    shape = low.shape(x)
    if node.attrs.get("axis", -1) % len(shape) != len(shape) - 1:
        raise ValueError("Softmax over an axis other than the last is not supported")

    def body(em, legion, v, rows, cols):
        stat = v["stat"]
        em.emit(BY_MNEMONIC["vrmax"](legion, stat, v[x], rows, cols))
        em.emit(BY_MNEMONIC["vsub"](legion, v["out"], v[x], stat, rows, cols))
        em.emit(BY_MNEMONIC["vexp"](legion, v["out"], v["out"], rows, cols))
        em.emit(BY_MNEMONIC["vrsum"](legion, stat, v["out"], rows, cols))
        em.emit(BY_MNEMONIC["vdiv"](legion, v["out"], v["out"], stat, rows, cols))
    args = [Arg(x, low.operand(x)), Arg("out", low.result(out), out=True), Arg("stat", col=True)]
    rowwise(low.em, shape, args, body, keep_last=True, where=f"node '{node.name}': ")
