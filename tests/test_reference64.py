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


def test_the_copy_keeps_quantization_operators_in_float32():
    model = float64_model(MODELS / "llama_tiny_qdq.onnx")
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert dq and all(any(i.endswith(f"/as_f32/{n.name}") for i in n.input) for n in dq)
    assert {a.i for c in casts for a in c.attribute if a.name == "to"} >= {1, 11}
    assert not [t.name for t in model.graph.initializer if t.data_type == 1]


# --- MatMulNBits by its definition ---------------------------------------------------------------

def _nbits_model(path, K=64, N=24, bits=4, block=32, zero_points=None, bias=None, level=4, seed=0):
    """One MatMulNBits node with random codes packed lowest bits first, as the contrib operator's
    documentation lays them out; also the weight [K, N] those bytes mean, computed here by
    plain loops (the default zero point 2^(bits-1))."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(seed)
    blocks, per = -(-K // block), 8 // bits
    codes = rng.integers(0, 1 << bits, (N, blocks * block))
    packed = np.zeros((N, blocks * block // per), np.uint8)
    for j in range(blocks * block):
        packed[:, j // per] |= (codes[:, j] << (bits * (j % per))).astype(np.uint8)
    scales = rng.uniform(0.01, 0.05, (N, blocks)).astype(np.float32)
    zp = np.full((N, blocks), 1 << (bits - 1)) if zero_points is None else zero_points
    weight = np.array([[(codes[n, k] - zp[n, k // block]) * float(scales[n, k // block]) for n in range(N)]
                       for k in range(K)])
    inits = [numpy_helper.from_array(packed.reshape(N, blocks, -1), "B"), numpy_helper.from_array(scales, "scales")]
    ins = ["x", "B", "scales", "", "", ""]
    if zero_points is not None:      # packed as B is: N rows of ceil(blocks * bits / 8) bytes
        zp_packed = np.zeros((N, -(-blocks * bits // 8)), np.uint8)
        for j in range(blocks):
            zp_packed[:, j // per] |= (zero_points[:, j] << (bits * (j % per))).astype(np.uint8)
        inits.append(numpy_helper.from_array(zp_packed, "zp"))
        ins[3] = "zp"
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "bias"))
        ins[5] = "bias"
    node = helper.make_node("MatMulNBits", ins, ["y"], domain="com.microsoft", name="nbits", K=K, N=N,
                            bits=bits, block_size=block, accuracy_level=level)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, N])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                      helper.make_opsetid("com.microsoft", 1)]), path)
    return weight


@pytest.mark.parametrize("case", ["4 bits, no zero points", "4 bits, zero points and bias", "2 bits", "8 bits"])
def test_matmul_nbits_is_evaluated_by_its_definition(tmp_path, case):
    """The float64 copy computes x @ W (+ bias) with W dequantized as documented (the default
    zero point 2^(bits-1), which a 0 would shift by 8 scales): equal to the product in float64,
    and onnxruntime's fp32 kernel at accuracy_level 0 (no quantized activations) within fp32's
    rounding of it. The graphs' accuracy_level 4 does not enter the yardstick."""
    bits = {"2 bits": 2, "8 bits": 8}.get(case, 4)
    rng = np.random.default_rng(1)
    zp = rng.integers(0, 1 << bits, (24, 2)) if "zero points" in case else None
    bias = rng.standard_normal(24).astype(np.float32) if "bias" in case else None
    weight = _nbits_model(tmp_path / "m.onnx", bits=bits, zero_points=zp, bias=bias)
    _nbits_model(tmp_path / "exact.onnx", bits=bits, zero_points=zp, bias=bias, level=0)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    got = float64_outputs(tmp_path / "m.onnx", {"x": x})["y"]
    want = x.astype(np.float64) @ weight + (0 if bias is None else bias.astype(np.float64))
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    [fp32] = session(tmp_path / "exact.onnx", "onnxruntime").run(["y"], {"x": x})
    assert rel_l2(fp32, got) < 1e-6


