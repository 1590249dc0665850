"""Attention's float products on the arrays in int8 (passes/attention.py): the default rule,
the exact integer parts, the error, causal skipping and the recorded approximation."""
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from isa import arch
from isa.asm import format_program, load, parse
from isa.encoding import decode_program, encode_program
from isa.instructions import DmaLoad, DmaStore, Drain, MatMul, VUnary
from dlegion_cc.lower import qplan, qtiles, reduce, rowwise
from dlegion_cc.lower.quant import int_result
from dlegion_cc.lower.schedules import Schedules
from dlegion_cc.passes import attnoperands
from dlegion_cc.pipeline import Options, compile_model, graph_of
from runtime.check import approximation_tolerance, flip_one_weight, judge
from runtime.emulator import random_inputs, run
from runtime.report import regions_by_name
from runtime.state import Trap
from runtime.timing import simulate

ROOT = Path(__file__).parent.parent
WIDE = arch.load("dlegion-8x8")
TINY = arch.load("dlegion-tiny")
D = 32


def _save(path, nodes, ins, outs, inits=()):
    graph = helper.make_graph(nodes, "g", ins, outs, list(inits))
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), path)
    return path


def attention(path, heads=2, seq=64, kv_heads=None):
    """Causal attention of float inputs q [1, heads, seq, D] and k, v [1, kv_heads, seq, D]; with
    fewer key/value heads, each is repeated for its group as torch's repeat_kv does."""
    kv = kv_heads or heads
    mask = np.where(np.tril(np.ones((seq, seq), bool)), 0, np.finfo(np.float32).min).astype(np.float32)
    inits = [numpy_helper.from_array(mask.reshape(1, 1, seq, seq), "mask"),
             numpy_helper.from_array(np.float32(D ** -0.5), "scale")]
    nodes, k, v = [], "k", "v"
    if kv != heads:
        inits += [numpy_helper.from_array(np.array([2], np.int64), "axis2"),
                  numpy_helper.from_array(np.array([1, kv, heads // kv, seq, D], np.int64), "wide"),
                  numpy_helper.from_array(np.array([1, heads, seq, D], np.int64), "heads")]
        for x in "kv":
            nodes += [helper.make_node("Unsqueeze", [x, "axis2"], [f"{x}5"]),
                      helper.make_node("Expand", [f"{x}5", "wide"], [f"{x}r"]),
                      helper.make_node("Reshape", [f"{x}r", "heads"], [f"{x}h"])]
        k, v = "kh", "vh"
    nodes += [helper.make_node("Transpose", [k], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["q", "kt"], ["s"]),
              helper.make_node("Mul", ["s", "scale"], ["ss"]),
              helper.make_node("Add", ["ss", "mask"], ["sm"]),
              helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", v], ["o"])]
    ins = [helper.make_tensor_value_info("q", TP.FLOAT, [1, heads, seq, D])]
    ins += [helper.make_tensor_value_info(x, TP.FLOAT, [1, kv, seq, D]) for x in "kv"]
    return _save(path, nodes, ins, [helper.make_tensor_value_info("o", TP.FLOAT, [1, heads, seq, D])], inits)


def _inputs(heads=2, seq=64, kv_heads=None):
    rng = np.random.default_rng(0)
    kv = kv_heads or heads
    # K with a bias its channels share, which smoothing removes before quantizing
    return {"q": rng.standard_normal((1, heads, seq, D)).astype(np.float32),
            "k": (rng.standard_normal((1, kv, seq, D)) + 3 * rng.standard_normal(D)).astype(np.float32),
            "v": rng.standard_normal((1, kv, seq, D)).astype(np.float32)}


def _onnxruntime(path, x):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, x)[0]


def _rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def test_float_models_keep_fp32_and_quantized_models_default_to_int8(tmp_path):
    path = attention(tmp_path / "attn.onnx")
    plain = graph_of(path, Options(TINY))
    assert not [n for n in plain.nodes if n.op == "AttnMatMul"]
    forced = graph_of(path, Options(TINY, attention="int8"))
    assert [n.op for n in forced.nodes if n.op == "AttnMatMul"] == ["AttnMatMul"] * 2
    bitnet = graph_of(ROOT / "models" / "bitnet_tiny_relu2.onnx", Options(TINY))
    assert [n for n in bitnet.nodes if n.op == "AttnMatMul"]
    # A decode step's product has fewer query rows than an array: fp32 unless int8 is asked for.
    dims = {"sequence": 1, "past_sequence_length": 11}
    decode = graph_of(ROOT / "models" / "bitnet_tiny_decode.onnx", Options(TINY, dims))
    assert not [n for n in decode.nodes if n.op == "AttnMatMul"]
    decode = graph_of(ROOT / "models" / "bitnet_tiny_decode.onnx", Options(TINY, dims, attention="int8"))
    assert [n for n in decode.nodes if n.op == "AttnMatMul"]
    fp32 = graph_of(ROOT / "models" / "bitnet_tiny_relu2.onnx", Options(TINY, attention="fp32"))
    assert not [n for n in fp32.nodes if n.op == "AttnMatMul"]


def test_the_program_records_its_approximations_through_both_formats(tmp_path):
    """Each with the model's values it is made in: int8_attention names the outputs of the
    products it quantized (QK^T's "s", PV's "o")."""
    path = attention(tmp_path / "attn.onnx", seq=16)
    _, exact = compile_model(path, Options(TINY))
    _, approx = compile_model(path, Options(TINY, attention="int8"))
    assert exact.approximations == {} and approx.approximations == {"int8_attention": ["s", "o"]}
    text = format_program(approx)
    assert '.approximation int8_attention "s" "o"\n' in text
    assert parse(text).approximations == {"int8_attention": ["s", "o"]}
    assert decode_program(encode_program(approx)).approximations == {"int8_attention": ["s", "o"]}
    _, nbits = compile_model(ROOT / "models" / "llama_tiny_nbits4.onnx", Options(TINY))
    assert list(nbits.approximations) == ["int8_activations", "int8_attention"]
    assert nbits.approximations["int8_activations"] == [] and len(nbits.approximations["int8_attention"]) == 4
    assert approximation_tolerance(nbits.approximations) > approximation_tolerance(approx.approximations) > 1e-4


def plain_product(tmp_path):
    """A model of one MatMul of two float inputs (3 batches of 40x48 by 48x24, b's columns of
    different magnitudes) with no softmax after it, and its inputs."""
    H, M, K, N = 3, 40, 48, 24
    path = _save(tmp_path / "mm.onnx", [helper.make_node("MatMul", ["a", "b"], ["o"])],
                 [helper.make_tensor_value_info("a", TP.FLOAT, [H, M, K]),
                  helper.make_tensor_value_info("b", TP.FLOAT, [H, K, N])],
                 [helper.make_tensor_value_info("o", TP.FLOAT, [H, M, N])])
    rng = np.random.default_rng(1)
    x = {"a": rng.standard_normal((H, M, K)).astype(np.float32),
         "b": (rng.standard_normal((H, K, N)) * rng.uniform(0.1, 10, (H, 1, N))).astype(np.float32)}
    return path, x


def test_the_integer_parts_are_exact(tmp_path):
    """A product of two float matrices with no softmax after it: each row of a and each column of
    b quantized by absmax, multiplied exactly in int32, scaled when draining, bit for bit as
    numpy computes the same steps in fp32."""
    path, x = plain_product(tmp_path)
    _, program = compile_model(path, Options(WIDE, attention="int8"))
    got = run(program, WIDE, x).outputs["o"]

    def absmax(v):          # per row of v: int8 values and their fp32 scale
        r = np.maximum(np.abs(v).max(axis=-1, keepdims=True), np.float32(1e-30)) / np.float32(127)
        return np.round(v / r), r
    a8, ra = absmax(x["a"])
    b8t, rb = absmax(np.swapaxes(x["b"], 1, 2))
    acc = np.einsum("hmk,hnk->hmn", a8.astype(np.int64), b8t.astype(np.int64))
    want = acc.astype(np.float32) * ra * np.swapaxes(rb, 1, 2)
    np.testing.assert_array_equal(got, want)
    assert 0 < _rel(got, x["a"] @ x["b"]) < 1e-2


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_attention_error_is_within_its_bound(tmp_path, kv_heads):
    heads, seq = 4, 128
    path = attention(tmp_path / "attn.onnx", heads, seq, kv_heads)
    x = _inputs(heads, seq, kv_heads)
    _, program = compile_model(path, Options(WIDE, attention="int8"))
    got = run(program, WIDE, x).outputs["o"]
    err = _rel(got, _onnxruntime(path, x))
    assert 1e-4 < err < 2e-2          # an approximation, and a close one (measured: 1.2e-2)
    assert not [t for t in program.tensors if t.dtype == "f32" and t.shape[-2:] == (seq, seq)
                and t.kind == "scratch" and "softmax" in t.name.lower()]


def test_smoothing_k_removes_its_shared_bias(tmp_path, monkeypatch):
    """K's channels share a large bias: quantized per token without smoothing, it takes most of
    each token's range, and the scores lose what differs between tokens."""
    path = attention(tmp_path / "attn.onnx", 2, 64)
    x = _inputs(2, 64)
    x["k"] = x["k"] + 20 * np.random.default_rng(2).standard_normal(D).astype(np.float32)
    want = _onnxruntime(path, x)
    graph = graph_of(path, Options(WIDE, attention="int8"))
    assert [n for n in graph.nodes if n.op == "ReduceMean"]        # K's mean over the sequence
    _, program = compile_model(path, Options(WIDE, attention="int8"))
    smoothed = _rel(run(program, WIDE, x).outputs["o"], want)
    from dlegion_cc.passes import attention as attn
    monkeypatch.setattr(attn, "_feeds_softmax", lambda graph, scores: False)
    _, plain = compile_model(path, Options(WIDE, attention="int8"))
    unsmoothed = _rel(run(plain, WIDE, x).outputs["o"], want)
    assert smoothed < unsmoothed / 2


def test_causal_skipping_keeps_the_same_bits(tmp_path):
    """P's quantized rows are computed only as far as the causal mask lets them reach, and the
    PV product leaves out the rows of V past a row block's reach (neither loaded nor passed);
    the program computes the same as with nothing skipped."""
    path = attention(tmp_path / "attn.onnx", 2, 256)
    x = _inputs(2, 256)
    _, sparse = compile_model(path, Options(WIDE, attention="int8"))
    _, dense = compile_model(path, Options(WIDE, attention="int8", sparsity=False))
    a, b = run(sparse, WIDE, x), run(dense, WIDE, x)
    np.testing.assert_array_equal(a.outputs["o"], b.outputs["o"])
    assert sparse.skipped["causal_skipped_vector_ops"] > 0 and sparse.skipped["causal_skipped_macs"] > 0
    assert not dense.skipped
    assert any(isinstance(i, MatMul) and i.mask is not None for i in sparse.instrs)
    assert a.timeline.counters["macs"] < b.timeline.counters["macs"]


def test_the_causal_mask_is_loaded_and_added_only_past_its_zeros(tmp_path):
    """The softmax kernel loads and adds the causal mask only past the columns where every row
    of a block holds +0.0 in it (the scores there are left as they are, which changes no bit of
    P); the program computes the same as the one that loads and adds it all (sparsity off)."""
    path = attention(tmp_path / "attn.onnx", 2, 256)
    x = _inputs(2, 256)
    loaded, out = {}, {}
    for sparsity in (True, False):
        _, program = compile_model(path, Options(WIDE, attention="int8", sparsity=sparsity))
        [mask] = [t for t, tensor in enumerate(program.tensors) if tensor.name == "mask"]
        loaded[sparsity] = sum(i.rows * i.cols * (i.span or 1) for i in program.instrs
                               if isinstance(i, DmaLoad) and i.src.tensor == mask)
        out[sparsity] = run(program, WIDE, x).outputs["o"]
    np.testing.assert_array_equal(out[True], out[False])
    assert 0 < 3 * loaded[True] < 2 * loaded[False]


def test_a_layer_of_many_heads_computes_the_same_with_causal_skipping(tmp_path):
    """Ten heads at sequence 128 (2B4T's head width): PV's weight slots once served a row block
    the chunk loaded for an earlier one of a shorter reach, whose rows past that reach were
    never loaded (logits 0.36 from the dense program's); a slot's key now holds its reach."""
    from models.bitnet import build_bitnet, preset, save
    path = tmp_path / "layer.onnx"
    config = preset("2b4t", layers=1, seq=128, vocab=256, hidden=1280, heads=10, kv_heads=5, ffn=256)
    save(build_bitnet(config), path, external_data=True)
    machine = WIDE
    _, sparse = compile_model(path, Options(machine, attention="int8"))
    _, dense = compile_model(path, Options(machine, attention="int8", sparsity=False))
    x = random_inputs(sparse, 0)
    np.testing.assert_array_equal(run(sparse, machine, x).outputs["logits"], run(dense, machine, x).outputs["logits"])


def test_a_weight_slot_loaded_for_a_shorter_reach_is_not_reused_for_a_longer_one(tmp_path):
    """PV pinned to row blocks of 32 rows, the whole of K one chunk, two weight slots: in a
    part's row block 0, which reaches 32 of V's rows, a head whose slot an earlier head wrote
    loads only those rows; row block 1 reaches all 64 and must not take that slot for the
    whole chunk (it once did, and read the earlier head's V). Same bits as the dense program,
    and MACs skipped."""
    path = attention(tmp_path / "attn.onnx", 4, 128)
    x = _inputs(4, 128)
    searched = Schedules()
    compile_model(path, Options(WIDE, attention="int8", schedules=searched))
    pv = [e for e in searched.chosen if e["shape"]["K"] == 128]
    assert pv and all(e["tile"]["rows"] > 32 and e["chunk"]["depth"] == 128 for e in pv)
    for e in pv:
        e["tile"]["rows"], e["slots"]["wgt"] = 32, 2
    pinned = lambda: Schedules("pinned", {pv[0]["node"]: pv})  # noqa: E731
    _, sparse = compile_model(path, Options(WIDE, attention="int8", schedules=pinned()))
    _, dense = compile_model(path, Options(WIDE, attention="int8", schedules=pinned(), sparsity=False))
    np.testing.assert_array_equal(run(sparse, WIDE, x).outputs["o"], run(dense, WIDE, x).outputs["o"])
    assert sparse.skipped["causal_skipped_macs"] > 0


def test_qk_tiles_above_the_diagonal_are_neither_loaded_nor_passed(tmp_path):
    """QK^T of a causal mask: a row block's output tiles past its last row are dead (nothing
    looks at them); they are neither loaded, passed, drained nor stored. Counted on one pinned
    schedule (each Legion's columns in tiles of an array's width, fewer weight slots than
    tiles, so the dense program loads every tile again for each row block), with and without
    skipping: one pass per live (head, row block, tile), fewer weight bytes loaded."""
    heads, seq = 1, 512
    path = attention(tmp_path / "attn.onnx", heads, seq)
    x = _inputs(heads, seq)
    searched = Schedules()
    compile_model(path, Options(WIDE, attention="int8", schedules=searched))
    [qk] = [e for e in searched.chosen if e["shape"]["K"] == D]
    rows, cols = 128, WIDE.array
    assert qk["chunk"]["depth"] == D and qk["deal"]["columns_per_legion"] > 2 * cols
    qk["tile"], qk["slots"]["wgt"], qk["loop_order"] = {"rows": rows, "cols": cols}, 2, "rows"
    counts, out = {}, {}
    for sparsity in (True, False):
        _, program = compile_model(path, Options(WIDE, attention="int8", sparsity=sparsity,
                                                 schedules=Schedules("pinned", {qk["node"]: [qk]})))
        ins = [program.instrs[k] for k in regions_by_name(program)[qk["node"]]]
        spans = lambda kind: sum(i.span or 1 for i in ins if isinstance(i, kind))  # noqa: E731
        loads = sum(i.rows * i.cols * (i.span or 1) for i in ins if isinstance(i, DmaLoad) and i.dst.space == "wgt")
        counts[sparsity] = spans(MatMul), spans(Drain), loads
        out[sparsity] = run(program, WIDE, x).outputs["o"]
    np.testing.assert_array_equal(out[True], out[False])
    tiles = seq // cols
    live = heads * sum(n0 < m0 + rows for m0 in range(0, seq, rows) for n0 in range(0, seq, cols))
    assert counts[False][0] == heads * (seq // rows) * tiles
    assert counts[True][0] == live < counts[False][0]
    assert counts[True][1] < counts[False][1] and counts[True][2] < counts[False][2]


@pytest.mark.parametrize("name", ["bitnet_tiny_relu2", "bitnet_tiny_gqa", "llama_tiny_dynamic_int8",
                                  "llama_tiny_qdq"])
def test_committed_models_pass_check_with_int8_attention(name):
    from models.golden import read_npz
    golden = read_npz(ROOT / "tests" / "golden" / f"{name}.npz")
    inputs = {"input_ids": golden["input_ids"]}
    dims = {"sequence": golden["input_ids"].shape[1]} if name == "bitnet_tiny_gqa" else {}
    model = ROOT / "models" / f"{name}.onnx"
    # (bitnet_tiny_gqa's golden has fewer positions than an array has rows: int8 asked for)
    _, program = compile_model(model, Options(TINY, dims, attention="int8"))
    assert list(program.approximations) == ["int8_attention"]
    outputs = run(program, TINY, inputs).outputs
    verdict = judge(model, inputs, outputs, program_approximations=program.approximations)
    [row] = verdict.rows
    # past the tolerance from onnxruntime, at fp32's distance from fp64 with the same quantization
    assert row.ok and row.rel_l2 > 1e-4 and row.fp64.ours < 1e-6
    assert row.top1.agree == row.top1.positions


def test_check_says_what_the_program_approximates_and_allows_for_it(tmp_path):
    from click.testing import CliRunner
    from dlegion_cc.cli import compile_command
    from runtime.cli import run_command
    model, prog = ROOT / "models" / "bitnet_tiny_relu2.onnx", tmp_path / "p.s"
    r = CliRunner().invoke(compile_command, [str(model), "-o", str(prog), "--arch", "dlegion-tiny", "-q"])
    assert r.exit_code == 0, r.output
    assert ".approximation int8_attention" in prog.read_text()
    # the float64 evaluation applies int8 attention too: measured from it at the tolerance as given
    r = CliRunner().invoke(run_command, [str(prog), "--check", str(model), "-q"])
    assert r.exit_code == 0, r.output
    assert "int8_attention" in r.output and "measured from the float64 evaluation with them applied" in r.output
    # against onnxruntime's fp32 run alone, the approximation's own tolerance is allowed for
    r = CliRunner().invoke(run_command, [str(prog), "--check", str(model), "--reference", "onnxruntime", "-q"])
    assert r.exit_code == 0 and "relative L2 <= 0.05" in r.output, r.output
    r = CliRunner().invoke(run_command, [str(prog), "--check", str(model), "--reference", "onnxruntime",
                                         "--tolerance", "1e-4", "-q"])
    assert r.exit_code == 1 and "MISMATCH" in r.output
    data = Path(f"{prog}.data")
    data.write_bytes(flip_one_weight(data.read_bytes(), load(prog, read_data=False))[0])
    r = CliRunner().invoke(run_command, [str(prog), "--check", str(model), "-q"])
    assert r.exit_code == 1 and "MISMATCH" in r.output, r.output


def test_pv_stores_its_heads_straight_into_the_merged_rows(tmp_path):
    """o [1, heads, seq, D] -> Transpose -> Reshape [1, seq, heads * D], read by a row op: the
    P.V drains store each head's rows where the merged rows hold them, so the Reshape copies
    nothing (it did: 10.5 MB and 17,490 cycles of the 2B4T layer at sequence 512), with the same
    bits as the heads-major output, race-checked."""
    heads, seq = 3, 64
    base = attention(tmp_path / "attn.onnx", heads, seq)
    model = onnx.load(base)
    g = model.graph
    g.initializer.extend([numpy_helper.from_array(np.array([1, seq, heads * D], np.int64), "merged"),
                          numpy_helper.from_array(np.float32(2), "two")])
    g.node.extend([helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3], name="merge_t"),
                   helper.make_node("Reshape", ["ot", "merged"], ["om"], name="merge_r"),
                   helper.make_node("Mul", ["om", "two"], ["y"])])
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("y", TP.FLOAT, [1, seq, heads * D]))
    merged = tmp_path / "merged.onnx"
    onnx.save(model, merged)
    x = _inputs(heads, seq)
    _, program = compile_model(merged, Options(WIDE, attention="int8"))
    assert not {"merge_t", "merge_r"} & set(regions_by_name(program))        # no copy emitted
    _, plain = compile_model(base, Options(WIDE, attention="int8"))
    want = run(plain, WIDE, x).outputs["o"].transpose(0, 2, 1, 3).reshape(1, seq, heads * D) * 2
    np.testing.assert_array_equal(run(program, WIDE, x, races=True).outputs["y"], want)


# --- K and V quantized in one pass over their values (passes/attnoperands.py) ---------------

def _without_pass(monkeypatch):
    monkeypatch.setattr(attnoperands.QuantizeOperandsInPlace, "run", lambda self, graph, options: None)


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_k_and_v_quantized_in_place_compute_the_same_bits(tmp_path, monkeypatch, kv_heads):
    heads, seq = 4, 128
    path = attention(tmp_path / "attn.onnx", heads, seq, kv_heads)
    x = _inputs(heads, seq, kv_heads)
    ops = [n.op for n in graph_of(path, Options(WIDE, attention="int8")).nodes]
    assert "ColumnAbsmaxQuantize" in ops and "SmoothAbsmaxQuantize" in ops
    # K's smoothing and V's transposes gone; Q's quantization as it was
    assert "Sub" not in ops and ops.count("AbsmaxQuantize") == 1 and "Transpose" not in ops[ops.index("RowKernel"):]
    _, fused = compile_model(path, Options(WIDE, attention="int8"))
    got = run(fused, WIDE, x, races=True).outputs["o"]
    _without_pass(monkeypatch)
    _, plain = compile_model(path, Options(WIDE, attention="int8"))
    np.testing.assert_array_equal(got, run(plain, WIDE, x, races=True).outputs["o"])
    # V's transpose before its quantization and the copy of V8 back before P.V are gone
    moved = lambda p: sum(i.rows * i.cols * (i.span or 1) for i in p.instrs if isinstance(i, DmaLoad))  # noqa: E731
    assert moved(fused) < moved(plain)


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_k_codes_stored_transposed_need_no_copy_before_qk(tmp_path, monkeypatch, kv_heads):
    """SmoothAbsmaxQuantize stores K's int8 codes as the arrays read K^T: the copy of K8
    through the scratchpad before QK^T is gone, with the same bits, race-checked."""
    heads, seq = 4, 128
    path = attention(tmp_path / "attn.onnx", heads, seq, kv_heads)
    x = _inputs(heads, seq, kv_heads)
    _, stored = compile_model(path, Options(WIDE, attention="int8"))
    got = run(stored, WIDE, x, races=True).outputs["o"]
    monkeypatch.setattr(reduce, "_codes", lambda low, q: int_result(low, q))
    _, copied = compile_model(path, Options(WIDE, attention="int8"))
    np.testing.assert_array_equal(got, run(copied, WIDE, x, races=True).outputs["o"])
    moved = lambda p: sum(i.rows * i.cols * (i.span or 1) for i in p.instrs if isinstance(i, DmaLoad))  # noqa: E731
    assert moved(copied) - moved(stored) == (kv_heads or heads) * seq * D     # K8 loaded once less


def test_the_race_check_finds_a_wait_removed_from_the_column_strips(tmp_path):
    """A strip's first instruction waits for its load: without that wait, a race."""
    path = attention(tmp_path / "attn.onnx", 2, 64)
    _, program = compile_model(path, Options(WIDE, attention="int8"))
    [region] = [m for name, m in regions_by_name(program).items() if "absmax" in name and "v_" in name]
    k = next(k for k in region if isinstance(program.instrs[k], VUnary) and program.instrs[k].condition() is not None)
    broken = replace(program, instrs=[replace(i, wait=None) if j == k else i for j, i in enumerate(program.instrs)])
    x = _inputs(2, 64)
    run(program, WIDE, x, races=True)
    with pytest.raises(Trap, match=rf"instruction {k}: vabs: race on"):
        run(broken, WIDE, x, races=True)


def test_a_reduction_over_the_tokens_reads_columns_in_place_with_the_same_bits(tmp_path):
    """ReduceMean (K's mean) and ReduceMax over the next-to-last axis: strips of columns loaded
    transposed into the scratchpad, no copy of the input through DRAM, and the sums bit for bit
    those of each column made a contiguous row (numpy's pairwise order, as before)."""
    S, D = 200, 40
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[2], keepdims=1),
             helper.make_node("ReduceMax", ["x"], ["z"], axes=[-2], keepdims=0)]
    path = onnx.helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [2, 3, S, D])],
        [helper.make_tensor_value_info("m", TP.FLOAT, [2, 3, 1, D]),
         helper.make_tensor_value_info("z", TP.FLOAT, [2, 3, D])]), opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(path, tmp_path / "r.onnx")
    _, program = compile_model(tmp_path / "r.onnx", Options(WIDE))
    assert not [t for t in program.tensors if t.name.endswith("_moved")]
    x = (np.random.default_rng(3).standard_normal((2, 3, S, D)) * 50 + 7).astype(np.float32)
    out = run(program, WIDE, {"x": x}, races=True).outputs
    rows = np.ascontiguousarray(np.swapaxes(x, -1, -2))
    np.testing.assert_array_equal(out["m"][:, :, 0], np.sum(rows, axis=-1, dtype=np.float32) / np.float32(S))
    np.testing.assert_array_equal(out["z"], rows.max(axis=-1))


