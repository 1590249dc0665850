"""Hostile and odd inputs (found by fuzzing): each is one line `NAME: error: ...` naming the file,
exit status 2, no traceback, nothing written; none blocks or reads for ever."""
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from isa import arch, asm, encoding

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
TINY = (Path(arch.__file__).parent / "presets" / "dlegion-tiny.toml").read_text()
BIG = "9" * 5000        # past int()'s 4,300 digits
MAINS = {"dlegion-cc": "dlegion_cc.cli:main", "dlegion-run": "runtime.cli:main", "dlegion-as": "isa.cli:assemble_main",
         "dlegion-dis": "isa.cli:disassemble_main", "dlegion-arch": "isa.cli:arch_main",
         "dlegion-dse": "dlegion_cc.dse:main"}
needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")


@pytest.fixture
def run(monkeypatch, capsys):
    """Run a console script in this process: (exit status, stderr lines)."""
    def go(name, *args):
        module, _, func = MAINS[name].partition(":")
        monkeypatch.setattr(sys, "argv", [name, *map(str, args)])
        capsys.readouterr()
        try:
            getattr(importlib.import_module(module), func)()
            status = 0
        except SystemExit as e:
            status = e.code
        return status, capsys.readouterr().err.splitlines()
    return go


def run_apart(name, *args, timeout=120):
    """Run a console script in a process of its own, args as bytes (a path need not be UTF-8),
    with a timeout: a read that never ends fails the test instead of hanging it."""
    module, _, func = MAINS[name].partition(":")
    code = f"import sys; sys.argv[0] = {name!r}; from {module} import {func}; {func}()"
    argv = [os.fsencode(a) if isinstance(a, (str, Path)) else a for a in args]
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, timeout=timeout)
    return r.returncode, r.stderr.decode("utf-8", "replace").splitlines()


def refused(result, name, *parts):
    """The run failed with one error line (then at most a parse error's indented context)."""
    status, lines = result
    assert status == 2, lines
    assert lines and lines[0].startswith(f"{name}: error: "), lines
    assert all(line.startswith(" ") for line in lines[1:]), lines
    assert not any("Traceback" in line for line in lines)
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def listing(folder):
    return sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*"))


