"""dlegion-cc: bad input is one line naming the culprit, exit status 2, no traceback, and nothing
written; the command line is checked against the model before the long compile."""
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dlegion_cc import cli
from isa import arch
from isa.asm import load

ROOT = Path(__file__).parent.parent
TINY_MODEL = ROOT / "models" / "bitnet_tiny_relu2.onnx"


def _error(result, *names):
    """The single error line of a failed run, checked to name each of ``names``."""
    status, lines = result
    assert status == 2 and len(lines) == 1 and lines[0].startswith("dlegion-cc: error: "), lines
    for name in names:
        assert str(name) in lines[0], lines[0]
    return lines[0]


def _save(path, nodes, inputs, outputs, inits=(), **kwargs):
    g = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(a, n) for n, a in inits])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path), **kwargs)
    return path


def _symbolic(path, **kwargs):
    """x[batch, sequence, 4] @ w[4, 8]."""
    return _save(path, [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", 4])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", 8])],
                 [("w", np.ones((4, 8), np.float32))], **kwargs)


def _square(path, extra, outputs=()):
    """y = x @ w with x[4, 4], plus the nodes ``extra`` reading x; ``outputs`` are more graph outputs."""
    return _save(path, [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), *extra],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8]), *outputs],
                 [("w", np.ones((4, 8), np.float32))])


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return path


