"""ReLU(gate)^2 * up in the drain of the fused gate/up matmul (``passes/gated.py``): the same
fp32 operations in the graph's order, so the product is bit for bit the one the separate kernel
made; each Legion's gate and up columns in pairs of granules, each output column stored once."""
import numpy as np
import onnx
import pytest

from isa import arch
from isa.instructions import DmaStore
from dlegion_cc import pipeline
from dlegion_cc.lower.qmatmul import gated_major
from dlegion_cc.lower.qplan import Plan, Problem, Segment, stores
from dlegion_cc.passes.gated import GateInDrain, gate_granule
from dlegion_cc.pipeline import Options
from models.bitnet import BitLinear, preset
from models.decoder import relu2
from models.graph import FLOAT, GraphBuilder, tensor_info
from runtime.check import compare, onnx_reference
from runtime.emulator import run
from progbuild import assert_bitwise_equal, assert_matches_onnx, compile_without
from runtime.timing import simulate

TINY, EIGHT = arch.load("dlegion-tiny"), arch.load("dlegion-8x8")


def _mlp(path, rows, depth, ffn, exponent=2.0, seed=5, gate_out=False):
    """Gate and up on one absmax-quantized input, ReLU(gate)^exponent * up (an output), then
    quantized into down; ``gate_out``: the gate is an output too."""
    b, rng = GraphBuilder(), np.random.default_rng(seed)
    linear = BitLinear(preset("tiny", seed=seed, block=8), rng)
    xq = linear.prepare(b, "x")
    up = linear.project(b, xq, "up_proj", depth, ffn)
    gate = linear.project(b, xq, "gate_proj", depth, ffn)
    act = relu2(b, gate) if exponent == 2.0 else b.op("Pow", b.op("Relu", gate), b.f32(exponent))
    hidden = b.op("Mul", act, up)
    down = linear.project(b, linear.prepare(b, hidden), "down_proj", ffn, depth)
    outs = [(hidden, ffn), (down, depth)] + ([(gate, ffn)] if gate_out else [])
    onnx.save(b.model([tensor_info("x", FLOAT, [1, rows, depth])],
                      [tensor_info(o, FLOAT, [1, rows, n]) for o, n in outs]), path)
    return path, {"x": rng.standard_normal((1, rows, depth)).astype(np.float32)}


def _compile(path, machine, gated=True, row_blocks=True):
    return compile_without(path, machine, None if gated else GateInDrain, row_blocks)


def _gated_nodes(graph) -> list:
    return [n for n in graph.nodes if n.op == "QMatMul" and n.attrs.get("gated") is not None]


@pytest.mark.parametrize("machine, rows, depth, ffn, row_blocks", [
    (TINY, 6, 48, 64, True), (TINY, 40, 32, 96, True), (EIGHT, 256, 128, 512, True), (EIGHT, 256, 128, 512, False)])
def test_the_product_in_the_drain_is_the_separate_kernels_bit_for_bit(tmp_path, machine, rows, depth, ffn, row_blocks):
    path, inputs = _mlp(tmp_path / "mlp.onnx", rows, depth, ffn)
    graph, program = _compile(path, machine, row_blocks=row_blocks)
    [node] = _gated_nodes(graph)
    assert not any(n.op in ("Relu", "Pow") or (n.op == "RowKernel" and any(s.op == "Relu" for s in n.attrs["nodes"]))
                   for n in graph.nodes)
    ours = run(program, machine, inputs).outputs                          # race-checked
    assert_matches_onnx(ours, path, inputs)
    apart_graph, apart = _compile(path, machine, gated=False, row_blocks=row_blocks)
    assert not _gated_nodes(apart_graph)
    theirs = run(apart, machine, inputs).outputs
    assert ours.keys() == theirs.keys()
    assert_bitwise_equal(ours, theirs)


def test_the_drain_stores_half_the_bytes_and_the_kernel_after_it_reads_half(tmp_path):
    """Gate and up are no longer written to DRAM and read back: only their product is."""
    path, _ = _mlp(tmp_path / "mlp.onnx", 256, 128, 512)
    moved = {}
    for gated in (True, False):
        _, program = _compile(path, EIGHT, gated, row_blocks=False)
        stored = sum(i.rows * i.cols * 4 for i in program.instrs if isinstance(i, DmaStore)
                     and program.tensors[i.dst.tensor].dtype == "f32")
        moved[gated] = (stored, simulate(program, EIGHT).cycles)
    assert moved[True][0] < moved[False][0]
    assert moved[True][1] < moved[False][1]


