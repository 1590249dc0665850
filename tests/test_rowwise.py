"""Row kernels keep two or three blocks in flight on each Legion: the next blocks load while the
current one computes."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

from isa import arch
from isa.instructions import DmaLoad
from dlegion_cc.pipeline import Options, compile_model
from runtime.emulator import run

WIDE = arch.load("dlegion-8x8")
ROWS, COLS = 4096, 512


def _compiled(tmp_path, nodes, x: tuple, y: tuple, inits: dict | None = None):
    """The program for dlegion-8x8 of a graph of ``nodes`` with input and output (name, shape)
    ``x`` and ``y``, and constants ``inits``."""
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(x[0], TP.FLOAT, x[1])],
                              [helper.make_tensor_value_info(y[0], TP.FLOAT, y[1])],
                              [onnx.numpy_helper.from_array(v, k) for k, v in (inits or {}).items()])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), path)
    return compile_model(path, Options(WIDE))[1]


def _least_busy(result) -> float:
    """The least busy Legion's vector queue, as a share of the run's cycles."""
    tl = result.timeline
    return min(tl.busy[(legion, "vec")] for legion in range(WIDE.legions)) / tl.cycles


def _softmax(tmp_path):
    node = helper.make_node("Softmax", ["x"], ["y"], axis=-1)
    return _compiled(tmp_path, [node], ("x", [ROWS, COLS]), ("y", [ROWS, COLS]))


def test_blocks_alternate_halves_and_the_vector_unit_stays_busy(tmp_path):
    program = _softmax(tmp_path)
    half = WIDE.derived.spad_elems["vec"] // 2
    assert {i.dst.addr for i in program.instrs if isinstance(i, DmaLoad)} == {0, half}
    x = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    result = run(program, WIDE, {"x": x})
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(result.outputs["y"], e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)
    # Each block's load and store hide behind the vector work of its neighbours: the vector
    # queue of every Legion is busy nearly all the time (one block after another it was ~60%).
    assert _least_busy(result) >= 0.9


def test_a_row_every_block_reads_is_loaded_once_on_each_legion(tmp_path):
    """x * g with g one row broadcast over the 4096 rows: each Legion loads g once, below its
    two halves of blocks, not with every block (274 loads of g before)."""
    g = np.random.default_rng(1).standard_normal(COLS).astype(np.float32)
    program = _compiled(tmp_path, [helper.make_node("Mul", ["x", "g"], ["y"])], ("x", [ROWS, COLS]),
                        ("y", [ROWS, COLS]), {"g": g})
    loads = [i for i in program.instrs if isinstance(i, DmaLoad)]
    of_g = [i for i in loads if program.tensors[i.src.tensor].kind == "const"]
    assert sum(i.span or 1 for i in of_g) == WIDE.legions
    assert {i.dst.addr for i in loads if i not in of_g} == {COLS, COLS + (WIDE.derived.spad_elems["vec"] - COLS) // 2}
    x = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    np.testing.assert_array_equal(run(program, WIDE, {"x": x}).outputs["y"], x * g)


def _float_matmul(tmp_path, M: int, K: int, N: int):
    """x [M, K] @ w [K, N] in fp32 on dlegion-8x8, checked against float64: the program and
    the least busy Legion's vector unit, as a share of the run's cycles."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((K, N)).astype(np.float32)
    program = _compiled(tmp_path, [helper.make_node("MatMul", ["x", "w"], ["y"])], ("x", [M, K]), ("y", [M, N]),
                        {"w": w})
    x = rng.standard_normal((M, K)).astype(np.float32)
    result = run(program, WIDE, {"x": x})
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert np.linalg.norm(result.outputs["y"] - want) / np.linalg.norm(want) < 1e-6
    return program, _least_busy(result)


@pytest.mark.parametrize("heads", [20, 4])
def test_a_table_shared_by_the_heads_is_loaded_once_a_block(tmp_path, heads):
    """x [1, H, S, D] * t [1, 1, S, D] (rotary's tables): with 20 heads, the heads become the
    rows of a block (a position each), which loads its row of t once for all of them: t is read
    once in all. With 4 heads, blocks of so few rows would cost more than they save: t is read
    once per head."""
    S, D = 256, 128
    t = np.random.default_rng(2).standard_normal((1, 1, S, D)).astype(np.float32)
    program = _compiled(tmp_path, [helper.make_node("Mul", ["x", "t"], ["y"])], ("x", [1, heads, S, D]),
                        ("y", [1, heads, S, D]), {"t": t})
    of_t = [i for i in program.instrs if isinstance(i, DmaLoad) and program.tensors[i.src.tensor].kind == "const"]
    assert sum(i.rows * i.cols * (i.span or 1) for i in of_t) == S * D * (1 if heads >= 16 else heads)
    x = np.random.default_rng(3).standard_normal((1, heads, S, D)).astype(np.float32)
    np.testing.assert_array_equal(run(program, WIDE, {"x": x}).outputs["y"], x * t)