@pytest.fixture
def prog(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("matmul_w8.s", "matmul_w8.s.data"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    return tmp_path / "matmul_w8.s"


def _model(path, nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    path.write_bytes(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString())
    return path


def _vi(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


# --- 1. integers past int()'s 4,300 digits ------------------------------------------------------

@pytest.mark.parametrize("old, new", [
    ("rows=16 cols=32", f"rows={BIG} cols=32"),                 # an instruction's field
    ("i8[16,32]", f"i8[{BIG},32]"),                             # a tensor's shape
    ("const 0", f"const {BIG}"),                                # a data-file offset
    ("L0 {0} act", f"L0 {{{BIG}}} act"),                        # a Legion set
    ("wait=L0.dma>=2", f"wait=L0.dma>={BIG}"),                  # a wait's count
    ("dma.ld L0 {0} act[0,32,1]", f"dma.ld  L{BIG} {{0}} act[0,32,1]"),     # a Legion, read by Lark
])
def test_a_number_too_long_in_program_text_is_out_of_range(prog, run, old, new):
    prog.write_text(prog.read_text().replace(old, new, 1))
    before = listing(prog.parent)
    refused(run("dlegion-as", prog), "dlegion-as", "matmul_w8.s:", "5000 digits is out of range")
    assert listing(prog.parent) == before


def _binary_with(prog, old: bytes, new: bytes) -> Path:
    """The example assembled, one text of its JSON header replaced."""
    body = encoding.encode_program(asm.load(prog))
    _, version, reserved, n = encoding.PREFIX.unpack_from(body)
    start = encoding.PREFIX.size + n
    head, words = body[encoding.PREFIX.size:start], body[start + -start % encoding.WORD_BYTES:]
    assert old in head
    head = head.replace(old, new, 1)
    out = encoding.PREFIX.pack(encoding.MAGIC, version, reserved, len(head)) + head
    path = prog.parent / "big.bin"
    path.write_bytes(out + bytes(-len(out) % encoding.WORD_BYTES) + words)
    return path


@pytest.mark.parametrize("old", [b'"instructions":5', b'"offset":0'])
def test_a_number_too_long_in_a_binary_header_is_refused(prog, run, old):
    path = _binary_with(prog, old, old.split(b":")[0] + b":" + BIG.encode())
    refused(run("dlegion-dis", path), "dlegion-dis", "big.bin: corrupt header (a number out of range)")


@pytest.mark.parametrize("old, new, message", [
    ("legions = 2", f"legions = {BIG}", "a number out of range"),
    ("legions = 2", "legions = 0x" + "f" * 5000, "legions is out of range"),
    ("array = 8", "array = 0x" + "f" * 5000, "array is out of range"),
])
def test_a_number_too_long_in_a_machine_file_is_refused(tmp_path, run, old, new, message):
    (tmp_path / "m.toml").write_text(TINY.replace(old, new))
    refused(run("dlegion-arch", tmp_path / "m.toml"), "dlegion-arch", "m.toml", message)


@pytest.mark.parametrize("dim", [f"sequence={BIG}", "sequence=\u00b2", f"sequence={1 << 63}"])
def test_a_dim_too_long_or_not_ascii_is_refused(tmp_path, run, dim):
    out = tmp_path / "out" / "p.s"
    refused(run("dlegion-cc", ROOT / "models" / "bitnet_tiny_gqa.onnx", "-o", out, "--dim", dim),
            "dlegion-cc", "--dim", "is not NAME=SIZE")
    assert listing(tmp_path) == []


@pytest.mark.parametrize("option", ["--legions", "--cores", "--array"])
def test_a_sweep_size_too_long_is_refused(tmp_path, run, option):
    refused(run("dlegion-dse", ROOT / "models" / "bitnet_tiny_relu2.onnx", option, BIG, "--out", tmp_path / "d"),
            "dlegion-dse", option, "positive integers")
    assert listing(tmp_path) == []


# --- 2. malformed external-data fields ----------------------------------------------------------

@pytest.mark.parametrize("key, value, message", [
    ("offset", "-5", "offset '-5' is not a non-negative integer"),
    ("length", "-5", "length '-5' is not a non-negative integer"),
    ("offset", "abc", "offset 'abc' is not a non-negative integer"),
    ("length", "1e3", "length '1e3' is not a non-negative integer"),
    ("offset", BIG, "is not a non-negative integer"),
    ("location", "w\0.bin", "bad location"),
])
def test_a_malformed_external_data_field_is_one_line(tmp_path, run, key, value, message):
    (tmp_path / "w.bin").write_bytes(np.ones((64, 64), np.float32).tobytes())
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[64, 64], data_location=TensorProto.EXTERNAL)
    for k, v in {"location": "w.bin", key: value}.items():
        w.external_data.add(key=k, value=v)
    model = _model(tmp_path / "m.onnx", [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
                   [_vi("x", [1, 64])], [_vi("y", [1, 64])], [w])
    before = listing(tmp_path)
    refused(run("dlegion-cc", model, "-o", tmp_path / "out" / "p.s", "--arch", "dlegion-tiny"),
            "dlegion-cc", "m.onnx: external data of tensor 'w'", message)
    assert listing(tmp_path) == before


# --- 3. data files and inputs that are not regular files in their place ------------------------

@pytest.mark.parametrize("data", ["../../../../etc/passwd", "/dev/zero", "zero.data"])
@pytest.mark.parametrize("name", ["dlegion-as", "dlegion-run"])
def test_a_program_reads_data_only_from_a_file_in_its_folder(prog, data, name):
    os.symlink("/dev/zero", prog.parent / "zero.data")        # a link out of the folder
    prog.write_text(prog.read_text().replace('"matmul_w8.s.data"', f'"{data}"'))
    before = listing(prog.parent)
    refused(run_apart(name, prog, *(["-q"] if name == "dlegion-run" else [])),
            name, f'matmul_w8.s: .data "{data}" must name a file in the program\'s folder')
    assert listing(prog.parent) == before


def test_assembling_to_another_folder_refuses_a_data_file_out_of_its_reach(prog, run):
    (prog.parent / "out").mkdir()
    refused(run("dlegion-as", prog, "-o", prog.parent / "out" / "p.bin"), "dlegion-as",
            '.data "../matmul_w8.s.data" must name a file')
    assert listing(prog.parent / "out") == []


@pytest.mark.parametrize("name, args, message", [
    ("dlegion-cc", ["/dev/zero", "-o", "out/p.s"], "/dev/zero: cannot read (a character device, not a regular file)"),
    ("dlegion-as", ["/dev/zero"], "/dev/zero: cannot read the program (a character device"),
    ("dlegion-run", ["matmul_w8.s", "--inputs", "/dev/zero"], "/dev/zero: cannot read the --inputs file (a character"),
    ("dlegion-run", ["matmul_w8.s", "--check", "/dev/zero"], "/dev/zero: cannot read the --check model (a character"),
    ("dlegion-cc", [ROOT / "models" / "bitnet_tiny_relu2.onnx", "-o", "out/p.s", "--arch", "zero.toml"],
     "zero.toml: cannot read architecture file (a character device"),
])
def test_a_device_as_input_is_refused(prog, name, args, message):
    os.symlink("/dev/zero", prog.parent / "zero.toml")
    before = listing(prog.parent)
    refused(run_apart(name, *args), name, message)
    assert listing(prog.parent) == before


@needs_fifo
@pytest.mark.parametrize("name, args", [
    ("dlegion-cc", ["fifo", "-o", "out/p.s"]),
    ("dlegion-as", ["fifo"]),
    ("dlegion-run", ["matmul_w8.s", "--inputs", "fifo"]),
    ("dlegion-run", ["matmul_w8.s", "--check", "fifo"]),
    ("dlegion-arch", ["fifo.toml"]),
    ("dlegion-run", ["data_fifo.s"]),
])
def test_a_fifo_as_input_is_refused_at_once(prog, name, args):
    os.mkfifo(prog.parent / "fifo")
    os.symlink("fifo", prog.parent / "fifo.toml")
    (prog.parent / "data_fifo.s").write_text(prog.read_text().replace('"matmul_w8.s.data"', '"fifo"'))
    refused(run_apart(name, *args), name, "a FIFO, not a regular file")


# --- 4. outputs that are not regular files ------------------------------------------------------

@pytest.mark.parametrize("name, args", [
    ("dlegion-as", ["matmul_w8.s", "-o", "null.bin"]),
    ("dlegion-dis", ["matmul_w8.s", "-o", "null.bin"]),
    ("dlegion-cc", [ROOT / "models" / "bitnet_tiny_relu2.onnx", "-o", "null.bin", "--arch", "dlegion-tiny"]),
    ("dlegion-run", ["matmul_w8.s", "--json", "null.bin", "-q"]),
])
def test_a_device_output_is_refused_not_replaced(prog, run, name, args):
    os.symlink(os.devnull, prog.parent / "null.bin")       # a link: the device itself is never at risk
    before = listing(prog.parent)
    refused(run(name, *args), name, "null.bin: a character device, not a regular file")
    assert (prog.parent / "null.bin").is_symlink() and listing(prog.parent) == before


@needs_fifo
def test_a_fifo_output_is_refused_not_replaced(prog, run):
    os.mkfifo(prog.parent / "out.bin")
    refused(run("dlegion-as", prog, "-o", "out.bin"), "dlegion-as", "out.bin: a FIFO, not a regular file")
    assert not (prog.parent / "out.bin").is_file()


# --- 5. paths that are not UTF-8 ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["dlegion-as", "dlegion-dis", "dlegion-run", "dlegion-cc", "dlegion-arch"])
def test_a_path_that_is_not_utf8_is_printed_escaped(tmp_path, name):
    missing = os.fsencode(tmp_path) + (b"/\xff.toml" if name == "dlegion-arch" else b"/\xff.s")
    args = [missing, "-o", os.fsencode(tmp_path) + b"/o.s"] if name == "dlegion-cc" else [missing]
    refused(run_apart(name, *args), name, "\\xff.")


def test_a_program_named_by_bytes_that_are_not_utf8_compiles_and_runs(tmp_path):
    out = os.fsencode(tmp_path) + b"/\xff.bin"
    status, lines = run_apart("dlegion-cc", ROOT / "models" / "bitnet_tiny_relu2.onnx", "-o", out,
                              "--arch", "dlegion-tiny", "--emit", "bin", "-q")
    assert status == 0 and "\\xff.bin: " in lines[-1], lines
    assert (tmp_path / os.fsdecode(b"\xff.bin.data")).is_file()
    status, lines = run_apart("dlegion-run", out, "-q")
    assert status == 0, lines


# --- 6. invalid models that used to compile -----------------------------------------------------

def _invalid_models(tmp_path):
    relu = [helper.make_node("Relu", ["x"], ["a"], name="r"), helper.make_node("Relu", ["a"], ["y"], name="r")]
    shape = numpy_helper.from_array(np.array([4, 4], np.int64), "s")
    rows = numpy_helper.from_array(np.array([1, 7], np.int64), "i")
    return {
        "reshape": (_model(tmp_path / "reshape.onnx", [helper.make_node("Reshape", ["x", "s"], ["y"], name="rs")],
                           [_vi("x", [4, 8])], [_vi("y", [4, 4])], [shape]),
                    "node 'rs' (Reshape): invalid ONNX model: reshapes [4, 8] (32 elements) to [4, 4] (16)"),
        "gather": (_model(tmp_path / "gather.onnx", [helper.make_node("Gather", ["x", "i"], ["y"], name="g")],
                          [_vi("x", [4, 8])], [_vi("y", [2, 8])], [rows]),
                   "node 'g' (Gather): invalid ONNX model: index 7 is outside axis 0 of size 4"),
        "opset": (_model(tmp_path / "opset.onnx", relu[:1], [_vi("x", [4, 8])], [_vi("a", [4, 8])], opset=99),
                  "invalid ONNX model: opset 99 of the default domain"),
        "empty": (_model(tmp_path / "empty.onnx", [], [], []), "the graph has no outputs"),
        "no outputs": (_model(tmp_path / "noout.onnx", relu[:1], [_vi("x", [4, 8])], []), "the graph has no outputs"),
        "duplicate": (_model(tmp_path / "dup.onnx", relu, [_vi("x", [4, 8])], [_vi("y", [4, 8])]),
                      "node 'r' (Relu): invalid ONNX model: a second node of this name"),
        # 2**42 elements: it used to be tiled for hours
        "huge": (_model(tmp_path / "huge.onnx", [helper.make_node("Expand", ["x", "big"], ["e"], name="e"),
                                                 helper.make_node("ReduceSum", ["e", "axes"], ["y"], name="sum",
                                                                  keepdims=0)],
                        [_vi("x", [1, 4])], [_vi("y", [4])],
                        [numpy_helper.from_array(np.array([1 << 20, 1 << 20, 4], np.int64), "big"),
                         numpy_helper.from_array(np.array([0, 1], np.int64), "axes")], opset=18),
                 "node 'e' (Expand): output 'e' float32[1048576,1048576,4] would take 16,384 GiB, more than "
                 "this host's memory"),
    }


@pytest.mark.parametrize("case", ["reshape", "gather", "opset", "empty", "no outputs", "duplicate", "huge"])
def test_an_invalid_model_is_refused_naming_its_node(tmp_path, run, case):
    model, message = _invalid_models(tmp_path)[case]
    out = tmp_path / "out" / "p.s"
    refused(run("dlegion-cc", model, "-o", out, "--arch", "dlegion-tiny", "-q"), "dlegion-cc", model.name, message)
    assert not out.parent.exists()


# --- 7. dlegion-dse's --out, output folders, onnxruntime's log ----------------------------------

def test_dse_refuses_an_empty_out(tmp_path, run, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused(run("dlegion-dse", ROOT / "models" / "bitnet_tiny_relu2.onnx", "--out", ""), "dlegion-dse",
            "an empty path names no file")
    assert listing(tmp_path) == []


def test_no_output_folder_is_made_for_a_refused_model(tmp_path, run):
    model, _ = _invalid_models(tmp_path)["reshape"]
    refused(run("dlegion-dse", model, "--out", tmp_path / "new" / "d", "--jobs", "1"), "dlegion-dse")
    refused(run("dlegion-cc", model, "-o", tmp_path / "new" / "p.s"), "dlegion-cc")
    assert not (tmp_path / "new").exists()


FAILING_INFERENCE = """
import logging, sys
from onnxruntime.tools import symbolic_shape_infer

def failing(model, **kwargs):
    logging.getLogger(symbolic_shape_infer.__name__).warning("Potential unsafe merge")
    raise AssertionError        # as onnxruntime's own asserts fail: without a message

symbolic_shape_infer.SymbolicShapeInference.infer_shapes = staticmethod(failing)
sys.argv[0] = "dlegion-cc"
from dlegion_cc.cli import main
main()
"""


def test_onnxruntime_logs_nothing_before_the_error(tmp_path):
    """A contrib-op model goes through onnxruntime's shape inference, which logs warnings to
    stderr through Python's logging; a failure of it is the one line, alone."""
    model = ROOT / "models" / "llama_tiny_nbits4.onnx"
    r = subprocess.run([sys.executable, "-c", FAILING_INFERENCE, model, "-o", tmp_path / "p.s", "-q"],
                       capture_output=True, text=True, timeout=120)
    refused((r.returncode, r.stderr.splitlines()), "dlegion-cc", "shape inference failed: AssertionError")
    assert not (tmp_path / "p.s").exists()


# --- 8. NaN and infinity in weights ---------------------------------------------------------------

def _poisoned(tmp_path, weight, index, value):
    """The tiny BitNet with one weight element set to ``value``."""
    import onnx
    m = onnx.load(ROOT / "models" / "bitnet_tiny_relu2.onnx")
    t = next(t for t in m.graph.initializer if t.name == weight)
    a = numpy_helper.to_array(t).copy()
    a[index] = value
    t.CopyFrom(numpy_helper.from_array(a, t.name))
    path = tmp_path / "poisoned.onnx"
    onnx.save(m, path)
    return path


@pytest.mark.parametrize("weight, index, value", [
    ("model.embed_tokens.weight", (5, 3), np.nan),                       # token 5's row: its keys and values
    ("model.layers.0.self_attn.k_proj.weight_t", (5, 3), np.nan),        # every key
    ("model.layers.1.self_attn.v_proj.weight_t", (7, 1), np.inf),        # every value
])
def test_a_nan_or_inf_weight_spreads_as_onnx_says(tmp_path, weight, index, value):
    """The causal skip leaves out products with a masked score or a zero of P; a NaN or an
    infinity there is NaN in every row onnxruntime computes, so nothing is skipped then."""
    import onnxruntime as ort
    from dlegion_cc.pipeline import Options, compile_model
    from runtime.emulator import run as emulate
    model = _poisoned(tmp_path, weight, index, value)
    tiny = arch.load("dlegion-tiny")
    _, program = compile_model(model, Options(tiny))
    ids = {"input_ids": np.arange(1, 9, dtype=np.int64).reshape(1, 8)}
    ours = emulate(program, tiny, ids).outputs["logits"]
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(["logits"], ids)[0]
    assert np.isnan(want).any()
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(want))
    clean = compile_model(ROOT / "models" / "bitnet_tiny_relu2.onnx", Options(tiny, attention="fp32"))[1]
    assert program.skipped.get("causal_skipped_macs", 0) < clean.skipped["causal_skipped_macs"]


def test_finite_weights_still_skip_causal_blocks():
    from dlegion_cc.pipeline import Options, compile_model
    _, program = compile_model(ROOT / "models" / "bitnet_tiny_relu2.onnx", Options(arch.load("dlegion-tiny"), attention="fp32"))
    assert program.skipped.get("causal_skipped_macs", 0) > 0


# --- 9. bool inputs -----------------------------------------------------------------------------

def _bool_model(tmp_path):
    nodes = [helper.make_node("Where", ["b", "x", "z"], ["y"], name="w"), helper.make_node("Not", ["b"], ["nb"], name="n")]
    return _model(tmp_path / "where.onnx", nodes,
                  [_vi("x", [4, 8]), _vi("b", [4, 8], TensorProto.BOOL), _vi("z", [4, 8])],
                  [_vi("y", [4, 8]), _vi("nb", [4, 8], TensorProto.BOOL)])


def test_a_bool_input_runs_checked_with_random_or_given_values(tmp_path, run):
    """A bool input is u8 in the program (0 or 1): random values are 0 or 1, and --inputs may
    give it as bool; onnxruntime gets bools either way."""
    model, prog = _bool_model(tmp_path), tmp_path / "p.s"
    assert run("dlegion-cc", model, "-o", prog, "--arch", "dlegion-tiny", "-q")[0] == 0
    assert '.tensor b u8[4,8] input "b" range 0 2' in prog.read_text()
    assert run("dlegion-run", prog, "-q", "--check", model) == (0, [])
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "in.npz", x=rng.standard_normal((4, 8)).astype(np.float32), b=rng.random((4, 8)) < 0.5,
             z=np.zeros((4, 8), np.float32))
    status, _ = run("dlegion-run", prog, "-q", "--inputs", tmp_path / "in.npz", "--check", model,
                    "--out", tmp_path / "out.npz")
    assert status == 0
    with np.load(tmp_path / "in.npz") as given, np.load(tmp_path / "out.npz") as got:
        np.testing.assert_array_equal(got["nb"], ~given["b"])


# --- 10. machine numbers the model cannot compute with --------------------------------------------

@pytest.mark.parametrize("old, new, message", [
    ("dram_gbps = 64.0", "dram_gbps = 5e-324", "dram_gbps must be between 1e-06 and 1e+06, not 5e-324"),
    ("clock_ghz = 1.0", "clock_ghz = 5e-324", "clock_ghz must be between"),
    ("clock_ghz = 1.0", "clock_ghz = 1e300", "clock_ghz must be between"),
    ("noc_link_gbps = 32.0", "noc_link_gbps = 1e-5", "noc_link_gbps / clock_ghz is 1e-05 bytes per cycle"),
    ("clock_ghz = 1.0", "clock_ghz = 1e5", "dram_gbps / clock_ghz is 0.00064 bytes per cycle"),
    ("static_watts = 0.008", "static_watts = 1e300", "static_watts must be 0 or between"),
    ("pj_per_dram_byte = 243.75", "pj_per_dram_byte = 1e308", "pj_per_dram_byte must be 0 or between"),
])
def test_a_machine_number_past_what_the_model_computes_with_is_refused(prog, run, old, new, message):
    """A subnormal clock or bandwidth made cycles overflow (a traceback), a false deadlock or
    'inf us'; an energy near the float maximum 'inf J' and 'nan W'."""
    assert old in TINY
    (prog.parent / "m.toml").write_text(TINY.replace(old, new))
    before = listing(prog.parent)
    refused(run("dlegion-run", prog, "--arch", "m.toml", "-q", "--report", "--json", "r.json"),
            "dlegion-run", "m.toml: ", message)
    assert listing(prog.parent) == before


def test_a_zero_energy_is_still_a_machine(tmp_path, run):
    (tmp_path / "m.toml").write_text(TINY.replace("pj_per_dram_byte = 243.75", "pj_per_dram_byte = 0"))
    assert run("dlegion-arch", tmp_path / "m.toml")[0] == 0


# --- 11. outputs partly written -------------------------------------------------------------------

@pytest.mark.parametrize("old, new, warning", [
    ("rows=16 cols=24", "rows=12 cols=24", "no instruction writes some elements of output tensor(s) y (96 of 384)"),
    ('.tensor y i32[16,24] output "y"', '.tensor y i32[16,24] output "y"\n.tensor z i32[4] output "z"',
     "no instruction writes output tensor(s) z; they stay zero"),
])
def test_an_output_part_no_instruction_writes_is_warned_of(prog, run, old, new, warning):
    prog.write_text(prog.read_text().replace(old, new, 1))
    status, lines = run("dlegion-run", "matmul_w8.s", "-q")
    assert status == 0 and lines == [f"dlegion-run: warning: matmul_w8.s: {warning}" + ("" if "stay" in warning
                                                                                          else "; they stay zero")]


def test_a_wholly_written_output_gets_no_warning(prog, run):
    assert run("dlegion-run", prog, "-q") == (0, [])


# --- 12. '-' -------------------------------------------------------------------------------------

MODEL = ROOT / "models" / "bitnet_tiny_relu2.onnx"


@pytest.mark.parametrize("name, args", [
    ("dlegion-as", ["-"]), ("dlegion-as", ["matmul_w8.s", "-o", "-"]), ("dlegion-dis", ["-"]),
    ("dlegion-run", ["-"]), ("dlegion-run", ["matmul_w8.s", "--out", "-"]),
    ("dlegion-run", ["matmul_w8.s", "--json", "-"]), ("dlegion-run", ["matmul_w8.s", "--trace", "-"]),
    ("dlegion-run", ["matmul_w8.s", "--inputs", "-"]), ("dlegion-run", ["matmul_w8.s", "--check", "-"]),
    ("dlegion-run", ["matmul_w8.s", "--arch", "-"]), ("dlegion-cc", ["-", "-o", "p.s"]),
    ("dlegion-cc", [MODEL, "-o", "-"]), ("dlegion-cc", [MODEL, "-o", "p.s", "--arch", "-"]),
    ("dlegion-dse", ["-"]), ("dlegion-dse", [MODEL, "--out", "-"]), ("dlegion-dse", [MODEL, "--preset", "-"]),
    ("dlegion-arch", ["-"]),
])
def test_a_dash_where_no_stream_is_read_or_written_is_refused(prog, run, name, args):
    """'-' is not read or written as a file of that name (dlegion-cc -o - wrote './-' and './-.data')."""
    before = listing(prog.parent)
    refused(run(name, *args), name, "'-' (standard input or output) is not taken here")
    assert listing(prog.parent) == before


def test_disassembling_to_dash_prints_the_program(prog):
    from click.testing import CliRunner
    from isa.cli import disassemble_main
    before = listing(prog.parent)
    result = CliRunner().invoke(disassemble_main, [str(prog), "-o", "-"])
    assert result.exit_code == 0 and result.stdout == asm.format_program(asm.load(prog, read_data=False))
    assert listing(prog.parent) == before
