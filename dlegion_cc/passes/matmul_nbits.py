"""4-bit (and 2/8-bit) blockwise weights: com.microsoft.MatMulNBits -> one quantized matmul.

Source construct (onnxruntime ``MatMulNBitsQuantizer``)::

    y = MatMulNBits(x, B, scales[, zero_points][, g_idx][, bias])   K, N, bits, block_size

B packs codes q along K, lowest bits first, as [N, K / block, block * bits / 8] bytes; the
weight is (q - zero_point) * scale per block of ``block_size`` rows (zero point 2^(bits-1)
when absent). It becomes::

    xq, r = dlegion.AbsmaxQuantize(x)    # int8 per row: xq = round(x / r), r = max|x| / 127
    y = dlegion.QMatMul(xq, r)           # weight = q - zero_point, scales per block

The weight is exact (w4 when it fits [-8, 7], w8, or two w8 pieces for 8-bit codes with
zero points); quantizing the float activations to int8 per
row is this lowering's only approximation (onnxruntime's accuracy_level 4 quantizes them too,
per block). One AbsmaxQuantize serves every MatMulNBits reading the same x.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dlegion_cc.ir import DLEGION, Graph, Node, Value
from dlegion_cc.lower.qmatmul import Weights, mode_for
from dlegion_cc.ort_schemas import MS

APPROXIMATION = "int8_activations"      # recorded in the program for dlegion-run --check


def unpack_codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Codes of ``bits`` bits packed lowest first in the last axis of ``packed`` (uint8)."""
    per = 8 // bits
    shifts = np.arange(per, dtype=np.uint8) * bits
    codes = (packed[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :count].astype(np.int64)


def _const(graph: Graph, node: Node, index: int, what: str) -> np.ndarray | None:
    name = node.inputs[index] if index < len(node.inputs) else ""
    if not name:
        return None
    c = graph.const(name)
    if c is None:
        raise ValueError(f"{what} '{name}' is computed at run time; it must be a constant")
    return c


def _zero_points(graph: Graph, node: Node, bits: int, n: int, blocks: int) -> np.ndarray:
    zp = _const(graph, node, 3, "zero_points")
    if zp is None:
        return np.full((n, blocks), 1 << (bits - 1), np.int64)
    if zp.dtype == np.uint8:
        per_col = math.ceil(blocks * bits / 8)
        return unpack_codes(zp.reshape(n, per_col), bits, blocks)
    values = zp.astype(np.float64).reshape(n, blocks)
    if not np.array_equal(values, np.round(values)):
        raise ValueError("fractional float zero points make non-integer weights; not supported")
    return values.astype(np.int64)


def nbits_weights(graph: Graph, node: Node) -> Weights:
    """The integer weight, per-block scales and bias of a MatMulNBits node; ValueError if none."""
    K, N = node.attrs["K"], node.attrs["N"]
    bits, block = node.attrs.get("bits", 4), node.attrs["block_size"]
    kind = np.dtype(graph.values[node.inputs[0]].dtype)
    if kind != np.float32:
        raise ValueError(f"activations of type {kind.name} are not supported (float32)")
    if bits not in (2, 4, 8):
        raise ValueError(f"bits={bits} is not supported (2, 4 or 8)")
    blocks = math.ceil(K / block)
    packed = _const(graph, node, 1, "B")
    scales = _const(graph, node, 2, "scales")
    if packed is None or scales is None or packed.dtype != np.uint8:
        raise ValueError("B must be a constant uint8 tensor with constant scales")
    g_idx = _const(graph, node, 4, "g_idx")
    if g_idx is not None and not np.array_equal(g_idx.reshape(-1)[:K], np.arange(K) // block):
        raise ValueError("a g_idx that reorders the rows is not supported")
    codes = unpack_codes(packed.reshape(N, blocks, -1), bits, block).reshape(N, -1)[:, :K]
    zp = np.repeat(_zero_points(graph, node, bits, N, blocks), block, axis=1)[:, :K]
    bias = _const(graph, node, 5, "bias")
    return Weights((codes - zp).T, scales.astype(np.float32).reshape(N, blocks).T.copy(), block,
                   None if bias is None else bias.astype(np.float32).reshape(N))


@dataclass(frozen=True)
class RecognizeMatMulNBits:
    name: str = "matmul-nbits"

    def run(self, graph: Graph, options) -> None:
        quantized: dict[str, tuple[str, str]] = {}
        for node in list(graph.nodes):
            if node.op == "MatMulNBits" and node.domain == MS:
                self._rewrite(graph, node, quantized)

    def _rewrite(self, graph: Graph, node: Node, quantized: dict) -> None:
        try:
            w = nbits_weights(graph, node)
        except ValueError:
            return            # the MatMulNBits lowering reports why
        x = node.inputs[0]
        if x not in quantized:
            quantized[x] = _absmax_node(graph, x, graph.nodes.index(node))
        q, r = quantized[x]
        attrs = {"weight": w.values, "mode": mode_for(w.values) or "w8", "scales": w.scales, "block": w.block}
        if w.bias is not None:
            attrs["bias"] = w.bias
        qmm = Node("QMatMul", node.name, [q, r], list(node.outputs), attrs, DLEGION)
        graph.nodes[graph.nodes.index(node)] = qmm


def _absmax_node(graph: Graph, x: str, at: int) -> tuple[str, str]:
    """Insert ``q, r = AbsmaxQuantize(x)`` before node ``at`` (the first reader of x)."""
    shape = graph.values[x].shape
    q, r = graph.fresh(f"{x}_q"), graph.fresh(f"{x}_r")
    graph.values[q] = Value(q, shape, np.dtype(np.int8))
    graph.values[r] = Value(r, (*shape[:-1], 1), np.dtype(np.float32))
    graph.nodes.insert(at, Node("AbsmaxQuantize", f"{x}_absmax", [x], [q, r],
                                {"approximation": APPROXIMATION}, DLEGION))
    return q, r
