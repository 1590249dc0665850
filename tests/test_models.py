"""The model zoo: committed models are valid, goldens reproduce, generators are deterministic and shaped right."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from models import bitnet, build_all, golden, llama_quant, weights
from models.build_all import GOLDEN_DIR, MANIFEST, MODELS_DIR, ZOO
from models.torch_export import layer_op_counts

ENTRIES = {entry.name: entry for entry in ZOO}
BITNET_ZOO = [name for name in ENTRIES if name.startswith("bitnet")]


@pytest.fixture(scope="module")
def manifest():
    return json.loads((GOLDEN_DIR / MANIFEST).read_text())


def same_runtime(manifest) -> bool:
    import onnxruntime
    return manifest["onnxruntime"] == onnxruntime.__version__ and manifest["cpu"] == golden.machine()


def inits(model: onnx.ModelProto) -> dict:
    return {t.name: t for t in model.graph.initializer}


# --- committed models -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ENTRIES)
def test_committed_model_passes_checker(name):
    path = MODELS_DIR / ENTRIES[name].filename
    onnx.checker.check_model(str(path), full_check=True)  # a path lets the checker follow external data


@pytest.mark.parametrize("name", ENTRIES)
def test_committed_files_match_manifest(name, manifest):
    recorded = manifest["models"][name]
    assert sorted(recorded) == sorted(ENTRIES[name].files())
    for filename, digest in recorded.items():
        assert build_all.sha256(MODELS_DIR / filename) == digest, filename


def test_committed_models_stay_small():
    total = sum((MODELS_DIR / f).stat().st_size for e in ZOO for f in e.files())
    assert total < 5 * 2**20


def test_external_data_model_keeps_weights_outside():
    entry = ENTRIES["bitnet_tiny_gqa"]
    model = onnx.load(MODELS_DIR / entry.filename, load_external_data=False)
    outside = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert any(t.name.endswith("q_proj.weight_t") for t in outside)
    assert {kv.value for t in outside for kv in t.external_data if kv.key == "location"} == {entry.filename + ".data"}


# --- goldens ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ENTRIES)
def test_golden_matches_fresh_onnxruntime_run(name, manifest):
    entry = ENTRIES[name]
    path = MODELS_DIR / entry.filename
    model = onnx.load(path, load_external_data=False)
    stored = golden.read_npz(GOLDEN_DIR / f"{name}.npz")
    input_names = [v.name for v in model.graph.input]
    output_names = [v.name for v in model.graph.output]
    assert sorted(stored) == sorted(input_names + output_names)
    ids = stored["input_ids"]
    assert ids.dtype == np.int64 and ids.shape == (1, entry.seq) and 0 <= ids.min() and ids.max() < entry.vocab
    fresh = golden.run(path, {n: stored[n] for n in input_names})
    for out in output_names:
        if same_runtime(manifest):
            np.testing.assert_array_equal(fresh[out], stored[out], err_msg=f"{name}:{out}")
        else:  # another onnxruntime or CPU picks other kernels; only the last bits may move
            np.testing.assert_allclose(fresh[out], stored[out], rtol=1e-4, atol=1e-4, err_msg=f"{name}:{out}")


def test_golden_inputs_are_seeded():
    entry = ENTRIES["bitnet_tiny_relu2"]
    model = onnx.load(MODELS_DIR / entry.filename, load_external_data=False)
    again = golden.seeded_inputs(model, entry.seq, entry.vocab, entry.input_seed)
    stored = golden.read_npz(GOLDEN_DIR / "bitnet_tiny_relu2.npz")
    np.testing.assert_array_equal(again["input_ids"], stored["input_ids"])


def test_npz_writer_is_byte_stable(tmp_path):
    arrays = {"b": np.arange(6, dtype=np.int64).reshape(2, 3), "a": np.ones(4, np.float32)}
    golden.write_npz(tmp_path / "one.npz", arrays)
    golden.write_npz(tmp_path / "two.npz", dict(reversed(arrays.items())))
    assert (tmp_path / "one.npz").read_bytes() == (tmp_path / "two.npz").read_bytes()
    loaded = golden.read_npz(tmp_path / "one.npz")
    np.testing.assert_array_equal(loaded["b"], arrays["b"])


# --- determinism ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BITNET_ZOO)
def test_bitnet_generator_reproduces_committed_bytes(name, tmp_path, manifest):
    hashes = build_all.build(ENTRIES[name], tmp_path, tmp_path)
    assert hashes == manifest["models"][name]


LLAMA_ZOO = {"llama_tiny_dynamic_int8": "dynamic-int8", "llama_tiny_nbits4": "nbits4",
             "llama_tiny_qdq": "qdq", "llama_tiny_qdq_int4": "qdq-int4", "llama_tiny_decode": "dynamic-int8"}


def needs_quantizer(variant: str) -> None:
    if variant == "nbits4":  # onnxruntime's MatMulNBits quantizer imports onnx_ir, which it does not require
        pytest.importorskip("onnx_ir")


@pytest.mark.parametrize("variant", LLAMA_ZOO.values())
def test_quantized_llama_is_deterministic(variant):
    needs_quantizer(variant)
    config = llama_quant.LlamaConfig()
    one = llama_quant.build_quantized(config, variant).SerializeToString()
    assert one == llama_quant.build_quantized(config, variant).SerializeToString()


@pytest.mark.parametrize("name", LLAMA_ZOO)
def test_quantized_llama_reproduces_committed_bytes(name, tmp_path, manifest):
    if not same_runtime(manifest):
        pytest.skip("the quantizers of another onnxruntime may write other bytes")
    needs_quantizer(LLAMA_ZOO[name])
    assert build_all.build(ENTRIES[name], tmp_path, tmp_path) == manifest["models"][name]


def test_seed_changes_weights():
    one = inits(bitnet.build_bitnet(bitnet.preset("tiny", seed=0)))
    two = inits(bitnet.build_bitnet(bitnet.preset("tiny", seed=1)))
    name = "model.layers.0.mlp.up_proj.weight_t"
    assert one[name].raw_data != two[name].raw_data


def test_save_leaves_model_unchanged(tmp_path):
    model = bitnet.build_bitnet(bitnet.preset("tiny"))
    before = model.SerializeToString()
    bitnet.save(model, tmp_path / "m.onnx", external_data=True)
    assert model.SerializeToString() == before
    assert (tmp_path / "m.onnx.data").stat().st_size > 0


# --- real-shape presets -----------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["large", "3b", "2b4t"])
def real_shape(request):
    config = bitnet.preset(request.param, layers=1, seq=8, vocab=512)
    return config, bitnet.build_bitnet(config)


def expected_shapes(c: bitnet.BitNetConfig) -> dict:
    d = c.hidden // c.heads
    layer = "model.layers.0"
    shapes = {
        "model.embed_tokens.weight": [c.vocab, c.hidden],
        "lm_head.weight_t": [c.hidden, c.vocab],
        "model.norm.weight": [c.hidden],
        "causal_mask": [1, 1, c.seq, c.seq],
        "rotary_cos": [1, 1, c.seq, d],
        "rotary_sin": [1, 1, c.seq, d],
        f"{layer}.self_attn.q_proj.weight_t": [c.hidden, c.heads * d],
        f"{layer}.self_attn.k_proj.weight_t": [c.hidden, c.kv_heads * d],
        f"{layer}.self_attn.v_proj.weight_t": [c.hidden, c.kv_heads * d],
        f"{layer}.self_attn.o_proj.weight_t": [c.heads * d, c.hidden],
        f"{layer}.mlp.gate_proj.weight_t": [c.hidden, c.ffn],
        f"{layer}.mlp.up_proj.weight_t": [c.hidden, c.ffn],
        f"{layer}.mlp.down_proj.weight_t": [c.ffn, c.hidden],
        f"{layer}.self_attn.attn_sub_norm.weight": [c.hidden],
        f"{layer}.mlp.ffn_sub_norm.weight": [c.ffn],
        f"{layer}.input_layernorm.weight": [c.hidden],
        f"{layer}.post_attention_layernorm.weight": [c.hidden],
    }
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        shapes[f"{layer}.{proj}.weight_scale"] = [1]
    return shapes


def test_real_shape_initializers(real_shape):
    config, model = real_shape
    found = inits(model)
    for name, shape in expected_shapes(config).items():
        assert list(found[name].dims) == shape, name


def test_real_shape_weights_are_ternary_floats(real_shape):
    config, model = real_shape
    tensor = inits(model)["model.layers.0.self_attn.q_proj.weight_t"]
    assert tensor.data_type == onnx.TensorProto.FLOAT
    values, counts = np.unique(numpy_helper.to_array(tensor), return_counts=True)
    assert values.tolist() == [-1.0, 0.0, 1.0]
    assert abs(counts[1] / counts.sum() - weights.TERNARY_ZERO) < 0.01


def test_presets_have_published_shapes():
    shapes = [(p.hidden, p.heads, p.ffn) for p in (bitnet.PRESETS[n] for n in ("large", "3b", "2b4t"))]
    assert shapes == [(1536, 16, 4096), (3200, 32, 8640), (2560, 20, 6912)]
    assert bitnet.PRESETS["2b4t"].kv_heads == 5 and bitnet.PRESETS["2b4t"].act == "relu2"
    assert bitnet.PRESETS["3b"].hidden // bitnet.PRESETS["3b"].heads == 100


def test_real_shape_layer_matches_tiny_layer_ops():
    """The pattern does not depend on size: a 2B4T layer has the tiny relu2/GQA layer's ops."""
    big = layer_op_counts(bitnet.build_bitnet(bitnet.preset("2b4t", layers=1, seq=4, vocab=64, ffn=256)))
    tiny = layer_op_counts(bitnet.build_bitnet(bitnet.preset("tiny", layers=1, seq=4)))
    assert big == tiny


