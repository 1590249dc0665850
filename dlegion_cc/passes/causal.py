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
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlegion_cc.ir import Graph, Node

SWAMPING = -1e37      # mask values at or below this swamp any attention score when added


@dataclass(frozen=True)
class CausalSkip:
    name: str = "causal"

    def run(self, graph: Graph, options) -> None:
        if not options.sparsity:
            return
        for node in list(graph.nodes):
            if node.op == "Softmax" and node.domain == "":
                _mark(graph, node)


def _only_user(graph: Graph, name: str) -> Node | None:
    users = graph.consumers(name)
    return users[0] if len(users) == 1 and name not in graph.outputs else None


def _mark(graph: Graph, softmax: Node) -> None:
    rank = len(graph.values[softmax.inputs[0]].shape)
    if softmax.attrs.get("axis", -1) % rank != rank - 1:
        return
    add = graph.producer(softmax.inputs[0])
    if add is None or add.op != "Add" or _only_user(graph, add.outputs[0]) is not softmax:
        return
    dead, scores = _mask_and_scores(graph, add)
    if dead is None or not dead.any():
        return
    qk = _through_scale(graph, scores)
    if qk is None or qk.op != "MatMul" or qk.domain != "" or _only_user(graph, qk.outputs[0]) is None:
        return
    if graph.values[qk.outputs[0]].shape[-2:] != dead.shape:
        return
    qk.attrs["dead"] = dead
    # A row the mask wipes out whole is not zeros after the softmax (all its scores tie).
    zero = dead & ~dead.all(axis=1, keepdims=True)
    readers = graph.consumers(softmax.outputs[0])
    pvs = [pv for pv in readers if pv.op == "MatMul" and pv.domain == "" and pv.inputs[0] == softmax.outputs[0]]
    for pv in pvs:
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
    if node is None or node.op != "Mul" or _only_user(graph, name) is None:
        return node
    for i in (0, 1):
        c = graph.const(node.inputs[i])
        if c is not None and c.size == 1 and np.isfinite(c).all() and abs(float(c.reshape(()))) <= 1e3:
            inner = node.inputs[1 - i]
            return graph.producer(inner) if _only_user(graph, inner) is node else None
    return None
