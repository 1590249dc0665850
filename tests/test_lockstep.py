"""Legions in lockstep (runtime/lockstep.py): simulating one Legion of each class, each repeated
segment once, gives every task the times of simulating every task, and runs each in an order
its dependencies allow."""
import dataclasses

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from isa.arch import load
from isa.fields import Cond, DramRef, View
from isa.instructions import BY_MNEMONIC, Barrier, DmaLoad, Wait
from isa.program import Program, Tensor
from runtime import lockstep, timing
from runtime.timing import simulate

ARCH = dataclasses.replace(load("dlegion-tiny"), legions=4)
X = Tensor("x", "i8", (1, 4096), "input")


def vadd(legion, cols, span=None, wait=None):
    v = View("vec", 0, cols)
    return BY_MNEMONIC["vadd"](legion, v, v, v, 1, cols, span=span, wait=wait)


def load_x(legion, cols, dests=None, span=None, lstride=None, wait=None):
    dests = frozenset({legion} if dests is None else dests)
    return DmaLoad(legion, dests, View("act", 0, cols), DramRef(0, 0, cols), 1, cols,
                   span=span, lstride=lstride, wait=wait)


@st.composite
def blocks(draw):
    """A few instructions as compilers write them: spans over every Legion with conditions on
    their own queues, a multicast load that every Legion then waits for, and now and then an
    instruction on one Legion, a shorter span or a barrier, which break the symmetry."""
    cols = draw(st.integers(1, 400))
    n = ARCH.legions
    kind = draw(st.sampled_from(["span", "multicast", "load", "single", "short", "wait", "cross", "pair",
                                         "barrier"]))
    if kind == "span":
        return [vadd(0, cols, span=n, wait=draw(st.sampled_from([None, Cond(None, "dma"), Cond(None, "vec", back=1)])))]
    if kind == "multicast":
        return [load_x(0, cols, dests=range(n)), vadd(0, cols, span=n, wait=Cond(0, "dma"))]
    if kind == "load":
        return [load_x(0, cols, span=n, lstride=cols)]
    if kind == "single":
        return [vadd(draw(st.integers(0, n - 1)), cols, wait=draw(st.sampled_from([None, Cond(None, "dma")])))]
    if kind == "short":
        return [load_x(1, cols, span=n - 1, lstride=0)]
    if kind == "cross":       # every Legion waits on one Legion's loads: that one on its own
        return [vadd(0, cols, span=n, wait=Cond(draw(st.integers(0, n - 1)), "dma"))]
    if kind == "pair":        # the same work, but one Legion waits on another's loads
        a, b = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        return [vadd(legion, cols, wait=Cond(b, "dma") if legion == a else Cond(None, "dma"))
                for legion in range(n)]
    if kind == "wait":
        return [Wait(0, "dma", Cond(None, "vec"), span=n)]
    return [Barrier()]


@st.composite
def programs(draw):
    body = [i for b in draw(st.lists(blocks(), min_size=1, max_size=8)) for i in b]
    repeats = draw(st.integers(1, 3))          # repeated segments are timed once
    instrs = (body + [Barrier()]) * repeats
    return Program("t", [X], instrs, data=None)


def every_task(program):
    """The times of simulating every task of ``program`` on its own."""
    flat = timing.expand(program, ARCH.legions).program
    tasks = lockstep.tasks_of(flat, timing._costs(flat, ARCH))
    times = tuple(np.full(len(tasks.kind), np.nan) for _ in range(3))
    timing._at_once(flat, ARCH, tasks, times, None, None)
    return flat, times


