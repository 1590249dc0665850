"""The emulator's shortcuts give the answers of the long way: cached scratchpad windows, the
race check's DRAM table, one cost per spanned instruction, fdot's quick rounding test, and
the race check's knowledge computed in program order."""
import numpy as np
import pytest

from isa.arch import load
from isa.asm import parse
from isa.fields import View
from isa.verify import verify
from runtime import fdot
from runtime.costs import Env, cost
from runtime.races import Order, WideLedger, _apart, _bounds, _depth_first, _rectangle
from runtime.state import Bank, Machine, Scratchpad, Trap, _ranks_apart, convert, copy_into
from runtime.timing import _costs, _masks

ARCH = load("dlegion-8x8")


# --- scratchpad windows ------------------------------------------------------------------------

def test_a_cached_read_view_sees_later_stores():
    pad = Scratchpad(0, "vec", 64)
    view = View("vec", 0, 8, 1)
    pad.write(view, np.ones((2, 8), np.float32))
    assert pad.read(view, 2, 8).sum() == 16
    pad.write(view, np.full((2, 8), 3, np.float32))
    assert pad.read(view, 2, 8).sum() == 48


def test_a_window_still_traps_after_a_read_of_it_trapped():
    pad = Scratchpad(0, "vec", 64)
    view = View("vec", 0, 8, 1)
    pad.write(View("vec", 0, 8, 1), np.ones((1, 8), np.float32))
    for _ in range(2):
        with pytest.raises(Trap, match=r"never-written L0 vec\[8\]"):
            pad.read(view, 2, 8)
    for _ in range(2):
        with pytest.raises(Trap, match="outside the scratchpad"):
            pad.read(View("vec", 60, 8, 1), 1, 8)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int32, np.float32])
def test_rows_copied_as_raw_elements_are_the_plain_copy(dtype):
    # Short contiguous rows of a strided window, broadcast ranks, NaN payloads, long rows and
    # rows that are not contiguous: every byte as numpy's own assignment puts it.
    rng = np.random.default_rng(0)
    flat = rng.integers(0, 256, 1 << 16, dtype=np.uint8).view(dtype)
    item = flat.itemsize
    for shape, strides in [((3, 20, 16), (700, 50, 1)), ((2, 7, 3), (0, 9, 1)), ((1, 5, 300), (0, 400, 1)),
                           ((2, 4, 6), (300, 40, 2)), ((4, 9, 1), (30, 3, 1)), ((2, 3, 64), (5000, 70, 1))]:
        values = np.ndarray(shape, dtype, flat, 8 * item, tuple(x * item for x in strides))
        plain, raw = (np.zeros((shape[0], shape[1] * 2, shape[2] + 3), dtype) for _ in range(2))
        plain[:, ::2, 1:-2] = values
        copy_into(raw[:, ::2, 1:-2], values)
        assert plain.tobytes() == raw.tobytes()
        # One rank into several (a multicast's run of Legions), as numpy broadcasts it.
        plain, raw = (np.zeros((3, shape[1] * 2, shape[2] + 3), dtype) for _ in range(2))
        plain[:, ::2, 1:-2] = values[:1]
        copy_into(raw[:, ::2, 1:-2], values[:1])
        assert plain.tobytes() == raw.tobytes()


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16])
@pytest.mark.parametrize("source", [np.float32, np.float64])
def test_a_narrow_integer_conversion_in_the_floats_own_type_is_the_fp64_one(dtype, source):
    """Floats to 8 or 16 bits are rounded and clipped in their own type: the same integers as
    through fp64, halves to even, NaN to 0, infinities and edges saturated."""
    info = np.iinfo(dtype)
    edges = [info.min - 0.5, info.min - 1.5, info.max + 0.5, info.max - 0.5, 0.5, 1.5, -0.5, -2.5,
             np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0, -0.0]
    rng = np.random.default_rng(4)
    values = np.concatenate([edges, rng.standard_normal(500) * info.max]).astype(source)
    wide = np.clip(np.nan_to_num(np.rint(values.astype(np.float64)), nan=0.0, posinf=info.max, neginf=info.min),
                   info.min, info.max).astype(dtype)
    got = convert(values, dtype)
    assert got.dtype == dtype and got.tobytes() == wide.tobytes()