# --- block sparsity ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.9])
def test_block_sparsity_zeroes_requested_fraction(fraction):
    config = bitnet.preset("tiny", block_sparsity=fraction, block=16)
    model = bitnet.build_bitnet(config)
    projections = [t for t in model.graph.initializer if t.name.endswith(".weight_t") and "lm_head" not in t.name]
    assert len(projections) == 7 * config.layers
    for tensor in projections:
        w = numpy_helper.to_array(tensor)
        tiles = np.prod(weights.block_grid(w.shape, 16))
        assert weights.zero_block_fraction(w, 16) == round(fraction * tiles) / tiles, tensor.name


def test_block_sparsity_covers_partial_edge_blocks():
    rng = np.random.default_rng(0)
    w = weights.zero_blocks(rng, np.ones((20, 36), np.float32), 1.0, 8)
    assert not w.any()
    w = weights.zero_blocks(rng, np.ones((20, 36), np.float32), 0.5, 8)
    assert weights.zero_block_fraction(w, 8) == 8 / 15  # 3 x 5 tiles, round(7.5) = 8 zeroed


def test_no_block_sparsity_leaves_no_zero_block():
    model = bitnet.build_bitnet(bitnet.preset("tiny"))
    w = numpy_helper.to_array(inits(model)["model.layers.0.mlp.down_proj.weight_t"])
    assert weights.zero_block_fraction(w, 16) == 0.0


