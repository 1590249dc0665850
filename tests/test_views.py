"""Reshapes, transposes, slices and expands are strided views of their input's DRAM when every
reader takes one: no copy is emitted, and the graph still computes what onnxruntime does."""
import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from isa import arch
from isa.instructions import DmaStore
from dlegion_cc.lower.layout import Operand, reshaped
from dlegion_cc.pipeline import Options, compile_model
from runtime.check import compare, onnx_reference
from runtime.emulator import random_inputs, run
from runtime.report import region_ranges

TINY = arch.load("dlegion-tiny")


@st.composite
def _views(draw):
    """A strided view of a numpy array (a slice, then a transpose) and a shape of its size."""
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    full = tuple(d * draw(st.sampled_from([1, 2])) for d in shape)
    base = np.arange(int(np.prod(full))).reshape(full)
    view = base[tuple(slice(0, d) for d in shape)].transpose(draw(st.permutations(range(rank))))
    factors, rest = [], view.size
    while rest > 1:
        f = draw(st.sampled_from([d for d in range(2, rest + 1) if rest % d == 0]))
        factors.append(f)
        rest //= f
    new_shape = tuple(draw(st.permutations(factors + [1] * draw(st.integers(0, 2))))) or (1,)
    return base, view, new_shape


@settings(max_examples=300, deadline=None)
@given(_views())
def test_a_reshaped_view_reads_the_elements_numpy_reshape_gives(case):
    base, view, new_shape = case
    op = Operand(0, 0, tuple(s // base.itemsize for s in view.strides))
    new = reshaped(op, view.shape, new_shape)
    if view.flags.c_contiguous:
        assert new is not None       # any reshape of a contiguous value is a view
    if new is None:
        return
    index = np.indices(new_shape).reshape(len(new_shape), -1)
    got = base.reshape(-1)[new.offset + sum(i * s for i, s in zip(index, new.strides))]
    np.testing.assert_array_equal(got, view.reshape(new_shape).reshape(-1))


def _rope_attention(path, out_transposed: bool = False):
    """Q/K of heads by reshape and transpose, rotate-half by slices, a negation and a concat,
    K^T by a transpose, then the scores: the movement a decoder's attention does."""
    S, H, D = 6, 2, 8
    rng = np.random.default_rng(0)
    half = [np.array([v], np.int64) for v in (0, D // 2, D)]
    nodes = [helper.make_node("Reshape", ["x", "shp"], ["x4"]),
             helper.make_node("Transpose", ["x4"], ["q"], perm=[0, 2, 1, 3]),
             helper.make_node("Slice", ["q", "h0", "h1", "ax"], ["q1"]),
             helper.make_node("Slice", ["q", "h1", "h2", "ax"], ["q2"]),
             helper.make_node("Neg", ["q2"], ["nq2"]),
             helper.make_node("Concat", ["nq2", "q1"], ["rot"], axis=-1),
             helper.make_node("Mul", ["q", "cos"], ["qc"]),
             helper.make_node("Mul", ["rot", "sin"], ["rs"]),
             helper.make_node("Add", ["qc", "rs"], ["qr"]),
             helper.make_node("Transpose", ["qr"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["qr", "kt"], ["y"])]
    out = ("y", [1, H, S, S])
    if out_transposed:
        nodes.append(helper.make_node("Transpose", ["y"], ["yt"], perm=[0, 2, 1, 3]))
        out = ("yt", [1, S, H, S])
    inits = [("shp", np.array([1, S, H, D], np.int64)), ("h0", half[0]), ("h1", half[1]), ("h2", half[2]),
             ("ax", np.array([-1], np.int64)), ("cos", rng.standard_normal((S, D)).astype(np.float32)),
             ("sin", rng.standard_normal((S, D)).astype(np.float32))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [1, S, H * D])],
                              [helper.make_tensor_value_info(*out[:1], TP.FLOAT, out[1])],
                              [numpy_helper.from_array(a, n) for n, a in inits])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), path)
    return path


def _compiled_regions(path, fusion: bool = True):
    graph, program = compile_model(path, Options(TINY, fusion=fusion, attention="fp32"))
    inputs = random_inputs(program, 0)
    rows = compare(run(program, TINY, inputs).outputs, onnx_reference(path, inputs))
    assert all(r.ok for r in rows), rows
    return [name for _, name in program.regions]


def test_heads_rotations_and_k_transposed_are_views(tmp_path):
    regions = _compiled_regions(_rope_attention(tmp_path / "rope.onnx"))
    assert len(regions) == 2 and "MatMul" in regions[1], regions     # the rotation's kernel, QK^T


def test_a_graph_output_gets_its_own_copy(tmp_path):
    """The last transpose names a graph output: it is copied into the output tensor."""
    regions = _compiled_regions(_rope_attention(tmp_path / "rope_t.onnx", out_transposed=True))
    assert sum("Transpose" in r for r in regions) == 1, regions


def test_a_reshape_strides_cannot_say_copies(tmp_path):
    """Expand repeats each head (a 0 stride), and the reshape that merges the repeats with the
    heads has no strides: the reshape copies, the expand stays a view. Then a Gather, which
    reads only contiguous tables, makes its transposed input a copy too."""
    nodes = [helper.make_node("Unsqueeze", ["k", "one"], ["k5"]),
             helper.make_node("Expand", ["k5", "rep"], ["ke"]),
             helper.make_node("Reshape", ["ke", "shp"], ["kr"]),
             helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 2, 1, 3]),
             helper.make_node("Gather", ["kt", "ids"], ["y"], axis=1)]
    inits = [("one", np.array([2], np.int64)), ("rep", np.array([1, 2, 3, 4, 5], np.int64)),
             ("shp", np.array([1, 6, 4, 5], np.int64)), ("ids", np.array([3, 0], np.int64))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("k", TP.FLOAT, [1, 2, 4, 5])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [1, 2, 6, 5])],
                              [numpy_helper.from_array(a, n) for n, a in inits])
    path = tmp_path / "gqa.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), path)
    regions = _compiled_regions(path)
    assert [r.split("/")[-1].split("_")[0] for r in regions] == ["Reshape", "Transpose", "Gather"], regions


