"""Instructions that span Legions and conditions relative to program order."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

from isa import arch, asm
from isa.expand import expand
from isa.fields import Cond, DramRef, View
from isa.instructions import BY_MNEMONIC, Barrier, DmaLoad, DmaStore, Wait
from isa.program import Program, ProgramError, Tensor
from isa.verify import check, verify
from runtime.emulator import run
from runtime.timing import simulate

TINY = arch.load("dlegion-tiny")            # 2 Legions
WIDE = arch.load("dlegion-8x8")             # 8 Legions
VADD = BY_MNEMONIC["vadd"]


def _program(instrs, rows=4, cols=16):
    tensors = [Tensor("x", "f32", (rows, cols), "input", io_name="x"),
               Tensor("y", "f32", (rows, cols), "output", io_name="y")]
    return Program("dlegion-tiny", tensors, instrs, source="t.s", lines=list(range(1, len(instrs) + 1)))


def _add_one(span=None, per=2, cols=16, legion=0):
    """y = x + 1 with blocks of ``per`` rows, one per Legion of a span."""
    v = View("vec", 0, cols, 1)
    stride = per * cols if span else None
    return [DmaLoad(legion, frozenset({legion}), v, DramRef(0, 0, cols), per, cols, span=span, lstride=stride),
            VADD(legion, v, v, 1.0, per, cols, span=span, wait=Cond(None, "dma")),
            DmaStore(legion, DramRef(1, 0, cols), v, per, cols, span=span, lstride=stride,
                     wait=Cond(None, "vec"))]


def test_a_span_runs_once_per_legion_with_its_dram_offset_and_destinations_moved():
    load = DmaLoad(0, frozenset({0}), View("vec", 0, 16, 1), DramRef(0, 8, 16), 2, 16, span=2, lstride=32)
    tasks = expand(_program([load]), legions=2).program.instrs
    assert [(t.legion, t.dests, t.src.offset, t.span, t.lstride) for t in tasks] == [
        (0, frozenset({0}), 8, None, None), (1, frozenset({1}), 40, None, None)]


def test_relative_conditions_become_the_counts_each_legion_has_reached():
    load = DmaLoad(0, frozenset({0}), View("vec", 0, 16, 1), DramRef(0, 0, 16), 1, 16)
    add = VADD(0, View("vec", 0, 16, 1), View("vec", 0, 16, 1), 1.0, 1, 16)
    instrs = [load, load, Barrier(),
              add.__class__(**{**add.__dict__, "span": 2, "wait": Cond(None, "dma")}),
              Wait(1, "vec", Cond(0, "dma", None, 1)),
              Wait(1, "mat", Cond(None, "vec", None, 0))]
    p = expand(_program(instrs), legions=2).program
    # L0 ran two loads and the barrier, L1 only the barrier
    assert [t.wait for t in p.instrs[3:5]] == [Cond(0, "dma", 3), Cond(1, "dma", 1)]
    assert p.instrs[5].until == Cond(0, "dma", 2)           # all of L0's dma but the last one
    assert p.instrs[6].until == Cond(1, "vec", 3)           # its own: the barrier, the vadd, the wait


def test_ranks_of_one_span_do_not_wait_on_each_other():
    add = VADD(0, View("vec", 0, 16, 1), View("vec", 0, 16, 1), 1.0, 1, 16, span=2, wait=Cond(0, "vec"))
    tasks = expand(_program([add]), legions=2).program.instrs
    assert [t.wait for t in tasks] == [Cond(0, "vec", 0), Cond(0, "vec", 0)]


def test_a_span_past_the_last_legion_is_rejected_with_its_line():
    p = _program([VADD(1, View("vec", 0, 16, 1), View("vec", 0, 16, 1), 1.0, 1, 16, span=2),
                  VADD(0, View("vec", 0, 16, 1), View("vec", 0, 16, 1), 1.0, 1, 16, span=0)])
    problems = check(p, TINY)
    assert "t.s:1: vadd: span: L2 does not exist (dlegion-tiny has 2 Legions: L0 to L1)" in problems
    assert "t.s:2: vadd: span: a span of 0 Legions runs nowhere" in problems


def test_a_span_past_the_last_legion_is_rejected_in_a_program_read_from_text():
    # Read from text, its spans are found from its words: the same problems, the good span not.
    p = asm.parse(".arch dlegion-tiny\n"
                  "vadd L1 vec[0,16,1] vec[0,16,1] #1 rows=1 cols=16 span=2\n"
                  "vadd L0 vec[0,16,1] vec[0,16,1] #1 rows=1 cols=16 span=0\n"
                  "vadd L0 vec[0,16,1] vec[0,16,1] #1 rows=1 cols=16 span=2\n")
    assert check(p, TINY) == ["<text>:2: vadd: span: L2 does not exist (dlegion-tiny has 2 Legions: L0 to L1)",
                              "<text>:3: vadd: span: a span of 0 Legions runs nowhere"]


def test_problems_of_a_task_name_the_line_it_came_from_once():
    bad = DmaLoad(0, frozenset({0}), View("vec", 0, 16, 1), DramRef(0, 0, 16), 4, 16, span=2, lstride=16)
    problems = check(_program([bad]), TINY)
    assert len(problems) == 1 and problems[0].startswith("t.s:1: dma.ld: src @x")


def test_spanned_and_written_out_programs_compute_and_time_the_same():
    x = np.arange(64, dtype=np.float32).reshape(4, 16)
    spanned = _program(_add_one(span=2))
    written_out = _program(_add_one(legion=0) + [
        DmaLoad(1, frozenset({1}), View("vec", 0, 16, 1), DramRef(0, 32, 16), 2, 16),
        VADD(1, View("vec", 0, 16, 1), View("vec", 0, 16, 1), 1.0, 2, 16, wait=Cond(1, "dma", 1)),
        DmaStore(1, DramRef(1, 32, 16), View("vec", 0, 16, 1), 2, 16, wait=Cond(1, "vec", 1))])
    a, b = run(spanned, TINY, {"x": x}), run(written_out, TINY, {"x": x})
    np.testing.assert_array_equal(a.outputs["y"], x + 1)
    np.testing.assert_array_equal(b.outputs["y"], x + 1)
    assert a.timeline.cycles == b.timeline.cycles == simulate(spanned, TINY).cycles


def test_a_fault_in_one_rank_names_the_spanned_instruction():
    instrs = _add_one(span=2)
    instrs[0] = DmaLoad(0, frozenset({0}), View("vec", 0, 16, 1), DramRef(0, 0, 16), 1, 16, span=2, lstride=32)
    with pytest.raises(Exception, match=r"t\.s:2: vadd: read of never-written L0"):
        run(_program(instrs), TINY, {"x": np.zeros((4, 16), np.float32)})


def test_spans_and_relative_waits_round_trip_through_text():
    text = (".arch dlegion-tiny\n.tensor x f32[4,16] input \"x\"\n.tensor y f32[4,16] output \"y\"\n"
            "dma.ld L0 {0} vec[0,16,1] @x[0,16] rows=2 cols=16 span=2 lstride=32\n"
            "vadd L0 vec[0,16,1] vec[0,16,1] #1 rows=2 cols=16 span=2 wait=dma\n"
            "wait L1 mat L0.vec~1\n"
            "dma.st L0 @y[0,16] vec[0,16,1] rows=2 cols=16 span=2 lstride=32 wait=vec\n")
    p = asm.parse(text, "t.s")
    assert p.instrs[1].wait == Cond(None, "dma") and p.instrs[2].until == Cond(0, "vec", None, 1)
    assert asm.parse(asm.format_program(p), "t.s") == p
    verify(p, TINY)


@pytest.mark.parametrize("text, message", [
    ("vadd L0 vec[0,16,1] vec[0,16,1] #1 rows=2 cols=16 wait=dma>1", "unexpected"),
    ("vadd L0 vec[0,16,1] vec[0,16,1] #1 rows=2 cols=16 span=-1", "unexpected"),
])
def test_malformed_spans_and_conditions_are_syntax_errors(text, message):
    with pytest.raises(ProgramError, match=message):
        asm.parse(".arch dlegion-tiny\n" + text + "\n", "t.s")


def test_compiled_row_kernels_span_every_legion(tmp_path):
    """An element-wise op over many rows is emitted once per group of eight Legions."""
    node = helper.make_node("Sigmoid", ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TP.FLOAT, [4096, 512])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [4096, 512])])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), path)
    from dlegion_cc.pipeline import Options, compile_model
    _, program = compile_model(path, Options(WIDE))
    tasks = expand(program, WIDE.legions).program.instrs
    spans = [i.span for i in program.instrs if hasattr(i, "span")]
    assert spans and all(s == WIDE.legions for s in spans)
    assert len(tasks) >= 7 * len(program.instrs)
    x = np.random.default_rng(0).standard_normal((4096, 512)).astype(np.float32)
    y = run(program, WIDE, {"x": x}).outputs["y"]
    np.testing.assert_allclose(y, 1 / (1 + np.exp(-x)), rtol=1e-6)


@pytest.mark.parametrize("body, message", [
    ("dma.ld L0 {0} vec[0,16,1] @x[0,16] rows=2 cols=16 span=2 lstride=48",
     "dma.ld: src @x[48,16] over 2x16 reaches storage element 79 of tensor 'x', which has 64"),
    ("dma.st L0 @y[0,16] vec[0,16,1] rows=2 cols=16 span=2 lstride=40",
     "dma.st: dst @y[40,16] over 2x16 reaches storage element 71 of tensor 'y', which has 64"),
    ("dma.ld L0 {1} vec[0,16,1] @x[0,16] rows=2 cols=16 span=2 lstride=32",
     "dma.ld: dests: Legion L2 does not exist (dlegion-tiny has 2)"),
])
def test_the_last_rank_of_a_transfer_is_checked_where_it_moves(body, message):
    """The first rank fits; the last one's DRAM window or destination does not."""
    text = ".arch dlegion-tiny\n.tensor x f32[4,16] input \"x\"\n.tensor y f32[4,16] output \"y\"\n" + body + "\n"
    assert check(asm.parse(text, "t.s"), TINY) == [f"t.s:4: {message}"]



