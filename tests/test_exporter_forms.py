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
    seq, past = STEPS[step]
    assert outputs["logits"].shape == (1, seq, 64)
    assert outputs["present.0.key"].shape == (1, 2, past + seq, 16)


@pytest.mark.parametrize("name,step", CASES)
def test_present_keeps_the_past_exactly(name, step):
    """The cache's old rows are copied, not recomputed: present[:, :, :past] is the past bit for bit."""
    _, _, inputs, outputs = compiled(name, step)
    past = STEPS[step][1]
    for i in range(2):
        for kind in ("key", "value"):
            np.testing.assert_array_equal(outputs[f"present.{i}.{kind}"][:, :, :past],
                                          inputs[f"past_key_values.{i}.{kind}"])


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
        ref = stored("optimum_tiny_llama", step)["logits"]
        for name in ("genai_tiny_fp32", "opset23_tiny_llama"):
            got = stored(name, step)["logits"]
            assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref), (name, step)
