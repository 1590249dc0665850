"""K split over the Legions: the reducing transfer ``noc.add`` (what it adds, what the race check
and the timing model see) and the schedule that splits a matmul's K over the Legions
(``dlegion_cc/lower/ksplit.py``): exact results, picked only where it wins, pinned by file."""
import dataclasses
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from isa.arch import load
from isa.asm import parse
from isa.instructions import NocAdd
from isa.program import ProgramError
from isa.verify import verify
from runtime.emulator import run
from runtime.state import Trap
from runtime.timing import simulate

ARCH = load("dlegion-8x8")

# Legions 0 and 1 each multiply one half of K (32 of 64) into their accumulators; L1 adds its
# partial sums into L0's over the NoC once both passes are done; L0 stores the sum.
TWO = """.arch dlegion-8x8
.tensor x i8[1,64] input "x"
.tensor w i8[64,16] input "w"
.tensor y i32[1,16] output "y"
dma.ld L0 {0} act[0,32,1] @x[0,64] rows=1 cols=32
dma.ld L0 {0} wgt[0,16,1] @w[0,16] rows=32 cols=16
dma.ld L1 {1} act[0,32,1] @x[32,64] rows=1 cols=32
dma.ld L1 {1} wgt[0,16,1] @w[512,16] rows=32 cols=16
mm L0 acc[0,16] act[0,32] wgt[0,16] M=1 K=32 N=16 mode=w8 split=k accumulate=set mask=none wait=L0.dma>=2
mm L1 acc[0,16] act[0,32] wgt[0,16] M=1 K=32 N=16 mode=w8 split=k accumulate=set mask=none wait=L1.dma>=2
wait L1 dma L0.mat>=1
noc.add L1 {0} acc[0,16,1] acc[0,16,1] rows=1 cols=16 wait=L1.mat>=1
dma.st L0 @y[0,16] acc[0,16,1] rows=1 cols=16 wait=L1.dma>=4
"""
RNG = np.random.default_rng(3)
XW = {"x": RNG.integers(-128, 128, (1, 64)).astype(np.int8), "w": RNG.integers(-128, 128, (64, 16)).astype(np.int8)}


def test_the_reduction_adds_the_partial_sums():
    y = run(parse(TWO), ARCH, XW).outputs["y"]
    np.testing.assert_array_equal(y, XW["x"].astype(np.int64) @ XW["w"].astype(np.int64))


@pytest.mark.parametrize("cuts, names", [
    # the reduction no longer waits for L0's pass, which may still be writing its sums
    ((("wait L1 dma L0.mat>=1\n", ""), ("wait=L1.dma>=4", "wait=L1.dma>=3")), r"noc\.add.*mm|mm.*noc\.add"),
    # the store no longer waits for the reduction
    ((("wait=L1.dma>=4", "wait=L1.dma>=3"),), r"noc\.add"),
])
def test_a_removed_wait_around_the_reduction_is_a_race(cuts, names):
    body = TWO
    for old, new in cuts:
        body = body.replace(old, new)
    with pytest.raises(Trap, match=names):
        run(parse(body), ARCH, XW)


def test_a_transfer_into_another_legion_is_ordered_by_that_legion_s_queues():
    """A send waiting only for its own Legion's pass does not order it after the receiver's
    work: L1 overwriting L0's activations while L0 may still load and read them is a race."""
    body = TWO.replace("wait L1 dma L0.mat>=1\n", "").replace(
        "noc.add L1 {0} acc[0,16,1] acc[0,16,1] rows=1 cols=16 wait=L1.mat>=1",
        "noc.mv L1 {0} act[0,32,1] act[0,32,1] rows=1 cols=32 wait=L1.mat>=1").replace("wait=L1.dma>=4", "wait=L0.mat>=1")
    with pytest.raises(Trap, match=r"noc\.mv: race on L0 act"):
        run(parse(body), ARCH, XW)


def test_verify_refuses_a_reduction_outside_the_accumulators():
    with pytest.raises(ProgramError, match="noc.add adds int32 partial sums: dst and src must be acc"):
        verify(parse(".arch dlegion-8x8\nnoc.add L0 {1} vec[0,16,1] vec[0,16,1] rows=1 cols=16\n"), ARCH)


