"""Quantized matmuls emitted once per span of Legions: Legions whose work is the same up to a
DRAM offset share every instruction (``span=``, ``lstride=``), results stay exact, programs
shrink, and every pair of conflicting scratchpad accesses is still ordered by a condition."""
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from isa import arch
from isa.arch import MODE_BITS
from isa.expand import expand
from isa.fields import QUEUES, View
from isa.instructions import Barrier, DmaLoad, DmaStore, Drain, MatMul, VBinary, VUnary
from dlegion_cc.lower.emitter import Emitter
from dlegion_cc.lower.qmatmul import block_maps
from dlegion_cc.lower.qplan import Group, Problem, RowScale, choose, groups
from dlegion_cc.lower.qtiles import emit_tiles
from dlegion_cc.pipeline import Options, compile_model
from runtime.check import compare, onnx_reference
from runtime.emulator import run


def _small() -> arch.Arch:
    """dlegion-tiny with 4 Legions and scratchpads of a few KiB: small matmuls already reuse
    their slots (and need the conditions that guard a reuse)."""
    text = (Path(arch.__file__).parent / "presets" / "dlegion-tiny.toml").read_text()
    changes = (('name = "dlegion-tiny"', 'name = "dlegion-4x2-small"'), ("legions = 2", "legions = 4"),
               ("act_kib = 64", "act_kib = 4"), ("wgt_kib = 64", "wgt_kib = 2"), ("acc_kib = 32", "acc_kib = 4"),
               ("vec_kib = 64", "vec_kib = 8"))
    for old, new in changes:
        assert old in text
        text = text.replace(old, new)
    return arch.from_toml_text(text, "dlegion-4x2-small")


MACHINE = _small()
L = MACHINE.legions


