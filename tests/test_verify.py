"""Static verifier: one case per rejection, a valid multi-Legion program, arch-dependent rules."""
from __future__ import annotations

import dataclasses

import pytest

from isa import arch as archs
from isa.fields import Cond, DramRef, View
from isa.instructions import (BY_MNEMONIC, Barrier, DmaLoad, DmaStore, Drain, Gather, MatMul,
                              VSelect, Wait)
from isa.program import Program, ProgramError, Tensor
from isa.verify import MAX_SHOWN, check, verify

TINY = archs.load("dlegion-tiny")
CAP = TINY.derived.spad_elems
VADD, VRSUM = BY_MNEMONIC["vadd"], BY_MNEMONIC["vrsum"]
FIRST_LINE = 10     # instruction i sits on line FIRST_LINE + i of "t.s"


def tensors() -> list[Tensor]:
    return [
        Tensor("x", "i8", (16, 64), "input", io_name="x"),          # 0
        Tensor("w", "w2", (64, 32), "const", offset=0),             # 1: 512 bytes
        Tensor("m", "u8", (8, 4), "const", offset=512),             # 2: mask, K=64 N=32 array 8
        Tensor("y", "f32", (16, 32), "output", io_name="y"),        # 3
        Tensor("e", "f32", (100, 32), "const", offset=544),         # 4: gather table
        Tensor("s", "f32", (16, 32), "scratch"),                    # 5
    ]


def instrs() -> list:
    """Each queue's instructions are counted on the right; a barrier counts in every queue."""
    mm = dict(acc=View("acc", 0, 32), act=View("act", 0, 64), wgt=View("wgt", 0, 8), M=16, K=64,
              N=32, mode="w2", split="k", accumulate="set")
    return [
        DmaLoad(0, frozenset({0, 1}), View("act", 0, 64, 1), DramRef(0, 0, 64), rows=16, cols=64),
        DmaLoad(0, frozenset({0, 1}), View("wgt", 0, 8, 1), DramRef(1, 0, 8), rows=64, cols=8),
        Wait(1, "mat", Cond(0, "dma", 2)),                                          # L1.mat 1
        MatMul(0, **mm, mask=2, wait=Cond(0, "dma", 2)),                            # L0.mat 1
        MatMul(1, **mm, mask=None),                                                 # L1.mat 2
        Drain(0, View("vec", 0, 32, 1), View("acc", 0, 32), M=16, N=32, zp=None, rscale=1024,
              cscale=None, bias=None, accumulate="set", wait=Cond(0, "mat", 1)),    # 5
        VADD(0, View("vec", 0, 32, 1), View("vec", 0, 32, 1), 1.5, rows=16, cols=32),
        VRSUM(0, View("vec", 600, 1, 1), View("vec", 0, 32, 1), rows=16, cols=32),  # L0.vec 3
        DmaStore(0, DramRef(3, 0, 32), View("vec", 0, 32, 1), rows=16, cols=32,
                 wait=Cond(0, "vec", 3)),                                           # L0.dma 3
        Barrier(),                                                                  # all +1
        Gather(1, View("vec", 2000, 32, 1), DramRef(4, 0, 32), View("vec", 1500, 1, 1),   # 10
               rows=4, cols=32),                                                    # L1.dma 2
        VSelect(1, View("vec", 2000, 32, 1), View("vec", 2000, 32, 1), 0.0, rows=4, cols=32,
                wait=Cond(1, "dma", 2)),
    ]


def program() -> Program:
    ins = instrs()
    return Program("dlegion-tiny", tensors(), ins, data_file="t.s.data",
                   lines=[FIRST_LINE + i for i in range(len(ins))], source="t.s",
                   data=bytes(544 + 100 * 32 * 4))


def problems_of(p: Program, arch) -> list[str]:
    with pytest.raises(ProgramError) as e:
        verify(p, arch)
    return str(e.value).splitlines()


