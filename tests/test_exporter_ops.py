"""Other exporters' operators (onnxruntime's contrib ops, ONNX's opset-23 and function ops): one-node
models compiled for dlegion-tiny, run, and compared with onnxruntime; each must become one row
kernel, as BitNet's own RMSNorm does."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from isa import arch
from dlegion_cc.errors import CompileError
from dlegion_cc.pipeline import Options, compile_model
from runtime.check import compare, onnx_reference
from runtime.emulator import run

TINY = arch.load("dlegion-tiny")
MS = "com.microsoft"
SHAPE = [1, 5, 64]
RNG = np.random.default_rng(0)
GAMMA, BETA = RNG.standard_normal(64).astype(np.float32), RNG.standard_normal(64).astype(np.float32)


def _model(node, inputs, outputs, opset=21):
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TP.FLOAT, SHAPE) for n in inputs],
                          [helper.make_tensor_value_info(n, TP.FLOAT, SHAPE) for n in outputs],
                          [numpy_helper.from_array(GAMMA, "g"), numpy_helper.from_array(BETA, "b")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])


CASES = {
    # onnxruntime-genai's builder: a contrib op in the default domain, which ONNX's checker refuses
    "SimplifiedLayerNormalization": _model(helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y"],
                                                            epsilon=1e-6, axis=-1), ["x"], ["y"]),
    "SkipSimplifiedLayerNormalization": _model(helper.make_node(
        "SkipSimplifiedLayerNormalization", ["x", "s", "g"], ["y", "", "", "sum"], epsilon=1e-6, domain=MS),
        ["x", "s"], ["y", "sum"]),
    "SkipLayerNormalization": _model(helper.make_node("SkipLayerNormalization", ["x", "s", "g", "b", "b"],
                                                      ["y", "", "", "sum"], domain=MS), ["x", "s"], ["y", "sum"]),
    "LayerNormalization-14": _model(helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"]), ["x"], ["y"],
                                    opset=14),
    "LayerNormalization-17": _model(helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], epsilon=1e-6),
                                    ["x"], ["y"], opset=17),
    "RMSNormalization-23": _model(helper.make_node("RMSNormalization", ["x", "g"], ["y"], epsilon=1e-6), ["x"], ["y"],
                                  opset=23),
    "FastGelu": _model(helper.make_node("FastGelu", ["x", "b"], ["y"], domain=MS), ["x"], ["y"]),
    "Gelu-tanh-20": _model(helper.make_node("Gelu", ["x"], ["y"], approximate="tanh"), ["x"], ["y"], opset=20),
    # exact GELUs: the vector unit has no erf; it is written in the ops it has
    "Gelu-20": _model(helper.make_node("Gelu", ["x"], ["y"]), ["x"], ["y"], opset=20),
    "Gelu (contrib)": _model(helper.make_node("Gelu", ["x"], ["y"], domain=MS), ["x"], ["y"]),
    "Erf": _model(helper.make_node("Erf", ["x"], ["y"]), ["x"], ["y"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_node_matches_onnxruntime_in_one_row_kernel(tmp_path, name):
    path = tmp_path / "m.onnx"
    onnx.save(CASES[name], path)
    graph, program = compile_model(path, Options(TINY))
    assert [n.op for n in graph.nodes] == ["RowKernel"]
    feeds = {i: (RNG.standard_normal(SHAPE) * 3).astype(np.float32) for i in ("x", "s")
             if i in {v.name for v in CASES[name].graph.input}}
    feeds["x"][0, 0, :6] = [0.0, -0.0, 1e-8, -1e-3, 10.0, -10.0]      # erf's two ranges and its tails
    rows = compare(run(program, TINY, feeds).outputs, onnx_reference(path, feeds))
    assert rows and all(r.ok for r in rows), rows


def test_an_unsupported_output_of_a_contrib_op_is_named(tmp_path):
    """SkipSimplifiedLayerNormalization's ``mean`` output is not computed by onnxruntime's
    simplified norm; asked for, it is refused with the node named."""
    node = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "s", "g"], ["y", "m"], name="norm", domain=MS)
    path = tmp_path / "m.onnx"
    onnx.save(_model(node, ["x", "s"], ["y", "m"]), path)
    with pytest.raises(CompileError, match=r"node 'norm' \(SkipSimplifiedLayerNormalization\): output 'mean'"):
        compile_model(path, Options(TINY))


def test_a_declared_shape_that_inference_contradicts_is_let_go(tmp_path):
    """onnxruntime-genai's builder declares a 1-D constant as a scalar; onnxruntime runs the
    model (the inferred shape wins), and so does the compiler."""
    nodes = [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(BETA)),
             helper.make_node("Add", ["x", "c"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, SHAPE)],
                          [helper.make_tensor_value_info("y", TP.FLOAT, SHAPE)],
                          value_info=[helper.make_tensor_value_info("c", TP.FLOAT, [])])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), path)
    feeds = {"x": RNG.standard_normal(SHAPE).astype(np.float32)}
    _, program = compile_model(path, Options(TINY))
    rows = compare(run(program, TINY, feeds).outputs, onnx_reference(path, feeds))
    assert rows and all(r.ok for r in rows), rows


def _int64(name, value):
    return numpy_helper.from_array(np.array(value, np.int64), name)


def test_gather_nd_by_index_grids_as_a_mask_is_built(tmp_path):
    """transformers' padding mask, ``mask[batch_idx, kv_idx]`` with index grids made of Range,
    Expand and Concat (torch.onnx's advanced indexing): once folded, the indices are constant,
    and GatherND is a Gather of the merged leading axes. Negative indices count from the end."""
    B, KV = 2, 7
    nodes = [helper.make_node("Range", ["zero", "nb", "one"], ["bi"]),
             helper.make_node("Range", ["back", "zero", "one"], ["ki"]),         # -7..-1
             helper.make_node("Reshape", ["bi", "s_b"], ["b4"]),
             helper.make_node("Reshape", ["ki", "s_k"], ["k4"]),
             helper.make_node("Expand", ["b4", "full"], ["be"]),
             helper.make_node("Expand", ["k4", "full"], ["ke"]),
             helper.make_node("Unsqueeze", ["be", "last"], ["bu"]),
             helper.make_node("Unsqueeze", ["ke", "last"], ["ku"]),
             helper.make_node("Concat", ["bu", "ku"], ["idx"], axis=-1),
             helper.make_node("GatherND", ["mask", "idx"], ["picked"]),
             helper.make_node("Not", ["picked"], ["y"])]
    inits = [_int64("zero", 0), _int64("nb", B), _int64("back", -KV), _int64("one", 1), _int64("s_b", [B, 1, 1, 1]),
             _int64("s_k", [1, 1, 1, KV]), _int64("full", [B, 1, 1, KV]), _int64("last", [-1])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("mask", TP.BOOL, [B, KV])],
                          [helper.make_tensor_value_info("y", TP.BOOL, [B, 1, 1, KV])], inits)
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    graph, program = compile_model(path, Options(TINY))
    assert "GatherND" not in {n.op for n in graph.nodes}
    feeds = {"mask": RNG.random((B, KV)) < 0.5}
    got = run(program, TINY, feeds).outputs["y"]
    np.testing.assert_array_equal(got.astype(bool), onnx_reference(path, feeds)["y"])


B, S, H, D, POSITIONS = 2, 5, 4, 16, 32
COS, SIN = (RNG.standard_normal((POSITIONS, D // 2)).astype(np.float32) for _ in range(2))


def _rotary(domain, x_shape, pos_shape, opset, **attrs):
    ins = ["x", "pos", "cos", "sin"] if domain else ["x", "cos", "sin", "pos"]
    node = helper.make_node("RotaryEmbedding", ins, ["y"], domain=domain, **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TP.FLOAT, x_shape),
                                        helper.make_tensor_value_info("pos", TP.INT64, pos_shape)],
                          [helper.make_tensor_value_info("y", TP.FLOAT, x_shape)],
                          [numpy_helper.from_array(COS, "cos"), numpy_helper.from_array(SIN, "sin")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])


ROTARY = {
    "contrib [B, S, H * D]": _rotary(MS, [B, S, H * D], [B, S], 21, num_heads=H),
    "contrib [B, H, S, D]": _rotary(MS, [B, H, S, D], [B, S], 21),
    "contrib start offset": _rotary(MS, [B, S, H * D], [1], 21, num_heads=H),
    "contrib interleaved": _rotary(MS, [B, S, H * D], [B, S], 21, num_heads=H, interleaved=1),
    "opset 23": _rotary("", [B, S, H * D], [B, S], 23, num_heads=H),
    "opset 23 interleaved, half rotated": _rotary("", [B, S, H * D], [B, S], 23, num_heads=H, interleaved=1,
                                                  rotary_embedding_dim=D // 2),
}


@pytest.mark.parametrize("name", sorted(ROTARY))
def test_rotary_embedding_matches_onnxruntime(tmp_path, name):
    """onnxruntime's RotaryEmbedding (rewritten) and ONNX's (its function inlined); an
    interleaved one writes its pairs through a Concat of [..., 1] parts."""
    path = tmp_path / "m.onnx"
    m = ROTARY[name]
    if "half" in name:      # the caches hold the rotated width's half
        for t in m.graph.initializer:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t)[:, :D // 4].copy(), t.name))
    onnx.save(m, path)
    _, program = compile_model(path, Options(TINY))
    x_shape = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    pos_shape = [d.dim_value for d in m.graph.input[1].type.tensor_type.shape.dim]
    pos = RNG.integers(0, POSITIONS - S, pos_shape) if pos_shape != [1] else np.array([7])
    feeds = {"x": RNG.standard_normal(x_shape).astype(np.float32), "pos": pos.astype(np.int64)}
    rows = compare(run(program, TINY, feeds).outputs, onnx_reference(path, feeds))
    assert rows and all(r.ok for r in rows), rows


@pytest.mark.parametrize("layout", ["[B, S, H * D]", "[B, H, S, D]"])
def test_opset_23_attention_matches_onnxruntime(tmp_path, layout):
    """ONNX's Attention (grouped: 4 query heads, 2 key/value heads; causal), its function inlined."""
    q, kv = ([B, S, H * D], [B, S, 2 * D]) if layout.startswith("[B, S") else ([B, H, S, D], [B, 2, S, D])
    attrs = {"q_num_heads": H, "kv_num_heads": 2} if len(q) == 3 else {}
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=1, **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TP.FLOAT, s) for n, s in
                                        (("q", q), ("k", kv), ("v", kv))],
                          [helper.make_tensor_value_info("y", TP.FLOAT, q)])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)]), path)
    _, program = compile_model(path, Options(TINY))
    feeds = {n: RNG.standard_normal(s).astype(np.float32) for n, s in (("q", q), ("k", kv), ("v", kv))}
    rows = compare(run(program, TINY, feeds).outputs, onnx_reference(path, feeds))
    assert rows and all(r.ok for r in rows), rows


