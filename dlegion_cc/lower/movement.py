"""Data movement. A reshape, transpose, slice, expand or split is a strided view of its input's
DRAM when its readers take one (``Lowering.view``); otherwise it, like a concat or a gather,
copies through a Legion's vector scratchpad with strided DMA."""
from __future__ import annotations

import math

import numpy as np

from isa.fields import DramRef, View
from isa.instructions import BY_MNEMONIC, DmaLoad, DmaStore, Gather
from dlegion_cc.lower import carry
from dlegion_cc.lower.context import Lowering, any_view, lowers, perm_of
from dlegion_cc.lower.emitter import Emitter
from dlegion_cc.lower.layout import Operand, broadcast, coalesce, contiguous_strides, outer_indices, reshaped, transposed, whole
from dlegion_cc.lower.rowwise import Arg, rowwise


def nd_copy(em: Emitter, dst: Operand, src: Operand, shape: tuple[int, ...], where: str = "") -> None:
    """dst[idx] = src[idx] for every idx of ``shape``."""
    if math.prod(shape) == 0:
        return
    shape2, (s2, d2) = coalesce(shape, [src, dst])
    if d2.strides[-1] not in (0, 1):    # parts interleaved along the last axis (a Concat of [..., 1]s)
        _element_rows(em, shape2, s2, d2, where)
        return
    if s2.strides[-1] in (0, 1):
        body = lambda e, l, v, r, c: e.emit(BY_MNEMONIC["vmov"](l, v["out"], v["src"], r, c))
        rowwise(em, shape, [Arg("src", src), Arg("out", dst, out=True)], body, where=where)
        return
    _transpose_copy(em, shape2, s2, d2, where)


# The parts of ``vec`` a transposing copy's tiles take in turn on a Legion: a tile's load waits
# for the store of the tile this many before, so the DMA round trips of that many overlap (2B4T's
# K copied for the arrays before the first head group's passes; the layer at 512 on dlegion-8x8:
# 1 part 810,822 cycles, 2 parts 810,644, 3 810,527, 4 810,598; at 128 230,401 -> 230,261 with 3;
# K's int8 codes are now stored transposed by their kernel instead, ``reduce._codes``).
COPY_PARTS = 3