def assert_rejected(p: Program, arch, i: int, reason: str) -> None:
    """Every reported line names instruction i, and one of them gives ``reason``."""
    head = f"t.s:{FIRST_LINE + i}: {p.instrs[i].MNEMONIC}: "
    lines = problems_of(p, arch)
    assert all(line.startswith(head) for line in lines), lines
    assert any(reason in line for line in lines), lines


# --- the valid program and the machine it needs ------------------------------------------------

def test_valid_multi_legion_program_passes_on_tiny():
    assert check(program(), TINY) == []
    verify(program(), TINY)


def test_multicast_rejected_without_multicast():
    lines = problems_of(program(), dataclasses.replace(TINY, multicast=False))
    reason = "dests multicast to 2 Legions, but dlegion-tiny has no multicast"
    assert lines == [f"t.s:{FIRST_LINE + i}: dma.ld: {reason}" for i in (0, 1)]


def test_legions_beyond_the_machine_rejected():
    lines = problems_of(program(), dataclasses.replace(TINY, legions=1))
    assert "t.s:10: dma.ld: dests: Legion L1 does not exist (dlegion-tiny has 1)" in lines
    assert "t.s:12: wait: Legion L1 does not exist (dlegion-tiny has 1)" in lines
    assert "t.s:14: mm: Legion L1 does not exist (dlegion-tiny has 1)" in lines
    assert "t.s:21: vsel: condition L1.dma>=2 names Legion L1 (dlegion-tiny has 1)" in lines


def test_w2_matmul_rejected_on_ws64():
    ws = archs.load("ws-64")
    p = Program("ws-64", [], [MatMul(0, View("acc", 0, 64), View("act", 0, 64), View("wgt", 0, 16),
                                     M=64, K=64, N=64, mode="w2", split="n", accumulate="set",
                                     mask=None)], source="t.s", lines=[FIRST_LINE])
    assert problems_of(p, ws) == ["t.s:10: mm: mode w2 is not supported by ws-64 (modes: w8)"]
    w8 = dataclasses.replace(p.instrs[0], mode="w8", wgt=View("wgt", 0, 64))
    assert check(dataclasses.replace(p, instrs=[w8]), ws) == []


def test_split_k_needs_parallel_accumulators_on_many_cores():
    no_pa = dataclasses.replace(TINY, parallel_accumulators=False)
    lines = problems_of(program(), no_pa)
    assert [ln.split(": ")[0] for ln in lines] == ["t.s:13", "t.s:14"]
    assert all("split=k" in ln and "parallel accumulators" in ln for ln in lines)
    one_core = dataclasses.replace(no_pa, cores=1)
    assert check(program(), one_core) == []


# --- one case per instruction rejection -------------------------------------------------------

def act_end(addr: int) -> int:
    return addr + 15 * 64 + 63