def _plus(value: float):
    return VADD(0, View("vec", 0, 16, 1), View("vec", 0, 16, 1), value, 2, 16)


def test_instructions_read_from_text_are_alike_by_their_words():
    """Read from text, instructions are found alike by their words: the same partition as by
    their fields (the layers' repeats), except immediates equal only as values (0.0, -0.0)."""
    from isa.encoding import kept_words
    from isa.expand import Alike
    p = asm.parse(asm.format_program(_program(_add_one(span=2) * 2 + [_plus(-0.0)])), "t.s")
    tasks = expand(p, legions=2).program.instrs
    assert tasks.words == kept_words(p) is not None
    assert tasks.alike().ids == Alike(p.instrs).ids == [0, 1, 2, 0, 1, 2, 6]
    signed = asm.parse(asm.format_program(_program([_plus(0.0), _plus(-0.0)])), "t.s")
    assert Alike(signed.instrs).ids == [0, 0]                               # equal as fields
    assert expand(signed, legions=2).program.instrs.alike().ids == [0, 1]   # not as words


def _same_tasks(p: Program, legions: int):
    """The arrays of a program's tasks read from its words equal those read from its objects."""
    from isa.encoding import kept_words
    from isa.expand import Tasks
    words = kept_words(p)
    assert words is not None
    fast, slow = Tasks(p.instrs, legions, words), Tasks(p.instrs, legions)
    for name in ("origin", "first", "legion", "queue", "cond", "barrier"):
        np.testing.assert_array_equal(getattr(fast, name), getattr(slow, name), err_msg=name)
    assert fast.names == slow.names == ["dma", "mat", "vec"]
    return fast


