"""Data movement: reshapes share DRAM; slices, transposes, concats, expands and gathers copy
through a Legion's vector scratchpad with strided DMA."""
from __future__ import annotations

import math

import numpy as np

from isa.fields import DramRef, View
from isa.instructions import BY_MNEMONIC, DmaLoad, DmaStore, Gather
from dlegion_cc.lower.context import Lowering, lowers
from dlegion_cc.lower.emitter import Emitter
from dlegion_cc.lower.layout import Operand, broadcast, coalesce, outer_indices, whole
from dlegion_cc.lower.rowwise import Arg, rowwise


def nd_copy(em: Emitter, dst: Operand, src: Operand, shape: tuple[int, ...], where: str = "") -> None:
    """dst[idx] = src[idx] for every idx of ``shape`` (dst contiguous along its last axis)."""
    if math.prod(shape) == 0:
        return
    shape2, (s2, d2) = coalesce(shape, [src, dst])
    if s2.strides[-1] in (0, 1):
        body = lambda e, l, v, r, c: e.emit(BY_MNEMONIC["vmov"](l, v["out"], v["src"], r, c))
        rowwise(em, shape, [Arg("src", src), Arg("out", dst, out=True)], body, where=where)
        return
    _transpose_copy(em, shape2, s2, d2, where)