def _problem(M, K, N, w):
    """y = (a . w) * (1 / s) * scale: activations a, row scales s, per-column scales."""
    em, na = Emitter(MACHINE, "t"), MACHINE.array
    n_pad = -(-N // na) * na
    padded = np.pad(w, ((0, 0), (0, n_pad - N)))
    scale = np.random.default_rng(1).uniform(0.5, 1.5, (1, n_pad)).astype(np.float32)
    a8 = em.tensor("a", "i8", (M, K), "input", io_name="a")
    s = em.tensor("s", "f32", (M,), "input", io_name="s")
    p = Problem(a8, RowScale(s, 0, 1, "recip"), ((em.const("w", padded, "w2"), "w2"),),
                em.const("scale", scale, "f32"), 1, K, None, None, None, 0, "w8", None, False,
                em.tensor("y", "f32", (M, N), "output", io_name="y"), range(M), K, N, n_pad,
                block_maps([padded], na))
    return em, p, scale[0, :N]


def _compile(M, K, N, w, spans=True):
    """The program, its output on random inputs, and numpy's."""
    em, p, scale = _problem(M, K, N, w)
    emit_tiles(em, p, choose(MACHINE, p), spans=spans)
    program = em.program(None)
    rng = np.random.default_rng(2)
    a = rng.integers(-128, 128, (M, K)).astype(np.int8)
    s = rng.uniform(0.5, 2.0, M).astype(np.float32)
    acc = (a.astype(np.int64) @ w.astype(np.int64)).astype(np.float32)
    want = acc * (np.float32(1) / s)[:, None] * scale[None, :]
    return program, run(program, MACHINE, {"a": a, "s": s}).outputs["y"], want


def _weights(K, N, seed=0):
    return np.random.default_rng(seed).integers(-1, 2, (K, N)).astype(np.int8)


def _spans(program, kind, space=None) -> set:
    return {i.span for i in program.instrs
            if isinstance(i, kind) and (space is None or i.dst.space == space)}


# --- which Legions share their instructions --------------------------------------------------

def test_dense_equal_slices_run_as_one_span():
    M, K, N = 40, 384, 96                    # 24 columns a Legion; activation slots reused
    program, y, want = _compile(M, K, N, _weights(K, N))
    np.testing.assert_array_equal(y, want)
    assert _spans(program, MatMul) == _spans(program, Drain) == _spans(program, DmaLoad, "wgt") == {L}
    per_legion = N // L
    weight_loads = [i for i in program.instrs if isinstance(i, DmaLoad) and i.dst.space == "wgt"]
    assert {i.lstride for i in weight_loads} == {per_legion * MODE_BITS["w2"] // 8}
    assert {i.lstride for i in program.instrs if isinstance(i, DmaStore)} == {per_legion}
    # The activations are still one multicast from Legion 0, not a load per Legion.
    acts = [i for i in program.instrs if isinstance(i, DmaLoad) and i.dst.space == "act"]
    assert acts and all(i.span is None and i.dests == frozenset(range(L)) for i in acts)
    flat, y_flat, _ = _compile(M, K, N, _weights(K, N), spans=False)
    np.testing.assert_array_equal(y_flat, want)
    assert _spans(flat, MatMul) == {None}
    assert 2 * len(program.instrs) < len(flat.instrs)
    assert _unordered(program) == []


def test_a_shorter_last_slice_runs_alone():
    M, K, N = 16, 256, 88                    # Legions 0-2 own 24 columns, Legion 3 the last 16
    program, y, want = _compile(M, K, N, _weights(K, N))
    np.testing.assert_array_equal(y, want)
    assert _spans(program, MatMul) == {L - 1, None}
    assert {i.legion for i in program.instrs if isinstance(i, MatMul) and i.span is None} == {L - 1}
    assert _unordered(program) == []


def test_sparse_masks_span_only_where_the_legions_agree():
    M, K, N = 16, 256, 128
    same = _weights(K, N)
    same[:MACHINE.array] = 0                 # the same zero row of blocks in every slice
    program, y, want = _compile(M, K, N, same)
    np.testing.assert_array_equal(y, want)
    assert _spans(program, MatMul) == {L}
    assert any(i.mask is not None for i in program.instrs if isinstance(i, MatMul))
    differ = _weights(K, N)
    differ[:64, :32] = 0                     # zero blocks in Legion 0's slice only
    program, y, want = _compile(M, K, N, differ)
    np.testing.assert_array_equal(y, want)
    assert {(i.legion, i.span) for i in program.instrs if isinstance(i, MatMul)} == {(0, None), (1, L - 1)}
    assert _unordered(program) == []


def test_groups_are_runs_of_legions_with_the_same_work():
    em, p, _ = _problem(8, 256, 128, _weights(256, 128))
    plan = choose(MACHINE, p)
    assert groups(MACHINE, p, plan) == [Group(0, L)]
    em, p, _ = _problem(8, 256, 88, _weights(256, 88))
    assert groups(MACHINE, p, choose(MACHINE, p)) == [Group(0, L - 1), Group(L - 1, 1)]


# --- through the compiler, against onnxruntime ----------------------------------------------

def _int8_model(path, K=64, N=128):
    """uint8 activations with a zero point x int8 weights: the exact int32 product (with the
    zero-point correction passes) and the same product scaled in fp32."""
    rng = np.random.default_rng(0)
    w = rng.integers(-63, 64, (K, N)).astype(np.int8)
    nodes = [helper.make_node("MatMulInteger", ["a", "w", "az"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["f", "scale"], ["y"])]
    inits = [numpy_helper.from_array(w, "w"),
             numpy_helper.from_array(rng.uniform(0.01, 0.02, N).astype(np.float32), "scale")]
    g = helper.make_graph(nodes, "int8", [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 6, K]),
                                          helper.make_tensor_value_info("az", TensorProto.UINT8, [])],
                          [helper.make_tensor_value_info("acc", TensorProto.INT32, [1, 6, N]),
                           helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, N])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]), path)
    return {"a": rng.integers(0, 256, (1, 6, K)).astype(np.uint8), "az": np.array(131, np.uint8)}


@pytest.mark.parametrize("multicast", [True, False])
def test_compiled_int8_matmul_matches_onnxruntime(tmp_path, multicast):
    path = tmp_path / "m.onnx"
    inputs = _int8_model(path)
    program = compile_model(path, Options(MACHINE, multicast=multicast))[1]
    assert _spans(program, MatMul) == {L}
    rows = compare(run(program, MACHINE, inputs).outputs, onnx_reference(path, inputs))
    assert rows and all(r.ok for r in rows), rows
    assert next(r for r in rows if r.name == "acc").exact
    assert _unordered(program) == []