def test_a_masked_store_marks_only_what_it_stores():
    pad = Scratchpad(0, "vec", 64)
    view = View("vec", 0, 8, 1)
    where = np.zeros((1, 8), bool)
    where[0, :4] = True
    pad.write(view, np.ones((1, 8), np.float32), where=where)
    with pytest.raises(Trap, match=r"never-written L0 vec\[4\]"):
        pad.read(view, 1, 8)
    pad.write(view, np.ones((1, 8), np.float32))
    pad.write(view, np.ones((1, 8), np.float32))       # written already: nothing new to mark
    assert pad.read(view, 1, 8).sum() == 8


class _Told:
    """A watch that keeps the scratchpad accesses it is told of."""

    def __init__(self):
        self.spads = []

    def spad(self, *access):
        self.spads.append(access)


def _accumulating_machine(values: np.ndarray):
    program = parse(SPANNED)
    m = Machine(program, ARCH)
    view = View("acc", 3, 40, 2)           # a strided window of every other element
    m.write(1, view, values)
    m.watch = _Told()
    return m, view


def test_an_accumulation_in_place_is_the_read_plus_the_write():
    """add_into leaves the bytes, the written marks and the told accesses that a read, a sum
    and a write leave, int32 wrapping included."""
    rng = np.random.default_rng(5)
    old = rng.integers(-2 ** 31, 2 ** 31, (3, 6, 8), dtype=np.int64).astype(np.int32)
    old[0, 0, 0] = 2 ** 31 - 1
    add = rng.integers(-2 ** 31, 2 ** 31, (3, 6, 8), dtype=np.int64).astype(np.int32)
    plain, view = _accumulating_machine(old)
    plain.write(1, view, plain.read(1, view, 6, 8, 3) + add)
    fast, _ = _accumulating_machine(old)
    fast.add_into(1, view, add)
    for space in ("acc", "vec"):
        assert fast.banks[space].data.tobytes() == plain.banks[space].data.tobytes()
        assert fast.banks[space].written.tobytes() == plain.banks[space].written.tobytes()
    assert fast.watch.spads == plain.watch.spads
    wrapped = (2 ** 31 - 1 + int(add[0, 0, 0]) + 2 ** 31) % 2 ** 32 - 2 ** 31
    assert fast.read(1, view, 6, 8, 3)[0, 0, 0] == wrapped


def test_an_accumulation_into_never_written_elements_traps_and_changes_nothing():
    m, view = _accumulating_machine(np.zeros((1, 6, 8), np.int32))
    before = m.banks["acc"].data.copy()
    with pytest.raises(Trap, match="never-written L2 acc"):
        m.add_into(1, view, np.ones((2, 6, 8), np.int32))     # Legion 2's window was never written
    assert m.banks["acc"].data.tobytes() == before.tobytes()
    assert m.watch.spads == []
    bank = Bank("acc", 2, 32)
    with pytest.raises(Trap, match="hits some element twice"):
        bank.add_into(0, View("acc", 0, 1, 1), np.ones((1, 4, 4), np.int32))


@pytest.mark.parametrize("dests", [{0, 1, 2, 3, 4, 5, 6, 7}, {2, 3, 5, 7}, {6}, {1, 9}])
def test_a_multicast_is_the_stores_one_destination_after_the_other(dests):
    """Runs of consecutive Legions stored at once leave the bytes, written marks and told
    accesses of one store per destination; a Legion the machine lacks traps as those do."""
    rng = np.random.default_rng(len(dests))
    values = rng.integers(-128, 128, (1, 5, 12)).astype(np.int8)
    view = View("act", 7, 30, 2)
    got = []
    for send in ("plain", "multicast"):
        m = Machine(parse(SPANNED), ARCH)
        m.watch = _Told()
        try:
            if send == "plain":
                for legion in sorted(dests):
                    m.write(legion, view, values)
            else:
                m.multicast(dests, view, values)
            error = None
        except Trap as e:
            error = str(e)
        got.append((m.banks["act"].data.tobytes(), m.banks["act"].written.tobytes(), m.watch.spads, error))
    assert got[0] == got[1]
    assert (got[0][3] is not None) == (9 in dests)


