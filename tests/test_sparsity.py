"""Block sparsity: all-zero weight blocks are neither loaded nor multiplied, masks compact the
rest, results still match onnxruntime, and the run is cheaper than the dense schedule."""
import numpy as np
import pytest

from isa import arch
from isa.instructions import DmaLoad, MatMul
from dlegion_cc.lower.context import Switches
from dlegion_cc.lower.emitter import Emitter
from dlegion_cc.lower.qplan import Problem, candidates, choose, estimate
from dlegion_cc.lower.qmatmul import block_maps
from dlegion_cc.lower.qtiles import emit_tiles
from dlegion_cc.pipeline import Options, compile_model
from models.bitnet import build_bitnet, preset, save
from runtime.check import compare, onnx_reference
from runtime.emulator import random_inputs, run
from runtime.report import summarize

TINY = arch.load("dlegion-tiny")


@pytest.fixture(scope="module")
def sparse_bitnet(tmp_path_factory):
    """A one-layer BitNet with half of its 16x16 weight blocks zero, built with and without
    sparsity, both run on the same inputs, and onnxruntime's logits for them."""
    path = tmp_path_factory.mktemp("sparse") / "m.onnx"
    save(build_bitnet(preset("tiny", layers=1, seq=6, vocab=64, block_sparsity=0.5, block=16, seed=3)), path, False)
    out = {}
    for sparse in (True, False):
        _, program = compile_model(path, Options(TINY, sparsity=sparse, attention="fp32"))
        inputs = random_inputs(program, 0)
        out[sparse] = run(program, TINY, inputs)
    return out, onnx_reference(path, inputs)


def test_sparse_and_dense_builds_match_onnxruntime(sparse_bitnet):
    results, ref = sparse_bitnet
    for result in results.values():
        [row] = compare(result.outputs, ref)
        assert row.ok, row


def _weight_work(result) -> tuple[int, int]:
    """The ``mm`` tasks a run executed and the bytes it loaded into ``wgt``."""
    tasks = result.program.instrs                # one task per Legion of each span
    mms = sum(isinstance(i, MatMul) for i in tasks)
    return mms, sum(i.rows * i.cols for i in tasks if isinstance(i, DmaLoad) and i.dst.space == "wgt")


def test_sparsity_saves_passes_loads_and_cycles(sparse_bitnet):
    results, _ = sparse_bitnet
    sparse, dense = (summarize(results[k])["sparsity"] for k in (True, False))
    (mm_sparse, wgt_sparse), (mm_dense, wgt_dense) = (_weight_work(results[k]) for k in (True, False))
    assert mm_sparse < mm_dense
    assert wgt_sparse < wgt_dense
    assert results[True].timeline.cycles < results[False].timeline.cycles
    assert sparse["masked_mm"] > 0 and sparse["masked_zero_blocks"] > 0
    assert sparse["windows_skipped"] > 0 and sparse["cycles_saved"] > 0
    assert dense["masked_mm"] == dense["windows_skipped"] == 0


def test_masks_are_u8_block_maps_named_after_their_weight(sparse_bitnet):
    results, _ = sparse_bitnet
    program = results[True].program
    for i in program.instrs:
        if isinstance(i, MatMul) and i.mask is not None:
            t = program.tensors[i.mask]
            assert t.dtype == "u8" and t.kind == "const" and "_mask" in t.name
            assert t.shape == (-(-i.K // TINY.array), -(-i.N // TINY.array))


def _problem(w: np.ndarray, M: int = 4):
    em, na = Emitter(TINY, "t"), TINY.array
    K, N = w.shape
    a8 = em.tensor("a", "i8", (M, K), "input", io_name="a")
    out = em.tensor("y", "i32", (M, N), "output", io_name="y")
    p = Problem(a8, None, ((em.const("w", w, "w2"), "w2"),), None, 1, K, None, None, None, 0, "w8", None,
                True, out, range(M), K, N, N, block_maps([w], na))
    return em, p


def _plan(p, switches, depth=None):
    """The scheduler's pick, or the fastest plan whose chunks have at most ``depth`` rows."""
    if depth is None:
        return choose(TINY, p, switches)
    return min((c for c in candidates(TINY, p, switches) if c.depth <= depth),
               key=lambda c: estimate(TINY, p, c).cycles)


def _run(em, p, a, switches=Switches(), depth=None):
    emit_tiles(em, p, _plan(p, switches, depth))
    program = em.program(None)
    result = run(program, TINY, {"a": a})
    return program, result.outputs["y"], result.timeline.counters


def test_fully_sparse_chunks_are_neither_loaded_nor_multiplied():
    K, N = 256, 16
    w = np.random.default_rng(0).integers(-1, 2, (K, N)).astype(np.int8)
    w[: K // 2] = 0                                     # the first half of K: every block zero
    a = np.random.default_rng(1).integers(-128, 128, (4, K)).astype(np.int8)
    em, p = _problem(w)
    program, y, counters = _run(em, p, a, depth=K // 2)     # a chunk holds only zero blocks
    np.testing.assert_array_equal(y, a.astype(np.int64) @ w.astype(np.int64))
    row_bytes = N * 2 // 8
    loaded_rows = {i.src.offset // row_bytes + r for i in program.instrs
                   if isinstance(i, DmaLoad) and i.dst.space == "wgt" for r in range(i.rows)}
    assert loaded_rows and min(loaded_rows) >= K // 2
    # Chunks inside the zero half have no mm; a chunk across the edge has a mask skipping it.
    em, p = _problem(w)
    _, y_dense, dense = _run(em, p, a, Switches(sparsity=False))
    np.testing.assert_array_equal(y_dense, y)
    assert counters["passes"] * 2 <= dense["passes"]


def test_an_all_zero_weight_gives_zeros_without_work():
    w = np.zeros((64, 16), np.int8)
    em, p = _problem(w)
    program, y, counters = _run(em, p, np.ones((4, 64), np.int8))
    assert not y.any()
    mms = [i for i in program.instrs if isinstance(i, MatMul)]
    assert all(i.mask is not None for i in mms)         # all-zero masks: passes that cost nothing
    assert counters["passes"] == 0