def test_column_strips_take_a_buffer_each_and_load_ahead_of_their_stores(tmp_path, monkeypatch):
    """K's mean over the tokens of 5 K heads in strips of columns, 5 a Legion (2B4T's at 128 on
    dlegion-8x8): each strip takes a buffer of its own (``reduce.ring``), so every Legion's loads
    are issued before its first store, and the program computes the bits of the one with two
    buffers, race-checked, in fewer cycles."""
    shape = [1, 5, 128, 128]
    node = helper.make_node("ReduceMean", ["x"], ["m"], axes=[2], keepdims=1)
    model = onnx.helper.make_model(helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TP.FLOAT, shape)],
        [helper.make_tensor_value_info("m", TP.FLOAT, [*shape[:2], 1, shape[-1]])]),
        opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "r.onnx")
    x = {"x": (np.random.default_rng(5).standard_normal(shape) * 9 + 2).astype(np.float32)}
    _, ringed = compile_model(tmp_path / "r.onnx", Options(WIDE))
    for legion in range(WIDE.legions):
        dma = [type(i) for i in ringed.instrs if isinstance(i, (DmaLoad, DmaStore)) and i.legion == legion]
        assert dma == [DmaLoad] * 5 + [DmaStore] * 5
    monkeypatch.setattr(reduce, "ring", lambda em, size, strips, temp: 2)
    _, two = compile_model(tmp_path / "r.onnx", Options(WIDE))
    np.testing.assert_array_equal(run(ringed, WIDE, x, races=True).outputs["m"], run(two, WIDE, x, races=True).outputs["m"])
    assert simulate(ringed, WIDE).cycles < simulate(two, WIDE).cycles