def _move_machine(src: View, dst: View, dests, deliver: str):
    """A machine after a noc.mv of a 4 x 8 window from Legion 1 (act), every destination's
    stores made by ``deliver``: "multicast" as the emulator chooses, "plain" one by one."""
    import runtime.semantics as semantics
    from isa.instructions import NocMove
    m = Machine(parse(SPANNED), ARCH)
    start = np.arange(8 * 64, dtype=np.int64).reshape(8, 64) % 251 - 120
    m.write(0, View("act", 0, 64, 1), start.reshape(8, 1, 64).astype(np.int8))
    m.watch = _Told()
    move = NocMove(legion=1, dests=frozenset(dests), dst=dst, src=src, rows=4, cols=8)
    if deliver == "plain":
        values = m.read(1, src, 4, 8, 1)
        for legion in sorted(dests):
            m.write(legion, dst, values)
    else:
        semantics.noc_move(m, move)
    return m.banks["act"].data.tobytes(), m.watch.spads


@pytest.mark.parametrize("dst", [View("act", 0, 16, 1), View("act", 40, 16, 1), View("act", 4, 16, 1),
                                 View("act", 2, 8, 1)])
def test_a_move_onto_its_own_source_stores_as_one_destination_after_the_other(dst):
    """A move whose own Legion is a destination: its window elsewhere, the same window, or one
    that overlaps it (each later destination then gets what the earlier stores left)."""
    src = View("act", 0, 16, 1)
    for dests in ({0, 1, 2, 3}, {1, 2}, {3, 4}):
        assert _move_machine(src, dst, dests, "multicast") == _move_machine(src, dst, dests, "plain")


def test_ranks_told_apart_share_no_element():
    """A store's ranks are written at once only when no two share an element (enumerated),
    and the ranks side by side in the rows of a wider matrix are told apart."""
    for span in (2, 3, 8):
        for rows in (1, 2, 5):
            for cols in (1, 3, 4):
                for rs in (0, 3, 4, 12, 13, 40):
                    for lstride in (0, 1, 3, 4, 5, 12, 40, 200):
                        ranks = [{r * lstride + i * rs + j for i in range(rows) for j in range(cols)}
                                 for r in range(span)]
                        if _ranks_apart(span, rows, cols, rs, lstride):
                            assert sum(map(len, ranks)) == len(set().union(*ranks))
    assert _ranks_apart(8, 64, 16, 2560, 16) and not _ranks_apart(8, 64, 16, 100, 16)


def test_a_store_of_ranks_side_by_side_is_the_stores_rank_by_rank():
    from isa.fields import DramRef
    program = parse(SPANNED)
    rng = np.random.default_rng(4)
    values = rng.standard_normal((4, 3, 16)).astype(np.float32)
    ref = DramRef(1, 5, 128)                      # y: 3 rows of 4 ranks of 16, then a gap
    at_once, by_rank = Machine(program, ARCH), Machine(program, ARCH)
    at_once.dram_write(ref, values, 16)
    for r in range(4):
        by_rank.dram_write(DramRef(1, 5 + 16 * r, 128), values[r:r + 1])
    assert at_once.dram[1].tobytes() == by_rank.dram[1].tobytes()
    assert np.count_nonzero(at_once.dram[1]) == values.size


