"""Text format: parsing, printing, round trips, error messages, program files and the CLIs."""
from __future__ import annotations

import dataclasses
import re
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from isa import asm, cli, encoding
from isa.fields import Cond, DramRef, View
from isa.instructions import BY_MNEMONIC, INSTRUCTIONS, Barrier, Wait
from isa.program import Program, ProgramError, Tensor
from strategies import instructions_of, programs

HEADER = """.arch dlegion-tiny
.data "prog.s.data"
.tensor x i8[64,256] input "x"
.tensor ids i64[1,8] input "input_ids" range 0 1000
.tensor w w2[256,128] const 0
.tensor y i32[64,128] output "y"
"""

DESIGN_EXAMPLE = HEADER + """
dma.ld L0 {0-1} act[0,256,1] @x[0,256] rows=64 cols=256  ; a multicast load
mm L0 acc[0,32] act[0,256] wgt[0,8] M=64 K=256 N=32 mode=w2 split=k accumulate=set mask=none wait=L0.dma>=1
wait L1 vec L0.mat>=1
barrier
vadd L1 vec[0,64,1] vec[0,64,1] #1.5 rows=4 cols=64
"""


# Regions: before the first instruction, between two, two at one place, one after the last.
REGIONS_EXAMPLE = """.arch dlegion-tiny
.region "model/MatMul_1"
.tensor t f32[4] scratch
vexp L0 vec[0,1,1] vec[0,1,1] rows=1 cols=1
barrier
  .region "norm/Pow+norm/ReduceMean"   ; a fused kernel
.region "empty \\"quoted\\""
vexp L1 vec[0,1,1] vec[0,1,1] rows=1 cols=1
.region "tail"
"""


def lark_only(text: str, source: str = "<text>") -> Program:
    """The program as the LALR parser alone reads it (no per-line regex path)."""
    b = asm._Builder(text, source)
    asm._lark_parse(text, b)
    return b.finish()


def parse_error(text: str) -> str:
    with pytest.raises(ProgramError) as e:
        asm.parse(text, "t.s")
    return str(e.value)


# --- parsing -----------------------------------------------------------------------------------

def test_design_example_parses_to_the_expected_fields():
    p = asm.parse(DESIGN_EXAMPLE, "prog.s")
    assert p.arch == "dlegion-tiny" and p.data_file == "prog.s.data"
    assert [t.name for t in p.tensors] == ["x", "ids", "w", "y"]
    assert p.tensors[1].range == (0, 1000) and p.tensors[1].io_name == "input_ids"
    assert p.tensors[2].offset == 0 and p.tensors[2].io_name is None
    load, mm, wait, barrier, vadd = p.instrs
    assert load.dests == frozenset({0, 1}) and load.dst == View("act", 0, 256, 1)
    assert load.src == DramRef(0, 0, 256) and (load.rows, load.cols) == (64, 256)
    assert load.wait is None
    assert mm.wgt == View("wgt", 0, 8, 1) and (mm.mode, mm.split, mm.mask) == ("w2", "k", None)
    assert mm.wait == Cond(0, "dma", 1)
    assert (wait.legion, wait.queue_name, wait.until) == (1, "vec", Cond(0, "mat", 1))
    assert barrier == Barrier() and barrier.queue() == "*"
    assert vadd.b == 1.5 and vadd.legion == 1 and vadd.wait is None
    assert p.lines == [8, 9, 10, 11, 12]
    assert p.where(3) == "prog.s:11"


def test_regex_path_and_lalr_parser_agree_on_the_example():
    fast, slow = asm.parse(DESIGN_EXAMPLE), lark_only(DESIGN_EXAMPLE)
    assert fast == slow and fast.lines == slow.lines


@pytest.mark.parametrize("imm, value", [("#nan", None), ("#inf", float("inf")), ("#-inf", float("-inf")),
                                        ("#-1.5e-3", -0.001500000013038516), ("#2", 2.0), ("#.5", 0.5),
                                        ("#-0", -0.0), ("#1e-45", 1.401298464324817e-45)])
def test_immediates_are_fp32(imm, value):
    p = asm.parse(f".arch a\nvmul L0 vec[0,1,1] vec[0,1,1] {imm} rows=1 cols=1\n")
    b = p.instrs[0].b
    assert (b != b) if value is None else (b == value and str(b) == str(value))