def test_tasks_read_from_words_equal_tasks_read_from_objects_with_spans_and_relative_waits():
    text = (".arch dlegion-8x8\n.tensor x f32[8,16] input \"x\"\n.tensor y f32[8,16] output \"y\"\n"
            "dma.ld L0 {0} vec[0,16,1] @x[0,16] rows=2 cols=16 span=4 lstride=32\n"
            "dma.ld L5 {5,6} vec[0,16,1] @x[0,16] rows=1 cols=16 wait=L3.vec>=2\n"
            "vadd L0 vec[0,16,1] vec[0,16,1] #1 rows=2 cols=16 span=4 wait=dma\n"
            "barrier\n"
            "wait L1 mat L0.vec~1\n"
            "wait L2 vec L4.dma>=0\n"
            "wait L3 dma vec~2 span=3\n"
            "vmax L6 vec[0,16,1] vec[0,16,1] #0 rows=1 cols=16 wait=L6.mat~1\n"
            "dma.st L0 @y[0,16] vec[0,16,1] rows=2 cols=16 span=4 lstride=32 wait=vec\n"
            "noc.mv L2 {3} vec[0,16,1] vec[32,16,1] rows=1 cols=16 span=2 wait=dma~1\n")
    tasks = _same_tasks(asm.parse(text, "t.s"), WIDE.legions)
    assert len(tasks) == 4 + 1 + 4 + 1 + 1 + 1 + 3 + 1 + 4 + 2
    assert (tasks.cond[:, 0] != -1).sum() == len(tasks) - 4 - 1       # all but the first loads and the barrier
    assert sorted(set(tasks.cond[:, 2].tolist())) != [0]             # counted, not left relative


