"""A chain's last matmul, whose rows nothing in the chain reads, in long passes for most of its
columns (``lower/qlong.py``): its first windows a Legion pass block by block beside the row
kernel before it, the rest pass all the rows at once; a gated matmul of two row blocks passes
its first and last windows block by block, its middle ones over all the rows."""
import numpy as np
import onnx

from isa import arch
from dlegion_cc.lower import qlong, qmatmul, rowblocks
from dlegion_cc.pipeline import Options, compile_model
from models.bitnet import BitLinear, preset
from models.decoder import relu2
from models.graph import FLOAT, GraphBuilder, tensor_info
from runtime.check import compare, onnx_reference
from runtime.emulator import run
from runtime.timing import simulate

EIGHT = arch.load("dlegion-8x8")
TWO = [range(0, 128), range(128, 256)]
DEPTH, WIDE = 512, 2048         # WIDE: 4 w2 windows a Legion of dlegion-8x8


def _window_cycles(rows: int, K: int, ops: float = 1) -> float:
    """A w2 window of 4 tiles a Legion over ``rows`` rows, fill and drain included, less the
    vector cycles of its drains, ``ops`` operations an element."""
    d = EIGHT.derived
    passes = rows * K * EIGHT.array * 4 * EIGHT.legions / d.macs_per_cycle["w2"] * (1 + d.pass_overhead / rows)
    return passes - ops * rows * EIGHT.array * 4 / EIGHT.vector_lanes


def test_the_first_windows_cover_the_vector_work_beside_a_block():
    one = _window_cycles(128, 6912)
    assert qlong.head_windows(EIGHT, "w2", 6912, 4, 128, 0) == 1
    assert qlong.head_windows(EIGHT, "w2", 6912, 4, 128, one) == 1
    assert qlong.head_windows(EIGHT, "w2", 6912, 4, 128, one + 1) == 2
    # The stack's down_proj beside the quantization of ReLU^2 x up (8 operations an element of
    # 128 x 6912 on 8 Legions of 64 lanes): 2 windows, the best measured.
    assert qlong.head_windows(EIGHT, "w2", 6912, 4, 128, 8 * 128 * 6912 / 512) == 2
    assert qlong.head_windows(EIGHT, "w4", 6912, 4, 128, one + 1) == 1       # half the MACs a cycle


def test_the_first_windows_of_each_legion_pass_block_by_block():
    window, beside = EIGHT.legions * EIGHT.array * 4, 1.5 * _window_cycles(128, 6912)
    assert qlong.head_columns(EIGHT, "w2", 6912, 2560, 4, TWO, beside) == 2 * window
    assert qlong.head_columns(EIGHT, "w2", 6912, 2560, 4, TWO[:1], beside) == 0         # one block: nothing to cover
    assert qlong.head_columns(EIGHT, "w2", 6912, 2 * window, 4, TWO, beside) == 0       # no windows left over
    assert qlong.head_columns(EIGHT, "w2", 6912, 2560 + 16, 4, TWO, beside) == 0        # a part-empty window
    assert qlong.head_columns(EIGHT, "w2", 6912, 2560, 4, TWO, 9 * beside) == 0         # every window needed


def test_a_gated_matmul_of_two_blocks_passes_its_first_and_last_windows_block_by_block():
    # The stack's gate/up (27 w2 windows a Legion, drains of 2.5 operations an element) beside
    # Q's quantization and ReLU^2 x up's, 8 operations an element of 128 x 2560 and 128 x 6912,
    # each starting 8 passes (of 256 weight rows) into its step.
    before, after = 8 * 128 * 2560 / 512, 8 * 128 * 6912 / 512
    cut = qlong.gated_windows(EIGHT, "w2", 2560, 2 * 6912, 4, TWO, before, after, 2.5, 8)
    window, late = _window_cycles(128, 2560, 2.5), 8 * _window_cycles(128, 2560) * 256 / 2560
    assert cut == (3, 7) and before + late <= 3 * window and after + late > 6 * window
    # Starting with its step, a kernel needs fewer windows: one more costs its fill and drain.
    assert qlong.gated_windows(EIGHT, "w2", 2560, 2 * 6912, 4, TWO, before, after, 2.5, 0) == (2, 6)
    assert qlong.gated_windows(EIGHT, "w2", 2560, 2 * 6912, 4, TWO[:1], 1, 1, 2.5, 8) == (0, 0)
    assert qlong.gated_windows(EIGHT, "w2", 2560, 2 * 6912, 4, TWO * 2, 1, 1, 2.5, 8) == (0, 0)   # four blocks
    assert qlong.gated_windows(EIGHT, "w2", 2560, 2 * 6912, 4, TWO, 14 * window, 13 * window, 2.5, 0) == (0, 0)
    assert qlong.gated_windows(EIGHT, "w2", 2560, 2 * 6912 + 16, 4, TWO, 1, 1, 2.5, 8) == (0, 0)


