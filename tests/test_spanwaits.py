"""Runs of per-Legion waits made one spanning wait (dlegion_cc/lower/spanwaits.py): the program
is shorter and expands to the very same tasks, so the machine does exactly what it did."""
from __future__ import annotations

from isa import arch
from isa.expand import expand
from isa.fields import Cond
from isa.instructions import Wait
from isa.program import Program
from isa.verify import verify
from dlegion_cc.lower import graph
from dlegion_cc.lower.spanwaits import span_waits
from dlegion_cc.pipeline import Options, compile_model

EIGHT = arch.load("dlegion-8x8")


def _wait(legion: int, back: int, on: int | None = None) -> Wait:
    return Wait(legion, "dma", Cond(legion if on is None else on, "vec", back=back))


def test_a_run_of_one_wait_per_legion_becomes_one_spanning_wait():
    instrs = [_wait(0, 2), _wait(1, 2), _wait(2, 2), _wait(3, 2),    # a run: one wait
              _wait(4, 3),                                          # another condition
              _wait(5, 1, on=0),                                    # on another Legion's queue
              _wait(6, 1), _wait(7, 1)]                             # a region starts at 7
    p = span_waits(Program("dlegion-8x8", instrs=instrs, regions=[(0, "a"), (4, "b"), (7, "c")]))
    assert p.instrs[0] == Wait(0, "dma", Cond(None, "vec", back=2), span=4)
    assert p.instrs[1:] == instrs[4:]
    assert p.regions == [(0, "a"), (1, "b"), (4, "c")]


def test_a_layers_waits_span_and_its_tasks_stay_the_same(tmp_path, monkeypatch):
    from models.bitnet import build_bitnet, preset, save
    path = tmp_path / "layer.onnx"
    save(build_bitnet(preset("2b4t", layers=1, seq=128, vocab=256, hidden=1024, heads=8, kv_heads=8, ffn=256)),
         path, external_data=True)
    _, spanned = compile_model(path, Options(EIGHT))
    monkeypatch.setattr(graph, "span_waits", lambda program: program)
    _, plain = compile_model(path, Options(EIGHT))
    assert len(spanned.instrs) < 0.9 * len(plain.instrs)
    tasks = [list(map(str, expand(verify(p, EIGHT), EIGHT.legions).program.instrs)) for p in (spanned, plain)]
    assert tasks[0] == tasks[1]
    assert [name for _, name in spanned.regions] == [name for _, name in plain.regions]
