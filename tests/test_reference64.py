"""The float64 evaluation of a graph: the yardstick fp32 programs are measured against."""
from pathlib import Path

import numpy as np
import pytest

from runtime.check import session
from runtime.reference64 import float64_model, float64_outputs, rel_l2

MODELS = Path(__file__).parent.parent / "models"


def _ids(seq: int = 8) -> dict[str, np.ndarray]:
    return {"input_ids": np.random.default_rng(0).integers(0, 200, size=(1, seq)).astype(np.int64)}


@pytest.mark.parametrize("name", ["bitnet_tiny_relu2", "llama_tiny_nbits4", "llama_tiny_dynamic_int8"])
def test_float64_logits_are_near_onnxruntimes_fp32_but_computed_in_float64(name):
    inputs = _ids()
    ref = float64_outputs(MODELS / f"{name}.onnx", inputs)["logits"]
    [fp32] = session(MODELS / f"{name}.onnx", "exact").run(["logits"], inputs)
    assert ref.dtype == np.float64
    assert 0 < rel_l2(fp32, ref) < 1e-5


def test_the_copy_computes_matmul_nbits_by_its_definition():
    """MatMulNBits becomes a float64 MatMul by its dequantized weight, (q - zero point) * scale
    per block, unpacked here by hand for the first one; no float32 initializer is left."""
    import onnx
    from onnx import numpy_helper
    source = onnx.load(MODELS / "llama_tiny_nbits4.onnx")
    first = next(n for n in source.graph.node if n.op_type == "MatMulNBits")
    model = float64_model(MODELS / "llama_tiny_nbits4.onnx")
    assert not [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert not [t.name for t in model.graph.initializer if t.data_type == 1]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    dense = inits[f"{first.name}/dequantized"]
    attrs = {a.name: a.i for a in first.attribute}
    K, N, block = attrs["K"], attrs["N"], attrs["block_size"]
    packed = {t.name: numpy_helper.to_array(t) for t in source.graph.initializer}[first.input[1]]
    scales = {t.name: numpy_helper.to_array(t) for t in source.graph.initializer}[first.input[2]]
    low, high = packed.reshape(N, -1) & 15, packed.reshape(N, -1) >> 4
    codes = np.stack([low, high], -1).reshape(N, -1)[:, :K].astype(np.float64)
    assert len(first.input) == 3          # no zero points: 8, the middle of 4 bits
    expected = (codes - 8) * np.repeat(scales.reshape(N, -1).astype(np.float64), block, axis=1)[:, :K]
    assert dense.dtype == np.float64 and np.array_equal(dense, expected.T)


def test_an_operator_onnxruntime_has_no_double_kernel_for_is_evaluated_by_the_reference(tmp_path):
    # GELU's Erf has no float64 kernel in onnxruntime: onnx's reference evaluator runs the copy
    import math
    import onnx
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Erf", ["x"], ["y"])], "erf", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "erf.onnx")
    values = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    got = float64_outputs(tmp_path / "erf.onnx", {"x": values})["y"]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, [[math.erf(float(v)) for v in row] for row in values], rtol=1e-15)
