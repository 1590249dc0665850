"""Fused row kernels against onnxruntime: the operand positions an immediate cannot take."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from isa import arch
from dlegion_cc.pipeline import Options, compile_model
from runtime.check import onnx_reference
from runtime.emulator import run

TINY = arch.load("dlegion-tiny")


def _save(path, nodes, shape, inits):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
                          [numpy_helper.from_array(a, n) for n, a in inits.items()])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def _run(path, x):
    graph, program = compile_model(path, Options(TINY))
    assert [n.op for n in graph.nodes] == ["RowKernel"]
    return run(program, TINY, {"x": x}).outputs["y"], onnx_reference(path, {"x": x})["y"]


@pytest.mark.parametrize("rows", [1, 4])
def test_rms_norm_with_one_over_the_root_matches_onnxruntime(tmp_path, rows):
    """The RMSNorm torch.onnx writes for Llama (Optimum's exports): ``1 / Sqrt(...)`` is a Div
    whose constant first operand the vector unit cannot take as an immediate. The kernel once
    filled the output with it by ``b * 0 + 1``, in the slot of the dying root: the root became 1
    and the norm did nothing (relative L2 0.98 from onnxruntime)."""
    nodes = [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
             helper.make_node("Pow", ["xf", "two"], ["x2"]),
             helper.make_node("ReduceMean", ["x2", "axes"], ["ms"], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["mse"]),
             helper.make_node("Sqrt", ["mse"], ["rms"]),
             helper.make_node("Div", ["one", "rms"], ["inv"]),
             helper.make_node("Mul", ["xf", "inv"], ["xn"]),
             helper.make_node("Cast", ["xn"], ["xc"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["g", "xc"], ["y"])]
    rng = np.random.default_rng(0)
    inits = {"two": np.array(2, np.float32), "axes": np.array([-1], np.int64), "eps": np.array(1e-6, np.float32),
             "one": np.array(1, np.float32), "g": rng.standard_normal(64).astype(np.float32)}
    path = _save(tmp_path / "rms.onnx", nodes, [1, rows, 64], inits)
    x = (rng.standard_normal((1, rows, 64)) * 0.02).astype(np.float32)
    got, want = _run(path, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["Div", "Pow"])
def test_a_constant_first_operand_meets_every_value(tmp_path, op):
    """c / x and c ** x in a kernel (after an Abs), x holding zeros and infinities: the constant
    is read as a broadcast operand, so no product with x (inf * 0 is NaN) takes its place."""
    nodes = [helper.make_node("Abs", ["x"], ["a"]), helper.make_node(op, ["c", "a"], ["y"])]
    path = _save(tmp_path / "c.onnx", nodes, [3, 16], {"c": np.array(1.5, np.float32)})
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    x[0, :4] = [np.inf, -np.inf, 0.0, -0.0]
    got, want = _run(path, x)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def _absmax_quant(eps: float, k: float, lo: float, hi: float):
    """BitNet's activation quantization: Round(x * (K / max(max|x|, eps))), clipped."""
    nodes = [helper.make_node("Abs", ["x"], ["a"]),
             helper.make_node("ReduceMax", ["a", "axes"], ["m"], keepdims=1),
             helper.make_node("Clip", ["m", "eps"], ["c"]),
             helper.make_node("Reciprocal", ["c"], ["r"]),
             helper.make_node("Mul", ["r", "k"], ["s"]),
             helper.make_node("Mul", ["x", "s"], ["q"]),
             helper.make_node("Round", ["q"], ["qr"]),
             helper.make_node("Clip", ["qr", "lo", "hi"], ["y"])]
    inits = {"axes": np.array([-1], np.int64), "eps": np.array(eps, np.float32), "k": np.array(k, np.float32),
             "lo": np.array(lo, np.float32), "hi": np.array(hi, np.float32)}
    return nodes, inits


@pytest.mark.parametrize("eps, k, lo, hi, kept", [(1e-5, 127, -128, 127, False), (1e-5, 127, -127, 127, False),
                                                  (1e-5, 127, -128, 126, True), (0.0, 127, -128, 127, True),
                                                  (1e-5, 127.5, -128, 127, True)])
def test_the_clip_of_an_absmax_quantization_is_left_out_only_where_it_changes_nothing(tmp_path, monkeypatch, eps, k,
                                                                                     lo, hi, kept):
    """Round(x * 127 / max|x|) lies in [-127, 127]: a Clip to [-128, 127] is not emitted. It is
    kept where the bounds cut into the range, where the maximum may be 0 or subnormal (1 / m
    overflows), or where K is not an integer. Every row (zeros, an infinity, a NaN, a subnormal
    maximum) comes out bit for bit as with the Clip, and the finite ones as onnxruntime's (which
    drops a NaN in a maximum and clips one to a bound, where the vector unit keeps it)."""
    nodes, inits = _absmax_quant(eps, k, lo, hi)
    path = _save(tmp_path / "q.onnx", nodes, [6, 32], inits)
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((6, 32)) * 3).astype(np.float32)
    x[1] = 0.0
    x[2, :3] = [np.inf, -1.0, 2.0]
    x[3, 5] = np.nan
    x[4] = np.float32(1e-39) * np.sign(x[4])
    x[5, 7] = -np.abs(x[5]).max() * 1.5
    graph, program = compile_model(path, Options(TINY))
    assert ("vmin" in {i.MNEMONIC for i in program.instrs}) == kept
    got = run(program, TINY, {"x": x}).outputs["y"]
    monkeypatch.setattr("dlegion_cc.lower.fused.identity_clips", lambda nodes, scalars: set())
    _, clipped = compile_model(path, Options(TINY))
    assert "vmin" in {i.MNEMONIC for i in clipped.instrs}
    np.testing.assert_array_equal(got, run(clipped, TINY, {"x": x}).outputs["y"])
    finite = [0, 1, 4, 5]
    np.testing.assert_array_equal(got[finite], onnx_reference(path, {"x": x})["y"][finite])


def test_the_clip_of_a_quantized_softmax_is_left_out():
    """Round(Exp(x - max x) * 127) lies in [0, 127]: its Clip to [0, 127] changes nothing, one
    to [1, 127] does."""
    from dlegion_cc.ir import Node
    from dlegion_cc.lower.fused import identity_clips

    def kernel(lo):
        return [Node("ReduceMax", "m", ["x"], ["m"]), Node("Sub", "d", ["x", "m"], ["d"]),
                Node("Exp", "e", ["d"], ["e"]), Node("Mul", "q", ["e", "k"], ["q"]),
                Node("Round", "r", ["q"], ["r"]), Node("Clip", "c", ["r", "lo", "hi"], ["y"])]
    assert identity_clips(kernel(0.0), {"k": 127.0, "lo": 0.0, "hi": 127.0}) == {"y"}
    assert identity_clips(kernel(1.0), {"k": 127.0, "lo": 1.0, "hi": 127.0}) == set()
    assert identity_clips(kernel(0.0), {"k": 127.0, "lo": 0.0, "hi": 126.0}) == set()
