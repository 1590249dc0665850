"""Quantized matmuls' schedules: written by --emit schedule, pinned by --schedule FILE, checked."""
import copy
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from dlegion_cc.lower import schedules
from dlegion_cc.pipeline import Options, compile_model
from isa import arch as arch_mod
from isa.asm import format_program
from isa.instructions import MatMul
from runtime.emulator import random_inputs, run
from runtime.timing import simulate

ROOT = Path(__file__).parent.parent
BITNET = ROOT / "models" / "bitnet_tiny_relu2.onnx"
TINY = arch_mod.load("dlegion-tiny")


def _narrow(path: Path) -> Path:
    """Attention-like int8 products narrower than dlegion-tiny's Legions: the rows are dealt in
    parts, one Legion each; and a constant-weight matmul beside them."""
    nodes = [helper.make_node("MatMulInteger", ["a", "b"], ["y"], name="qk"),
             helper.make_node("MatMulInteger", ["a2", "w"], ["z"], name="proj")]
    inputs = [helper.make_tensor_value_info("a", TP.INT8, [2, 64, 32]),
              helper.make_tensor_value_info("b", TP.INT8, [2, 32, 8]),
              helper.make_tensor_value_info("a2", TP.INT8, [64, 32])]
    outputs = [helper.make_tensor_value_info("y", TP.INT32, [2, 64, 8]),
               helper.make_tensor_value_info("z", TP.INT32, [64, 24])]
    w = numpy_helper.from_array(np.random.default_rng(3).integers(-63, 64, (32, 24)).astype(np.int8), "w")
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, [w]),
                                opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


def _compile(model, pinned: dict | None = None):
    """(program text without its header, the schedules document) compiling ``model`` for
    dlegion-tiny, with ``pinned`` (a schedules document) if given."""
    s = schedules.Schedules()
    if pinned is not None:
        for e in pinned["schedules"]:
            s.pinned.setdefault(e["node"], []).append(e)
        s.source = "pinned.json"
    _, program = compile_model(model, Options(TINY, schedules=s))
    return program, s.document(TINY, Options(TINY).switches())


@pytest.mark.parametrize("which", ["bitnet", "narrow"])
def test_pinning_the_emitted_schedules_reproduces_the_program_and_its_cycles(tmp_path, which):
    model = BITNET if which == "bitnet" else _narrow(tmp_path / "m.onnx")
    searched, doc = _compile(model)
    pinned, again = _compile(model, json.loads(json.dumps(doc)))
    assert again == doc and doc["schedules"]
    assert format_program(pinned) == format_program(searched)
    assert simulate(pinned, TINY).cycles == simulate(searched, TINY).cycles
    if which == "narrow":       # the int8 product's rows in two parts, one Legion each
        assert {(e["node"], e["deal"]["legions_per_part"], e["deal"]["parts"]) for e in doc["schedules"]} >= {("qk", 1, 2)}


def test_a_pinned_schedule_is_the_one_compiled(tmp_path):
    """A chunk depth other than the search's, pinned: the passes are that deep, and the file
    written under the pin predicts that schedule's own cycles."""
    model = _narrow(tmp_path / "m.onnx")
    _, doc = _compile(model)
    e = next(e for e in doc["schedules"] if e["node"] == "proj")
    assert e["chunk"]["depth"] > TINY.array
    e["chunk"] |= {"depth": TINY.array, "whole_rows": False}
    program, again = _compile(model, doc)
    pinned = next(x for x in again["schedules"] if x["node"] == "proj")
    assert pinned["chunk"] == e["chunk"] and pinned["predicted"] != e["predicted"]
    starts = [start for start, _ in program.regions] + [len(program.instrs)]
    entries = [k for k, (_, name) in enumerate(program.regions) if name == "proj"]   # weights loaded early too
    passes = [i for k in entries for i in program.instrs[starts[k]:starts[k + 1]] if isinstance(i, MatMul)]
    assert passes and {i.K for i in passes} == {TINY.array}


def test_a_pinned_deal_cuts_the_rows_and_the_results_stay_exact(tmp_path):
    """The constant-weight matmul's rows in two parts of one Legion each (the search keeps them
    whole): each part's schedule is for its 32 rows and 24 columns a Legion, and every output
    is the searched program's, bit for bit."""
    model = _narrow(tmp_path / "m.onnx")
    searched, doc = _compile(model)
    e = next(e for e in doc["schedules"] if e["node"] == "proj")
    assert (e["deal"]["legions_per_part"], e["deal"]["parts"]) == (TINY.legions, 1)
    e["deal"] |= {"legions_per_part": 1, "parts": 2, "columns_per_legion": 24}
    e["shape"]["M"] = 32
    pinned, again = _compile(model, doc)
    assert [x["deal"] for x in again["schedules"] if x["node"] == "proj"] == [e["deal"]]
    inputs = random_inputs(searched, 1)
    want, got = run(searched, TINY, inputs).outputs, run(pinned, TINY, inputs).outputs
    assert format_program(pinned) != format_program(searched)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_emit_schedule_and_pin_it_on_the_command_line(tmp_path, cc):
    model = _narrow(tmp_path / "m.onnx")
    status, _ = cc(model, "--arch", "dlegion-tiny", "--emit", "schedule", "-o", tmp_path / "s.json", "-q")
    doc = json.loads((tmp_path / "s.json").read_text())
    assert status == 0 and doc["arch"] == "dlegion-tiny" and {e["node"] for e in doc["schedules"]} == {"qk", "proj"}
    assert not (tmp_path / "s.json.data").exists()
    for out, pin in (("a.s", ()), ("b.s", ("--schedule", tmp_path / "s.json"))):
        assert cc(model, "--arch", "dlegion-tiny", "-o", tmp_path / out, "-q", *pin)[0] == 0
    body = lambda name: (tmp_path / name).read_text().split("\n", 2)[2]     # past the .data line
    assert body("a.s") == body("b.s")


