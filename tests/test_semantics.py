"""One test per instruction family against a numpy reference (integers exact), plus traps."""
from dataclasses import dataclass
from itertools import product

import numpy as np
import pytest

from isa.arch import MODE_BITS
from isa.fields import Cond, DramRef, View
from isa.instructions import (BY_MNEMONIC, INSTRUCTIONS, VECTOR_FUNCS, Barrier, DmaLoad, DmaStore,
                              Drain, Gather, Instr, MatMul, VBinary, VMatMul, VSelect, Wait)
from isa.program import ProgramError, pack, unpack
from runtime.semantics import execute, handler_for, unpack_weights
from runtime.state import Trap, overlaps
from progbuild import Builder

L0 = 0


def run(machine):
    for instr in machine.program.instrs:
        execute(machine, instr)
    return machine


def put(machine, legion, space, addr, rs, values, cs=1):
    machine.write(legion, View(space, addr, rs, cs), np.asarray(values)[None])


def spad(machine, legion, space, addr, rs, rows, cols, cs=1):
    return np.array(machine.read(legion, View(space, addr, rs, cs), rows, cols)[0])


def wrap32(x):
    return np.asarray(x, np.int64).astype(np.int32)


# --- matrix ----------------------------------------------------------------------------------

def random_weights(rng, mode, shape):
    half = 1 << (MODE_BITS[mode] - 1)
    return rng.integers(-half, half, size=shape)


def pack_row(values, mode):
    return pack(values, "i8").view(np.uint8) if mode == "w8" else pack(values, mode)


