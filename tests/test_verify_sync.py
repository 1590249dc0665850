"""Verifier checks of the progress-counter synchronization that need the whole stream."""
from isa import arch
from isa.fields import Cond, DramRef, View
from isa.instructions import DmaLoad, Wait
from isa.program import Program, Tensor
from isa.verify import check

TINY = arch.load("dlegion-tiny")


def _program(instrs):
    return Program("dlegion-tiny", [Tensor("x", "f32", (4, 4), "input", io_name="x")], instrs, source="t.s",
                   lines=list(range(1, len(instrs) + 1)))


def _load(wait=None):
    return DmaLoad(0, frozenset({0}), View("vec", 0, 4, 1), DramRef(0, 0, 4), 4, 4, wait=wait)


def test_waiting_on_the_own_queue_for_later_work_is_rejected():
    problems = check(_program([_load(wait=Cond(0, "dma", 1)), _load()]), TINY)
    assert any("t.s:1: dma.ld: condition L0.dma>=1 waits on its own queue" in p for p in problems)


def test_waiting_on_the_own_queue_for_earlier_work_is_fine():
    assert check(_program([_load(), _load(wait=Cond(0, "dma", 1))]), TINY) == []
    assert check(_program([_load(), Wait(0, "dma", Cond(0, "dma", 1)), _load()]), TINY) == []