def _vector_machine(cls, dst: View, a: View, b, deliver: str):
    """The scratchpads after ``cls`` (span 2, 3 x 5, dst and operands maybe sharing elements) on values
    with NaN, infinities, signed zeros and subnormals: computed into the destination ("fast")
    or stored as a separate result ("plain")."""
    from runtime import semantics
    rng = np.random.default_rng(7)
    m = Machine(parse(SPANNED), ARCH)
    start = rng.standard_normal((2, 1, 200)).astype(np.float32) * np.float32(1e3)
    start[:, 0, ::7] = ([np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-42, -3.5, 2.5, 0.5, -0.5] * 3)[:29]
    m.write(0, View("vec", 0, 200, 1), start)
    m.watch = _Told()
    binary = issubclass(cls, semantics.VBinary)
    fields = dict(legion=0, dst=dst, a=a, rows=3, cols=5, span=2)
    i = cls(**fields, b=b) if binary else cls(**fields)
    if deliver == "fast":
        semantics.execute(m, i)
    else:
        with np.errstate(all="ignore"):
            ops = [semantics._operand(m, i, x, 3, 5) for x in ((a, b) if binary else (a,))]
            m.write(0, dst, semantics._shaped(m, i, cls.FUNC(*ops), 3, 5))
    return [(bank.data.tobytes(), bank.written.tobytes()) for bank in m.banks.values()], m.watch.spads


@pytest.mark.parametrize("mnemonic", ["vadd", "vsub", "vmul", "vdiv", "vneg", "vabs", "vround", "vfloor",
                                      "vceil", "vtrunc", "vsqrt", "vmax", "vexp"])
def test_a_vector_result_computed_into_its_window_is_the_stored_result(mnemonic):
    from isa.instructions import BY_MNEMONIC
    cls = BY_MNEMONIC[mnemonic]
    for dst, a, b in [(View("vec", 100, 10, 1), View("vec", 0, 10, 1), View("vec", 50, 12, 2)),
                      (View("vec", 2, 10, 1), View("vec", 0, 10, 1), View("vec", 4, 10, 1)),   # overlapping
                      (View("vec", 0, 10, 1), View("vec", 0, 10, 1), 2.5),                     # in place
                      (View("vec", 100, 10, 1), View("vec", 3, 0, 1), -0.0),                   # broadcast row
                      (View("vec", 100, 10, 1), 1.5, -0.0),                                    # two immediates
                      (View("act", 30, 10, 1), 2.5, 3.0),                                      # ... into int8
                      (View("act", 30, 10, 1), View("vec", 3, 0, 1), 0.5)]:                    # a row into int8
        assert _vector_machine(cls, dst, a, b, "fast") == _vector_machine(cls, dst, a, b, "plain")


@pytest.mark.parametrize("mnemonic", ["vrsum", "vrmax", "vrmin"])
@pytest.mark.parametrize("rows, cols, rs", [(1, 2560, 2560), (1, 129, 0), (11, 88, 256), (20, 64, 64), (3, 300, 7)])
def test_a_reduction_of_every_rank_at_once_rounds_as_each_rank_alone(mnemonic, rows, cols, rs):
    """Rows contiguous, the ranks of a spanned reduction are reduced in one call: the same
    bits, NaN, signed zeros and magnitudes far apart included, as the rank-by-rank loop."""
    from isa.instructions import BY_MNEMONIC
    from runtime import semantics
    cls = BY_MNEMONIC[mnemonic]
    rng = np.random.default_rng(8)
    m = Machine(parse(SPANNED), ARCH)
    start = (rng.standard_normal((8, 1, 9000)) * 10.0 ** rng.integers(-6, 6, (8, 1, 9000))).astype(np.float32)
    start[:, 0, ::11], start[:, 0, ::13], start[:, 0, 5::4001] = -0.0, 0.0, np.nan
    m.write(0, View("vec", 0, 9000, 1), start)
    i = cls(legion=0, dst=View("vec", 9500, 1, 1), a=View("vec", 0, rs, 1), rows=rows, cols=cols, span=8)
    semantics.execute(m, i)
    a = m.read(0, i.a, rows, cols, 8)
    with np.errstate(all="ignore"):
        alone = np.stack([np.asarray(cls.FUNC(x), np.float32) for x in a])
    assert m.read(0, i.dst, rows, 1, 8).tobytes() == alone.reshape(8, rows, 1).tobytes()


