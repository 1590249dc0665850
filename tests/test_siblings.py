"""Asymmetric multi-matrix fusion: quantized matmuls sharing their input become one matmul whose
Legions each hold a slice of every member, and whose tiles store each slice to its own output."""
import numpy as np
import onnx
import pytest

from isa import arch
from isa.instructions import DmaStore
from dlegion_cc.lower.qmatmul import legion_major
from dlegion_cc.lower.qplan import Plan, Problem, Segment, stores
from dlegion_cc.passes.siblings import FuseSiblings
from dlegion_cc.pipeline import Options, compile_model
from models.bitnet import BitLinear, preset
from models.graph import FLOAT, GraphBuilder, tensor_info
from runtime.check import compare, onnx_reference
from runtime.emulator import run
from progbuild import assert_bitwise_equal, assert_matches_onnx, compile_without
from runtime.timing import simulate

TINY = arch.load("dlegion-tiny")


def _siblings_model(path, widths, rows=6, depth=48, seed=3, sparsity=0.0):
    """One absmax-quantized input shared by BitLinear projections of ``widths`` columns (a
    ``sparsity`` fraction of 8 x 8 weight blocks zero)."""
    b, rng = GraphBuilder(), np.random.default_rng(seed)
    linear = BitLinear(preset("tiny", seed=seed, block_sparsity=sparsity, block=8), rng)
    xq = linear.prepare(b, "x")
    outs = [linear.project(b, xq, f"proj{i}", depth, n) for i, n in enumerate(widths)]
    infos = [tensor_info(o, FLOAT, [1, rows, n]) for o, n in zip(outs, widths)]
    onnx.save(b.model([tensor_info("x", FLOAT, [1, rows, depth])], infos), path)
    return path, {"x": rng.standard_normal((1, rows, depth)).astype(np.float32)}


def _compile(path, machine, fuse=True, row_blocks=True):
    return compile_without(path, machine, None if fuse else FuseSiblings, row_blocks)


@pytest.mark.parametrize("widths", [(40, 24, 24), (20, 7), (16, 16, 16, 16)])
def test_fused_matmul_matches_onnxruntime_and_the_unfused_program(tmp_path, widths):
    path, inputs = _siblings_model(tmp_path / "m.onnx", widths)
    graph, fused = _compile(path, TINY)
    [node] = [n for n in graph.nodes if n.op == "QMatMul"]
    assert node.attrs["segments"] == list(widths)
    ours = run(fused, TINY, inputs).outputs
    assert_matches_onnx(ours, path, inputs)
    _, apart = _compile(path, TINY, fuse=False)
    theirs = run(apart, TINY, inputs).outputs
    assert_bitwise_equal(ours, theirs)


def test_fused_matmul_runs_fewer_passes_than_its_members(tmp_path):
    """GQA's K and V are a fifth of Q: alone, each fills a fraction of a w2 window (4 tiles);
    fused, a Legion's slices of all three share full windows."""
    machine = arch.load("dlegion-8x8")
    path, _ = _siblings_model(tmp_path / "qkv.onnx", (320, 80, 80), rows=32, depth=256)
    counts = {}
    for fuse in (True, False):
        _, program = _compile(path, machine, fuse)
        tl = simulate(program, machine)
        busy = max(tl.busy.get((legion, "mat"), 0) for legion in range(machine.legions))
        counts[fuse] = (tl.counters["passes"], busy)
    assert counts[True][0] < counts[False][0]
    assert counts[True][1] < counts[False][1]


def test_legion_major_layout_holds_every_column_once():
    lay = legion_major([40, 24, 7], legions=4, na=8)
    assert lay.widths == (10, 6, 2) and lay.offsets == (0, 10, 16) and lay.per_legion == 24
    taken = lay.columns[lay.columns >= 0]
    assert sorted(taken.tolist()) == list(range(71))
    # Legion 3's slice: columns 30..39 of the first, 18..23 of the second, none of the third
    # (7 columns, 2 a Legion, end in Legion 3's first), then padding.
    assert lay.columns[72:82].tolist() == list(range(30, 40))
    assert lay.columns[82:88].tolist() == list(range(58, 64))
    assert lay.columns[88:90].tolist() == [70, -1]


def test_stores_cover_each_output_column_once():
    """Every Legion's tiles, cut at any width, store each column of each segment exactly once."""
    lay = legion_major([40, 24, 7], legions=4, na=8)
    segs = tuple(Segment(t, n, w, o) for t, n, w, o in zip((5, 6, 7), (40, 24, 7), lay.widths, lay.offsets))
    p = Problem(0, None, (), None, 1, 8, None, None, None, 0, "w8", None, False, 5, range(4), 8,
                4 * lay.per_legion, 4 * lay.per_legion, (), segs)
    for cols in (8, 16, 24):
        plan = Plan("rows", 4, cols, 8, True, lay.per_legion, 2, 2, 2, 2, "k", True, False)
        seen = {s.tensor: [] for s in segs}
        for legion in range(4):
            for n0 in range(legion * lay.per_legion, (legion + 1) * lay.per_legion, cols):
                for seg, j, col, count in stores(p, plan, legion, n0, min(cols, (legion + 1) * lay.per_legion - n0)):
                    # the tile's column j is laid-out column n0 + j: it must be that output column
                    assert lay.columns[n0 + j] == sum(s.N for s in segs if s.tensor < seg.tensor) + col
                    seen[seg.tensor] += range(col, col + count)
        assert all(sorted(seen[s.tensor]) == list(range(s.N)) for s in segs)