def test_grouped_query_heads_multiply_their_shared_head_where_it_is(tmp_path):
    """BitNet's tiny preset (4 query heads, 2 key/value heads) at sequence 128 on dlegion-8x8:
    the repeated K and V heads are neither expanded nor transposed into copies (the matmuls
    broadcast over the heads of a group, a 5-D product), P.V stores its heads merged, the causal
    blocks of both products are still skipped, and the result is onnxruntime's."""
    from models.bitnet import build_bitnet, preset, save
    wide = arch.load("dlegion-8x8")
    path = tmp_path / "tiny.onnx"
    save(build_bitnet(preset("tiny", layers=1, seq=128)), path, external_data=False)
    graph, program = compile_model(path, Options(wide, attention="fp32"))
    regions = [name.split("/")[-1] for _, name in program.regions]
    # Nor are the heads merged back into rows by a copy after P.V: its blocks are stored there.
    assert not [r for r in regions if r.startswith(("Expand", "Reshape", "Transpose"))], regions
    assert [len(graph.values[n.inputs[1]].shape) for n in graph.nodes if n.op == "MatMul"][:2] == [5, 5]
    assert program.skipped.get("causal_skipped_blocks", 0) > 0
    inputs = random_inputs(program, 0)
    rows = compare(run(program, wide, inputs).outputs, onnx_reference(path, inputs))
    assert all(r.ok for r in rows), rows


def _rope(path, swapped: bool):
    """q * cos + rotate_half(q) * sin, rotate_half by Slice/Neg/Concat (``swapped``: each Mul's
    operands and the Add's the other way round, the halves sliced from the end)."""
    H, S, D = 2, 6, 8
    rng = np.random.default_rng(3)
    big = np.iinfo(np.int64).max
    lo, hi = ((-D, -D // 2), (-D // 2, big)) if swapped else ((0, D // 2), (D // 2, D))
    two = (lambda a, b: [b, a]) if swapped else (lambda a, b: [a, b])
    nodes = [helper.make_node("Slice", ["q", "lo0", "lo1", "ax"], ["q1"]),
             helper.make_node("Slice", ["q", "hi0", "hi1", "ax"], ["q2"]),
             helper.make_node("Neg", ["q2"], ["nq2"]),
             helper.make_node("Concat", ["nq2", "q1"], ["rot"], axis=-1),
             helper.make_node("Mul", two("q", "cos"), ["qc"]),
             helper.make_node("Mul", two("rot", "sin"), ["rs"]),
             helper.make_node("Add", two("qc", "rs"), ["y"])]
    inits = [("lo0", np.array([lo[0]])), ("lo1", np.array([lo[1]])), ("hi0", np.array([hi[0]])),
             ("hi1", np.array([hi[1]])), ("ax", np.array([-1])),
             ("cos", rng.standard_normal((S, D)).astype(np.float32)),
             ("sin", rng.standard_normal((S, D)).astype(np.float32))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("q", TP.FLOAT, [1, H, S, D])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [1, H, S, D])],
                              [numpy_helper.from_array(np.asarray(a), n) for n, a in inits])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), path)
    return path


@pytest.mark.parametrize("swapped", [False, True])
def test_rotary_embeddings_go_by_halves_into_their_output_bit_for_bit(tmp_path, swapped):
    """No rotated copy of q, no negation, no concat copy: one row kernel computes both halves
    from q's halves and writes them where the concat puts them; onnxruntime's bits."""
    path = _rope(tmp_path / "rope.onnx", swapped)
    graph, program = compile_model(path, Options(TINY, attention="fp32"))
    assert "Neg" not in {n.op for n in graph.nodes}
    assert [name.split(".")[-1] for _, name in program.regions] == ["hi"], program.regions
    q = np.random.default_rng(0).standard_normal((1, 2, 6, 8)).astype(np.float32)
    got = run(program, TINY, {"q": q}).outputs["y"]
    np.testing.assert_array_equal(got, onnx_reference(path, {"q": q})["y"])


@pytest.mark.parametrize("fusion", [True, False])
def test_a_concat_input_is_written_in_place_unless_it_is_read_elsewhere(tmp_path, fusion):
    """Concat(Relu(x), Exp(x), Sigmoid(x)) on axis 1: the element-wise ops (one row kernel, or
    each alone) write their parts of the output themselves; Sigmoid's result is an output too,
    so the concat copies it."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Exp", ["x"], ["b"]),
             helper.make_node("Sigmoid", ["x"], ["c"]), helper.make_node("Concat", ["a", "b", "c"], ["y"], axis=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [5, 3, 4])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [5, 9, 4]),
                               helper.make_tensor_value_info("c", TP.FLOAT, [5, 3, 4])])
    path = tmp_path / "cat.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), path)
    regions = _compiled_regions(path, fusion)
    assert regions[-1] == "Concat_3" and len(regions) == (2 if fusion else 4), regions
    _, program = compile_model(path, Options(TINY, fusion=fusion, attention="fp32"))
    concat = dict(zip([n for _, n in program.regions], region_ranges(program)))[regions[-1]]
    assert sum(isinstance(program.instrs[k], DmaStore) for k in concat) == 1    # only c's part
