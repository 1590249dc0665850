"""dlegion-generate: greedy generation with a key/value cache on the emulator, against onnxruntime's
own loop; its errors; and the serving numbers the timing model gives for the same steps."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from isa import arch
from runtime.generate import Build, cache_graph, emulate, onnxruntime_loop

ROOT = Path(__file__).parent.parent
BITNET = ROOT / "models" / "bitnet_tiny_decode.onnx"
LLAMA = ROOT / "models" / "llama_tiny_decode.onnx"      # dynamic int8: its matmuls on the arrays


@pytest.fixture
def generate(console, tmp_path):
    """Run dlegion-generate in this process, its build folder in tmp_path: (status, stdout, stderr lines)."""
    from runtime import generate_cli
    script = console(generate_cli.main, "dlegion-generate")
    return lambda *args: script(*args, "--build-dir", tmp_path / "build")


def _refused(result, *parts):
    status, _, lines = result
    assert status == 2 and len(lines) == 1 and lines[0].startswith("dlegion-generate: error: "), lines
    for part in parts:
        assert part in lines[0], lines[0]


@pytest.mark.parametrize("model", [BITNET, LLAMA], ids=["bitnet", "llama-int8"])
def test_sixteen_tokens_are_onnxruntimes(generate, tmp_path, model):
    status, out, _ = generate(model, "--arch", "dlegion-tiny", "--prompt-len", 5, "--seed", 3, "-n", 16,
                              "--check", "--json", tmp_path / "g.json", "-q")
    assert status == 0, out
    record = json.loads((tmp_path / "g.json").read_text())
    reference = "exact" if "llama" in model.name else "onnxruntime"
    assert record["tokens"] == onnxruntime_loop(cache_graph(model), record["prompt"], 16, reference)
    assert len(set(record["tokens"])) > 1          # not one token repeated: the cache is read
    assert [s["past"] for s in record["steps"]] == [0] + list(range(5, 20))
    assert all(r["ok"] for r in record["check"])
    assert f"generated (16): {','.join(map(str, record['tokens']))}" in out


def test_the_programs_are_compiled_once(generate, tmp_path):
    args = (BITNET, "--arch", "dlegion-tiny", "--prompt-ids", "1,2,3", "-n", 4, "-q")
    status, out, _ = generate(*args)
    assert status == 0 and "4 of 4 programs compiled" in out
    status, again, _ = generate(*args)
    assert status == 0 and "0 of 4 programs compiled" in again
    assert again.splitlines()[:2] == out.splitlines()[:2]       # prompt and tokens
    assert len(list((tmp_path / "build").glob("*.bin"))) == 4


def test_a_wrong_program_is_caught(generate, tmp_path):
    """One ternary weight of the prefill program negated: --check finds it and exits 1."""
    from isa.asm import load
    from runtime.check import flip_one_weight
    args = (BITNET, "--arch", "dlegion-tiny", "--prompt-ids", "9,8,7,6", "-n", 3, "--check", "-q")
    assert generate(*args)[0] == 0
    [prefill] = (tmp_path / "build").glob("*.s4.p0.bin")
    data = Path(str(prefill) + ".data")
    data.write_bytes(flip_one_weight(data.read_bytes(), load(prefill))[0])
    status, out, _ = generate(*args)
    assert status == 1 and "MISMATCH" in out


def test_a_model_without_a_cache_is_refused(generate):
    _refused(generate(ROOT / "models" / "bitnet_tiny_relu2.onnx", "--prompt-len", 3),
             "no 'present.*' outputs: not a decode graph with a key/value cache")


def test_a_fixed_past_is_refused(generate, tmp_path):
    from models import bitnet
    path = tmp_path / "static.onnx"
    onnx.save(bitnet.build_bitnet(bitnet.preset("tiny", seq=1, past=4)), path)
    _refused(generate(path, "--prompt-len", 3), "input 'input_ids' has a fixed sequence length (1)")


def test_a_prompt_outside_the_vocabulary_is_refused(generate):
    _refused(generate(BITNET, "--prompt-ids", "1,256"), "prompt token 256 is outside the vocabulary", "0 to 255")
    status, _, lines = generate(BITNET, "--prompt-ids", "1,x")
    assert status == 2 and "is not token ids separated by commas" in lines[0]
    status, _, lines = generate(BITNET)
    assert status == 2 and "--prompt-ids A,B,... or --prompt-len N" in lines[0]


def _positions(path: Path, rows: int) -> Path:
    """A decode graph whose positions index a table of ``rows``: logits = embed[ids] * table[past ..
    past + sequence], present = Concat(past, the new rows)."""
    nodes = [helper.make_node("Shape", ["past_key_values.0.key"], ["p"], start=2, end=3, name="past_len"),
             helper.make_node("Shape", ["input_ids"], ["s"], start=1, end=2, name="seq_len"),
             helper.make_node("Add", ["p", "s"], ["t"], name="total"),
             helper.make_node("Squeeze", ["p"], ["p0"], name="p0"),
             helper.make_node("Squeeze", ["t"], ["t0"], name="t0"),
             helper.make_node("Range", ["p0", "t0", "one"], ["pos"], name="positions"),
             helper.make_node("Gather", ["table", "pos"], ["rows"], axis=0, name="table_gather"),
             helper.make_node("Gather", ["embed", "input_ids"], ["x"], axis=0, name="embed_gather"),
             helper.make_node("Mul", ["x", "rows"], ["logits"], name="mul"),
             helper.make_node("Unsqueeze", ["logits", "axis1"], ["new"], name="new"),
             helper.make_node("Concat", ["past_key_values.0.key", "new"], ["present.0.key"], axis=2, name="cat")]
    inits = [numpy_helper.from_array(np.linspace(1, 2, rows * 8, dtype=np.float32).reshape(rows, 8), "table"),
             numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32), "embed"),
             numpy_helper.from_array(np.array(1, np.int64), "one"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "sequence"]),
                                       helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT,
                                                                     [1, 1, "past_sequence_length", 8])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "sequence", 8]),
                           helper.make_tensor_value_info("present.0.key", TensorProto.FLOAT,
                                                         [1, 1, "total_sequence_length", 8])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]), path)
    return path


def test_a_past_longer_than_the_positions_is_refused_before_running(generate, tmp_path):
    model = _positions(tmp_path / "pos.onnx", rows=8)
    status, out, _ = generate(model, "--arch", "dlegion-tiny", "--prompt-ids", "1,2,3", "-n", 6, "--check", "-q")
    assert status == 0, out                         # the last step reads position 7
    _refused(generate(model, "--arch", "dlegion-tiny", "--prompt-ids", "1,2,3", "-n", 7, "-q"),
             "sequence 1, past 8:", "node 'table_gather' (Gather)", "the model's 8 positions")


def test_the_timing_model_gives_the_emulated_steps_cycles(tmp_path):
    """serve's numbers come from time_only: the same cycles as the emulated loop's, step by step;
    sampling every 3rd step interpolates the others between them."""
    from runtime.llm_metrics import sampled_pasts, serve
    machine = arch.load("dlegion-tiny")
    build = Build(cache_graph(BITNET), machine, "dlegion-tiny", tmp_path)
    emulated = emulate(build, [4, 5, 6, 7], 8, races=False)
    every = serve(build, 4, 8, every=1)
    assert every["prefill"]["cycles"] == emulated[0].cycles
    assert [s["cycles"] for s in every["decode_samples"]] == [s.cycles for s in emulated[1:]]
    seconds = [s.seconds for s in emulated]
    assert every["ttft_s"] == pytest.approx(seconds[0])
    assert every["tpot_s"] == pytest.approx(np.mean(seconds[1:]))
    assert every["tokens_per_s"] == pytest.approx(8 / sum(seconds))
    assert every["average_watts"] == pytest.approx(every["joules"] / sum(seconds))
    assert sampled_pasts(4, 8, 3) == [4, 7, 10]
    sampled = serve(build, 4, 8, every=3)
    assert sampled["decode_steps_timed"] == 3 and sampled["decode_steps"] == 7
    assert sampled["tpot_s"] == pytest.approx(every["tpot_s"], rel=0.02)


def test_timing_only_gives_the_generated_steps_cycles(generate, tmp_path):
    """--timing-only computes no value, yet each step's cycles are those of the full generation's
    step, and its serving numbers follow from them; --every times fewer steps."""
    args = (BITNET, "--arch", "dlegion-tiny", "--prompt-len", 5, "-n", 6, "-q")
    assert generate(*args, "--json", tmp_path / "full.json")[0] == 0
    status, out, _ = generate(*args, "--timing-only", "--json", tmp_path / "timed.json")
    assert status == 0, out
    full = json.loads((tmp_path / "full.json").read_text())
    timed = json.loads((tmp_path / "timed.json").read_text())
    cycles = [s["cycles"] for s in full["steps"]]
    assert [timed["prefill"]["cycles"]] + [s["cycles"] for s in timed["decode_samples"]] == cycles
    seconds = [s["seconds"] for s in full["steps"]]
    assert timed["ttft_s"] == pytest.approx(seconds[0]) and timed["tpot_s"] == pytest.approx(np.mean(seconds[1:]))
    assert f"TTFT {seconds[0] * 1e3:,.4g} ms, TPOT {np.mean(seconds[1:]) * 1e3:,.4g} ms" in out
    assert "generated" not in out and "5 of 5 decode steps timed" in out
    status, out, _ = generate(*args, "--timing-only", "--every", 3)
    assert status == 0 and "3 of 5 decode steps timed" in out         # pasts 5, 8 and the last, 9


def test_timing_only_refuses_what_needs_values(generate):
    status, _, lines = generate(BITNET, "--prompt-len", 3, "--timing-only", "--check")
    assert status == 2 and "--check needs values: it cannot go with --timing-only" in lines[0]
    status, _, lines = generate(BITNET, "--prompt-len", 3, "--every", 2)
    assert status == 2 and "--every needs --timing-only" in lines[0]


def test_timing_only_refuses_a_past_longer_than_the_positions_first(generate, tmp_path):
    model = _positions(tmp_path / "pos.onnx", rows=8)
    _refused(generate(model, "--arch", "dlegion-tiny", "--prompt-len", 3, "-n", 7, "--timing-only", "-q"),
             "sequence 1, past 8:", "node 'table_gather' (Gather)", "the model's 8 positions")
    assert not list((tmp_path / "build").glob("*.bin"))       # refused before any step was compiled


@pytest.mark.parametrize("form", ["genai_tiny_fp32", "genai_tiny_int4", "optimum_tiny_llama", "opset23_tiny_llama"])
def test_exporters_graphs_generate_onnxruntimes_tokens(generate, tmp_path, form):
    """Optimum's and onnxruntime-genai's graphs take an attention mask and positions besides the
    cache: the loop fills them (ones over past and new tokens; past .. past + sequence - 1)."""
    model = ROOT / "models" / "forms" / f"{form}.onnx"
    status, out, _ = generate(model, "--arch", "dlegion-tiny", "--prompt-len", 5, "-n", 16, "--check",
                              "--json", tmp_path / "g.json", "-q")
    assert status == 0, out
    record = json.loads((tmp_path / "g.json").read_text())
    assert record["tokens"] == onnxruntime_loop(cache_graph(model), record["prompt"], 16)
    assert len(set(record["tokens"])) > 1 and all(r["ok"] for r in record["check"])
    # the cache, mask and positions are right: one onnxruntime run of the whole text, no cache,
    # chooses the same tokens at every position
    import onnxruntime
    from runtime.generate import step_inputs
    graph = cache_graph(model)
    text = record["prompt"] + record["tokens"][:-1]
    logits = onnxruntime.InferenceSession(str(model)).run(["logits"], step_inputs(graph, text, graph.empty_past()))[0]
    assert logits[0, 4:].argmax(axis=-1).tolist() == record["tokens"]
