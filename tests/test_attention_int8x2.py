"""--attention int8x2 (passes/attention.py): each operand of attention's float products in two
int8 pieces, three products of pieces summed in fp32; the integer parts exact, the error far
below int8's, and --check's yardstick quantizing the same way (runtime/reference64.py)."""
import numpy as np
import pytest

from isa.asm import format_program, parse
from isa.encoding import decode_program, encode_program
from dlegion_cc.passes.attention import LOW_STEPS
from dlegion_cc.pipeline import Options, compile_model, graph_of
from runtime.check import PROGRAM_APPROXIMATIONS, judge
from runtime.emulator import random_inputs, run
from runtime.reference64 import LOW_STEPS as REFERENCE_LOW_STEPS, float64_outputs
from test_attention_int8 import (ROOT, TINY, WIDE, _inputs, _onnxruntime, _rel, attention, plain_product, rotary_layer,
                                 same_bits_with_q_quantized_apart)


def _pieces(v: np.ndarray):
    """Per row of v, as the program computes them in fp32: the first int8 piece and its scale,
    the second (what the first leaves over, in LOW_STEPS steps of it) and its scale."""
    r = np.maximum(np.abs(v).max(axis=-1, keepdims=True), np.float32(1e-30)) / np.float32(127)
    s = v / r
    hi = np.round(s)
    lo = np.clip(np.round((s - hi) * np.float32(LOW_STEPS)), -127, 127)
    return hi, r, lo, r / np.float32(LOW_STEPS)


def test_the_integer_parts_are_exact(tmp_path):
    """A product of two float matrices with no softmax after it: hi.hi, and lo.hi + hi.lo summed
    exactly in int32 (a's second scale is ra / 254, b's rb / 254: both products drain with
    ra . rb / 254), each scaled when draining and the second added to the first in fp32, bit for
    bit as numpy computes the same steps; much closer to the float product than int8's."""
    path, x = plain_product(tmp_path)
    _, program = compile_model(path, Options(WIDE, attention="int8x2"))
    assert program.approximations == {"int8x2_attention": ["o"]}
    got = run(program, WIDE, x).outputs["o"]
    a8, ra, alo, _ = _pieces(x["a"])
    b8, rb, blo, rblo = (np.swapaxes(p, 1, 2) for p in _pieces(np.swapaxes(x["b"], 1, 2)))

    def acc(a, b):
        return np.einsum("hmk,hkn->hmn", a.astype(np.int64), b.astype(np.int64))
    cross = acc(alo, b8) + acc(a8, blo)
    assert np.abs(cross).max() < 2 ** 24          # exact in fp32 too: the drain converts it
    want = acc(a8, b8).astype(np.float32) * ra * rb + cross.astype(np.float32) * ra * rblo
    np.testing.assert_array_equal(got, want)
    exact = x["a"].astype(np.float64) @ x["b"]
    _, int8 = compile_model(path, Options(WIDE, attention="int8"))
    one_piece = _rel(run(int8, WIDE, x).outputs["o"], exact)
    assert 0 < _rel(got, exact) < one_piece / 50


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_attention_error_is_far_below_int8s(tmp_path, kv_heads):
    """Causal attention (grouped-query with two K/V heads): two nodes of three products each on
    the arrays, the
    error from onnxruntime's fp32 a small fraction of int8's (measured: 9.4e-3 -> 5.3e-5 at
    two heads, sequence 64), yet an approximation."""
    heads, seq = 4, 128
    path = attention(tmp_path / "attn.onnx", heads, seq, kv_heads)
    x = _inputs(heads, seq, kv_heads)
    want = _onnxruntime(path, x)
    graph = graph_of(path, Options(WIDE, attention="int8x2"))
    products = [n for n in graph.nodes if n.op == "AttnMatMul"]
    assert len(products) == 2 and all(len(n.inputs) == 6 for n in products)
    errors = {}
    for mode in ("int8", "int8x2"):
        _, program = compile_model(path, Options(WIDE, attention=mode))
        errors[mode] = _rel(run(program, WIDE, x).outputs["o"], want)
    assert 1e-6 < errors["int8x2"] < errors["int8"] / 20, errors


def test_the_program_records_int8x2_through_both_formats(tmp_path):
    path = attention(tmp_path / "attn.onnx", seq=16)
    _, approx = compile_model(path, Options(TINY, attention="int8x2"))
    assert approx.approximations == {"int8x2_attention": ["s", "o"]}
    assert parse(format_program(approx)).approximations == approx.approximations
    assert decode_program(encode_program(approx)).approximations == approx.approximations
    assert REFERENCE_LOW_STEPS == LOW_STEPS


