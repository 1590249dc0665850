"""Decode steps with a key/value cache: the generator's graph (transformers' pattern), empty caches,
and the command line's errors about the cache's dims."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from isa.asm import load
from isa.encoding import decode_program, encode_program
from models import bitnet
from models.decoder import PAST_DIM

ROOT = Path(__file__).parent.parent
DECODE = ROOT / "models" / "bitnet_tiny_decode.onnx"
KV, HEAD = 2, 16        # the tiny preset's key/value heads and head dim


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _caches(session, layers: int, arrays) -> dict:
    names = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    assert names == [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    return dict(zip(names, arrays))


def test_a_prefill_then_a_decode_step_give_the_logits_of_the_whole_sequence():
    full = _session(bitnet.build_bitnet(bitnet.preset("tiny", dynamic=True)))
    cached = _session(bitnet.build_bitnet(bitnet.preset("tiny", dynamic=True, past=0)))
    ids = np.random.default_rng(0).integers(0, 256, (1, 7), dtype=np.int64)
    whole = full.run(["logits"], {"input_ids": ids})[0]
    empty = np.zeros((1, KV, 0, HEAD), np.float32)
    first = cached.run(None, {"input_ids": ids[:, :4], **_caches(cached, 2, [empty] * 4)})
    second = cached.run(None, {"input_ids": ids[:, 4:], **_caches(cached, 2, first[1:])})
    np.testing.assert_array_equal(first[0], whole[:, :4])
    np.testing.assert_array_equal(second[0], whole[:, 4:])
    assert second[1].shape == (1, KV, 7, HEAD)          # present: the past and the new keys


def test_a_static_past_is_the_symbolic_one_bound():
    static = _session(bitnet.build_bitnet(bitnet.preset("tiny", seq=2, past=5)))
    dynamic = _session(bitnet.build_bitnet(bitnet.preset("tiny", dynamic=True, past=0)))
    rng = np.random.default_rng(1)
    feeds = {"input_ids": rng.integers(0, 256, (1, 2), dtype=np.int64)}
    feeds |= _caches(static, 2, [rng.standard_normal((1, KV, 5, HEAD)).astype(np.float32) for _ in range(4)])
    for a, b in zip(static.run(None, feeds), dynamic.run(None, feeds)):
        np.testing.assert_array_equal(a, b)
    assert [o.shape for o in static.get_outputs()][1] == [1, KV, 7, HEAD]
    assert [i.shape for i in dynamic.get_inputs()][1] == [1, KV, PAST_DIM, HEAD]


def test_without_past_the_graph_has_no_cache():
    model = bitnet.build_bitnet(bitnet.preset("tiny"))
    assert [i.name for i in model.graph.input] == ["input_ids"]
    assert [o.name for o in model.graph.output] == ["logits"]


# --- the command line ----------------------------------------------------------------------------------

def _refused(result, *parts):
    status, lines = result
    assert status == 2 and len(lines) == 1 and lines[0].startswith("dlegion-cc: error: "), lines
    for part in parts:
        assert part in lines[0], lines[0]


def test_an_unbound_cache_names_the_dim_to_give_once(cc, tmp_path):
    _refused(cc(DECODE, "-o", tmp_path / "p.s", "--dim", "sequence=1"),
             "'past_sequence_length' of inputs 'past_key_values.0.key' and 3 more",
             "pass --dim past_sequence_length=N or --inputs")
    assert not list(tmp_path.iterdir())


def test_an_empty_cache_compiles_from_dim_or_inputs(cc, tmp_path):
    status, lines = cc(DECODE, "-o", tmp_path / "a.s", "--dim", "sequence=3", "--dim", "past_sequence_length=0", "-q")
    assert status == 0, lines
    program = load(tmp_path / "a.s")
    empty = [t for t in program.tensors if t.io_name and t.io_name.startswith("past_key_values.")]
    assert [t.shape for t in empty] == [(1, KV, 0, HEAD)] * 4
    assert decode_program(encode_program(program)).tensors == program.tensors     # the binary form too
    arrays = {"input_ids": np.zeros((1, 3), np.int64)}
    arrays |= {f"past_key_values.{i}.{k}": np.zeros((1, KV, 0, HEAD), np.float32) for i in range(2) for k in ("key", "value")}
    np.savez(tmp_path / "in.npz", **arrays)
    status, lines = cc(DECODE, "-o", tmp_path / "b.s", "--inputs", tmp_path / "in.npz", "-q")
    assert status == 0, lines
    assert (tmp_path / "b.s").read_text().replace("b.s.data", "a.s.data") == (tmp_path / "a.s").read_text()


def test_an_empty_output_is_refused(cc, tmp_path):
    _refused(cc(DECODE, "-o", tmp_path / "p.s", "--dim", "sequence=0", "--dim", "past_sequence_length=2"),
             "graph output 'logits' float32[1,0,256] is empty with sequence=0")
    assert not list(tmp_path.iterdir())


def _position_table(path: Path, rows: int) -> Path:
    """y = x * cos_cache[past .. past + sequence]: a table of ``rows`` positions read at the cache's end."""
    nodes = [helper.make_node("Shape", ["past"], ["p"], start=2, end=3, name="past_len"),
             helper.make_node("Shape", ["x"], ["s"], start=1, end=2, name="seq_len"),
             helper.make_node("Add", ["p", "s"], ["t"], name="total"),
             helper.make_node("Squeeze", ["p"], ["p0"], name="p0"),
             helper.make_node("Squeeze", ["t"], ["t0"], name="t0"),
             helper.make_node("Range", ["p0", "t0", "one"], ["pos"], name="positions"),
             helper.make_node("Gather", ["cos_cache", "pos"], ["cos"], axis=0, name="cos_gather"),
             helper.make_node("Mul", ["x", "cos"], ["y"], name="mul")]
    inits = [numpy_helper.from_array(np.ones((rows, 4), np.float32), "cos_cache"),
             numpy_helper.from_array(np.array(1, np.int64), "one")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "sequence", 4]),
                                       helper.make_tensor_value_info("past", TensorProto.FLOAT, [1, 1, PAST_DIM, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "sequence", 4])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]), path)
    return path


