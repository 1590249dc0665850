"""Causal attention: the score blocks a constant mask wipes out need not be computed.

Source construct (a decoder's attention, scores of shape [..., S_q, S_k])::

    s = MatMul(q, k_t)              # QK^T
    s = Mul(s, c)                   # optional, a scalar constant (1/sqrt(d))
    s = Add(s, mask)                # mask: constant [1, .., 1, S_q, S_k], 0 or the fp32 minimum
    p = Softmax(s, axis=-1)
    o = MatMul(p, v)                # PV

Where the mask holds the fp32 minimum (or -inf), ``s + mask`` is the mask itself whatever the
score (any score below 1e30 is lost in its rounding), and softmax makes ``p`` exactly 0 there
(unless the whole row is masked: then its scores tie). So the QK^T MatMul gets ``dead`` (those
outputs are never looked at) and the PV MatMul ``zero_a`` (those entries of ``p`` are exact
zeros, whose products add nothing); the float matmul lowering skips the blocks and K-chunks
that lie wholly inside, and cuts the blocks the diagonal crosses into strips of rows that
compute only the columns, and sum only the K rows, they reach. The program is the same bit for
bit; only the work goes away.

Skipping is exact only where the skipped products' operands are finite: ONNX adds the mask to a
NaN or infinite score (NaN: the whole softmax row is NaN) and multiplies P's zeros by V's NaN
or infinite entries (NaN). So nothing is skipped where a constant the operands are computed
from (an initializer or a folded weight's scales) holds a NaN or an infinity, the
``-inf`` entries of a causal mask before its softmax excepted; values computed from the
graph's inputs are taken to be finite.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlegion_cc.ir import Graph, Mapped, Node

SWAMPING = -1e37      # mask values at or below this swamp any attention score when added


@dataclass(frozen=True)
class CausalSkip:
    name: str = "causal"

    def run(self, graph: Graph, options) -> None:
        if not options.sparsity:
            return
        finite = Finiteness(graph)
        for node in list(graph.nodes):
            if node.op == "Softmax" and node.domain == "":
                _mark(graph, node, finite)



def _mark(graph: Graph, softmax: Node, finite: "Finiteness") -> None:
    rank = len(graph.values[softmax.inputs[0]].shape)
    if softmax.attrs.get("axis", -1) % rank != rank - 1:
        return
    add = graph.producer(softmax.inputs[0])
    if add is None or add.op != "Add" or graph.only_user(add.outputs[0]) is not softmax:
        return
    dead, scores = _mask_and_scores(graph, add)
    if dead is None or not dead.any():
        return
    qk = _through_scale(graph, scores)
    if qk is None or qk.op != "MatMul" or qk.domain != "" or graph.only_user(qk.outputs[0]) is None:
        return
    if graph.values[qk.outputs[0]].shape[-2:] != dead.shape:
        return
    if not all(finite.known(name) for name in qk.inputs):      # a NaN score makes its whole row NaN
        return
    qk.attrs["dead"] = dead
    # A row the mask wipes out whole is not zeros after the softmax (all its scores tie).
    zero = dead & ~dead.all(axis=1, keepdims=True)
    readers = graph.consumers(softmax.outputs[0])
    pvs = [pv for pv in readers if pv.op == "MatMul" and pv.domain == "" and pv.inputs[0] == softmax.outputs[0]]
    for pv in pvs:
        if finite.known(pv.inputs[1]):          # 0 x NaN or 0 x inf is NaN
            pv.attrs["zero_a"] = zero
    if len(pvs) == len(readers) and softmax.outputs[0] not in graph.outputs:
        # Per row of P, the columns up to its last one that is not an exact zero: all P.V
        # reads of the rest are zeros, which P's DRAM tensor holds unless written (it starts
        # zeroed).
        softmax.attrs["reach"] = reach(~zero)


def reach(live: np.ndarray) -> np.ndarray | int:
    """Along the last axis: 1 + the index of the last true entry (0 where there is none)."""
    last = live.shape[-1] - np.argmax(live[..., ::-1], axis=-1)
    return np.where(live.any(axis=-1), last, 0).astype(np.int64)


def _mask_and_scores(graph: Graph, add: Node):
    """(the entries the constant mask swamps, as a 2-D bool array; the other addend)."""
    for i in (0, 1):
        mask = graph.const(add.inputs[i])
        if mask is None or mask.ndim < 2 or mask.size != mask.shape[-1] * mask.shape[-2]:
            continue
        scores = add.inputs[1 - i]
        if graph.values[scores].shape[-2:] != mask.shape[-2:] or graph.values[add.outputs[0]].shape != graph.values[scores].shape:
            continue
        return mask.reshape(mask.shape[-2:]) <= SWAMPING, scores
    return None, None


def _through_scale(graph: Graph, name: str) -> Node | None:
    """The producer of ``name``, looking through one Mul by a scalar constant."""
    node = graph.producer(name)
    if node is None or node.op != "Mul" or graph.only_user(name) is None:
        return node
    for i in (0, 1):
        c = graph.const(node.inputs[i])
        if c is not None and c.size == 1 and np.isfinite(c).all() and abs(float(c.reshape(()))) <= 1e3:
            inner = node.inputs[1 - i]
            return graph.producer(inner) if graph.only_user(inner) is node else None
    return None


class Finiteness:
    """Which values are known to hold no NaN and no infinity, given finite graph inputs: those
    computed only from finite constants. Asked value by value, so only the constants a value is
    computed from are read (each once)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.producers = {o: n for n in graph.nodes for o in n.outputs}
        self.memo: dict[str, bool] = {"": True}

    def known(self, name: str) -> bool:
        stack = [name]
        while stack:
            top = stack[-1]
            if top in self.memo:
                stack.pop()
                continue
            node = self.producers.get(top)
            if node is None:
                self.memo[top] = self._leaf(top)
                stack.pop()
                continue
            todo = [i for i in node.inputs if i not in self.memo]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            ok = self._node(node)
            self.memo.update((o, ok) for o in node.outputs)
        return self.memo[name]

    def _leaf(self, name: str) -> bool:
        """A graph input (taken to be finite) or a constant (read to see)."""
        stored = self.graph.stored(name)
        return stored is None or _finite(stored)

    def _node(self, node: Node) -> bool:
        if node.op == "Softmax" and node.domain == "" and self._masked_scores(node.inputs[0]):
            return True
        return all(self.memo[i] for i in node.inputs) and all(_finite(a) for a in node.attrs.values())

    def _masked_scores(self, name: str) -> bool:
        """Finite scores plus a constant mask whose only non-finite entries are -inf and whose every row
        keeps a finite entry: the softmax of that is finite."""
        add = self.producers.get(name)
        if add is None or add.op != "Add" or add.domain != "" or len(add.inputs) != 2:
            return False
        for i in (0, 1):
            mask = self.graph.const(add.inputs[i])
            if mask is None or mask.ndim < 1 or not np.issubdtype(mask.dtype, np.floating):
                continue
            if not self.memo[add.inputs[1 - i]] or np.isnan(mask).any() or (mask == np.inf).any():
                continue
            if self.graph.values[name].shape[-1:] == mask.shape[-1:] and np.isfinite(mask).any(axis=-1).all():
                return True
        return False


def _finite(value) -> bool:
    """Whether a constant or an attribute holds no NaN and no infinity (non-float ones hold none);
    a large mapped constant is read a piece at a time."""
    if isinstance(value, float):
        return np.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    dtype = getattr(value, "dtype", None)
    if dtype is None or not np.issubdtype(dtype, np.inexact):
        return True
    if isinstance(value, Mapped):
        return all(np.isfinite(piece).all() for piece in value.pieces())
    return bool(np.isfinite(np.asarray(value)).all())
