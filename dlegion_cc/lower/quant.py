"""The ONNX quantization operators.

QuantizeLinear, DequantizeLinear and DynamicQuantizeLinear run on the vector unit with
onnxruntime's fp32 formulas (``x / scale``, round half to even, then the zero point, then
saturation); MatMulInteger and QLinearMatMul run on the systolic arrays through
:func:`lower_qmatmul`. Integer results stay exact: they are stored as integer DRAM tensors.
"""
from __future__ import annotations

import math

import numpy as np

from isa.instructions import BY_MNEMONIC, VSelect
from dlegion_cc.ir import DLEGION
from dlegion_cc.lower.context import Lowering, lowers
from dlegion_cc.lower.layout import Operand, whole
from dlegion_cc.lower.qmatmul import Activations, Output, Weights, lower_qmatmul, lower_run_time_weights
from dlegion_cc.lower.rowwise import Arg, rowwise
from dlegion_cc.passes.dynamic_int8 import integer_weights
from dlegion_cc.passes.matmul_nbits import nbits_weights
from dlegion_cc.passes.qdq import dequantize_constant
from dlegion_cc.ort_schemas import MS

QRANGE = {"int8": (-128, 127), "uint8": (0, 255), "int4": (-8, 7), "uint4": (0, 15),
          "int16": (-32768, 32767), "uint16": (0, 65535)}
INT_DRAM = {"int8": "i8", "uint8": "u8", "int32": "i32"}
OFFSET = {"uint8": 128, "int8": 0}       # int8 storage of each activation type: value - offset


def V(mnemonic: str):
    return BY_MNEMONIC[mnemonic]


def int_result(low: Lowering, name: str) -> Operand:
    """A DRAM tensor for a result, integer-valued ones stored exactly in their own integer type.

    A scalar that is not a graph output gets a one-element tensor (DRAM tensors have a rank).
    """
    dtype = INT_DRAM.get(low.dtype(name).name, "f32")
    shape = low.shape(name)
    if name in low.graph.outputs or (dtype == "f32" and shape):
        return low.result(name)
    idx = low.em.tensor(name, dtype, shape or (1,), "scratch")
    low.operands[name] = Operand(idx, 0, whole(idx, shape).strides)
    return low.operands[name]


def qrange(low: Lowering, name: str) -> tuple[int, int]:
    kind = low.dtype(name).name
    if kind not in QRANGE:
        raise ValueError(f"quantized type {kind} of '{name}' is not supported")
    return QRANGE[kind]


# --- broadcasting of scales and zero points ------------------------------------------------