@pytest.mark.parametrize("exponent, gate_out", [(3.0, False), (2.0, True)])
def test_no_gate_in_the_drain_when_the_pattern_differs(tmp_path, exponent, gate_out):
    """A cube is not a square, and a gate read elsewhere must be stored: both stay apart."""
    path, inputs = _mlp(tmp_path / "mlp.onnx", 6, 48, 64, exponent=exponent, gate_out=gate_out)
    graph, program = _compile(path, TINY)
    assert not _gated_nodes(graph)
    for row in compare(run(program, TINY, inputs).outputs, onnx_reference(path, inputs)):
        assert row.ok, f"{row.name}: relative L2 {row.rel_l2:.2e}"


def test_gated_layout_pairs_each_up_granule_with_its_gate():
    g = gate_granule(TINY)
    assert g == 16                               # half a w2 window of 8-wide arrays
    lay = gated_major(64, gate=1, legions=2, granule=g)
    assert lay.widths == (32,) and lay.per_legion == 64
    assert sorted(lay.columns.tolist()) == list(range(128))
    for legion in range(2):
        for pair in range(2):
            at = legion * 64 + pair * 2 * g
            up = lay.columns[at:at + g]
            assert up.tolist() == list(range(legion * 32 + pair * g, legion * 32 + (pair + 1) * g))
            assert (lay.columns[at + g:at + 2 * g] == up + 64).all()   # the gate segment comes second


def test_gated_stores_cover_each_output_column_once():
    """Every Legion's tiles, of any whole number of pairs, store each product column once, from
    the up granule of its pair."""
    g, legions = 16, 2
    lay = gated_major(128, gate=0, legions=legions, granule=g)
    seg = Segment(5, 128, lay.widths[0], 0)
    n = legions * lay.per_legion
    p = Problem(0, None, (), None, 1, 8, None, None, None, 0, "w8", None, False, 5, range(4), 8,
                n, n, (), (seg,), gated=g)
    for cols in (32, 64, 96):
        plan = Plan("rows", 4, cols, 8, True, lay.per_legion, 2, 2, 2, 2, "k", True, False)
        seen = []
        for legion in range(legions):
            start = legion * lay.per_legion
            for n0 in range(start, start + lay.per_legion, cols):
                for s, j, col, count in stores(p, plan, legion, n0, min(cols, start + lay.per_legion - n0)):
                    # the up column the product is left in is that output column of the up segment
                    assert lay.columns[n0 + j] == 128 + col and count == g
                    seen += range(col, col + count)
        assert sorted(seen) == list(range(128))


def test_a_broken_product_is_caught(tmp_path, monkeypatch):
    """The drain's product computed in another order (the gate squared before its ReLU) gives
    other numbers for negative gates: the bit-for-bit comparison fails."""
    from isa.instructions import BY_MNEMONIC
    from dlegion_cc.lower import qtiles

    def squared_first(st, g, src, elems):
        k = st.p.gated
        up, gate = qtiles.View("vec", src.addr, 2 * k, 1), qtiles.View("vec", src.addr + k, 2 * k, 1)
        rows = elems // (2 * k)
        st.emit(g, BY_MNEMONIC["vmul"](g.base, gate, gate, gate, rows, k))
        st.emit(g, BY_MNEMONIC["vmul"](g.base, up, gate, up, rows, k))
    monkeypatch.setattr(qtiles, "_gate", squared_first)
    path, inputs = _mlp(tmp_path / "mlp.onnx", 6, 48, 64)
    _, program = _compile(path, TINY)
    _, apart = _compile(path, TINY, gated=False)
    ours, theirs = run(program, TINY, inputs).outputs, run(apart, TINY, inputs).outputs
    assert not all(np.array_equal(ours[k], theirs[k]) for k in theirs)



def test_a_pinned_tile_that_cuts_a_pair_is_refused(tmp_path):
    """A schedule file pinning the gated matmul's tiles to 16 columns (a multiple of the array,
    half a pair of granules) is refused, naming the pairs."""
    from dlegion_cc.lower import schedules
    path, _ = _mlp(tmp_path / "mlp.onnx", 6, 48, 64)
    emitted = schedules.Schedules()
    pipeline.compile_model(path, Options(TINY, schedules=emitted))
    doc = emitted.document(TINY, Options(TINY).switches())
    pinned = schedules.Schedules()
    for e in doc["schedules"]:
        if "gate_proj" in e["node"]:
            e["tile"]["cols"] = 16
        pinned.pinned.setdefault(e["node"], []).append(e)
    pinned.source = "pinned.json"
    with pytest.raises(schedules.ScheduleError, match="pairs of 16-column granules"):
        pipeline.compile_model(path, Options(TINY, schedules=pinned))