def test_immediates_near_the_fp32_limit_print():
    # the shortest-form search tries '3.403e+38', which rounds past the largest fp32
    top = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]      # the largest finite fp32
    p = asm.parse(".arch a\nvmul L0 vec[0,1,1] vec[0,1,1] #3.4028235e38 rows=1 cols=1\n")
    assert p.instrs[0].b == top
    assert asm.parse(asm.format_program(p)) == p


def test_legion_sets_and_optional_operands():
    p = asm.parse(".arch a\n.tensor m u8[2,2] scratch\n"
                  "dma.ld L1 {5,0-2,7-7} vec[1,2,3] @m[4,5] rows=1 cols=1\n"
                  "drain L0 act[0,1,1] acc[2,3] M=1 N=1 zp=acc[7] rscale=none cscale=vec[9] bias=none accumulate=add\n"
                  "mm L0 acc[0,1] act[0,1] wgt[0,1] M=1 K=1 N=1 mode=w4 split=n accumulate=add mask=@m\n")
    load, drain, mm = p.instrs
    assert load.dests == frozenset({0, 1, 2, 5, 7})
    assert (drain.zp, drain.rscale, drain.cscale, drain.bias) == (7, None, 9, None)
    assert drain.acc == View("acc", 2, 3, 1) and mm.mask == 0


def test_spacing_comments_and_line_endings_do_not_matter():
    canonical = asm.parse(DESIGN_EXAMPLE)
    messy = DESIGN_EXAMPLE.replace(" ", "  ").replace("\n", " ; note\r\n").replace("[0,", "[ 0 ,")
    messy = messy.replace('.data  "prog.s.data" ; note', '.data "prog.s.data"')
    p = asm.parse("\n\n" + messy.replace("vadd", "\tvadd"))
    assert p == canonical
    assert p.lines == [n + 2 for n in canonical.lines]


def test_program_lines_skip_blank_and_comment_lines():
    p = asm.parse(".arch a\n; c\n\nbarrier\n   ; c\nwait L0 vec L1.dma>=2\n")
    assert p.lines == [4, 6]


def test_arch_file_and_names_that_look_like_operands():
    p = asm.parse('.arch "../my arch.toml"\n.tensor none f32[1] scratch\n.tensor L0 f32[1] scratch\n'
                  "mm L0 acc[0,1] act[0,1] wgt[0,1] M=1 K=1 N=1 mode=w8 split=k accumulate=set mask=@none\n"
                  "dma.st L0 @L0[0,1] vec[0,1,1] rows=1 cols=1\n")
    assert p.arch == "../my arch.toml"
    assert p.instrs[0].mask == 0 and p.instrs[1].dst.tensor == 1


def test_design_document_example_parses():
    doc = (Path(__file__).parent.parent / "docs" / "DESIGN.md").read_text()
    block = doc.split("## Text format", 1)[1].split("```")[1]
    p = asm.parse(block)
    assert [i.MNEMONIC for i in p.instrs] == [i.MNEMONIC for i in asm.parse(DESIGN_EXAMPLE).instrs]
    assert p.instrs == asm.parse(DESIGN_EXAMPLE).instrs


@pytest.mark.parametrize("parse", [asm.parse, lark_only])
def test_optional_wait_absent_or_present(parse):
    line = "vexp L0 vec[0,1,1] vec[0,1,1] rows=1 cols=1"
    p = parse(f".arch a\n{line}\n{line} wait=L1.mat>=7 ; note\n{line}\twait=L0.dma>=0\n")
    assert [i.wait for i in p.instrs] == [None, Cond(1, "mat", 7), Cond(0, "dma", 0)]
    assert asm.format_program(p).splitlines()[1:] == [line, f"{line} wait=L1.mat>=7",
                                                      f"{line} wait=L0.dma>=0"]


@pytest.mark.parametrize("parse", [asm.parse, lark_only])
def test_regions_name_the_instructions_after_them(parse):
    p = parse(REGIONS_EXAMPLE)
    assert p.regions == [(0, "model/MatMul_1"), (2, "norm/Pow+norm/ReduceMean"), (2, 'empty "quoted"'),
                         (3, "tail")]
    assert [i.MNEMONIC for i in p.instrs] == ["vexp", "barrier", "vexp"] and p.lines == [4, 5, 8]


