"""Causal attention: score blocks a constant mask wipes out, and the zero blocks of P, are skipped."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from isa import arch
from isa.expand import expand
from isa.instructions import BY_MNEMONIC, VMatMul, family
from dlegion_cc.lower.fused import split_parts, split_width
from dlegion_cc.pipeline import Options, compile_model
from runtime.emulator import run

WIDE = arch.load("dlegion-8x8")
H, S, D = 2, 384, 64


def attention(path, mask_value=np.finfo(np.float32).min, extra_use=False, heads=H, seq=S):
    mask = np.where(np.tril(np.ones((seq, seq), bool)), 0, mask_value).astype(np.float32).reshape(1, 1, seq, seq)
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Mul", ["s", "scale"], ["ss"]),
             helper.make_node("Add", ["ss", "mask"], ["sm"]),
             helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"])]
    outs = [helper.make_tensor_value_info("o", TP.FLOAT, [1, heads, seq, D])]
    if extra_use:                       # the raw scores are an output too: nothing may be skipped
        outs.append(helper.make_tensor_value_info("s", TP.FLOAT, [1, heads, seq, seq]))
    ins = [helper.make_tensor_value_info(n, TP.FLOAT, [1, heads, seq, D]) for n in "qkv"]
    inits = [numpy_helper.from_array(mask, "mask"), numpy_helper.from_array(np.float32(D ** -0.5), "scale")]
    graph = helper.make_graph(nodes, "attn", ins, outs, inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), path)
    return path


def _inputs(heads=H, seq=S):
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal((1, heads, seq, D)).astype(np.float32) for n in "qkv"}


def _vmm_tasks(program):
    return sum(i.M * i.K * i.N for i in expand(program, WIDE.legions).program.instrs if isinstance(i, VMatMul))


@pytest.mark.parametrize("mask_value", [np.finfo(np.float32).min, -np.inf])
def test_causal_blocks_are_skipped_and_the_result_is_the_same_bit_for_bit(tmp_path, mask_value):
    path = attention(tmp_path / "attn.onnx", mask_value)
    _, sparse = compile_model(path, Options(WIDE))
    _, dense = compile_model(path, Options(WIDE, sparsity=False))
    x = _inputs()
    a, b = run(sparse, WIDE, x).outputs["o"], run(dense, WIDE, x).outputs["o"]
    np.testing.assert_array_equal(a, b)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, x)[0]
    assert np.linalg.norm(a - want) / np.linalg.norm(want) < 1e-5
    # QK^T: 6 x 6 output blocks of 64 x 64, the 15 above the diagonal skipped. PV: K in six
    # chunks of 64; row block i skips the 5 - i chunks right of the diagonal, all zeros of P.
    # On the diagonal, two strips of 32 rows: strip j computes 32 (j + 1) score columns and
    # sums 32 (j + 1) rows of V, 32 x 32 x (1 + 2) of the block's 64 x 64 each.
    diagonal = 64 * 64 - 32 * 32 * 3
    skipped = H * 2 * (15 * 64 * 64 + 6 * diagonal) * D
    assert _vmm_tasks(sparse) == _vmm_tasks(dense) - skipped
    # The program says what it left out, for the report; the dense one left out nothing.
    assert sparse.skipped == {"causal_skipped_blocks": H * 15, "causal_skipped_macs": skipped,
                              "causal_skipped_vector_ops": _softmax_ops(dense) - _softmax_ops(sparse)}
    assert dense.skipped == {}


def _lane_elems(program, cls):
    return sum(i.rows * i.cols for i in expand(program, WIDE.legions).program.instrs if isinstance(i, cls))


@pytest.mark.parametrize("heads, seq", [(H, S), (16, 128)])
def test_softmax_runs_only_as_wide_as_its_rows_reach(tmp_path, heads, seq):
    """P's rows are computed, and stored, only as far as their last nonzero (widened to where
    vrsum adds alike): the rest stays zeros in DRAM, and the output is the same bit for bit.
    With 16 heads, a block is one query position of every head (the mask row read once)."""
    path = attention(tmp_path / "attn.onnx", heads=heads, seq=seq)
    _, sparse = compile_model(path, Options(WIDE))
    _, dense = compile_model(path, Options(WIDE, sparsity=False))
    x = _inputs(heads, seq)
    np.testing.assert_array_equal(run(sparse, WIDE, x).outputs["o"], run(dense, WIDE, x).outputs["o"])
    exps, all_of_them = _lane_elems(sparse, BY_MNEMONIC["vexp"]), _lane_elems(dense, BY_MNEMONIC["vexp"])
    assert all_of_them == heads * seq * seq
    assert heads * seq * (seq + 1) // 2 <= exps < 0.7 * all_of_them
    # The program says how many lane operations of the softmax kernel it left out.
    assert sparse.skipped["causal_skipped_vector_ops"] == _softmax_ops(dense) - _softmax_ops(sparse) > 0


def _softmax_ops(program) -> int:
    from runtime.costs import cost
    from runtime.report import regions_by_name
    flat = expand(program, WIDE.legions).program
    members = next(m for name, m in regions_by_name(flat).items() if "Softmax" in name)
    body = [flat.instrs[k] for k in members if family(type(flat.instrs[k])) == "vector"]
    return sum(cost(i, WIDE, None).counters["vector_ops"] for i in body)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 2048), st.data())
def test_a_reach_is_widened_to_where_the_split_sum_adds_alike(n, data):
    """The runs of a row's first ``split_width`` columns, each summed by vrsum and added from
    the last, give vrsum's sum of the whole row bit for bit, for that row and for every row
    reaching less far (a block of rows runs as wide as its widest)."""
    need = data.draw(st.integers(1, n))
    width = split_width(n, need)
    assert need <= width <= n and split_width(n, width) == width
    assert width <= -(-need // 8) * 8 + 8 * max(0, n.bit_length() - 7) or width == n
    rng = np.random.default_rng(need)
    row = np.zeros((4, n), np.float32)
    row[:, :need] = rng.random((4, need), np.float32) * np.float32(1e3) ** rng.uniform(-1, 1, (4, need))
    row[1, data.draw(st.integers(1, need)):] = 0.0
    vrsum = BY_MNEMONIC["vrsum"].FUNC
    parts = split_parts(n, width)
    assert sum(w for _, w in parts) == width and parts[0][0] == 0
    total = vrsum(row[:, parts[-1][0]:sum(parts[-1])])
    for c, w in reversed(parts[:-1]):
        total = vrsum(row[:, c:c + w]) + total
    np.testing.assert_array_equal(vrsum(row).view(np.int32), total.view(np.int32))


def test_skipped_work_survives_text_and_binary_and_reaches_the_report(tmp_path):
    from isa import asm, encoding
    from runtime import report
    _, program = compile_model(attention(tmp_path / "attn.onnx"), Options(WIDE))
    text = asm.format_program(program)
    assert f".skipped causal_skipped_macs {program.skipped['causal_skipped_macs']}" in text
    assert asm.parse(text).skipped == program.skipped
    assert encoding.decode_program(encoding.encode_program(program)).skipped == program.skipped
    sp = report.summarize(run(program, WIDE, _inputs()))["sparsity"]
    assert sp["causal_blocks_skipped"] == H * 15
    assert sp["causal_macs_skipped"] == program.skipped["causal_skipped_macs"]
    assert sp["causal_vector_ops_skipped"] == program.skipped["causal_skipped_vector_ops"] > 0
    assert sp["causal_cycles_saved"] == -(-(sp["causal_macs_skipped"] + sp["causal_vector_ops_skipped"]) // WIDE.vector_lanes)


def test_nothing_is_skipped_when_the_scores_are_used_elsewhere(tmp_path):
    path = attention(tmp_path / "attn.onnx", extra_use=True)
    graph, program = compile_model(path, Options(WIDE))
    assert not any("dead" in n.attrs for n in graph.nodes)
    _, dense = compile_model(path, Options(WIDE, sparsity=False))
    assert _vmm_tasks(program) == _vmm_tasks(dense) or any("zero_a" in n.attrs for n in graph.nodes)
    out = run(program, WIDE, _inputs()).outputs
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, _inputs())
    np.testing.assert_allclose(out["s"], want[1], rtol=1e-5, atol=1e-5)


def test_heads_go_to_spans_of_legions(tmp_path):
    _, program = compile_model(attention(tmp_path / "attn.onnx"), Options(WIDE))
    spans = {i.span for i in program.instrs if isinstance(i, VMatMul)}
    assert spans == {H}


def test_a_row_masked_whole_is_not_taken_for_zeros(tmp_path):
    """Row 0 of the mask wipes out every score: its softmax is uniform, not zeros, so P.V must
    read all of that row (before, its row block's chunks past the diagonal were skipped)."""
    path = tmp_path / "masked.onnx"
    attention(path)
    m = onnx.load(path)
    mask = numpy_helper.to_array(m.graph.initializer[0]).copy()
    mask[..., 0, :] = np.finfo(np.float32).min
    m.graph.initializer[0].CopyFrom(numpy_helper.from_array(mask, "mask"))
    onnx.save(m, path)
    _, program = compile_model(path, Options(WIDE))
    x = _inputs()
    got = run(program, WIDE, x).outputs["o"]
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, x)[0]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
