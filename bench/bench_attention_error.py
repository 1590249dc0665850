"""Where int8 attention's error on the 2B4T layer comes from, and how far it is from 1e-2.

    python bench/bench_attention_error.py [--seq 512]

The generated 2B4T layer runs in onnxruntime (fp32) with its attention's operands as extra
outputs: Q, K^T and V as the products read them, and the scores' chain up to the softmax. The
attention output is then made again in float64 from those operands, with the compiler's int8
scheme (passes/attention.py: Q per row, K smoothed over the tokens and per token, P as
``round(127 exp(s - max)) / (127 sum)``, V per channel), with one operand quantized at a time,
with some kept exact or in two int8 pieces (15 bits; and as ``--attention int8x2`` computes
them: three products of pieces, lo.lo left out), or with the published refinements (P
unsigned with a fixed scale 1/255, K's channels smoothed into Q, V's mean re-added through P's
row sums), and fed to the rest of the layer (the graph cut at PV's output): the layer output's
relative L2 distance from the same cut fed the exact attention is printed per variant
(``bench_layer.py --error`` emulates the compiled programs; the first line here is its model,
within a few percent). The last line scales the int8 scheme's attention error down, to show
how close any scheme's attention must come for the layer's target. The layer's int8 activations after the attention (the
o_proj's absmax quantization, the MLP's) turn every perturbed value that crosses a rounding
boundary into a whole step: the layer error grows about as the fifth root of the attention's, so
even near-exact attention leaves several 1e-3.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).parent.parent))

import numpy as np                                            # noqa: E402
import onnx                                                   # noqa: E402
import onnxruntime as ort                                     # noqa: E402
from onnx import numpy_helper                                 # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from bench_layer import _layer_model                          # noqa: E402
from models.bitnet import save                                # noqa: E402
from dlegion_cc.passes.attention import LOW_STEPS             # noqa: E402

WIDE = 127 * 258        # 15 bits: a second int8 piece of each value


@dataclass(frozen=True)
class Scheme:
    """How each operand is quantized: levels of Q, K (per token), P (``round(p e) / p`` with
    e = exp(s - max), so e's row maximum is exact) and V (per channel); 127 is int8, WIDE two
    int8 pieces, 0 exact. ``channels``: K's per-channel range moved into Q before the per-token
    scales (SmoothQuant, Xiao et al., arXiv 2211.10438; exact in real arithmetic). ``v_mean``: V's
    mean over the tokens subtracted before its scales and added back through P's row sums."""

    q: int = 127
    k: int = 127
    p: int = 127
    v: int = 127
    channels: bool = False
    v_mean: bool = False
    split: bool = False     # every operand in two int8 pieces as --attention int8x2 computes them


def _two_pieces(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """``x``'s two int8 pieces along ``axis`` as passes/attention.py makes them (``_low_piece``),
    each times its scale: ``r hi`` and ``(r / LOW_STEPS) lo``, with ``s = x / r``,
    ``hi = round(s)``, ``lo = round(LOW_STEPS (s - hi))``."""
    r = np.maximum(np.abs(x).max(axis=axis, keepdims=True), 1e-30) / 127
    s = x / r
    hi = np.round(s)
    return hi * r, np.round(LOW_STEPS * (s - hi)) * (r / LOW_STEPS)


def _pieces_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """hi.hi + lo.hi + hi.lo of a per row and b per column (lo.lo left out, as the compiler)."""
    (ah, al), (bh, bl) = _two_pieces(a, -1), _two_pieces(b, -2)
    return ah @ bh + al @ bh + ah @ bl


EXACT = Scheme(0, 0, 0, 0)
VARIANTS = (("int8 (the compiler's scheme)", Scheme()),
            ("only Q in int8", Scheme(127, 0, 0, 0)), ("only K in int8", Scheme(0, 127, 0, 0)),
            ("only P in int8", Scheme(0, 0, 127, 0)), ("only V in int8", Scheme(0, 0, 0, 127)),
            ("Q and K exact", Scheme(0, 0)), ("P exact", Scheme(p=0)), ("V exact", Scheme(v=0)),
            ("P and V exact", Scheme(p=0, v=0)),
            ("P unsigned, scale 1/255 (uint8)", Scheme(p=255)),
            ("P in two int8 pieces (PV twice)", Scheme(p=WIDE)),
            ("K's channels smoothed into Q", Scheme(channels=True)),
            ("V's mean over the tokens re-added", Scheme(v_mean=True)),
            ("the three above together", Scheme(p=255, channels=True, v_mean=True)),
            ("P and V in two pieces", Scheme(p=WIDE, v=WIDE)),
            ("P, V and Q in two pieces", Scheme(WIDE, 127, WIDE, WIDE)),
            ("every operand in two pieces (products 3x)", Scheme(WIDE, WIDE, WIDE, WIDE)),
            ("--attention int8x2 (two int8 pieces, lo.lo left out)", Scheme(split=True)))
SCALES = (0.5, 0.2, 0.1, 0.05, 0.02)    # the int8 scheme's attention error, scaled down


def _absmax(x: np.ndarray, axis: int, levels: int) -> np.ndarray:
    if not levels:
        return x
    r = np.maximum(np.abs(x).max(axis=axis, keepdims=True), 1e-30) / levels
    return np.round(x / r) * r


def _smoothed_channels(q: np.ndarray, kt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q and K^T with each channel c scaled by 1/a_c in K and a_c in Q (the scores unchanged),
    a_c = sqrt(max|K_c| / max|Q_c|): both operands' channels get the same range."""
    a = np.sqrt(np.abs(kt).max(-1, keepdims=True) / np.maximum(np.abs(q).max(-2, keepdims=True).swapaxes(-1, -2),
                                                               1e-30))
    a = np.where(a > 0, a, 1.0)
    return q * a.swapaxes(-1, -2), kt / a


class Attention:
    """The layer's attention operands (onnxruntime's fp32 values) and the rest of the layer."""

    def __init__(self, path: Path, tmp: Path, seq: int):
        model = onnx.load(str(path))
        nodes = {o: n for n in model.graph.node for o in n.output}
        consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
        pv = next(n for n in model.graph.node if n.op_type == "MatMul" and n.input[0] == softmax.output[0])
        chain, x = [], softmax.input[0]         # the scale and the mask between QK^T and the softmax
        while nodes[x].op_type != "MatMul":
            chain.insert(0, nodes[x])
            x = next(i for i in nodes[x].input if i not in consts)
        qk = nodes[x]
        self.chain = [(n.op_type, next(consts[i] for i in n.input if i in consts)) for n in chain]
        wanted = [*qk.input, pv.input[1], pv.output[0], _output_of(model)]
        values = self._run(model, wanted, tmp / "probe.onnx")
        self.q, self.kt, self.v, self.o, self.y = (v.astype(np.float64) for v in values)
        self.cut = self._cut(model, pv, tmp / "cut.onnx")

    def _run(self, model, names: list[str], path: Path) -> list[np.ndarray]:
        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
        save(probe, path, external_data=True)
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.ids = np.random.default_rng(0).integers(0, 512, self.session.get_inputs()[0].shape).astype(np.int64)
        return self.session.run(names, {self.session.get_inputs()[0].name: self.ids})

    def _cut(self, model, pv, path: Path):
        """The layer from PV's output on, that output a graph input."""
        cut = onnx.ModelProto()
        cut.CopyFrom(model)
        keep = [n for n in cut.graph.node if n.name != pv.name]
        del cut.graph.node[:]
        cut.graph.node.extend(keep)
        cut.graph.input.append(onnx.helper.make_tensor_value_info(pv.output[0], onnx.TensorProto.FLOAT, self.o.shape))
        cut.graph.output.append(onnx.helper.make_empty_tensor_value_info(_output_of(model)))
        save(cut, path, external_data=True)
        self.pv_output = pv.output[0]
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def layer(self, o: np.ndarray) -> np.ndarray:
        feed = {self.session.get_inputs()[0].name: self.ids, self.pv_output: o.astype(np.float32)}
        return self.cut.run(None, feed)[-1].astype(np.float64)

    def output(self, scheme: Scheme) -> np.ndarray:
        """The attention output with each operand quantized as ``scheme`` says."""
        q, kt = self.q, self.kt - self.kt.mean(axis=-1, keepdims=True) if scheme.k else self.kt  # smoothed
        if scheme.channels:
            q, kt = _smoothed_channels(q, kt)
        s = _pieces_product(q, kt) if scheme.split else _absmax(q, -1, scheme.q) @ _absmax(kt, -2, scheme.k)
        for op, c in self.chain:
            s = s * c if op == "Mul" else s + c
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        if scheme.split:        # P's pieces from 127 e, whose row maximum is exactly 127
            return _pieces_product(e / e.sum(axis=-1, keepdims=True), self.v)
        p = (np.round(scheme.p * e) / scheme.p if scheme.p else e) / e.sum(axis=-1, keepdims=True)
        mean = self.v.mean(axis=-2, keepdims=True) if scheme.v_mean else 0.0
        return p @ _absmax(self.v - mean, -2, scheme.v) + p.sum(axis=-1, keepdims=True) * mean


def _output_of(model) -> str:
    """The layer's output: what the final norm reads."""
    return next(n for n in model.graph.node if n.name.startswith("model.norm/")).input[0]


def _rel(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


@click.command()
@click.option("--seq", default=512, show_default=True)
def main(seq: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "layer.onnx"
        _layer_model(seq, path)
        att = Attention(path, Path(tmp), seq)
        o_exact = att.output(EXACT)
        exact = att.layer(o_exact)
        print(f"2B4T layer, sequence {seq}: layer output relative L2 from exact attention's (target <= 1e-2)")
        print(f"  onnxruntime's own fp32 attention: attention {_rel(att.o, o_exact):.2e}, "
              f"layer {_rel(att.y, exact):.2e}")
        for label, scheme in VARIANTS:
            o = att.output(scheme)
            print(f"  {label}: attention output {_rel(o, o_exact):.2e}, layer {_rel(att.layer(o), exact):.2e}")
        _print_scaled(att, o_exact, exact)


def _print_scaled(att: Attention, o_exact: np.ndarray, exact: np.ndarray) -> None:
    """The layer's error when the int8 scheme's attention error is scaled down: how close the
    attention must be for the target, whatever the scheme."""
    error = att.output(Scheme()) - o_exact
    points = [(_rel(o_exact + t * error, o_exact), _rel(att.layer(o_exact + t * error), exact)) for t in SCALES]
    print("  the int8 error scaled down (attention -> layer): "
          + ", ".join(f"{a:.1e} -> {y:.2e}" for a, y in points))


if __name__ == "__main__":
    main()
