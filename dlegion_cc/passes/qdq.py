"""QDQ graphs: MatMul(DequantizeLinear(int activations), int weights) -> one quantized matmul.

Source construct (onnxruntime ``quantize_static`` in QDQ format, int8 or int4 weights, standard
or com.microsoft Q/DQ)::

    xq = QuantizeLinear(x, sa, za)                                 # per tensor, constant
    y  = MatMul(DequantizeLinear(xq, sa, za), DequantizeLinear(Wq, sw, zw, axis=1))

becomes ``y = dlegion.QMatMul(xq)`` with ``weight = Wq - zw``, activation zero point ``za``
(a correction pass on the arrays) and column scales ``sa * sw`` applied by the drain; the
QuantizeLinear stays and writes the integers. Blocked weights (axis 0, ``block_size``) drain
once per block.

The importer folds a standard DequantizeLinear of constants into fp32 weights. Those are
taken apart again exactly: every column must equal ``fp32(q * s)`` for integers |q| <= 128
and one scale s near ``max|column| / max|q|``, checked element by element; otherwise the
MatMul stays in float.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlegion_cc.ir import DLEGION, Graph, Node
from dlegion_cc.lower.qmatmul import mode_for

DQ_DOMAINS = ("", "com.microsoft")
OFFSET = {np.dtype(np.uint8): 128, np.dtype(np.int8): 0}
LARGEST_CODE = 128
# Largest codes tried, in order: those of symmetric int4 and int8 quantizers first, then every
# other one from the smallest up, so a column is found with the narrowest codes that hold it.
TOPS = (7, 8, 127, 128) + tuple(t for t in range(1, LARGEST_CODE + 1) if t not in (7, 8, 127, 128))
ULP_STEPS = (0, 1, -1, 2, -2)


def expand_param(p: np.ndarray, shape: tuple[int, ...], axis: int, block: int) -> np.ndarray:
    """A Q/DQ scale or zero point broadcast to ``shape`` (per tensor, per axis or per block)."""
    if p.size == 1:
        return p.reshape(())
    axis %= len(shape)
    if block:
        return np.take(np.repeat(p, block, axis=axis), np.arange(shape[axis]), axis=axis)
    return p.reshape([-1 if d == axis else 1 for d in range(len(shape))])


def _params(graph: Graph, node: Node):
    x, s, z = (node.inputs + [""])[:3]
    return graph.const(x), graph.const(s), (graph.const(z) if z else None)


def dequantize_constant(graph: Graph, node: Node) -> np.ndarray:
    """(x - zero_point) * scale of a DequantizeLinear whose inputs are all constants, in fp32."""
    x, s, z = _params(graph, node)
    axis, block = node.attrs.get("axis", 1), node.attrs.get("block_size", 0)
    ints = x.astype(np.int64) - (0 if z is None else expand_param(z.astype(np.int64), x.shape, axis, block))
    return (ints.astype(np.float32) * expand_param(s.astype(np.float32), x.shape, axis, block)).astype(np.float32)


def dq_weights(graph: Graph, node: Node):
    """(values [K, N], scales [groups, N], block) of a DequantizeLinear of a constant 2-D weight
    with scales per tensor, per column or per block of rows; None otherwise."""
    x, s, z = _params(graph, node)
    z_named = len(node.inputs) > 2 and node.inputs[2]
    if x is None or s is None or x.ndim != 2 or (z_named and z is None):
        return None
    K, N = x.shape
    axis, block = node.attrs.get("axis", 1) % 2, node.attrs.get("block_size", 0)
    values = x.astype(np.int64) - (0 if z is None else expand_param(z.astype(np.int64), x.shape, axis, block))
    s = s.astype(np.float32)
    if s.size == 1:
        return values, np.full((1, N), s.reshape(()), np.float32), 0
    if not block and axis == 1:
        return values, s.reshape(1, N), 0
    if block and axis == 0:
        return values, s.reshape(-1, N), block
    return None      # scales that change along a row of W (per row of K) are not column scales


def _ulps(s: np.ndarray, steps: int) -> np.ndarray:
    toward = np.float32(np.inf if steps > 0 else -np.inf)
    for _ in range(abs(steps)):
        s = np.nextafter(s, toward)
    return s


def _fit(cols: np.ndarray, absmax: np.ndarray):
    """Per column: (codes, scale, ok) for the first candidate scale that reproduces it exactly."""
    n = cols.shape[1]
    codes, scales, ok = np.zeros(cols.shape, np.int64), np.ones(n, np.float32), absmax == 0
    for top in TOPS:
        for steps in ULP_STEPS:
            todo = np.flatnonzero(~ok)
            if not todo.size:
                return codes, scales, ok
            s = _ulps((absmax[todo] / np.float32(top)).astype(np.float32), steps)
            with np.errstate(all="ignore"):
                q = np.rint(cols[:, todo] / s)
            exact = (q.astype(np.float32) * s == cols[:, todo]).all(axis=0)
            good = exact & (np.abs(q) <= LARGEST_CODE).all(axis=0)
            codes[:, todo[good]], scales[todo[good]] = q[:, good].astype(np.int64), s[good]
            ok[todo[good]] = True
    return codes, scales, ok


def recover_weights(w: np.ndarray):
    """(values [K, N], scales [1, N], 0) with fp32(values * scales) == w exactly, or None.

    The scale of a column is searched near max|column| / top for every possible largest code
    (see TOPS); a float matrix fails on its first column, which is tried alone.
    """
    if w.ndim != 2 or w.dtype != np.float32 or not w.size:
        return None
    absmax = np.abs(w).max(axis=0)
    if not _fit(w[:, :1], absmax[:1])[2].all():
        return None
    values, scales, ok = _fit(w, absmax)
    return (values, scales[None, :], 0) if ok.all() else None


def weight_of(graph: Graph, name: str):
    dq = graph.producer(name)
    if dq is not None and dq.op == "DequantizeLinear" and dq.domain in DQ_DOMAINS:
        return dq_weights(graph, dq)
    w = graph.const(name)
    return None if w is None else recover_weights(w)


def activation_of(graph: Graph, name: str):
    """(q, scale, zero point) when ``name`` = DequantizeLinear(q) per tensor with constants."""
    dq = graph.producer(name)
    if dq is None or dq.op != "DequantizeLinear" or dq.domain not in DQ_DOMAINS:
        return None
    q, s, z = (dq.inputs + [""])[:3]
    scale, zp = graph.const(s), (graph.const(z) if z else np.zeros(1, np.int64))
    if scale is None or zp is None or scale.size != 1 or zp.size != 1 or graph.const(q) is not None:
        return None
    if np.dtype(graph.values[q].dtype) not in OFFSET:
        return None
    return q, np.float32(scale.reshape(())), int(zp.reshape(()))


@dataclass(frozen=True)
class RecognizeQDQMatMul:
    name: str = "qdq"

    def run(self, graph: Graph, options) -> None:
        for node in list(graph.nodes):
            if node.op == "MatMul" and node.domain == "":
                self._rewrite(graph, node)

    def _rewrite(self, graph: Graph, mm: Node) -> None:
        act = activation_of(graph, mm.inputs[0])
        w = None if act is None else weight_of(graph, mm.inputs[1])
        if w is None:
            return
        q, sa, za = act
        values, scales, block = w
        attrs = {"weight": values, "mode": mode_for(values) or "w8", "scales": (sa * scales).astype(np.float32),
                 "block": block, "act_offset": OFFSET[np.dtype(graph.values[q].dtype)], "act_zero_point": za}
        graph.nodes[graph.nodes.index(mm)] = Node("QMatMul", mm.name, [q], list(mm.outputs), attrs, DLEGION)
