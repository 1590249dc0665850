"""A float Llama-style decoder quantized by onnxruntime's own tools, in the variants users bring:
dynamic int8 (MatMulInteger), 4-bit blockwise MatMulNBits, and QDQ with int8 or int4 weights."""
from __future__ import annotations

import logging
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import onnx

from models.bitnet import save
from models.decoder import DecoderSpec, build_decoder
from models.graph import GraphBuilder
from models.weights import gaussian

NBITS_BLOCK = 32  # the block size of matmul_nbits_quantizer's command line
CALIBRATION_BATCHES = 4


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    layers: int = 2
    vocab: int = 256
    seq: int = 8
    seed: int = 0
    dynamic: bool = False       # symbolic sequence (and, with a cache, past) dims
    past: int | None = None     # a decode step with a key/value cache of this many positions

    def spec(self) -> DecoderSpec:
        return DecoderSpec(
            hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads, ffn=self.ffn, layers=self.layers,
            vocab=self.vocab, seq=self.seq, act="silu", sub_norm=False, rms_eps=1e-6, rope_theta=10000.0,
            dynamic=self.dynamic, past=self.past,
        )


@dataclass
class FloatLinear:
    """nn.Linear without bias: MatMul(x, W^T) with the transposed weight as the initializer."""

    rng: np.random.Generator

    def prepare(self, b: GraphBuilder, x: str) -> str:
        return x

    def project(self, b: GraphBuilder, x: str, name: str, fan_in: int, fan_out: int) -> str:
        with b.scoped(name):
            w = b.weight(f"{b.prefix()}.weight_t", gaussian(self.rng, (fan_in, fan_out), fan_in ** -0.5))
            return b.op("MatMul", x, w)


def build_llama(config: LlamaConfig) -> onnx.ModelProto:
    rng = np.random.default_rng(config.seed)
    return build_decoder(config.spec(), FloatLinear(rng), rng)


def sample_ids(config: LlamaConfig, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, config.vocab, (1, config.seq), dtype=np.int64)


class IdsReader:
    """onnxruntime's CalibrationDataReader protocol over a few seeded token batches."""

    def __init__(self, config: LlamaConfig):
        self.batches = iter([{"input_ids": sample_ids(config, 1000 + i)} for i in range(CALIBRATION_BATCHES)])

    def get_next(self):
        return next(self.batches, None)


def weight_matmuls(model: onnx.ModelProto) -> list[str]:
    """Names of the MatMul nodes whose B operand is an initializer (the linear layers)."""
    inits = {t.name for t in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]


def dynamic_int8(model: onnx.ModelProto, config: LlamaConfig, work: Path) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantType, quantize_dynamic
    quantize_dynamic(model, work / "q.onnx", weight_type=QuantType.QInt8)
    return onnx.load(work / "q.onnx")


def nbits4(model: onnx.ModelProto, config: LlamaConfig, work: Path) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=NBITS_BLOCK, is_symmetric=True)
    quantizer.process()
    return quantizer.model.model


def qdq(model: onnx.ModelProto, config: LlamaConfig, work: Path, weight_bits: int = 8) -> onnx.ModelProto:
    """Static QDQ on the linear layers: int8 activations, per-channel int8 or int4 weights."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    weight_type = QuantType.QInt8 if weight_bits == 8 else QuantType.QInt4
    quantize_static(
        model, work / "q.onnx", IdsReader(config), quant_format=QuantFormat.QDQ, per_channel=True,
        activation_type=QuantType.QInt8, weight_type=weight_type, nodes_to_quantize=weight_matmuls(model),
        op_types_to_quantize=["MatMul"],
    )
    return onnx.load(work / "q.onnx")


def qdq_int4(model: onnx.ModelProto, config: LlamaConfig, work: Path) -> onnx.ModelProto:
    """At opset 20 (what the exporter writes) the quantizer takes int4 through com.microsoft's
    QuantizeLinear/DequantizeLinear. At opset 21 it would use the standard ones, but onnxruntime's own
    QDQ propagation then fails to load the model (its inserted QuantizeLinear lacks output_dtype)."""
    return qdq(model, config, work, weight_bits=4)


VARIANTS = {
    "float": lambda model, config, work: model,
    "dynamic-int8": dynamic_int8,
    "nbits4": nbits4,
    "qdq": qdq,
    "qdq-int4": qdq_int4,
}


def build_quantized(config: LlamaConfig, variant: str) -> onnx.ModelProto:
    """The float decoder passed through onnxruntime's quantizer for ``variant``."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown Llama variant {variant!r}; known: {', '.join(VARIANTS)}")
    with quiet_root_logger(), tempfile.TemporaryDirectory() as work:
        model = VARIANTS[variant](build_llama(config), config, Path(work))
        model = onnx.ModelProto.FromString(model.SerializeToString())  # detach from files in ``work``
    model.producer_name = "dlegion.models"
    return model


@contextmanager
def quiet_root_logger():
    """The quantizers advise pre-processing through the root logger on every call; keep that off stderr."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


@click.command(help="Generate a small Llama-style decoder quantized by onnxruntime's tools.")
@click.option("--variant", type=click.Choice(list(VARIANTS)), default="dynamic-int8", show_default=True)
@click.option("--layers", type=int, default=2, show_default=True)
@click.option("--hidden", type=int, default=64, show_default=True)
@click.option("--heads", type=int, default=4, show_default=True)
@click.option("--kv-heads", type=int, default=2, show_default=True)
@click.option("--ffn", type=int, default=128, show_default=True)
@click.option("--vocab", type=int, default=256, show_default=True)
@click.option("--seq", type=int, default=8, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--external-data/--no-external-data", default=False, show_default=True)
@click.argument("output", type=click.Path(dir_okay=False))
def main(variant, layers, hidden, heads, kv_heads, ffn, vocab, seq, seed, external_data, output):
    config = LlamaConfig(hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, layers=layers, vocab=vocab,
                         seq=seq, seed=seed)
    save(build_quantized(config, variant), output, external_data)
    click.echo(f"wrote {output}")


if __name__ == "__main__":
    main()
