"""``dlegion-run --check-all``: every intermediate it compares is the model's value, so the first
divergence it names is where the program's values first leave the model's."""
from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path

import numpy as np
import onnx

from dlegion_cc.pipeline import Options, compile_model
from isa import arch
from runtime.check import PROGRAM_APPROXIMATIONS
from runtime.intermediates import compare_intermediates, not_the_value
from runtime.emulator import random_inputs, run
from runtime.report import print_intermediates

ROOT = Path(__file__).parent.parent
TINY = arch.load("dlegion-tiny")
MODEL = ROOT / "models" / "bitnet_tiny_relu2.onnx"


@cache
def int8_attention():
    """The committed BitNet model with attention in int8 (its default): Q is stored as int8 codes."""
    _, program = compile_model(MODEL, Options(TINY, {}))
    inputs = random_inputs(program, 0)
    return program, inputs, run(program, TINY, inputs)


def ancestors(model: onnx.ModelProto, name: str) -> set[str]:
    """The values ``name`` is computed from, ``name`` included."""
    producer = {o: n for n in model.graph.node for o in n.output}
    seen, todo = set(), [name]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo += list(producer[v].input) if v in producer else []
    return seen


def test_first_divergence_is_an_int8_attention_product():
    """Every intermediate before the first divergence is the model's value to fp32 rounding, and
    the first divergence is computed from a product the program records as int8, at most that
    approximation's documented distance away. (The int8 codes of the rotated Q were compared as
    Q under its name: relative L2 47, named as the first divergence.)"""
    program, inputs, result = int8_attention()
    products = program.approximations["int8_attention"]
    rows = compare_intermediates(MODEL, inputs, result)
    compared = [r for r in rows if not r.not_the_value]
    first = next(i for i, r in enumerate(compared) if not r.ok)
    assert first > 0 and all(r.rel_l2 <= 1e-6 for r in compared[:first])
    assert compared[first].rel_l2 <= PROGRAM_APPROXIMATIONS["int8_attention"][1]
    assert set(products) & ancestors(onnx.load(MODEL), compared[first].name), (compared[first].name, products)


def judged(program, inputs, result, perturb: str | None = None, by: float = 0.0):
    """compare_intermediates with the program's approximations, ``perturb``'s tensor scaled by
    1 + ``by`` in the run's memory first (a program that computed it that far off)."""
    if not perturb:
        return compare_intermediates(MODEL, inputs, result, approximations=program.approximations)
    dram = result.machine.dram[next(i for i, t in enumerate(program.tensors) if t.io_name == perturb)]
    kept = dram.copy()
    dram *= np.float32(1 + by)
    try:
        return compare_intermediates(MODEL, inputs, result, approximations=program.approximations)
    finally:
        dram[...] = kept


def test_values_after_an_approximation_are_judged_at_its_tolerance():
    """With the program's approximations, every value computed from an int8 attention product is
    judged at int8_attention's tolerance and every other at 1e-4: the program, right, shows no
    divergence, where at 1e-4 throughout its first was the attention output."""
    program, inputs, result = int8_attention()
    rows = [r for r in judged(program, inputs, result) if not r.not_the_value]
    after = {r.name for r in rows if r.approximated}
    model = onnx.load(MODEL)
    products = set(program.approximations["int8_attention"])
    assert after and all(products & ancestors(model, n) for n in after)
    assert all(r.tolerance == PROGRAM_APPROXIMATIONS["int8_attention"][1] for r in rows if r.name in after)
    assert all(r.tolerance == 1e-4 for r in rows if r.name not in after)
    assert all(r.ok for r in rows), [(r.name, r.rel_l2) for r in rows if not r.ok]


