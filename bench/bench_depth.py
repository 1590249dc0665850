"""Depth does not cost accuracy beyond onnxruntime's own: a BitNet 2B4T stack of layers,
dlegion's logits and onnxruntime's fp32 logits each measured against a float64 evaluation of
the same graph (runtime/reference64.py).

    python bench/bench_depth.py [--layers 4] [--seq 256] [--vocab 1000] [--seeds 3]

Target: dlegion's distance from fp64 no larger than onnxruntime's (the median over the input
seeds). Both are fp32 programs: BitNet's per-token absmax quantization rounds a value on a .5
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
        _, program = compile_model(path, Options(machine))
        ort = session(path)
        ours, theirs, between = [], [], []
        for seed in range(seeds):
            ids = np.random.default_rng(seed).integers(0, vocab, size=(1, seq)).astype(np.int64)
            inputs = {"input_ids": ids}
            ref = float64_outputs(path, inputs)["logits"]
            got = run(program, machine, inputs).outputs["logits"]
            [want] = ort.run(["logits"], inputs)
            ours.append(rel_l2(got, ref))
            theirs.append(rel_l2(want, ref))
            between.append(rel_l2(got, want))
            print(f"  seed {seed}: dlegion {ours[-1]:.2e} from fp64, onnxruntime {theirs[-1]:.2e}, "
                  f"dlegion from onnxruntime {between[-1]:.2e}")
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"2B4T, {layers} layers, sequence {seq}, {machine.name}: relative L2 of the logits from fp64, "
          f"median of {seeds}: dlegion {a:.2e}, onnxruntime {b:.2e} "
          f"(target: dlegion <= onnxruntime: {'ok' if a <= b else 'MISSED'}); "
          f"dlegion from onnxruntime {statistics.median(between):.2e}")


if __name__ == "__main__":
    main()
