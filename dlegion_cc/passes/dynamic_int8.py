"""Dynamic int8 quantization: MatMulInteger + Cast + Mul(scale) -> one quantized matmul.

Source construct (onnxruntime ``quantize_dynamic(weight_type=QInt8)``)::

    xq, xs, xz = DynamicQuantizeLinear(x)             # uint8, run-time scale and zero point
    acc = MatMulInteger(xq, Wq, xz, wz)                 # Wq, wz: constants
    y   = Mul(Cast(acc, to=float), Mul(xs, w_scale))    # the scale product is a run-time scalar

becomes ``y = dlegion.QMatMul(xq, xs, xz)`` with ``weight = Wq - wz`` and
``rscale_factor = w_scale``: the arrays multiply xq - 128 stored as int8, a correction pass adds
(128 - xz) * colsum(W) exactly, and the drain converts the int32 sum to fp32 and multiplies it
once by fp32(xs * w_scale), as Cast + Mul do.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlegion_cc.ir import DLEGION, Graph, Node
from dlegion_cc.lower.qmatmul import mode_for

OFFSET = {np.dtype(np.uint8): 128, np.dtype(np.int8): 0}


def integer_weights(graph: Graph, b: str, b_zp: str) -> np.ndarray:
    """B - b_zero_point for a constant 2-D B (raises ValueError for anything else)."""
    w = graph.const(b)
    if w is None:
        raise ValueError(f"B '{b}' is computed at run time; of the integer matmuls only MatMulInteger of two int8 "
                         "values takes a run-time B")
    if w.ndim not in (2, 3):
        raise ValueError(f"B '{b}' has rank {w.ndim}; only 2-D weights (or a batch of them) are supported")
    zp = graph.const(b_zp) if b_zp else None
    if b_zp and zp is None:
        raise ValueError(f"b_zero_point '{b_zp}' is computed at run time")
    if zp is not None and zp.size not in (1, w.shape[-1]):
        raise ValueError(f"b_zero_point of shape {list(zp.shape)} is neither per tensor nor per column")
    return w.astype(np.int64) - (0 if zp is None else zp.astype(np.int64).reshape(-1))


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
        if values.ndim != 2:
            return
        cast = only_consumer(graph, mmi.outputs[0], "Cast")
        if offset is None or cast is None or np.dtype(graph.values[cast.outputs[0]].dtype) != np.float32:
            return
        mul = only_consumer(graph, cast.outputs[0], "Mul")
        scale = None if mul is None else _scale_operand(graph, mul, cast.outputs[0], values.shape[1])
        if scale is None:
            return
        attrs = {"weight": values, "mode": mode_for(values) or "w8", "act_offset": offset}
        s = ""
        if graph.const(scale) is None:
            s, factor = _scale_product(graph, scale)
            if factor is not None:
                attrs["rscale_factor"] = factor
        else:
            per_column = graph.const(scale).astype(np.float32).reshape(-1)
            attrs["cscale"] = np.broadcast_to(per_column, (values.shape[1],)).copy()
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


def _scale_product(graph: Graph, scale: str) -> tuple[str, float | None]:
    """(x_scale, w_scale) when ``scale`` = Mul(x_scale, constant w_scale) read only here: the
    QMatMul forms the product itself (the same fp32 multiply), so no scalar node remains."""
    mul = graph.producer(scale)
    if mul is None or mul.op != "Mul" or mul.domain or len(graph.consumers(scale)) != 1 or scale in graph.outputs:
        return scale, None
    consts = [graph.const(i) for i in mul.inputs]
    if sum(c is not None for c in consts) != 1:
        return scale, None
    k = 0 if consts[0] is not None else 1
    if consts[k].size != 1 or graph.values[mul.inputs[1 - k]].shape != graph.values[scale].shape:
        return scale, None
    return mul.inputs[1 - k], float(np.float32(consts[k].reshape(())))