def test_different_row_multipliers_do_not_fuse():
    """Matmuls whose drains multiply rows differently (their own activation-times-weight scale
    factors, as the dynamic int8 graphs have) keep their own drains."""
    from dlegion_cc.ir import DLEGION, Graph, Node, Value
    w = np.ones((8, 8), np.int8)
    values = {n: Value(n, (4, 8), np.dtype(np.float32)) for n in ("q", "s", "y0", "y1", "y2")}
    g = Graph(name="g", source="g.onnx", values=values, inputs=["q", "s"], outputs=["y0", "y1", "y2"], nodes=[
        Node("QMatMul", f"m{i}", ["q", "s"], [f"y{i}"], {"weight": w, "mode": "w2", "rscale_factor": f}, DLEGION)
        for i, f in enumerate((0.5, 0.5, 0.25))])
    FuseSiblings().run(g)
    assert [n.name for n in g.nodes] == ["m0+m1", "m2"]
    assert g.nodes[0].outputs == ["y0", "y1"] and g.nodes[0].attrs["segments"] == [8, 8]


def test_no_fusion_keeps_the_matmuls_apart(tmp_path):
    path, _ = _siblings_model(tmp_path / "m.onnx", (16, 8))
    graph, program = compile_model(path, Options(TINY, fusion=False))
    assert sum(n.op == "QMatMul" for n in graph.nodes) == 2
    assert {i.dst.tensor for i in program.instrs if isinstance(i, DmaStore)} >= {
        t for t, x in enumerate(program.tensors) if x.kind == "output"}


@pytest.mark.parametrize("widths, sparsity", [((40, 24, 24), 0.0), ((40,), 0.0), ((40, 24), 0.5)])
def test_rows_cut_into_parts_match_onnxruntime(tmp_path, monkeypatch, widths, sparsity):
    """Each part of the rows on a Legion of its own (forced here: dlegion-tiny's two Legions,
    one a part), fused or not, with zero weight blocks skipped or not: the weights laid out
    for one Legion, each part storing its own rows of every output."""
    from dlegion_cc.lower import qmatmul
    monkeypatch.setattr(qmatmul, "pick_width", lambda arch, switches, widths, part: 1)
    path, inputs = _siblings_model(tmp_path / "m.onnx", widths, rows=64, sparsity=sparsity)
    _, program = _compile(path, TINY)
    for row in compare(run(program, TINY, inputs).outputs, onnx_reference(path, inputs)):
        assert row.ok, f"{row.name}: relative L2 {row.rel_l2:.2e}"
    stored = {0: set(), 1: set()}
    for i in program.instrs:
        if isinstance(i, DmaStore) and i.dst.tensor in {program.tensors.index(t) for t in program.tensors
                                                        if t.kind == "output"}:
            row0 = i.dst.offset // i.dst.rs
            stored[i.legion] |= set(range(row0, row0 + i.rows))
    assert stored == {0: set(range(32)), 1: set(range(32, 64))}
    assert (simulate(program, TINY).counters["windows_skipped"] > 0) == (sparsity > 0)


def test_a_legions_slices_that_leave_its_last_pass_part_empty_cut_the_rows(tmp_path, monkeypatch):
    """dlegion-32x8, 2560 output columns: 5 array-wide slices a Legion, and a w2 pass holds 4
    windows, so each K-slice takes 2 passes for 5 windows. Parts of the rows on fewer Legions
    give each more slices to fill its passes: the cost model picks them, and they are faster."""
    from dlegion_cc.lower import qmatmul
    from dlegion_cc.lower.qparts import part_widths
    machine = arch.load("dlegion-32x8")
    assert part_widths(machine, 256, 160, 4) == [32, 16, 8]
    assert part_widths(machine, 256, 128, 4) == [32]          # 4 slices a Legion fill one pass
    assert part_widths(arch.load("dlegion-8x8"), 256, 160, 4) == [8]
    path, _ = _siblings_model(tmp_path / "o.onnx", (2560,), rows=512, depth=2560)
    picked = []
    pick = qmatmul.pick_width
    monkeypatch.setattr(qmatmul, "pick_width", lambda *a: picked.append(pick(*a)) or picked[-1])
    # (whole rows: row blocks of the quantization and the matmul would each be cut otherwise)
    parts = simulate(_compile(path, machine, row_blocks=False)[1], machine).cycles
    monkeypatch.setattr(qmatmul, "pick_width", lambda *a: machine.legions)
    whole = simulate(_compile(path, machine, row_blocks=False)[1], machine).cycles
    assert picked[0] < machine.legions
    assert parts < 0.95 * whole, (parts, whole)      # with the input's quantization: 0.91