def test_row_blocks_in_flight_are_counted_as_dealt(tmp_path, monkeypatch):
    """K's smoothed quantization ahead of the first head group (4 heads of 128 rows) takes 16 rows
    a Legion a head, where half the vector scratchpad holds more: three blocks fit in flight
    (``rowwise.dealt``), so each Legion's loads of a head's block go ahead of the stores of the
    head two before, and the layer computes the bits of the one sized by the rows half the
    scratchpad holds, race-checked."""
    from models.bitnet import build_bitnet, preset, save
    path = tmp_path / "layer.onnx"
    save(build_bitnet(preset("2b4t", layers=1, seq=128, vocab=256, hidden=1024, heads=8, kv_heads=8, ffn=256)),
         path, external_data=True)

    def loads_before_codes(program) -> int:
        """Legion 0's loads ahead of K's smoothing before the first group, before its first codes stored."""
        [region] = [m for name, m in regions_by_name(program).items() if "mean" in name and "smooth" in name]
        dma = [program.instrs[k] for k in region if isinstance(program.instrs[k], (DmaLoad, DmaStore))
               and program.instrs[k].legion == 0]
        return next(n for n, i in enumerate(dma) if isinstance(i, DmaStore) and i.rows > 1)
    _, dealt = compile_model(path, Options(WIDE, attention="int8"))
    monkeypatch.setattr(rowwise, "dealt", lambda rows, most, legions: most)
    _, halves = compile_model(path, Options(WIDE, attention="int8"))
    assert loads_before_codes(dealt) > loads_before_codes(halves)
    x = random_inputs(dealt, 0)
    np.testing.assert_array_equal(run(dealt, WIDE, x, races=True).outputs["logits"],
                                  run(halves, WIDE, x, races=True).outputs["logits"])


