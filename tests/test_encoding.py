"""Binary format: the generic packer, round trips, and strict decoding of bad files."""
from __future__ import annotations

import dataclasses
import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isa import asm, encoding
from isa.fields import ADDR_BITS, QUEUES, Cond, DramRef, View, f32_bits
from isa.instructions import (BY_MNEMONIC, INSTRUCTIONS, WORD_BITS, Barrier, DmaStore, Wait,
                              word_bits)
from isa.program import Program, ProgramError, Tensor
from strategies import instructions, instructions_of, programs

VAdd = BY_MNEMONIC["vadd"]
WORD = WORD_BITS // 8           # bytes of an instruction word
VIEW_BITS = 2 + ADDR_BITS + 16 + 16    # space, address, row and column strides


def word(i) -> int:
    return int.from_bytes(encoding.encode_instr(i), "little")


# --- instruction words -------------------------------------------------------------------------

def test_fields_follow_the_opcode_in_declared_order():
    # wait: opcode 8 bits, legion 8, queue_name 2 (dma, mat, vec), then the condition: "own
    # Legion" 1, its Legion 8, its queue 2, "relative" 1, its count 24; then the optional span
    until = 7 << 1 | 2 << 9 | 9 << 12
    assert word(Wait(1, "mat", Cond(7, "vec", 9))) == 0x41 | 1 << 8 | 1 << 16 | until << 18
    relative_own = 1 | 2 << 9 | 1 << 11 | 3 << 12
    assert word(Wait(1, "mat", Cond(None, "vec", None, 3))) == 0x41 | 1 << 8 | 1 << 16 | relative_own << 18
    span_at = 18 + 36
    assert word(Wait(1, "mat", Cond(7, "vec", 9), span=4)) >> span_at == 1 | 4 << 1
    assert word(Barrier()) == 0x42


def test_views_immediates_and_the_optional_wait_are_packed_by_their_kinds():
    i = VAdd(2, View("vec", 5, 6, 7), View("act", 1, 0, 0), -1.5, 4, 64)
    x = word(i)
    assert x & 0xFF == i.OPCODE and x >> 8 & 0xFF == 2
    dst = x >> 16 & ((1 << VIEW_BITS) - 1)
    assert dst == 3 | 5 << 2 | 6 << (2 + ADDR_BITS) | 7 << (2 + ADDR_BITS + 16)
    b = x >> (16 + 2 * VIEW_BITS) & ((1 << (1 + VIEW_BITS)) - 1)
    assert b == 1 | f32_bits(-1.5) << 1
    rows_at = 16 + 3 * VIEW_BITS + 1
    assert x >> rows_at == 4 | 64 << 16                 # no wait: its presence bit and all else 0
    # then the optional span (a presence bit and 8 bits), and the wait, last: a presence bit,
    # then the condition
    wait_at = rows_at + 32 + 9
    waited = word(dataclasses.replace(i, wait=Cond(3, "dma", 5)))
    assert waited >> wait_at == 1 | (3 << 1 | 0 << 9 | 5 << 12) << 1
    assert waited & ((1 << wait_at) - 1) == x


def test_every_class_fits_its_word():
    assert all(word_bits(c) <= WORD_BITS for c in INSTRUCTIONS)
    assert len({c.OPCODE for c in INSTRUCTIONS}) == len(INSTRUCTIONS)


@settings(max_examples=300, deadline=None)
@given(instructions(n_tensors=4))
def test_decode_inverts_encode(i):
    b = encoding.encode_instr(i)
    assert len(b) == WORD
    assert encoding.decode_instr(b) == i


@settings(max_examples=200, deadline=None)
@given(instructions(n_tensors=4), st.integers(0, WORD_BITS - 1))
def test_a_flipped_bit_decodes_to_another_instruction_or_fails_cleanly(i, bit):
    x = word(i) ^ (1 << bit)
    try:
        j = encoding.decode_instr(x.to_bytes(WORD, "little"))
    except ProgramError:
        return
    assert encoding.encode_instr(j) == x.to_bytes(WORD, "little")


def test_unknown_opcode_and_bad_lengths():
    with pytest.raises(ProgramError, match="unknown opcode 0xff"):
        encoding.decode_instr(b"\xff" + bytes(WORD - 1))
    with pytest.raises(ProgramError, match=f"{WORD} bytes, got 32"):
        encoding.decode_instr(bytes(32))            # a word of the old 256-bit format


