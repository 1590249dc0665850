"""Golden outputs: every committed BitNet model compiles, runs, and matches onnxruntime's output."""
from pathlib import Path

import numpy as np
import pytest

from isa import arch
from dlegion_cc.pipeline import Options, compile_model
from models.golden import read_npz, run as golden_run
from runtime.check import compare
from runtime.emulator import run

ROOT = Path(__file__).parent.parent
BITNET = ["bitnet_tiny_relu2", "bitnet_tiny_silu_mha", "bitnet_tiny_gqa", "bitnet_tiny_sparse"]


def _compile_and_run(name: str, machine: str):
    golden = read_npz(ROOT / "tests" / "golden" / f"{name}.npz")
    inputs = {"input_ids": golden["input_ids"]}
    dims = {"sequence": golden["input_ids"].shape[1]}
    graph, program = compile_model(ROOT / "models" / f"{name}.onnx", Options(arch.load(machine), dims, attention="fp32"))
    return graph, run(program, arch.load(machine), inputs), golden


@pytest.mark.parametrize("name", BITNET)
def test_bitnet_model_matches_golden(name):
    graph, result, golden = _compile_and_run(name, "dlegion-tiny")
    [row] = compare(result.outputs, {"logits": golden["logits"]})
    assert row.ok, f"{name}: relative L2 {row.rel_l2:.2e}"
    # Every BitLinear became a matmul on the systolic arrays in w2 mode.
    qmm = [n for n in graph.nodes if n.op == "QMatMul"]
    assert qmm and all(n.attrs["mode"] == "w2" for n in qmm)
    assert result.timeline.counters["macs"] > 0


def test_bitnet_on_the_design_point():
    _, result, golden = _compile_and_run("bitnet_tiny_gqa", "dlegion-8x8")
    [row] = compare(result.outputs, {"logits": golden["logits"]})
    assert row.ok
    assert result.timeline.counters["multicast_saved_bytes"] > 0



# --- a decode step with a key/value cache -------------------------------------------------------------

DECODE = "bitnet_tiny_decode"


def _decode_run(inputs: dict):
    """Compile the decode model for the shapes of ``inputs`` (sequence and cache length) and run it."""
    machine = arch.load("dlegion-tiny")
    dims = {"sequence": inputs["input_ids"].shape[1], "past_sequence_length": inputs["past_key_values.0.key"].shape[2]}
    _, program = compile_model(ROOT / "models" / f"{DECODE}.onnx", Options(machine, dims, attention="fp32"))
    return run(program, machine, inputs)


@pytest.mark.fp32
def test_decode_step_matches_golden():
    golden = read_npz(ROOT / "tests" / "golden" / f"{DECODE}.npz")
    inputs = {k: v for k, v in golden.items() if k == "input_ids" or k.startswith("past_key_values.")}
    outputs = {k: v for k, v in golden.items() if k not in inputs}
    assert inputs["past_key_values.0.key"].shape[2] > 0 and "present.1.value" in outputs
    result = _decode_run(inputs)
    rows = compare(result.outputs, outputs)
    assert all(row.ok for row in rows), [(row.name, row.rel_l2) for row in rows]
    # The present cache is the past one with the new token's keys/values after it, copied exactly.
    past = inputs["past_key_values.1.value"]
    np.testing.assert_array_equal(result.outputs["present.1.value"][:, :, :past.shape[2]], past)


@pytest.mark.fp32
def test_prefill_with_an_empty_cache_matches_onnxruntime():
    rng = np.random.default_rng(5)
    empty = np.zeros((1, 2, 0, 16), np.float32)
    inputs = {"input_ids": rng.integers(0, 256, (1, 5), dtype=np.int64)}
    inputs |= {f"past_key_values.{i}.{k}": empty for i in range(2) for k in ("key", "value")}
    expected = golden_run(ROOT / "models" / f"{DECODE}.onnx", inputs)
    rows = compare(_decode_run(inputs).outputs, expected)
    assert all(row.ok for row in rows), [(row.name, row.rel_l2) for row in rows]
