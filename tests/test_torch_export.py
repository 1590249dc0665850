"""The generator against the real thing: transformers' BitNet exported by torch.onnx.export(dynamo=True)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxscript")

from models import bitnet, golden  # noqa: E402
from models.torch_export import export, layer_op_counts  # noqa: E402

CONFIGS = {
    "relu2_gqa": dict(),
    "silu_mha": dict(act="silu", kv_heads=4),
    "silu_mqa_dynamic": dict(act="silu", kv_heads=1, dynamic=True),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(config, exported path, generated path) for one tiny configuration, the same weights in both."""
    config = bitnet.preset("tiny", **CONFIGS[request.param])
    work = tmp_path_factory.mktemp(request.param)
    exported = export(config, work / "torch.onnx")
    generated = work / "generated.onnx"
    bitnet.save(bitnet.build_bitnet(config), generated, external_data=True)
    return config, exported, generated


def test_layer_op_multisets_match(pair):
    config, exported, generated = pair
    theirs = layer_op_counts(onnx.load(exported, load_external_data=False))
    ours = layer_op_counts(onnx.load(generated, load_external_data=False))
    layers = list(range(config.layers))
    assert sorted(k for k in theirs if k is not None) == layers
    for layer in layers:
        assert ours[layer] == theirs[layer], f"layer {layer}"


def test_static_graphs_match_node_for_node(pair):
    config, exported, generated = pair
    if config.dynamic:
        pytest.skip("with a symbolic sequence the exporter's mask is transformers' vmapped one (PATTERNS.md)")
    theirs = [n.op_type for n in onnx.load(exported, load_external_data=False).graph.node]
    ours = [n.op_type for n in onnx.load(generated, load_external_data=False).graph.node]
    assert ours == theirs


def test_dynamic_prologue_differs_only_in_the_mask(pair):
    config, exported, generated = pair
    if not config.dynamic:
        pytest.skip("static graphs are compared node for node")
    theirs = layer_op_counts(onnx.load(exported, load_external_data=False))[None]
    ours = layer_op_counts(onnx.load(generated, load_external_data=False))[None]
    assert not ours - theirs  # everything we compute before layer 0 the exporter computes too
    assert {"GatherND", "CumSum"} <= set(theirs - ours)


def test_onnxruntime_runs_both_alike(pair):
    config, exported, generated = pair
    seq = config.seq + 3 if config.dynamic else config.seq
    ids = {"input_ids": np.random.default_rng(7).integers(0, config.vocab, (1, seq), dtype=np.int64)}
    theirs = golden.run(exported, ids)["logits"]
    ours = golden.run(generated, ids)["logits"]
    assert theirs.shape == ours.shape == (1, seq, config.vocab)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_dlegion_compiles_the_torch_export_and_matches(pair):
    """The real export, as users bring it, through dlegion-cc and the emulator."""
    from isa import arch
    from dlegion_cc.pipeline import Options, compile_model
    from runtime.check import compare, onnx_reference
    from runtime.emulator import random_inputs, run

    config, exported, _ = pair
    machine = arch.load("dlegion-tiny")
    graph, program = compile_model(exported, Options(machine, {"sequence": config.seq} if config.dynamic else {}))
    covered = sum(len(n.outputs) for n in graph.nodes if n.op == "QMatMul")
    assert covered == 7 * config.layers                                  # every BitLinear on the arrays
    inputs = random_inputs(program, 0)
    [row] = compare(run(program, machine, inputs).outputs, onnx_reference(exported, inputs))
    assert row.ok, f"relative L2 {row.rel_l2:.2e}"
