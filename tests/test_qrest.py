"""A fused matmul's part-empty last window split off onto parts of its rows (``lower/qrest.py``):
2B4T's Q/K/V leave each Legion of dlegion-8x8 7.5 w2 windows; the last 256 columns of V go to
two parts of four Legions, a window each, and every Legion passes fewer cycles."""
import numpy as np
import onnx
import pytest

from isa import arch
from isa.instructions import DmaLoad, MatMul
from dlegion_cc.lower import qrest
from dlegion_cc.pipeline import Options, compile_model
from models.bitnet import BitLinear, preset
from models.graph import FLOAT, GraphBuilder, tensor_info
from runtime.check import compare, onnx_reference
from runtime.emulator import run
from runtime.timing import simulate
from progbuild import assert_bitwise_equal

EIGHT = arch.load("dlegion-8x8")
QKV = (2560, 640, 640)
DEPTH = 64


def test_the_columns_past_the_whole_windows_go_to_parts_that_fill_a_window_each():
    assert qrest.split(EIGHT, list(QKV), 4, 128) == qrest.Rest(256, 4)
    assert qrest.kept(list(QKV), qrest.Rest(256, 4)) == [2560, 640, 384]


@pytest.mark.parametrize("segments, rows", [((2560, 512, 512), 128),     # 448 a Legion: 7 whole windows
                                            (QKV, 64),                  # parts of 32 rows: too few
                                            ((512, 128, 128), 128),     # the last segment is too narrow
                                            (None, 128)])
def test_nothing_is_split_off_where_it_would_not_fill_windows_or_parts(segments, rows):
    assert qrest.split(EIGHT, None if segments is None else list(segments), 4, rows) is None


def _model(path, rows: int, reads_v: bool = False, depth: int = DEPTH):
    """The absmax-quantized input and its Q/K/V projections: with row blocks, a chain of the
    quantization and the fused matmul (``reads_v``: and V quantized and projected, which the
    chain then reads)."""
    b, rng = GraphBuilder(), np.random.default_rng(5)
    linear = BitLinear(preset("tiny", seed=5), rng)
    xq = linear.prepare(b, "x")
    outs = [linear.project(b, xq, f"proj{i}", depth, n) for i, n in enumerate(QKV)]
    widths = list(QKV)
    if reads_v:
        outs.append(linear.project(b, linear.prepare(b, outs[-1]), "after_v", QKV[-1], depth))
        widths.append(depth)
    onnx.save(b.model([tensor_info("x", FLOAT, [1, rows, depth])],
                      [tensor_info(o, FLOAT, [1, rows, n]) for o, n in zip(outs, widths)]), path)
    return path, {"x": rng.standard_normal((1, rows, depth)).astype(np.float32)}, outs[:len(QKV)]


def _arrays_busy(program) -> int:
    return max(c for (_, queue), c in simulate(program, EIGHT).busy.items() if queue == "mat")


@pytest.mark.parametrize("rows, row_blocks, reads_v", [(128, False, False), (256, True, False), (256, False, False),
                                                     (256, True, True)])
def test_split_off_columns_match_onnxruntime_and_save_array_cycles(tmp_path, monkeypatch, rows, row_blocks, reads_v):
    """In a chain the split-off columns run at its end, or, where the chain reads them (V
    quantized and projected), right after the matmul's last block."""
    path, inputs, qkv = _model(tmp_path / "qkv.onnx", rows, reads_v)
    program = compile_model(path, Options(EIGHT, row_blocks=row_blocks))[1]
    rest = [t for t in program.tensors if t.name.endswith("_rest_w")]
    assert len(rest) == 1
    loaders = {i.legion for i in program.instrs if isinstance(i, DmaLoad) and program.tensors[i.src.tensor] is rest[0]}
    assert loaders == {0, 4}            # each part's four Legions load their windows as one group
    assert any(isinstance(i, MatMul) and i.N == 64 for i in program.instrs)
    ours = run(program, EIGHT, inputs).outputs                     # race-checked
    # (V's projection after its quantization is held to the program without the split: V's fp32
    # values differ from onnxruntime's in their last bit, and its quantization may round apart.)
    rows = compare({k: ours[k] for k in qkv}, {k: v for k, v in onnx_reference(path, inputs).items() if k in qkv})
    assert len(rows) == len(QKV)
    for row in rows:
        assert row.ok, f"{row.name}: relative L2 {row.rel_l2:.2e}"
    monkeypatch.setattr(qrest, "split", lambda *a: None)
    whole = compile_model(path, Options(EIGHT, row_blocks=row_blocks))[1]
    theirs = run(whole, EIGHT, inputs).outputs
    assert_bitwise_equal(ours, theirs)
    assert _arrays_busy(program) < _arrays_busy(whole)


def test_each_part_loads_its_first_rows_before_the_last_pass_of_the_step_before(tmp_path):
    """At a chain's end the split-off columns are a step whose two parts are emitted one after
    the other: the second part's first loads go ahead of the last pass before the step too, not
    behind that step's last stores in its Legions' in-order DMA queues (K deep enough for each
    part to take more passes than go ahead, ``rowblocks.HOISTED_PASSES``)."""
    path, _, _ = _model(tmp_path / "qkv.onnx", 256, depth=1024)
    program = compile_model(path, Options(EIGHT))[1]
    instrs = program.instrs
    last_pass = max(k for k, i in enumerate(instrs) if isinstance(i, MatMul) and (i.span or 1) == EIGHT.legions)
    for part in ({0, 1, 2, 3}, {4, 5, 6, 7}):
        first_load = min(k for k, i in enumerate(instrs) if isinstance(i, DmaLoad) and i.dests == part)
        assert first_load < last_pass
