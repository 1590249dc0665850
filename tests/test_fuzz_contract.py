"""The exit-status contract under fuzzing: mutations of the committed examples and models (assembly
text, binaries, ONNX models, machine files) given to every command end with exit status 0, 1 or 2,
never a traceback, and nothing written when the status is not 0.

Each command runs in this process (an exception escaping ``main`` is the traceback a user would
see, and fails the test). The budget is bounded (``max_examples``) so the file stays a few
seconds' work in CI.
"""
import contextlib
import importlib
import io
import shutil
import sys
import tempfile
from pathlib import Path

import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper

from isa import arch, asm, encoding

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
MODELS = ROOT / "models"
TINY = (Path(arch.__file__).parent / "presets" / "dlegion-tiny.toml").read_text()
MAINS = {"dlegion-cc": "dlegion_cc.cli:main", "dlegion-run": "runtime.cli:main", "dlegion-as": "isa.cli:assemble_main",
         "dlegion-dis": "isa.cli:disassemble_main", "dlegion-arch": "isa.cli:arch_main"}
def fuzz(examples: int):
    """Bounded, reproducible runs (the same examples on every machine), no time limit per example."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def invoke(name: str, *args) -> tuple[int, str]:
    """(exit status, stderr) of a console script run in this process."""
    module, _, func = MAINS[name].partition(":")
    err, out = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = [name, *map(str, args)]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            getattr(importlib.import_module(module), func)()
        status = 0
    except SystemExit as e:
        status = e.code
    finally:
        sys.argv = argv
    return status, err.getvalue()


def holds(result, outputs, statuses=(0, 2)) -> None:
    """The contract: an allowed status, no traceback, an error as one `NAME: error:` line, and
    no output left behind by a failed run."""
    status, err = result
    assert status in statuses, err
    assert "Traceback" not in err, err
    if status != 0:
        errors = [line for line in err.splitlines() if ": error: " in line]
        assert errors, err
        for path in outputs:
            assert not Path(path).exists(), f"{path} written by a run that failed: {err}"


@contextlib.contextmanager
def folder():
    """A fresh folder holding the examples (hypothesis runs many examples per test function)."""
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        for f in EXAMPLES.iterdir():
            if f.suffix in (".s", ".data"):
                shutil.copy(f, d / f.name)
        yield d


# --- mutations ---------------------------------------------------------------------------------

# What a mutation inserts: numbers at and past every limit, the grammar's own punctuation and words.
TOKENS = ["0", "1", "-1", "255", "65535", "65536", "4294967296", "9" * 30, "1e309", "nan", "-inf", "0.5",
          "L0", "L63", "L99", "{0}", "{0-63}", "vec", "act", "wgt", "acc", "@x", "@y", "[", "]", ",", "=", ">=",
          "~1", "rows=", "cols=", "wait=", "span=", "lstride=", "\n", " ", ";", '"', "\x00", "\u00ff", "é",
          ".tensor", ".arch", ".data", "f32", "i8", "w2", "input", "output", "const", "range", "dlegion-tiny"]


@st.composite
def edits(draw, text: str, tokens=TOKENS):
    """``text`` after a few random insertions, deletions, replacements and line duplications."""
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        end = min(len(text), at + draw(st.integers(0, 12)))
        kind = draw(st.sampled_from(["insert", "delete", "replace", "line"]))
        token = draw(st.sampled_from(tokens) | st.text(max_size=4))
        if kind == "insert":
            text = text[:at] + token + text[at:]
        elif kind == "delete":
            text = text[:at] + text[end:]
        elif kind == "replace":
            text = text[:at] + token + text[end:]
        else:
            lines = text.split("\n")
            i = draw(st.integers(0, len(lines) - 1))
            lines.insert(i, lines[draw(st.integers(0, len(lines) - 1))])
            text = "\n".join(lines)
    return text


@st.composite
def byte_edits(draw, body: bytes):
    """``body`` with a few bytes overwritten, a piece cut out or the end cut off."""
    body = bytearray(body)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["set", "cut", "truncate"]))
        at = draw(st.integers(0, max(0, len(body) - 1)))
        if kind == "set" and body:
            body[at] = draw(st.integers(0, 255))
        elif kind == "cut":
            del body[at:at + draw(st.integers(1, 16))]
        else:
            del body[at:]
    return bytes(body)


PROGRAMS = ["matmul_w8.s", "matmul_w2_multicast.s", "softmax.s"]


@fuzz(60)
@given(st.data())
def test_mutated_assembly_text(data):
    name = data.draw(st.sampled_from(PROGRAMS))
    with folder() as d:
        text = data.draw(edits((d / name).read_text()))
        (d / "p.s").write_text(text, encoding="utf-8", errors="surrogateescape")
        out = d / "out" / "p.bin"
        holds(invoke("dlegion-as", d / "p.s", "-o", out), [out])
        text_out = d / "out" / "p2.s"
        holds(invoke("dlegion-dis", d / "p.s", "-o", text_out), [text_out])


@fuzz(15)
@given(st.data())
def test_mutated_assembly_runs(data):
    """The emulator and timing model on what assembles: a fault is exit 2, never a traceback."""
    name = data.draw(st.sampled_from(PROGRAMS))
    with folder() as d:
        text = data.draw(edits((d / name).read_text(), [t for t in TOKENS if t.isdigit() or t in ("L0", "L1")]))
        (d / "p.s").write_text(text)
        out = d / "r.json"
        holds(invoke("dlegion-run", d / "p.s", "-q", "--json", out), [out])


def _binary(d: Path, name: str) -> bytes:
    return encoding.encode_program(asm.load(d / name))


@fuzz(60)
@given(st.data())
def test_mutated_binaries(data):
    name = data.draw(st.sampled_from(PROGRAMS))
    with folder() as d:
        (d / "p.bin").write_bytes(data.draw(byte_edits(_binary(d, name))))
        out = d / "out" / "p.s"
        holds(invoke("dlegion-dis", d / "p.bin", "-o", out), [out])
        again = d / "out" / "p2.bin"
        holds(invoke("dlegion-as", d / "p.bin", "-o", again), [again])


MACHINE_VALUES = ["0", "-1", "1", "5e-324", "1e-300", "1e300", "1.7976931348623157e308", "inf", "nan", "true",
                  '"x"', "[]", "{}", "3", "7", "64", "65", "1e6", "1e-6", "0x" + "f" * 40, "9" * 40]


@st.composite
def machine_files(draw):
    """The tiny preset with some values replaced, lines dropped or repeated, or text edits."""
    lines = TINY.split("\n")
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(lines) - 1))
        kind = draw(st.sampled_from(["value", "value", "drop", "repeat"]))
        if kind == "value" and "=" in lines[i]:
            lines[i] = lines[i].split("=")[0] + "= " + draw(st.sampled_from(MACHINE_VALUES))
        elif kind == "drop":
            del lines[i]
        elif kind == "repeat":
            lines.insert(i, lines[i])
    text = "\n".join(lines)
    return draw(edits(text)) if draw(st.booleans()) else text


@fuzz(40)
@given(machine_files())
def test_mutated_machine_files(text):
    with folder() as d:
        (d / "m.toml").write_text(text)
        holds(invoke("dlegion-arch", d / "m.toml"), [])
        out = d / "out" / "r.json"
        holds(invoke("dlegion-run", d / "matmul_w8.s", "--arch", d / "m.toml", "-q", "--report", "--json", out),
              [out])


# --- models ------------------------------------------------------------------------------------

def _small_model() -> onnx.ModelProto:
    """A few nodes of every kind the compiler lowers differently: a float matmul, row ops, a softmax."""
    import numpy as np
    from onnx import TensorProto, numpy_helper
    w = numpy_helper.from_array(np.linspace(-1, 1, 16 * 8, dtype=np.float32).reshape(16, 8), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Softmax", ["r"], ["y"], name="sm", axis=-1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


OPS = ["Relu", "Add", "Mul", "MatMul", "Softmax", "Reshape", "Transpose", "Gather", "Cast", "Sqrt", "Unknown"]


@st.composite
def model_edits(draw, model: onnx.ModelProto):
    """``model`` with a node's op, an input name, an attribute, a shape or an initializer changed."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["op", "input", "attr", "dim", "init", "drop"]))
        node = g.node[draw(st.integers(0, len(g.node) - 1))] if len(g.node) else None
        if kind == "op" and node is not None:
            node.op_type = draw(st.sampled_from(OPS))
        elif kind == "input" and node is not None and node.input:
            names = [v.name for v in g.input] + [t.name for t in g.initializer] + [o for n in g.node for o in n.output]
            node.input[draw(st.integers(0, len(node.input) - 1))] = draw(st.sampled_from(names + ["", "nowhere"]))
        elif kind == "attr" and node is not None:
            del node.attribute[:]
            node.attribute.append(helper.make_attribute(draw(st.sampled_from(["axis", "perm", "to", "alpha"])),
                                                        draw(st.sampled_from([-3, 0, 1, 7, [1, 0], [2, 0, 1]]))))
        elif kind == "dim":
            value = draw(st.sampled_from(list(g.input) + list(g.output)))
            dims = value.type.tensor_type.shape.dim
            if dims:
                dims[draw(st.integers(0, len(dims) - 1))].dim_value = draw(st.sampled_from([0, 1, 3, 64, 1 << 40]))
        elif kind == "init" and g.initializer:
            t = g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
            if t.dims:
                t.dims[0] = draw(st.sampled_from([0, 1, 2, 1 << 20]))
        elif kind == "drop" and node is not None:
            g.node.remove(node)
    return m