def test_matmul_nbits_at_accuracy_level_4_is_measured_from_the_definition(tmp_path):
    """onnxruntime's accuracy_level 4 kernel quantizes x to int8 per block: its distance from the
    definition is int8's (about 1e-3 here), not 0 as when the yardstick ran that kernel too."""
    _nbits_model(tmp_path / "m.onnx")
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    got = float64_outputs(tmp_path / "m.onnx", {"x": x})["y"]
    [fp32] = session(tmp_path / "m.onnx", "onnxruntime").run(["y"], {"x": x})
    assert 1e-4 < rel_l2(fp32, got) < 2e-2


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


def test_products_of_codes_sum_the_codes_exactly_then_scale_as_the_drain_does():
    """A product of two dequantized int8 operands (``q * r``: a row scale on the left, a column
    scale on the right) becomes the product of their codes, times the row scale, times the
    column scale: in float32 its sums are then exact, as the program's int32 accumulation, where
    the dequantized operands' float32 sums round."""
    import onnx
    from onnx import TensorProto, helper
    from runtime.reference64 import _products_of_codes
    rng = np.random.default_rng(0)
    M, K, N = 4, 512, 8
    qa, qb = (rng.integers(-127, 128, size=s).astype(np.float32) for s in ((M, K), (K, N)))
    ra = rng.uniform(1e-3, 1e-2, (M, 1)).astype(np.float32)
    rb = rng.uniform(1e-3, 1e-2, (1, N)).astype(np.float32)
    f = TensorProto.FLOAT
    nodes = []
    for side in ("a", "b"):
        nodes += [helper.make_node("Cast", [f"q{side}"], [f"q{side}64"], to=f),
                  helper.make_node("Cast", [f"r{side}"], [f"r{side}64"], to=f),
                  helper.make_node("Mul", [f"q{side}64", f"r{side}64"], [side])]
    nodes.append(helper.make_node("MatMul", ["a", "b"], ["y"]))
    inputs = {"qa": qa, "ra": ra, "qb": qb, "rb": rb}
    graph = helper.make_graph(nodes, "product", [helper.make_tensor_value_info(k, f, v.shape) for k, v in inputs.items()],
                              [helper.make_tensor_value_info("y", f, (M, N))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    _products_of_codes(model)
    assert [n.op_type for n in model.graph.node][-3:] == ["MatMul", "Mul", "Mul"]
    onnx.checker.check_model(model)
    import onnxruntime as ort
    [y] = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], inputs)
    exact = qa.astype(np.int64) @ qb.astype(np.int64)
    assert np.array_equal(y, (exact.astype(np.float32) * ra) * rb)


def test_shape_inference_sees_large_weights_as_inputs_and_keeps_small_constants():
    """onnx's shape inference serializes the model it is given, weights and all: the yardstick
    infers from a copy whose large initializers are graph inputs of their type and shape, with
    small constants (a Reshape's shape) kept for it to propagate; the model is left as it was,
    and its session computes from the weights."""
    from onnx import TensorProto, helper, numpy_helper
    from runtime.reference64 import KEPT_BYTES, _inferred, _session
    import onnxruntime as ort
    rng = np.random.default_rng(0)
    w = rng.standard_normal((128, 256))                 # 256 KiB of float64
    assert w.nbytes > KEPT_BYTES
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Reshape", ["y", "shape"], ["z"])]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([4, 2, 256]), "shape")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, (8, 128))],
                              [helper.make_tensor_value_info("z", TensorProto.DOUBLE, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    inferred = _inferred(model)
    [z] = [vi for vi in inferred.output if vi.name == "z"]
    assert [d.dim_value for d in z.type.tensor_type.shape.dim] == [4, 2, 256]
    assert "w" in {vi.name for vi in inferred.input}
    assert [t.name for t in model.graph.initializer] == ["w", "shape"] and not model.graph.input[1:]
    x = rng.standard_normal((8, 128))
    [out] = _session(model, ort.SessionOptions()).run(["z"], {"x": x})
    assert np.array_equal(out, (x @ w).reshape(4, 2, 256))