def _gqa(packed: bool, seq: int, past: int, rotary: bool):
    """onnxruntime-genai's attention: 4 query heads over 2 key/value heads of 16, a past of
    ``past`` positions, seqlens_k an input, total_sequence_length a constant."""
    kv_heads, total = 2, past + seq
    qkv = ["qkv", "", ""] if packed else ["q", "k", "v"]
    ins = qkv + ["past_k", "past_v", "seqlens", "total"] + (["cos", "sin"] if rotary else [])
    node = helper.make_node("GroupQueryAttention", ins, ["y", "present_k", "present_v"], domain=MS, num_heads=H,
                            kv_num_heads=kv_heads, do_rotary=int(rotary))
    widths = {"qkv": (H + 2 * kv_heads) * D, "q": H * D, "k": kv_heads * D, "v": kv_heads * D}
    inputs = [helper.make_tensor_value_info(n, TP.FLOAT, [1, seq, widths[n]]) for n in qkv if n]
    inputs += [helper.make_tensor_value_info(n, TP.FLOAT, [1, kv_heads, past, D]) for n in ("past_k", "past_v")]
    inputs.append(helper.make_tensor_value_info("seqlens", TP.INT32, [1]))
    outputs = [helper.make_tensor_value_info("y", TP.FLOAT, [1, seq, H * D])]
    outputs += [helper.make_tensor_value_info(n, TP.FLOAT, [1, kv_heads, total, D]) for n in ("present_k", "present_v")]
    inits = [numpy_helper.from_array(np.array([total], np.int32), "total"),
             numpy_helper.from_array(COS, "cos"), numpy_helper.from_array(SIN, "sin")]
    g = helper.make_graph([node], "g", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])


