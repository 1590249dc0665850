"""Float weights onto the arrays: ``--quantize w8|w4|w2`` quantizes float MatMul and Gemm weights.

Source construct (a float Llama, a BitNet exported with ``nn.Linear``, any float lm_head)::

    y = MatMul(x, W)                      # W: a float32 constant [K, N], x: float32 at run time
    y = Gemm(x, W, C, alpha, beta)        # transA=0; W [K, N] or, with transB, [N, K]; C constant

becomes what the MatMulNBits pass makes of a blockwise 4-bit weight::

    xq, r = dlegion.AbsmaxQuantize(x)     # int8 per token: xq = round(x / r), r = max|x| / 127
    y = dlegion.QMatMul(xq, r)            # weight = the integer codes, scales applied when draining

so the existing lowering runs it on the arrays with int32 accumulation. The codes by mode:

- w8: per output channel, symmetric: s_n = max|W[:, n]| / 127, q = round(W / s) in [-127, 127];
- w4: per block of BLOCK rows of K and output channel, symmetric: s = max|block| / 7, q in [-7, 7]
  (32, the block of onnxruntime's MatMulNBits quantizer and of GPTQ/AWQ's small groups; the
  arrays drain once per block, so a larger block would be cheaper and coarser);
- w2: BitNet b1.58's absmean ternary: s = mean|W| over the whole matrix, q = clip(round(W / s), -1, 1).

It is an approximation of the model, recorded in the program (``quantized_w8`` and so on, one name
per mode, for the weights and the activations together) for ``dlegion-run --check``. A matmul named
in ``--quantize-skip`` keeps its float weights. One AbsmaxQuantize serves every matmul reading the
same x (Q, K and V; gate and up), which then fuse as BitNet's do.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlegion_cc.ir import DLEGION, Derived, Graph, Lazy, Mapped, Node
from dlegion_cc.passes.attention import absmax

MODES = ("w8", "w4", "w2")
BLOCK = 32                  # w4: rows of K per scale
TOP = {"w8": 127, "w4": 7}  # the largest code of the symmetric modes
PIECE = 1 << 26             # bytes of a weight read at a time: a 1.3 GB lm_head is never resident whole
FLOOR = np.float32(1e-30)   # the scale of an all-zero channel or block: its codes are 0


def approximation(mode: str) -> str:
    """The name the program records for weights quantized to ``mode``."""
    return f"quantized_{mode}"


# What the program records for a matmul ``--quantize-skip`` kept in float, with the node's name
# as its value, so ``--check`` knows not to quantize it.
KEPT = "quantize_kept"


def _row_chunks(w):
    """(first row, rows) of ``w`` [K, N], PIECE bytes at a time, as fp32 arrays."""
    rows, (K, N) = _rows(w.shape[1]), w.shape
    arr = None if isinstance(w, Mapped) else np.asarray(w)
    for start in range(0, K, rows):
        n = min(rows, K - start)
        if arr is None:         # a mapped weight: each piece mapped alone, unmapped when dropped
            item = np.dtype(w.dtype).itemsize
            yield start, np.asarray(Mapped(w.file, w.offset + start * N * item, (n, N), w.dtype).load(), np.float32)
        else:
            yield start, np.asarray(arr[start:start + n], np.float32)


def _rows(n: int) -> int:
    """Rows of ``n`` fp32 columns in a piece: whole blocks of BLOCK rows (w4's scales)."""
    return max(1, PIECE // (4 * max(1, n)) // BLOCK) * BLOCK


def weight_scales(w, mode: str) -> np.ndarray:
    """The fp32 scales [groups, N] of float weight ``w`` [K, N] quantized to ``mode``."""
    K, N = w.shape
    if mode == "w8":
        top = np.zeros(N, np.float32)
        for _, rows in _row_chunks(w):
            top = np.maximum(top, np.abs(rows).max(axis=0))
        return np.maximum(top / np.float32(TOP[mode]), FLOOR).astype(np.float32)[None, :]
    if mode == "w4":
        blocks = [np.abs(rows[i:i + BLOCK]).max(axis=0) for _, rows in _row_chunks(w)
                  for i in range(0, len(rows), BLOCK)]
        return np.maximum(np.stack(blocks) / np.float32(TOP[mode]), FLOOR).astype(np.float32)
    total = sum(float(np.abs(rows).sum(dtype=np.float64)) for _, rows in _row_chunks(w))
    mean = np.float32(total / max(1, K * N))
    return np.full((1, N), max(mean, FLOOR), np.float32)


def weight_codes(w, scales: np.ndarray, mode: str) -> np.ndarray:
    """int8 codes [K, N]: round(w / scale) half to even, clipped to the mode's range."""
    top = TOP.get(mode, 1)
    block = BLOCK if mode == "w4" else w.shape[0]
    out = np.empty(w.shape, np.int8)
    for start, rows in _row_chunks(w):
        groups = (start + np.arange(len(rows))) // block
        out[start:start + len(rows)] = np.clip(np.rint(rows / scales[groups]), -top, top).astype(np.int8)
    return out


def quantized_weight(w, mode: str) -> tuple:
    """(codes, scales [groups, N], block) of float weight ``w``; the codes lazy for a lazy ``w``
    (made when the lowering packs them), the scales now. None when ``w`` holds a NaN or an
    infinity, which ONNX spreads and codes would lose."""
    scales = weight_scales(w, mode)
    if not np.isfinite(scales).all():
        return None
    block = BLOCK if mode == "w4" and w.shape[0] > BLOCK else 0
    if mode == "w4" and not block:
        scales = scales[:1]
    codes = (Derived(tuple(w.shape), np.dtype(np.int8), lambda: weight_codes(w, scales, mode))
             if isinstance(w, Lazy) else weight_codes(w, scales, mode))
    return codes, scales, block


@dataclass(frozen=True)
class QuantizeWeights:
    name: str = "quantize"

    def run(self, graph: Graph, options) -> None:
        mode = getattr(options, "quantize", None)
        if mode is None:
            return
        skip = set(getattr(options, "quantize_skip", ()))
        quantized: dict[str, tuple[str, str]] = {}
        for node in list(graph.nodes):
            if node.name in skip:
                node.attrs["approximation"], node.attrs["approximated"] = KEPT, node.name
            elif quantizable(graph, node):
                _rewrite(graph, node, mode, quantized)


def float_weight(graph: Graph, node: Node):
    """The float32 constant [K, N] a MatMul or Gemm multiplies its run-time input by, or None."""
    if node.domain or node.op not in ("MatMul", "Gemm") or len(node.inputs) < 2:
        return None
    x, w = graph.values[node.inputs[0]], graph.values[node.inputs[1]]
    if x.stored is not None or w.stored is None or len(w.shape) != 2 or np.dtype(w.dtype) != np.float32:
        return None
    if np.dtype(x.dtype) != np.float32 or not x.shape or x.shape[-1] == 0 or 0 in w.shape:
        return None
    return w.stored


def quantizable(graph: Graph, node: Node) -> bool:
    """A MatMul or a Gemm of a run-time float input by a float constant (Gemm: of a matrix input,
    its bias, if any, a constant)."""
    if float_weight(graph, node) is None:
        return False
    if node.op == "MatMul":
        return True
    c = node.inputs[2] if len(node.inputs) > 2 else ""
    return (not node.attrs.get("transA", 0) and len(graph.values[node.inputs[0]].shape) == 2
            and (not c or graph.const(c) is not None))


def _gemm_weight(graph: Graph, node: Node):
    """Gemm's B as [K, N] (transposed lazily when transB), its alpha and its beta * C per column."""
    w = graph.stored(node.inputs[1])
    if node.attrs.get("transB", 0):
        src = w
        w = Derived((w.shape[1], w.shape[0]), np.dtype(np.float32), lambda: np.asarray(src).T.copy())
    n = w.shape[1]
    c = node.inputs[2] if len(node.inputs) > 2 else ""
    bias = None
    if c:
        bias = (np.float32(node.attrs.get("beta", 1.0)) * np.broadcast_to(graph.const(c).astype(np.float32),
                                                                          (1, n))).astype(np.float32).reshape(n)
    return w, np.float32(node.attrs.get("alpha", 1.0)), bias


def _rewrite(graph: Graph, node: Node, mode: str, shared: dict) -> None:
    if node.op == "Gemm":
        w, alpha, bias = _gemm_weight(graph, node)
    else:
        w, alpha, bias = graph.stored(node.inputs[1]), np.float32(1.0), None
    quantized = quantized_weight(w, mode)
    if quantized is None:
        return          # the matmul stays fp32
    codes, scales, block = quantized
    x = node.inputs[0]
    if x not in shared:
        shared[x] = absmax(graph, x, graph.nodes.index(node), approximation(mode))
    q, r = shared[x]
    attrs = {"weight": codes, "mode": mode, "scales": (scales * alpha).astype(np.float32), "block": block,
             "approximation": approximation(mode)}
    if bias is not None:
        attrs["bias"] = bias
    graph.nodes[graph.nodes.index(node)] = Node("QMatMul", node.name, [q, r], list(node.outputs), attrs, DLEGION)
