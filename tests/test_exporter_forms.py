"""Decoders with a key/value cache in other exporters' forms (models/exporter_forms.py): each
compiles for dlegion-tiny, as a prefill into an empty cache and as a decode step after one, and
matches onnxruntime; the committed models and goldens are what the generator makes."""
from __future__ import annotations

import json
from functools import cache

import numpy as np
import onnx
import pytest

from dlegion_cc.pipeline import Options, compile_model
from isa import arch
from models import exporter_forms as forms
from models import golden
from models.exporter_forms import FORMS, GOLDEN_DIR, MANIFEST, MODELS_DIR, STEPS
from runtime.check import judge, onnx_reference
from runtime.emulator import run

TINY = arch.load("dlegion-tiny")
CASES = [pytest.param(name, step, id=f"{name}-{step}") for name in FORMS for step in STEPS]


def path(name: str):
    return MODELS_DIR / f"{name}.onnx"


def stored(name: str, step: str) -> dict[str, np.ndarray]:
    return golden.read_npz(forms.golden_path(name, step))


@cache
def compiled(name: str, step: str):
    """The form compiled for the step's dims (attention's products in fp32, ONNX's semantics), run on
    the golden inputs."""
    graph, program = compile_model(path(name), Options(TINY, forms.dims(step), attention="fp32"))
    inputs = {v.name: stored(name, step)[v.name] for v in onnx.load(path(name)).graph.input}
    return graph, program, inputs, run(program, TINY, inputs).outputs


@pytest.mark.parametrize("name,step", CASES)
def test_form_matches_onnxruntime(name, step):
    """Float forms within the fp32 tolerance of onnxruntime (or of the float64 evaluation, as
    --check judges); the int4 form within the tolerance of the approximation its program records
    (int8 activation rows), against the kernels computing MatMulNBits' definition."""
    _, program, inputs, outputs = compiled(name, step)
    verdict = judge(path(name), inputs, outputs, program_approximations=program.approximations)
    names = {r.name for r in verdict.rows}
    assert names == {"logits"} | {f"present.{i}.{k}" for i in range(2) for k in ("key", "value")}
    assert verdict.ok, [r.as_json() for r in verdict.rows]
    seq, past, batch = STEPS[step]
    assert outputs["logits"].shape == (batch, seq, 64)
    assert outputs["present.0.key"].shape == (batch, 2, past + seq, 16)


@pytest.mark.parametrize("name,step", CASES)
def test_present_keeps_the_past_exactly(name, step):
    """The cache's old rows are copied, not recomputed: present[b, :, :kept] is the past bit for bit,
    kept the whole past where the form concatenates, and where GroupQueryAttention places the new
    token after each row's own past length (its attention mask's ones less the new tokens)."""
    _, _, inputs, outputs = compiled(name, step)
    seq, past, batch = STEPS[step]
    kept = inputs["attention_mask"].sum(axis=1) - seq if name.startswith("genai") else [past] * batch
    for i in range(2):
        for kind in ("key", "value"):
            for b, n in enumerate(kept):
                np.testing.assert_array_equal(outputs[f"present.{i}.{kind}"][b, :, :n],
                                              inputs[f"past_key_values.{i}.{kind}"][b, :, :n])


@pytest.mark.parametrize("step", STEPS)
def test_int4_is_within_its_recorded_approximation(step):
    """The int4 form against the kernels computing MatMulNBits' definition, within the bound --check
    gives the approximation its program records (the verdict itself: test_form_matches_onnxruntime)."""
    _, program, inputs, outputs = compiled("genai_tiny_int4", step)
    path_ = path("genai_tiny_int4")
    verdict = judge(path_, inputs, outputs, program_approximations=program.approximations)
    assert verdict.approximations and verdict.approximation_bound > 1e-4
    ref = onnx_reference(path_, inputs, "exact")
    for out, value in ref.items():
        err = np.linalg.norm(outputs[out].astype(np.float64) - value) / np.linalg.norm(value.astype(np.float64))
        assert err <= verdict.approximation_bound, (out, err)


