"""A concat's copy of a graph input, carried by the loads of the float matmul that reads the concat.

A decode step's key/value cache is ``present = Concat(past, new)``: a graph output, and the
operand of attention's products. Copied as a node of its own, the past crosses DRAM three
times: read and written by the copy, read again by the product. Instead the copy of ``past``
is left to the product (``Carried``): each of its loads that falls in ``present``'s past part
reads ``past`` in place, and the product stores what it loaded to ``present`` from its
scratchpad, the load after next (``_Stream``), so no DMA queue waits for a load to land. The
past crosses DRAM twice, while the product's vector work runs.

- **When.** The part comes from a graph input (nothing overwrites it), and every reader of the
  concat output is a chain of views ending in a float ``MatMul`` (``carried``).
- **Coverage.** A store is issued only for loaded elements no earlier store wrote; whatever no
  load covered (blocks a causal mask skips) is copied when the product's node ends
  (``settle``), as is the whole part before any other node that reads it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from isa.fields import DramRef, View
from isa.instructions import DmaLoad, DmaStore
from dlegion_cc.lower.layout import Operand

CHAIN_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Expand"})


@dataclass
class Carried:
    """``dst`` (a part of a concat output) still to be written with ``src``, both of ``shape``;
    ``covered``: its elements a product's store already wrote."""

    dst: Operand
    src: Operand
    shape: tuple[int, ...]
    covered: np.ndarray = field(init=False)

    def __post_init__(self):
        self.covered = np.zeros(self.shape, dtype=bool)

    def indices(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per DRAM offset of ``dst``'s tensor, its index in ``dst`` (axes first) and whether it is in it."""
        rem = offsets - self.dst.offset
        idx = np.zeros((len(self.shape),) + offsets.shape, dtype=np.int64)
        inside = rem >= 0
        for axis in sorted(range(len(self.shape)), key=lambda a: -self.dst.strides[a]):
            s = self.dst.strides[axis]
            if self.shape[axis] == 1 or s == 0:
                continue
            idx[axis] = rem // s
            rem = rem - idx[axis] * s
        inside &= (rem == 0) & np.all((idx >= 0) & (idx < np.array(self.shape).reshape((-1,) + (1,) * offsets.ndim)),
                                      axis=0)
        return idx, inside


def carried(low, concat, part: str) -> bool:
    """Whether the concat's copy of input ``part`` may be left to the loads of its readers."""
    graph = low.graph
    if part not in graph.inputs or low.dtype(part) != np.float32:
        return False
    return all(_ends_in_matmul(graph, n, concat.outputs[0]) for n in graph.consumers(concat.outputs[0]))


def _ends_in_matmul(graph, node, name: str) -> bool:
    while not node.domain and node.op in CHAIN_OPS and node.inputs[0] == name:
        name = node.outputs[0]
        readers = graph.consumers(name)
        if len(readers) != 1 or name in graph.outputs:
            return False
        node = readers[0]
    return not node.domain and node.op == "MatMul"


def load(em, i: DmaLoad) -> list[DmaStore]:
    """Emit ``i`` (a load of a float matmul's operand), its parts that read a carried
    destination reading the source instead; the stores that write those parts from the
    scratchpad, to be issued once ``i`` has landed."""
    entry = _entry(em, i)
    if entry is None:
        em.emit(i)
        return []
    count = em.span[1]
    rows = np.arange(i.rows).reshape(-1, 1)
    starts = i.src.offset + rows * i.src.rs + np.arange(count).reshape(1, -1) * (i.lstride or 0)
    idx, inside = entry.indices(starts)
    inside &= idx[-1] + i.cols <= entry.shape[-1]
    if entry.dst.strides[-1] != 1 or (inside.any(axis=1) != inside.all(axis=1)).any():
        raise ValueError("internal: a load covers part of a carried copy across its Legions")
    stores = []
    for r0, r1, carry in _runs(inside[:, 0]):
        part = _rows(i, r0, r1)
        if not carry:
            em.emit(part)
            continue
        src = entry.src.offset + np.tensordot(np.array(entry.src.strides), idx[:, r0:r1], axes=1)
        em.emit(_from_source(part, entry, src))
        sel = tuple(idx[:, r0:r1, :, None] + _row_ramp(entry, i.cols))
        if _distinct(entry, sel) and not entry.covered[sel].any():
            entry.covered[sel] = True
            stores.append(DmaStore(i.legion, part.src, part.dst, part.rows, part.cols, lstride=part.lstride))
    return stores


def _entry(em, i: DmaLoad) -> Carried | None:
    return next((c for c in em.carried if c.dst.tensor == i.src.tensor), None)


def _distinct(entry: Carried, sel: tuple) -> bool:
    """Whether no element is loaded twice: Legions of a span that load the same rows (heads
    that share a key/value head) would all store them, a race; settle copies them instead."""
    flat = np.ravel_multi_index(sel, entry.shape).ravel()
    return len(np.unique(flat)) == len(flat)


def _row_ramp(entry: Carried, cols: int) -> np.ndarray:
    """Offsets along the last axis of a row of ``cols`` elements, as an index to add."""
    ramp = np.zeros((len(entry.shape), 1, 1, cols), dtype=np.int64)
    ramp[-1, 0, 0] = np.arange(cols)
    return ramp


def _runs(flags: np.ndarray) -> list[tuple[int, int, bool]]:
    out = []
    for r, f in enumerate(flags.tolist()):
        if out and out[-1][2] == f:
            out[-1] = (out[-1][0], r + 1, f)
        else:
            out.append((r, r + 1, f))
    return out


def _rows(i: DmaLoad, r0: int, r1: int) -> DmaLoad:
    """Rows ``r0`` .. ``r1 - 1`` of load ``i``."""
    if (r0, r1) == (0, i.rows):
        return i
    dst = View(i.dst.space, i.dst.addr + r0 * i.dst.rs, i.dst.rs, i.dst.cs)
    return DmaLoad(i.legion, i.dests, dst, DramRef(i.src.tensor, i.src.offset + r0 * i.src.rs, i.src.rs),
                   r1 - r0, i.cols, lstride=i.lstride)


def _from_source(part: DmaLoad, entry: Carried, src: np.ndarray) -> DmaLoad:
    """``part`` reading the carried source at offsets ``src`` [rows, Legions]: one affine load."""
    rs = int(src[1, 0] - src[0, 0]) if src.shape[0] > 1 else part.src.rs
    ls = int(src[0, 1] - src[0, 0]) if src.shape[1] > 1 else None
    grid = src[0, 0] + np.arange(src.shape[0]).reshape(-1, 1) * rs + np.arange(src.shape[1]).reshape(1, -1) * (ls or 0)
    if not np.array_equal(grid, src):
        raise ValueError("internal: a carried copy's source is not one strided load")
    return DmaLoad(part.legion, part.dests, part.dst, DramRef(entry.src.tensor, int(src[0, 0]), rs),
                   part.rows, part.cols, lstride=ls if part.lstride is not None else None)


def settle(low, tensors=None) -> bool:
    """Copy what no load carried of the entries whose destination is in ``tensors`` (all when
    None), and drop them. True when something was emitted."""
    from dlegion_cc.lower.movement import nd_copy       # it imports this module
    em, emitted = low.em, False
    for entry in [c for c in em.carried if tensors is None or c.dst.tensor in tensors]:
        em.carried.remove(entry)
        for dst, src, shape in _uncovered(entry):
            nd_copy(em, dst, src, shape)
            emitted = True
    return emitted


def _uncovered(entry: Carried) -> list[tuple[Operand, Operand, tuple]]:
    """The parts of ``entry`` no store wrote: the whole when none did, else runs of rows."""
    if not entry.covered.any():
        return [(entry.dst, entry.src, entry.shape)]
    out = []
    flat = entry.covered.reshape(-1, entry.shape[-1])
    for row in np.flatnonzero(~flat.all(axis=1)).tolist():
        index = np.unravel_index(row, entry.shape[:-1]) if entry.shape[:-1] else ()
        for c0, c1, done in _runs(flat[row]):
            if done:
                continue
            at = tuple(int(x) for x in index)
            dst, src = entry.dst.at(at), entry.src.at(at)
            out.append((Operand(dst.tensor, dst.offset + c0 * dst.strides[0], dst.strides),
                        Operand(src.tensor, src.offset + c0 * src.strides[0], src.strides), (c1 - c0,)))
    return out


def tensors_read(low, node) -> set[int]:
    """The DRAM tensors of the node's inputs that have operands."""
    return {low.operands[n].tensor for n in node.inputs if n in low.operands}


def reads_by_loads(node) -> bool:
    """Nodes that read a carried destination only through views or a float matmul's loads."""
    return not node.domain and (node.op in CHAIN_OPS or node.op == "MatMul")


def pending(low, node) -> set[int]:
    tensors = {c.dst.tensor for c in low.em.carried}
    return tensors & tensors_read(low, node) if tensors else set()