def _transpose_copy(em, shape, src: Operand, dst: Operand, where) -> None:
    """Tiles whose source rows run along another axis: load rows, store columns."""
    last = len(shape) - 1
    j = next((d for d in range(last) if src.strides[d] == 1), None)
    if j is None:
        raise ValueError(f"{where}copy with no contiguous source axis is not supported")
    other = [d for d in range(last) if d != j]
    a_len, b_len = shape[last], shape[j]
    cap = em.capacity("vec")
    ta = min(a_len, max(1, cap // max(1, min(b_len, cap))))
    tb = min(b_len, cap // ta)
    for idx in outer_indices(tuple(shape[d] for d in other) + (1, 1)):
        s_base = src.offset + sum(i * src.strides[d] for i, d in zip(idx, other))
        d_base = dst.offset + sum(i * dst.strides[d] for i, d in zip(idx, other))
        for a0 in range(0, a_len, ta):
            for b0 in range(0, b_len, tb):
                na, nb = min(ta, a_len - a0), min(tb, b_len - b0)
                legion = em.next_legion()
                src_ref = DramRef(src.tensor, s_base + a0 * src.strides[last] + b0, src.strides[last])
                em.emit(DmaLoad(legion, frozenset({legion}), View("vec", 0, 1, na), src_ref, na, nb))
                em.fence((legion, "dma"))
                dst_ref = DramRef(dst.tensor, d_base + b0 * dst.strides[j] + a0, dst.strides[j])
                em.emit(DmaStore(legion, dst_ref, View("vec", 0, na, 1), nb, na))
                em.fence((legion, "dma"))


def _copy_into(low: Lowering, node, src: Operand) -> None:
    out = node.outputs[0]
    nd_copy(low.em, low.result(out), src, low.shape(out), where=f"node '{node.name}': ")


@lowers("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape(low: Lowering, node) -> None:
    x, out = node.inputs[0], node.outputs[0]
    if low.alias(out, x):
        return
    src = whole(low.operand(x).tensor, low.shape(out))
    _copy_into(low, node, Operand(src.tensor, low.operand(x).offset, src.strides))


@lowers("Transpose")
def transpose(low: Lowering, node) -> None:
    x = node.inputs[0]
    rank = len(low.shape(x))
    perm = node.attrs.get("perm", list(range(rank))[::-1])
    op = low.operand(x)
    _copy_into(low, node, Operand(op.tensor, op.offset, tuple(op.strides[p] for p in perm)))


@lowers("Expand")
def expand(low: Lowering, node) -> None:
    x, out = node.inputs[0], node.outputs[0]
    _copy_into(low, node, broadcast(low.operand(x), low.shape(x), low.shape(out)))


def _slice_params(low: Lowering, node):
    names = (node.inputs + ["", "", "", ""])[1:5]
    starts, ends, axes, steps = (low.const(n) if n else None for n in names)
    if starts is None or ends is None or any(n and low.const(n) is None for n in names):
        raise ValueError("Slice bounds computed at run time are not supported")
    rank = len(low.shape(node.inputs[0]))
    axes = list(range(len(starts))) if axes is None else [int(a) % rank for a in axes]
    steps = [1] * len(starts) if steps is None else [int(s) for s in steps]
    return [int(s) for s in starts], axes, steps


@lowers("Slice")
def slice_(low: Lowering, node) -> None:
    x = node.inputs[0]
    shape, op = low.shape(x), low.operand(x)
    starts, axes, steps = _slice_params(low, node)
    offset, strides = op.offset, list(op.strides)
    for start, axis, step in zip(starts, axes, steps):
        if step <= 0:
            raise ValueError("Slice with a negative step is not supported")
        start = min(max(start + shape[axis] if start < 0 else start, 0), shape[axis])
        offset += start * op.strides[axis]
        strides[axis] = op.strides[axis] * step
    _copy_into(low, node, Operand(op.tensor, offset, tuple(strides)))


@lowers("Concat")
def concat(low: Lowering, node) -> None:
    out = node.outputs[0]
    rank = len(low.shape(out))
    axis = node.attrs["axis"] % rank
    dst = low.result(out)
    pos = 0
    for name in node.inputs:
        shape = low.shape(name)
        part = Operand(dst.tensor, dst.offset + pos * dst.strides[axis], dst.strides)
        nd_copy(low.em, part, low.operand(name), shape, where=f"node '{node.name}': ")
        pos += shape[axis]


@lowers("Split")
def split(low: Lowering, node) -> None:
    x = node.inputs[0]
    shape, op = low.shape(x), low.operand(x)
    axis = node.attrs.get("axis", 0) % len(shape)
    pos = 0
    for out in node.outputs:
        size = low.shape(out)[axis]
        src = Operand(op.tensor, op.offset + pos * op.strides[axis], op.strides)
        nd_copy(low.em, low.result(out), src, low.shape(out), where=f"node '{node.name}': ")
        pos += size


@lowers("Gather")
def gather(low: Lowering, node) -> None:
    data, indices = node.inputs
    if low.const(indices) is not None:
        _gather_const_indices(low, node)
        return
    if node.attrs.get("axis", 0) % len(low.shape(data)) != 0:
        raise ValueError("Gather with run-time indices is supported along axis 0 only")
    _gather_rows(low, node)


def _gather_const_indices(low: Lowering, node) -> None:
    data, indices = node.inputs
    shape, op = low.shape(data), low.operand(data)
    axis = node.attrs.get("axis", 0) % len(shape)
    idx = np.asarray(low.const(indices)).reshape(-1)
    dst = low.result(node.outputs[0])
    piece = shape[:axis] + shape[axis + 1:]
    step = math.prod(shape[axis + 1:])
    for k, i in enumerate(idx):
        i = int(i) % shape[axis]
        src = Operand(op.tensor, op.offset + i * op.strides[axis], op.strides[:axis] + op.strides[axis + 1:])
        out_strides = _gather_out_strides(shape, axis, len(idx))
        part = Operand(dst.tensor, dst.offset + k * step, out_strides)
        nd_copy(low.em, part, src, piece, where=f"node '{node.name}': ")


def _gather_out_strides(shape, axis, n) -> tuple[int, ...]:
    """Strides of one gathered slice inside the output [*shape[:axis], n, *shape[axis+1:]]."""
    full = shape[:axis] + (n,) + shape[axis + 1:]
    strides = whole(0, full).strides
    return strides[:axis] + strides[axis + 1:]


def _gather_rows(low: Lowering, node) -> None:
    """Embedding lookup: rows of a DRAM table picked by run-time ids."""
    data, indices = node.inputs
    em, shape = low.em, low.shape(data)
    row = math.prod(shape[1:])
    n = math.prod(low.shape(indices))
    ids, table, dst = low.operand(indices), low.operand(data), low.result(node.outputs[0])
    block = max(1, min(n, em.capacity("vec") // (row + 1)))
    for r0 in range(0, n, block):
        rows, legion = min(block, n - r0), em.next_legion()
        em.emit(DmaLoad(legion, frozenset({legion}), View("vec", 0, 1, 1),
                        DramRef(ids.tensor, ids.offset + r0, 1), rows, 1))
        em.fence((legion, "dma"))
        em.emit(Gather(legion, View("vec", rows, row, 1), DramRef(table.tensor, table.offset, row),
                       View("vec", 0, 1, 0), rows, row))
        em.fence((legion, "dma"))
        em.emit(DmaStore(legion, DramRef(dst.tensor, dst.offset + r0 * row, row),
                         View("vec", rows, row, 1), rows, row))
        em.fence((legion, "dma"))