@pytest.mark.parametrize("name,step", [c for c in CASES if c.values[1].endswith("_b2")])
def test_grouped_heads_are_not_copied_at_batch_2(name, step):
    """Grouped-query attention at batch 2 (GroupQueryAttention or transformers' repeat_kv): no
    product reads a key/value head repeated for its group (passes/gqa.py took every repeat)."""
    graph, _, _, _ = compiled(name, step)

    def repeated(value):
        node = graph.producer(value)
        while node is not None and node.op in ("Transpose", "Reshape"):
            node = graph.producer(node.inputs[0])
        return node is not None and node.op == "Expand"

    products = [n for n in graph.nodes if n.op == "MatMul"]
    assert len(products) >= 4       # at least the 2 attention products of each layer (int4: only those)
    assert not [n.name for n in products if any(repeated(i) for i in n.inputs)]


def test_int4_projections_run_on_the_arrays():
    graph, program, _, _ = compiled("genai_tiny_int4", "decode")
    ops = {n.op for n in graph.nodes}
    assert "QMatMul" in ops and "MatMulNBits" not in ops
    assert "int8_activations" in program.approximations


@pytest.mark.parametrize("name", FORMS)
def test_forms_use_their_exporters_operators(name):
    ops = {(n.domain or "", n.op_type) for n in onnx.load(path(name)).graph.node}
    expected = {
        "genai_tiny_fp32": {("", "SimplifiedLayerNormalization"), (forms.MS, "SkipSimplifiedLayerNormalization"),
                            (forms.MS, "RotaryEmbedding"), (forms.MS, "GroupQueryAttention")},
        "genai_tiny_int4": {(forms.MS, "MatMulNBits"), (forms.MS, "GroupQueryAttention"),
                            (forms.MS, "SkipSimplifiedLayerNormalization")},
        "optimum_tiny_llama": {("", "Pow"), ("", "ReduceMean"), ("", "Sqrt"), ("", "Div"), ("", "Concat"),
                               ("", "Gather"), ("", "Softmax")},
        "opset23_tiny_llama": {("", "RMSNormalization"), ("", "RotaryEmbedding"), ("", "Attention")},
    }[name]
    assert expected <= ops


# --- the committed files --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def manifest():
    return json.loads((GOLDEN_DIR / MANIFEST).read_text())


def same_runtime(manifest) -> bool:
    import onnxruntime
    return manifest["onnxruntime"] == onnxruntime.__version__ and manifest["cpu"] == golden.machine()


@pytest.mark.parametrize("name", FORMS)
def test_committed_model_is_the_generators(name, manifest):
    assert FORMS[name]().SerializeToString() == path(name).read_bytes()
    assert manifest["models"][name] == {f"{name}.onnx": forms.hashlib.sha256(path(name).read_bytes()).hexdigest()}
    assert path(name).stat().st_size < 300_000


@pytest.mark.parametrize("name,step", CASES)
def test_golden_matches_fresh_onnxruntime_run(name, step, manifest):
    model = onnx.load(path(name))
    data = stored(name, step)
    inputs = forms.step_inputs(model, step)
    assert sorted(data) == sorted(list(inputs) + [v.name for v in model.graph.output])
    for n, value in inputs.items():
        np.testing.assert_array_equal(data[n], value, err_msg=n)
    fresh = golden.run(path(name), inputs)
    for out, value in fresh.items():
        if same_runtime(manifest):
            np.testing.assert_array_equal(value, data[out], err_msg=f"{name}.{step}:{out}")
        else:
            np.testing.assert_allclose(value, data[out], rtol=1e-4, atol=1e-5, err_msg=f"{name}.{step}:{out}")


def test_float_forms_are_one_model():
    """The three float forms hold the same weights: their logits agree (so each is the decoder it
    claims to be, not only self-consistent)."""
    for step in STEPS:
        data = stored("optimum_tiny_llama", step)
        full = data["attention_mask"].all(axis=1)
        for name in ("genai_tiny_fp32", "opset23_tiny_llama"):
            # GroupQueryAttention reads a mask's zeros as a shorter past, not as padded positions
            rows = full if name.startswith("genai") else slice(None)
            ref, got = data["logits"][rows], stored(name, step)["logits"][rows]
            assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref), (name, step)


