"""The overlap rewrite of a kernel each decoder layer repeats runs once: the later layers take
its result with their own DRAM tensors (``overlap.reused``), and the program is the one
rewritten layer by layer."""
from __future__ import annotations

import onnx
import pytest

from dlegion_cc.lower import heads, overlap, rowblocks
from dlegion_cc.pipeline import Options, compile_model
from isa import arch
from isa.encoding import TENSOR_FIELDS, renamed_tensors
from models.bitnet import build_bitnet, preset

TINY = arch.load("dlegion-tiny")
LAYERS = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("reuse") / "bitnet3.onnx"
    onnx.save(build_bitnet(preset("tiny", layers=LAYERS, seq=16)), path)
    return path


def _compiled(model, monkeypatch, reuse: bool):
    """The program, and how many rewrites were asked for and how many ran."""
    asked, ran = [], []
    run = overlap._Rewrite.run

    def counted(self):
        ran.append(1)
        return run(self)

    def reused(program, seen, how, make):
        asked.append(1)
        return overlap.reused(program, seen if reuse else {}, how, make)
    with monkeypatch.context() as m:
        m.setattr(overlap._Rewrite, "run", counted)
        m.setattr(heads, "reused", reused)
        m.setattr(rowblocks, "reused", reused)
        program = compile_model(model, Options(TINY, {}))[1]
    return program, len(asked), len(ran)


def test_a_kernel_each_layer_repeats_is_rewritten_once_to_the_same_program(model, monkeypatch):
    program, asked, ran = _compiled(model, monkeypatch, reuse=True)
    alone, asked_alone, ran_alone = _compiled(model, monkeypatch, reuse=False)
    assert asked == asked_alone >= LAYERS and ran_alone == asked
    assert ran == asked // LAYERS         # one per distinct kernel
    assert program.instrs == alone.instrs and program.tensors == alone.tensors


def test_renaming_a_tensor_reaches_every_field_that_names_one(model, monkeypatch):
    """Every DRAM tensor an instruction names (a transfer's, a gather's table, a matmul's block
    mask) is renamed, and renaming back gives the instruction again."""
    program = compile_model(model, Options(TINY, {}))[1]
    named = [i for i in program.instrs if TENSOR_FIELDS.get(type(i))]
    assert {type(i).__name__ for i in named} >= {"DmaLoad", "DmaStore"}
    for i in named:
        moved = renamed_tensors(i, lambda t: t + 1000)
        fields = [index(getattr(moved, name)) for name, index in TENSOR_FIELDS[type(i)]]
        assert all(t is None or t >= 1000 for t in fields)
        assert renamed_tensors(moved, lambda t: t - 1000) == i
