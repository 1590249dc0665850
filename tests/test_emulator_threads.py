"""The emulator holds the BLAS pools to one thread while it runs, and gives them back after."""
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

import runtime.semantics as semantics
from isa.arch import load
from isa.asm import parse
from runtime.emulator import run

ARCH = load("dlegion-tiny")
PROGRAM = """.arch dlegion-tiny
.tensor x f32[4,8] input "x"
.tensor y f32[4,8] output "y"
dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
vadd L0 vec[0,8,1] vec[0,8,1] #1 rows=4 cols=8 wait=L0.dma>=1
dma.st L0 @y[0,8] vec[0,8,1] rows=4 cols=8 wait=L0.vec>=1
"""


def _blas_threads() -> list[int]:
    return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]


def test_blas_runs_on_one_thread_during_the_run_only(monkeypatch):
    seen = []
    original = semantics.execute_unguarded

    def recording(machine, instr):
        seen.append(_blas_threads())
        return original(machine, instr)

    monkeypatch.setattr(semantics, "execute_unguarded", recording)
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    with threadpool_limits(2, user_api="blas"):
        before = _blas_threads()
        assert before, "numpy's BLAS pool is not visible"
        out = run(parse(PROGRAM), ARCH, {"x": x}).outputs["y"]
        assert _blas_threads() == before
    assert np.array_equal(out, x + 1)
    assert seen and all(threads == [1] * len(before) for threads in seen)