# --- the race check's DRAM table ---------------------------------------------------------------

def _random_window(rng):
    rs = int(rng.choice([0, 4, 8, 16]))
    rows = 1 if rs == 0 else int(rng.integers(1, 5))
    cols = int(rng.integers(1, max(2, rs or 8)))
    cs = int(rng.choice([1, 1, 1, 2]))
    return (int(rng.integers(0, 64)), rows, cols, rs, cs)


def _access(win, k, rng):
    lo, hi = _bounds(win)
    return (lo, hi, k, int(rng.integers(0, 4)), int(rng.integers(1, 9)), bool(rng.integers(0, 2)),
            win, _rectangle(win))


def _meeting(kept: list, lo: int, hi: int, rect) -> list:
    """The accesses of ``kept`` (oldest first) that may meet [lo, hi], by lowest element."""
    near = [a for a in kept if a[1] >= lo and a[0] <= hi and not _apart(rect, a[7])]
    return sorted(near, key=lambda a: a[0])


def test_the_dram_table_finds_the_accesses_a_plain_list_finds():
    """The table kept through adds, drops and sweeps names the accesses a plain list scanned
    in full names, in the same order, for every probe."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        slow, fast = [], WideLedger()
        for k in range(60):
            win = _random_window(rng)
            lo, hi = _bounds(win)
            rect = _rectangle(win)
            found = _meeting(slow, lo, hi, rect)
            assert found == [fast.items[n] for n in fast.meeting(lo, hi, rect)]
            if found and rng.integers(0, 3) == 0:
                gone = found[int(rng.integers(0, len(found)))]
                slow.remove(gone)
                fast.drop([fast.items.index(gone)])
            access = _access(win, k, rng)
            slow.append(access)
            fast.add(access)
            if k % 16 == 15:
                floor = rng.integers(0, 9, 4).tolist()
                slow = [a for a in slow if floor[a[3]] < a[4]]
                fast.keep(floor)
                assert slow == fast.items


# --- costs, knowledge, fdot ----------------------------------------------------------------------

SPANNED = """.arch dlegion-8x8
.tensor x f32[8,64] input "x"
.tensor y f32[8,64] output "y"
dma.ld L0 {0} vec[0,64,1] @x[0,64] rows=1 cols=64 span=8 lstride=64
vmul L0 vec[64,64,1] vec[0,64,1] #2 rows=1 cols=64 span=8 wait=dma
dma.st L0 @y[0,64] vec[64,64,1] rows=1 cols=64 span=8 lstride=64 wait=vec
"""


def test_a_spanned_instruction_is_costed_once_for_the_same_costs():
    tasks = verify(parse(SPANNED), ARCH)
    env = Env(tuple(tasks.tensors), _masks(tasks))
    assert len(tasks.instrs) == 24
    assert _costs(tasks, ARCH).per_task() == [cost(i, ARCH, env) for i in tasks.instrs]


def test_knowledge_in_program_order_is_knowledge_in_dependency_order():
    order = Order(verify(parse(SPANNED), ARCH), ARCH)
    deps = [order._deps(k) for k in range(len(order.queue))]
    assert _depth_first(deps) == list(range(len(deps)))      # every wait names an earlier task


def test_knowledge_of_a_wait_for_a_later_instruction():
    """A hand-written program may wait for an instruction dispatched after it."""
    p = parse(""".arch dlegion-tiny