def test_a_past_longer_than_the_models_positions_is_refused(cc, tmp_path):
    model = _position_table(tmp_path / "pos.onnx", rows=8)
    out = tmp_path / "out" / "p.s"
    status, lines = cc(model, "-o", out, "--dim", "sequence=2", "--dim", "past_sequence_length=6", "-q")
    assert status == 0, lines
    _refused(cc(model, "-o", out, "--dim", "sequence=2", "--dim", "past_sequence_length=7"),
             "node 'cos_gather' (Gather)", "past_sequence_length=7, sequence=2 reach position 8",
             "the model's 8 positions")


def test_a_decode_step_reads_each_cached_head_once_per_group():
    """One query row per head: the group's query heads are the rows of one product against the
    unrepeated key/value head (not a product per query head, each reading the whole head)."""
    from isa import arch
    from dlegion_cc.pipeline import Options, graph_of
    graph = graph_of(DECODE, Options(arch.load("dlegion-tiny"), {"sequence": 1, PAST_DIM: 11}, attention="fp32"))
    products = [n for n in graph.nodes if n.op == "MatMul" and not n.domain][:2]
    shapes = [[graph.values[i].shape for i in n.inputs] for n in products]
    assert shapes == [[(1, KV, 2, HEAD), (1, KV, HEAD, 12)], [(1, KV, 2, 12), (1, KV, 12, HEAD)]]


def test_copying_a_cache_into_its_present_output_keeps_dram_busy(tmp_path):
    """The present output is a copy of the past with the new rows after it: rows of a 2B4T
    layer's cache are longer than a block, and the blocks they are cut into take half the
    vector scratchpad each, so one loads while the one before is stored."""
    from isa import arch
    from dlegion_cc.pipeline import Options, compile_model
    from runtime.timing import simulate
    machine = arch.load("dlegion-8x8")
    past, new = [1, 5, 512, 128], [1, 5, 1, 128]
    g = helper.make_graph([helper.make_node("Concat", ["past", "new"], ["present"], axis=2)], "g",
                          [helper.make_tensor_value_info("past", TensorProto.FLOAT, past),
                           helper.make_tensor_value_info("new", TensorProto.FLOAT, new)],
                          [helper.make_tensor_value_info("present", TensorProto.FLOAT, [1, 5, 513, 128])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]), tmp_path / "cat.onnx")
    _, program = compile_model(tmp_path / "cat.onnx", Options(machine, cache_alias=False))
    moved = 2 * 4 * (np.prod(past) + np.prod(new))          # read once and written once
    floor = moved / machine.derived.dram_bytes_per_cycle + 2 * machine.dram_latency_cycles
    assert simulate(program, machine).cycles <= 1.05 * floor


@pytest.mark.fp32
def test_the_causal_skip_follows_the_mask_offset_by_the_past():
    """Several new tokens after a cache: token i sees keys 0 .. past + i, so the blocks past that
    are left out (the mask's own values say where), and the result is onnxruntime's."""
    from isa import arch
    from dlegion_cc.pipeline import Options, compile_model
    from runtime.check import compare, onnx_reference
    from runtime.emulator import random_inputs, run
    seq, past = 24, 40
    machine = arch.load("dlegion-tiny")
    graph, program = compile_model(DECODE, Options(machine, {"sequence": seq, PAST_DIM: past}, attention="fp32"))
    [qk] = [n for n in graph.nodes if n.op == "MatMul" and "dead" in n.attrs][:1]
    rows, cols = np.indices((seq, past + seq))
    np.testing.assert_array_equal(qk.attrs["dead"], cols > past + rows)
    assert program.skipped.get("causal_skipped_macs", 0) > 0
    inputs = random_inputs(program, 0)
    result = compare(run(program, machine, inputs).outputs, onnx_reference(DECODE, inputs))
    assert all(r.ok for r in result), result
