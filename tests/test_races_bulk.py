"""The whole-run race check (runtime/races_bulk.py) agrees with the check access by access
(runtime/races.py): on random programs of loads, vector ops and stores with random waits, and
on a compiled model with waits removed; and a race it finds is named as that check names it."""
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from isa.arch import load
from isa.asm import parse
from isa.expand import in_program_order
from isa.fields import QUEUES
from isa.instructions import Wait
from isa.progress import SILENT
from isa.verify import verify
from runtime.emulator import _emulate, _repeated_segments, random_inputs, run
from runtime.races import DMA
from runtime.races_bulk import AccessLog
from runtime.state import Trap

ARCH = load("dlegion-tiny")
HEAD = """.arch dlegion-tiny
.tensor x f32[4,8] input "x"
.tensor y f32[4,8] output "y"
.tensor t f32[8,8] scratch
"""
X = {"x": np.arange(32, dtype=np.float32).reshape(4, 8)}
# Every window the random instructions read is written before the barrier.
PROLOGUE = "".join(f"dma.ld L{a} {{{a}}} vec[{v},8,1] @x[0,8] rows=4 cols=8\n" for a in (0, 1) for v in (0, 32)) \
    + "dma.st L0 @t[0,8] vec[0,8,1] rows=4 cols=8 wait=L0.dma>=2\n" \
    + "dma.st L1 @t[32,8] vec[0,8,1] rows=4 cols=8 wait=L1.dma>=2\nbarrier\n"
# (queue, text): windows at 0, 16 and 32 overlap by halves.
MENU = [
    ("dma", "dma.ld L{a} {{{a}}} vec[{v},8,1] @x[0,8] rows=4 cols=8"),
    ("dma", "dma.ld L{a} {{0-1}} vec[{v},8,1] @x[0,8] rows=4 cols=8"),
    ("dma", "dma.ld L{a} {{{a}}} vec[{v},8,1] @t[{d},8] rows=4 cols=8"),
    ("dma", "dma.st L{a} @t[{d},8] vec[{v},8,1] rows=4 cols=8"),
    ("vec", "vadd L{a} vec[{v},8,1] vec[{w},8,1] #1 rows=4 cols=8"),
]


def random_lines(draw, most: int, barriers: bool = False) -> str:
    """After the prologue, up to ``most`` random instructions (and barriers, when asked), each
    waiting for a random count (at most what is issued before it: the program stays in program
    order) of a random queue, or not."""
    issued = {(a, q): 2 if q == "dma" else 0 for a in (0, 1) for q in ("dma", "vec")}
    lines = []
    for _ in range(draw(st.integers(1, most))):
        if barriers and draw(st.integers(0, 7)) == 0:
            lines.append("barrier\n")
            continue
        queue, text = draw(st.sampled_from(MENU))
        a = draw(st.integers(0, 1))
        line = text.format(a=a, v=draw(st.sampled_from([0, 16, 32])), w=draw(st.sampled_from([0, 16, 32])),
                           d=draw(st.sampled_from([0, 16, 32])))
        if draw(st.booleans()):
            on, q = draw(st.integers(0, 1)), draw(st.sampled_from(["dma", "vec"]))
            line += f" wait=L{on}.{q}>={draw(st.integers(0, issued[(on, q)]))}"
        issued[(a, queue)] += 1
        lines.append(line + "\n")
    return HEAD + PROLOGUE + "".join(lines)


@st.composite
def racy_programs(draw):
    """A prologue, then random instructions (``random_lines``)."""
    return parse(random_lines(draw, 8))


def verdicts(program, arch, inputs):
    """(the whole check's verdict, the check by access's): True when ordered; None when the
    run traps before any check."""
    expanded = verify(program, arch)
    assert in_program_order(expanded.instrs, arch.legions)
    unchecked = _repeated_segments(expanded.instrs.source, expanded)
    log = AccessLog(expanded, arch, unchecked)
    try:
        _emulate(expanded, arch, inputs, True, SILENT, True, log, unchecked)
    except Trap:
        return None
    try:
        run(program, arch, inputs, races="each")
    except Trap as e:
        assert "race on" in str(e)
        return log.ordered(), False
    return log.ordered(), True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(racy_programs())
def test_the_whole_check_agrees_with_the_check_by_access(program):
    got = verdicts(program, ARCH, X)
    if got is not None:
        whole, each = got
        assert whole == each


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(racy_programs())
def test_a_race_is_named_as_the_check_by_access_names_it(program):
    def message(races):
        try:
            run(program, ARCH, X, races=races)
        except Trap as e:
            return str(e)
        return None
    assert message(True) == message("each")


MODEL = Path(__file__).parent.parent / "models" / "bitnet_tiny_relu2.onnx"


@lru_cache(maxsize=1)
def _compiled():
    from dlegion_cc.pipeline import Options, compile_model
    return compile_model(str(MODEL), Options(ARCH))[1]


def _unwaited(i):
    """``i`` waiting for nothing more than an empty queue would."""
    if isinstance(i, Wait):
        return replace(i, until=replace(i.until, count=0, back=0))
    return replace(i, wait=None)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_compiled_model_with_waits_removed(data):
    """Waits removed from a compiled decoder layer: the two checks find a race, or none, alike."""
    program = _compiled()
    waited = [j for j, i in enumerate(program.instrs) if isinstance(i, Wait) or getattr(i, "wait", None) is not None]
    drop = set(data.draw(st.lists(st.sampled_from(waited), min_size=1, max_size=3)))
    broken = replace(program, instrs=[_unwaited(i) if j in drop else i for j, i in enumerate(program.instrs)])
    got = verdicts(broken, ARCH, random_inputs(program, 0))
    if got is not None:
        assert got[0] == got[1]