def test_tasks_of_a_compiled_model_read_from_words_equal_tasks_read_from_objects():
    from pathlib import Path

    from dlegion_cc.pipeline import Options, compile_model
    _, program = compile_model(Path(__file__).parent.parent / "models" / "bitnet_tiny_gqa.onnx",
                                Options(WIDE, dims={"sequence": 8}))
    p = asm.parse(asm.format_program(program), "m.s")
    tasks = _same_tasks(p, WIDE.legions)
    assert len(tasks) > len(p.instrs) and tasks.barrier.any() == any(isinstance(i, Barrier) for i in p.instrs)
    assert any(c is not None and c.count is None for c in (i.condition() for i in p.instrs))   # relative waits


PROBLEMS = (".arch dlegion-8x8\n.tensor x f32[8,16] input \"x\"\n.tensor y f32[8,16] output \"y\"\n"
            "dma.ld L0 {0} vec[0,16,1] @x[0,16] rows=2 cols=16\n"
            "dma.ld L0 {0} vec[0,16,1] @x[100,16] rows=2 cols=16\n"                 # the line above's group
            "dma.ld L0 {0} vec[0,16,1] @x[120,16] rows=2 cols=16 span=2 lstride=8\n"
            "dma.ld L0 {0} vec[0,16,1] @x[0,16] rows=2 cols=16 span=4 lstride=40\n"  # its last rank
            "dma.ld L6 {7} vec[0,16,1] @x[0,16] rows=1 cols=16 span=2 lstride=16\n"  # its last rank's dests
            "dma.st L0 @x[0,16] vec[0,16,1] rows=2 cols=16\n"
            "dma.st L1 @y[64,16] vec[0,16,1] rows=4 cols=16\n"
            "dma.st L1 @y[80,16] vec[0,16,1] rows=4 cols=16 wait=dma\n"
            "noc.mv L2 {3} vec[0,16,1] vec[32,16,1] rows=1 cols=16 span=2\n"
            "noc.mv L0 {6,7} vec[0,16,1] vec[32,16,1] rows=1 cols=16 span=3\n"
            "vadd L0 vec[0,16,1] vec[0,16,1] #1 rows=2 cols=16\n"
            "vadd L0 vec[0,0,1] vec[0,16,1] #1 rows=2 cols=16\n"
            "vadd L0 vec[0,16,1] vec[0,16,1] #1 rows=2 cols=16\n"
            "vadd L0 vec[0,0,1] vec[0,16,1] #1 rows=2 cols=16 span=2\n"
            "wait L1 mat L0.vec>=1\n"
            "wait L9 vec L0.dma>=0\n")


def test_the_checks_of_a_program_read_from_a_file_find_what_the_checks_of_its_objects_find():
    """Read from a file, the family checks run once per group of transfers equal but for their
    offset and once per distinct other instruction; every problem is still found, at its task."""
    import copy
    p = asm.parse(PROBLEMS, "t.s")
    objects = Program(p.arch, p.tensors, [copy.copy(i) for i in p.instrs], source="t.s", lines=p.lines)
    from isa.encoding import kept_words
    assert kept_words(p) is not None and kept_words(objects) is None
    found = check(p, WIDE)
    assert found == check(objects, WIDE)
    assert "t.s:5: dma.ld: src @x[100,16] over 2x16 reaches storage element 131 of tensor 'x', which has 128" in found
    assert "t.s:7: dma.ld: src @x[120,16] over 4x16 reaches storage element 199 of tensor 'x', which has 128" not in found
    assert [f for f in found if f.startswith(("t.s:6:", "t.s:7:", "t.s:8:"))] == [
        "t.s:6: dma.ld: src @x[120,16] over 2x16 reaches storage element 151 of tensor 'x', which has 128",
        "t.s:6: dma.ld: src @x[128,16] over 2x16 reaches storage element 159 of tensor 'x', which has 128",
        "t.s:7: dma.ld: src @x[120,16] over 2x16 reaches storage element 151 of tensor 'x', which has 128",
        "t.s:8: dma.ld: dests: Legion L8 does not exist (dlegion-8x8 has 8)"]
    assert sum(f.endswith(": vadd: dst vec[0,0,1] writes 2 rows with row stride 0") for f in found) == 2
    assert "t.s:19: wait: Legion L9 does not exist (dlegion-8x8 has 8)" in found and len(found) == 12