def _compile_holds(body: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        (d / "m.onnx").write_bytes(body)
        out = d / "out" / "p.s"
        holds(invoke("dlegion-cc", d / "m.onnx", "-o", out, "--arch", "dlegion-tiny", "-q"),
              [out, Path(str(out) + ".data")])


@fuzz(40)
@given(st.data())
def test_mutated_small_models(data):
    model = data.draw(model_edits(_small_model()))
    _compile_holds(model.SerializeToString())


BITNET = MODELS / "bitnet_tiny_relu2.onnx"


@fuzz(8)
@given(st.data())
def test_mutated_bitnet(data):
    """The committed tiny BitNet: one structural edit (most fail fast in the checker)."""
    model = data.draw(model_edits(onnx.load(BITNET)))
    _compile_holds(model.SerializeToString())


@fuzz(20)
@given(st.data())
def test_mutated_model_bytes(data):
    _compile_holds(data.draw(byte_edits(_small_model().SerializeToString())))


def test_the_unmutated_inputs_pass():
    """The fuzzers start from inputs every command takes (a contract that refused all would hold)."""
    with folder() as d:
        for name in PROGRAMS:
            assert invoke("dlegion-as", d / name, "-o", d / (name + ".bin"))[0] == 0
        (d / "m.toml").write_text(TINY)
        assert invoke("dlegion-run", d / "matmul_w8.s", "--arch", d / "m.toml", "-q")[0] == 0
        (d / "m.onnx").write_bytes(_small_model().SerializeToString())
        assert invoke("dlegion-cc", d / "m.onnx", "-o", d / "p.s", "--arch", "dlegion-tiny", "-q")[0] == 0
