"""The race check: conflicting accesses must be ordered by the program's waits, whatever order
the timing model happens to run them in."""
import numpy as np
import pytest

from isa.arch import load
from isa.asm import parse
from runtime.emulator import run
from runtime.races import Order
from runtime.state import Trap

ARCH = load("dlegion-tiny")
HEAD = """.arch dlegion-tiny
.tensor x f32[4,8] input "x"
.tensor y f32[4,8] output "y"
.tensor t f32[4,8] scratch
"""
X = {"x": np.arange(32, dtype=np.float32).reshape(4, 8)}


def emulate(body: str, races=True):
    return run(parse(HEAD + body), ARCH, X, races=races)


@pytest.mark.parametrize("body", [
    # A load, then a vector op waiting for it, then a store waiting for the op.
    """dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
vadd L0 vec[0,8,1] vec[0,8,1] #1 rows=4 cols=8 wait=L0.dma>=1
dma.st L0 @y[0,8] vec[0,8,1] rows=4 cols=8 wait=L0.vec>=1""",
    # Two loads into the same place on one DMA queue land in order; a store after a load
    # reads before the next load on its queue lands.
    """dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
dma.st L0 @y[0,8] vec[0,8,1] rows=4 cols=8 wait=L0.dma>=2
dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8""",
    # The same multicast, after the reader is done.
    """dma.ld L0 {0-1} vec[0,8,1] @x[0,8] rows=4 cols=8
vadd L1 vec[32,8,1] vec[0,8,1] #1 rows=4 cols=8 wait=L0.dma>=1
dma.ld L0 {0-1} vec[0,8,1] @x[0,8] rows=4 cols=8 wait=L1.vec>=1
dma.st L1 @y[0,8] vec[32,8,1] rows=4 cols=8 wait=L1.vec>=1""",
    # A barrier orders everything.
    """dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
barrier
vadd L0 vec[0,8,1] vec[0,8,1] #1 rows=4 cols=8
barrier
dma.st L0 @y[0,8] vec[0,8,1] rows=4 cols=8""",
    # Ordering is transitive: the store waits for the vector op, which waited for the load.
    """dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
vmov L0 vec[64,8,1] vec[0,8,1] rows=4 cols=8 wait=L0.dma>=1
dma.st L0 @y[0,8] vec[64,8,1] rows=4 cols=8 wait=L0.vec>=1
dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8""",
])
def test_ordered_programs_run(body):
    out = emulate(body)
    assert out.outputs["y"].shape == (4, 8)


@pytest.mark.parametrize("body, message", [
    # Read after write: the second vector op waits for the first load only.
    ("""dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
vadd L0 vec[32,8,1] vec[0,8,1] #1 rows=4 cols=8 wait=L0.dma>=1
dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
vadd L0 vec[32,8,1] vec[0,8,1] #1 rows=4 cols=8
dma.st L0 @y[0,8] vec[32,8,1] rows=4 cols=8 wait=L0.vec>=2""",
     "race on L0 vec[0]: line"),
    # Write after read: the second load may land while the vector op still reads.
    ("""dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
vadd L0 vec[32,8,1] vec[0,8,1] #1 rows=4 cols=8 wait=L0.dma>=1
dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
dma.st L0 @y[0,8] vec[32,8,1] rows=4 cols=8 wait=L0.vec>=1""",
     "(vadd) read it"),
    # A store on the queue of the load it reads, without waiting for its data to land.
    ("""dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
dma.st L0 @y[0,8] vec[0,8,1] rows=4 cols=8""",
     "<text>:6: dma.st: race on L0 vec[0]: line 5 (dma.ld) wrote it"),
    # A multicast lands in another Legion's scratchpad while that Legion still reads it.
    ("""dma.ld L0 {0-1} vec[0,8,1] @x[0,8] rows=4 cols=8
vadd L1 vec[32,8,1] vec[0,8,1] #1 rows=4 cols=8 wait=L0.dma>=1
dma.ld L0 {0-1} vec[0,8,1] @x[0,8] rows=4 cols=8
dma.st L1 @y[0,8] vec[32,8,1] rows=4 cols=8 wait=L1.vec>=1""",
     "race on L1 vec[0]"),
    # DRAM: a load of what a store of another Legion writes, without waiting for it.
    ("""dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
dma.st L0 @t[0,8] vec[0,8,1] rows=4 cols=8 wait=L0.dma>=1
dma.ld L1 {1} vec[0,8,1] @t[0,8] rows=4 cols=8
dma.st L1 @y[0,8] vec[0,8,1] rows=4 cols=8 wait=L1.dma>=1""",
     "race on @t[0]"),
])
def test_unordered_accesses_are_races(body, message):
    with pytest.raises(Trap, match="race") as e:
        emulate(body)
    assert message in str(e.value)


