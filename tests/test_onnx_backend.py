"""ONNX's own node tests, run through dlegion-cc and the emulator on dlegion-tiny.

A node test is in scope when the operator it tests is one the compiler supports (an
``*_expanded`` test checks the same operator through its function body). Tests that cannot
pass by design are excluded below, one group per reason; everything else must pass. Only the
node-test case is collected: ONNX's model tests need downloads.
"""
import re
import warnings

import numpy as np
import onnx
import onnx.backend.test
from onnx import TensorProto, helper, numpy_helper
from onnx.backend.test.loader import load_model_tests

from dlegion_cc.onnx_backend import DlegionBackend

OPS = {
    "MatMul", "Gemm", "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Neg", "Abs", "Exp",
    "Log", "Relu", "Sigmoid", "Tanh", "Round", "Floor", "Ceil", "Clip", "Where", "IsNaN", "IsInf",
    "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Not", "Max", "Min",
    "Cast", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceSum", "Softmax", "Reshape", "Transpose",
    "Slice", "Concat", "Unsqueeze", "Squeeze", "Flatten", "Expand", "Gather", "Split", "Identity",
    "Sign", "Sin", "Cos",
    "MatMulInteger", "QLinearMatMul", "DynamicQuantizeLinear", "QuantizeLinear", "DequantizeLinear",
}

# Excluded by design: one regular expression per reason, matched against the test name
# (which ends in the device, ``_cpu``).
EXCLUDED = {
    # DRAM tensors are f32, i64, i32, i8 or u8 (bool as u8) and the vector unit computes in fp32:
    # there is no float64, float16, bfloat16 or 8-/4-bit float tensor to read or write.
    "no float64/float16/bfloat16/fp8/fp4 tensors":
        r"^test_cast_.*(DOUBLE|FLOAT16|FLOAT8|FLOAT4)|_float16|_float64|e4m3fn|e5m2|float4e2m1",
    # No 16-bit or wide unsigned DRAM dtype; uint32/uint64 values also exceed fp32's exact range.
    # (quantizelinear_blocked_symmetric quantizes to int16.)
    "no int16/uint16/uint32/uint64 tensors":
        r"_u?int16(_|$)|_uint(32|64)(_|$)|^test_quantizelinear_blocked_symmetric_cpu$",
    # Packed 2-/4-bit integers exist only as constant weights (w2/w4), never as graph inputs or outputs.
    "no 2-/4-bit integer inputs or outputs": r"^test_cast_.*U?INT[24]_|_u?int[24]_cpu$",
    # Tensors of numbers only.
    "no string tensors": r"_string",
    "no sequence or optional values": r"^test_identity_(sequence|opt)_cpu$",
}


def _base(name: str) -> str:
    return re.sub(r"_expanded(_ver\d+)?$", "", name)


def _in_scope() -> list[str]:
    """Names of the node tests whose operator is in OPS."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # the cast cases overflow on purpose
        cases = load_model_tests(kind="node")
    op_of = {c.name: c.model.graph.node[0].op_type for c in cases if len(c.model.graph.node) == 1}
    return sorted(c.name for c in cases if op_of.get(_base(c.name)) in OPS)


IN_SCOPE = _in_scope()
backend_test = onnx.backend.test.BackendTest(DlegionBackend, __name__)
backend_test.include("^(" + "|".join(IN_SCOPE) + ")_cpu$")
for pattern in EXCLUDED.values():
    backend_test.exclude(f"(?:{pattern})")
OnnxBackendNodeModelTest = backend_test.test_cases["OnnxBackendNodeModelTest"]


# --- the backend itself, and lowerings on shapes the node tests keep small ----------------------

def _model(node, inputs, outputs, opset=18):
    graph = helper.make_graph([node], "case", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(node, arrays, out_dtype=TensorProto.FLOAT, opset=18):
    inputs = [(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in zip(node.input, arrays)]
    model = _model(node, inputs, [(node.output[0], out_dtype, None)], opset)
    model = onnx.shape_inference.infer_shapes(model)
    return DlegionBackend.prepare(model).run(arrays)[0]


RNG = np.random.default_rng(7)


def test_run_node_returns_onnx_dtypes():
    a, b = RNG.standard_normal((3, 5)).astype(np.float32), RNG.standard_normal(5).astype(np.float32)
    (c,) = DlegionBackend.run_node(helper.make_node("Less", ["a", "b"], ["c"]), [a, b])
    assert c.dtype == np.bool_
    np.testing.assert_array_equal(c, a < b)


def test_symbolic_dims_are_bound_from_each_run():
    model = _model(helper.make_node("Softmax", ["x"], ["y"], axis=0),
                   [("x", TensorProto.FLOAT, ["n", 5])], [("y", TensorProto.FLOAT, ["n", 5])])
    rep = DlegionBackend.prepare(model)
    for n in (3, 7):
        x = RNG.standard_normal((n, 5)).astype(np.float32)
        e = np.exp(x - x.max(axis=0))
        np.testing.assert_allclose(rep.run([x])[0], e / e.sum(axis=0), rtol=1e-5)
    assert len(rep.programs) == 2


def test_shape_operands_given_at_run_time_become_constants():
    model = _model(helper.make_node("Reshape", ["x", "shape"], ["y"]),
                   [("x", TensorProto.FLOAT, [4, 6]), ("shape", TensorProto.INT64, [2])],
                   [("y", TensorProto.FLOAT, None)])
    rep = DlegionBackend.prepare(model)
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    for shape in ([3, 8], [-1, 12]):
        np.testing.assert_array_equal(rep.run([x, np.array(shape)])[0], x.reshape(shape))
    assert len(rep.programs) == 2


def test_reduction_over_outer_and_inner_axes_across_many_row_blocks():
    x = RNG.standard_normal((3, 300, 70)).astype(np.float32)
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)
    graph = helper.make_graph([node], "case", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [300])],
                              [numpy_helper.from_array(np.array([0, -1]), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    np.testing.assert_allclose(DlegionBackend.prepare(model).run([x])[0], x.sum(axis=(0, 2)), rtol=1e-4, atol=1e-4)


def test_slice_with_negative_steps_on_every_axis():
    x = RNG.standard_normal((6, 7, 9)).astype(np.float32)
    node = helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"])
    bounds = [np.array(v) for v in ([-1, 5, 8], [-100, 0, -100], [0, 1, 2], [-1, -2, -3])]
    y = _run(node, [x, *bounds])
    np.testing.assert_array_equal(y, x[::-1, 5:0:-2, 8::-3])


def test_gather_of_run_time_negative_ids_along_a_middle_axis():
    data = RNG.standard_normal((4, 6, 5)).astype(np.float32)
    ids = np.array([[-1, 0], [3, -6]], np.int64)
    y = _run(helper.make_node("Gather", ["data", "ids"], ["y"], axis=1), [data, ids])
    np.testing.assert_array_equal(y, np.take(data, ids % 6, axis=1))


def test_variadic_max_broadcasts_every_input():
    a, b = RNG.standard_normal((3, 4)).astype(np.float32), RNG.standard_normal(4).astype(np.float32)
    c = RNG.standard_normal((3, 1)).astype(np.float32)
    y = _run(helper.make_node("Max", ["a", "b", "c"], ["y"]), [a, b, c])
    np.testing.assert_array_equal(y, np.maximum(np.maximum(a, b), c))