# --- GroupQueryAttention, a batch whose rows have their own past ------------------------------------------

def _gqa_batch(tmp_path, batch: int, seq: int, past: int):
    """One packed GroupQueryAttention node (4 query heads over 2 key/value heads of 16, rotary),
    ``batch`` rows, seqlens_k an input: each row's past length is read at run time."""
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper
    heads, kv, depth, total = 4, 2, 16, past + seq
    angles = np.outer(np.arange(32), 10000.0 ** (-np.arange(depth // 2) * 2 / depth))
    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "past_k", "past_v", "seqlens", "total", "cos", "sin"],
                            ["y", "present_k", "present_v"], domain=forms.MS, num_heads=heads, kv_num_heads=kv,
                            do_rotary=1)
    f = lambda n, s: helper.make_tensor_value_info(n, TP.FLOAT, s)  # noqa: E731
    inputs = [f("qkv", [batch, seq, (heads + 2 * kv) * depth]), f("past_k", [batch, kv, past, depth]),
              f("past_v", [batch, kv, past, depth]), helper.make_tensor_value_info("seqlens", TP.INT32, [batch])]
    outputs = [f("y", [batch, seq, heads * depth]), f("present_k", [batch, kv, total, depth]),
               f("present_v", [batch, kv, total, depth])]
    inits = [numpy_helper.from_array(np.array([total], np.int32), "total"),
             numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
             numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin")]
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(forms.MS, 1)])
    path_ = tmp_path / "gqa.onnx"
    onnx.save(model, path_)
    return path_, model


def test_group_query_attention_rows_of_a_batch_have_their_own_past(tmp_path):
    """Batch 3, the rows' pasts 8, 6 and 5 long in a cache of 8: the output and both presents
    (each row's new key at its own position, zeros after) match onnxruntime."""
    from runtime.check import compare
    seq, past = 1, 8
    path_, model = _gqa_batch(tmp_path, 3, seq, past)
    _, program = compile_model(path_, Options(TINY))
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in model.graph.input if i.name != "seqlens"}
    feeds["seqlens"] = np.array([past + seq - 1, past + seq - 3, past + seq - 4], np.int32)
    outputs = run(program, TINY, feeds).outputs
    rows = compare(outputs, onnx_reference(path_, feeds))
    assert len(rows) == 3 and all(r.ok for r in rows), rows
    assert not outputs["present_k"][2, :, past + seq - 3:].any() and outputs["present_k"][2, :, :past - 3].all()


def test_group_query_attention_batch_of_several_new_tokens_after_a_past_is_refused(tmp_path):
    """onnxruntime's kernel refuses it (batch_size must be 1 when sequence_length > 1 and past context
    is given): so does the compiler, naming the node."""
    from dlegion_cc.errors import CompileError
    path_, _ = _gqa_batch(tmp_path, 2, 3, 8)
    with pytest.raises(CompileError, match=r"\(GroupQueryAttention\): a batch of more than one row with more "
                                           r"than one new token after a past is not supported"):
        compile_model(path_, Options(TINY))


def test_a_past_longer_than_the_rotary_positions_is_refused_before_the_work():
    """GroupQueryAttention rotating at positions up to total_sequence_length - 1 with a 32-row
    cos cache: a total of 33 is refused when compiling (onnxruntime refuses it when run), 32 is not."""
    from dlegion_cc.errors import CompileError
    dims = lambda past: {forms.BATCH: 1, forms.SEQ: 1, forms.PAST: past, forms.TOTAL: past + 1}  # noqa: E731
    compile_model(path("genai_tiny_int4"), Options(TINY, dims(31)))
    with pytest.raises(CompileError, match=r"\(GroupQueryAttention\): total_sequence_length 33 is past the "
                                           r"model's 32 positions \(the rows of 'cos_cache'\)"):
        compile_model(path("genai_tiny_int4"), Options(TINY, dims(32)))
