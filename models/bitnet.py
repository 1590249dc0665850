"""BitNet b1.58 decoders as torch.onnx.export writes transformers' BitNet with offline AutoBitLinear:
ternary float {-1,0,1} weights, a per-tensor weight_scale, activations fake-quantized per token."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import click
import numpy as np
import onnx

from isa.console import run_script
from isa.progress import SILENT, Progress
from models.decoder import DecoderSpec, build_decoder
from models.graph import MODEL_LIMIT, GraphBuilder, save, write_external
from models.weights import ternary, ternary_scale, zero_blocks

ACT_QMAX = 127.0  # symmetric 8-bit per-token activation range [-128, 127]
ACT_QMIN = -128.0
ACT_FLOOR = 1e-5  # the clamp on the per-token absmax


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
    past: int | None = None  # a decode step's cached positions (None: no key/value cache)

    def spec(self) -> DecoderSpec:
        return DecoderSpec(
            hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads, ffn=self.ffn, layers=self.layers,
            vocab=self.vocab, seq=self.seq, act=self.act, sub_norm=True, dynamic=self.dynamic,
            rms_eps=self.rms_eps, rope_theta=self.rope_theta, past=self.past,
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


def build_bitnet(config: BitNetConfig, b: GraphBuilder | None = None, progress: Progress = SILENT) -> onnx.ModelProto:
    """The whole decoder; the same config and seed give the same bytes. The tensors go to ``b``'s
    store (by default inside the returned model)."""
    rng = np.random.default_rng(config.seed)
    return build_decoder(config.spec(), BitLinear(config, rng), rng, b, progress)


def write_bitnet(config: BitNetConfig, path: str | Path, external_data: bool, progress: Progress = SILENT) -> None:
    """Write the decoder to ``path`` as ``save(build_bitnet(config), ...)`` would, without holding it
    whole when it has external data: each tensor goes to ``<path>.data`` as it is drawn (one weight
    matrix at a time, the vocabulary-sized tables in row blocks) and the model keeps stubs. Without
    external data a model past 2 GiB is refused before anything is drawn."""
    path = Path(path)
    if external_data:
        write_external(path, lambda store: build_bitnet(config, GraphBuilder(store=store), progress))
        return
    size = config.spec().matrix_bytes()
    if size >= MODEL_LIMIT:  # save() would refuse too, after minutes of drawing
        raise ValueError(f"{path.name}: the model exceeds 2 GiB ({size / 2**30:.1f} GiB of weights); "
                         "save it with external data")
    save(build_bitnet(config, progress=progress), path, False)


@click.command(help="Generate a BitNet b1.58 decoder ONNX graph in torch.onnx.export's pattern.")
@click.option("--preset", "name", type=click.Choice(list(PRESETS)), default="tiny", show_default=True)
@click.option("--layers", type=int, help="decoder layers (default: the preset's)")
@click.option("--seq", type=int, default=8, show_default=True, help="sequence length of input_ids")
@click.option("--vocab", type=int, help="vocabulary size (default: the preset's)")
@click.option("--act", type=click.Choice(["relu2", "silu"]), help="MLP activation (default: the preset's)")
@click.option("--kv-heads", type=int, help="key/value heads (default: the preset's)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dynamic", is_flag=True,
              help="symbolic sequence dimension 'sequence' (with --past, the cache's 'past_sequence_length' too)")
@click.option("--past", type=click.IntRange(min=0),
              help="a decode step with a key/value cache of this many positions: past_key_values.N.key/value "
                   "inputs, present.N.key/value outputs (with --dynamic the cache's length is symbolic, "
                   "whatever P)")
@click.option("--block-sparsity", type=float, default=0.0, show_default=True, help="fraction of zero weight blocks")
@click.option("--block", type=int, default=16, show_default=True, help="block edge for --block-sparsity")
@click.option("--external-data/--no-external-data", default=False, show_default=True,
              help="weights in OUTPUT.data beside the model, written layer by layer (needed past 2 GiB)")
@click.option("-q", "--quiet", is_flag=True, help="no progress bar")
@click.argument("output", type=click.Path(dir_okay=False))
def main(name, layers, seq, vocab, act, kv_heads, seed, dynamic, past, block_sparsity, block, external_data, quiet,
         output):
    config = preset(name, layers=layers, seq=seq, vocab=vocab, act=act, kv_heads=kv_heads, seed=seed,
                    dynamic=dynamic, block_sparsity=block_sparsity, block=block, past=past)
    write_bitnet(config, output, external_data, Progress.for_terminal(quiet))
    click.echo(f"wrote {output}")


def cli() -> None:
    """Errors a user can cause (a bad option, a model too large, an unwritable output) as one line."""
    run_script(main, "models.bitnet", (ValueError,))


if __name__ == "__main__":
    cli()