def test_a_wrong_value_is_still_found_either_side_of_the_approximation(capsys):
    """A value before the approximation 1e-3 off, or one after it 10% off (twice its tolerance),
    is named as the first divergence, with the tolerance it was judged at."""
    program, inputs, result = int8_attention()
    rows = [r for r in judged(program, inputs, result) if not r.not_the_value]
    before = next(r.name for r in rows if not r.approximated and r.dtype == "float32")
    after = next(r.name for r in reversed(rows) if r.approximated and r.dtype == "float32")
    for name, by in ((before, 1e-3), (after, 0.1)):
        bad = [r for r in judged(program, inputs, result, name, by) if not r.ok]
        assert [r.name for r in bad] == [name]
        print_intermediates(bad, 1e-4)
        out = capsys.readouterr().out
        assert f"the first is {name}" in out and ("tolerance" in out) == (name == after)
    assert all(r.ok for r in judged(program, inputs, result) if not r.not_the_value)     # restored


def test_a_tensor_that_cannot_hold_its_value_is_not_compared_and_said(capsys):
    """A program tensor bound to a model value it holds in another form (the int8 codes of Q,
    bound under Q's name) is left out of the comparison, and the report names it and why."""
    program, inputs, result = int8_attention()
    codes = next(i for i, t in enumerate(program.tensors) if t.kind == "scratch" and t.name.endswith("_int8_0"))
    q = program.tensors[codes].name.removesuffix("_int8_0")
    program = dataclasses.replace(program, tensors=list(program.tensors))
    program.tensors[codes] = dataclasses.replace(program.tensors[codes], io_name=q)
    rows = compare_intermediates(MODEL, inputs, dataclasses.replace(result, program=program))
    [row] = [r for r in rows if r.name == q]
    assert row.not_the_value and "int8" in row.not_the_value
    print_intermediates(rows, 1e-4)
    out = capsys.readouterr().out
    assert f"{q} not compared" in out and f"the first is {q}" not in out


def test_integer_values_in_integer_storage_are_compared():
    """Quantized activations the model computes in float (Clip(Round(.))) and the program holds
    as int8 are the same integers: compared, not set aside."""
    ref = np.array([[-3.0, 0.0, 127.0]], np.float32)
    assert not_the_value(ref.astype(np.int8), ref) is None
    assert not_the_value(np.array([[0, 1, 2]], np.int8), ref + 0.5)


IN_PLACE = """\
.arch dlegion-tiny
.tensor x f32[8,32] input "x"
.tensor n f32[8,32] scratch "n"
.tensor y f32[8,32] output "y"
dma.ld L0 {0} vec[0,32,1] @x[0,32] rows=8 cols=32
vneg L0 vec[0,32,1] vec[0,32,1] rows=8 cols=32 wait=L0.dma>=1
dma.st L0 @n[0,32] vec[0,32,1] rows=8 cols=32 wait=L0.vec>=1
dma.ld L0 {0} vec[256,32,1] @n[0,32] rows=8 cols=32 wait=L0.dma>=2
vexp L0 vec[256,32,1] vec[256,32,1] rows=8 cols=32 wait=L0.dma>=3
dma.st L0 @n[0,32] vec[256,32,1] rows=8 cols=32 wait=L0.vec>=2
dma.st L0 @y[0,32] vec[256,32,1] rows=8 cols=32
"""


def test_a_value_overwritten_in_place_after_its_reader_is_not_compared(tmp_path, capsys):
    """n = Neg(x) is stored, read back, and its tensor then holds Exp(n) (written in place): the
    run leaves Exp(n) there, which is not n. The program's output is right; --check-all does
    not compare n as if the tensor still held it, and says so."""
    from onnx import TensorProto, helper
    from isa.asm import parse
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [8, 32])   # noqa: E731
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Exp", ["n"], ["y"])],
                              "g", [value("x")], [value("y")])
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    program = parse(IN_PLACE, "in_place.s")
    inputs = random_inputs(program, 0)
    result = run(program, TINY, inputs)
    assert np.allclose(result.outputs["y"], np.exp(-inputs["x"]), rtol=1e-6)
    [row] = compare_intermediates(model, inputs, result)
    assert row.name == "n" and row.not_the_value and "in place" in row.not_the_value
    print_intermediates([row], 1e-4)
    out = capsys.readouterr().out
    assert "n not compared" in out and "diverge" not in out