def test_regions_print_before_their_first_instruction():
    text = asm.format_program(asm.parse(REGIONS_EXAMPLE))
    assert text.splitlines()[2:] == [
        '.region "model/MatMul_1"', "vexp L0 vec[0,1,1] vec[0,1,1] rows=1 cols=1", "barrier",
        '.region "norm/Pow+norm/ReduceMean"', '.region "empty \\"quoted\\""',
        "vexp L1 vec[0,1,1] vec[0,1,1] rows=1 cols=1", '.region "tail"']
    assert asm.parse(text) == asm.parse(REGIONS_EXAMPLE)


def test_printing_regions_out_of_order_fails():
    p = Program(arch="a", instrs=[Barrier()], regions=[(0, "a"), (2, "b")])
    with pytest.raises(ProgramError, match=r"region 1 \('b'\): starts at instruction 2, expected 0..1"):
        asm.format_program(p)


# --- round trips ---------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(programs())
def test_text_round_trip(p):
    text = asm.format_program(p)
    q = asm.parse(text)
    assert q == p
    assert asm.format_program(q) == text


@settings(max_examples=60, deadline=None)
@given(programs(max_instrs=6))
def test_regex_path_agrees_with_the_lalr_parser(p):
    text = asm.format_program(p)
    assert lark_only(text) == asm.parse(text)


@settings(max_examples=150, deadline=None)
@given(programs())
def test_words_packed_while_parsing_are_the_encoders(p):
    """The fast path packs each instruction's word as it reads it, and the binary keeps those
    words: they must be the encoder's, field by field."""
    parsed = asm.parse(asm.format_program(p))
    fresh = dataclasses.replace(parsed)            # the same program, without the kept words
    assert encoding.encode_program(parsed) == encoding.encode_program(fresh)


def outcome(parse, text):
    try:
        return parse(text)
    except ProgramError:
        return "error"


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(INSTRUCTIONS).flatmap(lambda c: instructions_of(c, 1)), st.data())
def test_regex_path_never_accepts_what_the_lalr_parser_rejects(i, data):
    # Mutate one instruction line a character at a time; both parsers must agree on the result.
    head = ".arch a\n.tensor t f32[4] scratch\n"
    line = asm.format_instr(i, ["t"])
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(line)))
        junk = data.draw(st.sampled_from(["", "-", ",", "0", "9", " ", "#", "e", "[", "]", "{", "}",
                                          "none", "@t", "x", ";", "=", "L", "s", ".", ">", ">=",
                                          " wait=L0.dma>=1", "dma", "L1.", "barrier"]))
        cut = data.draw(st.integers(0, 2))
        line = line[:at] + junk + line[at + cut:]
    assert outcome(asm.parse, head + line) == outcome(lark_only, head + line)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=6), st.data())
def test_regex_path_and_lalr_parser_agree_on_region_lines(name, data):
    line = '.region "' + name.replace("\\", "").replace('"', "").replace("\n", "") + '"'
    for _ in range(data.draw(st.integers(0, 3))):
        at = data.draw(st.integers(0, len(line)))
        junk = data.draw(st.sampled_from(["", '"', "\\", "\\q", "\\n", " ", "\t", ";", "x", "\r", "."]))
        line = line[:at] + junk + line[at + data.draw(st.integers(0, 2)):]
    text = ".arch a\nbarrier\n" + line + "\nbarrier\n"
    assert outcome(asm.parse, text) == outcome(lark_only, text)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(INSTRUCTIONS).flatmap(lambda c: instructions_of(c, 1)), st.sampled_from([" ", "\t", "  "]))
def test_every_instruction_class_survives_other_spacing(i, sep):
    p = Program(arch="a", tensors=[Tensor("t", "f32", (4,), "scratch")], instrs=[i])
    text = asm.format_program(p).replace(" ", sep).replace(f".arch{sep}a", ".arch a")
    assert asm.parse(text.replace(f".tensor{sep}t{sep}f32[4]{sep}scratch", ".tensor t f32[4] scratch")) == p


# --- errors --------------------------------------------------------------------------------------

def first_line(msg: str) -> str:
    return msg.split("\n")[0]