def test_three_scale_slots_keep_the_passes_operands_from_waiting_on_a_drain(tmp_path, monkeypatch):
    """With three row-scale and column-vector slots (``qplan.RS_SLOTS``, ``CV_SLOTS``) a tile's
    scales load into a slot no drain of the tile before reads: the attention computes the bits
    it computed with two, race-checked, in fewer cycles."""
    path = attention(tmp_path / "attn.onnx", 8, 128)
    x = _inputs(8, 128)
    _, three = compile_model(path, Options(WIDE, attention="int8"))
    for module in (qplan, qtiles):
        monkeypatch.setattr(module, "RS_SLOTS", 2)
        monkeypatch.setattr(module, "CV_SLOTS", 2)
    _, two = compile_model(path, Options(WIDE, attention="int8"))
    np.testing.assert_array_equal(run(three, WIDE, x, races=True).outputs["o"], run(two, WIDE, x, races=True).outputs["o"])
    assert simulate(three, WIDE).cycles < simulate(two, WIDE).cycles


def rotary_layer(tmp_path, attention: str):
    """A small 2B4T layer saved in ``tmp_path``, its path, fused graph and program compiled with
    ``attention``."""
    from models.bitnet import build_bitnet, preset, save
    path = tmp_path / "layer.onnx"
    config = preset("2b4t", layers=1, seq=64, vocab=256, hidden=512, heads=4, kv_heads=2, ffn=256)
    save(build_bitnet(config), path, external_data=True)
    return (path, *compile_model(path, Options(WIDE, attention=attention)))


