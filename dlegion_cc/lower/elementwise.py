"""Element-wise ONNX ops on the vector unit, with numpy broadcasting through 0 strides."""
from __future__ import annotations

import numpy as np

from isa.instructions import BY_MNEMONIC, VSelect
from dlegion_cc.lower.context import Lowering, lowers, row_view
from dlegion_cc.lower.layout import broadcast
from dlegion_cc.lower.rowwise import Arg, rowwise

UNARY = {"Abs": "vabs", "Neg": "vneg", "Exp": "vexp", "Log": "vlog", "Sqrt": "vsqrt",
         "Reciprocal": "vrecip", "Relu": "vrelu", "Sigmoid": "vsigmoid", "Tanh": "vtanh",
         "Floor": "vfloor", "Ceil": "vceil", "Round": "vround", "Sign": "vsign", "IsNaN": "visnan",
         "Not": "vnot", "Sin": "vsin", "Cos": "vcos", "Identity": "vmov"}
BINARY = {"Add": "vadd", "Sub": "vsub", "Mul": "vmul", "Div": "vdiv", "Pow": "vpow", "Max": "vmax",
          "Min": "vmin", "Equal": "veq", "Less": "vlt", "LessOrEqual": "vle", "Greater": "vgt",
          "GreaterOrEqual": "vge", "And": "vand", "Or": "vor"}
VARIADIC = ("Max", "Min", "Sum", "Mean")
# Casting to an integer type truncates toward zero; the store then writes exact integers.
CAST_TO_INT = {np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.int64)}


def _in(low: Lowering, name: str, out_shape) -> Arg:
    return Arg(name, broadcast(low.operand(name), low.shape(name), out_shape))


def _kernel(low: Lowering, node, inputs: list[str], body) -> None:
    out = node.outputs[0]
    shape = low.shape(out)
    args = [_in(low, i, shape) for i in dict.fromkeys(inputs)]
    args.append(Arg("out", low.result(out), out=True))
    rowwise(low.em, shape, args, body, where=f"node '{node.name}': ")


@lowers(*UNARY, views=row_view, writes=row_view)
def unary(low: Lowering, node) -> None:
    cls = BY_MNEMONIC[UNARY[node.op]]
    x = node.inputs[0]
    if node.op == "Identity" and low.alias(node.outputs[0], x):
        return
    _kernel(low, node, [x], lambda em, l, v, r, c: em.emit(cls(l, v["out"], v[x], r, c)))


@lowers("IsInf", views=row_view, writes=row_view)
def isinf(low: Lowering, node) -> None:
    pos, neg = node.attrs.get("detect_positive", 1), node.attrs.get("detect_negative", 1)
    x = node.inputs[0]
    if pos and neg:
        _kernel(low, node, [x], lambda em, l, v, r, c: em.emit(BY_MNEMONIC["visinf"](l, v["out"], v[x], r, c)))
        return
    target = float("inf") if pos else float("-inf")
    _kernel(low, node, [x], lambda em, l, v, r, c: em.emit(BY_MNEMONIC["veq"](l, v["out"], v[x], target, r, c)))


def _binary_body(cls, a: str, b: str, imm: float | None):
    def body(em, legion, v, rows, cols):
        em.emit(cls(legion, v["out"], v[a], imm if imm is not None else v[b], rows, cols))
    return body


def squares(op: str, b) -> bool:
    """Whether ``op`` with second operand ``b`` is Pow(x, 2): x * x, which a vector multiply
    computes in one cycle a lane where ``vpow`` is transcendental. The product is rounded once,
    as a correctly rounded power is: the two are equal bit for bit (so is onnxruntime's)."""
    return op == "Pow" and isinstance(b, float) and b == 2.0


@lowers(*BINARY, views=row_view, writes=row_view)
def binary(low: Lowering, node) -> None:
    a, b = node.inputs
    imm = low.scalar(b)
    body = _binary_body(BY_MNEMONIC[BINARY[node.op]], a, b, imm)
    if squares(node.op, imm):
        body = _binary_body(BY_MNEMONIC["vmul"], a, a, None)
    if node.op == "Div" and low.dtype(node.outputs[0]).kind in "iu":
        body = _then_trunc(body)
    _kernel(low, node, [a] if imm is not None else [a, b], body)


def _then_trunc(body):
    """Integer division truncates toward zero; fp32 a / b is exact enough for |a| < 2**24."""
    def wrapped(em, legion, v, rows, cols):
        body(em, legion, v, rows, cols)
        em.emit(BY_MNEMONIC["vtrunc"](legion, v["out"], v["out"], rows, cols))
    return wrapped