REJECTIONS = {
    "unencodable-field": (0, dict(rows=1 << 16), "rows: 65536 does not fit in 16 bits"),
    "legion": (6, dict(legion=2), "Legion L2 does not exist (dlegion-tiny has 2)"),
    "dests-legion": (0, dict(dests=frozenset({0, 3})), "dests: Legion L3 does not exist"),
    "dma-dst-bounds": (0, dict(dst=View("act", CAP["act"] - 100, 64, 1)),
                       f"reaches act element {act_end(CAP['act'] - 100)}, past the {CAP['act']}"),
    "dest-row-stride-0": (0, dict(dst=View("act", 0, 0, 1)), "writes 16 rows with row stride 0"),
    "dest-col-stride-0": (6, dict(dst=View("vec", 0, 32, 0)),
                          "writes 32 columns with column stride 0"),
    "space-not-allowed": (10, dict(dst=View("acc", 0, 32, 1)), "space 'acc' not allowed here"),
    "dram-tensor-index": (0, dict(src=DramRef(9, 0, 64)),
                          "src names tensor 9, but only 6 are declared"),
    "dram-extent": (0, dict(src=DramRef(0, 1, 64)),
                    "reaches storage element 1024 of tensor 'x', which has 1024"),
    "load-dtype": (0, dict(src=DramRef(5, 0, 32), cols=32),
                   "src tensor 's' is f32, which cannot be loaded into act"),
    "store-dtype": (8, dict(src=View("acc", 0, 32, 1)),
                    "dst tensor 'y' is f32, which cannot be stored from acc"),
    "store-src-bounds": (8, dict(src=View("vec", CAP["vec"] - 1, 32, 1)),
                         f"reaches vec element {CAP['vec'] - 1 + 15 * 32 + 31}"),
    "store-into-const": (8, dict(dst=DramRef(4, 0, 32)), "dst tensor 'e' is const"),
    "store-into-input": (8, dict(dst=DramRef(0, 0, 64)), "dst tensor 'x' is input"),
    "gather-dtype": (10, dict(dst=View("act", 0, 32, 1)),
                     "table tensor 'e' is f32, which cannot be loaded into act"),
    "gather-table-index": (10, dict(table=DramRef(6, 0, 32)), "table names tensor 6"),
    "gather-ids-rows-x-1": (10, dict(ids=View("vec", CAP["vec"] - 3, 1, 1)),
                            f"reaches vec element {CAP['vec']}, past the {CAP['vec']}"),
    "gather-dst-row-stride-0": (10, dict(dst=View("vec", 0, 0, 1)), "writes 4 rows"),
    "mm-empty": (3, dict(K=0), "empty matrix multiplication (K=0)"),
    "mm-row-not-whole-bytes": (3, dict(N=30), "N=30 weights of mode w2 are 60 bits a row"),
    "mm-act-bounds": (3, dict(act=View("act", CAP["act"] - 64, 64)),
                      f"reaches act element {act_end(CAP['act'] - 64)}"),
    "mm-acc-bounds": (3, dict(acc=View("acc", CAP["acc"] - 32, 32)),
                      f"reaches acc element {CAP['acc'] - 32 + 15 * 32 + 31}"),
    "mm-acc-row-stride-0": (3, dict(acc=View("acc", 0, 0)), "writes 16 rows with row stride 0"),
    "mm-wgt-bounds": (3, dict(wgt=View("wgt", CAP["wgt"] - 8, 8)),
                      f"wgt wgt[{CAP['wgt'] - 8},8,1] over 64x8 reaches wgt element "
                      f"{CAP['wgt'] - 8 + 63 * 8 + 7}"),
    # 8-byte rows at this address fit; the 32-byte rows of w8 weights do not
    "mm-wgt-bytes-by-mode": (3, dict(mode="w8", wgt=View("wgt", CAP["wgt"] - 520, 8)),
                             f"over 64x32 reaches wgt element {CAP['wgt'] + 15}"),
    "mm-mask-index": (3, dict(mask=9), "mask names tensor 9"),
    "mm-mask-not-const": (3, dict(mask=5), "mask tensor 's' is scratch, not const"),
    "mm-mask-not-u8": (3, dict(mask=4), "mask tensor 'e' is f32, not u8"),
    "mm-mask-too-small": (3, dict(N=40), "mask tensor 'm' has 32 elements, fewer than the 40"),
    "drain-dst-bounds": (5, dict(dst=View("vec", CAP["vec"] - 32, 32, 1)), "dst vec["),
    "drain-dst-row-stride-0": (5, dict(dst=View("vec", 0, 0, 1)), "writes 16 rows"),
    "drain-acc-bounds": (5, dict(acc=View("acc", CAP["acc"] - 31, 32)), "acc acc["),
    "drain-zp": (5, dict(zp=CAP["acc"] - 2),
                 f"zp acc[{CAP['acc'] - 2}] of 32 elements reaches acc element {CAP['acc'] + 29}"),
    "drain-rscale": (5, dict(rscale=CAP["vec"] - 4),
                     f"rscale vec[{CAP['vec'] - 4}] of 16 elements reaches vec element "
                     f"{CAP['vec'] + 11}"),
    "drain-cscale": (5, dict(cscale=CAP["vec"] - 31), f"cscale vec[{CAP['vec'] - 31}] of 32"),
    "drain-bias": (5, dict(bias=CAP["vec"] - 31), f"bias vec[{CAP['vec'] - 31}] of 32"),
    "vbinary-a-bounds": (6, dict(a=View("vec", CAP["vec"] - 31, 32, 1)), "a vec["),
    "vbinary-b-bounds": (6, dict(b=View("vec", CAP["vec"] - 31, 32, 1)), "b vec["),
    "vbinary-bad-immediate": (6, dict(b=0.1), "immediate 0.1 is not an fp32 value"),
    "vreduce-dst-rows-x-1": (7, dict(dst=View("vec", CAP["vec"] - 15, 1, 0)),
                             f"over 16x1 reaches vec element {CAP['vec']}, past"),
    "vreduce-dst-row-stride-0": (7, dict(dst=View("vec", 600, 0, 1)), "writes 16 rows"),
    "vselect-cond-bounds": (11, dict(cond=View("vec", CAP["vec"] - 31, 32, 1)), "cond vec["),
    "wait-legion": (2, dict(legion=5), "Legion L5 does not exist"),
    # L0.dma runs two loads, a store and the barrier
    "wait-unsatisfiable": (2, dict(until=Cond(0, "dma", 5)),
                           "condition L0.dma>=5 can never be satisfied: L0.dma runs 4 instructions"),
    "wait-condition-legion": (2, dict(until=Cond(5, "dma", 1)),
                              "condition L5.dma>=1 names Legion L5 (dlegion-tiny has 2)"),
    "wait-unencodable-condition": (2, dict(until=Cond(0, "gpu", 1)),
                                   "until: expected a condition like L0.dma>=5"),
    "wait-field-unsatisfiable": (3, dict(wait=Cond(0, "dma", 5)),
                                 "condition L0.dma>=5 can never be satisfied: L0.dma runs 4"),
    # L1.dma runs the barrier and the gather
    "wait-field-counts-barriers": (11, dict(wait=Cond(1, "dma", 3)),
                                   "condition L1.dma>=3 can never be satisfied: L1.dma runs 2"),
    "wait-field-legion": (11, dict(wait=Cond(2, "vec", 1)),
                          "condition L2.vec>=1 names Legion L2 (dlegion-tiny has 2)"),
    "wait-field-unencodable": (6, dict(wait=Cond(0, "dma", 1 << 24)),
                               "wait: condition L0.dma>=16777216 out of range"),
}