def test_a_float_matmul_loads_the_next_k_chunk_while_the_vector_unit_multiplies(tmp_path):
    """[512, 4096] x [4096, 512] in fp32 on dlegion-8x8: K in chunks of whole 64-row blocks,
    loaded into two buffers in turn, so the vector unit of every Legion is busy nearly all the
    time (with one buffer each chunk's load waited for the product before it: 89% of it)."""
    program, busy = _float_matmul(tmp_path, 512, 4096, 512)
    assert len({i.dst.addr for i in program.instrs if isinstance(i, DmaLoad)}) == 4    # a and b, twice
    assert busy >= 0.95


def test_blocks_deal_the_rows_in_full_rounds_and_keep_overlapping(tmp_path):
    """Masked softmax of [8, 256, 256] scores: 21 rows fit half the vector scratchpad, and 256
    rows in blocks of 21 leave a round of 4 and a block of 4, on other Legions, which stopped the
    overlap at every head (29,056 cycles). Blocks of 16 deal each head's rows in two full rounds
    (13,836)."""
    mask = np.where(np.tril(np.ones((256, 256), bool)), 0, -1e9).astype(np.float32)
    nodes = [helper.make_node("Add", ["s", "mask"], ["sm"]), helper.make_node("Softmax", ["sm"], ["y"], axis=-1)]
    program = _compiled(tmp_path, nodes, ("s", [8, 256, 256]), ("y", [8, 256, 256]), {"mask": mask})
    assert {(i.rows, i.span) for i in program.instrs if isinstance(i, DmaLoad)} == {(16, 8)}
    s = np.random.default_rng(0).standard_normal((8, 256, 256)).astype(np.float32)
    result = run(program, WIDE, {"s": s})
    e = np.exp(s + mask - (s + mask).max(axis=-1, keepdims=True))
    np.testing.assert_allclose(result.outputs["y"], e / e.sum(axis=-1, keepdims=True), rtol=1e-5, atol=1e-7)
    # Every Legion's vector unit busy 89% of the time (28% on the least busy, before).
    assert _least_busy(result) >= 0.85


def test_a_float_matmul_loads_the_next_block_while_the_vector_unit_multiplies(tmp_path):
    """[1024, 128] x [128, 1024] in fp32 (attention's QK^T shape): each 64 x 64 output block's K
    is short, so it is the next block's chunks that load while a block multiplies, into the
    other buffers, and its sum goes to the other result buffer while the store reads this one."""
    _, busy = _float_matmul(tmp_path, 1024, 128, 1024)
    assert busy >= 0.95     # 99.6%; 86.5% block after block


def test_rows_per_block_deal_full_rounds_where_they_can():
    from dlegion_cc.lower.rowwise import _balanced
    assert _balanced(20, 21, 8) == 20            # one block holds them: one Legion, the next kernel the next
    assert _balanced(256, 21, 8) == 16           # two full rounds of 8 blocks, not 12 blocks of 21 and a tail
    assert _balanced(100, 21, 8) == 13           # one round: 8 Legions of 13 rows (the last 9), not 5 of 20
    assert _balanced(20, 15, 8) == 3             # a decode step's softmax, 20 heads: 3 rows a Legion, not 4
    assert _balanced(64, 21, 8) == 8             # full blocks where they are as even
    assert _balanced(257, 21, 8) == 17           # a prime: as even as it gets, one short block left


def test_rows_that_split_evenly_over_the_legions_give_every_legion_the_same_rows():
    from dlegion_cc.lower.rowwise import _groups
    groups = list(_groups(512, 10, 8))           # a causal softmax head at 512, blocks of at most 10
    assert [n for _, n, _ in groups] == [10, 9, 9, 9, 9, 9, 9]
    assert all(count == 8 for *_, count in groups)
    assert [r0 for r0, *_ in groups] == [0, 80, 152, 224, 296, 368, 440]
    assert list(_groups(20, 21, 8)) == [(0, 20, 1)]          # one block: one Legion
    assert list(_groups(257, 21, 8)) == [(0, 17, 8), (136, 17, 7), (255, 2, 1)]   # uneven: _balanced blocks


