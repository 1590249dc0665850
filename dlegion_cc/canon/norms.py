"""onnxruntime's normalizations as the ops of ONNX's own function bodies.

The row-kernel fusion takes each as one kernel, as it does BitNet's RMSNorm. The formulas are
onnxruntime's (and ONNX's RMSNormalization and LayerNormalization functions): RMS norm
``x / sqrt(mean(x^2) + eps) * scale``; layer norm with ``var = mean(x^2) - mean(x)^2``,
``(x - mean) / sqrt(var + eps) * scale + bias``; the Skip variants first add
``input + skip (+ bias)``, which is their fourth output.
"""
from __future__ import annotations

import onnx

from dlegion_cc.canon import expands
from dlegion_cc.canon.builder import Builder, attr, io
from dlegion_cc.ort_schemas import MS

EPSILON = 1e-5      # onnxruntime's default for every one of them


def _axes(b: Builder, x: str, axis: int) -> list[int]:
    rank = b.rank(x)
    return list(range(axis % rank, rank))


def rms_norm(b: Builder, x: str, scale: str, eps: float, axes: list[int], y: str, inv: str = "") -> None:
    square = b.op("Mul", [x, x])
    mean = b.reduce_mean(square, axes)
    root = b.op("Sqrt", [b.op("Add", [mean, b.const(eps, "epsilon")])])
    b.op("Mul", [b.op("Div", [x, root]), scale], y)
    if inv:
        b.op("Reciprocal", [root], inv)


def layer_norm(b: Builder, x: str, scale: str, bias: str, eps: float, axes: list[int], outs: list[str]) -> None:
    """``outs``: y, and optionally mean and 1 / standard deviation."""
    y, mean_out, inv = io(outs, 3)
    mean = b.reduce_mean(x, axes, mean_out or None)
    var = b.op("Sub", [b.reduce_mean(b.op("Mul", [x, x]), axes), b.op("Mul", [mean, mean])])
    root = b.op("Sqrt", [b.op("Add", [var, b.const(eps, "epsilon")])])
    scaled = b.op("Mul", [b.op("Div", [b.op("Sub", [x, mean]), root]), scale], None if bias else y)
    if bias:
        b.op("Add", [scaled, bias], y)
    if inv:
        b.op("Reciprocal", [root], inv)


def _skip_sum(b: Builder, node: onnx.NodeProto, bias: str, out: str) -> str:
    x, skip = node.input[:2]
    total = b.op("Add", [x, skip], None if bias else out or None)
    return b.op("Add", [total, bias], out or None) if bias else total


@expands("SimplifiedLayerNormalization")
def simplified_layer_norm(node, b):
    x, scale = node.input[:2]
    y, inv = io(node.output, 2)
    rms_norm(b, x, scale, attr(node, "epsilon", EPSILON), _axes(b, x, attr(node, "axis", -1)), y, inv)


@expands("LayerNormalization")
def layer_normalization(node, b):
    """ONNX's (opset 17) and onnxruntime's own before it, the same computation. ONNX's function
    body would do, but flattens to 2-D and back: two more copies around the kernel."""
    if attr(node, "stash_type", 1) != onnx.TensorProto.FLOAT:
        raise ValueError("stash_type other than float is not supported")
    x, scale, bias = io(node.input, 3)
    layer_norm(b, x, scale, bias, attr(node, "epsilon", EPSILON), _axes(b, x, attr(node, "axis", -1)),
               list(node.output))


@expands("SkipSimplifiedLayerNormalization", domain=MS)
def skip_simplified_layer_norm(node, b):
    _, _, gamma, bias = io(node.input, 4)
    y, mean, inv, total = io(node.output, 4)
    if mean:
        raise ValueError("output 'mean' of a simplified (RMS) norm is not supported")
    rms_norm(b, _skip_sum(b, node, bias, total), gamma, attr(node, "epsilon", EPSILON), _axes(b, node.input[0], -1),
             y, inv)


@expands("SkipLayerNormalization", domain=MS)
def skip_layer_norm(node, b):
    _, _, gamma, beta, bias = io(node.input, 5)
    y, mean, inv, total = io(node.output, 4)
    layer_norm(b, _skip_sum(b, node, bias, total), gamma, beta, attr(node, "epsilon", EPSILON),
               _axes(b, node.input[0], -1), [y, mean, inv])