def test_unused_bits_and_keyword_codes_outside_the_choices_are_rejected():
    good = word(Wait(3, "vec", Cond(0, "dma", 5)))
    for bad in (good | 1 << (WORD_BITS - 1), Barrier.OPCODE | 1 << 8):
        with pytest.raises(ProgramError, match="non-canonical"):
            encoding.decode_instr(bad.to_bytes(WORD, "little"))
    with pytest.raises(ProgramError, match="queue_name has no valid value"):
        encoding.decode_instr((good | 3 << 16).to_bytes(WORD, "little"))
    with pytest.raises(ProgramError, match="until has no valid value"):
        encoding.decode_instr((good | 3 << (18 + 9)).to_bytes(WORD, "little"))


def test_an_absent_wait_has_one_encoding():
    i = VAdd(0, View("vec", 0, 1, 1), View("vec", 0, 1, 1), 1.0, 1, 1)
    wait_at = 16 + 3 * VIEW_BITS + 1 + 32 + 9
    payload = word(i) | 5 << (wait_at + 1)          # a condition without its presence bit
    with pytest.raises(ProgramError, match="non-canonical"):
        encoding.decode_instr(payload.to_bytes(WORD, "little"))
    present = word(i) | 1 << wait_at
    assert encoding.decode_instr(present.to_bytes(WORD, "little")).wait == Cond(0, "dma", 0)


def test_nan_immediates_encode_as_the_quiet_nan():
    nan = struct.unpack("<f", struct.pack("<I", 0xFFC00001))[0]
    a = word(VAdd(0, View("vec", 0, 1, 1), View("vec", 0, 1, 1), nan, 1, 1))
    b = word(VAdd(0, View("vec", 0, 1, 1), View("vec", 0, 1, 1), float("nan"), 1, 1))
    assert a == b
    other = a ^ (1 << (16 + 2 * VIEW_BITS + 1))          # flip the lowest payload bit of the NaN
    with pytest.raises(ProgramError, match="non-canonical"):
        encoding.decode_instr(other.to_bytes(WORD, "little"))


@pytest.mark.parametrize("i, match", [
    (Wait(256, "vec", Cond(0, "dma", 1)), "legion: Legion index 256 out of range"),
    (Wait(0, "gpu", Cond(0, "dma", 1)), "queue_name: 'gpu' is not one of"),
    (Wait(0, "vec", Cond(0, "gpu", 1)), "until: expected a condition like L0.dma>=5"),
    (Wait(0, "vec", None), "until: expected a condition like L0.dma>=5 or dma~1, got None"),
    (Wait(0, "vec", Cond(256, "dma", 1)), "until: condition L256.dma>=1 out of range"),
    (VAdd(0, View("vec", 0, 1, 1), View("vec", 0, 1, 1), 1.0, 1, 1, wait=Cond(0, "dma", 1 << 24)),
     "wait: condition L0.dma>=16777216 out of range"),
    (VAdd(0, View("vec", 0, 1, 1), View("vec", 0, 1, 1), 1.0, 1, 1, wait=5), "wait: expected a condition"),
    (VAdd(0, View("vec", 0, 1, 1), View("vec", 0, 1, 1), 1.0, 1, 1, span=256), "span: 256 does not fit in 8 bits"),
    (VAdd(0, View("vec", 0, 1, 1), View("vec", 0, 1, 1), 1.0, 1, 1, wait=Cond(0, "dma", 1, 2)),
     "is absolute and relative at once"),
    (VAdd(0, View("vec", 1 << ADDR_BITS, 1, 1), View("vec", 0, 1, 1), 1.0, 1, 1), "dst: view addr"),
    (VAdd(0, View("vec", 0, 1, 1), View("vec", 0, 1, 1), 0.1, 1, 1), "b: immediate 0.1 is not an fp32"),
    (VAdd(0, View("vec", 0, 1, 1), View("vec", 0, 1, 1), 1e39, 1, 1),
     "b: immediate 1e\\+39 is outside the fp32 range"),
    (VAdd(0, View("vec", 0, 1, 1), View("vec", 0, 1, 1), 1, 1, 1), "b: immediate 1 is not an fp32"),
])
def test_values_the_word_cannot_hold_are_errors(i, match):
    with pytest.raises(ProgramError, match=match):
        encoding.encode_instr(i)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([c for c in INSTRUCTIONS if c.fields()]), st.data())