# --- 1: tracebacks that were -------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["text", "truncated", "npy", "damaged"])
def test_an_unreadable_inputs_file_is_named(tmp_path, cc, kind):
    model = _symbolic(tmp_path / "sym.onnx")
    good = _npz(tmp_path / "good.npz", x=np.zeros((1, 2, 4), np.float32)).read_bytes()
    bad = tmp_path / "in.npz"
    if kind == "text":
        bad.write_text("hello\n")
    elif kind == "truncated":
        bad.write_bytes(good[:len(good) // 2])
    elif kind == "npy":
        np.save(tmp_path / "a.npy", np.zeros(3))
        bad.write_bytes((tmp_path / "a.npy").read_bytes())
    else:       # the archive's directory intact, the array inside it cut short
        with zipfile.ZipFile(bad, "w") as z:
            z.writestr("x.npy", zipfile.ZipFile(tmp_path / "good.npz").read("x.npy")[:-8])
    _error(cc(model, "-o", tmp_path / "p.s", "--inputs", bad), bad)
    assert not (tmp_path / "p.s").exists()


def test_a_file_that_is_not_onnx_is_named_even_with_inputs(tmp_path, cc):
    model = tmp_path / "notonnx.onnx"
    model.write_text("garbage\n")
    inputs = _npz(tmp_path / "good.npz", x=np.zeros((1, 2, 4), np.float32))
    assert "not an ONNX model" in _error(cc(model, "-o", tmp_path / "p.s", "--inputs", inputs), model)


def test_a_truncated_external_data_file_is_named(tmp_path, cc):
    model = _symbolic(tmp_path / "ext.onnx", save_as_external_data=True, location="ext.onnx.data",
                      size_threshold=0)
    data = tmp_path / "ext.onnx.data"
    data.write_bytes(data.read_bytes()[:10])
    _error(cc(model, "-o", tmp_path / "p.s", "--dim", "batch=1", "--dim", "sequence=2"), model, "ext.onnx.data")
    assert not (tmp_path / "p.s").exists()


def test_a_fractional_legion_count_is_one_line(tmp_path, cc):
    toml = tmp_path / "half.toml"
    toml.write_text((ROOT / "isa" / "presets" / "dlegion-tiny.toml").read_text()
                    .replace("legions = 2\n", "legions = 2.5\n"))
    _error(cc(TINY_MODEL, "-o", tmp_path / "p.s", "--arch", toml), "legions")


# --- 2, 3: arguments checked against the passes and the model -----------------------------------

def test_an_unknown_pass_is_rejected_listing_the_passes(tmp_path, cc):
    _error(cc(TINY_MODEL, "-o", tmp_path / "p.s", "--print-ir-after", "bogus"), "bogus", "legalize", "all")


def test_a_dim_the_model_lacks_is_named_with_those_it_has(tmp_path, cc):
    model = _symbolic(tmp_path / "sym.onnx")
    _error(cc(model, "-o", tmp_path / "p.s", "--dim", "batch=1", "--dim", "sequence=2", "--dim", "nosuchdim=4"),
           "nosuchdim", "batch, sequence")


def test_a_dim_bound_to_two_sizes(tmp_path, cc):
    model = _symbolic(tmp_path / "sym.onnx")
    _error(cc(model, "-o", tmp_path / "p.s", "--dim", "batch=1", "--dim", "sequence=4", "--dim", "sequence=8"),
           "sequence=4", "sequence=8")
    inputs = _npz(tmp_path / "in.npz", x=np.zeros((1, 4, 4), np.float32))
    _error(cc(model, "-o", tmp_path / "p.s", "--inputs", inputs, "--dim", "sequence=8"),
           "sequence=8", "sequence=4", inputs)


def test_inputs_of_another_rank_name_the_input_and_both_shapes(tmp_path, cc):
    model = _symbolic(tmp_path / "sym.onnx")
    inputs = _npz(tmp_path / "in.npz", x=np.zeros((2, 4), np.float32))
    _error(cc(model, "-o", tmp_path / "p.s", "--inputs", inputs), "'x'", "[2, 4]", "[batch, sequence, 4]")
    assert not (tmp_path / "p.s").exists()


# --- 4, 5: outputs checked before the work -----------------------------------------------------

@pytest.mark.parametrize("case", ["model", "model's data", "output's data"])
def test_the_output_never_overwrites_the_model(tmp_path, cc, case):
    if case == "model":
        model = _symbolic(tmp_path / "m.onnx")
        output = model
    elif case == "model's data":
        model = _symbolic(tmp_path / "m.onnx", save_as_external_data=True, location="m.onnx.data",
                          size_threshold=0)
        output = tmp_path / "m.onnx.data"
    else:
        model = _symbolic(tmp_path / "p.s.data")
        output = tmp_path / "p.s"
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    _error(cc(model, "-o", output, "--dim", "batch=1", "--dim", "sequence=2"), output, "overwrite")
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("case", ["folder is a file", "data is a folder", "folder not writable"])
def test_an_unwritable_output_is_found_before_compiling(tmp_path, cc, monkeypatch, case):
    monkeypatch.setattr(cli, "compile_model", lambda *a, **k: pytest.fail("compiled before checking the output"))
    output = tmp_path / "out" / "p.s"
    if case == "folder is a file":
        (tmp_path / "out").write_text("")
        culprit = tmp_path / "out"
    elif case == "data is a folder":
        (tmp_path / "out" / "p.s.data").mkdir(parents=True)
        culprit = tmp_path / "out" / "p.s.data"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes anywhere")
        (tmp_path / "out").mkdir(mode=0o555)
        culprit = tmp_path / "out"
    _error(cc(TINY_MODEL, "-o", output, "--arch", "dlegion-tiny"), culprit)


# --- 6, 8: the model's culprit nodes -------------------------------------------------------------

def test_an_invalid_model_names_the_node(tmp_path, cc):
    model = _square(tmp_path / "m.onnx", [helper.make_node("Relu", ["nope"], ["z"], name="bad_relu")])
    _error(cc(model, "-o", tmp_path / "p.s", "--arch", "dlegion-tiny"), "'nope'", "bad_relu")


def test_unused_nodes_are_dropped_whatever_their_op(tmp_path, cc):
    model = _square(tmp_path / "m.onnx", [helper.make_node("Unique", ["x"], ["u"], name="uniq"),
                                          helper.make_node("Det", ["x"], ["d"], name="det")])
    status, lines = cc(model, "-o", tmp_path / "p.s", "--arch", "dlegion-tiny")
    assert status == 0 and (tmp_path / "p.s").exists(), lines


def test_every_unsupported_node_is_listed_though_one_has_no_static_shape(tmp_path, cc):
    model = _square(tmp_path / "m.onnx", [helper.make_node("Unique", ["x"], ["u"], name="uniq"),
                                          helper.make_node("Det", ["x"], ["d"], name="det")],
                    [helper.make_tensor_value_info("u", TensorProto.FLOAT, ["n"]),
                     helper.make_tensor_value_info("d", TensorProto.FLOAT, [])])
    status, lines = cc(model, "-o", tmp_path / "p.s", "--arch", "dlegion-tiny")
    assert status == 2 and lines == [f"dlegion-cc: error: {model}: node 'uniq' (Unique): operator not supported",
                                     f"{model}: node 'det' (Det): operator not supported"], lines
    assert not (tmp_path / "p.s").exists()


# --- 7: a machine file travels with the program --------------------------------------------------

def test_a_program_for_a_machine_file_runs_from_anywhere(tmp_path, cc):
    toml = tmp_path / "machines" / "my.toml"
    toml.parent.mkdir()
    toml.write_text((ROOT / "isa" / "presets" / "dlegion-tiny.toml").read_text()
                    .replace('name = "dlegion-tiny"', 'name = "my-machine"').replace("legions = 2\n", "legions = 4\n"))
    program = tmp_path / "out" / "p.s"
    status, lines = cc(TINY_MODEL, "-o", program, "--arch", toml)
    assert status == 0, lines
    spec = load(program, read_data=False).arch
    assert spec == "../machines/my.toml"
    machine = arch.load(spec, base=program.parent)
    assert (machine.name, machine.legions) == ("my-machine", 4)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = "import sys; from runtime.cli import main; sys.argv[0] = 'dlegion-run'; main()"
    r = subprocess.run([sys.executable, "-c", code, str(program), "--report"], cwd=elsewhere,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "my-machine" in r.stdout, r.stderr


# --- a machine's description is honored, and a bad one refused, before anything is written -------

def _tiny_toml(path, **changes):
    """dlegion-tiny with 4 Legions (so a matmul could multicast) and ``changes`` (key = value)."""
    text = ((ROOT / "isa" / "presets" / "dlegion-tiny.toml").read_text()
            .replace('name = "dlegion-tiny"', f'name = "{path.stem}"').replace("legions = 2\n", "legions = 4\n"))
    for key, value in changes.items():
        text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
        assert n == 1, key
    path.write_text(text)
    return path


@pytest.mark.parametrize("feature", ["multicast", "parallel_accumulators"])
def test_a_program_for_a_machine_without_a_feature_runs_correctly(tmp_path, cc, feature):
    toml = _tiny_toml(tmp_path / f"no-{feature}.toml", **{feature: "false"})
    program = tmp_path / "p.s"
    status, lines = cc(TINY_MODEL, "-o", program, "--arch", toml)
    assert status == 0, lines
    code = "import sys; from runtime.cli import main; sys.argv[0] = 'dlegion-run'; main()"
    r = subprocess.run([sys.executable, "-c", code, str(program), "--check", str(TINY_MODEL)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_an_array_whose_weight_rows_are_not_whole_bytes_is_one_line(tmp_path, cc):
    toml = _tiny_toml(tmp_path / "a6.toml", array=6)
    assert _error(cc(TINY_MODEL, "-o", tmp_path / "p.s", "--arch", toml), toml).endswith(
        "array 6: a row of 6 w2 weights is 12 bits, not whole bytes")
    assert not (tmp_path / "p.s").exists()


def test_a_float_matmul_too_big_for_vec_says_how_much_it_needs(tmp_path, cc):
    toml = _tiny_toml(tmp_path / "v4.toml", vec_kib=4)
    line = _error(cc(TINY_MODEL, "-o", tmp_path / "p.s", "--arch", toml), "lm_head")
    assert re.search(r"need \d+ vector scratchpad elements, more than its 1024$", line), line


# --- the model: any file name, every node of an unknown domain, the inputs it has ----------------

def test_a_model_named_other_than_onnx_is_read_as_onnx(tmp_path, cc):
    model = tmp_path / "m.json"
    model.write_bytes(TINY_MODEL.read_bytes())
    status, lines = cc(model, "-o", tmp_path / "p.s", "--arch", "dlegion-tiny")
    assert status == 0 and (tmp_path / "p.s").exists(), lines


def test_every_node_of_an_unknown_domain_is_named(tmp_path, cc):
    nodes = [helper.make_node("Foo", ["y"], ["f"], name="foo", domain="my.dom"),
             helper.make_node("Bar", ["f"], ["b"], name="", domain="my.dom"),
             helper.make_node("Baz", ["x"], ["unused"], name="baz", domain="other.dom")]    # dropped, unread
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), *nodes], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                          [helper.make_tensor_value_info("b", TensorProto.FLOAT, [4, 8])],
                          [numpy_helper.from_array(np.ones((4, 8), np.float32), "w")])
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in
                                                  (("", 17), ("my.dom", 1), ("other.dom", 1))]), model)
    status, lines = cc(model, "-o", tmp_path / "p.s", "--arch", "dlegion-tiny")
    assert status == 2 and lines == [
        f"dlegion-cc: error: {model}: node 'foo' (Foo): operator not supported (domain my.dom)",
        f"{model}: node 'Bar_2' (Bar): operator not supported (domain my.dom)"], lines
    assert not (tmp_path / "p.s").exists()