@settings(max_examples=120, deadline=None)
@given(programs())
def test_lockstep_times_are_those_of_every_task(program):
    flat, (start, free, done) = every_task(program)
    t = simulate(program, ARCH)
    for got, want in ((t.start, start), (t.free, free), (t.done, done)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(programs())
def test_each_task_runs_once_after_what_it_waits_for(program):
    seen = []
    t = simulate(program, ARCH, seen.append)
    flat = t.program
    runs = [k for k, i in enumerate(flat.instrs) if not isinstance(i, (Wait, Barrier))]
    assert sorted(seen) == runs
    at = {k: n for n, k in enumerate(seen)}
    assert all(t.done[a] <= t.done[b] for a, b in zip(seen, seen[1:]))
    for k, i in enumerate(flat.instrs):       # what a task waits for ran before it
        cond = i.condition()
        if k not in at or cond is None or not cond.count:
            continue
        queue = [j for j, x in enumerate(flat.instrs[:k]) if not isinstance(x, Barrier)
                 and (x.legion, x.queue()) == (cond.legion, cond.queue) and j in at]
        assert all(at[j] < at[k] for j in queue[:cond.count])


def test_symmetric_legions_are_simulated_once_and_repeats_not_again():
    body = [load_x(0, 64, dests=range(4)), vadd(0, 64, span=4, wait=Cond(0, "dma")),
            load_x(0, 32, span=4, lstride=32), vadd(0, 32, span=4, wait=Cond(None, "dma")), Barrier()]
    flat = timing.expand(Program("t", [X], body * 3, data=None), ARCH.legions).program
    tasks = lockstep.tasks_of(flat, timing._costs(flat, ARCH))
    segs = list(lockstep.segments(tasks, ARCH.legions, timing.machine_queues(ARCH)))
    # L0 issues the multicast and is a class of its own; L1-L3 move together
    assert sorted(segs[0].part().mult) == [1] * 4 + [3] * 3
    assert len(segs[0].order) == 2 * 3 + 1 and segs[0].hi - segs[0].lo == 4 * 3 + 1
    assert segs[0].key == segs[1].key == segs[2].key


def test_a_legion_waiting_on_another_is_not_in_lockstep_with_its_twins():
    # L1-L3 run the same vadds, but L1's waits for L0's long multicast load, the others' for
    # their own short loads: L1 must not take its twins' times
    body = [load_x(0, 4000, dests=[0]), load_x(1, 8, span=3, lstride=0)]
    body += [vadd(legion, 16, wait=Cond(0 if legion == 1 else None, "dma")) for legion in range(1, 4)]
    program = Program("t", [X], body, data=None)
    flat, (start, _, done) = every_task(program)
    t = simulate(program, ARCH)
    np.testing.assert_allclose(t.done, done, rtol=1e-12)
    assert t.start[4] > t.start[5]          # L1's vadd starts after the long load


@settings(max_examples=60, deadline=None)
@given(programs())
def test_tasks_in_completion_order_are_the_copies_of_each_completed_task(program):
    flat = timing.expand(program, ARCH.legions).program
    tasks = lockstep.tasks_of(flat, timing._costs(flat, ARCH))
    for seg in lockstep.segments(tasks, ARCH.legions, timing.machine_queues(ARCH)):
        sim = timing._Sim(seg.part(), ARCH)
        sim.run()
        copies = seg.copies()
        want = [k for j in sim.order for k in copies[j]]
        assert seg.in_order(sim.order).tolist() == want


@settings(max_examples=60, deadline=None)
@given(programs())
def test_tasks_issued_inline_time_as_through_the_general_issue(program):
    # A queue's next task with no condition (a plain task after a completion, a DMA after its
    # flow ended) is issued inline; a condition met from the start (count 0, on its own queue)
    # sends the same task through the general issue step, which must give the same timeline.
    flat = timing.expand(program, ARCH.legions).program
    tasks = lockstep.tasks_of(flat, timing._costs(flat, ARCH))
    free = (tasks.cond[:, 0] == lockstep.NONE) & (tasks.kind != lockstep.BARRIER)
    assume(free.any())
    cond = tasks.cond.copy()
    cond[free] = np.stack([tasks.legion[free], tasks.queue[free], np.zeros(int(free.sum()), np.int64)], axis=1)
    runs = []
    for c in (tasks.cond, cond):
        sim = timing._Sim(lockstep.whole(dataclasses.replace(tasks, cond=c), timing.machine_queues(ARCH)), ARCH)
        sim.run()
        runs.append((sim.start, sim.free, sim.done, sim.order))
    (start, free_at, done, order), (start0, free0, done0, order0) = runs
    assert order == order0
    for got, want in ((start, start0), (free_at, free0), (done, done0)):
        np.testing.assert_array_equal(got, want)
