"""Golden outputs: every committed BitNet model compiles, runs, and matches onnxruntime's output."""
from pathlib import Path

import pytest

from isa import arch
from dlegion_cc.pipeline import Options, compile_model
from models.golden import read_npz
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