def _model(path):
    """An absmax-quantized input projected to ``WIDE`` columns: with row blocks, a chain of the
    quantization and the matmul, which nothing reads."""
    b, rng = GraphBuilder(), np.random.default_rng(7)
    linear = BitLinear(preset("tiny", seed=7), rng)
    out = linear.project(b, linear.prepare(b, "x"), "last", DEPTH, WIDE)
    onnx.save(b.model([tensor_info("x", FLOAT, [1, 256, DEPTH])], [tensor_info(out, FLOAT, [1, 256, WIDE])]), path)
    return path, {"x": rng.standard_normal((1, 256, DEPTH)).astype(np.float32)}


def _arrays_busy(program) -> int:
    return max(c for (_, queue), c in simulate(program, EIGHT).busy.items() if queue == "mat")


def test_long_passes_match_onnxruntime_and_the_uncut_program_in_fewer_array_cycles(tmp_path, monkeypatch):
    path, inputs = _model(tmp_path / "chain.onnx")
    program = compile_model(path, Options(EIGHT))[1]
    names = {t.name.rsplit("_", 1)[-1] for t in program.tensors if t.name.endswith(("_head_w", "_long_w"))}
    assert names == {"w"} and sum(t.name.endswith("_long_w") for t in program.tensors) == 1
    ours = run(program, EIGHT, inputs).outputs                     # race-checked
    for row in compare(ours, onnx_reference(path, inputs)):
        assert row.ok, f"{row.name}: relative L2 {row.rel_l2:.2e}"
    monkeypatch.setattr(qlong, "head_columns", lambda *a: 0)
    uncut = compile_model(path, Options(EIGHT))[1]
    for name, value in run(uncut, EIGHT, inputs).outputs.items():
        np.testing.assert_array_equal(ours[name], value)
    assert _arrays_busy(program) < _arrays_busy(uncut)


def _gated_model(path):
    """An absmax-quantized input through a gate/up pair (ReLU^2 x up, made in the drains) and a
    quantized down projection, ``GATED`` columns each: gate/up, 8 w2 windows a Legion, is cut."""
    b, rng = GraphBuilder(), np.random.default_rng(11)
    linear = BitLinear(preset("tiny", seed=11), rng)
    xq = linear.prepare(b, "x")
    up = linear.project(b, xq, "up", GATED, GATED)
    hidden = b.op("Mul", relu2(b, linear.project(b, xq, "gate", GATED, GATED)), up)
    out = linear.project(b, linear.prepare(b, hidden), "down", GATED, GATED)
    onnx.save(b.model([tensor_info("x", FLOAT, [1, 256, GATED])], [tensor_info(out, FLOAT, [1, 256, GATED])]), path)
    return path, {"x": rng.standard_normal((1, 256, GATED)).astype(np.float32)}


GATED = 2048


def test_a_cut_gated_matmul_matches_onnxruntime_and_the_uncut_program_in_fewer_array_cycles(tmp_path, monkeypatch):
    path, inputs = _gated_model(tmp_path / "gated.onnx")
    program = compile_model(path, Options(EIGHT))[1]
    parts = {t.name.rsplit("_", 2)[-2] for t in program.tensors if t.name.endswith(("_first_w", "_middle_w", "_last_w"))}
    assert parts == {"first", "middle", "last"}
    ours = run(program, EIGHT, inputs).outputs                     # race-checked
    for row in compare(ours, onnx_reference(path, inputs)):
        assert row.ok, f"{row.name}: relative L2 {row.rel_l2:.2e}"
    monkeypatch.setattr(rowblocks, "gated_cut", lambda *a: (0, 0))
    uncut = compile_model(path, Options(EIGHT))[1]
    assert not any(t.name.endswith("_middle_w") for t in uncut.tensors)
    for name, value in run(uncut, EIGHT, inputs).outputs.items():
        np.testing.assert_array_equal(ours[name], value)
    assert _arrays_busy(program) < _arrays_busy(uncut)


def test_a_cut_on_fewer_legions_than_all_leaves_its_steps_empty(tmp_path, monkeypatch):
    path, inputs = _gated_model(tmp_path / "gated.onnx")
    monkeypatch.setattr(qmatmul, "pick_width", lambda arch, *a: arch.legions // 2)
    program = compile_model(path, Options(EIGHT))[1]
    assert not any(t.name.endswith("_middle_w") for t in program.tensors)
    ours = run(program, EIGHT, inputs).outputs                     # race-checked
    monkeypatch.setattr(rowblocks, "gated_cut", lambda *a: (0, 0))
    for name, value in run(compile_model(path, Options(EIGHT))[1], EIGHT, inputs).outputs.items():
        np.testing.assert_array_equal(ours[name], value)