@pytest.mark.parametrize("fraction,block", [(-0.1, 16), (1.5, 16), (0.5, 0)])
def test_block_sparsity_rejects_bad_options(fraction, block):
    with pytest.raises(ValueError, match="block"):
        weights.zero_blocks(np.random.default_rng(0), np.ones((4, 4), np.float32), fraction, block)


# --- graph pattern ----------------------------------------------------------------------------------------

def layer_ops(model, layer=0):
    return [n.op_type for n in model.graph.node if n.name.startswith(f"model.layers.{layer}.")]


def test_bitlinear_pattern():
    model = bitnet.build_bitnet(bitnet.preset("tiny"))
    ops = layer_ops(model)
    quant = ["Abs", "ReduceMax", "Clip", "Reciprocal", "Mul", "Mul", "Round", "Clip", "Div", "MatMul", "Mul"]
    rms = ["Pow", "ReduceMean", "Add", "Sqrt", "Reciprocal", "Mul", "Mul"]
    assert ops[:len(rms + quant)] == rms + quant
    assert Counter(ops)["Round"] == 4  # one fake quantization per distinct input: qkv, o, gate/up, down
    assert Counter(ops)["MatMul"] == 7 + 2


@pytest.mark.parametrize("act,ops", [("relu2", ["Relu", "Pow"]), ("silu", ["Sigmoid", "Mul"])])
def test_activation_ops(act, ops):
    counts = Counter(layer_ops(bitnet.build_bitnet(bitnet.preset("tiny", act=act))))
    assert all(counts[op] >= 1 for op in ops)
    assert ("Relu" in counts) == (act == "relu2") and ("Sigmoid" in counts) == (act == "silu")


def test_mha_has_no_kv_expand():
    counts = Counter(layer_ops(bitnet.build_bitnet(bitnet.preset("tiny", kv_heads=4))))
    assert "Expand" not in counts
    assert Counter(layer_ops(bitnet.build_bitnet(bitnet.preset("tiny"))))["Expand"] == 2