def test_syntax_error_names_line_column_and_expected_field():
    msg = parse_error(".arch a\n\nvadd L0 vec[0,1,1] vec[0,1,1] #1 rows=4\n")
    assert first_line(msg) == "t.s:3:40: unexpected end of line; expected 'cols='"
    assert "usage: vadd <legion> <dst> <a> <b> rows=<rows> cols=<cols>" in msg
    caret_line = msg.split("\n")[2]
    assert caret_line.index("^") - 2 == 39


def test_wrong_token_inside_an_operand():
    msg = parse_error(".arch a\nvadd L0 vec[0,1,1] vec[0,x,1] #1 rows=4 cols=1\n")
    assert first_line(msg) == "t.s:2:26: unexpected 'x,1]'; expected an integer"


def test_keyword_error_lists_the_choices():
    msg = parse_error(".arch a\nmm L0 acc[0,1] act[0,1] wgt[0,1] M=1 K=1 N=1 mode=w3 split=k "
                      "accumulate=set mask=none\n")
    assert first_line(msg) == "t.s:2:51: unexpected 'w3'; expected one of w8, w4, w2"


def test_unknown_mnemonic_suggests_close_ones():
    msg = parse_error(".arch a\nbarrier\n  vsell L0 vec[0,1,1]\n")
    assert first_line(msg).startswith("t.s:3:3: unknown mnemonic 'vsell'; did you mean vsel, ")


def test_unknown_directive():
    assert first_line(parse_error(".arch a\n.tensr x f32[1] input\n")).startswith(
        "t.s:2:1: unknown directive '.tensr'; did you mean .tensor")
    assert first_line(parse_error(".arch a\nbarrier\n.regoin \"x\"\n")).startswith(
        "t.s:3:1: unknown directive '.regoin'; did you mean .region")