def test_a_race_goes_unnoticed_without_the_check():
    body = """dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
dma.st L0 @y[0,8] vec[0,8,1] rows=4 cols=8"""
    run(parse(HEAD + body), ARCH, X, races=False)


def test_knowledge_follows_waits_queues_and_barriers():
    p = parse(HEAD + """dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
dma.ld L0 {0} vec[32,8,1] @x[0,8] rows=4 cols=8
vadd L0 vec[0,8,1] vec[0,8,1] #1 rows=4 cols=8 wait=L0.dma>=1
vadd L0 vec[0,8,1] vec[0,8,1] #1 rows=4 cols=8
barrier
dma.st L1 @y[0,8] vec[0,8,1] rows=4 cols=8""")
    o = Order(p, ARCH)
    dma, vec = o.qid(0, "dma"), o.qid(0, "vec")
    assert o.known[1, dma] == 0                 # the second load starts before the first lands
    assert o.known[2, dma] == 1 and o.known[2, vec] == 0
    assert o.known[3, dma] == 1 and o.known[3, vec] == 1    # the vec queue runs one at a time
    assert (o.known[5] >= 1).all()                           # after the barrier: everything
    assert o.known[5, dma] == 3 and o.known[5, vec] == 3 and o.known[5, o.qid(1, "dma")] == 1


def test_interleaved_windows_of_unordered_legions_are_no_race():
    """Two Legions store the two column halves of the same rows, neither waiting for the
    other: their windows' bounds overlap, their elements do not."""
    out = emulate("""dma.ld L0 {0-1} vec[0,8,1] @x[0,8] rows=4 cols=8
dma.st L0 @y[0,8] vec[0,8,1] rows=4 cols=4 wait=L0.dma>=1
dma.st L1 @y[4,8] vec[4,8,1] rows=4 cols=4 wait=L0.dma>=1""")
    np.testing.assert_array_equal(out.outputs["y"], X["x"])


def test_overlapping_windows_of_unordered_legions_race_on_their_first_shared_element():
    with pytest.raises(Trap, match=r"race on @y\[3\]: line 6 \(dma.st\) wrote it"):
        emulate("""dma.ld L0 {0-1} vec[0,8,1] @x[0,8] rows=4 cols=8
dma.st L0 @y[0,8] vec[0,8,1] rows=4 cols=4 wait=L0.dma>=1
dma.st L1 @y[3,8] vec[3,8,1] rows=4 cols=4 wait=L0.dma>=1""")


def test_first_shared_element_of_two_strided_windows():
    from runtime.races import _elements, _first_shared
    rng = np.random.default_rng(0)
    for _ in range(3000):
        a, b = ([int(rng.integers(0, 40)), int(rng.integers(1, 5)), int(rng.integers(1, 6)),
                 int(rng.choice([0, 1, 2, 3, 5, 8])), int(rng.choice([0, 1, 1, 2, 3]))] for _ in range(2))
        mine = _elements(tuple(a))
        shared = np.isin(mine, _elements(tuple(b)))
        want = int(mine[np.argmax(shared)]) if shared.any() else None
        assert _first_shared(tuple(a), tuple(b)) == want, (a, b)


