"""BitLinear: absmax int8 activations x a ternary constant -> one w2 matmul.

Source construct (BitNet b1.58, transformers' AutoBitLinear exported by torch.onnx)::

    q  = Clip(Round(x * s), -128, 127)      # s: per-row scale, shape [..., M, 1]
    xq = Div(q, s)
    y  = MatMul(xq, W)                       # W: constant, every value in {-1, 0, 1}
    y  = Mul(y, weight_scale)                # optional, a constant

becomes ``y = dlegion.QMatMul(q, s)`` with ``weight=W`` and ``cscale=weight_scale``: the
matrix unit multiplies the exact int8 ``q`` by the 2-bit ``W`` in int32, and the drain
applies ``1/s`` per row and the weight scale per column.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlegion_cc.ir import DLEGION, Graph, Mapped, Node, astype

PIECE = 1 << 24     # bytes checked at a time: a float weight fails at its first piece


def is_ternary(w) -> bool:
    """Every value in {-1, 0, 1}: read a piece at a time, so a mapped 1 GB table is never
    resident whole."""
    if isinstance(w, Mapped):
        pieces = w.pieces(PIECE)
    else:
        flat = np.asarray(w).reshape(-1)
        step = max(1, PIECE // max(1, flat.itemsize))
        pieces = (flat[i:i + step] for i in range(0, flat.size, step))
    return w.size > 0 and all(np.isin(p, (-1.0, 0.0, 1.0)).all() for p in pieces)


def int8_valued(graph: Graph, name: str) -> bool:
    """True when ``name`` = Clip(Round(...), lo >= -128, hi <= 127): exact int8 values in fp32."""
    clip = graph.producer(name)
    if clip is None or clip.op != "Clip" or len(clip.inputs) < 3:
        return False
    lo, hi = graph.const(clip.inputs[1]), graph.const(clip.inputs[2])
    if lo is None or hi is None or float(lo) < -128 or float(hi) > 127:
        return False
    rnd = graph.producer(clip.inputs[0])
    return rnd is not None and rnd.op == "Round"


def per_row(graph: Graph, scale: str, act: str) -> bool:
    s, a = graph.values[scale].shape, graph.values[act].shape
    return len(s) == len(a) and s[-1] == 1 and s[:-1] == a[:-1]


@dataclass(frozen=True)
class RecognizeBitLinear:
    name: str = "bitlinear"

    def run(self, graph: Graph, options) -> None:
        for node in list(graph.nodes):
            if node.op == "MatMul" and node.domain == "":
                self._rewrite(graph, node)

    def _rewrite(self, graph: Graph, mm: Node) -> None:
        act, w = mm.inputs
        weight, div = graph.stored(w), graph.producer(act)
        if div is None or div.op != "Div" or not int8_valued(graph, div.inputs[0]):
            return
        q, s = div.inputs
        if weight is None or weight.ndim != 2 or not per_row(graph, s, q) or not is_ternary(weight):
            return      # the weight is read last, only for a matmul that is otherwise a BitLinear
        # A large weight stays lazy: its int8 copy is made when the lowering packs it.
        attrs = {"weight": astype(weight, np.int8), "mode": "w2", "row_divisor": True}
        qmm = Node("QMatMul", mm.name, [q, s], list(mm.outputs), attrs, DLEGION)
        graph.nodes[graph.nodes.index(mm)] = qmm
        _absorb_weight_scale(graph, qmm)


def _absorb_weight_scale(graph: Graph, qmm: Node) -> None:
    """Fold a following Mul by a constant per-tensor or per-column scale into the drain."""
    out = qmm.outputs[0]
    users = graph.consumers(out)
    if len(users) != 1 or users[0].op != "Mul" or out in graph.outputs:
        return
    mul = users[0]
    other = mul.inputs[1] if mul.inputs[0] == out else mul.inputs[0]
    scale = graph.const(other)
    n = qmm.attrs["weight"].shape[1]
    if scale is None or scale.size not in (1, n) or graph.values[mul.outputs[0]].shape != graph.values[out].shape:
        return
    if scale.size == n and scale.shape[-1] != n:
        return
    qmm.attrs["cscale"] = np.broadcast_to(scale.astype(np.float32).reshape(-1), (n,)).copy()
    qmm.outputs = list(mul.outputs)
    graph.nodes.remove(mul)
