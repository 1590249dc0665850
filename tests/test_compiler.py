"""dlegion-cc: the command contract, the IR views, errors, and small graphs against onnxruntime."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from isa import arch
from isa.asm import load
from dlegion_cc.errors import CompileError
from dlegion_cc.importer import import_model
from dlegion_cc.pipeline import Options, compile_model
from runtime.check import compare, onnx_reference
from runtime.emulator import random_inputs, run

ROOT = Path(__file__).parent.parent
TINY = arch.load("dlegion-tiny")


def dlegion_cc(*args):
    code = "import sys; from dlegion_cc.cli import main; sys.argv[0] = 'dlegion-cc'; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)


def _model(path, nodes, inputs, outputs, inits=(), opset=20):
    g = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(a, n) for n, a in inits])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), path)
    return path


def _bitlinear(path, seq="seq", k=32, n=24, seed=0):
    w = np.random.default_rng(seed).integers(-1, 2, (n, k)).astype(np.float32)
    nodes = [helper.make_node("Abs", ["x"], ["ax"]),
             helper.make_node("ReduceMax", ["ax", "axes"], ["mx"], keepdims=1),
             helper.make_node("Clip", ["mx", "eps"], ["mxc"]),
             helper.make_node("Reciprocal", ["mxc"], ["r"]),
             helper.make_node("Mul", ["r", "c127"], ["s"]),
             helper.make_node("Mul", ["x", "s"], ["xs"]),
             helper.make_node("Round", ["xs"], ["xr"]),
             helper.make_node("Clip", ["xr", "lo", "hi"], ["q"]),
             helper.make_node("Div", ["q", "s"], ["xq"]),
             helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["xq", "wt"], ["y0"]),
             helper.make_node("Mul", ["y0", "ws"], ["y"])]
    inits = [("axes", np.array([-1], np.int64)), ("eps", np.array(1e-5, np.float32)),
             ("c127", np.array(127, np.float32)), ("lo", np.array(-128, np.float32)),
             ("hi", np.array(127, np.float32)), ("w", w), ("ws", np.array(0.25, np.float32))]
    return _model(path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, k])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, n])], inits)


def _check(path, machine=TINY, dims=None):
    graph, program = compile_model(path, Options(machine, dims or {}))
    inputs = random_inputs(program, 0)
    result = run(program, machine, inputs)
    return graph, program, compare(result.outputs, onnx_reference(path, inputs))


@pytest.mark.parametrize("machine", ["dlegion-tiny", "dlegion-8x8", "ws-64", "adip-64"])
def test_bitlinear_becomes_one_quantized_matmul(tmp_path, machine):
    graph, program, rows = _check(_bitlinear(tmp_path / "b.onnx"), arch.load(machine), {"seq": 9})
    assert all(r.ok for r in rows), rows
    assert [n.op for n in graph.nodes if n.op == "QMatMul"] == ["QMatMul"]
    modes = {i.mode for i in program.instrs if i.MNEMONIC == "mm"}
    assert modes == ({"w8"} if machine == "ws-64" else {"w2"})


def test_cli_writes_program_and_data_and_runs(tmp_path):
    model = _bitlinear(tmp_path / "b.onnx")
    out = tmp_path / "out" / "b.s"
    r = dlegion_cc(model, "-o", out, "--dim", "seq=5", "--arch", "dlegion-tiny")
    assert r.returncode == 0, r.stderr
    program = load(out)
    assert program.data is not None and (tmp_path / "out" / "b.s.data").exists()
    assert any(i.MNEMONIC == "mm" for i in program.instrs)


def test_emit_ir_bin_and_print_after(tmp_path):
    model = _bitlinear(tmp_path / "b.onnx")
    r = dlegion_cc(model, "-o", tmp_path / "b.ir", "--emit", "ir", "--dim", "seq=4", "--print-ir-after", "all")
    assert r.returncode == 0, r.stderr
    assert "dlegion.QMatMul" in (tmp_path / "b.ir").read_text()
    assert "IR after import" in r.stderr and "IR after bitlinear" in r.stderr
    r = dlegion_cc(model, "-o", tmp_path / "b.bin", "--emit", "bin", "--dim", "seq=4")
    assert r.returncode == 0 and (tmp_path / "b.bin").read_bytes().startswith(b"DLGN")


def test_unbound_dimension_is_named(tmp_path):
    r = dlegion_cc(_bitlinear(tmp_path / "b.onnx"), "-o", tmp_path / "b.s")
    assert r.returncode == 2
    assert "unbound symbolic dimension 'seq'" in r.stderr and "--dim seq=N" in r.stderr
    assert not (tmp_path / "b.s").exists()


def test_every_unsupported_node_is_listed(tmp_path):
    nodes = [helper.make_node("Atan", ["x"], ["a"], name="atan1"),
             helper.make_node("Relu", ["a"], ["b"], name="relu"),
             helper.make_node("Hardmax", ["b"], ["y"], name="hardmax1")]
    model = _model(tmp_path / "u.onnx", nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    r = dlegion_cc(model, "-o", tmp_path / "u.s")
    assert r.returncode == 2
    assert "node 'atan1' (Atan)" in r.stderr and "node 'hardmax1' (Hardmax)" in r.stderr
    assert "relu" not in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "u.s").exists() and not (tmp_path / "u.s.data").exists()


def test_a_lowering_bug_is_not_taken_for_a_failed_producer(tmp_path, monkeypatch):
    """A KeyError in a lowering means "an input whose producer failed" only when a failure was
    reported before it; otherwise it is a bug, which must not leave a program without the node."""
    from dlegion_cc.lower import context

    def broken(low, node):
        raise KeyError("internal")
    monkeypatch.setitem(context.LOWERINGS, ("", "Relu"), broken)
    model = _model(tmp_path / "r.onnx", [helper.make_node("Relu", ["x"], ["y"], name="relu")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    with pytest.raises(KeyError, match="internal"):
        compile_model(model, Options(TINY))


def test_an_identity_naming_an_output_costs_nothing(tmp_path):
    """Identity(x) -> graph output y: x's producer writes y itself. An Identity of a graph
    input, or of a value that is an output too, still copies."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Identity", ["r"], ["y"], name="name_y"),
             helper.make_node("Identity", ["x"], ["z"], name="copy_z"),
             helper.make_node("Identity", ["y"], ["w"], name="copy_w")]
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 8]) for n in ("x", "y", "z", "w")]
    path = _model(tmp_path / "i.onnx", nodes, info[:1], info[1:])
    graph = import_model(path)
    assert [n.name for n in graph.nodes] == ["relu", "copy_z", "copy_w"]
    assert graph.nodes[0].outputs == ["y"] and "r" not in graph.values
    assert all(r.ok for r in _check(path)[2])