@pytest.mark.parametrize("text, expected", [
    (".arch a\n.tensor x f16[4] input\n", "t.s:2:9: tensor 'x': unknown dtype 'f16'"),
    (".arch a\n.tensor x f32[4] buffer\n", "t.s:2:9: tensor 'x': unknown kind 'buffer'"),
    (".arch a\n.tensor x f32[4,0] output\n", "t.s:2:9: tensor 'x': bad shape [4, 0]"),
    (".arch a\n.tensor x f32[4] const\n", "t.s:2:9: tensor 'x': a const tensor needs a data-file offset"),
    (".arch a\n.tensor x f32[4] input 3\n", "t.s:2:9: tensor 'x': a const tensor needs a data-file offset"),
    (".arch a\n.tensor x f32[4] output range 0 1\n", "t.s:2:9: tensor 'x': range (0, 1) needs an input"),
    (".arch a\n.tensor x f32[4] input range 5 5\n", "t.s:2:9: tensor 'x': range (5, 5) needs an input"),
    (".arch a\n.tensor x f32[4] input\n.tensor x f32[4] input\n", "t.s:3:9: tensor 'x' declared twice"),
    (".arch a\nbarrier\n.tensor x f32[4] input\n",
     "t.s:3:9: .tensor after the first instruction (directives come first)"),
    (".arch a\nbarrier\n.arch b\n", "t.s:3:7: .arch after the first instruction"),
    (".arch a\n.skipped x 1\n.skipped x 2\n", "t.s:3:10: a second .skipped x"),
    (".arch a\nbarrier\n.skipped x 1\n", "t.s:3:10: .skipped after the first instruction"),
    (".arch a\n.skipped x -1\n", "t.s:2:12: unexpected '-1'; expected an integer"),
    (".arch a\n.arch b\n", "t.s:2:7: a second .arch directive"),
    (".tensor x f32[4] input\n", "t.s: missing .arch directive"),
    (".arch a\n.data \"a\\q\"\n", "t.s:2:7: bad escape in string"),
    (".arch a\nbarrier\n.region \"a\\q\"\n", "t.s:3:9: bad escape in string"),
    (".arch a\nbarrier\n.region a\n", "t.s:3:9: unexpected 'a'; expected a quoted string"),
    (".arch a\nbarrier\n.region\n", "t.s:3:8: unexpected end of line; expected a quoted string"),
    (".arch a\n.region \"a\" \"b\"\n", "t.s:2:13: unexpected '\"b\"'; expected end of line"),
    (".arch a\ndma.st L0 @q[0,1] vec[0,1,1] rows=1 cols=1\n", "t.s:2:12: unknown tensor 'q' (declared: none)"),
    (".arch a\nvadd L0 vec[0,1,1] vec[0,1,1] #1e39 rows=1 cols=1\n",
     "t.s:2:31: immediate #1e39 is outside the fp32 range"),
    (".arch a\nvadd L0 vec[0,1,1] vec[0,1,1] #1 rows=70000 cols=1\n",
     "t.s:2:1: vadd: rows: 70000 does not fit in 16 bits"),
    (".arch a\nvmm L0 act[0,1,1] vec[0,1,1] vec[0,1,1] M=1 K=1 N=1\n",
     "t.s:2:1: vmm: dst: space 'act' not allowed here (allowed: vec)"),
    (".arch a\n.tensor x f32[1] scratch\ndma.ld L0 {} vec[0,1,1] @x[0,1] rows=1 cols=1\n",
     "t.s:3:1: dma.ld: dests: Legion set must be"),
    (".arch a\ndma.ld L0 {3-1} vec[0,1,1] @x[0,1] rows=1 cols=1\n", "t.s:2:12: bad Legion range 3-1"),
    (".arch a\ndma.ld L0 {64} vec[0,1,1] @x[0,1] rows=1 cols=1\n", "t.s:2:12: bad Legion range 64-64"),
    (".arch a\nwait L256 vec L0.dma>=1\n", "t.s:2:1: wait: legion: Legion index 256 out of range"),
    (".arch a\nwait L0 vec L256.dma>=1\n", "t.s:2:1: wait: until: condition L256.dma>=1 out of range"),
    (".arch a\nvadd L0 vec[0,1,1] vec[0,1,1] #1 rows=1 cols=1 wait=L0.dma>=16777216\n",
     "t.s:2:1: vadd: wait: condition L0.dma>=16777216 out of range"),
    (".arch a\nwait L0 vec L0.gpu>=1\n",
     "t.s:2:13: unexpected 'L0.gpu>=1'; expected a condition (L0.dma>=5)"),
    (".arch a\nwait L0 vec L0.dma>1\n", "t.s:2:13: unexpected 'L0.dma>1'; expected a condition"),
    (".arch a\nvadd L0 vec[0,1,1] vec[0,1,1] #1 rows=1 cols=1 wait=\n",
     "t.s:2:53: unexpected end of line; expected a condition (L0.dma>=5)"),
    (".arch a\nvadd L0 vec[0,1,1] vec[0,1,1] #1 rows=1 cols=1 wait=L0.dma>=1 wait=L0.dma>=1\n",
     "t.s:2:63: unexpected 'wait=L0.dma>=1'; expected end of line"),
    (".arch a\nwait L0 vec L0.dma>=1 wait=L0.dma>=1\n", "t.s:2:23: unexpected 'wait=L0.dma>=1'"),
    (".arch a\nbarrier L0\n", "t.s:2:9: unexpected 'L0'; expected end of line"),
])
def test_semantic_errors_name_file_line_and_column(text, expected):
    assert first_line(parse_error(text)).startswith(expected)


def test_an_error_far_into_a_long_program_has_the_right_line():
    body = "barrier\nwait L0 vec L1.dma>=1\n" * 1500
    msg = parse_error(".arch a\n" + body + "wait L0 vecc L1.dma>=1\n")
    assert first_line(msg).startswith("t.s:3002:9:")


# --- printing ------------------------------------------------------------------------------------

def test_printing_is_canonical():
    text = asm.format_program(asm.parse(DESIGN_EXAMPLE))
    assert text.splitlines()[6:] == [
        "dma.ld L0 {0-1} act[0,256,1] @x[0,256] rows=64 cols=256",
        "mm L0 acc[0,32] act[0,256] wgt[0,8] M=64 K=256 N=32 mode=w2 split=k accumulate=set mask=none "
        "wait=L0.dma>=1",
        "wait L1 vec L0.mat>=1",
        "barrier",
        "vadd L1 vec[0,64,1] vec[0,64,1] #1.5 rows=4 cols=64",
    ]
    assert text.splitlines()[:6] == HEADER.splitlines()


