"""Decoders with a key/value cache written by the exporters themselves (models/real/, made by
models/real_exports.py: torch.onnx dynamo of transformers' Llama and offline-AutoBitLinear BitNet,
Optimum's text-generation-with-past, onnxruntime-genai's builder at fp32 and int4): each compiles
for dlegion-tiny as a prefill (an empty past) and a decode step, matches onnxruntime, and
generates onnxruntime's 16 tokens. Also the fixes these graphs needed, each on its own."""
from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dlegion_cc.canon.gqa import cache_head_dims
from dlegion_cc.errors import CompileError
from dlegion_cc.pipeline import Options, compile_model
from isa import arch
from runtime.check import flip_one_weight, judge
from runtime.emulator import run
from runtime.generate import cache_graph, onnxruntime_loop

REAL = Path(__file__).parent.parent / "models" / "real"
TINY = arch.load("dlegion-tiny")
FORMS = ("torch_llama", "torch_bitnet", "optimum_llama", "genai_fp32", "genai_int4")
STEPS = {"prefill": (5, 0), "decode": (1, 5)}      # (new tokens, cached positions)
# census: (matmuls on the arrays, all matmuls) of the prefill, as dlegion-cc's last line says
ON_ARRAYS = {"torch_llama": (0, 19), "torch_bitnet": (16, 19), "optimum_llama": (0, 20),
             "genai_fp32": (0, 15), "genai_int4": (15, 15)}
FLOAT = {"torch_llama", "optimum_llama", "genai_fp32"}


def model(name: str) -> Path:
    return REAL / name / "model.onnx"


def step_inputs(name: str, seq: int, past: int) -> dict[str, np.ndarray]:
    """Seeded token ids and cache (not the model's own: any past must be carried), an all-ones
    mask and the positions after the past, in the types the graph declares."""
    rng = np.random.default_rng(seq * 100 + past)
    graph = onnx.load(model(name), load_external_data=False).graph
    shapes = cache_graph(model(name))
    out = {}
    for i in graph.input:
        dtype = helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        if i.name == "input_ids":
            out[i.name] = rng.integers(0, 256, (1, seq)).astype(dtype)
        elif i.name == "attention_mask":
            out[i.name] = np.ones((1, past + seq), dtype)
        elif i.name == "position_ids":
            out[i.name] = np.arange(past, past + seq).reshape(1, -1).astype(dtype)
        else:
            dims = shapes.dims(seq, past)
            out[i.name] = rng.standard_normal([dims.get(d, d) for d in shapes.inputs[i.name]]).astype(dtype)
    return out


@cache
def compiled(name: str, step: str):
    seq, past = STEPS[step]
    options = Options(TINY, cache_graph(model(name)).dims(seq, past))
    _, program = compile_model(model(name), options)
    inputs = step_inputs(name, seq, past)
    return options.census, program, inputs, run(program, TINY, inputs).outputs


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("name", FORMS)
def test_real_export_matches_onnxruntime(name, step):
    """Every output (logits and each layer's present key and value) within the tolerance of
    onnxruntime, or of the float64 evaluation with the approximations the program records;
    the float graphs within 1e-4 of onnxruntime's logits outright."""
    _, program, inputs, outputs = compiled(name, step)
    verdict = judge(model(name), inputs, outputs, program_approximations=program.approximations)
    rows = {r.name: r for r in verdict.rows}
    assert set(rows) == {"logits"} | {f"present.{i}.{k}" for i in range(2) for k in ("key", "value")}
    assert verdict.ok, [r.as_json() for r in verdict.rows]
    seq, past = STEPS[step]
    assert outputs["logits"].shape == (1, seq, 256)
    assert outputs["present.0.key"].shape == (1, 2, past + seq, 16)
    if name in FLOAT:
        assert not program.approximations and rows["logits"].rel_l2 <= 1e-4