def test_cycles_of_a_small_k_split_by_hand():
    """L0's loads: x lands at 200 + 32 B / 256 B a link-cycle = 200.125; w, sent after x's bytes
    left, at 0.125 + 200 + 512 / 256 = 202.125. Its pass: the 16-cycle weight load, then the
    two K slices on two cores, one pass each of M + N = 17 cycles: 235.125 (L1's the same).
    The reduction: 64 bytes over the link, 1 cycle (the accumulator port's 2 x 16 words take
    one of its 1024): 236.125. The store: 64 bytes leave at 0.25 cycle and land 200 later:
    436.375, so 437 cycles."""
    tl = simulate(parse(TWO), ARCH)
    assert tl.done[7] == pytest.approx(236.125) and tl.done[8] == pytest.approx(436.375) and tl.cycles == 437


def test_a_reduction_costs_the_link_or_the_accumulator_port():
    """4 x 1000 int32: 16,000 bytes over the 256-byte link, 63 cycles; the port reads and writes
    8,000 words, 8 of its 1024-word cycles. With a 64-word port the adds take 125 cycles. A tree
    over 8 Legions is 3 such steps, one after another: 189."""
    one = parse(".arch dlegion-8x8\nnoc.add L1 {0} acc[0,1000,1] acc[0,1000,1] rows=4 cols=1000\n")
    assert simulate(one, ARCH).cycles == 63
    assert simulate(one, dataclasses.replace(ARCH, acc_port_words=64)).cycles == 125
    tree = [f"noc.add L{s} {{{r}}} acc[0,1000,1] acc[0,1000,1] rows=4 cols=1000" + (f" wait=L{w}.dma>=1" if w else "")
            for s, r, w in [(1, 0, 0), (3, 2, 0), (5, 4, 0), (7, 6, 0), (2, 0, 3), (6, 4, 7), (4, 0, 6)]]
    assert simulate(parse(".arch dlegion-8x8\n" + "\n".join(tree) + "\n"), ARCH).cycles == 189


# --- the schedule ---------------------------------------------------------------------------

