"""GELU as onnxruntime's contrib operators spell it.

FastGelu is the tanh approximation, ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``,
written as onnxruntime computes it: ``x (0.5 + 0.5 tanh(x (B + C x^2)))``. Its Gelu is the
exact one, ``0.5 x (1 + erf(x / sqrt(2)))``.
"""
from __future__ import annotations

import math

from dlegion_cc.canon import expands
from dlegion_cc.canon.builder import Builder, io

MS = "com.microsoft"
B = math.sqrt(2 / math.pi)
C = 0.044715 * B


def _biased(b: Builder, x: str, bias: str) -> str:
    return b.op("Add", [x, bias]) if bias else x


@expands("FastGelu", domain=MS)
def fast_gelu(node, b):
    x, bias = io(node.input, 2)
    x = _biased(b, x, bias)
    inner = b.op("Mul", [x, b.op("Add", [b.op("Mul", [b.op("Mul", [x, x]), b.const(C, "C")]), b.const(B, "B")])])
    half = b.const(0.5, "half")
    b.op("Mul", [x, b.op("Add", [b.op("Mul", [b.op("Tanh", [inner]), half]), half])], node.output[0])


@expands("Gelu", "BiasGelu", domain=MS)
def gelu(node, b):
    x, bias = io(node.input, 2)
    x = _biased(b, x, bias)
    erf = b.op("Erf", [b.op("Mul", [x, b.const(1 / math.sqrt(2), "rsqrt2")])])
    b.op("Mul", [b.op("Mul", [x, b.const(0.5, "half")]), b.op("Add", [erf, b.const(1.0, "one")])], node.output[0])