def test_an_inputs_array_the_model_does_not_have_is_named_with_those_it_has(tmp_path, cc):
    model = _symbolic(tmp_path / "sym.onnx")
    inputs = _npz(tmp_path / "in.npz", x=np.zeros((1, 2, 4), np.float32), foo=np.zeros(3))
    _error(cc(model, "-o", tmp_path / "p.s", "--inputs", inputs), inputs, "'foo'", "its inputs: x")
    assert not (tmp_path / "p.s").exists()
    # A model of IR version 3 lists its weights among its inputs too; they are not for --inputs.
    old = _save(tmp_path / "old.onnx", [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
                [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
                 helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 8])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], [("w", np.ones((4, 8), np.float32))])
    inputs = _npz(tmp_path / "in2.npz", x=np.zeros((1, 4), np.float32), w=np.zeros((4, 8), np.float32))
    line = _error(cc(old, "-o", tmp_path / "p.s", "--inputs", inputs), "'w' is not an input")
    assert line.endswith("(its inputs: x)")


def test_a_dim_bound_twice_alike_is_still_a_slip(tmp_path, cc):
    model = _symbolic(tmp_path / "sym.onnx")
    _error(cc(model, "-o", tmp_path / "p.s", "--dim", "batch=1", "--dim", "sequence=8", "--dim", "sequence=8"),
           "'sequence' bound twice")


def test_onnxruntimes_qoperator_format_is_named_with_the_format_that_compiles(tmp_path, cc):
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    rng = np.random.default_rng(0)
    inits = [(name, rng.standard_normal(shape).astype(np.float32)) for name, shape in
             (("w1", (16, 32)), ("b1", (32,)), ("w2", (32, 8)))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"])]
    floats = tmp_path / "mlp.onnx"
    _save(floats, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], inits)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([{"x": rng.standard_normal((4, 16)).astype(np.float32)} for _ in range(2)])

        def get_next(self):
            return next(self.feeds, None)

    for fmt, expected in ((QuantFormat.QOperator, 2), (QuantFormat.QDQ, 0)):
        model = tmp_path / f"{fmt.name}.onnx"
        quantize_static(floats, model, Reader(), quant_format=fmt, weight_type=QuantType.QInt8)
        status, lines = cc(model, "-o", tmp_path / f"{fmt.name}.s", "--arch", "dlegion-tiny")
        assert status == expected, lines
        if expected:
            assert "(QLinearAdd): operator not supported (domain com.microsoft; onnxruntime's QOperator format: " \
                   "quantize with quant_format=QuantFormat.QDQ, which compiles)" in lines[0], lines