def test_printing_a_reference_to_an_undeclared_tensor_fails():
    p = Program(arch="a", instrs=[BY_MNEMONIC["dma.st"](0, DramRef(3, 0, 1), View("vec", 0, 1, 1), 1, 1)])
    with pytest.raises(ProgramError, match=r"instruction 0: dma.st: dst: tensor index 3 but only 0"):
        asm.format_program(p)


# --- files ---------------------------------------------------------------------------------------

def test_load_reads_the_data_file_next_to_the_program(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "prog.s").write_text(DESIGN_EXAMPLE)
    (tmp_path / "sub" / "prog.s.data").write_bytes(b"\x01\x02")
    path = str(tmp_path / "sub" / "prog.s")
    p = asm.load(path)
    assert p.data == b"\x01\x02" and p.source == path
    assert p.where(0) == f"{path}:8"


def test_load_names_a_missing_data_file(tmp_path):
    (tmp_path / "prog.s").write_text(DESIGN_EXAMPLE)
    with pytest.raises(ProgramError, match=r"prog.s: cannot read data file 'prog.s.data'"):
        asm.load(tmp_path / "prog.s")
    assert asm.load(tmp_path / "prog.s", read_data=False).data is None


def test_save_and_load_text_and_binary(tmp_path):
    p = asm.parse(DESIGN_EXAMPLE)
    for name, binary in (("p.s", False), ("p.bin", True)):
        asm.save(p, tmp_path / name, data=b"abc", binary=binary)
        q = asm.load(tmp_path / name)
        assert q == p and q.data == b"abc"
    assert (tmp_path / "p.bin").read_bytes().startswith(b"DLGN")
    assert (tmp_path / "p.s").read_text() == asm.format_program(p)


def test_save_writes_nothing_when_the_program_is_invalid(tmp_path):
    p = asm.parse(DESIGN_EXAMPLE)
    (tmp_path / "p.s").write_text("old")
    p.instrs.append(Wait(999, "vec", Cond(0, "dma", 1)))
    for binary in (False, True):
        with pytest.raises(ProgramError, match="legion"):
            asm.save(p, tmp_path / "p.s", data=b"new", binary=binary)
    assert (tmp_path / "p.s").read_text() == "old"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["p.s"]


def test_save_writes_neither_file_when_one_cannot_be_written(tmp_path):
    # the data file's folder would be a regular file: the program file, written first, goes too
    p = asm.parse(DESIGN_EXAMPLE)
    (tmp_path / "blocker").write_text("")
    p.data_file = "blocker/prog.s.data"
    with pytest.raises(ProgramError, match=r"blocker: cannot write \(not a directory\)"):
        asm.save(p, tmp_path / "p.s", data=b"new")
    assert [f.name for f in tmp_path.iterdir()] == ["blocker"]


def test_save_needs_a_data_file_name_for_data(tmp_path):
    p = asm.parse(".arch a\n")
    with pytest.raises(ProgramError, match="names no .data file"):
        asm.save(p, tmp_path / "p.s", data=b"x")


def test_load_rejects_undecodable_text(tmp_path):
    (tmp_path / "p.s").write_bytes(b"\xff\xfe")
    with pytest.raises(ProgramError, match="neither UTF-8 program text nor a D-Legion binary"):
        asm.load(tmp_path / "p.s")


# --- command-line tools --------------------------------------------------------------------------