def test_quick_field_checks_agree_with_bad_fields(cls, data):
    # Corrupt one field of a valid instruction with a value of another field's kind.
    i = data.draw(instructions_of(cls, 4))
    names = [f.name for f in cls.fields()]
    name = data.draw(st.sampled_from(names))
    value = data.draw(st.one_of(st.integers(-2, 1 << 33), st.none(), st.floats(width=32),
                                st.builds(View, st.sampled_from(["act", "vec", "acc", "wgt"]),
                                          st.integers(0, 1 << 25), st.integers(0, 1 << 17), st.integers(0, 2)),
                                st.sampled_from(["w8", "k", "set", "dma", "x"]),
                                st.frozensets(st.integers(0, 70), max_size=3),
                                st.builds(Cond, st.integers(-1, 300), st.sampled_from(QUEUES + ("gpu",)),
                                          st.integers(-1, 1 << 25))))
    j = cls(**{**{n: getattr(i, n) for n in names}, name: value})
    try:
        expected = j.bad_fields()
    except (OverflowError, TypeError, ValueError):
        expected = None                      # the kind's own check cannot judge this value
    if expected is not None:
        assert encoding.field_errors(j) == expected


# --- whole programs ------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(programs())
def test_program_binary_round_trip(p):
    assert encoding.decode_program(encoding.encode_program(p)) == p


@settings(max_examples=100, deadline=None)
@given(programs())
def test_disassembled_text_reassembles_to_the_same_bytes(p):
    binary = encoding.encode_program(p)
    text = asm.format_program(encoding.decode_program(binary))
    assert encoding.encode_program(asm.parse(text)) == binary


