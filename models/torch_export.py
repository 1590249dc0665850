"""The reference pattern: transformers' BitNet with offline AutoBitLinear, exported by
torch.onnx.export(dynamo=True, opset 20). Needs torch, transformers and onnxscript (imported lazily)."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import click
import numpy as np
import onnx
from onnx import numpy_helper

from models.bitnet import PRESETS, BitNetConfig, build_bitnet, preset

LAYER = re.compile(r"^model\.layers\.(\d+)(?:\.|/|$)")
SCOPES_KEY = "pkg.torch.onnx.name_scopes"


def hf_config(config: BitNetConfig):
    """The transformers BitNetConfig with the same shapes (eager attention, no KV cache)."""
    from transformers import BitNetConfig as HFBitNetConfig
    hf = HFBitNetConfig(
        vocab_size=config.vocab, hidden_size=config.hidden, intermediate_size=config.ffn,
        num_hidden_layers=config.layers, num_attention_heads=config.heads, num_key_value_heads=config.kv_heads,
        hidden_act=config.act, max_position_embeddings=max(config.seq, 128), rms_norm_eps=config.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta}, use_cache=False,
        bos_token_id=None, eos_token_id=None,
    )
    hf._attn_implementation = "eager"
    return hf


def offline_bitnet(config: BitNetConfig):
    """BitNetForCausalLM whose linear layers (not lm_head) are offline AutoBitLinear, as
    transformers' BitNet quantizer sets them up (linear_class="autobitlinear", quantization_mode="offline")."""
    import torch
    from transformers import BitNetForCausalLM
    from transformers.integrations.bitnet import replace_with_bitnet_linear
    from transformers.utils.quantization_config import BitNetQuantConfig

    quant = BitNetQuantConfig(linear_class="autobitlinear", quantization_mode="offline",
                              modules_to_not_convert=["lm_head"])
    model = BitNetForCausalLM(hf_config(config))
    replace_with_bitnet_linear(model, modules_to_not_convert=["lm_head"], quantization_config=quant)
    model.to_empty(device="cpu")  # the replaced layers were made on the meta device
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.compute_default_rope_parameters(model.config)[0]
    return model.eval().requires_grad_(False).to(torch.float32)


def copy_weights(torch_model, generated: onnx.ModelProto) -> None:
    """Load the generator's initializers into the torch model: ``*.weight_t`` are [in, out] transposes."""
    import torch
    state = {}
    for tensor in generated.graph.initializer:
        name, array = tensor.name, numpy_helper.to_array(tensor)
        if name.endswith(".weight_t"):
            state[name[:-2]] = torch.from_numpy(np.ascontiguousarray(array.T))
        elif name.endswith((".weight", ".weight_scale")):
            state[name] = torch.from_numpy(array.copy())
    missing = set(torch_model.state_dict()) - set(state)
    if missing:
        raise ValueError(f"generated model lacks {sorted(missing)[0]!r} (and {len(missing) - 1} more)")
    torch_model.load_state_dict(state, strict=False)


def export(config: BitNetConfig, path: str | Path, weights_from_generator: bool = True) -> Path:
    """Export the transformers model; input ``input_ids`` [1, seq] (symbolic when config.dynamic)."""
    import torch
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = offline_bitnet(config)
    if weights_from_generator:
        copy_weights(model, build_bitnet(config))
    ids = torch.zeros((1, config.seq), dtype=torch.int64)
    dynamic = ({1: torch.export.Dim("sequence", max=4096)},) if config.dynamic else None
    with torch.no_grad():
        torch.onnx.export(model, (ids,), str(path), dynamo=True, opset_version=20, external_data=True,
                          input_names=["input_ids"], output_names=["logits"], dynamic_shapes=dynamic)
    return path


def node_layer(node: onnx.NodeProto) -> int | None:
    """The decoder layer a node belongs to: from its name (generated graphs) or the exporter's name scopes."""
    match = LAYER.match(node.name)
    if match:
        return int(match.group(1))
    for prop in node.metadata_props:
        if prop.key == SCOPES_KEY:
            scopes = [s for s in prop.value.strip("[]").replace("'", "").split(", ") if LAYER.match(s)]
            return int(LAYER.match(scopes[0]).group(1)) if scopes else None
    return None


def layer_op_counts(model: onnx.ModelProto) -> dict:
    """Op-type multiset per decoder layer; key None holds the nodes outside any layer."""
    counts: dict = {}
    for node in model.graph.node:
        counts.setdefault(node_layer(node), Counter())[node.op_type] += 1
    return counts


@click.command(help="Export transformers' BitNet (offline AutoBitLinear) with torch and list one layer's ops.")
@click.option("--preset", "name", type=click.Choice(list(PRESETS)), default="tiny", show_default=True)
@click.option("--act", type=click.Choice(["relu2", "silu"]))
@click.option("--kv-heads", type=int)
@click.option("--layers", type=int)
@click.option("--seq", type=int, default=8, show_default=True)
@click.option("--vocab", type=int)
@click.option("--dynamic", is_flag=True)
@click.option("--layer", type=int, default=0, show_default=True, help="layer whose op sequence is printed")
@click.argument("output", type=click.Path(dir_okay=False))
def main(name, act, kv_heads, layers, seq, vocab, dynamic, layer, output):
    config = preset(name, act=act, kv_heads=kv_heads, layers=layers, seq=seq, vocab=vocab, dynamic=dynamic)
    model = onnx.load(str(export(config, output)), load_external_data=False)
    for node in model.graph.node:
        if node_layer(node) == layer:
            click.echo(f"{node.op_type:12s} {', '.join(node.input)} -> {', '.join(node.output)}")


if __name__ == "__main__":
    main()
