"""The emulator runs a compiled program in program order, each instruction's tasks (one per
Legion of its span) as one numpy operation; a program that waits ahead runs task by task in the
timing model's completion order. Both orders must give the same machine state."""
from pathlib import Path

import numpy as np
import pytest

from dlegion_cc.pipeline import Options, compile_model
from isa import arch
from isa.asm import parse
from isa.verify import verify
from runtime import emulator
from runtime.emulator import in_program_order, random_inputs, run
from runtime.state import Trap

ROOT = Path(__file__).parent.parent
TINY, L8 = arch.load("dlegion-tiny"), arch.load("dlegion-8x8")


@pytest.fixture(scope="module", params=["bitnet_tiny_gqa", "llama_tiny_qdq"])
def compiled(request):
    _, program = compile_model(ROOT / "models" / f"{request.param}.onnx", Options(TINY, {"sequence": 8}),
                               "prog.s.data")
    return program


def _task_by_task(monkeypatch):
    monkeypatch.setattr(emulator, "in_program_order", lambda tasks, legions: False)


def test_a_compiled_program_waits_only_behind(compiled):
    assert in_program_order(verify(compiled, TINY).instrs, TINY.legions)


def test_instruction_at_once_and_task_by_task_agree(compiled, monkeypatch):
    inputs = random_inputs(compiled, 3)
    batched = run(compiled, TINY, inputs)
    _task_by_task(monkeypatch)
    single = run(compiled, TINY, inputs)
    assert batched.outputs.keys() == single.outputs.keys()
    for name, value in batched.outputs.items():
        np.testing.assert_array_equal(value, single.outputs[name], err_msg=name)
    for space, bank in batched.machine.banks.items():
        np.testing.assert_array_equal(bank.data, single.machine.banks[space].data, err_msg=space)
        np.testing.assert_array_equal(bank.written, single.machine.banks[space].written, err_msg=space)
    np.testing.assert_array_equal(batched.timeline.done, single.timeline.done)


HEAD = """.arch dlegion-8x8
.tensor x f32[8,64] input "x"
.tensor y f32[8,64] output "y"
"""


def test_a_wait_ahead_runs_task_by_task():
    p = parse(HEAD + """vadd L0 vec[64,64,1] vec[0,64,1] #1 rows=1 cols=64 wait=L0.dma>=1
dma.ld L0 {0} vec[0,64,1] @x[0,64] rows=1 cols=64
dma.st L0 @y[0,64] vec[64,64,1] rows=1 cols=64 wait=L0.vec>=1
""")
    assert not in_program_order(verify(p, L8).instrs, L8.legions)
    x = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
    np.testing.assert_array_equal(run(p, L8, {"x": x}).outputs["y"][0], x[0] + 1)


def test_a_span_computes_each_rank_on_its_own_rows():
    p = parse(HEAD + """dma.ld L0 {0} vec[0,64,1] @x[0,64] rows=1 cols=64 span=8 lstride=64
vmul L0 vec[64,64,1] vec[0,64,1] #2 rows=1 cols=64 span=8 wait=dma
vrsum L0 vec[128,1,1] vec[64,64,1] rows=1 cols=64 span=8 wait=vec
vadd L0 vec[64,64,1] vec[64,64,1] vec[128,0,0] rows=1 cols=64 span=8 wait=vec
dma.st L0 @y[0,64] vec[64,64,1] rows=1 cols=64 span=8 lstride=64 wait=vec
""")
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    y = run(p, L8, {"x": x}).outputs["y"]
    twice = x * np.float32(2)
    sums = np.stack([np.sum(row[None], axis=1, dtype=np.float32) for row in twice])
    np.testing.assert_array_equal(y, twice + sums)


def test_a_fault_names_the_rank_that_faults():
    """Legions 0-2 were given data, the rest of the span was not: L3 reads what nobody wrote."""
    p = parse(HEAD + """dma.ld L0 {0} vec[0,64,1] @x[0,64] rows=1 cols=64 span=3 lstride=64
vmul L0 vec[64,64,1] vec[0,64,1] #2 rows=1 cols=64 span=8 wait=L0.dma>=1
""")
    with pytest.raises(Trap, match=r"read of never-written L3 vec\[0\]"):
        run(p, L8, {"x": np.zeros((8, 64), np.float32)}, races=False)


SEGMENT = """dma.ld L0 {0} vec[0,64,1] @x[0,64] rows=1 cols=64 span=8 lstride=64
vmul L0 vec[64,64,1] vec[0,64,1] #2 rows=1 cols=64 span=8 wait=dma
dma.st L0 @y[0,64] vec[64,64,1] rows=1 cols=64 span=8 lstride=64 wait=vec
barrier
"""


@pytest.mark.parametrize("races", [True, "each"])
def test_a_repeated_segment_is_race_checked_once(monkeypatch, races):
    from runtime.races import RaceCheck
    from runtime.races_bulk import AccessLog
    started = []
    check = AccessLog if races is True else RaceCheck      # the whole run's check, or by access
    original = check.start
    monkeypatch.setattr(check, "start", lambda self, k, span=1: (started.append(k), original(self, k, span)))
    p = parse(HEAD + ".tensor t f32[8,64] scratch\n" + SEGMENT * 3 + SEGMENT.replace("@y", "@t")
              + SEGMENT.replace("#2", "#3"))
    run(p, L8, {"x": np.ones((8, 64), np.float32)}, races=races)
    # Checked: the first segment, the second (the first after a barrier) and the last, which
    # multiplies by another number; not the third, nor the fourth, the same with t for y.
    assert len(started) == 3 * 3


def test_a_race_in_a_segment_that_differs_only_by_it_is_found():
    racy = SEGMENT.replace(" wait=vec", "")
    p = parse(HEAD + SEGMENT * 2 + racy)
    with pytest.raises(Trap, match=r"race on L0 vec\[64\]"):
        run(p, L8, {"x": np.ones((8, 64), np.float32)})