@pytest.mark.parametrize("name", FORMS)
def test_census_of_real_exports(name):
    """Where the matmuls run: the float exports none on the arrays (--quantize is the way there),
    offline AutoBitLinear's projections and MatMulNBits on them."""
    census, *_ = compiled(name, "prefill")
    on_arrays, total = ON_ARRAYS[name]
    assert (len(census.arrays), len(census.arrays) + len(census.fp32)) == (on_arrays, total), census.line()
    assert census.line().startswith(f"{on_arrays} of {total} matmuls on the arrays")


@pytest.fixture
def generate(console, tmp_path):
    from runtime import generate_cli
    script = console(generate_cli.main, "dlegion-generate")
    return lambda *args: script(*args, "--build-dir", tmp_path / "build")


@pytest.mark.parametrize("name", FORMS)
def test_real_export_generates_onnxruntimes_tokens(generate, tmp_path, name):
    """16 tokens after a prompt of 5, each step checked, the tokens those of onnxruntime's loop."""
    status, out, _ = generate(model(name), "--arch", "dlegion-tiny", "--prompt-len", 5, "-n", 16, "--check",
                              "--json", tmp_path / "g.json", "-q")
    assert status == 0, out
    record = json.loads((tmp_path / "g.json").read_text())
    assert record["tokens"] == onnxruntime_loop(cache_graph(model(name)), record["prompt"], 16)
    assert len(set(record["tokens"])) > 1
    assert all(r["ok"] for r in record["check"])


# --- float exports quantized onto the arrays (dlegion-cc --quantize) ------------------------------

# (matmuls on the arrays, all) of the prefill: the projections and lm_head; Optimum's rotary
# inv_freq x positions product and the attention products of fewer rows than an array stay fp32
# (GroupQueryAttention's, rewritten into plain ops, have as many rows as the array: in int8).
QUANTIZED_ON_ARRAYS = {"torch_llama": (17, 19), "optimum_llama": (15, 20), "genai_fp32": (15, 15)}


@cache
def quantized(name: str, mode: str, step: str = "prefill", attention: str | None = None):
    """The ``step`` quantized to ``mode``, with ``attention`` (default: int8 where the compiler
    puts the products on the arrays)."""
    seq, past = STEPS[step]
    options = Options(TINY, cache_graph(model(name)).dims(seq, past), quantize=mode, attention=attention)
    _, program = compile_model(model(name), options)
    inputs = step_inputs(name, seq, past)
    return options.census, program, inputs, run(program, TINY, inputs).outputs


@pytest.mark.parametrize("mode", ["w8", "w4", "w2"])
@pytest.mark.parametrize("name", sorted(FLOAT))
def test_float_export_quantized_onto_the_arrays(name, mode):
    """--quantize puts the float exports' projections and lm_head on the arrays in ``mode``;
    every output is at fp32's distance from the float64 evaluation of the model quantized as
    the compiler quantized it (so --check passes on that), and within the tolerance --check
    prints for the approximations the program records. (Top-1 is not asserted: the random
    model's logits lie closer together than w8 moves them; 4 or 5 of 5 agree.)"""
    from runtime.check import approximation_tolerance
    census, program, inputs, outputs = quantized(name, mode)
    on_arrays, total = QUANTIZED_ON_ARRAYS[name]
    assert census.line().startswith(f"{on_arrays} of {total} matmuls on the arrays"), census.line()
    assert mode in set(census.arrays.values()) and f"quantized_{mode}" in program.approximations
    verdict = judge(model(name), inputs, outputs, program_approximations=program.approximations)
    assert verdict.fp64 == "evaluated" and verdict.ok, [r.as_json() for r in verdict.rows]
    tolerance = approximation_tolerance(list(program.approximations))
    for row in verdict.rows:
        assert row.fp64.ours < 1e-5 and row.rel_l2 <= tolerance, row.as_json()
    logits = {r.name: r for r in verdict.rows}["logits"]
    assert logits.rel_l2 > 1e-3          # the quantization is there