def _relu2_norm(tmp_path, rows: int, cols: int):
    """BitNet's ReLU(gate)^2 * up and its RMSNorm over rows of ``cols``: two streamed inputs
    and the norm's weight, resident."""
    g = np.random.default_rng(3).standard_normal(cols).astype(np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "r"], ["r2"]),
             helper.make_node("Mul", ["r2", "u"], ["h"]), helper.make_node("Mul", ["h", "h"], ["h2"]),
             helper.make_node("ReduceMean", ["h2", "axes"], ["m"], keepdims=1),
             helper.make_node("Add", ["m", "eps"], ["me"]), helper.make_node("Sqrt", ["me"], ["s"]),
             helper.make_node("Reciprocal", ["s"], ["inv"]), helper.make_node("Mul", ["h", "inv"], ["n"]),
             helper.make_node("Mul", ["g", "n"], ["y"])]
    inits = {"g": g, "axes": np.array([-1], np.int64), "eps": np.array(1e-5, np.float32)}
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TP.FLOAT, [rows, cols]) for n in "xu"],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [rows, cols])],
                              [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
    path = tmp_path / "relu2.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), path)
    return path


def test_rows_too_wide_for_two_blocks_load_the_next_one_into_a_ring_of_buffers(tmp_path, monkeypatch):
    """Rows of 6912 (2B4T's feed-forward width) with two streamed inputs beside a resident
    weight row: two whole blocks do not fit, one block and a spare buffer do. The next block's
    first input loads into the spare while this one computes; the result is the same bit for bit
    (the race check proves the program ordered) and the kernel is faster than block after block."""
    rows, cols = 64, 6912
    path = _relu2_norm(tmp_path, rows, cols)
    program = compile_model(path, Options(WIDE))[1]
    buffers = {i.dst.addr for i in program.instrs if isinstance(i, DmaLoad) and i.cols == cols
               and program.tensors[i.src.tensor].kind == "input"}
    assert buffers == {cols + k * cols for k in range(3)}        # three buffers above the weight row
    rng = np.random.default_rng(4)
    x = {n: rng.standard_normal((rows, cols)).astype(np.float32) for n in "xu"}
    ring = run(program, WIDE, x)
    monkeypatch.setattr("dlegion_cc.lower.rowwise._Ring.fitting", lambda *a, **k: None)
    serial = run(compile_model(path, Options(WIDE))[1], WIDE, x)
    np.testing.assert_array_equal(ring.outputs["y"], serial.outputs["y"])
    assert ring.timeline.cycles < 0.9 * serial.timeline.cycles      # 14,437 against 16,958


def test_blocks_whose_outputs_fit_in_place_keep_three_in_flight(tmp_path, monkeypatch):
    """BitLinear's absmax quantization of [256, 2560] rows: its output in place, blocks of as
    many rows as half the scratchpad holds fit a third of it, so each Legion keeps three blocks
    in flight. With two, a block's stores wait in the in-order DMA queue for its body and the
    next loads behind them; the kernel is faster with three, and computes what onnxruntime does."""
    import onnxruntime as ort
    from dlegion_cc.lower import rowwise
    from models.bitnet import BitLinear, preset
    from models.graph import FLOAT, GraphBuilder, tensor_info
    from runtime.timing import simulate
    b = GraphBuilder()
    y = BitLinear(preset("2b4t", layers=1, seq=256), np.random.default_rng(0)).prepare(b, "x")
    model = b.model([tensor_info("x", FLOAT, [256, 2560])], [tensor_info(y, FLOAT, [256, 2560])])
    onnx.save(model, tmp_path / "q.onnx")
    program = compile_model(tmp_path / "q.onnx", Options(WIDE))[1]
    third = WIDE.derived.spad_elems["vec"] // 3
    assert {i.dst.addr for i in program.instrs if isinstance(i, DmaLoad)} == {0, third, 2 * third}
    x = np.random.default_rng(1).standard_normal((256, 2560)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(run(program, WIDE, {"x": x}).outputs[y], want)
    monkeypatch.setattr(rowwise, "_depth", lambda *args: 2)
    two = compile_model(tmp_path / "q.onnx", Options(WIDE))[1]
    assert simulate(program, WIDE).cycles < 0.97 * simulate(two, WIDE).cycles