@pytest.mark.parametrize("i, changes, reason", REJECTIONS.values(), ids=REJECTIONS.keys())
def test_instruction_rejected(i, changes, reason):
    p = program()
    p.instrs[i] = dataclasses.replace(p.instrs[i], **changes)
    assert_rejected(p, TINY, i, reason)


def test_conditions_count_the_whole_queue_barriers_included():
    vadd = VADD(1, View("vec", 0, 1, 1), View("vec", 0, 1, 1), 1.0, rows=1, cols=1)
    p = Program("dlegion-tiny", [], [vadd, Barrier(), vadd, Wait(0, "dma", Cond(1, "vec", 4))],
                source="t.s", lines=[FIRST_LINE + i for i in range(4)])
    assert problems_of(p, TINY) == [
        "t.s:13: wait: condition L1.vec>=4 can never be satisfied: L1.vec runs 3 instructions"]
    p.instrs[-1] = Wait(0, "dma", Cond(1, "vec", 3))
    assert check(p, TINY) == []
    # a queue that runs nothing but the barrier runs one instruction
    p.instrs[-1] = Wait(0, "dma", Cond(1, "mat", 2))
    assert problems_of(p, TINY) == [
        "t.s:13: wait: condition L1.mat>=2 can never be satisfied: L1.mat runs 1 instruction"]