def test_check_measures_it_from_the_same_quantization(tmp_path):
    """The yardstick quantizes the program's products in two pieces as the program does: the
    program is far closer to it than to the one-piece yardstick or to fp64 itself, and --check
    passes it."""
    path = attention(tmp_path / "attn.onnx", 2, 64)
    x = _inputs(2, 64)
    _, program = compile_model(path, Options(TINY, attention="int8x2"))
    got = run(program, TINY, x).outputs["o"]
    products = program.approximations["int8x2_attention"]
    two = float64_outputs(path, x, approximations=True, int8_attention=products, pieces=2)["o"]
    one = float64_outputs(path, x, approximations=True, int8_attention=products)["o"]
    plain = float64_outputs(path, x)["o"]
    assert _rel(got, two) < _rel(got, plain) / 10 and _rel(got, two) < _rel(got, one) / 100
    [row] = judge(path, x, {"o": got}, program_approximations=program.approximations).rows
    assert row.ok and row.fp64.bound == PROGRAM_APPROXIMATIONS["int8x2_attention"][1]
    assert 0 < row.fp64.approximation < 1e-3


def test_check_passes_a_committed_model_compiled_with_int8x2(tmp_path):
    from click.testing import CliRunner
    from dlegion_cc.cli import compile_command
    from runtime.cli import run_command
    model, prog = ROOT / "models" / "bitnet_tiny_relu2.onnx", tmp_path / "p.s"
    r = CliRunner().invoke(compile_command, [str(model), "-o", str(prog), "--arch", "dlegion-tiny",
                                             "--attention", "int8x2", "-q"])
    assert r.exit_code == 0, r.output
    assert ".approximation int8x2_attention" in prog.read_text()
    r = CliRunner().invoke(run_command, [str(prog), "--check", str(model), "-q"])
    assert r.exit_code == 0, r.output
    assert "int8x2_attention" in r.output and "measured from the float64 evaluation with them applied" in r.output


def _qk_blocks_by_legion(program, depth: int) -> dict:
    """Per Legion, the array-wide weight blocks times rows that QK^T's passes (K = ``depth``)
    multiply, block masks counted."""
    out = {}
    for i in program.instrs:
        if type(i).__name__ != "MatMul" or i.K != depth:
            continue
        blocks = -(-i.K // WIDE.array) * -(-i.N // WIDE.array)
        if i.mask is not None:
            t = program.tensors[i.mask]
            blocks = int(np.frombuffer(program.const_bytes(t), np.uint8).sum())
        for legion in range(i.legion, i.legion + (i.span or 1)):
            out[legion] = out.get(legion, 0) + i.M * blocks
    return out


def test_a_causal_qk_of_pieces_is_dealt_so_every_legion_skips_alike(tmp_path):
    """QK^T's output columns dealt to the Legions interleaved (qmatmul._interleave): every
    Legion multiplies as many live blocks, fewer than the dense product's; in order, the Legion
    of the first columns would pass every row of them. The output stays within int8x2's error."""
    heads, seq = 2, 512
    path = attention(tmp_path / "attn.onnx", heads, seq)
    _, program = compile_model(path, Options(WIDE, attention="int8x2"))
    work = _qk_blocks_by_legion(program, 32)
    dense = 3 * heads * seq * (seq // WIDE.legions // WIDE.array) * (32 // WIDE.array)
    assert sorted(work) == list(range(WIDE.legions)) and len(set(work.values())) == 1, work
    assert work[0] < 0.8 * dense
    x = _inputs(heads, seq)
    assert _rel(run(program, WIDE, x).outputs["o"], _onnxruntime(path, x)) < 1e-3


def test_qs_two_pieces_are_made_in_its_rotary_kernel_with_the_same_bits(tmp_path, monkeypatch):
    """Q's second piece joins the rotary kernel that quantizes the first (QuantizeInRowKernel):
    no AbsmaxQuantize nor a kernel of its own is left, both pieces are stored int8 by that
    kernel, and the layer computes the same bits as with the pieces made apart, race-checked."""
    path, graph, fused = rotary_layer(tmp_path, "int8x2")
    assert not [n for n in graph.nodes if n.op == "AbsmaxQuantize"]
    cats = [n for n in graph.nodes if n.op == "Concat" and graph.values[n.outputs[0]].dtype == np.int8]
    assert len(cats) == 2 and len({graph.producer(c.inputs[0]).name for c in cats}) == 1
    same_bits_with_q_quantized_apart(monkeypatch, path, "int8x2", fused, random_inputs(fused, 0))