@pytest.mark.parametrize("mode", ["w8", "w4", "w2"])
@pytest.mark.parametrize("step", STEPS)
def test_genai_int8_attention_is_measured_with_its_products_quantized(step, mode):
    """onnxruntime-genai's fp32 export in ``mode`` with int8 attention (the prefill's default; the
    decode step's single query row asks for --attention int8): the yardstick rewrites each
    GroupQueryAttention as the compiler did and quantizes the products the program names, so a
    correct program is at fp32's distance from it, and one with a weight flipped fails. Judged
    without the attention's quantization (as the yardstick once did), the same outputs stand
    2e-2 away in w8."""
    census, program, inputs, outputs = quantized("genai_fp32", mode, step, None if step == "prefill" else "int8")
    assert len(program.approximations["int8_attention"]) == 4 and not census.fp32, census.line()
    good = judge(model("genai_fp32"), inputs, outputs, program_approximations=program.approximations)
    assert good.fp64 == "evaluated" and good.ok, [r.as_json() for r in good.rows]
    for row in good.rows:
        assert row.fp64.ours < 1e-5 < row.fp64.approximation, row.as_json()
    data, which = flip_one_weight(program.data, program)
    bad_out = run(dataclasses.replace(program, data=data), TINY, inputs).outputs
    bad = judge(model("genai_fp32"), inputs, bad_out, program_approximations=program.approximations)
    logits = {r.name: r for r in bad.rows}["logits"]
    assert not bad.ok and logits.fp64.ours > 2 * logits.fp64.reference, (which, logits.as_json())
    if mode == "w8":
        weights_only = {a: v for a, v in program.approximations.items() if a != "int8_attention"}
        blind = judge(model("genai_fp32"), inputs, outputs, program_approximations=weights_only)
        assert {r.name: r for r in blind.rows}["logits"].fp64.ours > 1e-2


def test_an_attention_product_the_yardstick_cannot_find_is_reported():
    """A recorded int8 product that is no MatMul of the model, even once its GroupQueryAttention
    is rewritten: the float64 evaluation says so instead of leaving the product unquantized."""
    _, program, inputs, outputs = quantized("genai_fp32", "w8")
    approximations = {**program.approximations, "int8_attention": ["/model/layers.0/attn/Elsewhere/MatMul_out"]}
    verdict = judge(model("genai_fp32"), inputs, outputs, program_approximations=approximations)
    assert verdict.fp64.startswith("failed (the program's int8 attention products "
                                   "/model/layers.0/attn/Elsewhere/MatMul_out are no MatMul"), verdict.fp64


def test_an_integer_attention_mask_takes_ones_as_random_input():
    """dlegion-run's random inputs give an integer attention mask ones (one unpadded sequence):
    onnxruntime-genai's graph counts them into GroupQueryAttention's seqlens_k, which random
    integers make invalid (onnxruntime refused the check). Token ids stay within the vocabulary."""
    from runtime.emulator import random_inputs
    _, program, _, _ = compiled("genai_fp32", "prefill")
    inputs = random_inputs(program, 0)
    assert (inputs["attention_mask"] == 1).all() and inputs["input_ids"].max() < 256
    verdict = judge(model("genai_fp32"), inputs, run(program, TINY, inputs).outputs)
    assert verdict.ok, [r.as_json() for r in verdict.rows]


# --- the fixes, each on its own -------------------------------------------------------------------

def _past_dim_per_layer(folder: Path) -> Path:
    """torch.onnx's export without named dims: layer 1's cache gets a past symbol of its own."""
    import shutil
    shutil.copy(model("torch_llama").with_suffix(".onnx.data"), folder / "model.onnx.data")
    graph_model = onnx.load(model("torch_llama"), load_external_data=False)
    for value in [*graph_model.graph.input, *graph_model.graph.output]:
        if ".1." in value.name:
            dim = value.type.tensor_type.shape.dim[2]
            dim.dim_param = dim.dim_param.replace("past_sequence_length", "s7")
    onnx.save(graph_model, folder / "model.onnx")
    return folder / "model.onnx"


