"""``dlegion-cc --quantize w8|w4|w2``: a float model's matmuls on the arrays, judged by ``--check``
against the model quantized as the compiler quantizes it; the line saying where matmuls run."""
import dataclasses
import re
from functools import cache
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from isa import arch as arch_mod
from dlegion_cc.passes.quantize import BLOCK, quantized_weight
from dlegion_cc.pipeline import Options, compile_model
from models.llama_quant import LlamaConfig, build_llama
from runtime.check import flip_one_weight, judge
from runtime.emulator import random_inputs, run
from runtime.report import summarize

ROOT = Path(__file__).parent.parent
TINY = arch_mod.load("dlegion-tiny")
BITNET = ROOT / "models" / "bitnet_tiny_relu2.onnx"
MODES = ("w8", "w4", "w2")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A float Llama (every projection and the lm_head a float MatMul), from the models' helpers."""
    path = tmp_path_factory.mktemp("float") / "llama_float.onnx"
    onnx.save(build_llama(LlamaConfig()), str(path))
    return path


@cache
def compiled(path: Path, mode: str | None, attention: str | None = None, skip: tuple = ()):
    options = Options(TINY, quantize=mode, quantize_skip=skip, attention=attention)
    _, program = compile_model(path, options)
    return program, options.census, random_inputs(program, 0)


# --- the quantizers ------------------------------------------------------------------------

def test_each_mode_quantizes_as_documented():
    w = np.random.default_rng(0).normal(size=(70, 5)).astype(np.float32)
    codes, scales, block = quantized_weight(w, "w8")
    assert block == 0 and np.allclose(scales[0], np.abs(w).max(axis=0) / 127)
    assert np.abs(codes).max() == 127 and np.allclose(codes * scales, w, atol=scales.max() / 2 + 1e-7)
    codes, scales, block = quantized_weight(w, "w4")
    assert block == BLOCK and scales.shape == (3, 5) and codes.min() >= -7 and codes.max() <= 7
    assert np.allclose(scales[2], np.abs(w[64:]).max(axis=0) / 7)      # the last, partial block
    codes, scales, block = quantized_weight(w, "w2")
    assert np.allclose(scales, np.abs(w).mean()) and set(np.unique(codes)) == {-1, 0, 1}
    assert np.array_equal(codes, np.clip(np.rint(w / np.abs(w).mean()), -1, 1))


# --- on the arrays, judged by --check ------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_a_float_model_runs_on_the_arrays_passes_check_and_a_flipped_weight_fails(llama, mode):
    plain, _, inputs = compiled(llama, None, "fp32")
    before = summarize(run(plain, TINY, inputs))
    assert before["array_macs"] == 0
    program, census, _ = compiled(llama, mode, "fp32")
    assert f"quantized_{mode}" in program.approximations
    result = run(program, TINY, inputs)
    after = summarize(result)
    # every projection and the lm_head on the arrays in the mode (w8 for a machine without it)
    assert after["macs_by_mode"].get(mode, 0) > 0 and after["vector_macs"] < before["vector_macs"]
    good = judge(llama, inputs, result.outputs, program_approximations=program.approximations)
    [row] = good.rows
    assert good.ok and good.fp64 == "evaluated" and not row.within_tolerance, row
    assert row.fp64.ours < 1e-5 < row.fp64.approximation, row.fp64      # the program is its yardstick's
    data, which = flip_one_weight(program.data, program)
    bad_out = run(dataclasses.replace(program, data=data), TINY, inputs).outputs
    bad = judge(llama, inputs, bad_out, program_approximations=program.approximations)
    assert not bad.ok and bad.rows[0].fp64.ours > 2 * bad.rows[0].fp64.reference, which


def test_int8_attention_and_a_skipped_lm_head_are_measured_with_the_quantization(llama):
    """With the default attention (int8 once the projections are quantized) and the lm_head kept
    in float, the yardstick quantizes what the program quantized and nothing else."""
    program, census, inputs = compiled(llama, "w8", None, ("lm_head/MatMul",))
    assert {"int8_attention", "quantized_w8"} <= set(program.approximations)
    assert census.fp32 == {"lm_head/MatMul": "--quantize-skip"}
    good = judge(llama, inputs, run(program, TINY, inputs).outputs, program_approximations=program.approximations)
    assert good.ok and good.rows[0].fp64.ours < 1e-5, good.rows[0].fp64
    # judged as if the lm_head were quantized too, the same outputs are far from the yardstick
    unrecorded = {a: v for a, v in program.approximations.items() if a != "quantize_kept"}
    wrong = judge(llama, inputs, run(program, TINY, inputs).outputs, program_approximations=unrecorded)
    assert wrong.rows[0].fp64.ours > 1e-3