def _gemm(path, M, K, N, ternary=False):
    rng = np.random.default_rng(5)
    w = (rng.integers(-1, 2, (K, N)) if ternary else rng.integers(-128, 128, (K, N))).astype(np.int8)
    node = helper.make_node("MatMulInteger", ["x", "w"], ["y"], name="gemm")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TP.INT8, [M, K])],
                              [helper.make_tensor_value_info("y", TP.INT32, [M, N])], [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


def _compiled(model, machine, pinned=None, ksplit=True):
    from dlegion_cc.lower import schedules
    from dlegion_cc.pipeline import Options, compile_model
    s = schedules.Schedules()
    if pinned is not None:
        s.pinned = {e["node"]: [e] for e in pinned}
        s.source = "pinned.json"
    options = Options(machine, schedules=s, ksplit=ksplit)
    _, program = compile_model(model, options)
    return program, s.document(machine, options.switches())["schedules"]


def _onnxruntime(model, x):
    import onnxruntime as ort
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_a_pinned_k_split_matches_onnxruntime(tmp_path):
    """A matmul the search keeps on its columns (dlegion-tiny, 4 rows), pinned to split K over
    the Legions: noc.add reduces its partial sums, race-free, and its int32 results are
    onnxruntime's bit for bit."""
    machine = load("dlegion-tiny")
    model = _gemm(tmp_path / "g.onnx", 4, 512, 32)
    _, (entry,) = _compiled(model, machine)
    assert entry["k_split"] is None
    entry["k_split"] = {"parts": machine.legions}
    program, (again,) = _compiled(model, machine, [entry])
    assert again["k_split"]["parts"] == machine.legions
    adds = [i for i in program.instrs if isinstance(i, NocAdd)]
    assert len(adds) == machine.legions - 1 and {d for i in adds for d in i.dests} >= {0}
    x = np.random.default_rng(6).integers(-128, 128, (4, 512)).astype(np.int8)
    np.testing.assert_array_equal(run(program, machine, {"x": x}, races=True).outputs["y"], _onnxruntime(model, x))


@pytest.mark.parametrize("M, K, N, ternary, picked", [
    (1, 2560, 64, True, True),        # a decode-shaped GEMM of 4 column tiles: 4 of 8 Legions would idle
    (1, 2048, 32, False, True),
    (1, 2560, 640, True, False),      # 40 column tiles: every Legion has columns
    (64, 1024, 32, False, True),      # small N: 2 column tiles, even with 64 rows
    (16, 1024, 256, False, False),    # 16 column tiles: two a Legion
])
def test_the_search_splits_k_only_where_it_wins(tmp_path, M, K, N, ternary, picked):
    """Searched, the K split is taken exactly where the timing model finds it faster than the
    plan without it (each pinned the other way to compare), and the results stay onnxruntime's."""
    model = _gemm(tmp_path / "g.onnx", M, K, N, ternary)
    program, (entry,) = _compiled(model, ARCH)
    assert (entry["k_split"] is not None) == picked
    other = dict(entry, k_split=None if picked else {"parts": ARCH.legions})
    alternative, _ = _compiled(model, ARCH, [other])
    faster = simulate(program, ARCH).cycles < simulate(alternative, ARCH).cycles
    assert faster
    if picked:
        x = np.random.default_rng(8).integers(-128, 128, (M, K)).astype(np.int8)
        np.testing.assert_array_equal(run(program, ARCH, {"x": x}).outputs["y"], _onnxruntime(model, x))


def test_no_ksplit_switch(tmp_path):
    model = _gemm(tmp_path / "g.onnx", 1, 2048, 32)
    program, (entry,) = _compiled(model, ARCH, ksplit=False)
    assert entry["k_split"] is None and not any(isinstance(i, NocAdd) for i in program.instrs)


def test_the_schedule_file_round_trips_the_k_split(tmp_path, cc):
    """``--emit schedule`` writes k_split; ``--schedule`` of that file compiles the same program."""
    model = _gemm(tmp_path / "g.onnx", 1, 2048, 32)
    status, _ = cc(model, "--arch", "dlegion-8x8", "--emit", "schedule", "-o", tmp_path / "s.json", "-q")
    (entry,) = json.loads((tmp_path / "s.json").read_text())["schedules"]
    assert status == 0 and entry["k_split"]["parts"] == 8
    for out, pin in (("a.s", ()), ("b.s", ("--schedule", tmp_path / "s.json"))):
        assert cc(model, "--arch", "dlegion-8x8", "-o", tmp_path / out, "-q", *pin)[0] == 0
    body = lambda name: (tmp_path / name).read_text().split("\n", 2)[2]     # past the .data line
    assert body("a.s") == body("b.s") and "noc.add" in body("a.s")


def test_a_bad_pinned_k_split_is_one_line(tmp_path):
    from dlegion_cc.lower.schedules import ScheduleError
    model = _gemm(tmp_path / "g.onnx", 1, 2048, 32)
    _, (entry,) = _compiled(model, ARCH)
    for bad, message in (({"parts": 9}, "k_split parts 9: dlegion-8x8 splits K over 2 to 8 Legions"),
                         (3, "'k_split' must be null or an object")):
        with pytest.raises(ScheduleError, match=message) as e:
            _compiled(model, ARCH, [dict(entry, k_split=bad)])
        assert "\n" not in str(e.value)


def test_a_split_between_nodes_under_overlap_is_race_free(tmp_path):
    """Two int32 matmuls of one input and a Cast after the first, compiled with ``--overlap``
    (nodes end in waits on what they share): the split's reductions are ordered by what they
    read and write, and the results are onnxruntime's."""
    import onnxruntime as ort
    from dlegion_cc.pipeline import Options, compile_model
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.integers(-128, 128, (2048, n)).astype(np.int8), f"w{n}") for n in (32, 16)]
    nodes = [helper.make_node("MatMulInteger", ["x", "w32"], ["y1"], name="a"),
             helper.make_node("MatMulInteger", ["x", "w16"], ["y2"], name="b"),
             helper.make_node("Cast", ["y1"], ["f1"], to=TP.FLOAT)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.INT8, [1, 2048])],
                              [helper.make_tensor_value_info("f1", TP.FLOAT, [1, 32]),
                               helper.make_tensor_value_info("y2", TP.INT32, [1, 16])], inits)
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    _, program = compile_model(path, Options(ARCH, overlap=True))
    assert any(isinstance(i, NocAdd) for i in program.instrs)
    x = rng.integers(-128, 128, (1, 2048)).astype(np.int8)
    got = run(program, ARCH, {"x": x}, races=True).outputs
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(got["f1"], want[0])
    np.testing.assert_array_equal(got["y2"], want[1])