def test_every_layers_past_symbol_is_bound(generate, tmp_path):
    """Each layer's own past symbol gets the past length, so the loop (ours and onnxruntime's)
    starts from an empty cache in every layer and generates onnxruntime's tokens."""
    path = _past_dim_per_layer(tmp_path)
    graph = cache_graph(path)
    assert graph.dims(1, 5)["s7"] == graph.dims(1, 5)["past_sequence_length"] == 5
    status, out, _ = generate(path, "--arch", "dlegion-tiny", "--prompt-len", 5, "-n", 4, "--check",
                              "--json", tmp_path / "g.json", "-q")
    assert status == 0, out
    record = json.loads((tmp_path / "g.json").read_text())
    assert record["tokens"] == onnxruntime_loop(graph, record["prompt"], 4)


def test_a_sum_of_dims_is_computed():
    """Optimum names the mask's length 'past_sequence_length + sequence_length': binding its
    terms binds it; a size given for it that contradicts them is refused."""
    path = model("optimum_llama")
    dims = {"batch_size": 1, "sequence_length": 1, "past_sequence_length": 5}
    graph, _ = compile_model(path, Options(TINY, dims))
    assert graph.values["attention_mask"].shape == (1, 6)
    with pytest.raises(CompileError, match=r"'past_sequence_length \+ sequence_length' is bound to 7, "
                                           r"but its terms give 6"):
        compile_model(path, Options(TINY, dims | {"past_sequence_length + sequence_length": 7}))


@pytest.mark.parametrize("name", FORMS)
def test_an_unbound_cache_says_which_dim_to_give(name):
    """Every dim but the cache's past bound: the one error names the past dim of the cache's
    inputs and the --dim to give, not a mask length Optimum computes from it."""
    dims = {d: n for d, n in cache_graph(model(name)).dims(1, 5).items() if d != "past_sequence_length"
            and "+" not in d}
    with pytest.raises(CompileError) as e:
        compile_model(model(name), Options(TINY, dims))
    assert "'past_sequence_length' of inputs 'past_key_values.0.key'" in str(e.value)
    assert str(e.value).endswith("pass --dim past_sequence_length=N or --inputs")


def test_genai_past_beyond_its_rotary_table_is_refused():
    """onnxruntime-genai's cos/sin cache has the model's 128 positions: a step reaching
    position 128 is refused (each layer's attention named), one ending at 127 compiles."""
    graph = cache_graph(model("genai_fp32"))
    with pytest.raises(CompileError, match=r"\(GroupQueryAttention\): total_sequence_length 129 is past "
                                           r"the model's 128 positions \(the rows of 'cos_cache'\)"):
        compile_model(model("genai_fp32"), Options(TINY, graph.dims(1, 128)))
    compile_model(model("genai_fp32"), Options(TINY, graph.dims(1, 127)))


def test_genai_cache_head_size_is_read_from_the_graph():
    """onnxruntime-genai names the cache's head size 'kv_cache_dim': it is the packed QKV
    projection's width over the heads (64 + 2 * 32 over 4 + 2 * 2), for MatMul and MatMulNBits."""
    for name in ("genai_fp32", "genai_int4"):
        assert cache_head_dims(onnx.load(model(name), load_external_data=False)) == {"kv_cache_dim": 16}
        assert cache_graph(model(name)).dims(1, 5)["kv_cache_dim"] == 16
    assert cache_head_dims(onnx.load(model("optimum_llama"), load_external_data=False)) == {}


@pytest.mark.parametrize("step", STEPS)
def test_genai_int4_is_measured_from_matmul_nbits_definition(step):
    """MatMulNBits without zero points at accuracy_level 4: the float64 yardstick dequantizes by
    the definition (zero point 8), so onnxruntime (int8 activations per block) is near it, and
    the program with fp32 attention (int8 activations per row, which the yardstick models) is at
    fp32's distance from it: it passes on that, not only by being no farther than onnxruntime.
    The yardstick once ran onnxruntime's own kernel and stood 29x the logits' norm away from both."""
    seq, past = STEPS[step]
    options = Options(TINY, cache_graph(model("genai_int4")).dims(seq, past), attention="fp32")
    _, program = compile_model(model("genai_int4"), options)
    assert set(program.approximations) == {"int8_activations"}
    inputs = step_inputs("genai_int4", seq, past)
    verdict = judge(model("genai_int4"), inputs, run(program, TINY, inputs).outputs,
                    program_approximations=program.approximations)
    assert verdict.fp64 == "evaluated"
    for row in verdict.rows:
        assert row.ok and row.fp64.ours < 1e-6, row.as_json()
        assert 1e-4 < row.fp64.reference < 3e-2 and row.fp64.approximation < 3e-2, row.as_json()


