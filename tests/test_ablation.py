"""The ablation switches (--no-multicast, --no-accumulators, --no-sparsity, --no-fusion,
--no-prefetch): every combination compiles a tiny BitNet and a tiny int8 model that still match
onnxruntime, and each switch changes the program the way it says."""
import itertools
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from isa import arch
from isa.instructions import DmaLoad, MatMul
from dlegion_cc.pipeline import Options, compile_model
from models.bitnet import build_bitnet, preset, save
from runtime.check import compare, onnx_reference
from runtime.emulator import random_inputs, run

TINY = arch.load("dlegion-tiny")
SWITCHES = ("multicast", "accumulators", "sparsity", "fusion", "prefetch")
COMBOS = [dict(zip(SWITCHES, on)) for on in itertools.product((True, False), repeat=len(SWITCHES))]


def _int8_model(path):
    """Dynamic int8 activations (uint8, zero point) x int8 weights: an exact int32 product as
    one output, and the same product scaled and biased in fp32 as another."""
    rng = np.random.default_rng(0)
    w = rng.integers(-63, 64, (64, 40)).astype(np.int8)      # no int16 saturation in onnxruntime
    w[:32, :16] = 0                                          # some all-zero 8x8 blocks
    nodes = [helper.make_node("MatMulInteger", ["a", "w", "az"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["f", "scale"], ["g"]),
             helper.make_node("Add", ["g", "bias"], ["y"])]
    inits = [numpy_helper.from_array(w, "w"),
             numpy_helper.from_array(rng.uniform(0.01, 0.02, 40).astype(np.float32), "scale"),
             numpy_helper.from_array(rng.standard_normal(40).astype(np.float32), "bias")]
    g = helper.make_graph(nodes, "int8", [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, 6, 64]),
                                          helper.make_tensor_value_info("az", TensorProto.UINT8, [])],
                          [helper.make_tensor_value_info("acc", TensorProto.INT32, [1, 6, 40]),
                           helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 40])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]), path)
    return path, {"a": rng.integers(0, 256, (1, 6, 64)).astype(np.uint8), "az": np.array(131, np.uint8)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("ablation")
    bitnet = d / "bitnet.onnx"
    save(build_bitnet(preset("tiny", layers=1, seq=4, vocab=64, block_sparsity=0.5, block=16, seed=5)), bitnet, False)
    int8, int8_inputs = _int8_model(d / "int8.onnx")
    return {"bitnet": (bitnet, None), "int8": (int8, int8_inputs)}


def _build(path, combo):
    return compile_model(path, Options(TINY, **combo, attention="fp32"))[1]


@pytest.mark.parametrize("name", ["bitnet", "int8"])
def test_every_combination_matches_onnxruntime(models, name):
    path, inputs = models[name]
    ref = None
    for combo in COMBOS:
        program = _build(path, combo)
        feed = inputs if inputs is not None else random_inputs(program, 0)
        ref = ref if ref is not None else onnx_reference(path, feed)
        rows = compare(run(program, TINY, feed).outputs, ref)
        assert rows and all(r.ok for r in rows), (combo, rows)


def _mm(program):
    return [i for i in program.instrs if isinstance(i, MatMul)]


def test_each_switch_changes_the_program_as_it_says(models):
    path = models["bitnet"][0]
    base = _build(path, {})
    loads = lambda p: [i for i in p.instrs if isinstance(i, DmaLoad) and i.dst.space == "act"]
    assert any(len(i.dests) > 1 for i in loads(base))
    assert all(len(i.dests) == 1 for i in loads(_build(path, {"multicast": False})))
    assert {i.split for i in _mm(base)} == {"k"}
    assert {i.split for i in _mm(_build(path, {"accumulators": False}))} == {"n"}
    assert any(i.mask is not None for i in _mm(base))
    assert all(i.mask is None for i in _mm(_build(path, {"sparsity": False})))
    assert len(_build(path, {"fusion": False}).instrs) > len(base.instrs)
    entered = lambda p: len(p.regions) - len({name for _, name in p.regions})
    assert entered(base) > 0 and entered(_build(path, {"prefetch": False})) == 0


def test_command_line_flags(models, tmp_path):
    code = "import sys; from dlegion_cc.cli import main; sys.argv[0] = 'dlegion-cc'; main()"
    out = tmp_path / "p.s"
    flags = ["--no-multicast", "--no-accumulators", "--no-sparsity", "--no-fusion", "--no-prefetch"]
    r = subprocess.run([sys.executable, "-c", code, str(models["bitnet"][0]), "-o", str(out), "--arch",
                        "dlegion-tiny", *flags], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "split=n" in text and "split=k" not in text and "mask=@" not in text
    regions = [line.split(None, 1)[1] for line in text.splitlines() if line.startswith(".region")]
    assert regions and len(regions) == len(set(regions))          # no weights moved into a kernel