def test_bad_files(tmp_path):
    r = dlegion_cc(tmp_path / "none.onnx", "-o", tmp_path / "x.s")
    assert r.returncode == 2 and "no such file" in r.stderr
    (tmp_path / "junk.onnx").write_bytes(b"\x00not a model")
    r = dlegion_cc(tmp_path / "junk.onnx", "-o", tmp_path / "x.s")
    assert r.returncode == 2 and "junk.onnx" in r.stderr and "Traceback" not in r.stderr


def test_external_data_must_stay_in_the_model_folder(tmp_path):
    m = onnx.load(_bitlinear(tmp_path / "b.onnx"))
    (tmp_path / "sub").mkdir()
    onnx.save(m, tmp_path / "sub" / "ext.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="ext.onnx.data", size_threshold=0)
    moved = onnx.load(tmp_path / "sub" / "ext.onnx", load_external_data=False)
    for t in moved.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = "../ext.onnx.data"
    onnx.save(moved, tmp_path / "sub" / "ext.onnx")
    (tmp_path / "sub" / "ext.onnx.data").rename(tmp_path / "ext.onnx.data")
    with pytest.raises(CompileError, match="outside the model's folder"):
        compile_model(tmp_path / "sub" / "ext.onnx", Options(TINY, {"seq": 2}))


def test_float_graph_with_fusion_and_attention_matches(tmp_path):
    S, D, H = 6, 16, 2
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Pow", ["x", "two"], ["x2"]),
             helper.make_node("ReduceMean", ["x2", "ax"], ["ms"], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["mse"]),
             helper.make_node("Sqrt", ["mse"], ["rms"]),
             helper.make_node("Reciprocal", ["rms"], ["inv"]),
             helper.make_node("Mul", ["x", "inv"], ["xn"]),
             helper.make_node("Mul", ["xn", "g"], ["xg"]),
             helper.make_node("MatMul", ["xg", "W"], ["h"]),
             helper.make_node("Reshape", ["h", "shp"], ["h4"]),
             helper.make_node("Transpose", ["h4"], ["ht"], perm=[0, 2, 1, 3]),
             helper.make_node("Transpose", ["h4"], ["hk"], perm=[0, 2, 3, 1]),
             helper.make_node("MatMul", ["ht", "hk"], ["sc"]),
             helper.make_node("Softmax", ["sc"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "ht"], ["o"]),
             helper.make_node("Sub", ["one", "o"], ["y"])]
    inits = [("two", np.array(2, np.float32)), ("ax", np.array([-1], np.int64)),
             ("eps", np.array(1e-5, np.float32)), ("g", rng.standard_normal(D).astype(np.float32)),
             ("W", rng.standard_normal((D, D)).astype(np.float32)), ("shp", np.array([1, S, H, D // H], np.int64)),
             ("one", np.array(1.0, np.float32))]
    path = _model(tmp_path / "f.onnx", nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, S, D])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, H, S, D // H])], inits)
    graph, _, rows = _check(path)
    assert all(r.ok for r in rows), rows
    assert any(n.op == "RowKernel" for n in graph.nodes)


@pytest.mark.parametrize("fused", [False, True])
def test_a_square_is_a_multiply_and_equals_onnxruntime_bit_for_bit(tmp_path, fused):
    """Pow(x, 2), alone or in a row kernel (x^2 - 1): one vmul a lane, not a transcendental
    vpow, and onnxruntime's result bit for bit, overflow and infinities included."""
    nodes = [helper.make_node("Pow", ["x", "two"], ["y" if not fused else "x2"])]
    nodes += [helper.make_node("Sub", ["x2", "one"], ["y"])] if fused else []
    path = _model(tmp_path / "p.onnx", nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 40])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 40])],
                  [("two", np.array(2, np.float32)), ("one", np.array(1, np.float32))])
    graph, program = compile_model(path, Options(TINY))
    assert [n.op for n in graph.nodes] == (["RowKernel"] if fused else ["Pow"])
    assert "vmul" in {i.MNEMONIC for i in program.instrs} and "vpow" not in {i.MNEMONIC for i in program.instrs}
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 40)) * 10.0 ** rng.integers(-25, 25, (6, 40))).astype(np.float32)
    x[0, :4] = [np.inf, -np.inf, 3e38, -0.0]
    got = run(program, TINY, {"x": x}).outputs["y"]
    np.testing.assert_array_equal(got.view(np.uint32), onnx_reference(path, {"x": x})["y"].view(np.uint32))


