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