def same_bits_with_q_quantized_apart(monkeypatch, path, attention: str, fused, x) -> None:
    """``fused``'s logits, race-checked, equal those of the program compiled with Q's quantization
    left to AbsmaxQuantize (no QuantizeInRowKernel)."""
    got = run(fused, WIDE, x, races=True).outputs["logits"]
    monkeypatch.setattr(attnoperands.QuantizeInRowKernel, "run", lambda self, graph, options: None)
    plain_graph, plain = compile_model(path, Options(WIDE, attention=attention))
    assert [n for n in plain_graph.nodes if n.op == "AbsmaxQuantize"]
    np.testing.assert_array_equal(got, run(plain, WIDE, x, races=True).outputs["logits"])


def test_q_is_quantized_in_its_rotary_kernel_with_the_same_bits(tmp_path, monkeypatch):
    """Q's rotary halves are quantized in the row kernel that rotates them and stored int8
    (passes/attnoperands.py QuantizeInRowKernel): the rotated Q never goes to DRAM in fp32, no
    AbsmaxQuantize is left, and the layer computes the same bits as with it, race-checked;
    without the wait before the kernel's first store, a race."""
    path, graph, fused = rotary_layer(tmp_path, "int8")
    assert not [n for n in graph.nodes if n.op == "AbsmaxQuantize"]
    [cat] = [n for n in graph.nodes if n.op == "Concat" and graph.values[n.outputs[0]].dtype == np.int8]
    kernel = graph.producer(cat.inputs[0])
    assert kernel.op == "RowKernel" and [t.dtype for t in fused.tensors if t.io_name == cat.outputs[0]] == ["i8"]
    x = random_inputs(fused, 0)
    same_bits_with_q_quantized_apart(monkeypatch, path, "int8", fused, x)
    region = next(m for name, m in regions_by_name(fused).items() if name.startswith(kernel.attrs["nodes"][0].name))
    k = next(k for k in region if type(fused.instrs[k]).__name__ == "DmaStore" and fused.instrs[k].condition() is not None)
    broken = replace(fused, instrs=[replace(i, wait=None) if j == k else i for j, i in enumerate(fused.instrs)])
    with pytest.raises(Trap, match=rf"instruction {k}: dma.st: race on"):
        run(broken, WIDE, x, races=True)