@pytest.mark.parametrize("mask_shape", [(5, 7), (1, 1, 5, 7), (2, 1, 5, 7), (1, 3, 5, 1)])
def test_a_mask_repeated_over_heads_fuses_with_its_softmax(tmp_path, mask_shape):
    """Scores [2, 3, 5, 7] scaled, plus a mask that repeats along leading dimensions, then
    Softmax: one kernel, the mask read in the frame's own shape (a zero stride where it
    repeats), and onnxruntime's result."""
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Mul", ["s", "scale"], ["ss"]),
             helper.make_node("Add", ["ss", "mask"], ["sm"]),
             helper.make_node("Softmax", ["sm"], ["p"], axis=-1)]
    mask = np.where(rng.random(mask_shape) < 0.3, -1e4, 0).astype(np.float32)
    path = _model(tmp_path / "m.onnx", nodes, [helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 3, 5, 7])],
                  [helper.make_tensor_value_info("p", TensorProto.FLOAT, [2, 3, 5, 7])],
                  [("scale", np.array(0.125, np.float32)), ("mask", mask)])
    graph, _, rows = _check(path)
    assert all(r.ok for r in rows), rows
    assert [n.op for n in graph.nodes] == ["RowKernel"]


def test_check_all_compares_intermediates(tmp_path):
    model = _bitlinear(tmp_path / "b.onnx", seq=7)
    r = dlegion_cc(model, "-o", tmp_path / "b.s", "--arch", "dlegion-tiny")
    assert r.returncode == 0, r.stderr
    code = "import sys; from runtime.cli import main; main()"
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "b.s"), "--check", str(model), "--check-all"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "intermediates: all" in r.stdout and "within tolerance" in r.stdout


