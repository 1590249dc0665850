"""BitNet b1.58 decoders as torch.onnx.export writes transformers' BitNet with offline AutoBitLinear:
ternary float {-1,0,1} weights, a per-tensor weight_scale, activations fake-quantized per token."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import click
import numpy as np
import onnx

from models.decoder import DecoderSpec, build_decoder
from models.graph import GraphBuilder
from models.weights import ternary, ternary_scale, zero_blocks

ACT_QMAX = 127.0  # symmetric 8-bit per-token activation range [-128, 127]
ACT_QMIN = -128.0
ACT_FLOOR = 1e-5  # the clamp on the per-token absmax
EXTERNAL_THRESHOLD = 1024  # bytes: smaller tensors stay inside the .onnx file


@dataclass(frozen=True)
class BitNetConfig:
    """A BitNet decoder: real shapes come from PRESETS; block sparsity zeroes whole weight tiles."""

    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    layers: int
    vocab: int
    act: str
    seq: int = 8
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    dynamic: bool = False
    seed: int = 0
    block_sparsity: float = 0.0
    block: int = 16

    def spec(self) -> DecoderSpec:
        return DecoderSpec(
            hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads, ffn=self.ffn, layers=self.layers,
            vocab=self.vocab, seq=self.seq, act=self.act, sub_norm=True, dynamic=self.dynamic,
            rms_eps=self.rms_eps, rope_theta=self.rope_theta,
        )


PRESETS = {
    "tiny": BitNetConfig(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2, vocab=256, act="relu2"),
    # 1bitLLM/bitnet_b1_58-large: Llama shapes, SiLU
    "large": BitNetConfig(hidden=1536, heads=16, kv_heads=16, ffn=4096, layers=24, vocab=32002, act="silu"),
    # 1bitLLM/bitnet_b1_58-3B: head dim 100
    "3b": BitNetConfig(hidden=3200, heads=32, kv_heads=32, ffn=8640, layers=26, vocab=32002, act="silu"),
    # microsoft/bitnet-b1.58-2B-4T: GQA 20/5, squared ReLU, rope theta 500000
    "2b4t": BitNetConfig(hidden=2560, heads=20, kv_heads=5, ffn=6912, layers=30, vocab=128256, act="relu2",
                         rope_theta=500000.0),
}


def preset(name: str, **overrides) -> BitNetConfig:
    """A preset with some fields replaced; ``None`` overrides keep the preset's value."""
    if name not in PRESETS:
        raise ValueError(f"unknown BitNet preset {name!r}; known: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


@dataclass
class BitLinear:
    """AutoBitLinear (offline): y = MatMul(fake_quant(x), W^T) * weight_scale."""

    config: BitNetConfig
    rng: np.random.Generator

    def prepare(self, b: GraphBuilder, x: str) -> str:
        """Per-token absmax fake quantization: s = 127/clip(max|x|, 1e-5); clip(round(x*s), -128, 127)/s."""
        absmax = b.op("ReduceMax", b.op("Abs", x), b.const([-1]), keepdims=1, noop_with_empty_axes=0)
        scale = b.op("Mul", b.op("Reciprocal", b.op("Clip", absmax, b.f32(ACT_FLOOR))), b.f32(ACT_QMAX))
        rounded = b.op("Round", b.op("Mul", x, scale))
        return b.op("Div", b.op("Clip", rounded, b.f32(ACT_QMIN), b.f32(ACT_QMAX)), scale)

    def project(self, b: GraphBuilder, x: str, name: str, fan_in: int, fan_out: int) -> str:
        with b.scoped(name):
            w = b.weight(f"{b.prefix()}.weight_t", self.weight(fan_in, fan_out))
            s = b.weight(f"{b.prefix()}.weight_scale", ternary_scale(self.rng, fan_in))
            return b.op("Mul", b.op("MatMul", x, w), s)

    def weight(self, fan_in: int, fan_out: int) -> np.ndarray:
        """The ternary weight as MatMul's B operand [in, out] (the exporter folds the transpose)."""
        w = ternary(self.rng, fan_in, fan_out)
        if self.config.block_sparsity == 0.0:
            return w
        return zero_blocks(self.rng, w, self.config.block_sparsity, self.config.block)


def build_bitnet(config: BitNetConfig) -> onnx.ModelProto:
    """The whole decoder; the same config and seed give the same bytes."""
    rng = np.random.default_rng(config.seed)
    return build_decoder(config.spec(), BitLinear(config, rng), rng)


def save(model: onnx.ModelProto, path: str | Path, external_data: bool) -> None:
    """Write ``path``; with external data every tensor of 1 KiB or more goes to ``<name>.data`` beside it.

    The model is written as it stands (no proto copy: real-shape models hold gigabytes); onnx moves the
    tensor bytes out while writing, so they are read back afterwards to leave ``model`` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not external_data:
        if model.ByteSize() >= 2**31:
            raise ValueError(f"{path.name}: the model exceeds 2 GiB; save it with external data")
        onnx.save_model(model, str(path))
        return
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=EXTERNAL_THRESHOLD, convert_attribute=False)
    onnx.load_external_data_for_model(model, str(path.parent))
    for tensor in model.graph.initializer:
        tensor.ClearField("data_location")  # loading sets it to DEFAULT explicitly, which changes the bytes


@click.command(help="Generate a BitNet b1.58 decoder ONNX graph in torch.onnx.export's pattern.")
@click.option("--preset", "name", type=click.Choice(list(PRESETS)), default="tiny", show_default=True)
@click.option("--layers", type=int, help="decoder layers (default: the preset's)")
@click.option("--seq", type=int, default=8, show_default=True, help="sequence length of input_ids")
@click.option("--vocab", type=int, help="vocabulary size (default: the preset's)")
@click.option("--act", type=click.Choice(["relu2", "silu"]), help="MLP activation (default: the preset's)")
@click.option("--kv-heads", type=int, help="key/value heads (default: the preset's)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dynamic", is_flag=True, help="symbolic sequence dimension 'sequence'")
@click.option("--block-sparsity", type=float, default=0.0, show_default=True, help="fraction of zero weight blocks")
@click.option("--block", type=int, default=16, show_default=True, help="block edge for --block-sparsity")
@click.option("--external-data/--no-external-data", default=False, show_default=True)
@click.argument("output", type=click.Path(dir_okay=False))
def main(name, layers, seq, vocab, act, kv_heads, seed, dynamic, block_sparsity, block, external_data, output):
    config = preset(name, layers=layers, seq=seq, vocab=vocab, act=act, kv_heads=kv_heads, seed=seed,
                    dynamic=dynamic, block_sparsity=block_sparsity, block=block)
    save(build_bitnet(config), output, external_data)
    click.echo(f"wrote {output}")


if __name__ == "__main__":
    main()