def test_file_layout():
    p = Program(arch="dlegion-tiny", tensors=[Tensor("x", "f32", (2, 3), "input", "x")],
                instrs=[Wait(0, "dma", Cond(1, "vec", 1)), Barrier()], data_file="d.bin",
                regions=[(0, "MatMul_1"), (2, "after")], skipped={"causal_skipped_macs": 12},
                approximations={"int8_attention": ["s", "o"], "int8_activations": []})
    b = encoding.encode_program(p)
    magic, version, reserved, n = struct.unpack_from("<4sHHI", b)
    assert (magic, version, reserved) == (b"DLGN", encoding.VERSION, 0)
    head = json.loads(b[12:12 + n])
    assert head == {"arch": "dlegion-tiny", "data_file": "d.bin", "tensors": [
        {"name": "x", "dtype": "f32", "shape": [2, 3], "kind": "input", "io_name": "x", "offset": None,
         "range": None}], "regions": [[0, "MatMul_1"], [2, "after"]], "skipped": {"causal_skipped_macs": 12},
        "approximations": {"int8_attention": ["s", "o"], "int8_activations": []}, "instructions": 2}
    start = -(-(12 + n) // WORD) * WORD
    assert b[12 + n:start] == bytes(start - 12 - n)
    assert len(b) == start + 2 * WORD and b[start:start + WORD] == encoding.encode_instr(p.instrs[0])
    assert b[start + WORD:] == (Barrier.OPCODE).to_bytes(WORD, "little")


def test_every_truncation_fails_cleanly_or_is_a_shorter_program():
    body = "barrier\ndma.st L1 @t[0,1] vec[0,1,1] rows=1 cols=1 wait=L0.vec>=1\n"
    p = asm.parse(".arch a\n.tensor t f32[4] scratch\n" + body * 2)
    b = encoding.encode_program(p)
    for n in range(len(b)):
        try:
            q = encoding.decode_program(b[:n], "cut.bin")
        except ProgramError as e:
            assert str(e).startswith("cut.bin: ")
            continue
        assert q.instrs == p.instrs[:len(q.instrs)] and (len(b) - n) % WORD == 0


@pytest.mark.parametrize("head, match", [
    (b"{", "corrupt header"),
    (b"[]", "corrupt header: header needs exactly the keys"),
    (b'{"arch": 1, "data_file": null, "tensors": [], "regions": [], "skipped": {}, "approximations": {}, "instructions": 0}', "corrupt header: header arch 1"),
    (b'{"arch": "a", "data_file": null, "tensors": [{"name": "x"}], "regions": [], "skipped": {}, "approximations": {}, "instructions": 0}',
     "tensor needs exactly the keys"),
    (b'{"arch": "a", "data_file": null, "tensors": [{"name": "x", "dtype": "f16", "shape": [1], '
     b'"kind": "input", "io_name": null, "offset": null, "range": null}], "regions": [], "skipped": {}, "approximations": {}, "instructions": 0}',
     "unknown dtype 'f16'"),
    (b'{"arch": "a", "data_file": null, "tensors": [{"name": "x", "dtype": "f32", "shape": [1.5], '
     b'"kind": "input", "io_name": null, "offset": null, "range": null}], "regions": [], "skipped": {}, "approximations": {}, "instructions": 0}', "bad shape"),
    (b'{"arch": "a", "data_file": null, "tensors": [], "regions": [], "skipped": {"x y": 1}, "approximations": {}, "instructions": 0}', "is not a name"),
    (b'{"arch": "a", "data_file": null, "tensors": [], "regions": [], "skipped": {"x": -1}, "approximations": {}, "instructions": 0}', "is not a count"),
])
def test_corrupt_headers_are_errors(head, match):
    b = struct.pack("<4sHHI", b"DLGN", encoding.VERSION, 0, len(head)) + head
    b += bytes(-len(b) % WORD)
    with pytest.raises(ProgramError, match=match):
        encoding.decode_program(b, "x.bin")


def _with_header(head: bytes, words: int = 0) -> bytes:
    b = struct.pack("<4sHHI", b"DLGN", encoding.VERSION, 0, len(head)) + head
    return b + bytes(-len(b) % WORD) + Barrier.OPCODE.to_bytes(WORD, "little") * words


REGIONLESS = b'"arch": "a", "data_file": null, "tensors": [], "instructions": 1'


@pytest.mark.parametrize("regions, match", [
    (b'[[2, "x"]]', "region 0 \\('x'\\): starts at instruction 2, expected 0..1"),
    (b'[[1, "x"], [0, "y"]]', "region 1 \\('y'\\): starts at instruction 0, expected 1..1"),
    (b'[[0, 5]]', "region 0: expected \\(instruction index, name\\)"),
    (b'[[true, "x"]]', "region 0: expected"),
    (b'[[0, "x", 1]]', "region 0: expected"),
    (b'["x"]', "region 0: expected"),
])
def test_corrupt_regions_are_errors(regions, match):
    head = b"{" + REGIONLESS + b', "skipped": {}, "approximations": {}, "regions": ' + regions + b"}"
    with pytest.raises(ProgramError, match="x.bin: corrupt header: " + match):
        encoding.decode_program(_with_header(head, words=1), "x.bin")


def test_a_header_without_regions_is_corrupt():
    with pytest.raises(ProgramError, match="needs exactly the keys arch, data_file, tensors, regions, skipped"):
        encoding.decode_program(_with_header(b"{" + REGIONLESS + b"}"), "x.bin")


def test_regions_out_of_order_are_not_encoded():
    p = Program(arch="a", instrs=[Barrier()], regions=[(1, "late"), (0, "early")])
    with pytest.raises(ProgramError, match="region 1 \\('early'\\): starts at instruction 0"):
        encoding.encode_program(p)


def test_version_and_references_are_checked():
    p = Program(arch="a", tensors=[Tensor("t", "f32", (4,), "scratch")],
                instrs=[DmaStore(0, DramRef(0, 0, 1), View("vec", 0, 1, 1), 1, 1)])
    b = bytearray(encoding.encode_program(p))
    newer = encoding.VERSION + 1
    with pytest.raises(ProgramError, match=f"unsupported binary version {newer}.0"):
        encoding.decode_program(bytes(b[:4] + bytes([newer]) + b[5:]))
    b[-WORD + 2] = 5            # the tensor index of dst: bits 16.., after opcode and legion
    with pytest.raises(ProgramError, match="instruction 0: dma.st: dst: tensor index 5 but only 1"):
        encoding.decode_program(bytes(b))
    p.instrs[0] = DmaStore(0, DramRef(1, 0, 1), View("vec", 0, 1, 1), 1, 1)
    with pytest.raises(ProgramError, match="instruction 0: dst: tensor index 1"):
        encoding.encode_program(p)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 400))
def test_garbage_never_crashes(junk, cut):
    head = encoding.encode_program(Program(arch="a", tensors=[Tensor("t", "f32", (4,), "scratch")]))
    for b in (b"DLGN" + junk, head[:cut] + junk):
        try:
            encoding.decode_program(b)
        except ProgramError:
            pass