def test_intermediates_skip_values_the_compiler_made():
    """The 4-bit model's per-row activation quantization makes values onnxruntime does not
    know (as do the grouped-heads and rotary passes): the intermediate check compares the
    model's own values and leaves those out, instead of failing on them."""
    from runtime.intermediates import compare_intermediates
    model = ROOT / "models" / "llama_tiny_nbits4.onnx"
    graph, program = compile_model(model, Options(TINY, {"sequence": 5}))
    inputs = random_inputs(program, 0)
    made = {t.io_name for t in program.tensors if t.kind == "scratch" and t.io_name}
    known = {o for n in onnx.load(model).graph.node for o in n.output}
    assert made - known                     # there are such values
    rows = compare_intermediates(model, inputs, run(program, TINY, inputs), tol=3e-2)
    assert rows and {r.name for r in rows} <= known


def test_inputs_bind_symbolic_dimensions(tmp_path):
    model = _bitlinear(tmp_path / "b.onnx")
    np.savez(tmp_path / "in.npz", x=np.zeros((1, 11, 32), np.float32))
    r = dlegion_cc(model, "-o", tmp_path / "b.s", "--inputs", tmp_path / "in.npz", "--arch", "dlegion-tiny")
    assert r.returncode == 0, r.stderr
    [x] = [t for t in load(tmp_path / "b.s").tensors if t.kind == "input"]
    assert x.shape == (1, 11, 32)


def test_blocks_never_exceed_what_one_instruction_can_name(tmp_path):
    # 153,600 contiguous elements coalesce into one row; ws-64's 1 MiB vector scratchpad would
    # hold it whole, but rows, columns and strides are 16-bit fields.
    nodes = [helper.make_node("Add", ["x", "x"], ["y"])]
    shape = [1, 300, 512]
    path = _model(tmp_path / "a.onnx", nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    _, program, rows = _check(path, arch.load("ws-64"))
    assert all(r.ok for r in rows)
    assert all(getattr(i, "cols", 0) < 1 << 16 for i in program.instrs)


@pytest.mark.parametrize("merged_is_output", [False, True])
def test_heads_merged_after_pv_are_written_in_place(tmp_path, merged_is_output):
    """o = P.V [1, H, S, d] -> Transpose -> Reshape [1, S, H*d]: the matmul stores its blocks where
    the merge puts them, and no copy runs; unless the merged value is a graph output (a tensor of
    its own, which the merge then fills)."""
    S, D, H = 8, 16, 2
    nodes = [helper.make_node("Reshape", ["x", "shp"], ["x4"]),
             helper.make_node("Transpose", ["x4"], ["q"], perm=[0, 2, 1, 3]),
             helper.make_node("Transpose", ["x4"], ["kt"], perm=[0, 2, 3, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["sc"]),
             helper.make_node("Softmax", ["sc"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "q"], ["o"]),
             helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["ot", "flat"], ["om"])]
    out = "om" if merged_is_output else "y"
    if not merged_is_output:
        nodes.append(helper.make_node("Add", ["om", "x"], ["y"]))
    inits = [("shp", np.array([1, S, H, D // H], np.int64)), ("flat", np.array([1, S, D], np.int64))]
    path = _model(tmp_path / "heads.onnx", nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, S, D])],
                  [helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, S, D])], inits)
    _, program, rows = _check(path)
    assert rows and all(r.ok for r in rows), rows
    copies = [i for i in program.instrs if i.MNEMONIC == "vmov"]
    assert bool(copies) == merged_is_output


def test_a_kernel_output_transposed_in_its_last_two_axes_and_merged_stays_exact(tmp_path):
    """A row kernel's output read through a transpose of its last two axes and a merge that
    strides cannot say: in place it would need columns of stride > 1, which no writer stores
    (``Lowering.through_views`` asks for rows of consecutive elements); the result is
    onnxruntime's."""
    nodes = [helper.make_node("Mul", ["x", "two"], ["m"]),
             helper.make_node("Add", ["m", "x"], ["k"]),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("Reshape", ["kt", "flat"], ["kf"]),
             helper.make_node("Mul", ["kf", "kf"], ["y"])]
    inits = [("two", np.array(2, np.float32)), ("flat", np.array([1, 2, 48], np.int64))]
    path = _model(tmp_path / "t.onnx", nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 6, 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 48])], inits)
    _, _, rows = _check(path)
    assert rows and all(r.ok for r in rows), rows