# --- every conflict is ordered --------------------------------------------------------------

def _accesses(i):
    """(Legion, space, first, last + 1, writes) of each scratchpad range a task touches (a view
    as the whole address range it spans)."""
    def rng(v: View, rows, cols):
        return v.addr, v.addr + (rows - 1) * v.rs + (cols - 1) * v.cs + 1
    out = []
    if isinstance(i, DmaLoad):
        out += [(l, i.dst.space, *rng(i.dst, i.rows, i.cols), True) for l in i.dests]
    elif isinstance(i, DmaStore):
        out.append((i.legion, i.src.space, *rng(i.src, i.rows, i.cols), False))
    elif isinstance(i, MatMul):
        out += [(i.legion, "act", *rng(i.act, i.M, i.K), False),
                (i.legion, "wgt", *rng(i.wgt, i.K, -(-i.N * MODE_BITS[i.mode] // 8)), False),
                (i.legion, "acc", *rng(i.acc, i.M, i.N), True)]
    elif isinstance(i, Drain):
        vectors = [(a, n) for a, n in ((i.rscale, i.M), (i.cscale, i.N), (i.bias, i.N)) if a is not None]
        out += [(i.legion, "acc", *rng(i.acc, i.M, i.N), False),
                (i.legion, i.dst.space, *rng(i.dst, i.M, i.N), True)]
        out += [(i.legion, "vec", a, a + n, False) for a, n in vectors]
    elif isinstance(i, (VUnary, VBinary)):
        views = [v for v in (i.a, getattr(i, "b", None)) if isinstance(v, View)]
        out += [(i.legion, v.space, *rng(v, i.rows, i.cols), False) for v in views]
        out.append((i.legion, i.dst.space, *rng(i.dst, i.rows, i.cols), True))
    return out


def _unordered(program) -> list[str]:
    """Pairs of tasks, one writing what the other touches, where nothing makes the earlier one
    complete before the later one starts. ``known[k]``: for each queue, how many of its
    instructions task k knows complete when it starts (vector clocks over the queues)."""
    tasks = expand(program, MACHINE.legions).program.instrs
    index = {(l, q): n for n, (l, q) in enumerate((l, q) for l in range(L) for q in QUEUES)}
    prefix = {q: [np.zeros(len(index), int)] for q in index}    # what q's first n being done tells
    started = {q: np.zeros(len(index), int) for q in index}
    known, where = [], []
    for ins in tasks:
        queues = list(index) if isinstance(ins, Barrier) else [(ins.legion, ins.queue())]
        now = np.zeros(len(index), int)
        for q in queues:
            # In order: a DMA starts after the one before it started; others after it completed.
            now = np.maximum(now, started[q] if q[1] == "dma" else prefix[q][-1])
        if isinstance(ins, Barrier):
            now = np.maximum(now, np.array([len(prefix[q]) - 1 for q in index]))
        cond = ins.condition()
        if cond is not None:
            now = np.maximum(now, prefix[(cond.legion, cond.queue)][cond.count])
        for q in queues:
            started[q] = now
            done = now.copy()
            done[index[q]] = len(prefix[q])
            prefix[q].append(np.maximum(prefix[q][-1], done))
        known.append(now)
        where.append((index[queues[0]], len(prefix[queues[0]]) - 1))
    out, live = [], {}
    for k, ins in enumerate(tasks):
        for legion, space, lo, hi, write in _accesses(ins):
            seen = live.get((legion, space), [])
            for a, b, j, w in seen:
                q, n = where[j]
                if j != k and a < hi and lo < b and (write or w) and known[k][q] < n:
                    out.append(f"task {k} {ins.MNEMONIC} L{legion} {space}[{lo},{hi}) after task {j} "
                               f"{tasks[j].MNEMONIC}")
            # A write over a whole earlier range stands for it from now on.
            seen = [e for e in seen if not (write and lo <= e[0] and e[1] <= hi)]
            live[(legion, space)] = seen + [(lo, hi, k, write)]
    return out