def _transpose_copy(em, shape, src: Operand, dst: Operand, where) -> None:
    """Tiles whose source rows run along another axis: load rows, store columns."""
    last = len(shape) - 1
    j = next((d for d in range(last) if src.strides[d] == 1), None)
    if j is None:
        _element_rows(em, shape, src, dst, where)
        return
    other = [d for d in range(last) if d != j]
    a_len, b_len = shape[last], shape[j]
    part = min(em.capacity("vec") // COPY_PARTS, em.extent() ** 2)
    ta = min(a_len, em.extent(), max(1, part // max(1, min(b_len, part))))
    tb = min(b_len, em.extent(), part // ta)
    tiles: dict = {}
    for idx in outer_indices(tuple(shape[d] for d in other) + (1, 1)):
        s_base = src.offset + sum(i * src.strides[d] for i, d in zip(idx, other))
        d_base = dst.offset + sum(i * dst.strides[d] for i, d in zip(idx, other))
        for a0 in range(0, a_len, ta):
            for b0 in range(0, b_len, tb):
                na, nb = min(ta, a_len - a0), min(tb, b_len - b0)
                tiles.setdefault(em.next_legion(), []).append(
                    (DramRef(src.tensor, s_base + a0 * src.strides[last] + b0, src.strides[last]),
                     DramRef(dst.tensor, d_base + b0 * dst.strides[j] + a0, dst.strides[j]), na, nb))
    for legion, work in tiles.items():
        _in_parts(em, legion, work, part)


def _in_parts(em, legion: int, work: list, part: int) -> None:
    """A Legion's tiles (source, destination, rows, columns) through ``COPY_PARTS`` parts of
    ``vec`` in turn: each tile's load goes ahead of the store of the tile before, and waits only
    for the store of the tile ``COPY_PARTS`` before, from the same part."""
    queue, stored, last = (legion, "dma"), [0] * COPY_PARTS, None
    for n, (src_ref, dst_ref, na, nb) in enumerate(work):
        at = n % COPY_PARTS
        em.depend(queue, queue, upto=stored[at])
        em.emit(DmaLoad(legion, frozenset({legion}), View("vec", at * part, 1, na), src_ref, na, nb))
        loaded = em.issued.get(queue, 0)
        if last is not None:
            _store_part(em, legion, last, stored)
        last = (at, part, dst_ref, na, nb, loaded)
    _store_part(em, legion, last, stored)


def _store_part(em, legion: int, tile: tuple, stored: list) -> None:
    """A tile's store from its part of ``vec`` once its load is done; ``stored`` learns how many
    DMA instructions the part's next load waits for."""
    at, part, dst_ref, na, nb, loaded = tile
    queue = (legion, "dma")
    em.depend(queue, queue, upto=loaded)
    em.emit(DmaStore(legion, dst_ref, View("vec", at * part, na, 1), nb, na))
    stored[at] = em.issued.get(queue, 0)


def _element_rows(em, shape, src: Operand, dst: Operand, where) -> None:
    """No source axis is contiguous (a strided slice): move one element per DMA row."""
    body = lambda e, l, v, r, c: e.emit(BY_MNEMONIC["vmov"](l, v["out"], v["src"], r, c))
    args = [Arg("src", Operand(src.tensor, src.offset, src.strides + (1,))),
            Arg("out", Operand(dst.tensor, dst.offset, dst.strides + (1,)), out=True)]
    rowwise(em, tuple(shape) + (1,), args, body, keep_last=True, where=where)


@lowers("Reshape", "Flatten", "Squeeze", "Unsqueeze", views=any_view)
def reshape(low: Lowering, node) -> None:
    """A view when strides can say it (always, of a contiguous value); else a copy."""
    x, out = node.inputs[0], node.outputs[0]
    op = low.operand(x)
    new = reshaped(op, low.shape(x), low.shape(out))
    if new is not None and low.view(out, new):
        return
    _settle(low, op)
    dst = low.result(out)
    nd_copy(low.em, whole(dst.tensor, low.shape(x)), op, low.shape(x), where=f"node '{node.name}': ")


def _view_or_copy(low: Lowering, node, src: Operand, out: str | None = None) -> None:
    """``out`` (default: the node's output) is ``src``, a strided view, if its readers take one."""
    out = out or node.outputs[0]
    if not low.view(out, src):
        _settle(low, src)
        nd_copy(low.em, low.result(out), src, low.shape(out), where=f"node '{node.name}': ")


@lowers("Transpose", views=any_view, writes=any_view)
def transpose(low: Lowering, node) -> None:
    x = node.inputs[0]
    _view_or_copy(low, node, transposed(low.operand(x), perm_of(node, len(low.shape(x)))))


@lowers("Expand", views=any_view, writes=any_view)
def expand(low: Lowering, node) -> None:
    x, out = node.inputs[0], node.outputs[0]
    _view_or_copy(low, node, broadcast(low.operand(x), low.shape(x), low.shape(out)))


def _slice_ranges(low: Lowering, node) -> dict[int, range]:
    """The indices Slice picks along each sliced axis."""
    names = (node.inputs + ["", "", "", ""])[1:5]
    starts, ends, axes, steps = (low.const(n) if n else None for n in names)
    if starts is None or ends is None or any(n and low.const(n) is None for n in names):
        raise ValueError("Slice bounds computed at run time are not supported")
    shape = low.shape(node.inputs[0])
    axes = range(len(starts)) if axes is None else [int(a) % len(shape) for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    return {a: _picks(int(s), int(e), int(k), shape[a]) for a, s, e, k in zip(axes, starts, ends, steps)}


def _picks(start: int, end: int, step: int, dim: int) -> range:
    """ONNX's clamping: a negative bound counts from the end; a negative step walks down to -1."""
    if step == 0:
        raise ValueError("Slice with a step of 0")
    start, end = start + dim if start < 0 else start, end + dim if end < 0 else end
    lo, hi = (0, dim) if step > 0 else (-1, dim - 1)
    return range(min(max(start, lo), hi), min(max(end, lo), hi), step)


@lowers("Slice", views=any_view)
def slice_(low: Lowering, node) -> None:
    x = node.inputs[0]
    shape, op = low.shape(x), low.operand(x)
    offset, strides, view = op.offset, list(op.strides), list(shape)
    downward = []
    for axis, picks in _slice_ranges(low, node).items():
        if picks.step < 0:          # the same elements upward, reversed below
            picks = picks[::-1]
            downward.append(axis)
        offset += (picks.start if len(picks) else 0) * op.strides[axis]
        strides[axis] *= picks.step
        view[axis] = len(picks)
    src = Operand(op.tensor, offset, tuple(strides))
    if not downward or math.prod(view) == 0:
        _view_or_copy(low, node, src)
        return
    _reverse(low, node, src, tuple(view), downward)


def _reverse(low: Lowering, node, src: Operand, shape, axes: list[int]) -> None:
    """Copy ``src`` into the output with ``axes`` reversed: one gather of descending rows per axis."""
    where = f"node '{node.name}': "
    cur = whole(low.em.tensor(f"{node.outputs[0]}_up", "f32", shape, "scratch"), shape)
    nd_copy(low.em, cur, src, shape, where)
    for k, axis in enumerate(axes):
        low.em.barrier()
        last = k == len(axes) - 1
        dst = low.result(node.outputs[0]) if last else whole(
            low.em.tensor(f"{node.outputs[0]}_rev", "f32", shape, "scratch"), shape)
        rows = np.arange(shape[axis] - 1, -1, -1, dtype=np.float32)
        ids = whole(low.em.const(f"{node.outputs[0]}_rows", rows, "f32"), rows.shape)
        gather_axis(low.em, dst, cur, shape, axis, ids, rows.size, wrap=False)
        cur = dst


def _settle(low: Lowering, src: Operand) -> None:
    """A view that copies reads its source whole: what the loads of a matmul were to copy
    there (``carry``) is copied first."""
    if carry.settle(low, {src.tensor}):
        low.em.barrier()


@lowers("Concat", views=any_view, writes=any_view)
def concat(low: Lowering, node) -> None:
    """Each input copied to its part of the output, unless written there already; a graph
    input's copy is left to the matmul that reads the output, where it can (``carry``)."""
    out = node.outputs[0]
    rank = len(low.shape(out))
    axis = node.attrs["axis"] % rank
    dst = low.destination(out)
    pos = 0
    for name in node.inputs:
        shape = low.shape(name)
        part = Operand(dst.tensor, dst.offset + pos * dst.strides[axis], dst.strides)
        src = low.operand(name)
        if src != part and math.prod(shape) and _carries(low, node, name, dst.tensor):
            low.em.carried.append(carry.Carried(part, src, shape))
        elif src != part:
            nd_copy(low.em, part, src, shape, where=f"node '{node.name}': ")
        pos += shape[axis]


def _carries(low: Lowering, node, name: str, tensor: int) -> bool:
    return carry.carried(low, node, name) and all(
        c.dst.tensor != tensor for c in low.em.carried)


@lowers("Split", views=any_view)
def split(low: Lowering, node) -> None:
    x = node.inputs[0]
    shape, op = low.shape(x), low.operand(x)
    axis = node.attrs.get("axis", 0) % len(shape)
    pos = 0
    for out in node.outputs:
        size = low.shape(out)[axis]
        _view_or_copy(low, node, Operand(op.tensor, op.offset + pos * op.strides[axis], op.strides), out)
        pos += size


@lowers("Gather")
def gather(low: Lowering, node) -> None:
    data, indices = node.inputs
    shape = low.shape(data)
    axis = node.attrs.get("axis", 0) % len(shape)
    n = math.prod(low.shape(indices))
    dst = low.result(node.outputs[0])
    if n == 0 or math.prod(shape) == 0:
        return
    const = low.const(indices)
    if const is None:       # run-time ids: negative ones are wrapped on the vector unit
        gather_axis(low.em, dst, low.operand(data), shape, axis, low.operand(indices), n, wrap=True)
        return
    rows = (np.asarray(const, np.int64).reshape(-1) % shape[axis]).astype(np.float32)
    ids = whole(low.em.const(f"{indices}_rows", rows, "f32"), rows.shape)
    gather_axis(low.em, dst, low.operand(data), shape, axis, ids, n, wrap=False)


def gather_axis(em: Emitter, dst: Operand, table: Operand, shape, axis: int, ids: Operand, n: int,
                wrap: bool) -> None:
    """dst[pre, i, post] = table[pre, ids[i], post] for contiguous ``dst`` and ``table`` of ``shape``.

    Each block of ids is loaded once; every index of the axes before ``axis`` is then one
    ``gather`` of rows ``post`` elements long. With ``wrap``, negative ids count from the end.
    """
    if table.strides != contiguous_strides(tuple(shape)):
        raise ValueError("internal: gather from a table that is not contiguous")
    pre, rows_in, post = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    block = min(n, (em.capacity("vec") - 2) // (post + 2), em.extent())
    if block < 1:
        raise ValueError(f"a gathered row of {post} elements does not fit the vector scratchpad")
    for r0 in range(0, n, block):
        rows, legion = min(block, n - r0), em.next_legion()
        idv, data = View("vec", 0, 1, 1), View("vec", 2 * rows, post, 1)
        em.emit(DmaLoad(legion, frozenset({legion}), idv, DramRef(ids.tensor, ids.offset + r0, 1), rows, 1))
        if wrap:
            _wrap_ids(em, legion, idv, View("vec", rows, 1, 1), rows, rows_in)
        else:
            em.fence((legion, "dma"))
        for p in range(pre):
            src = DramRef(table.tensor, table.offset + p * rows_in * post, post)
            em.emit(Gather(legion, data, src, View("vec", 0, 1, 0), rows, post))
            em.fence((legion, "dma"))
            out = DramRef(dst.tensor, dst.offset + (p * n + r0) * post, post)
            em.emit(DmaStore(legion, out, data, rows, post))
            em.fence((legion, "dma"))     # the next gather reuses the scratchpad rows


def _wrap_ids(em: Emitter, legion: int, ids: View, tmp: View, rows: int, size: int) -> None:
    """ids += size where ids < 0."""
    em.depend((legion, "dma"), (legion, "vec"))
    em.emit(BY_MNEMONIC["vlt"](legion, tmp, ids, 0.0, rows, 1))
    em.emit(BY_MNEMONIC["vmul"](legion, tmp, tmp, float(size), rows, 1))
    em.emit(BY_MNEMONIC["vadd"](legion, ids, ids, tmp, rows, 1))
    em.depend((legion, "vec"), (legion, "dma"))
