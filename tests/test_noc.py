"""Legion-to-Legion transfers (``noc.mv``): what they move, what the verifier and the race
check see, and what the timing model charges."""
import numpy as np
import pytest

from isa.arch import load
from isa.asm import parse
from isa.program import ProgramError
from isa.verify import verify
from runtime.emulator import run
from runtime.state import Trap
from runtime.timing import simulate

ARCH = load("dlegion-8x8")
HEAD = """.arch dlegion-8x8
.tensor x i8[4,64] input "x"
.tensor y i8[4,256] output "y"
"""
X = {"x": np.arange(256, dtype=np.int64).reshape(4, 64).astype(np.int8) - 100}


def program(body: str):
    return parse(HEAD + body)


# L0 loads x, sends it to L1, L2 and L5 at act 1024 (a multicast), each stores its copy.
MULTICAST = """dma.ld L0 {0} act[0,64,1] @x[0,64] rows=4 cols=64
noc.mv L0 {1-2,5} act[1024,64,1] act[0,64,1] rows=4 cols=64 wait=L0.dma>=1
dma.st L1 @y[0,256] act[1024,64,1] rows=4 cols=64 wait=L0.dma>=2
dma.st L2 @y[64,256] act[1024,64,1] rows=4 cols=64 wait=L0.dma>=2
dma.st L5 @y[128,256] act[1024,64,1] rows=4 cols=64 wait=L0.dma>=2
"""


def test_multicast_reaches_every_destination():
    y = run(program(MULTICAST), ARCH, X).outputs["y"]
    for part in range(3):
        assert np.array_equal(y[:, 64 * part:64 * part + 64], X["x"])
    with pytest.raises(Trap, match="never-written L3 act"):      # L3 is no destination
        run(program(MULTICAST + "dma.st L3 @y[192,256] act[1024,64,1] rows=4 cols=64 wait=L0.dma>=2\n"), ARCH, X)


def test_a_transfer_keeps_the_source_and_may_copy_locally():
    body = """dma.ld L0 {0} act[0,64,1] @x[0,64] rows=4 cols=64
noc.mv L0 {0} act[512,64,1] act[0,64,1] rows=4 cols=64 wait=L0.dma>=1
dma.st L0 @y[0,256] act[0,64,1] rows=4 cols=64 wait=L0.dma>=2
dma.st L0 @y[64,256] act[512,64,1] rows=4 cols=64 wait=L0.dma>=2
"""
    y = run(program(body), ARCH, X).outputs["y"]
    assert np.array_equal(y[:, :64], X["x"]) and np.array_equal(y[:, 64:128], X["x"])


def test_round_trip_of_the_text():
    p = program(MULTICAST)
    i = p.instrs[1]
    assert i.MNEMONIC == "noc.mv" and i.dests == frozenset({1, 2, 5}) and (i.rows, i.cols) == (4, 64)


def test_removing_the_dependency_is_a_race():
    """The send no longer waits for the load that writes its source: the race check names both."""
    body = MULTICAST.replace("rows=4 cols=64 wait=L0.dma>=1", "rows=4 cols=64", 1)
    with pytest.raises(Trap, match=r"noc\.mv.*dma\.ld|dma\.ld.*noc\.mv"):
        run(program(body), ARCH, X)


def test_a_reader_not_waiting_for_the_transfer_is_a_race():
    body = MULTICAST.replace("dma.st L2 @y[64,256] act[1024,64,1] rows=4 cols=64 wait=L0.dma>=2",
                             "dma.st L2 @y[64,256] act[1024,64,1] rows=4 cols=64 wait=L0.dma>=1")
    with pytest.raises(Trap, match=r"noc\.mv"):
        run(program(body), ARCH, X)


@pytest.mark.parametrize("instr, message", [
    ("noc.mv L0 {1} vec[0,64,1] act[0,64,1] rows=4 cols=64", "dst is in vec but src in act"),
    ("noc.mv L0 {9} act[0,64,1] act[0,64,1] rows=4 cols=64", "dests: Legion L9 does not exist"),
    ("noc.mv L0 {1} act[262140,64,1] act[0,64,1] rows=4 cols=64", "dst act[262140,64,1] over 4x64 reaches act element"),
])
def test_verify_names_the_field(instr, message):
    with pytest.raises(ProgramError) as e:
        verify(program(instr), ARCH)
    line = str(e.value)
    assert message in line and "noc.mv" in line and "\n" not in line


