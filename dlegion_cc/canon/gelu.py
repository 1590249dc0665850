"""GELU as onnxruntime's contrib operators spell it.

FastGelu is the tanh approximation, ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``,
written as onnxruntime computes it: ``x (0.5 + 0.5 tanh(x (B + C x^2)))``. Its Gelu is the
exact one, ``0.5 x (1 + erf(x / sqrt(2)))`` (ONNX's Gelu function writes the same).

The vector unit has no erf: Erf is written in ops it has, to a few fp32 roundings (as
onnxruntime's own is an approximation): below |x| = 0.5 its Taylor series to x^13 (the next
term is under 2e-8 of it), beyond ``1 - erfc(|x|)`` by Numerical Recipes' Chebyshev fit of
erfc, whose relative error is under 1.2e-7.
"""
from __future__ import annotations

import math

from dlegion_cc.canon import expands
from dlegion_cc.canon.builder import Builder, io
from dlegion_cc.ort_schemas import MS

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


TAYLOR = [1.0, -1 / 3, 1 / 10, -1 / 42, 1 / 216, -1 / 1320, 1 / 9360]     # times 2 / sqrt(pi), in x^2
ERFC = [-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
        1.48851587, -0.82215223, 0.17087277]                                   # in t, lowest first


def _horner(b: Builder, x: str, coefficients: list[float]) -> str:
    acc = b.const(coefficients[-1], "c")
    for c in reversed(coefficients[:-1]):
        acc = b.op("Add", [b.op("Mul", [acc, x]), b.const(c, "c")])
    return acc


@expands("Erf")
def erf(node, b):
    x = node.input[0]
    a = b.op("Abs", [x])
    one = b.const(1.0, "one")
    small = b.op("Mul", [b.op("Mul", [x, _horner(b, b.op("Mul", [x, x]), TAYLOR)]),
                         b.const(2 / math.sqrt(math.pi), "two_over_root_pi")])
    t = b.op("Div", [one, b.op("Add", [b.op("Mul", [a, b.const(0.5, "half")]), one])])
    exponent = b.op("Sub", [_horner(b, t, ERFC), b.op("Mul", [a, a])])
    erfc = b.op("Mul", [t, b.op("Exp", [exponent])])
    large = b.op("Mul", [b.op("Sign", [x]), b.op("Sub", [one, erfc])])
    b.op("Where", [b.op("Less", [a, b.const(0.5, "half")]), small, large], node.output[0])