@lowers(*VARIADIC, views=row_view, writes=row_view)
def variadic(low: Lowering, node) -> None:
    """Max, Min, Sum, Mean of any number of inputs: one instruction per further input."""
    cls = BY_MNEMONIC[BINARY.get(node.op, "vadd")]
    first, rest = node.inputs[0], node.inputs[1:]
    imms = {n: low.scalar(n) for n in rest}

    def body(em, legion, v, rows, cols):
        acc = v[first]
        for n in rest:
            em.emit(cls(legion, v["out"], acc, imms[n] if imms[n] is not None else v[n], rows, cols))
            acc = v["out"]
        if acc is v[first]:
            em.emit(BY_MNEMONIC["vmov"](legion, v["out"], acc, rows, cols))
        if node.op == "Mean":
            em.emit(BY_MNEMONIC["vdiv"](legion, v["out"], v["out"], float(len(node.inputs)), rows, cols))
    _kernel(low, node, [first] + [n for n in rest if imms[n] is None], body)


@lowers("Mod", views=row_view, writes=row_view)
def mod(low: Lowering, node) -> None:
    if not node.attrs.get("fmod", 0):
        raise ValueError("Mod with fmod=0 (integer modulo) is not supported")
    binary_like(low, node, "vfmod")


def binary_like(low: Lowering, node, mnemonic: str) -> None:
    a, b = node.inputs
    imm = low.scalar(b)
    _kernel(low, node, [a] if imm is not None else [a, b], _binary_body(BY_MNEMONIC[mnemonic], a, b, imm))


@lowers("Clip", views=row_view, writes=row_view)
def clip(low: Lowering, node) -> None:
    x, lo, hi = (node.inputs + ["", ""])[:3]
    lo_imm, hi_imm = (low.scalar(lo) if lo else None), (low.scalar(hi) if hi else None)
    extra = [n for n, imm in ((lo, lo_imm), (hi, hi_imm)) if n and imm is None]

    def body(em, legion, v, rows, cols):
        src = v[x]
        if lo:
            em.emit(BY_MNEMONIC["vmax"](legion, v["out"], src, lo_imm if lo_imm is not None else v[lo], rows, cols))
            src = v["out"]
        if hi:
            em.emit(BY_MNEMONIC["vmin"](legion, v["out"], src, hi_imm if hi_imm is not None else v[hi], rows, cols))
            src = v["out"]
        if src is v[x]:
            em.emit(BY_MNEMONIC["vmov"](legion, v["out"], src, rows, cols))
    _kernel(low, node, [x, *extra], body)


@lowers("Where", views=row_view, writes=row_view)
def where(low: Lowering, node) -> None:
    cond, x, y = node.inputs
    x_imm, y_imm = low.scalar(x), low.scalar(y)
    names = [cond] + [n for n, imm in ((x, x_imm), (y, y_imm)) if imm is None]

    def body(em, legion, v, rows, cols):
        if y_imm is None:
            em.emit(BY_MNEMONIC["vmov"](legion, v["out"], v[y], rows, cols))
        else:   # out = 0 * cond + y fills every element with the immediate
            em.emit(BY_MNEMONIC["vmul"](legion, v["out"], v[cond], 0.0, rows, cols))
            em.emit(BY_MNEMONIC["vadd"](legion, v["out"], v["out"], y_imm, rows, cols))
        em.emit(VSelect(legion, v["out"], v[cond], x_imm if x_imm is not None else v[x], rows, cols))
    _kernel(low, node, names, body)


@lowers("Cast", "CastLike", views=row_view, writes=row_view)
def cast(low: Lowering, node) -> None:
    """Cast, and CastLike (its second input only gives the dtype, which the output has)."""
    x, out = node.inputs[0], node.outputs[0]
    to = low.dtype(out)
    if to == np.bool_:
        def body(em, l, v, r, c):
            em.emit(BY_MNEMONIC["vnot"](l, v["out"], v[x], r, c))
            em.emit(BY_MNEMONIC["vnot"](l, v["out"], v["out"], r, c))
    else:
        mnemonic = "vtrunc" if to in CAST_TO_INT and low.dtype(x) != np.bool_ else "vmov"
        if mnemonic == "vmov" and low.alias(out, x):
            return

        def body(em, l, v, r, c):
            em.emit(BY_MNEMONIC[mnemonic](l, v["out"], v[x], r, c))
    _kernel(low, node, [x], body)