def test_no_multicast_without_the_machine_s():
    import dataclasses
    arch = dataclasses.replace(ARCH, multicast=False)
    with pytest.raises(ProgramError, match="no multicast"):
        verify(program("noc.mv L0 {1-2} act[0,64,1] act[0,64,1] rows=4 cols=64"), arch)


def test_timing_is_one_send_at_the_link_rate():
    """4 x 1000 int32 = 16,000 bytes over a 256-byte/cycle link: 62.5, so 63 cycles, whether
    it goes to one Legion or to seven (a multicast is one send). Two sends from one Legion
    take its DMA queue in turn: 126."""
    assert ARCH.derived.link_bytes_per_cycle == 256
    one = program("noc.mv L0 {1} acc[0,1000,1] acc[0,1000,1] rows=4 cols=1000")
    seven = program("noc.mv L0 {1-7} acc[0,1000,1] acc[0,1000,1] rows=4 cols=1000")
    two = program("noc.mv L0 {1} acc[0,1000,1] acc[0,1000,1] rows=4 cols=1000\n"
                  "noc.mv L0 {2} acc[4000,1000,1] acc[0,1000,1] rows=4 cols=1000")
    assert simulate(one, ARCH).cycles == 63
    assert simulate(seven, ARCH).cycles == 63
    tl = simulate(two, ARCH)
    assert tl.cycles == 126 and tl.counters["noc_bytes"] == 32_000 and tl.counters["dram_read_bytes"] == 0


def test_a_pass_waits_for_the_transfer():
    """A transfer after a 200-cycle DRAM latency and 1 cycle of load (256 bytes at 614 B/cycle,
    capped by the 256 B/cycle link: 1 cycle): the send then takes 1 cycle, so it is done at 202."""
    body = """dma.ld L0 {0} act[0,64,1] @x[0,64] rows=4 cols=64
noc.mv L0 {1} act[0,64,1] act[0,64,1] rows=4 cols=64 wait=L0.dma>=1
"""
    tl = simulate(program(body), ARCH)
    assert tl.done[1] == pytest.approx(202.0) and tl.cycles == 202


# --- a scheduled matmul that forwards its activations -------------------------------------

def _gemm(path, M, K, N):
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper
    w = numpy_helper.from_array(np.random.default_rng(5).integers(-128, 128, (K, N)).astype(np.int8), "w")
    node = helper.make_node("MatMulInteger", ["x", "w"], ["y"], name="gemm")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TP.INT8, [M, K])],
                              [helper.make_tensor_value_info("y", TP.INT32, [M, N])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), path)
    return path


def _compiled(model, machine, pinned=None, overlap=False):
    from dlegion_cc.lower import schedules
    from dlegion_cc.pipeline import Options, compile_model
    s = schedules.Schedules()
    if pinned is not None:
        s.pinned = {e["node"]: [e] for e in pinned}
        s.source = "pinned.json"
    _, program = compile_model(model, Options(machine, schedules=s, overlap=overlap))
    return program, s.document(machine, Options(machine).switches())["schedules"]


@pytest.mark.parametrize("homes", [1, 4])
def test_a_matmul_forwarding_its_activations_matches_onnxruntime(tmp_path, homes):
    """Pinned to keep its activation chunks in homes (all of them, or some: the rest are read
    from DRAM again), the GEMM sends them over the NoC and its int32 results are onnxruntime's."""
    import onnxruntime as ort
    from isa.instructions import DmaLoad, NocMove
    machine = load("dlegion-tiny")
    model = _gemm(tmp_path / "g.onnx", 32, 256, 128)
    _, (entry,) = _compiled(model, machine)
    entry.update(loop_order="rows", tile={"rows": 32, "cols": 16}, chunk={"depth": 32, "whole_rows": False, "homes": homes})
    entry["slots"]["act"] = 2
    program, (again,) = _compiled(model, machine, [entry])
    assert again["chunk"]["homes"] == homes
    sends = [i for i in program.instrs if isinstance(i, NocMove)]
    acts = [i for i in program.instrs if isinstance(i, DmaLoad) and i.dst.space == "act"]
    chunks = 256 // 32
    homed = min(chunks, homes * machine.legions)
    assert len([i for i in sends if len(i.dests) > 1]) > 0 and len([i for i in sends if len(i.dests) == 1]) == homed
    # Each homed chunk is read from DRAM once; the others once per column tile they are not in a slot for.
    assert sum(i.rows * i.cols for i in acts if i.src.tensor == acts[0].src.tensor) < 32 * 256 * (64 // 16)
    x = np.random.default_rng(6).integers(-128, 128, (32, 256)).astype(np.int8)
    got = run(program, machine, {"x": x}).outputs["y"]
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)
    if homes == 4:
        assert sum(i.rows * i.cols for i in acts if i.src.tensor == acts[0].src.tensor) == 32 * 256


