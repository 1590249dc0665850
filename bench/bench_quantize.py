"""``dlegion-cc --quantize``: the error each mode puts on a float model, as ``--check`` measures it.

    python bench/bench_quantize.py [--seq 32] [--vocab 1000] [--arch dlegion-8x8] [--modes w8,w4,w2]
                                   [--models committed,llama,2b4t-float,2b4t-bitnet] [--attention fp32]

Models: the committed ones (models/*.onnx, on dlegion-tiny with their golden sizes), the float
Llama of the models' helpers (``llama``), and two generated at BitNet-2B4T widths, one layer,
sequence ``--seq``: a float decoder (every projection a float MatMul, ``2b4t-float``) and the
bitnet generator's (ternary projections, float lm_head, ``2b4t-bitnet``). For each model and mode
it prints the logits' relative L2 from onnxruntime, the quantization's own distance from the float64
evaluation (the yardstick's from the graph's: what the tolerance of ``runtime/check.py`` must
cover), dlegion's distance from the yardstick, the top-1 agreement with onnxruntime, and the
verdict on the program and on the program with one weight flipped (target: passes, fails).
"""
from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))

from isa import arch as arch_mod                                  # noqa: E402
from dlegion_cc.pipeline import Options, compile_model           # noqa: E402
from models.bitnet import build_bitnet, preset, save             # noqa: E402
from models.decoder import build_decoder                         # noqa: E402
from models.llama_quant import FloatLinear, LlamaConfig, build_llama    # noqa: E402
from runtime.check import flip_one_weight, judge                 # noqa: E402
from runtime.emulator import random_inputs, run                  # noqa: E402

ROOT = Path(__file__).parent.parent
DIMS = {"bitnet_tiny_gqa": {"sequence": 8}, "bitnet_tiny_decode": {"sequence": 4, "past_sequence_length": 11}}


def _models(which: list[str], tmp: Path, seq: int, vocab: int, arch: str):
    """(label, path, dims, machine) of each model measured."""
    tiny = arch_mod.load("dlegion-tiny")
    if "committed" in which:
        for p in sorted((ROOT / "models").glob("*.onnx")):
            yield p.stem, p, DIMS.get(p.stem, {}), tiny
    if "llama" in which:
        path = tmp / "llama.onnx"
        save(build_llama(LlamaConfig()), path, external_data=False)
        yield "float llama (tiny)", path, {}, tiny
    big = arch_mod.load(arch)
    if "2b4t-float" in which:
        spec = dataclasses.replace(preset("2b4t", layers=1, seq=seq, vocab=vocab).spec(), sub_norm=False)
        rng = np.random.default_rng(0)
        path = tmp / "float.onnx"
        save(build_decoder(spec, FloatLinear(rng), rng), path, external_data=True)
        yield f"float decoder, 2B4T widths, 1 layer, seq {seq}", path, {}, big
    if "2b4t-bitnet" in which:
        path = tmp / "bitnet.onnx"
        save(build_bitnet(preset("2b4t", layers=1, seq=seq, vocab=vocab)), path, external_data=True)
        yield f"bitnet generator, 2B4T widths, 1 layer, seq {seq}", path, {}, big


def _measure(label: str, path: Path, dims: dict, machine, mode: str, attention: str | None) -> None:
    options = Options(machine, dims, quantize=mode, attention=attention)
    _, program = compile_model(path, options)
    inputs = random_inputs(program, 0)
    good = judge(path, inputs, run(program, machine, inputs, keep=False).outputs,
                 program_approximations=program.approximations)
    data, which = flip_one_weight(program.data, program)
    wrong = run(dataclasses.replace(program, data=data), machine, inputs, keep=False).outputs
    bad = judge(path, inputs, wrong, program_approximations=program.approximations)
    for r, b in zip(good.rows, bad.rows):
        if r.fp64 is None or r.exact:
            continue
        f = r.fp64
        top = f"; top-1 {r.top1.agree}/{r.top1.positions}" if r.top1 else ""
        print(f"{label} {mode} [{options.census.line()}] {r.name}: from onnxruntime {r.rel_l2:.2e}; quantization "
              f"{f.approximation if f.approximation is not None else 0:.2e} from fp64 (bound {f.bound:g}); dlegion "
              f"{f.ours:.2e} from its yardstick (onnxruntime {f.reference:.2e} from fp64; positions off "
              f"{f.off_ours} vs {f.off_reference} of {f.positions}){top}; {'passes' if r.ok else 'FAILS'}; "
              f"{which} flipped: {b.fp64.ours:.2e}, {'fails' if not b.ok else 'PASSES'}", flush=True)


@click.command()
@click.option("--seq", default=32, show_default=True)
@click.option("--vocab", default=1000, show_default=True)
@click.option("--arch", "arch_name", default="dlegion-8x8", show_default=True)
@click.option("--modes", default="w8,w4,w2", show_default=True)
@click.option("--models", "which", default="committed,llama,2b4t-float,2b4t-bitnet", show_default=True)
@click.option("--attention", type=click.Choice(["int8", "fp32"]), default=None,
              help="As dlegion-cc's (default: int8, the projections being quantized).")
def main(seq, vocab, arch_name, modes, which, attention):
    with tempfile.TemporaryDirectory() as tmp:
        for label, path, dims, machine in _models(which.split(","), Path(tmp), seq, vocab, arch_name):
            for mode in modes.split(","):
                _measure(label, path, dims, machine, mode, attention)


if __name__ == "__main__":
    main()
