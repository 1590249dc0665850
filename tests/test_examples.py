"""The hand-written example programs assemble, run, and agree with numpy."""
from pathlib import Path

import numpy as np
import pytest

from isa import arch
from isa.asm import load
from isa.program import unpack
from runtime.emulator import random_inputs, run

EXAMPLES = Path(__file__).parent.parent / "examples"


def _const(program, name):
    t = program.tensors[program.tensor_index(name)]
    raw = np.frombuffer(program.const_bytes(t), dtype=np.uint8)
    if t.dtype in ("w2", "w4"):
        return unpack(raw, t.dtype, t.numel).reshape(t.shape).astype(np.int64)
    return raw.view(np.int8).reshape(t.shape).astype(np.int64)


def _run(name, seed=3):
    program = load(EXAMPLES / name)
    inputs = random_inputs(program, seed)
    return program, inputs, run(program, arch.load(program.arch), inputs)


@pytest.mark.parametrize("name", ["matmul_w2_multicast.s", "matmul_w8.s"])
def test_integer_matmul_examples_are_exact(name):
    program, inputs, result = _run(name)
    want = inputs["x"].astype(np.int64) @ _const(program, "w")
    np.testing.assert_array_equal(result.outputs["y"], want.astype(np.int32))


def test_multicast_example_reads_activations_once():
    program, _, result = _run("matmul_w2_multicast.s")
    c = result.timeline.counters
    x_bytes = 32 * 64
    assert c["multicast_saved_bytes"] == x_bytes          # one read served both Legions
    assert c["dram_read_bytes"] == x_bytes + 64 * 8       # activations once + all packed weights


def test_softmax_example_matches_numpy():
    _, inputs, result = _run("softmax.s")
    x = inputs["x"]
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(result.outputs["y"], e / e.sum(axis=1, keepdims=True), rtol=1e-6)


def test_example_data_files_are_reproducible(tmp_path, monkeypatch):
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_data", EXAMPLES / "make_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "HERE", tmp_path)
    mod.main()
    for f in tmp_path.iterdir():
        assert f.read_bytes() == (EXAMPLES / f.name).read_bytes()