def run(main, *args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def program(tmp_path):
    (tmp_path / "prog.s").write_text(DESIGN_EXAMPLE)
    (tmp_path / "prog.s.data").write_bytes(b"\x00" * 8)
    return tmp_path / "prog.s"


def test_assemble_and_disassemble_round_trip(program, tmp_path):
    result = run(cli.assemble_main, program, "-o", tmp_path / "prog.bin")
    assert result.exit_code == 0, result.output
    binary = (tmp_path / "prog.bin").read_bytes()
    assert encoding.decode_program(binary) == asm.parse(DESIGN_EXAMPLE)
    result = run(cli.disassemble_main, tmp_path / "prog.bin")
    assert result.exit_code == 0 and result.stdout == asm.format_program(asm.parse(DESIGN_EXAMPLE))
    assert run(cli.disassemble_main, tmp_path / "prog.bin", "-o", tmp_path / "again.s").exit_code == 0
    assert run(cli.assemble_main, tmp_path / "again.s").exit_code == 0
    assert (tmp_path / "again.bin").read_bytes() == binary


def test_regions_survive_assembly_and_disassembly(tmp_path):
    (tmp_path / "r.s").write_text(REGIONS_EXAMPLE)
    assert run(cli.assemble_main, tmp_path / "r.s").exit_code == 0
    assert asm.load(tmp_path / "r.bin").regions == asm.parse(REGIONS_EXAMPLE).regions
    result = run(cli.disassemble_main, tmp_path / "r.bin")
    assert result.exit_code == 0 and result.stdout == asm.format_program(asm.parse(REGIONS_EXAMPLE))


def test_output_in_another_folder_still_names_the_arch_file_but_not_a_data_file_out_of_reach(program, tmp_path):
    program.write_text(DESIGN_EXAMPLE.replace(".arch dlegion-tiny", '.arch "machines/m.toml"'))
    (tmp_path / "machines").mkdir()          # dlegion-as checks that the .arch resolves
    (tmp_path / "machines" / "m.toml").write_text(
        cli.arch_mod.resources.files("isa.presets").joinpath("dlegion-tiny.toml").read_text())
    (tmp_path / "out" / "deep").mkdir(parents=True)
    # A program's data file lies in its folder: one elsewhere cannot be named from out/deep.
    refused = run(cli.assemble_main, program, "-o", tmp_path / "out" / "deep" / "p.bin")
    assert refused.exit_code == 2 and "must name a file" in refused.stderr
    assert not (tmp_path / "out" / "deep" / "p.bin").exists()
    dataless = "\n".join(l for l in program.read_text().splitlines()
                         if not l.startswith(".data") and " const" not in l)
    program.write_text(dataless)
    assert run(cli.assemble_main, program, "-o", tmp_path / "out" / "deep" / "p.bin").exit_code == 0
    p = asm.load(tmp_path / "out" / "deep" / "p.bin")
    assert p.data_file is None and p.arch == "../../machines/m.toml"


def test_assembler_errors_exit_2_with_the_location_first(tmp_path):
    (tmp_path / "bad.s").write_text(".arch a\nbarrier\nvadd L0 vec[0,1,1]\n")
    result = CliRunner().invoke(cli.assemble_main, [str(tmp_path / "bad.s"), "-o", str(tmp_path / "bad.bin")])
    assert result.exit_code == 2
    assert re.match(r".*bad\.s:3:19: unexpected end of line", result.stderr.split("\n")[0])
    assert "Traceback" not in result.output
    assert not (tmp_path / "bad.bin").exists()


def test_missing_input_and_corrupt_binary_exit_2(tmp_path):
    result = run(cli.disassemble_main, tmp_path / "nope.bin")
    assert result.exit_code == 2 and "nope.bin: cannot read" in result.stderr
    (tmp_path / "bad.bin").write_bytes(b"DLGN" + struct.pack("<HHI", encoding.VERSION, 0, 255) + b"{")
    result = run(cli.disassemble_main, tmp_path / "bad.bin")
    assert result.exit_code == 2 and "truncated header" in result.stderr


def test_arch_tool(tmp_path):
    listing = run(cli.arch_main)
    assert listing.exit_code == 0 and re.search(r"^dlegion-tiny +tiny D-Legion", listing.stdout, re.M)
    shown = run(cli.arch_main, "dlegion-8x8")
    assert shown.exit_code == 0 and "8 Legions x 8 cores x 16x16 PEs" in shown.stdout
    derived = run(cli.arch_main, "dlegion-tiny", "--json")
    assert '"macs_per_cycle"' in derived.stdout and '"w2": 1024' in derived.stdout
    unknown = run(cli.arch_main, "nope")
    assert unknown.exit_code == 2 and "unknown architecture 'nope'" in unknown.stderr
    (tmp_path / "m.toml").write_text("name = 1\n")
    assert run(cli.arch_main, tmp_path / "m.toml").exit_code == 2


@pytest.mark.parametrize("main", [cli.assemble_main, cli.disassemble_main, cli.arch_main])
def test_help(main):
    result = run(main, "--help")
    assert result.exit_code == 0 and "Exit status" in result.stdout


def test_scalar_tensors_round_trip():
    p = asm.parse('.arch a\n.tensor s f32[] output "scale"\n', "t.s")
    assert p.tensors[0].shape == () and p.tensors[0].numel == 1
    assert asm.parse(asm.format_program(p), "t.s") == p