LOOP = """dma.ld L0 {{0}} vec[0,8,1] @x[0,8] rows=4 cols=8 wait=L0.vec>={n}
vadd L0 vec[32,8,1] vec[0,8,1] #1 rows=4 cols=8 wait=L0.dma>={load}
dma.st L0 @t[0,8] vec[32,8,1] rows=4 cols=8 wait=L0.vec>={add}
"""


def _loop(rounds: int) -> str:
    return "".join(LOOP.format(n=r, load=2 * r + 1, add=r + 1) for r in range(rounds))


def test_the_ledgers_stay_short_on_a_long_ordered_program():
    result = emulate(_loop(200) + "dma.st L0 @y[0,8] vec[32,8,1] rows=4 cols=8 wait=L0.dma>=400\n", races="each")
    watch = result.machine.watch
    ledgers = list(watch.spads.values()) + list(watch.dram.values())
    assert max(len(ledger) for ledger in ledgers) <= 4       # 1,000 accesses made


def test_a_race_after_many_ordered_tasks_is_still_found():
    """The last vadd (line 306) reads what the last load (line 305) brings, without waiting
    for it."""
    body = _loop(100) + """dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8 wait=L0.vec>=100
vadd L0 vec[64,8,1] vec[0,8,1] #1 rows=4 cols=8
"""
    with pytest.raises(Trap, match=r"306: vadd: race on L0 vec\[0\]: line 305 \(dma.ld\) wrote it"):
        emulate(body)


# --- spans: one ledger access per instruction, ranks compared Legion by Legion ----------------

L8 = load("dlegion-8x8")
HEAD8 = """.arch dlegion-8x8
.tensor x f32[8,64] input "x"
.tensor y f32[8,64] output "y"
.tensor t f32[8,64] scratch
"""
X8 = {"x": np.arange(512, dtype=np.float32).reshape(8, 64)}


def emulate8(body: str):
    return run(parse(HEAD8 + body), L8, X8)


def test_a_span_on_some_legions_of_an_earlier_span_races_on_its_first_shared_legion():
    """The second load (Legions 5-7) lands where the vmul of Legions 0-7 still reads: its rank 0
    meets the vmul's rank 5."""
    with pytest.raises(Trap, match=r"7: dma.ld: race on L5 vec\[0\]: line 6 \(vmul\) read it"):
        emulate8("""dma.ld L0 {0} vec[0,64,1] @x[0,64] rows=1 cols=64 span=8 lstride=64
vmul L0 vec[64,64,1] vec[0,64,1] #2 rows=1 cols=64 span=8 wait=dma
dma.ld L5 {5} vec[0,64,1] @x[0,64] rows=1 cols=64 span=3 lstride=64
dma.st L0 @y[0,64] vec[64,64,1] rows=1 cols=64 span=8 lstride=64 wait=vec""")


def test_a_span_waiting_on_its_own_legions_is_ordered():
    out = emulate8("""dma.ld L0 {0} vec[0,64,1] @x[0,64] rows=1 cols=64 span=8 lstride=64
vmul L0 vec[64,64,1] vec[0,64,1] #2 rows=1 cols=64 span=8 wait=dma
dma.ld L5 {5} vec[0,64,1] @x[0,64] rows=1 cols=64 span=3 lstride=64 wait=vec
dma.st L0 @y[0,64] vec[64,64,1] rows=1 cols=64 span=8 lstride=64 wait=vec""")
    np.testing.assert_array_equal(out.outputs["y"], 2 * X8["x"])


# Legions 2 and 3 load once more before the spanned load: its ranks sit at unequal places on
# their queues, so no one bound covers the span and each rank is settled on its own Legion.
UNEVEN = """dma.ld L2 {2} vec[128,64,1] @x[0,64] rows=1 cols=64 span=2 lstride=64
dma.ld L0 {0} vec[0,64,1] @x[0,64] rows=1 cols=64 span=8 lstride=64
"""


def test_ranks_at_unequal_places_each_waiting_on_its_own_legion_are_ordered():
    out = emulate8(UNEVEN + """vmul L0 vec[64,64,1] vec[0,64,1] #2 rows=1 cols=64 span=8 wait=dma
dma.st L0 @y[0,64] vec[64,64,1] rows=1 cols=64 span=8 lstride=64 wait=vec""")
    np.testing.assert_array_equal(out.outputs["y"], 2 * X8["x"])