def test_light_weights_load_beside_the_multicast_activations(tmp_path, monkeypatch):
    """Weights light against multicast activations (``qplan.light_weights``: P.V's V, not the
    projections' ternary weights) load without waiting for the activations: the attention
    computes the same bits, race-checked, in fewer cycles (8 heads of 128 at 256 on
    dlegion-8x8: 31,897 -> 31,312)."""
    assert qplan.light_weights(SimpleNamespace(rows=512), 8, 16, "w8")
    assert not qplan.light_weights(SimpleNamespace(rows=512), 8, 64, "w8")
    assert not qplan.light_weights(SimpleNamespace(rows=64), 8, 2, "w2")
    monkeypatch.setitem(globals(), "D", 128)      # the 2B4T head's width: V's columns a Legion 16
    path = attention(tmp_path / "attn.onnx", 8, 256)
    x = _inputs(8, 256)
    _, light = compile_model(path, Options(WIDE, attention="int8"))
    monkeypatch.setattr(qplan, "light_weights", lambda *_: False)
    _, heavy = compile_model(path, Options(WIDE, attention="int8"))
    np.testing.assert_array_equal(run(light, WIDE, x, races=True).outputs["o"], run(heavy, WIDE, x, races=True).outputs["o"])
    assert simulate(light, WIDE).cycles < simulate(heavy, WIDE).cycles
