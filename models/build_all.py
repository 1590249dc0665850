"""Regenerate the committed models and their golden onnxruntime outputs, byte for byte."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import click
import onnx

from models import bitnet, golden, llama_quant
from models.llama_quant import LlamaConfig

MODELS_DIR = Path(__file__).resolve().parent
GOLDEN_DIR = MODELS_DIR.parent / "tests" / "golden"
MANIFEST = "MANIFEST.json"


@dataclass(frozen=True)
class Entry:
    """One committed model: how to build it, how it is stored, and the golden input it is run on."""

    name: str
    build: Callable[[], onnx.ModelProto]
    vocab: int
    seq: int  # golden sequence length (differs from the build length for a symbolic sequence)
    external_data: bool = False
    input_seed: int = 1
    past: int = 0  # golden cache length, for a decode-step graph

    @property
    def filename(self) -> str:
        return f"{self.name}.onnx"

    def files(self) -> list[str]:
        return [self.filename, self.filename + ".data"] if self.external_data else [self.filename]


def bitnet_entry(name: str, seq: int = 8, external_data: bool = False, golden_past: int = 0, **overrides) -> Entry:
    config = bitnet.preset("tiny", **overrides)
    return Entry(name, lambda: bitnet.build_bitnet(config), config.vocab, seq, external_data, past=golden_past)


def llama_entry(name: str, variant: str, seq: int | None = None, golden_past: int = 0, **overrides) -> Entry:
    config = LlamaConfig(**overrides)
    return Entry(name, lambda: llama_quant.build_quantized(config, variant), config.vocab, seq or config.seq,
                 past=golden_past)


ZOO = (
    # 2B4T-like: squared ReLU, 4 query heads sharing 2 KV heads
    bitnet_entry("bitnet_tiny_relu2"),
    # bitnet_b1_58-large/3B-like: SiLU, full multi-head attention
    bitnet_entry("bitnet_tiny_silu_mha", act="silu", kv_heads=4),
    # one KV head for 4 query heads, symbolic sequence, weights in a .data file; golden at another length
    bitnet_entry("bitnet_tiny_gqa", seq=6, external_data=True, act="silu", kv_heads=1, dynamic=True, seed=2),
    # half of the 16x16 weight blocks zero, for sparsity-aware compilation
    bitnet_entry("bitnet_tiny_sparse", block_sparsity=0.5, block=16, seed=3),
    # a decode step with a key/value cache, symbolic sequence and past; golden: one token after 11
    bitnet_entry("bitnet_tiny_decode", seq=1, golden_past=11, dynamic=True, past=0, seed=4),
    llama_entry("llama_tiny_dynamic_int8", "dynamic-int8"),
    llama_entry("llama_tiny_nbits4", "nbits4"),
    llama_entry("llama_tiny_qdq", "qdq"),
    llama_entry("llama_tiny_qdq_int4", "qdq-int4"),
    # a decode step with a key/value cache, dynamic int8, symbolic sequence and past: what dlegion-generate
    # runs (golden: one token after 11)
    llama_entry("llama_tiny_decode", "dynamic-int8", seq=1, golden_past=11, dynamic=True, past=0, seed=4),
)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_golden(entry: Entry, models_dir: Path, golden_dir: Path) -> None:
    """Golden file: the seeded inputs under the graph input names, outputs under the graph output names."""
    path = models_dir / entry.filename
    inputs = golden.seeded_inputs(onnx.load(path, load_external_data=False), entry.seq, entry.vocab,
                                  entry.input_seed, entry.past)
    outputs = golden.run(path, inputs)
    golden.write_npz(golden_dir / f"{entry.name}.npz", {**inputs, **outputs})


def build(entry: Entry, models_dir: Path, golden_dir: Path) -> dict:
    bitnet.save(entry.build(), models_dir / entry.filename, entry.external_data)
    write_golden(entry, models_dir, golden_dir)
    return {name: sha256(models_dir / name) for name in entry.files()}


def manifest(hashes: dict) -> str:
    """Which onnxruntime on which CPU made the goldens: only that pair is expected to reproduce them exactly."""
    import onnxruntime
    record = {"onnxruntime": onnxruntime.__version__, "cpu": golden.machine(), "models": hashes}
    return json.dumps(record, indent=2, sort_keys=True) + "\n"


@click.command(help="Regenerate the committed models and golden outputs.")
@click.option("--models-dir", type=click.Path(file_okay=False, path_type=Path), default=MODELS_DIR,
              show_default=True)
@click.option("--golden-dir", type=click.Path(file_okay=False, path_type=Path), default=GOLDEN_DIR,
              show_default=True)
@click.option("--only", multiple=True, help="build only these model names")
def main(models_dir: Path, golden_dir: Path, only: tuple[str, ...]):
    unknown = set(only) - {e.name for e in ZOO}
    if unknown:
        raise click.BadParameter(f"unknown model {sorted(unknown)[0]!r}", param_hint="--only")
    models_dir.mkdir(parents=True, exist_ok=True)
    golden_dir.mkdir(parents=True, exist_ok=True)
    hashes = {}
    for entry in ZOO:
        if only and entry.name not in only:
            continue
        hashes[entry.name] = build(entry, models_dir, golden_dir)
        click.echo(f"{entry.name}: {', '.join(entry.files())}")
    if not only:
        (golden_dir / MANIFEST).write_text(manifest(hashes))


if __name__ == "__main__":
    main()
