"""The yardstick of a ``dlegion-cc --quantize`` program: its model as the compiler quantized it.

A program compiled with ``--quantize MODE`` records ``quantized_MODE`` (and, per node
``--quantize-skip`` kept in float, ``quantize_kept "name"``). ``--check`` then
evaluates in float64 (``reference64.float64_outputs``) a copy of the model in which every
MatMul or Gemm the compiler quantizes (a float32 initializer B of rank 2, a run-time float A)
multiplies what the program multiplies::

    a' = q * r,   r = max(max|a|, floor) / 127 per row,  q = round(a / r)   # per token
    B' = codes * scales                                                     # the compiler's codes

The codes and scales come from ``dlegion_cc.passes.quantize`` itself (one definition of the
quantization); ``a'`` is made of ONNX operators, evaluated in float64 like the rest of the graph.
So a correct program is as close to this yardstick as fp32 is to float64 (a few activations
round the other way), and a wrong weight stands out however coarse the mode.
"""
from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PREFIX, KEPT = "quantized_", "quantize_kept"
# The most each mode's quantization may move a float output from the graph's float64 values (the
# distance between the two yardsticks), measured on the committed models and the bitnet generator at
# 2B4T widths (README, "Float models onto the arrays"), with room: random Gaussian weights, which a
# model trained for the mode does not have, are its worst case.
BOUNDS = {"w8": 5e-2, "w4": 3e-1, "w2": 1.0}


@dataclass(frozen=True)
class Quantization:
    mode: str
    kept: frozenset[str]

    @property
    def phrase(self) -> str:
        kept = f", except {', '.join(sorted(self.kept))}" if self.kept else ""
        return f"MatMul/Gemm float weights quantized to {self.mode}, their activations to int8 per token{kept}"

    @property
    def bound(self) -> float:
        return BOUNDS[self.mode]


def quantization(approximations: dict[str, list[str]]) -> Quantization | None:
    """The quantization a program's approximations (Program.approximations) record, or None."""
    modes = [n[len(PREFIX):] for n in approximations if n.startswith(PREFIX) and n[len(PREFIX):] in BOUNDS]
    if not modes:
        return None
    return Quantization(modes[0], frozenset(approximations.get(KEPT, ())))


def describe(name: str) -> str | None:
    """One phrase for a name this module records, or None."""
    if name == KEPT:
        return f"{KEPT}: matmuls --quantize-skip kept in float (named in the program)"
    return None


@contextlib.contextmanager
def quantized_file(model: str | Path, q: Quantization):
    """A temporary file of ``model`` as the compiler quantized it (see the module docstring)."""
    import onnx
    m = onnx.load(str(model))
    quantize_model(m, q)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "quantized.onnx"
        onnx.save(m, str(path), save_as_external_data=m.ByteSize() > (1 << 30), location="quantized.onnx.data")
        yield path


def quantize_model(m, q: Quantization) -> None:
    """Rewrite ``m`` in place: each quantized MatMul/Gemm reads a' and B'."""
    from onnx import numpy_helper
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    nodes, quantized = [], {}
    for node in g.node:
        w = _weight(node, inits, q)
        b = None
        if w is not None and not _bitlinear(node, numpy_helper.to_array(w), producers):
            b = _codes_times_scales(node, numpy_helper.to_array(w), q.mode, m)
        if b is not None:
            x = node.input[0]
            if x not in quantized:
                quantized[x] = f"{x}/quantized_rows"
                nodes.extend(_absmax_rows(x, quantized[x], m))
            node.input[0] = quantized[x]
            node.input[1], mul = b
            nodes.append(mul)
            _drop_attr(node, "transB")
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)


def _weight(node, inits: dict, q: Quantization):
    """The float32 rank-2 initializer B of a MatMul or Gemm the compiler quantizes, or None."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm") or node.name in q.kept:
        return None
    if len(node.input) < 2 or node.input[0] in inits or node.input[1] not in inits:
        return None
    if node.op_type == "Gemm" and any(a.name == "transA" and a.i for a in node.attribute):
        return None
    w = inits[node.input[1]]
    return w if w.data_type == 1 and len(w.dims) == 2 else None


def _bitlinear(node, w: np.ndarray, producers: dict) -> bool:
    """A BitNet matmul, which the compiler runs in w2 before --quantize sees it
    (passes/bitlinear.py): A = Div(Clip(Round(...)), s) and a ternary B."""
    div = producers.get(node.input[0])
    clip = producers.get(div.input[0]) if div is not None and div.op_type == "Div" else None
    rnd = producers.get(clip.input[0]) if clip is not None and clip.op_type == "Clip" else None
    return rnd is not None and rnd.op_type == "Round" and bool(np.isin(w, (-1.0, 0.0, 1.0)).all())


def _codes_times_scales(node, w: np.ndarray, mode: str, m) -> tuple:
    """Initializers of the compiler's codes and scales of ``w``, and a Mul of them: (its output, it);
    None where the compiler keeps ``w`` in float."""
    from onnx import helper, numpy_helper
    from dlegion_cc.passes.quantize import BLOCK, quantized_weight
    if node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute):
        w = w.T
    quantized = quantized_weight(np.ascontiguousarray(w, np.float32), mode)
    if quantized is None:
        return None                 # non-finite: the compiler keeps it in float
    codes, scales, block = quantized
    per_row = np.repeat(scales, block or BLOCK, axis=0)[:w.shape[0]] if block else scales
    p = f"{node.name}/quantized_{mode}"
    m.graph.initializer.extend([numpy_helper.from_array(np.asarray(codes, np.float32), f"{p}/codes"),
                                numpy_helper.from_array(per_row.astype(np.float32), f"{p}/scales")])
    return f"{p}/B", helper.make_node("Mul", [f"{p}/codes", f"{p}/scales"], [f"{p}/B"])


def _drop_attr(node, name: str) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)


def _absmax_rows(x: str, out: str, m) -> list:
    """Nodes making ``out = q * r`` of ``x`` per row (see the module docstring)."""
    from onnx import helper, numpy_helper
    from dlegion_cc.lower.quant import ABSMAX_FLOOR
    opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), 1)
    consts = {"floor": np.array(ABSMAX_FLOOR, np.float32), "127": np.array(127.0, np.float32),
              "axes": np.array([-1], np.int64)}
    m.graph.initializer.extend(numpy_helper.from_array(v, f"{out}/{k}") for k, v in consts.items())
    reduce = (helper.make_node("ReduceMax", [f"{out}/abs"], [f"{out}/max"], keepdims=1, axes=[-1]) if opset < 18
              else helper.make_node("ReduceMax", [f"{out}/abs", f"{out}/axes"], [f"{out}/max"], keepdims=1))
    return [helper.make_node("Abs", [x], [f"{out}/abs"]), reduce,
            helper.make_node("Max", [f"{out}/max", f"{out}/floor"], [f"{out}/floored"]),
            helper.make_node("Div", [f"{out}/floored", f"{out}/127"], [f"{out}/r"]),
            helper.make_node("Div", [x, f"{out}/r"], [f"{out}/scaled"]),
            helper.make_node("Round", [f"{out}/scaled"], [f"{out}/q"]),
            helper.make_node("Mul", [f"{out}/q", f"{out}/r"], [out])]
