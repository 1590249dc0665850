"""Dynamic int8 quantization: MatMulInteger + Cast + Mul(scale) -> one quantized matmul.

Source construct (onnxruntime ``quantize_dynamic(weight_type=QInt8)``)::

    xq, xs, xz = DynamicQuantizeLinear(x)             # uint8, run-time scale and zero point
    acc = MatMulInteger(xq, Wq, xz, wz)                 # Wq, wz: constants
    y   = Mul(Cast(acc, to=float), Mul(xs, w_scale))    # the scale product is a run-time scalar

becomes ``y = dlegion.QMatMul(xq, scale, xz)`` with ``weight = Wq - wz`` (int8): the arrays
multiply xq - 128 stored as int8, a correction pass adds (128 - xz) * colsum(W) exactly, and
the drain converts the int32 sum to fp32 and multiplies by the scale once, as Cast + Mul do.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlegion_cc.ir import DLEGION, Graph, Node
from dlegion_cc.lower.qmatmul import mode_for

OFFSET = {np.dtype(np.uint8): 128, np.dtype(np.int8): 0}


def integer_weights(graph: Graph, b: str, b_zp: str) -> np.ndarray:
    """B - b_zero_point for a constant 2-D B; raises ValueError when that is not an int8 matrix."""
    w = graph.const(b)
    if w is None:
        raise ValueError(f"B '{b}' is computed at run time; the arrays take constant weights only")
    if w.ndim != 2:
        raise ValueError(f"B '{b}' has rank {w.ndim}; only 2-D weights are supported")
    zp = graph.const(b_zp) if b_zp else None
    if b_zp and zp is None:
        raise ValueError(f"b_zero_point '{b_zp}' is computed at run time")
    if zp is not None and zp.size not in (1, w.shape[1]):
        raise ValueError(f"b_zero_point of shape {list(zp.shape)} is neither per tensor nor per column")
    values = w.astype(np.int64) - (0 if zp is None else zp.astype(np.int64).reshape(1, -1))
    if mode_for(values) is None:
        raise ValueError(f"B - b_zero_point spans [{values.min()}, {values.max()}], which does not fit int8")
    return values


def only_consumer(graph: Graph, name: str, op: str) -> Node | None:
    users = graph.consumers(name)
    if len(users) != 1 or users[0].op != op or users[0].domain or name in graph.outputs:
        return None
    return users[0]


@dataclass(frozen=True)
class RecognizeDynamicInt8:
    name: str = "dynamic-int8"

    def run(self, graph: Graph, options) -> None:
        for node in list(graph.nodes):
            if node.op == "MatMulInteger" and node.domain == "":
                self._rewrite(graph, node)

    def _rewrite(self, graph: Graph, mmi: Node) -> None:
        a, b, a_zp, b_zp = (mmi.inputs + ["", ""])[:4]
        offset = OFFSET.get(np.dtype(graph.values[a].dtype))
        try:
            values = integer_weights(graph, b, b_zp)
        except ValueError:
            return            # MatMulInteger's own lowering reports why
        cast = only_consumer(graph, mmi.outputs[0], "Cast")
        if offset is None or cast is None or np.dtype(graph.values[cast.outputs[0]].dtype) != np.float32:
            return
        mul = only_consumer(graph, cast.outputs[0], "Mul")
        scale = None if mul is None else _scale_operand(graph, mul, cast.outputs[0], values.shape[1])
        if scale is None:
            return
        attrs = {"weight": values, "mode": mode_for(values), "act_offset": offset}
        s = ""
        if graph.const(scale) is None:
            s = scale
        else:
            attrs["cscale"] = np.broadcast_to(graph.const(scale).astype(np.float32).reshape(-1), (values.shape[1],)).copy()
        qmm = Node("QMatMul", mmi.name, [a, s, a_zp], list(mul.outputs), attrs, DLEGION)
        graph.nodes[graph.nodes.index(mmi)] = qmm
        graph.nodes.remove(cast)
        graph.nodes.remove(mul)


def _scale_operand(graph: Graph, mul: Node, acc: str, n: int) -> str | None:
    """The other Mul operand when it is one run-time scalar, or a constant per tensor or column."""
    other = mul.inputs[1] if mul.inputs[0] == acc else mul.inputs[0]
    v = graph.values.get(other)
    if v is None or graph.values[mul.outputs[0]].shape != graph.values[acc].shape:
        return None
    size = int(np.prod(v.shape))
    if size == 1 or (v.const is not None and size == n and v.shape[-1] == n):
        return other
    return None