def test_the_compiled_model_is_proven_ordered_whole():
    program = _compiled()
    assert verdicts(program, ARCH, random_inputs(program, 0)) == (True, True)


@pytest.mark.parametrize("body", [
    # A store of two ranks whose windows share elements: rank 1 is not ordered after rank 0.
    "dma.st L0 @t[0,8] vec[0,8,1] rows=4 cols=8 span=2 lstride=8\n",
    # Two Legions' loads into one Legion's window, neither waiting for the other.
    "dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8\ndma.ld L1 {0} vec[16,8,1] @x[0,8] rows=4 cols=8\n",
])
def test_races_the_whole_check_finds(body):
    program = parse(HEAD + PROLOGUE + body)
    assert verdicts(program, ARCH, X) == (False, False)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 5), st.integers(1, 9), st.integers(-3, 12),
                          st.integers(-2, 3)), min_size=1, max_size=20))
def test_rectangles_are_those_of_the_check_by_access(wins):
    from runtime.races import _rectangle
    from runtime.races_bulk import _rectangles
    got = _rectangles(np.array(wins, np.int64)).tolist()
    assert got == [list(_rectangle(w) or (-1, got[n][1], got[n][2], got[n][3], got[n][4])) for n, w in enumerate(wins)]


def test_a_race_before_a_trap_is_the_error():
    """The recorded run goes past the race to the never-written read; the run again by access
    stops at the race, as a run by access always has."""
    body = """dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
vadd L0 vec[64,8,1] vec[0,8,1] #1 rows=4 cols=8
vadd L0 vec[96,8,1] vec[200,8,1] #1 rows=4 cols=8 wait=L0.dma>=1
"""
    with pytest.raises(Trap, match=r":4: vadd: race on L0 vec\[0\]: line 3 \(dma.ld\) wrote it"):
        run(parse(".arch dlegion-tiny\n.tensor x f32[4,8] input \"x\"\n" + body), ARCH, X)
    with pytest.raises(Trap, match=r"read of never-written L0 vec\[200\]"):
        run(parse(".arch dlegion-tiny\n.tensor x f32[4,8] input \"x\"\n" + body), ARCH, X, races=False)


def _pairs_by_brute_force(acc, order):
    """Every (earlier, later) pair of rank accesses of one space, one writing, the later's
    task not knowing the earlier's done, but for a later write on the earlier's DMA queue
    (ordered by the queue): each pair looked at."""
    task, space, write = acc["task"], acc["space"], acc["write"]
    out = set()
    for y in range(len(task)):
        for x in range(y):
            q = order.queue[task[x]]
            by_queue = write[y] and q == order.queue[task[y]] and q % len(QUEUES) == DMA
            if space[x] == space[y] and (write[x] or write[y]) and not by_queue \
                    and order.place[task[x]] >= order.known[task[y], q]:
                out.add((x, y))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(racy_programs())
def test_the_pairs_searched_are_every_pair_not_known_done(program):
    # The search takes each group's candidates as one run in sorted order: it must find the
    # pairs a look at every pair finds, no more, no fewer.
    from runtime.races import Order
    from runtime.races_bulk import _not_known_done
    expanded = verify(program, ARCH)
    log = AccessLog(expanded, ARCH)
    try:
        _emulate(expanded, ARCH, X, True, SILENT, True, log, np.zeros(len(expanded.instrs.source), bool))
    except Trap:
        return
    acc, order = log._ranks(), Order(expanded, ARCH)
    from runtime import races_bulk
    whole = races_bulk.KEYS_PER_BLOCK
    try:
        for block in (whole, 1, 3):      # all groups searched at once, and a group or a few at a time
            races_bulk.KEYS_PER_BLOCK = block
            blocks = _not_known_done(acc, order)
            assert blocks is not None
            found = [pair for a, b in blocks for pair in zip(a.tolist(), b.tolist())]
            assert len(found) == len(set(found)) and set(found) == _pairs_by_brute_force(acc, order)
    finally:
        races_bulk.KEYS_PER_BLOCK = whole


def test_a_segment_is_left_unchecked_only_when_it_repeats_an_earlier_one():
    # Segments: the prologue's, A, B (A's length, other values), A again, and one of a length
    # no other has: only the repeat of A is left unchecked.
    a = "vadd L0 vec[0,8,1] vec[0,8,1] #1 rows=4 cols=8\nvadd L0 vec[16,8,1] vec[16,8,1] #1 rows=4 cols=8\n"
    b = "vadd L0 vec[0,8,1] vec[0,8,1] #2 rows=4 cols=8\nvadd L0 vec[16,8,1] vec[16,8,1] #1 rows=4 cols=8\n"
    odd = "vadd L1 vec[0,8,1] vec[0,8,1] #1 rows=4 cols=8\n"
    program = verify(parse(HEAD + PROLOGUE + a + "barrier\n" + b + "barrier\n" + a + "barrier\n" + odd), ARCH)
    source = program.instrs.source
    unchecked = _repeated_segments(source, program)
    bars = [o for o, ins in enumerate(source) if type(ins).__name__ == "Barrier"]
    assert not unchecked[:bars[2]].any()
    assert unchecked[bars[2]:bars[3]].all()
    assert not unchecked[bars[3]:].any()


@given(st.lists(st.tuples(st.integers(-5, 50), st.integers(0, 4)), max_size=12))
def test_runs_are_each_start_counted_up(pairs):
    from runtime.races_bulk import _runs
    lo, count = (np.array(x, np.int64).reshape(-1) for x in zip(*pairs)) if pairs else (np.zeros(0, np.int64),) * 2
    assert _runs(lo, count).tolist() == [s + i for s, n in pairs for i in range(n)]