.tensor x f32[4,8] input "x"
vadd L0 vec[0,8,1] vec[0,8,1] #1 rows=1 cols=8 wait=L1.vec>=1
vadd L1 vec[0,8,1] vec[0,8,1] #1 rows=1 cols=8
""")
    o = Order(p, load("dlegion-tiny"))
    assert o.known[0, o.qid(1, "vec")] == 1 and o.known[1].sum() == 0


def _hard_products(rng, trial):
    K = int(rng.integers(2, 40))
    a = (rng.standard_normal((8, K)) * 10.0 ** rng.integers(-40, 38)).astype(np.float32)
    b = (rng.standard_normal((K, 8)) * 10.0 ** rng.integers(-40, 10)).astype(np.float32)
    if trial % 3 == 0:    # small integers times a power of two: exact sums, many on powers of two
        a = rng.integers(-3, 4, (8, K)).astype(np.float32)
        b = rng.integers(-3, 4, (K, 8)).astype(np.float32) * np.float32(2.0 ** -int(rng.integers(0, 140)))
    if trial % 7 == 0:
        a[0, 0], b[1, 2] = np.inf, np.nan
    if trial % 11 == 0:
        a[:], b[:] = np.float32(3e38), 1      # sums past fp32's largest value
    return a.astype(np.float64), b.astype(np.float64)


def test_the_quick_rounding_test_agrees_with_the_midpoints():
    rng = np.random.default_rng(2)
    with np.errstate(all="ignore"):
        for trial in range(600):
            a, b = _hard_products(rng, trial)
            s = a @ b
            out = s.astype(np.float32)
            err = (np.abs(a) @ np.abs(b)) * (2.0 * a.shape[1] * 2.0 ** -53)
            alike = fdot._rounds_alike(s, err, out)
            # As tight as the midpoints wherever the result is finite; past fp32's largest
            # value, an interval that rounds to infinity at both ends is passed as well.
            finite = np.isfinite(out)
            np.testing.assert_array_equal(alike[finite], fdot._within_edges(s, err, out)[finite])
            # Sound: wherever it passes the rounded fp64 sum, that is the exact sum rounded.
            for m, n in zip(*np.nonzero(alike & np.isfinite(s))):
                assert fdot._exact_dot(a[m], b[:, n]) == out[m, n]


def test_the_row_bound_covers_every_element_of_its_row():
    """fdot's bound per row is at least the elementwise one (|a_m| |b_n| per element, the
    Cauchy-Schwarz bound on sum |a_k b_k|) wherever a column is finite, batched or not, and an infinite or NaN
    column does not reach the others' bound."""
    rng = np.random.default_rng(3)
    with np.errstate(all="ignore"):
        for trial in range(200):
            a, b = _hard_products(rng, trial)
            a, b = (a, b) if trial % 2 else (np.stack([a, a[::-1]]), np.stack([b, -b]))
            k = a.shape[-1]
            err = np.broadcast_to(fdot._row_bounds(a, b, k), (a @ b).shape)
            # Cauchy-Schwarz per element: |a_m| |b_n|, with the same margin
            rows = np.sqrt(np.einsum("...k,...k->...", a, a))[..., :, None]
            cols = np.sqrt(np.einsum("...kn,...kn->...n", b, b))[..., None, :]
            elementwise = rows * cols * (2.0 * k * 2.0 ** -53)
            finite = np.broadcast_to(np.isfinite(b).all(axis=-2, keepdims=True), err.shape) & np.isfinite(elementwise)
            assert (err[finite] >= elementwise[finite]).all()
    b = np.ones((4, 3))
    b[0, 1] = np.inf
    assert np.isfinite(fdot._row_bounds(np.ones((2, 4)), b, 4)).all()


def test_a_sum_on_a_midpoint_is_left_to_the_exact_sum():
    one = np.float32(1)
    tie = np.array([[1.0 + 2.0 ** -24]])          # halfway between 1 and the fp32 after it
    for s in (tie, -tie, np.array([[1.0 - 2.0 ** -25]])):
        out = s.astype(np.float32)
        assert not fdot._rounds_alike(s, np.zeros_like(s), out)[0, 0]
    assert fdot._rounds_alike(np.array([[1.0 + 2.0 ** -30]]), np.zeros((1, 1)), np.array([[one]]))[0, 0]