def test_genai_prompt_past_64_positions_compiles():
    """A GroupQueryAttention prompt of 100 tokens: its causal mask (100 x 100 fp32) is a lazy
    constant, whose stub onnxruntime's shape inference read as elements ("cannot reshape array
    of size 0"): shown to it as an input now, the prefill compiles and matches onnxruntime."""
    path = model("genai_fp32")
    options = Options(TINY, cache_graph(path).dims(100, 0))
    _, program = compile_model(path, options)
    inputs = step_inputs("genai_fp32", 100, 0)
    verdict = judge(path, inputs, run(program, TINY, inputs).outputs)
    assert verdict.ok and {r.name: r for r in verdict.rows}["logits"].rel_l2 < 1e-4, [r.as_json() for r in verdict.rows]


def _mask_beside_scores() -> onnx.ModelProto:
    """torch.onnx's attention: the scaled keys [1, 4, 16, 6] and, next in the graph, the mask
    [1, 1, 1, 6] made with Where: a row-local run whose second output is broadcast over the rows."""
    keys = helper.make_tensor_value_info("keys", TensorProto.FLOAT, [1, 4, 16, 6])
    allowed = helper.make_tensor_value_info("allowed", TensorProto.BOOL, [1, 1, 1, 6])
    nodes = [helper.make_node("Mul", ["keys", "half"], ["scaled"]),
             helper.make_node("Where", ["allowed", "zero", "lowest"], ["mask"]),
             helper.make_node("Add", ["scaled", "mask"], ["out"])]
    consts = [numpy_helper.from_array(np.float32(v), n) for n, v in (("half", 0.5), ("zero", 0.0), ("lowest", -1e30))]
    graph = helper.make_graph(nodes, "g", [keys, allowed],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, 16, 6]),
                               helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 1, 1, 6])], consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_row_broadcast_output_is_not_fused_into_the_frame(tmp_path):
    """A value broadcast over a row kernel's frame is not one of its outputs (the kernel would
    store it with row stride 0): the Where starts its own kernel, and the program matches."""
    path = tmp_path / "m.onnx"
    onnx.save(_mask_beside_scores(), path)
    _, program = compile_model(path, Options(TINY, {}))
    rng = np.random.default_rng(0)
    inputs = {"keys": rng.standard_normal((1, 4, 16, 6)).astype(np.float32),
              "allowed": np.array([True, True, False, True, False, True]).reshape(1, 1, 1, 6)}
    outputs = run(program, TINY, inputs).outputs
    verdict = judge(path, inputs, outputs)
    assert verdict.ok, [r.as_json() for r in verdict.rows]


def test_matmul_nbits_yardstick_is_its_definition():
    """The float64 evaluation multiplies by MatMulNBits' dequantized weights (onnxruntime's kernel
    gave zeros behind a Cast of its scales): at a decode step, where the program's only
    approximation is the int8 activations the yardstick models, the program is within float32's
    rounding of it, and onnxruntime (which quantizes activations per block) near it."""
    _, program, inputs, outputs = compiled("genai_int4", "decode")
    verdict = judge(model("genai_int4"), inputs, outputs, program_approximations=program.approximations)
    for row in verdict.rows:
        fp64 = row.as_json()["fp64"]
        assert fp64["rel_l2_dlegion"] < 1e-6, (row.name, fp64)
        assert fp64["rel_l2_onnxruntime"] < 3e-2, (row.name, fp64)