def test_dynamic_sequence_runs_at_any_length(tmp_path):
    model = bitnet.build_bitnet(bitnet.preset("tiny", dynamic=True))
    assert model.graph.input[0].type.tensor_type.shape.dim[1].dim_param == "sequence"
    bitnet.save(model, tmp_path / "m.onnx", external_data=False)
    static = tmp_path / "s.onnx"
    for seq in (3, 8):
        bitnet.save(bitnet.build_bitnet(bitnet.preset("tiny", seq=seq)), static, external_data=False)
        ids = {"input_ids": np.random.default_rng(seq).integers(0, 256, (1, seq))}
        np.testing.assert_allclose(golden.run(tmp_path / "m.onnx", ids)["logits"],
                                   golden.run(static, ids)["logits"], rtol=1e-5, atol=1e-5)


def test_bad_config_names_the_culprit():
    with pytest.raises(ValueError, match="kv heads 3"):
        bitnet.build_bitnet(bitnet.preset("tiny", kv_heads=3))
    with pytest.raises(ValueError, match="preset 'huge'"):
        bitnet.preset("huge")


# --- quantized Llama --------------------------------------------------------------------------------------

def load_committed(name):
    return onnx.load(MODELS_DIR / ENTRIES[name].filename)


def test_dynamic_int8_uses_matmulinteger():
    counts = Counter(n.op_type for n in load_committed("llama_tiny_dynamic_int8").graph.node)
    assert counts["MatMulInteger"] == 15 and counts["DynamicQuantizeLinear"] >= 1 and counts["Cast"] >= 15
    assert counts["MatMul"] == 4  # attention stays float


def test_nbits4_uses_blockwise_matmulnbits():
    nodes = [n for n in load_committed("llama_tiny_nbits4").graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 15 and {n.domain for n in nodes} == {"com.microsoft"}
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["bits"] == 4 and attrs["block_size"] == llama_quant.NBITS_BLOCK


@pytest.mark.parametrize("name,dtype", [("llama_tiny_qdq", onnx.TensorProto.INT8),
                                        ("llama_tiny_qdq_int4", onnx.TensorProto.INT4)])
def test_qdq_weights(name, dtype):
    model = load_committed(name)
    found = inits(model)
    weight_dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in found
                 and found[n.input[0]].data_type == dtype]
    assert len(weight_dq) == 15
    scale = found[weight_dq[0].input[1]]
    assert len(scale.dims) == 1 and scale.dims[0] > 1  # per output channel
    assert Counter(n.op_type for n in model.graph.node)["MatMul"] == 19


def test_unknown_variant_is_rejected():
    with pytest.raises(ValueError, match="variant 'int3'"):
        llama_quant.build_quantized(llama_quant.LlamaConfig(), "int3")


# --- command lines ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [bitnet.main, llama_quant.main, build_all.main])
def test_cli_help(command):
    result = CliRunner().invoke(command, ["--help"])
    assert result.exit_code == 0 and "Usage" in result.output


def test_bitnet_cli_writes_what_the_api_builds(tmp_path):
    args = ["--preset", "tiny", "--layers", "1", "--block-sparsity", "0.5", "--external-data", str(tmp_path / "m.onnx")]
    result = CliRunner().invoke(bitnet.main, args)
    assert result.exit_code == 0, result.output
    bitnet.save(bitnet.build_bitnet(bitnet.preset("tiny", layers=1, block_sparsity=0.5)), tmp_path / "a.onnx", True)
    assert (tmp_path / "m.onnx.data").read_bytes() == (tmp_path / "a.onnx.data").read_bytes()


def test_build_all_rejects_unknown_name():
    result = CliRunner().invoke(build_all.main, ["--only", "nope"])
    assert result.exit_code != 0 and "nope" in result.output


def test_goldens_of_integer_models_do_not_depend_on_the_cpu(monkeypatch):
    """onnxruntime's default uint8 x int8 kernels saturate on CPUs without VNNI: goldens of models
    with integer operators come from the kernels that compute the definition on every CPU."""
    import runtime.check
    asked = []
    real = runtime.check.session
    monkeypatch.setattr(runtime.check, "session", lambda *a, **kw: asked.append(a[1]) or real(*a, **kw))
    for name in ("llama_tiny_dynamic_int8", "bitnet_tiny_relu2"):
        entry = ENTRIES[name]
        stored = golden.read_npz(GOLDEN_DIR / f"{name}.npz")
        golden.run(MODELS_DIR / entry.filename, {"input_ids": stored["input_ids"]})
    assert asked == ["exact", "onnxruntime"]