def matmul_case(rng, mode, mask, accumulate, M=12, K=40, N=24, arch="dlegion-tiny"):
    """A machine holding act, wgt (strided rows) and acc, plus the mm instruction and reference."""
    b = Builder(arch)
    n = b.arch.array
    a = rng.integers(-128, 128, size=(M, K))
    w = random_weights(rng, mode, (K, N))
    blocks = (rng.random((-(-K // n), -(-N // n))) < 0.6).astype(np.uint8)
    mask_id = b.tensor("mask", "u8", blocks.shape, "const", values=blocks) if mask else None
    row_bytes = -(-N * MODE_BITS[mode] // 8)
    wgt = View("wgt", 5, row_bytes + 3)
    acc, act = View("acc", 7, N + 2), View("act", 3, K + 1)
    b.add(MatMul(L0, acc, act, wgt, M, K, N, mode, "k", accumulate, mask_id))
    m = b.machine()
    put(m, L0, "act", act.addr, act.rs, a.astype(np.int8))
    put(m, L0, "wgt", wgt.addr, wgt.rs, np.stack([pack_row(r, mode) for r in w]))
    old = rng.integers(-2**31, 2**31, size=(M, N))
    put(m, L0, "acc", acc.addr, acc.rs, old.astype(np.int32))
    kept = np.kron(blocks, np.ones((n, n), np.int64))[:K, :N] if mask else 1
    ref = a @ (w * kept)
    return m, acc, wrap32(ref + old if accumulate == "add" else ref)


@pytest.mark.parametrize("mode,mask,accumulate",
                         list(product(["w8", "w4", "w2"], [False, True], ["set", "add"])))
def test_matmul_exact_in_every_mode(mode, mask, accumulate):
    m, acc, ref = matmul_case(np.random.default_rng(1), mode, mask, accumulate)
    run(m)
    np.testing.assert_array_equal(spad(m, L0, "acc", acc.addr, acc.rs, *ref.shape), ref)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("M", [3, 12])
def test_a_spanned_matmul_is_exact_on_each_legion(shared, M):
    """Both Legions of a span=2 matmul, with the same activations (one wide product) or not."""
    rng = np.random.default_rng(M)
    K, N = 24, 16
    b = Builder()
    acc, act, wgt = View("acc", 0, N), View("act", 0, K), View("wgt", 0, N // 4)
    b.add(MatMul(L0, acc, act, wgt, M, K, N, "w2", "k", "set", None, span=2))
    m = b.machine()
    refs, first = [], rng.integers(-128, 128, size=(M, K))
    for legion in (0, 1):
        a = first if legion == 0 or shared else rng.integers(-128, 128, size=(M, K))
        w = random_weights(rng, "w2", (K, N))
        put(m, legion, "act", 0, K, a.astype(np.int8))
        put(m, legion, "wgt", 0, N // 4, np.stack([pack_row(r, "w2") for r in w]))
        refs.append(wrap32(a @ w))
    run(m)
    for legion, ref in enumerate(refs):
        np.testing.assert_array_equal(spad(m, legion, "acc", 0, N, M, N), ref)


@pytest.mark.parametrize("mode", ["w8", "w4", "w2"])
def test_matmul_ragged_shapes(mode):
    m, acc, ref = matmul_case(np.random.default_rng(8), mode, True, "add", M=3, K=13, N=10)
    run(m)
    np.testing.assert_array_equal(spad(m, L0, "acc", acc.addr, acc.rs, *ref.shape), ref)


@pytest.mark.parametrize("mode", ["w4", "w2"])
@pytest.mark.parametrize("row_bytes", [512, 7])
def test_unpack_weights_matches_unpack(mode, row_bytes):
    """By byte pairs (an even row) or bytes (an odd one), on every byte value in both places of
    a pair, on rows of a wider window, a broadcast (zero-stride) span and rows in reverse
    order, into fresh memory or a buffer kept by shape (the same one for the third)."""
    rng = np.random.default_rng(row_bytes)
    every = np.stack([np.arange(256), rng.permutation(256)], axis=1).reshape(-1)
    packed = np.concatenate([every, rng.integers(0, 256, 3 * 1024)]).astype(np.uint8)
    rows = packed[:5 * (row_bytes + 3)].reshape(5, row_bytes + 3)[:, 1:row_bytes + 1]
    buffers = {}
    for span in (rows[None], np.broadcast_to(rows, (3, *rows.shape)), rows[None, ::-1]):
        ref = unpack(np.ascontiguousarray(span), mode)
        np.testing.assert_array_equal(unpack_weights(span, mode), ref)
        np.testing.assert_array_equal(unpack_weights(span, mode, buffers), ref)   # the first's buffer again
    assert len(buffers) == 2
    whole = packed[:len(packed) // 2 * 2].reshape(1, 1, -1)
    np.testing.assert_array_equal(unpack_weights(whole, mode, buffers), unpack(whole, mode))


@pytest.mark.parametrize("K", [1100, 1101, 3001])
def test_matmul_beyond_fp32_exactness_is_still_exact(K):
    # 126 * 126 * K > 2**24: odd partial sums that one fp32 product would round.
    rng = np.random.default_rng(2)
    a = np.full((4, K), 127) - rng.integers(0, 2, size=(4, K))
    w = np.full((K, 8), 127) - rng.integers(0, 2, size=(K, 8))
    b = Builder()
    b.add(MatMul(L0, View("acc", 0, 8), View("act", 0, K), View("wgt", 0, 8),
                 4, K, 8, "w8", "n", "set", None))
    m = b.machine()
    put(m, L0, "act", 0, K, a.astype(np.int8))
    put(m, L0, "wgt", 0, 8, w.astype(np.int8).view(np.uint8))
    run(m)
    ref = a @ w
    assert not np.array_equal((a.astype(np.float32) @ w.astype(np.float32)).astype(np.int64), ref)
    np.testing.assert_array_equal(spad(m, L0, "acc", 0, 8, 4, 8), ref)


def test_matmul_add_wraps_like_int32():
    b = Builder()
    b.add(MatMul(L0, View("acc", 0, 8), View("act", 0, 8), View("wgt", 0, 8),
                 1, 8, 8, "w8", "k", "add", None))
    m = b.machine()
    put(m, L0, "act", 0, 8, np.full((1, 8), 127, np.int8))
    put(m, L0, "wgt", 0, 8, np.full((8, 8), 127, np.uint8))
    put(m, L0, "acc", 0, 8, np.full((1, 8), 2**31 - 10, np.int32))
    run(m)
    assert (spad(m, L0, "acc", 0, 8, 1, 8) == -2**31 - 10 + 8 * 127 * 127).all()


def test_matmul_mode_missing_from_arch_traps():
    m, _, _ = matmul_case(np.random.default_rng(3), "w4", False, "set", arch="ws-64")
    with pytest.raises(Trap, match="mode w4 is not supported by ws-64"):
        run(m)


# --- DMA -------------------------------------------------------------------------------------

LOAD_CASES = [  # DRAM dtype, values, space, expected scratchpad values
    ("i8", [[-128, 5], [127, -1]], "act", [[-128, 5], [127, -1]]),
    ("i8", [[-1, 2]], "wgt", [[255, 2]]),                       # raw bytes
    ("w2", [[-2, -1, 0, 1]], "wgt", [[0b01001110]]),
    ("u8", [[255, 0]], "vec", [[255.0, 0.0]]),
    ("i64", [[2**40, -3]], "vec", [[np.float32(2**40), -3.0]]),
    ("i32", [[2**31 - 1, -7]], "acc", [[2**31 - 1, -7]]),
    ("f32", [[0.1, -2.5]], "vec", [[np.float32(0.1), -2.5]]),
]


@pytest.mark.parametrize("dtype,values,space,expected", LOAD_CASES)
def test_dma_load_converts_and_multicasts(dtype, values, space, expected):
    b = Builder()
    values = np.array(values)
    t = b.tensor("t", dtype, values.shape, "const", values=values)
    exp = np.array(expected)
    rows, cols = exp.shape
    dst = View(space, 10, 7, 2)
    b.add(DmaLoad(L0, frozenset({0, 1}), dst, DramRef(t, 0, cols), rows, cols))
    m = run(b.machine())
    for legion in (0, 1):
        np.testing.assert_array_equal(spad(m, legion, space, 10, 7, rows, cols, cs=2), exp)


def test_dma_load_strided_rows():
    b = Builder()
    x = np.arange(-24, 24).reshape(6, 8)
    t = b.tensor("x", "i8", x.shape, "input")
    b.add(DmaLoad(1, frozenset({1}), View("act", 0, 3), DramRef(t, 9, 16), 3, 3))
    m = b.machine()
    m.set_input("x", x.astype(np.int8))
    run(m)
    np.testing.assert_array_equal(spad(m, 1, "act", 0, 3, 3, 3), x[1::2, 1:4])


STORE_CASES = [  # space, scratchpad values, DRAM dtype, expected tensor
    ("vec", [0.5, 1.5, 2.5, -0.5, -1.5, 200.7, -300, np.nan, np.inf, -np.inf], "i8",
     [0, 2, 2, 0, -2, 127, -128, 0, 127, -128]),
    ("vec", [-3, 254.5, 255.5, 1e9], "u8", [0, 254, 255, 255]),
    ("vec", [3e9, -3e9, 2.5, np.nan], "i32", [2**31 - 1, -2**31, 2, 0]),
    ("vec", [1e19, -1e19, 3.5, -2**40], "i64", [2**63 - 1, -2**63, 4, -2**40]),
    ("wgt", [255, 128, 1], "i8", [-1, -128, 1]),                  # raw bytes
    ("acc", [2**31 - 1, -5], "i32", [2**31 - 1, -5]),
]


@pytest.mark.parametrize("space,values,dtype,expected", STORE_CASES)
def test_dma_store_rounds_half_even_and_saturates(space, values, dtype, expected):
    b = Builder()
    n = len(values)
    t = b.tensor("y", dtype, [1, n], "output")
    b.add(DmaStore(1, DramRef(t, 0, n), View(space, 4, n, 1), 1, n))
    m = b.machine()
    dtype_of_space = {"vec": np.float32, "wgt": np.uint8, "acc": np.int32}[space]
    put(m, 1, space, 4, n, np.array([values], dtype_of_space))
    run(m)
    np.testing.assert_array_equal(m.get("y"), [expected])


def test_dma_load_disallowed_pair_traps():
    b = Builder()
    t = b.tensor("t", "f32", [1, 4], "const", values=np.zeros(4))
    b.add(DmaLoad(L0, frozenset({0}), View("act", 0, 4), DramRef(t, 0, 4), 1, 4))
    with pytest.raises(Trap, match="cannot load into act a f32 tensor"):
        run(b.machine())


def test_dram_access_past_the_tensor_traps():
    b = Builder()
    t = b.tensor("t", "i8", [4, 4], "const", values=np.zeros(16))
    b.add(DmaLoad(L0, frozenset({0}), View("act", 0, 4), DramRef(t, 4, 4), 4, 4))
    with pytest.raises(Trap, match=r"@t\[4\.\.19\].*outside tensor t of 16"):
        run(b.machine())


# --- gather ----------------------------------------------------------------------------------

def gather_machine(ids, space="vec", dtype="f32"):
    b = Builder()
    table = np.random.default_rng(4).integers(-100, 100, size=(10, 6))
    t = b.tensor("emb", dtype, table.shape, "const", values=table)
    b.add(Gather(L0, View(space, 100, 7), DramRef(t, 1, 6), View("vec", 0, 1), len(ids), 6))
    m = b.machine()
    put(m, L0, "vec", 0, 1, np.array(ids, np.float32)[:, None])
    return m, table


@pytest.mark.parametrize("space,dtype", [("vec", "f32"), ("act", "i8")])
def test_gather_copies_rows(space, dtype):
    ids = [3, 0, 8, 3]
    m, table = gather_machine(ids, space, dtype)
    run(m)
    # Offset 1 shifts every row by one element into the next, so only rows 0..8 fit.
    rows = table.reshape(-1)[1 + 6 * np.array(ids)[:, None] + np.arange(6)]
    np.testing.assert_array_equal(spad(m, L0, space, 100, 7, 4, 6), rows)


@pytest.mark.parametrize("bad", [9, -1, 2.5, np.nan])
def test_gather_bad_id_traps(bad):
    m, _ = gather_machine([1, bad])
    with pytest.raises(Trap, match=r"id .* \(row 1\) is not a row of table emb, which has 9"):
        run(m)


# --- drain -----------------------------------------------------------------------------------

def test_drain_applies_every_operand_in_order():
    rng = np.random.default_rng(5)
    M, N = 5, 12
    acc = rng.integers(-2**31, 2**31, size=(M, N)).astype(np.int32)
    acc[0, 0] = 2**31 - 1
    zp = rng.integers(-1000, 1000, size=N).astype(np.int32)
    zp[0] = 5                                            # wraps acc[0, 0]
    rscale, cscale, bias = (rng.standard_normal(k).astype(np.float32) for k in (M, N, N))
    old = rng.standard_normal((M, N)).astype(np.float32)
    b = Builder()
    b.add(Drain(L0, View("vec", 1000, N + 1), View("acc", 0, N), M, N, 500, 0, 100, 200, "add"))
    m = b.machine()
    put(m, L0, "acc", 0, N, acc)
    put(m, L0, "acc", 500, N, zp[None])
    for addr, v in ((0, rscale), (100, cscale), (200, bias)):
        put(m, L0, "vec", addr, len(v), v[None])
    put(m, L0, "vec", 1000, N + 1, old)
    run(m)
    v = (acc + zp).astype(np.float32) * rscale[:, None] * cscale + bias
    np.testing.assert_array_equal(spad(m, L0, "vec", 1000, N + 1, M, N), old + v)
    assert (acc + zp)[0, 0] == -2**31 + 4


def test_drain_to_act_without_operands_rounds_and_saturates():
    acc = np.array([[1, -300, 300, 0, -7]], np.int32)
    b = Builder()
    b.add(Drain(L0, View("act", 0, 5), View("acc", 0, 5), 1, 5, None, None, None, None, "add"))
    m = b.machine()
    put(m, L0, "acc", 0, 5, acc)
    put(m, L0, "act", 0, 5, np.array([[1, 0, 0, 127, -128]], np.int8))
    run(m)
    np.testing.assert_array_equal(spad(m, L0, "act", 0, 5, 1, 5), [[2, -128, 127, 127, -128]])


# --- vector ----------------------------------------------------------------------------------

def _f(x):
    return np.float32(x)


def _b(x):
    return np.asarray(x, np.float32)


REFERENCE = {  # independent spellings of each vector function in numpy float32
    "vmov": lambda a: a, "vneg": lambda a: -a, "vabs": np.fabs,
    "vrelu": lambda a: np.where((a > 0) | np.isnan(a), a, _f(0)),
    "vround": np.round, "vfloor": np.floor,
    "vceil": np.ceil, "vtrunc": np.fix, "vsign": np.sign, "visnan": lambda a: _b(a != a),
    "visinf": lambda a: _b(np.abs(a) == np.inf), "vnot": lambda a: _b(a == 0),
    "vexp": np.exp, "vlog": np.log, "vsqrt": np.sqrt, "vrsqrt": lambda a: _f(1) / np.sqrt(a),
    "vrecip": np.reciprocal, "vsigmoid": lambda a: _f(1) / (_f(1) + np.exp(-a)),
    "vtanh": np.tanh, "vsin": np.sin, "vcos": np.cos,
    "vadd": lambda a, b: a + b, "vsub": lambda a, b: a - b, "vmul": lambda a, b: a * b,
    "vmax": lambda a, b: np.where(np.isnan(a) | np.isnan(b), np.nan, np.fmax(a, b)),
    "vmin": lambda a, b: np.where(np.isnan(a) | np.isnan(b), np.nan, np.fmin(a, b)),
    "veq": lambda a, b: _b(a == b), "vlt": lambda a, b: _b(a < b), "vle": lambda a, b: _b(a <= b),
    "vgt": lambda a, b: _b(a > b), "vge": lambda a, b: _b(a >= b),
    "vand": lambda a, b: _b(np.logical_and(a, b)), "vor": lambda a, b: _b(np.logical_or(a, b)),
    "vdiv": lambda a, b: a / b, "vpow": lambda a, b: a ** b, "vfmod": np.fmod,
    "vrsum": lambda a: np.add.reduce(a, axis=1, dtype=np.float32),
    "vrmax": lambda a: a.max(axis=1), "vrmin": lambda a: a.min(axis=1),
}


def vector_operands(rows, cols):
    rng = np.random.default_rng(6)
    a = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    b = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    a[0, :4] = [0.0, 2.5, -0.5, np.nan]
    b[0, :4] = [0.0, 1.0, np.inf, 1.0]
    b[1, :2] = a[1, :2]                                    # some equal pairs
    return a, b


@pytest.mark.parametrize("cls", VECTOR_FUNCS, ids=lambda c: c.MNEMONIC)
def test_vector_function_matches_numpy(cls):
    rows, cols = 3, 10
    a, b = vector_operands(rows, cols)
    va, vb, vd = View("vec", 0, 11), View("vec", 100, 1, 3), View("vec", 200, 12, 1)
    if issubclass(cls, VBinary):
        instr = cls(L0, vd, va, vb, rows, cols)
        with np.errstate(all="ignore"):
            ref = REFERENCE[cls.MNEMONIC](a, b)
    else:
        instr = cls(L0, vd, va, rows, cols)
        with np.errstate(all="ignore"):
            ref = REFERENCE[cls.MNEMONIC](a)
    ref = np.asarray(ref, np.float32).reshape(rows, -1)
    b_ = Builder()
    m = b_.machine()
    put(m, L0, "vec", 0, 11, a)
    put(m, L0, "vec", 100, 1, b, cs=3)
    execute(m, instr)
    np.testing.assert_array_equal(spad(m, L0, "vec", 200, 12, *ref.shape), ref)


def test_vector_immediate_and_zero_stride_broadcast():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    row, col = np.float32([10, 20, 30, 40]), np.float32([1, 2, 3])
    b = Builder()
    vadd, vmul = BY_MNEMONIC["vadd"], BY_MNEMONIC["vmul"]
    b.add(vadd(L0, View("vec", 100, 4), View("vec", 0, 4), View("vec", 50, 0, 1), 3, 4),
          vmul(L0, View("vec", 100, 4), View("vec", 100, 4), View("vec", 60, 1, 0), 3, 4),
          vadd(L0, View("vec", 100, 4), View("vec", 100, 4), 0.5, 3, 4))
    m = b.machine()
    put(m, L0, "vec", 0, 4, a)
    put(m, L0, "vec", 50, 4, row[None])
    put(m, L0, "vec", 60, 3, col[None])
    run(m)
    np.testing.assert_array_equal(spad(m, L0, "vec", 100, 4, 3, 4), (a + row) * col[:, None] + 0.5)


def test_vector_op_reads_integer_spaces_and_rounds_into_them():
    b = Builder()
    vmov = BY_MNEMONIC["vmov"]
    b.add(vmov(L0, View("act", 0, 8), View("vec", 0, 8), 1, 8),
          vmov(L0, View("acc", 0, 4), View("vec", 8, 4), 1, 4),
          BY_MNEMONIC["vadd"](L0, View("vec", 20, 4), View("acc", 0, 4), View("act", 0, 1, 2),
                              1, 4))
    m = b.machine()
    put(m, L0, "vec", 0, 8, _b([[0.5, 1.5, -2.5, 126.5, 127.5, -128.5, np.nan, -np.inf]]))
    put(m, L0, "vec", 8, 4, _b([[3e9, -3e9, np.nan, 7.5]]))
    run(m)
    assert spad(m, L0, "act", 0, 8, 1, 8).tolist() == [[0, 2, -2, 126, 127, -128, 0, -128]]
    assert spad(m, L0, "acc", 0, 4, 1, 4).tolist() == [[2**31 - 1, -2**31, 0, 8]]
    expected = _b([2**31 - 1, -2**31, 0, 8]) + _b([0, -2, 127, 0])
    np.testing.assert_array_equal(spad(m, L0, "vec", 20, 4, 1, 4)[0], expected)


def test_vector_op_reads_its_operands_before_writing():
    b = Builder()
    vmov = BY_MNEMONIC["vmov"]
    b.add(vmov(L0, View("vec", 1, 8), View("vec", 0, 8), 1, 7))   # shift right by one in place
    m = b.machine()
    put(m, L0, "vec", 0, 8, np.arange(8, dtype=np.float32)[None])
    run(m)
    assert spad(m, L0, "vec", 0, 8, 1, 8).tolist() == [[0, 0, 1, 2, 3, 4, 5, 6]]


def test_vselect_keeps_dst_where_cond_is_zero():
    cond = _b([[1, 0, np.nan, 0], [0, -2, 0, 3]])
    a = _b([[10, 11, 12, 13], [14, 15, 16, 17]])
    b = Builder()
    b.add(VSelect(L0, View("vec", 100, 4), View("vec", 0, 4), View("vec", 50, 4), 2, 4),
          VSelect(L0, View("act", 0, 4), View("vec", 0, 4), -200.0, 2, 4))
    m = b.machine()
    put(m, L0, "vec", 0, 4, cond)
    put(m, L0, "vec", 50, 4, a)
    put(m, L0, "vec", 100, 4, np.full((2, 4), -1, np.float32))
    run(m)
    take = cond != 0
    np.testing.assert_array_equal(spad(m, L0, "vec", 100, 4, 2, 4), np.where(take, a, -1))
    assert (spad(m, L0, "act", 0, 4, 1, 1) == -128).all()
    with pytest.raises(Trap, match=r"never-written L0 act\[1\]"):
        m.read(L0, View("act", 0, 4), 2, 4)                # untaken elements stay unwritten


def test_reduce_to_a_column():
    a = np.random.default_rng(7).standard_normal((4, 9)).astype(np.float32)
    b = Builder()
    b.add(BY_MNEMONIC["vrmax"](L0, View("vec", 100, 3, 99), View("vec", 0, 9), 4, 9))
    m = b.machine()
    put(m, L0, "vec", 0, 9, a)
    run(m)
    np.testing.assert_array_equal(spad(m, L0, "vec", 100, 3, 4, 1)[:, 0], a.max(axis=1))


def test_vmatmul_in_fp32():
    rng = np.random.default_rng(9)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    w = rng.standard_normal((7, 3)).astype(np.float32)
    b = Builder()
    b.add(VMatMul(L0, View("vec", 500, 4), View("vec", 0, 1, 5), View("vec", 100, 3), 5, 7, 3))
    m = b.machine()
    put(m, L0, "vec", 0, 1, a, cs=5)                           # a stored column-major
    put(m, L0, "vec", 100, 3, w)
    run(m)
    ref = a.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(spad(m, L0, "vec", 500, 4, 5, 3), ref, rtol=1e-5, atol=1e-6)


def test_sync_instructions_change_nothing():
    m = Builder().machine()
    put(m, L0, "vec", 0, 4, np.arange(8, dtype=np.float32).reshape(2, 4))
    before = [bank.data.copy() for bank in m.banks.values()]
    execute(m, Wait(1, "vec", Cond(L0, "dma", 3)))
    execute(m, Barrier())
    after = [bank.data for bank in m.banks.values()]
    assert len(after) == len(before) and all((a == b).all() for a, b in zip(after, before))


def test_a_wait_field_does_not_change_what_an_instruction_computes():
    b = Builder()
    vexp = BY_MNEMONIC["vexp"]
    b.add(vexp(L0, View("vec", 100, 4), View("vec", 0, 4), 2, 4),
          vexp(L0, View("vec", 200, 4), View("vec", 0, 4), 2, 4, wait=Cond(1, "mat", 7)))
    m = b.machine()
    put(m, L0, "vec", 0, 4, np.linspace(-2, 2, 8, dtype=np.float32).reshape(2, 4))
    run(m)
    np.testing.assert_array_equal(spad(m, L0, "vec", 100, 4, 2, 4), spad(m, L0, "vec", 200, 4, 2, 4))


# --- traps and state -------------------------------------------------------------------------

def test_view_outside_the_scratchpad_traps():
    m = Builder().machine()
    cap = m.arch.derived.spad_elems["acc"]
    with pytest.raises(Trap, match=rf"L1 acc\[{cap - 4}\.\.{cap + 3}\].*of {cap} elements"):
        m.write(1, View("acc", cap - 4, 4), np.zeros((1, 2, 4), np.int32))


def test_a_span_past_the_last_legion_traps_even_on_a_window_seen_before():
    m = Builder().machine()
    n, view = m.arch.legions, View("vec", 0, 4)
    m.write(n - 2, view, np.zeros((2, 1, 4), np.float32))      # the window on the last two Legions
    assert m.read(n - 2, view, 1, 4, span=2).shape == (2, 1, 4)
    for legion, span, bad in ((n - 2, 3, n), (-1, 1, -1)):
        for access in (lambda: m.read(legion, view, 1, 4, span=span),
                       lambda: m.target(legion, view, 1, 4, span=span),
                       lambda: m.write(legion, view, np.zeros((span, 1, 4), np.float32)),
                       lambda: m.read(legion, View("vec", 0, 0), 0, 4, span=span)):     # empty, too
            with pytest.raises(Trap, match=rf"Legion L{bad} does not exist \(the machine has {n}\)"):
                access()


def test_read_of_never_written_scratchpad_traps():
    b = Builder()
    b.add(BY_MNEMONIC["vexp"](L0, View("vec", 100, 4), View("vec", 0, 4), 2, 4))
    m = b.machine()
    put(m, L0, "vec", 0, 4, np.zeros((1, 4), np.float32))
    with pytest.raises(Trap, match=r"never-written L0 vec\[4\]"):
        run(m)


@pytest.mark.parametrize("view,rows,cols", [(View("vec", 0, 0, 1), 2, 4),
                                            (View("vec", 0, 3, 1), 2, 4),
                                            (View("vec", 0, 1, 0), 3, 2)])
def test_overlapping_write_traps(view, rows, cols):
    b = Builder()
    b.add(BY_MNEMONIC["vmov"](L0, view, View("vec", 100, 4), rows, cols))
    m = b.machine()
    put(m, L0, "vec", 100, 4, np.zeros((rows, cols), np.float32))
    with pytest.raises(Trap, match="hits some element twice"):
        run(m)


def test_overlaps_matches_enumeration():
    for rows, cols, rs, cs in product(range(1, 5), range(1, 5), range(0, 6), range(0, 6)):
        addrs = [i * rs + j * cs for i in range(rows) for j in range(cols)]
        assert overlaps(rows, cols, rs, cs) == (len(set(addrs)) < len(addrs)), (rows, cols, rs, cs)


def test_every_instruction_class_has_semantics():
    assert all(handler_for(cls) for cls in INSTRUCTIONS)


def test_unknown_instruction_class_traps():
    @dataclass(frozen=True)
    class Bogus(Instr):
        legion: int = 0

    with pytest.raises(Trap, match="no semantics for instruction class Bogus"):
        execute(Builder().machine(), Bogus())


def test_inputs_are_checked_and_outputs_shaped():
    b = Builder()
    b.tensor("x", "i8", [2, 3], "input", io_name="tokens")
    w = np.array([[-2, 1, 0], [1, -1, -2]])
    b.tensor("w", "w2", [2, 3], "const", values=w)
    b.tensor("tokens", "f32", [1], "output", io_name="y")
    m = b.machine()
    with pytest.raises(ProgramError, match="wants int8"):
        m.set_input("tokens", np.zeros((2, 3), np.int64))
    with pytest.raises(ProgramError, match=r"wants shape \[2, 3\]"):
        m.set_input("tokens", np.zeros((3, 2), np.int8))
    with pytest.raises(ProgramError, match="no tensor 'nope'"):
        m.get("nope")
    m.set_input("tokens", np.full((2, 3), -5, np.int8))
    assert m.get("tokens").dtype == np.float32                    # the tensor, not x's graph name
    assert m.get("x").tolist() == [[-5] * 3] * 2
    np.testing.assert_array_equal(m.get("w"), w)
    np.testing.assert_array_equal(unpack(m.dram[1], "w2", 6).reshape(2, 3), w)
    with pytest.raises(ProgramError, match="output tensor, not an input"):
        m.set_input("y", np.zeros(1, np.float32))