@pytest.mark.parametrize("packed, seq, rotary", [(True, 1, True), (True, 3, True), (False, 2, False)])
@pytest.mark.parametrize("padding", [0, 2])
def test_group_query_attention_matches_onnxruntime(tmp_path, packed, seq, rotary, padding):
    """Decode steps, a padded batch row (a shorter past, read from seqlens_k at run time) too:
    the output and both presents."""
    past = 8
    path = tmp_path / "m.onnx"
    m = _gqa(packed, seq, past, rotary)
    onnx.save(m, path)
    _, program = compile_model(path, Options(TINY))
    feeds = {i.name: RNG.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in m.graph.input if i.name != "seqlens"}
    feeds["seqlens"] = np.array([past + seq - 1 - padding], np.int32)
    rows = compare(run(program, TINY, feeds).outputs, onnx_reference(path, feeds))
    assert len(rows) == 3 and all(r.ok for r in rows), rows


def test_what_group_query_attention_cannot_do_is_named(tmp_path):
    m = _gqa(True, 1, 8, True)
    m.graph.node[0].name = "attn"
    m.graph.node[0].attribute.append(helper.make_attribute("local_window_size", 4))
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    with pytest.raises(CompileError, match=r"node 'attn' \(GroupQueryAttention\): local_window_size=4 is not supported"):
        compile_model(path, Options(TINY))


def test_a_range_of_run_time_values_is_named_not_its_function_body(tmp_path):
    """ONNX defines Range by a Loop, which nothing lowers: it is not inlined, so the error names it."""
    g = helper.make_graph([helper.make_node("Range", ["a", "b", "c"], ["y"], name="rng")], "g",
                          [helper.make_tensor_value_info(n, TP.FLOAT, []) for n in "abc"],
                          [helper.make_tensor_value_info("y", TP.FLOAT, [5])])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    with pytest.raises(CompileError, match=r"node 'rng' \(Range\): operator not supported"):
        compile_model(path, Options(TINY))