def _edited(doc: dict, node: str, edit) -> dict:
    doc = copy.deepcopy(doc)
    edit(next(e for e in doc["schedules"] if e["node"] == node))
    return doc


BAD = [
    (lambda e: e["slots"].update(wgt=10 ** 6), "qk", "schedule 1: it needs"),
    (lambda e: e["tile"].update(cols=3), "proj", "tile cols 3 is not a multiple of the array"),
    (lambda e: e.update(loop_order="diagonal"), "proj", "loop_order 'diagonal' is none of rows, cols"),
    (lambda e: e["shape"].update(M=7), "proj", "it is for a 7x32x24 matmul; the node's is 64x32x24"),
    (lambda e: e["deal"].update(parts=3), "qk", "a deal of 3 part(s) of 1 Legion(s) does not fit"),
    (lambda e: e["deal"].update(columns_per_legion=8), "proj", "columns_per_legion 8: dlegion-tiny deals"),
    (lambda e: e["chunk"].update(depth="deep"), "proj", "'depth' must be a positive integer"),
    (lambda e: e.update(node="nothing"), "proj", "is not a quantized matmul of"),
]


@pytest.mark.parametrize("edit, node, message", BAD)
def test_a_schedule_that_does_not_fit_is_one_line_naming_file_and_node(tmp_path, cc, edit, node, message):
    model = _narrow(tmp_path / "m.onnx")
    _, doc = _compile(model)
    (tmp_path / "bad.json").write_text(json.dumps(_edited(doc, node, edit)))
    status, lines = cc(model, "--arch", "dlegion-tiny", "-o", tmp_path / "p.s", "--schedule", tmp_path / "bad.json")
    assert status == 2 and len(lines) == 1, lines
    node = "nothing" if "not a quantized matmul" in message else node
    assert lines[0].startswith(f"dlegion-cc: error: {tmp_path / 'bad.json'}: node '{node}'") and message in lines[0], lines
    assert not (tmp_path / "p.s").exists()


def test_a_file_that_is_no_schedule_file_is_refused(tmp_path, cc):
    model = _narrow(tmp_path / "m.onnx")
    for text, message in (("{", "not a JSON schedule file"), ("[]", "whose 'schedules' is a list"),
                          ('{"schedules": [{}]}', "schedule 1 is not an object with a 'node' name")):
        (tmp_path / "bad.json").write_text(text)
        status, lines = cc(model, "--arch", "dlegion-tiny", "-o", tmp_path / "p.s", "--schedule", tmp_path / "bad.json")
        assert status == 2 and len(lines) == 1 and message in lines[0], lines


def test_more_or_fewer_schedules_than_the_node_needs(tmp_path, cc):
    model = _narrow(tmp_path / "m.onnx")
    _, doc = _compile(model)
    proj = next(e for e in doc["schedules"] if e["node"] == "proj")
    for schedules_, message in (([proj, proj], "the file gives 2 schedule(s); the lowering needs 1"),):
        (tmp_path / "s.json").write_text(json.dumps({"schedules": schedules_}))
        status, lines = cc(model, "--arch", "dlegion-tiny", "-o", tmp_path / "p.s", "--schedule", tmp_path / "s.json")
        assert status == 2 and len(lines) == 1 and message in lines[0] and "node 'proj'" in lines[0], lines


def test_the_schedules_read_are_never_overwritten_and_a_missing_file_is_named(tmp_path, cc):
    model = _narrow(tmp_path / "m.onnx")
    (tmp_path / "s.json").write_text('{"schedules": []}')
    status, lines = cc(model, "--arch", "dlegion-tiny", "--emit", "schedule", "-o", tmp_path / "s.json",
                       "--schedule", tmp_path / "s.json")
    assert status == 2 and "would overwrite the schedules" in lines[0], lines
    assert (tmp_path / "s.json").read_text() == '{"schedules": []}'
    status, lines = cc(model, "--arch", "dlegion-tiny", "-o", tmp_path / "p.s", "--schedule", tmp_path / "none.json")
    assert status == 2 and len(lines) == 1 and "none.json" in lines[0], lines