class Params:
    """Scale and zero point of Q/DQ in the frame of x: per tensor, per axis, or per block.

    A blocked axis of length n is split into (n / block, block) so that a scale repeats over
    each block through a 0 stride.
    """

    def __init__(self, low: Lowering, node, x: str):
        self.low, self.shape = low, low.shape(x)
        rank = len(self.shape)
        self.axis = node.attrs.get("axis", 1) % rank if rank else 0
        self.block = node.attrs.get("block_size", 0)
        if self.block and self.shape[self.axis] % self.block:
            raise ValueError(f"axis {self.axis} of length {self.shape[self.axis]} is not a whole number "
                             f"of blocks of {self.block}")
        self.frame = self._split(self.shape, [1] * rank)[0] if rank else (1,)

    def _split(self, dims, strides):
        """(dims, strides) with the blocked axis split in two."""
        if not self.block:
            return tuple(dims), tuple(strides)
        a, b = self.axis, self.block
        return ((*dims[:a], dims[a] // b, b, *dims[a + 1:]),
                (*strides[:a], strides[a] * b, strides[a], *strides[a + 1:]))

    def of_x(self, op: Operand) -> Operand:
        if not self.shape:
            return Operand(op.tensor, op.offset, (0,))
        return Operand(op.tensor, op.offset, self._split(self.shape, op.strides)[1])

    def immediate(self, name: str) -> float | None:
        c = self.low.const(name) if name else None
        return None if c is None or c.size != 1 else float(np.float32(c.reshape(())))

    def of_param(self, name: str) -> Operand:
        op, pshape = self.low.operand(name), self.low.shape(name)
        rank, n = len(self.shape), math.prod(pshape)
        if n == 1:
            return Operand(op.tensor, op.offset, (0,) * len(self.frame))
        if self.block and len(pshape) == rank:
            strides = tuple(s if pshape[d] > 1 else 0 for d, s in enumerate(op.strides))
            a = self.axis
            return Operand(op.tensor, op.offset, strides[:a + 1] + (0,) + strides[a + 1:])
        if not self.block and len(pshape) == 1 and pshape[0] == self.shape[self.axis]:
            strides = tuple(op.strides[0] if d == self.axis else 0 for d in range(rank))
            return Operand(op.tensor, op.offset, strides)
        raise ValueError(f"'{name}' of shape {list(pshape)} is neither per tensor, per axis {self.axis}"
                         f"{f', nor per block of {self.block}' if self.block else ''}")

    def arg(self, key: str, name: str) -> tuple[list[Arg], float | str | None]:
        """Kernel args and the operand key (or immediate) of an optional parameter."""
        if not name:
            return [], None
        imm = self.immediate(name)
        if imm is not None:
            return [], imm
        return [Arg(key, self.of_param(name))], key


def _pick(v: dict, ref):
    return v[ref] if isinstance(ref, str) else ref


# --- QuantizeLinear / DequantizeLinear -----------------------------------------------------

@lowers("QuantizeLinear")
@lowers("QuantizeLinear", domain=MS)
def quantize_linear(low: Lowering, node) -> None:
    x, s, z = (node.inputs + [""])[:3]
    out = node.outputs[0]
    lo, hi = qrange(low, out)
    p = Params(low, node, x)
    s_args, s_ref = p.arg("s", s)
    z_args, z_ref = p.arg("z", z)

    def body(em, l, v, r, c):
        em.emit(V("vdiv")(l, v["out"], v["x"], _pick(v, s_ref), r, c))
        em.emit(V("vround")(l, v["out"], v["out"], r, c))
        if z_ref is not None:
            em.emit(V("vadd")(l, v["out"], v["out"], _pick(v, z_ref), r, c))
        em.emit(V("vmax")(l, v["out"], v["out"], float(lo), r, c))
        em.emit(V("vmin")(l, v["out"], v["out"], float(hi), r, c))
    dst = int_result(low, out)
    args = [Arg("x", p.of_x(low.operand(x))), *s_args, *z_args, Arg("out", p.of_x(dst), out=True)]
    rowwise(low.em, p.frame, args, body, where=f"node '{node.name}': ")


@lowers("DequantizeLinear")
@lowers("DequantizeLinear", domain=MS)
def dequantize_linear(low: Lowering, node) -> None:
    x, s, z = (node.inputs + [""])[:3]
    out = node.outputs[0]
    if low.dtype(out) != np.float32:
        raise ValueError(f"dequantizing to {low.dtype(out).name} is not supported (only float32)")
    if _fold_constant(low, node):
        return
    p = Params(low, node, x)
    s_args, s_ref = p.arg("s", s)
    z_args, z_ref = p.arg("z", z)

    def body(em, l, v, r, c):
        src = v["x"]
        if z_ref is not None:
            em.emit(V("vsub")(l, v["out"], src, _pick(v, z_ref), r, c))
            src = v["out"]
        em.emit(V("vmul")(l, v["out"], src, _pick(v, s_ref), r, c))
    args = [Arg("x", p.of_x(low.operand(x))), *s_args, *z_args, Arg("out", p.of_x(low.result(out)), out=True)]
    rowwise(low.em, p.frame, args, body, where=f"node '{node.name}': ")


def _fold_constant(low: Lowering, node) -> bool:
    """A dequantized constant (a weight the importer could not fold) becomes fp32 data."""
    out = node.outputs[0]
    if out in low.graph.outputs or any(low.const(i) is None for i in node.inputs if i):
        return False
    value = dequantize_constant(low.graph, node)
    low.operands[out] = whole(low.em.const(out, value, "f32"), value.shape)
    return True


# --- DynamicQuantizeLinear -----------------------------------------------------------------

@lowers("DynamicQuantizeLinear")
def dynamic_quantize_linear(low: Lowering, node) -> None:
    """uint8 with a run-time scale and zero point over the whole tensor (onnxruntime's formulas):
    per-row min/max partials go to DRAM from every Legion, one Legion reduces them."""
    x = node.inputs[0]
    y, scale, zp = node.outputs
    shape = low.shape(x) or (1,)
    M = math.prod(shape[:-1])
    em, src = low.em, low.operand(x)
    if src != whole(src.tensor, low.shape(x)):
        raise ValueError(f"input '{x}' is not a contiguous tensor")
    lows, highs = (em.tensor(f"{x}_{k}", "f32", (M,), "scratch") for k in ("rmin", "rmax"))
    _row_min_max(low, x, shape, lows, highs, node.name)
    em.barrier()
    s_op, z_op = _scale_and_zero_point(low, lows, highs, M, scale, zp, node.name)
    em.barrier()
    frame = (M, shape[-1])

    def body(e, l, v, r, c):
        e.emit(V("vdiv")(l, v["out"], v["x"], v["s"], r, c))
        e.emit(V("vround")(l, v["out"], v["out"], r, c))
        e.emit(V("vadd")(l, v["out"], v["out"], v["z"], r, c))
        e.emit(V("vmax")(l, v["out"], v["out"], 0.0, r, c))
        e.emit(V("vmin")(l, v["out"], v["out"], 255.0, r, c))
    dst = int_result(low, y)
    args = [Arg("x", Operand(src.tensor, src.offset, (shape[-1], 1))),
            Arg("s", Operand(s_op.tensor, s_op.offset, (0, 0))),
            Arg("z", Operand(z_op.tensor, z_op.offset, (0, 0))),
            Arg("out", Operand(dst.tensor, dst.offset, (shape[-1], 1)), out=True)]
    rowwise(em, frame, args, body, where=f"node '{node.name}': ")


def _row_min_max(low: Lowering, x: str, shape, lows: int, highs: int, name: str) -> None:
    src = low.operand(x)
    K = shape[-1]

    def body(e, l, v, r, c):
        e.emit(V("vrmin")(l, v["lo"], v["x"], r, c))
        e.emit(V("vrmax")(l, v["hi"], v["x"], r, c))
    args = [Arg("x", Operand(src.tensor, src.offset, (K, 1))),
            Arg("lo", Operand(lows, 0, (1, 0)), out=True), Arg("hi", Operand(highs, 0, (1, 0)), out=True)]
    rowwise(low.em, (math.prod(shape[:-1]), K), args, body, keep_last=True, where=f"node '{name}': ")


def _scale_and_zero_point(low: Lowering, lows: int, highs: int, M: int, scale: str, zp: str, name: str):
    """scale = (max(hi, 0) - min(lo, 0)) / 255 (1 when that is 0); zp = round(clip(0 - lo / scale))."""
    def body(e, l, v, r, c):
        lo, hi, s, z = v["lo_all"], v["hi_all"], v["s"], v["z"]
        e.emit(V("vrmin")(l, lo, v["lo"], r, c))
        e.emit(V("vmin")(l, lo, lo, 0.0, r, 1))
        e.emit(V("vrmax")(l, hi, v["hi"], r, c))
        e.emit(V("vmax")(l, hi, hi, 0.0, r, 1))
        e.emit(V("vsub")(l, s, hi, lo, r, 1))
        e.emit(V("vdiv")(l, s, s, 255.0, r, 1))
        e.emit(V("veq")(l, z, hi, lo, r, 1))
        e.emit(VSelect(l, s, z, 1.0, r, 1))
        e.emit(V("vdiv")(l, z, lo, s, r, 1))
        e.emit(V("vneg")(l, z, z, r, 1))
        e.emit(V("vmax")(l, z, z, 0.0, r, 1))
        e.emit(V("vmin")(l, z, z, 255.0, r, 1))
        e.emit(V("vround")(l, z, z, r, 1))
    s_op = int_result(low, scale) if scale else whole(low.em.tensor(f"{name}_scale", "f32", (1,), "scratch"), ())
    z_op = int_result(low, zp) if zp else whole(low.em.tensor(f"{name}_zp", "f32", (1,), "scratch"), ())
    args = [Arg("lo", Operand(lows, 0, (0, 1))), Arg("hi", Operand(highs, 0, (0, 1))),
            Arg("lo_all", col=True), Arg("hi_all", col=True),
            Arg("s", Operand(s_op.tensor, s_op.offset, (0, 0)), out=True),
            Arg("z", Operand(z_op.tensor, z_op.offset, (0, 0)), out=True)]
    rowwise(low.em, (1, M), args, body, keep_last=True, where=f"node '{name}': ")
    return s_op, z_op


# --- integer matmuls -----------------------------------------------------------------------

def activation_offset(low: Lowering, a: str) -> int:
    kind = low.dtype(a).name
    if kind not in OFFSET:
        raise ValueError(f"activations '{a}' of type {kind} are not supported (int8 or uint8)")
    return OFFSET[kind]


@lowers("MatMulInteger")
def matmul_integer(low: Lowering, node) -> None:
    a, b, a_zp, b_zp = (node.inputs + ["", ""])[:4]
    if low.const(b) is None:
        return _run_time_b(low, a, b, a_zp, b_zp, node.outputs[0])
    values = integer_weights(low.graph, b, b_zp)
    acts = Activations(a, activation_offset(low, a), a_zp or 0)
    lower_qmatmul(low, node.name, acts, Weights(values), Output(node.outputs[0]))


def _run_time_b(low: Lowering, a: str, b: str, a_zp: str, b_zp: str, out: str) -> None:
    """Both operands computed at run time: int8 and symmetric (no zero point but 0), as the
    arrays multiply them with nothing to correct."""
    for what, name, zp in (("A", a, a_zp), ("B", b, b_zp)):
        if low.dtype(name) != np.int8:
            raise ValueError(f"{what} '{name}' is {low.dtype(name).name}; with B computed at run time "
                             f"both operands must be int8")
        z = low.const(zp) if zp else np.zeros(1)
        if z is None or np.any(z != 0):
            raise ValueError(f"{what}'s zero point '{zp}' is not 0; with B computed at run time only "
                             f"symmetric int8 operands are supported")
    lower_run_time_weights(low, a, b, out)


@lowers("QLinearMatMul")
def qlinear_matmul(low: Lowering, node) -> None:
    """(a - a_zp) . (b - b_zp) * (a_scale * b_scale / y_scale), rounded, plus y_zp, saturated:
    onnxruntime's requantization, with its fp32 multiplier computed here."""
    a, sa, a_zp, b, sb, b_zp, sy, y_zp = node.inputs
    values = integer_weights(low.graph, b, b_zp)
    consts = [low.const(n) for n in (sa, sb, sy, y_zp)]
    if any(c is None for c in consts):
        raise ValueError("scales and the output zero point computed at run time are not supported")
    a_scale, b_scale, y_scale, y_zero = consts
    if a_scale.size != 1 or y_scale.size != 1 or y_zero.size != 1:
        raise ValueError("per-row activation or output scales are not supported")
    n = values.shape[-1]
    multiplier = (np.float32(a_scale.reshape(())) * b_scale.astype(np.float32).reshape(-1)
                  / np.float32(y_scale.reshape(()))).astype(np.float32)
    scales = np.broadcast_to(multiplier, (n,))[None, :]
    lo, hi = qrange(low, node.outputs[0])
    acts = Activations(a, activation_offset(low, a), a_zp or 0)
    out = Output(node.outputs[0], (float(y_zero.reshape(())), lo, hi))
    lower_qmatmul(low, node.name, acts, Weights(values, scales), out)


# --- per-row absmax quantization (weight-only quantized matmuls) -----------------------------

@lowers("AbsmaxQuantize", domain=DLEGION)
def absmax_quantize(low: Lowering, node) -> None:
    """q = round(x / r) with r = max|x| / 127 per row (int8), and r."""
    x = node.inputs[0]
    q, r = node.outputs
    shape = low.shape(x)
    K = shape[-1]

    def body(e, l, v, rows, cols):
        absmax_rows(e, l, v["q"], v["r"], v["x"], rows, cols)
    src, q_op, r_op = low.operand(x), int_result(low, q), low.result(r)
    M = math.prod(shape[:-1])
    args = [Arg("x", Operand(src.tensor, src.offset, (K, 1))), Arg("q", Operand(q_op.tensor, 0, (K, 1)), out=True),
            Arg("r", Operand(r_op.tensor, 0, (1, 0)), out=True)]
    rowwise(low.em, (M, K), args, body, keep_last=True, where=f"node '{node.name}': ")


ABSMAX_FLOOR = float(np.float32(1e-30))   # keeps 127 / floor finite; an all-zero row stays 0


def absmax_rows(e, legion: int, q, r, x, rows: int, cols: int) -> None:
    """AbsmaxQuantize's instructions on a block of rows: q = round(x / r), r = its scale."""
    e.emit(V("vabs")(legion, q, x, rows, cols))
    e.emit(V("vrmax")(legion, r, q, rows, cols))
    absmax_scale(e, legion, r, rows)
    e.emit(V("vdiv")(legion, q, x, r, rows, cols))
    e.emit(V("vround")(legion, q, q, rows, cols))


def absmax_scale(e, legion: int, r, n: int) -> None:
    """``n`` absolute maxima at ``r`` made their int8 scales: max(r, floor) / 127."""
    e.emit(V("vmax")(legion, r, r, ABSMAX_FLOOR, n, 1))
    e.emit(V("vdiv")(legion, r, r, 127.0, n, 1))


@lowers("MatMulNBits", domain=MS)
def matmul_nbits(low: Lowering, node) -> None:
    """Reached only when the MatMulNBits pass could not rewrite the node: say why."""
    nbits_weights(low.graph, node)
    raise ValueError("internal: a MatMulNBits the pass accepts was not rewritten")
