"""The ONNX quantization operators, one-node models compiled for dlegion-tiny and compared with
onnxruntime: integer outputs bit for bit, floats at a stated tolerance.

onnxruntime runs at ORT_ENABLE_BASIC. On x86 CPUs without VNNI its uint8 x int8 kernels sum
pairs of products in saturating int16 (pmaddubsw), so weights that use the whole int8 range give
results that are not the operators' definition; those cases are checked against numpy, and the
onnxruntime comparisons keep |B| <= 63, where the pair sums cannot saturate.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from isa import arch as arch_mod
from isa.instructions import Barrier, DmaLoad, DmaStore, Drain, MatMul
from dlegion_cc.errors import CompileError
from dlegion_cc.lower.qparts import row_parts
from dlegion_cc.pipeline import Options, compile_model
from runtime.emulator import run
from runtime.timing import simulate

ARCH = arch_mod.load("dlegion-tiny")
MS = "com.microsoft"
NP = {TP.FLOAT: np.float32, TP.UINT8: np.uint8, TP.INT8: np.int8, TP.INT32: np.int32}


def model(nodes, inputs, outputs, inits=(), opset=21, ms=False):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs], list(inits))
    ops = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(MS, 1)] if ms else [])
    return helper.make_model(graph, opset_imports=ops)


def compile_and_run(tmp_path, m, feeds):
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    graph, program = compile_model(path, Options(ARCH))
    return graph, program, run(program, ARCH, feeds).outputs


def onnxruntime(m, feeds):
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def check_exact(tmp_path, m, feeds):
    _, program, ours = compile_and_run(tmp_path, m, feeds)
    for name, want in onnxruntime(m, feeds).items():
        np.testing.assert_array_equal(ours[name].astype(want.dtype), want, err_msg=name)
    return program


def rel_l2(a, b) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def modes(program) -> set[str]:
    return {i.mode for i in program.instrs if isinstance(i, MatMul)}


def const(name, array, dtype=None):
    if dtype is None:
        return numpy_helper.from_array(np.asarray(array), name)
    a = np.asarray(array)
    return helper.make_tensor(name, dtype, list(a.shape), a.reshape(-1).tolist())


rng = np.random.default_rng(7)


# --- DynamicQuantizeLinear -----------------------------------------------------------------

def _dql_inputs(kind, shape):
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    if kind == "positive":
        return np.abs(x) + 0.5
    if kind == "negative":
        return -np.abs(x) - 0.5
    if kind == "zeros":
        return np.zeros(shape, np.float32)
    if kind == "ties":          # many x / scale land on .5
        return (np.round(x * 2) / 2).astype(np.float32)
    return x


@pytest.mark.parametrize("opset", [17, 20, 21])
@pytest.mark.parametrize("kind", ["mixed", "positive", "negative", "zeros", "ties"])
def test_dynamic_quantize_linear_is_exact(tmp_path, opset, kind):
    shape = [2, 3, 40]
    m = model([helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])], [("x", TP.FLOAT, shape)],
              [("y", TP.UINT8, shape), ("s", TP.FLOAT, []), ("z", TP.UINT8, [])], opset=opset)
    check_exact(tmp_path, m, {"x": _dql_inputs(kind, shape)})


def test_dynamic_quantize_linear_reduces_across_legions(tmp_path):
    """Rows too long to share a block: the min/max partials come from both Legions."""
    shape = [7, 3000]
    m = model([helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])], [("x", TP.FLOAT, shape)],
              [("y", TP.UINT8, shape), ("s", TP.FLOAT, []), ("z", TP.UINT8, [])], opset=20)
    x = _dql_inputs("mixed", shape)
    x[5, 17], x[1, 2999] = 40.0, -25.0          # the extremes live in rows of different blocks
    check_exact(tmp_path, m, {"x": x})


# --- MatMulInteger -------------------------------------------------------------------------

def _matmul_integer(a_type, b, b_zp=None, a_zp_input=True, opset=21, a_zp_const=None):
    M, K = 10, b.shape[0]
    ins = ["a", "b"]
    inputs = [("a", a_type, [2, M // 2, K])]
    inits = [const("b", b)]
    if a_zp_input:
        ins.append("az")
        inputs.append(("az", a_type, []))
    elif a_zp_const is not None:
        ins.append("az")
        inits.append(const("az", a_zp_const, a_type))
    if b_zp is not None:
        ins += [""] * (3 - len(ins)) + ["bz"]
        inits.append(const("bz", b_zp))
    node = helper.make_node("MatMulInteger", ins, ["y"], name="mmi")
    return model([node], inputs, [("y", TP.INT32, [2, M // 2, b.shape[1]])], inits, opset=opset)


@pytest.mark.parametrize("opset", [17, 21])
@pytest.mark.parametrize("a_zp", [0, 1, 128, 200, 255])
def test_matmul_integer_uint8_with_runtime_zero_point(tmp_path, opset, a_zp):
    b = rng.integers(-63, 64, (64, 24)).astype(np.int8)
    a = rng.integers(0, 256, (2, 5, 64)).astype(np.uint8)
    feeds = {"a": a, "az": np.array(a_zp, np.uint8)}
    program = check_exact(tmp_path, _matmul_integer(TP.UINT8, b, opset=opset), feeds)
    assert modes(program) == {"w8"}


def test_matmul_integer_int8_with_constant_zero_points(tmp_path):
    b_zp = rng.integers(64, 192, 16).astype(np.uint8)        # per column; B - zp fits int8
    b = (b_zp + rng.integers(-64, 64, (40, 16))).astype(np.uint8)
    a = rng.integers(-128, 128, (2, 5, 40)).astype(np.int8)
    m = _matmul_integer(TP.INT8, b, b_zp, a_zp_input=False, a_zp_const=np.int8(-77))
    check_exact(tmp_path, m, {"a": a})


def test_matmul_integer_without_zero_points_uses_narrow_modes(tmp_path):
    b = rng.integers(-8, 8, (32, 16)).astype(np.int8)       # fits w4
    a = rng.integers(0, 256, (2, 5, 32)).astype(np.uint8)
    program = check_exact(tmp_path, _matmul_integer(TP.UINT8, b, a_zp_input=False), {"a": a})
    assert "w4" in modes(program)


def test_matmul_integer_full_range_weights_match_the_definition(tmp_path):
    b = rng.integers(-128, 128, (64, 24)).astype(np.int8)
    b[0, :] = -128
    a = rng.integers(0, 256, (2, 5, 64)).astype(np.uint8)
    a[0, 0, :] = 255
    _, _, ours = compile_and_run(tmp_path, _matmul_integer(TP.UINT8, b), {"a": a, "az": np.array(3, np.uint8)})
    want = (a.astype(np.int64) - 3) @ b.astype(np.int64)
    np.testing.assert_array_equal(ours["y"], want)


def test_matmul_integer_tiles_stay_exact_past_fp32(tmp_path):
    """Several row blocks and weight chunks on dlegion-tiny, a correction deeper than one chunk
    (every weight 127), and int32 sums far beyond 2^24 stored straight from the accumulators."""
    K, N = 2048, 256
    b = np.full((K, N), 127, np.int8)
    b[:, :4] = rng.integers(-128, 128, (K, 4))
    a = rng.integers(200, 256, (2, 160, K)).astype(np.uint8)
    node = helper.make_node("MatMulInteger", ["a", "b", "az"], ["y"])
    m = model([node], [("a", TP.UINT8, [2, 160, K]), ("az", TP.UINT8, [])], [("y", TP.INT32, [2, 160, N])],
              [const("b", b)])
    _, program, ours = compile_and_run(tmp_path, m, {"a": a, "az": np.array(0, np.uint8)})
    want = a.astype(np.int64) @ b.astype(np.int64)
    assert np.abs(want).max() > 2 ** 24
    np.testing.assert_array_equal(ours["y"], want)
    passes = [i for i in program.instrs if isinstance(i, MatMul)]
    assert max(i.K for i in passes) < K and max(i.M for i in passes) < 320     # chunked and blocked
    corrections = [i.K for i in passes if i.act.rs == 0]
    assert max(corrections) < K          # colsum = 127 K needs K correction rows: chunked too


def test_matmul_integer_into_other_ops_converts_like_cast(tmp_path):
    b = rng.integers(-63, 64, (64, 24)).astype(np.int8)
    nodes = [helper.make_node("MatMulInteger", ["a", "b", "az"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["f"], to=TP.FLOAT),
             helper.make_node("Add", ["f", "bias"], ["y"])]
    m = model(nodes, [("a", TP.UINT8, [6, 64]), ("az", TP.UINT8, [])], [("y", TP.FLOAT, [6, 24])],
              [const("b", b), const("bias", rng.standard_normal(24).astype(np.float32))])
    check_exact(tmp_path, m, {"a": rng.integers(0, 256, (6, 64)).astype(np.uint8), "az": np.array(77, np.uint8)})


@pytest.mark.parametrize("b_zp, pieces", [(0, 3), (255, 2), (100, 2)])
def test_matmul_integer_wide_weights_run_as_int8_pieces(tmp_path, b_zp, pieces):
    """uint8 B minus its zero point spans up to [-255, 255]: two or three int8 pieces."""
    b = rng.integers(0, 256, (32, 16)).astype(np.uint8)
    b[0, :] = [0, 255] * 8
    m = _matmul_integer(TP.UINT8, b, np.uint8(b_zp))
    program = check_exact(tmp_path, m, {"a": rng.integers(0, 256, (2, 5, 32)).astype(np.uint8),
                                        "az": np.array(9, np.uint8)})
    loaded = {program.tensors[i.src.tensor].name for i in program.instrs
              if isinstance(i, DmaLoad) and i.dst.space == "wgt"}
    assert len([n for n in loaded if not n.endswith("_zp_w")]) == pieces, loaded


def test_matmul_integer_batched_constant_weights(tmp_path):
    b = rng.integers(-63, 64, (2, 32, 16)).astype(np.int8)
    node = helper.make_node("MatMulInteger", ["a", "b", "az"], ["y"])
    m = model([node], [("a", TP.UINT8, [2, 5, 32]), ("az", TP.UINT8, [])], [("y", TP.INT32, [2, 5, 16])],
              [const("b", b)])
    check_exact(tmp_path, m, {"a": rng.integers(0, 256, (2, 5, 32)).astype(np.uint8), "az": np.array(0, np.uint8)})


@pytest.mark.parametrize("bshape", [(2, 32, 16), (32, 16), (2, 32, 12)])
def test_matmul_integer_of_two_run_time_int8_operands(tmp_path, bshape):
    """Attention's QK^T or PV quantized by the graph: B computed at run time is loaded as w8
    weights, one matrix per batch of A (or one for all of A), copied to rows of whole arrays'
    widths where it is narrower (12 columns on 8-wide arrays)."""
    node = helper.make_node("MatMulInteger", ["a", "b"], ["y"])
    n = bshape[-1]
    m = model([node], [("a", TP.INT8, [2, 5, 32]), ("b", TP.INT8, list(bshape))], [("y", TP.INT32, [2, 5, n])])
    feeds = {"a": rng.integers(-128, 128, (2, 5, 32)).astype(np.int8),
             "b": rng.integers(-128, 128, bshape).astype(np.int8)}
    program = check_exact(tmp_path, m, feeds)
    assert modes(program) == {"w8"}
    loaded = {program.tensors[i.src.tensor].name for i in program.instrs
              if isinstance(i, DmaLoad) and i.dst.space == "wgt"}
    assert loaded == {"b" if bshape[-1] % ARCH.array == 0 else "b_w8"}


def test_a_product_narrower_than_the_legions_splits_its_rows_across_them(tmp_path):
    """8 columns are one array-wide slice of dlegion-tiny's 8-wide arrays: each batch's 64 rows
    are cut in two parts, one per Legion, and the result stays exact."""
    node = helper.make_node("MatMulInteger", ["a", "b"], ["y"])
    m = model([node], [("a", TP.INT8, [2, 64, 32]), ("b", TP.INT8, [2, 32, 8])], [("y", TP.INT32, [2, 64, 8])])
    feeds = {"a": rng.integers(-128, 128, (2, 64, 32)).astype(np.int8),
             "b": rng.integers(-128, 128, (2, 32, 8)).astype(np.int8)}
    program = check_exact(tmp_path, m, feeds)
    assert {i.legion for i in program.instrs if isinstance(i, MatMul)} == {0, 1}
    stored = {0: 0, 1: 0}
    for i in program.instrs:
        if isinstance(i, DmaStore):
            stored[i.legion] += i.rows * (i.span or 1)
    assert stored == {0: 64, 1: 64}           # 32 rows of each batch a Legion


@pytest.mark.parametrize("machine, rows, n_pad, deal", [
    ("dlegion-8x8", 2048, 512, (8, 1)),       # 32 slices: every Legion has columns
    ("dlegion-32x8", 2048, 128, (8, 4)),      # 8 slices: four parts of the rows, 8 Legions each
    ("dlegion-8x8", 2048, 96, (2, 4)),        # 6 slices: three a Legion, two Legions a part
    ("dlegion-8x8", 100, 96, (8, 1)),         # too few rows to cut
])
def test_row_parts_keep_the_most_legions_busy(machine, rows, n_pad, deal):
    assert row_parts(arch_mod.load(machine), rows, n_pad) == deal


def _run_time_product(tmp_path, batches, M, K, N):
    """The program of an int8 A [batches, M, K] times a run-time B [batches, K, N], and its timeline."""
    node = helper.make_node("MatMulInteger", ["a", "b"], ["y"])
    m = model([node], [("a", TP.INT8, [batches, M, K]), ("b", TP.INT8, [batches, K, N])],
              [("y", TP.INT32, [batches, M, N])])
    path = tmp_path / f"m{batches}.onnx"
    onnx.save(m, path)
    _, program = compile_model(path, Options(ARCH, overlap=False))    # the node's own barriers
    return program, simulate(program, ARCH)


def test_batches_of_a_product_share_one_schedule(tmp_path):
    """Each batch's first loads go ahead of the last stores of the batch before (in the same
    slots, ordered by who reads them), so three batches take well under three times one."""
    one = _run_time_product(tmp_path, 1, 64, 32, 64)[1].cycles
    program, three = _run_time_product(tmp_path, 3, 64, 32, 64)
    assert sum(isinstance(i, Barrier) for i in program.instrs) == 1          # the node's own
    assert three.cycles < 0.95 * 3 * one


def test_an_accumulator_slots_store_waits_behind_the_next_tiles_loads(tmp_path):
    """Exact int32 results are stored from the accumulators. The store of a slot goes out with
    the first pass that reuses the slot, after that tile's loads: a load queued behind a store
    waiting for its pass would leave the arrays idle."""
    tl = _run_time_product(tmp_path, 1, 512, 32, 64)[1]
    busy = max(v for (_, q), v in tl.busy.items() if q == "mat")
    assert busy > 0.9 * tl.cycles


@pytest.mark.parametrize("a_type, b_type, bz, b_cols, why", [
    (TP.UINT8, TP.INT8, None, 8, "A 'a' is uint8; with B computed at run time both operands must be int8"),
    (TP.INT8, TP.UINT8, None, 8, "B 'b' is uint8"),
    (TP.INT8, TP.INT8, 3, 8, "B's zero point 'bz' is not 0"),
])
def test_matmul_integer_errors_name_the_node(tmp_path, a_type, b_type, bz, b_cols, why):
    ins = ["a", "b"] if bz is None else ["a", "b", "", "bz"]
    node = helper.make_node("MatMulInteger", ins, ["y"], name="mmi")
    inits = [] if bz is None else [const("bz", bz, b_type)]
    m = model([node], [("a", a_type, [4, 8]), ("b", b_type, [8, b_cols])], [("y", TP.INT32, [4, b_cols])], inits)
    with pytest.raises(CompileError, match=r"node 'mmi' \(MatMulInteger\): " + why):
        compile_and_run(tmp_path, m, {})


# --- QLinearMatMul -------------------------------------------------------------------------

def test_qlinear_matmul_of_a_run_time_b_says_what_takes_one(tmp_path):
    inits = [const(n, np.float32(0.5)) for n in ("sa", "sb", "sy")] + [const(n, 0, TP.INT8) for n in ("za", "zb", "zy")]
    node = helper.make_node("QLinearMatMul", ["a", "sa", "za", "b", "sb", "zb", "sy", "zy"], ["y"], name="qlm")
    m = model([node], [("a", TP.INT8, [4, 8]), ("b", TP.INT8, [8, 8])], [("y", TP.INT8, [4, 8])], inits)
    with pytest.raises(CompileError, match=r"node 'qlm' \(QLinearMatMul\): B 'b' is computed at run time; "
                                           r"of the integer matmuls only MatMulInteger of two int8"):
        compile_and_run(tmp_path, m, {})


@pytest.mark.parametrize("opset", [17, 21])
@pytest.mark.parametrize("a_type", [TP.UINT8, TP.INT8])
def test_qlinear_matmul_is_exact(tmp_path, opset, a_type):
    K, N = 48, 20
    b = rng.integers(-63, 64, (K, N)).astype(np.int8)
    a_np, (lo, hi) = (np.uint8, (0, 256)) if a_type == TP.UINT8 else (np.int8, (-128, 128))
    inits = [const("sa", np.float32(0.02)), const("za", 130 if a_type == TP.UINT8 else -5, a_type),
             const("b", b), const("sb", rng.uniform(0.01, 0.05, N).astype(np.float32)), const("zb", np.int8(0)),
             const("sy", np.float32(0.9)), const("zy", 120 if a_type == TP.UINT8 else 3, a_type)]
    node = helper.make_node("QLinearMatMul", ["a", "sa", "za", "b", "sb", "zb", "sy", "zy"], ["y"])
    m = model([node], [("a", a_type, [6, K])], [("y", a_type, [6, N])], inits, opset=opset)
    check_exact(tmp_path, m, {"a": rng.integers(lo, hi, (6, K)).astype(a_np)})


def test_qlinear_matmul_with_runtime_scale_is_a_node_error(tmp_path):
    inits = [const("za", np.uint8(0)), const("b", np.ones((8, 8), np.int8)), const("sb", np.float32(1)),
             const("zb", np.int8(0)), const("sy", np.float32(1)), const("zy", np.uint8(0))]
    node = helper.make_node("QLinearMatMul", ["a", "sa", "za", "b", "sb", "zb", "sy", "zy"], ["y"], name="qlm")
    m = model([node], [("a", TP.UINT8, [4, 8]), ("sa", TP.FLOAT, [])], [("y", TP.UINT8, [4, 8])], inits)
    with pytest.raises(CompileError, match=r"node 'qlm' \(QLinearMatMul\): scales .* run time"):
        compile_and_run(tmp_path, m, {})


# --- QuantizeLinear / DequantizeLinear -----------------------------------------------------

Q_CASES = {   # name: (opset, domain, x shape, qtype, scale, zero point, attrs)
    "per_tensor_uint8": (17, "", [4, 30], TP.UINT8, np.float32(0.05), np.uint8(128), {}),
    "per_tensor_int8": (19, "", [2, 3, 20], TP.INT8, np.float32(0.02), np.int8(-3), {}),
    "no_zero_point": (17, "", [4, 30], TP.UINT8, np.float32(0.05), None, {}),
    "per_axis": (17, "", [2, 6, 8], TP.INT8, rng.uniform(0.01, 0.1, 6).astype(np.float32),
                 rng.integers(-5, 5, 6).astype(np.int8), {"axis": 1}),
    "blocked": (21, "", [3, 8, 5], TP.UINT8, rng.uniform(0.01, 0.1, (3, 2, 5)).astype(np.float32),
                rng.integers(100, 150, (3, 2, 5)).astype(np.uint8), {"axis": 1, "block_size": 4}),
    "com_microsoft": (20, MS, [4, 30], TP.INT8, np.float32(0.03), np.int8(7), {}),
}


def _qdq_pair(case, op):
    opset, domain, shape, qtype, scale, zp, attrs = Q_CASES[case]
    inits = [const("s", scale)] + ([] if zp is None else [const("z", zp, qtype)])
    ins = ["x", "s"] + ([] if zp is None else ["z"])
    node = helper.make_node(op, ins, ["y"], domain=domain, **attrs)
    if op == "QuantizeLinear":
        return model([node], [("x", TP.FLOAT, shape)], [("y", qtype, shape)], inits, opset, bool(domain)), shape
    return model([node], [("x", qtype, shape)], [("y", TP.FLOAT, shape)], inits, opset, bool(domain)), shape


@pytest.mark.parametrize("case", Q_CASES)
def test_quantize_linear_is_exact(tmp_path, case):
    m, shape = _qdq_pair(case, "QuantizeLinear")
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    x.reshape(-1)[:6] = np.float32(Q_CASES[case][4].reshape(-1)[0]) * np.float32([0.5, 1.5, 2.5, -0.5, -1.5, 1e4])
    check_exact(tmp_path, m, {"x": x})


@pytest.mark.parametrize("case", Q_CASES)
def test_dequantize_linear_is_exact(tmp_path, case):
    m, shape = _qdq_pair(case, "DequantizeLinear")
    qtype = Q_CASES[case][3]
    info = np.iinfo(NP[qtype])
    check_exact(tmp_path, m, {"x": rng.integers(info.min, info.max + 1, shape).astype(NP[qtype])})


def test_quantize_linear_with_runtime_scale(tmp_path):
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"])
    m = model([node], [("x", TP.FLOAT, [5, 16]), ("s", TP.FLOAT, []), ("z", TP.UINT8, [])],
              [("y", TP.UINT8, [5, 16])], opset=19)
    feeds = {"x": rng.standard_normal((5, 16)).astype(np.float32), "s": np.array(0.01, np.float32),
             "z": np.array(100, np.uint8)}
    check_exact(tmp_path, m, feeds)


def test_dequantize_linear_int32(tmp_path):
    node = helper.make_node("DequantizeLinear", ["x", "s"], ["y"])
    m = model([node], [("x", TP.INT32, [4, 10])], [("y", TP.FLOAT, [4, 10])], [const("s", np.float32(0.125))], 17)
    check_exact(tmp_path, m, {"x": rng.integers(-100000, 100000, (4, 10)).astype(np.int32)})


def test_constant_int4_dequantize_is_folded_at_compile_time(tmp_path):
    """A com.microsoft DequantizeLinear of int4 weights the importer keeps becomes fp32 data."""
    w = rng.integers(-8, 8, (16, 12))
    inits = [const("wq", w, TP.INT4), const("ws", rng.uniform(0.1, 0.2, 12).astype(np.float32)),
             const("wz", np.zeros(12, np.int64), TP.INT4)]
    nodes = [helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], domain=MS, axis=1),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    m = model(nodes, [("x", TP.FLOAT, [3, 16])], [("y", TP.FLOAT, [3, 12])], inits, 20, ms=True)
    feeds = {"x": rng.standard_normal((3, 16)).astype(np.float32)}
    _, _, ours = compile_and_run(tmp_path, m, feeds)
    assert rel_l2(ours["y"], onnxruntime(m, feeds)["y"]) < 1e-6


# --- QDQ around MatMul ---------------------------------------------------------------------

def _qdq_matmul(weight_type, domain, opset, a_type=TP.INT8):
    K, N = 64, 24
    lo, hi = (-7, 7) if weight_type == TP.INT4 else (-127, 127)
    wq = rng.integers(lo, hi + 1, (K, N))
    inits = [const("wq", wq, weight_type), const("ws", rng.uniform(0.001, 0.02, N).astype(np.float32)),
             const("wz", np.zeros(N, np.int64), weight_type), const("sa", np.float32(0.02)),
             const("za", 3 if a_type == TP.INT8 else 131, a_type)]
    nodes = [helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=1, domain=domain),
             helper.make_node("QuantizeLinear", ["x", "sa", "za"], ["xq"], domain=domain),
             helper.make_node("DequantizeLinear", ["xq", "sa", "za"], ["xd"], domain=domain),
             helper.make_node("MatMul", ["xd", "w"], ["y"])]
    return model(nodes, [("x", TP.FLOAT, [2, 4, K])], [("y", TP.FLOAT, [2, 4, N])], inits, opset, bool(domain))


@pytest.mark.parametrize("weight_type, domain, opset, a_type, mode", [
    (TP.INT8, "", 20, TP.INT8, "w8"),            # the importer folds the weight DQ: recovered exactly
    (TP.INT8, "", 20, TP.UINT8, "w8"),
    (TP.INT4, MS, 20, TP.INT8, "w4"),            # com.microsoft DQ stays a node
    (TP.INT4, "", 21, TP.INT8, "w4"),
])
def test_qdq_matmul_runs_on_the_arrays(tmp_path, weight_type, domain, opset, a_type, mode):
    m = _qdq_matmul(weight_type, domain, opset, a_type)
    feeds = {"x": (rng.standard_normal((2, 4, 64)) * 0.8).astype(np.float32)}
    graph, program, ours = compile_and_run(tmp_path, m, feeds)
    assert [n.op for n in graph.nodes if "MatMul" in n.op] == ["QMatMul"]
    assert modes(program) >= {mode}
    assert rel_l2(ours["y"], onnxruntime(m, feeds)["y"]) < 1e-6


def test_unfolded_blocked_weight_dequantize_drains_per_block(tmp_path, monkeypatch):
    """A weight DequantizeLinear that reaches the pass as a node (the importer folds standard
    ones today) with int4 codes in blocks of 16 rows: one drain per block, uint8 activations."""
    from dlegion_cc import importer
    monkeypatch.setattr(importer, "NOT_FOLDED", importer.NOT_FOLDED | {"DequantizeLinear"})
    K, N, block = 64, 24, 16
    inits = [const("wq", rng.integers(-8, 8, (K, N)), TP.INT4),
             const("ws", rng.uniform(0.01, 0.05, (K // block, N)).astype(np.float32)),
             const("wz", rng.integers(-1, 1, (K // block, N)), TP.INT4),
             const("sa", np.float32(0.02)), const("za", 131, TP.UINT8)]
    nodes = [helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=0, block_size=block),
             helper.make_node("QuantizeLinear", ["x", "sa", "za"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sa", "za"], ["xd"]),
             helper.make_node("MatMul", ["xd", "w"], ["y"])]
    m = model(nodes, [("x", TP.FLOAT, [5, K])], [("y", TP.FLOAT, [5, N])], inits, 21)
    feeds = {"x": rng.standard_normal((5, K)).astype(np.float32)}
    graph, program, ours = compile_and_run(tmp_path, m, feeds)
    qmm = [n for n in graph.nodes if n.op == "QMatMul"]
    assert len(qmm) == 1 and qmm[0].attrs["scales"].shape == (K // block, N)
    # every block's accumulators are drained once (a Legion's last tile in row pieces)
    assert sum(i.M for i in program.instrs if isinstance(i, Drain)) == K // block * 5 * len(legions(program))
    assert rel_l2(ours["y"], onnxruntime(m, feeds)["y"]) < 1e-6


def legions(program) -> set[int]:
    """Legions that run matrix passes."""
    return {i.legion for i in program.instrs if isinstance(i, MatMul)}


# --- MatMulNBits ---------------------------------------------------------------------------

def _nbits(K=64, N=24, bits=4, block=32, zero_points=None, bias=False, g_idx=None):
    blocks = -(-K // block)
    per = 8 // bits
    codes = rng.integers(0, 1 << bits, (N, blocks * block))
    packed = np.zeros((N, blocks, block // per), np.uint8)
    for i in range(per):
        packed |= (codes.reshape(N, blocks, -1, per)[..., i] << (bits * i)).astype(np.uint8)
    scales = rng.uniform(0.01, 0.05, N * blocks).astype(np.float32)
    inits, ins = [const("B", packed), const("scales", scales)], ["x", "B", "scales"]
    bias = rng.standard_normal(N).astype(np.float32) if bias else None
    for name, value in (("zp", zero_points), ("g_idx", g_idx), ("bias", bias)):
        ins.append(name if value is not None else "")
        if value is not None:
            inits.append(const(name, value))
    node = helper.make_node("MatMulNBits", ins, ["y"], domain=MS, name="nbits", K=K, N=N, bits=bits,
                            block_size=block)
    return model([node], [("x", TP.FLOAT, [2, 3, K])], [("y", TP.FLOAT, [2, 3, N])], inits, 20, ms=True)


@pytest.mark.parametrize("case, kwargs, mode", [
    ("default zero point 8", {}, "w4"),
    ("uint8 zero points", {"zero_points": rng.integers(0, 256, 24 * 1).astype(np.uint8)}, "w8"),
    ("bias, K of 3 blocks", {"K": 96, "bias": True}, "w4"),
    ("2 bits", {"bits": 2}, "w2"),
    ("8 bits", {"bits": 8}, "w8"),
])
def test_matmul_nbits_error_is_small(tmp_path, case, kwargs, mode):
    m = _nbits(**kwargs)
    feeds = {"x": rng.standard_normal((2, 3, kwargs.get("K", 64))).astype(np.float32)}
    graph, program, ours = compile_and_run(tmp_path, m, feeds)
    err = rel_l2(ours["y"], onnxruntime(m, feeds)["y"])
    print(f"MatMulNBits {case}: rel L2 {err:.2e}")
    assert [n.op for n in graph.nodes] == ["AbsmaxQuantize", "QMatMul"]
    assert modes(program) == {mode}
    assert err < 3e-2


def test_matmul_nbits_reordering_g_idx_is_a_node_error(tmp_path):
    m = _nbits(g_idx=np.arange(64, dtype=np.int32)[::-1].copy())
    with pytest.raises(CompileError, match=r"node 'nbits' \(MatMulNBits\): a g_idx that reorders"):
        compile_and_run(tmp_path, m, {})


@pytest.mark.parametrize("zp_input", [True, False])
def test_rows_in_parts_with_a_zero_point_correction(tmp_path, monkeypatch, zp_input):
    """uint8 activations with a zero point (a graph input, or a constant) and constant int8
    weights, the rows cut into parts (forced: one Legion a part): each part's correction pass
    reads its own copy of the zero-point row, against correction weights laid out as the
    part's weights are."""
    from dlegion_cc.lower import qmatmul
    monkeypatch.setattr(qmatmul, "pick_width", lambda arch, switches, widths, part: 1)
    b = rng.integers(-63, 64, (32, 20)).astype(np.int8)     # onnxruntime's u8 x s8 kernels stay exact
    node = helper.make_node("MatMulInteger", ["a", "b", "az"], ["y"])
    inputs = [("a", TP.UINT8, [64, 32])] + ([("az", TP.UINT8, [])] if zp_input else [])
    inits = [const("b", b)] + ([] if zp_input else [const("az", 137, TP.UINT8)])
    m = model([node], inputs, [("y", TP.INT32, [64, 20])], inits)
    feeds = {"a": rng.integers(0, 256, (64, 32)).astype(np.uint8)} | ({"az": np.array(9, np.uint8)} if zp_input else {})
    program = check_exact(tmp_path, m, feeds)
    stored = {0: set(), 1: set()}
    for i in program.instrs:
        if isinstance(i, DmaStore) and program.tensors[i.dst.tensor].kind == "output":
            stored[i.legion] |= set(range(i.dst.offset // i.dst.rs, i.dst.offset // i.dst.rs + i.rows))
    assert stored == {0: set(range(32)), 1: set(range(32, 64))}       # each Legion its part's rows
