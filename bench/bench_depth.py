"""Depth does not cost accuracy beyond onnxruntime's own: a BitNet 2B4T stack of layers,
dlegion's logits and onnxruntime's fp32 logits each measured against a float64 evaluation of
the same graph (runtime/reference64.py).

    python bench/bench_depth.py [--layers 4] [--seq 256] [--vocab 1000] [--seeds 3]

Target: dlegion's distance from fp64 no larger than onnxruntime's (the median over the input
seeds). Two programs are measured: ``--attention fp32`` (exact ONNX semantics) against the
graph in fp64, and the default program (int8 attention, an approximation the compiler inserts
and records) against the graph in fp64 with the same products quantized, the yardstick
``--check`` uses (``float64_outputs(..., approximations=True, int8_attention=...)``). Both are fp32 programs: BitNet's per-token absmax quantization rounds a value on a .5
boundary either way depending on the last bit of a sum, and the flips grow layer after layer,
so each is some distance from fp64; the question is whether ours is farther.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))

from isa import arch as arch_mod                               # noqa: E402
from dlegion_cc.pipeline import Options, compile_model        # noqa: E402
from models.bitnet import build_bitnet, preset, save          # noqa: E402
from runtime.check import session                             # noqa: E402
from runtime.emulator import run                              # noqa: E402
from runtime.reference64 import float64_outputs, rel_l2       # noqa: E402


@click.command()
@click.option("--layers", default=4, show_default=True)
@click.option("--seq", default=256, show_default=True)
@click.option("--vocab", default=1000, show_default=True)
@click.option("--seeds", default=3, show_default=True, help="Input draws to take the median over.")
@click.option("--arch", "arch_name", default="dlegion-8x8", show_default=True)
def main(layers, seq, vocab, seeds, arch_name):
    machine = arch_mod.load(arch_name)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        save(build_bitnet(preset("2b4t", layers=layers, seq=seq, vocab=vocab)), path, external_data=True)
        ort = session(path)
        draws = [{"input_ids": np.random.default_rng(seed).integers(0, vocab, size=(1, seq)).astype(np.int64)}
                 for seed in range(seeds)]
        for attention in ("fp32", None):
            _, program = compile_model(path, Options(machine, attention=attention))
            _measure(path, program, machine, ort, draws, f"{layers} layers, sequence {seq}")


def _measure(path, program, machine, ort, draws, what: str) -> None:
    """dlegion's and onnxruntime's distances from the program's fp64 yardstick, per draw and median."""
    products = program.approximations.get("int8_attention")
    label = "int8 attention (default)" if products else "--attention fp32"
    ours, theirs, between = [], [], []
    for seed, inputs in enumerate(draws):
        plain = float64_outputs(path, inputs)["logits"]
        ref = float64_outputs(path, inputs, approximations=True, int8_attention=products)["logits"] \
            if products else plain
        got = run(program, machine, inputs).outputs["logits"]
        [want] = ort.run(["logits"], inputs)
        ours.append(rel_l2(got, ref))
        theirs.append(rel_l2(want, plain))
        between.append(rel_l2(got, want))
        print(f"  {label}, seed {seed}: dlegion {ours[-1]:.2e} from its yardstick, onnxruntime {theirs[-1]:.2e} "
              f"from fp64, dlegion from onnxruntime {between[-1]:.2e}")
    a, b = statistics.median(ours), statistics.median(theirs)
    yardstick = "fp64 with the same products in int8" if products else "fp64"
    print(f"2B4T, {what}, {machine.name}, {label}: relative L2 of the logits, median of {len(draws)}: "
          f"dlegion {a:.2e} from {yardstick}, onnxruntime {b:.2e} from fp64 "
          f"(target: dlegion <= onnxruntime: {'ok' if a <= b else 'MISSED'}); "
          f"dlegion from onnxruntime {statistics.median(between):.2e}")


if __name__ == "__main__":
    main()