@pytest.mark.parametrize("first, wait, raced", [(0, "L0.dma>=1", 1), (2, "L2.dma>=2", 3), (1, "L1.dma>=1", 2)])
def test_one_rank_not_waiting_on_its_own_legion_races_there(first, wait, raced):
    """Each span waits for its first Legion's load only: its next rank reads before its own
    Legion's load has landed."""
    with pytest.raises(Trap, match=rf"race on L{raced} vec\[0\]: line 6 \(dma.ld\) wrote it"):
        emulate8(UNEVEN + f"vmul L{first} vec[64,64,1] vec[0,64,1] #2 rows=1 cols=64 span=2 wait={wait}")


def test_the_ranks_of_one_store_that_overlap_race():
    with pytest.raises(Trap, match=r"6: dma.st: race on @t\[32\]: line 6 \(dma.st\) wrote it"):
        emulate8("""dma.ld L0 {0} vec[0,64,1] @x[0,64] rows=1 cols=64 span=8 lstride=64
dma.st L0 @t[0,64] vec[0,64,1] rows=1 cols=64 span=2 lstride=32 wait=dma
dma.st L0 @y[0,64] vec[0,64,1] rows=1 cols=64 span=8 lstride=64 wait=dma""")


@pytest.fixture(scope="module")
def compiled8():
    from pathlib import Path
    from dlegion_cc.pipeline import Options, compile_model
    root = Path(__file__).parent.parent
    _, program = compile_model(root / "models" / "bitnet_tiny_gqa.onnx", Options(L8, {"sequence": 8}),
                               "prog.s.data")
    return program


@pytest.mark.parametrize("mnemonic", ["mm", "drain", "vmul", "dma.st"])
def test_a_removed_wait_in_a_compiled_program_is_reported(compiled8, mnemonic):
    """The first instruction of a kind that waits for a DMA queue, its wait removed: it no
    longer waits for the data it reads (or for its readers to be done), which is a race."""
    from dataclasses import replace
    from runtime.emulator import random_inputs
    instrs = list(compiled8.instrs)
    o = next(o for o, ins in enumerate(instrs) if ins.MNEMONIC == mnemonic and getattr(ins, "wait", None) is not None)
    instrs[o] = replace(instrs[o], wait=None)
    racy = replace(compiled8, instrs=instrs)
    inputs = random_inputs(compiled8, 0)
    run(compiled8, L8, inputs)                       # the program as compiled has no race
    with pytest.raises(Trap, match="race on"):
        run(racy, L8, inputs)


def test_a_store_races_with_a_read_of_the_value_it_overwrites():
    """Line 7's load of @t waits for the first store; the second store (line 8) does not wait
    for that load."""
    with pytest.raises(Trap, match=r"8: dma.st: race on @t\[0\]: line 7 \(dma.ld\) read it"):
        emulate("""dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
dma.st L0 @t[0,8] vec[0,8,1] rows=4 cols=8 wait=L0.dma>=1
dma.ld L1 {1} vec[0,8,1] @t[0,8] rows=4 cols=8 wait=L0.dma>=2
dma.st L0 @t[0,8] vec[0,8,1] rows=4 cols=8
dma.st L1 @y[0,8] vec[0,8,1] rows=4 cols=8 wait=L1.dma>=1""")


def test_reads_after_a_tensors_last_store_are_checked_not_kept():
    """No write follows them, so nothing can race with them: the ledger keeps the store."""
    result = emulate("""dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8
dma.st L0 @t[0,8] vec[0,8,1] rows=4 cols=8 wait=L0.dma>=1
dma.ld L1 {1} vec[0,8,1] @t[0,8] rows=4 cols=8 wait=L0.dma>=2
dma.st L1 @y[0,8] vec[0,8,1] rows=4 cols=8 wait=L1.dma>=1""", races="each")
    kept = result.machine.watch.dram[2].items                 # @t
    assert [access[5] for access in kept] == [True]           # the store's write alone
