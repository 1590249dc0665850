"""Scratch tensors are given back after their last use, and results do not change."""
import numpy as np
import pytest

from isa.arch import load
from isa.asm import parse
from isa.program import ProgramError
from runtime.emulator import run
from isa.verify import verify
from runtime.liveness import Liveness, last_uses

ARCH = load("dlegion-tiny")
PROGRAM = """.arch dlegion-tiny
.tensor x f32[4,8] input "x"
.tensor y f32[4,8] output "y"
.tensor t f32[4,8] scratch
.tensor u f32[4,8] scratch
dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
dma.st L0 @t[0,8] vec[0,8,1] rows=4 cols=8 wait=L0.dma>=1
dma.ld L0 {0} vec[32,8,1] @t[0,8] rows=4 cols=8 wait=L0.dma>=2
vadd L0 vec[32,8,1] vec[32,8,1] #1 rows=4 cols=8 wait=L0.dma>=3
dma.st L0 @u[0,8] vec[32,8,1] rows=4 cols=8 wait=L0.vec>=1
dma.ld L0 {0} vec[64,8,1] @u[0,8] rows=4 cols=8 wait=L0.dma>=4
dma.st L0 @y[0,8] vec[64,8,1] rows=4 cols=8 wait=L0.dma>=5
"""
X = {"x": np.arange(32, dtype=np.float32).reshape(4, 8)}


def test_last_use_frees_each_scratch_tensor_once():
    live = Liveness(parse(PROGRAM))
    freed = {k: live.ran(k) for k in range(7)}
    assert freed == {0: [], 1: [], 2: [2], 3: [], 4: [], 5: [3], 6: []}

    # Every instruction run once in program order: the last uses, found at once.
    assert Liveness(parse(PROGRAM)).last_uses() == {k: dead for k, dead in freed.items() if dead}


def test_last_uses_from_the_words_are_those_from_the_instructions():
    program = verify(parse(PROGRAM), ARCH)
    assert program.instrs.words is not None
    found = last_uses(program)
    assert found == Liveness(program, program.instrs.source).last_uses()
    assert found == {2: [program.tensor_index("t")], 5: [program.tensor_index("u")]}


def test_freed_tensors_are_released_and_results_unchanged():
    kept = run(parse(PROGRAM), ARCH, X, keep=True)
    freed = run(parse(PROGRAM), ARCH, X, keep=False)
    np.testing.assert_array_equal(freed.outputs["y"], kept.outputs["y"])
    np.testing.assert_array_equal(freed.outputs["y"], X["x"] + 1)
    t, u = (kept.program.tensor_index(n) for n in "tu")
    assert freed.machine.dram[t] is None and freed.machine.dram[u] is None
    np.testing.assert_array_equal(kept.machine.get("u"), X["x"] + 1)
    with pytest.raises(ProgramError, match="'u' was freed after its last use"):
        freed.machine.get("u")
    assert freed.machine.get("y") is not None and freed.machine.get("x") is not None


def test_uses_in_completion_order_free_after_the_last_to_run():
    """Two loads of t on different Legions, unordered with each other: whichever completes
    last frees it."""
    live = Liveness(parse(PROGRAM.replace("dma.st L0 @y[0,8]", "dma.ld L1 {1} vec[0,8,1] @t[0,8] rows=4 cols=8\n"
                                                               "dma.st L0 @y[0,8]")))
    assert live.ran(6) == [] and live.ran(2) == [] and live.ran(1) == [2]