def test_a_condition_may_name_any_queue_of_the_machine_and_count_zero():
    p = program()
    p.instrs[2] = Wait(1, "mat", Cond(1, "vec", 0))
    p.instrs[6] = dataclasses.replace(p.instrs[6], wait=Cond(1, "mat", 3))
    assert check(p, TINY) == []


def test_location_without_line_numbers():
    p = program()
    p.lines = []
    p.instrs[2] = dataclasses.replace(p.instrs[2], until=Cond(0, "dma", 9))
    assert problems_of(p, TINY) == [
        "t.s: instruction 2: wait: condition L0.dma>=9 can never be satisfied: L0.dma runs 4 "
        "instructions"]


# --- tensors ------------------------------------------------------------------------------------

def no_offset(p):
    p.tensors[1].offset = None


def short_data(p):
    p.data = bytes(600)


def input_no_io_name(p):
    p.tensors[0].io_name = None


def output_no_io_name(p):
    p.tensors[3].io_name = None


def duplicate_name(p):
    p.tensors[5].name = "x"


def duplicate_io_name(p):
    p.tensors.append(Tensor("x2", "i8", (4,), "input", io_name="x"))


TENSOR_REJECTIONS = {
    "const-without-offset": (no_offset,
                             "t.s: tensor 'w': const tensor has no offset in the data file"),
    "const-beyond-data": (short_data, "t.s: tensor 'e': const bytes 544..13344 lie beyond the "
                                      "data file 't.s.data', which has 600"),
    "input-without-io-name": (input_no_io_name,
                              "t.s: tensor 'x': input tensor has no io_name to bind it to the "
                              "graph"),
    "output-without-io-name": (output_no_io_name,
                               "t.s: tensor 'y': output tensor has no io_name to bind it to the "
                               "graph"),
    "duplicate-name": (duplicate_name, "t.s: tensor name 'x' is declared 2 times"),
    "duplicate-io-name": (duplicate_io_name, "t.s: input name 'x' is bound to 2 tensors"),
}


@pytest.mark.parametrize("mutate, line", TENSOR_REJECTIONS.values(), ids=TENSOR_REJECTIONS.keys())
def test_tensor_rejected(mutate, line):
    p = program()
    mutate(p)
    assert problems_of(p, TINY) == [line]


def test_io_names_are_unique_per_kind_only():
    p = program()
    p.tensors[3].io_name = "x"      # an output may share its graph name with an input
    assert check(p, TINY) == []


def test_const_bytes_unchecked_without_data():
    p = program()
    p.data = None
    assert check(p, TINY) == []


# --- the message --------------------------------------------------------------------------------

def test_message_lists_at_most_max_shown_problems():
    p = program()
    extra = 5
    p.instrs += [Wait(0, "vec", Cond(0, "mat", 40 + k)) for k in range(MAX_SHOWN + extra)]
    p.lines = []
    assert len(check(p, TINY)) == MAX_SHOWN + extra
    lines = problems_of(p, TINY)
    assert len(lines) == MAX_SHOWN + 1
    assert lines[0] == (f"t.s: instruction {len(instrs())}: wait: condition L0.mat>=40 can never be "
                        "satisfied: L0.mat runs 2 instructions")
    assert lines[-1] == f"... and {extra} more"


def test_a_program_read_from_text_is_checked_anew_once_changed():
    """A parsed program's fields were checked as it was read, so verify skips that check; an
    instruction put in afterwards, which no parse checked, is still checked."""
    from isa import encoding
    from isa.asm import format_program, parse
    p = parse(format_program(program()), "t.s")
    assert encoding.words_hold(p)
    p.instrs[6] = dataclasses.replace(p.instrs[6], b=0.1)
    assert not encoding.words_hold(p)
    assert any("immediate 0.1 is not an fp32 value" in line for line in problems_of(p, TINY))