def test_the_overlap_pass_orders_the_transfers(tmp_path):
    """With ``--overlap`` (waits on what instructions share, not barriers) the forwarding GEMM's
    transfers are ordered by what they read and write: the race check accepts the program and
    its results are onnxruntime's."""
    import onnxruntime as ort
    from isa.instructions import NocMove
    machine = load("dlegion-tiny")
    model = _gemm(tmp_path / "g.onnx", 32, 256, 128)
    _, (entry,) = _compiled(model, machine)
    entry.update(loop_order="rows", tile={"rows": 32, "cols": 16}, chunk={"depth": 32, "whole_rows": False, "homes": 4})
    entry["slots"]["act"] = 2
    program, _ = _compiled(model, machine, [entry], overlap=True)
    assert any(isinstance(i, NocMove) for i in program.instrs)
    x = np.random.default_rng(7).integers(-128, 128, (32, 256)).astype(np.int8)
    got = run(program, machine, {"x": x}, races=True).outputs["y"]
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)


def test_a_pinned_forward_that_cannot_apply_is_refused(tmp_path):
    from dlegion_cc.lower.schedules import ScheduleError
    machine = load("dlegion-tiny")
    model = _gemm(tmp_path / "g.onnx", 32, 256, 128)
    _, (entry,) = _compiled(model, machine)
    entry.update(tile={"rows": 32, "cols": 64}, chunk={"depth": 32, "whole_rows": False, "homes": 2})
    with pytest.raises(ScheduleError, match="homes 2: activations are forwarded only when"):
        _compiled(model, machine, [entry])


def test_the_search_forwards_only_where_it_ranks_best():
    """Forwarding variants are candidates beside each plain plan that reads a chunk again; the
    pick is one only when the cost model ranks it best, and --no-transfers leaves them out."""
    import dataclasses
    from dlegion_cc.lower.context import Switches
    from dlegion_cc.lower.qplan import candidates, estimate, search
    from test_qplan import problem
    machine = load("dlegion-8x8")
    _, p, _, _ = problem(machine, 256, 2560, 2560)
    plans = candidates(machine, p, Switches())
    forwarding = [plan for plan in plans if plan.forward]
    assert forwarding and all(plan.homes > 0 for plan in forwarding)
    assert not any(plan.forward for plan in candidates(machine, p, dataclasses.replace(Switches(), transfers=False)))
    e, pick = search(machine, p)
    plain, _ = search(machine, p, dataclasses.replace(Switches(), transfers=False))
    assert pick.forward and e.dram_bytes < plain.dram_bytes and e.cycles <= plain.cycles * 1.025
    assert e.detail["noc_bytes"] > 0
    assert estimate(machine, p, pick).cycles == e.cycles


def test_a_chain_row_block_forwards_with_room_for_the_next_block_s_loads():
    """In a chain's row block the next block's first loads go ahead of the last pass: every
    forwarding variant keeps ``CHAIN_SPARE_SLOTS`` activation slots beside its homes, where a
    matmul alone may keep fewer."""
    import dataclasses
    from dlegion_cc.lower.context import Switches
    from dlegion_cc.lower.qplan import CHAIN_SPARE_SLOTS, candidates
    from test_qplan import problem
    machine = load("dlegion-8x8")
    _, p, _, _ = problem(machine, 128, 2560, 3840)
    alone = [plan for plan in candidates(machine, p, Switches()) if plan.forward]
    chained = [plan for plan in candidates(machine, dataclasses.replace(p, row_block=True), Switches()) if plan.forward]
    assert min(plan.a_slots for plan in alone) < CHAIN_SPARE_SLOTS
    assert chained and min(plan.a_slots for plan in chained) >= CHAIN_SPARE_SLOTS
    # Pipelined passes: the homes the spares would leave out cost more than the stall.
    pipelined = dataclasses.replace(machine, pass_overlap=True)
    row_block = dataclasses.replace(p, row_block=True)
    assert min(plan.a_slots for plan in candidates(pipelined, row_block, Switches()) if plan.forward) < CHAIN_SPARE_SLOTS