def gemm_model(path: Path, trans_b: int) -> Path:
    rng = np.random.default_rng(1)
    K, N = 40, 24
    w = rng.normal(size=(N, K) if trans_b else (K, N)).astype(np.float32)
    c = rng.normal(size=N).astype(np.float32)
    node = helper.make_node("Gemm", ["x", "w", "c"], ["y"], "proj", alpha=0.5, beta=2.0, transB=trans_b)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, N])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(c, "c")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_with_alpha_beta_and_transposed_weights(tmp_path, trans_b):
    path = gemm_model(tmp_path / "gemm.onnx", trans_b)
    program, census, inputs = compiled(path, "w4")
    assert census.arrays == {"proj": "w4"}
    out = run(program, TINY, inputs).outputs
    good = judge(path, inputs, out, program_approximations=program.approximations)
    assert good.ok and good.rows[0].fp64.ours < 1e-5, good.rows[0].fp64


# --- the line saying where the matmuls run -------------------------------------------------

LINE = re.compile(r"(\d+) of (\d+) matmuls on the arrays(?: \(([^)]*)\))?(?:; (\d+) in fp32 on the vector unit: (.*))?$")


def census_line(cc, *args) -> re.Match:
    status, lines = cc(*args)
    assert status == 0, lines
    m = LINE.match(lines[-1])
    assert m, lines
    return m


def test_the_line_for_a_bitnet_model(cc, tmp_path):
    """Every BitLinear projection in w2, the attention products in int8 (w8), the lm_head fp32."""
    projections = sum(n.op_type == "MatMul" for n in onnx.load(str(BITNET)).graph.node) - 1 - 4
    m = census_line(cc, BITNET, "-o", tmp_path / "a.s", "--arch", "dlegion-tiny")
    assert m.group(1, 2) == (str(projections + 4), str(projections + 5))
    assert m.group(3) == f"{projections} w2, 4 w8" and m.group(4) == "1"
    assert m.group(5) == "lm_head/MatMul (float weights)"
    m = census_line(cc, BITNET, "-o", tmp_path / "b.s", "--arch", "dlegion-tiny", "--attention", "fp32")
    assert m.group(3) == "w2" and m.group(4) == "5"
    assert m.group(5).endswith("(activation x activation), and 2 more")


def test_the_line_for_a_float_model_names_a_few_and_counts_the_rest(cc, tmp_path, llama):
    m = census_line(cc, llama, "-o", tmp_path / "a.s", "--arch", "dlegion-tiny")
    assert m.group(1, 2) == ("0", "19") and m.group(3) is None and m.group(4) == "19"
    assert m.group(5).count("(float weights)") == 3 and m.group(5).endswith(", and 16 more")
    m = census_line(cc, llama, "-o", tmp_path / "b.s", "--arch", "dlegion-tiny", "--quantize", "w4")
    assert m.group(0) == "19 of 19 matmuls on the arrays (15 w4, 4 w8)"


def test_the_line_for_a_mixed_model(cc, tmp_path, llama):
    """BitNet's projections stay w2; --quantize puts the lm_head on the arrays in w8."""
    m = census_line(cc, BITNET, "-o", tmp_path / "a.s", "--arch", "dlegion-tiny", "--quantize", "w8")
    assert m.group(0) == "19 of 19 matmuls on the arrays (14 w2, 5 w8)"
    m = census_line(cc, llama, "-o", tmp_path / "b.s", "--arch", "dlegion-tiny", "--quantize", "w2",
                    "--quantize-skip", "lm_head/MatMul", "--attention", "fp32")
    assert m.group(1, 3, 4) == ("14", "w2", "5")
    assert m.group(5).startswith("lm_head/MatMul (--quantize-skip)") and m.group(5).endswith(", and 2 more")


def test_quiet_leaves_the_line_out(cc, tmp_path):
    status, lines = cc(BITNET, "-o", tmp_path / "a.s", "--arch", "dlegion-tiny", "-q")
    assert status == 0 and len(lines) == 1 and "instructions" in lines[0]


# --- bad options -----------------------------------------------------------------------------

@pytest.mark.parametrize("args, says", [
    (("--quantize", "w3"), "Invalid value for '--quantize': 'w3' is not one of 'w8', 'w4', 'w2'"),
    (("--quantize-skip", "lm_head/MatMul"), "--quantize-skip needs --quantize"),
    (("--quantize", "w8", "--quantize-skip", "nope"), "--quantize-skip 'nope': no MatMul or Gemm of that name"),
])
def test_bad_quantize_options_are_refused(cc, tmp_path, args, says):
    status, lines = cc(BITNET, "-o", tmp_path / "a.s", "--arch", "dlegion-tiny", *args)
    assert status == 2 and any(says in line for line in lines), lines
    assert not (tmp_path / "a.s").exists()


def test_a_weight_holding_an_infinity_stays_fp32(tmp_path):
    """ONNX spreads an infinity; codes would lose it."""
    w = np.ones((8, 4), np.float32)
    w[3, 1] = np.inf
    node = helper.make_node("MatMul", ["x", "w"], ["y"], "proj")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                              [numpy_helper.from_array(w, "w")])
    path = tmp_path / "inf.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    program, census, _ = compiled(path, "w8")
    assert census.fp32 == {"proj": "float weights"} and "quantized_w8" not in program.approximations
