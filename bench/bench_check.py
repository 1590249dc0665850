"""``dlegion-run --check``'s verdict at the size users run: one BitNet-2B4T layer at its full
widths, where no fp32 program is within the 1e-4 tolerance of onnxruntime.

    python bench/bench_check.py [--seq 128] [--vocab 1000] [--arch dlegion-8x8]

The generated layer (``models.bitnet --preset 2b4t --layers 1``) is compiled and emulated; its
program is judged as ``dlegion-run --check`` judges it (runtime/check.py ``judge``: onnxruntime's
fp32 run, the graph in float64, top-1 agreement of the logits), then the same program with one
weight flipped in its data. Targets: the correct program passes, the flipped one fails. Each
figure is printed beside onnxruntime's own distance from float64.
"""
from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).parent.parent))

from isa import arch as arch_mod                               # noqa: E402
from dlegion_cc.pipeline import Options, compile_model        # noqa: E402
from models.bitnet import build_bitnet, preset, save          # noqa: E402
from runtime.check import flip_one_weight, judge              # noqa: E402
from runtime.emulator import random_inputs, run               # noqa: E402


def _verdict(label: str, verdict, want_ok: bool, seconds: float) -> None:
    for row in verdict.rows:
        f = row.fp64
        far = (f"dlegion {f.ours:.2e} from fp64, onnxruntime {f.reference:.2e}; positions off: "
               f"{f.off_ours} vs {f.off_reference} of {f.positions}") if f is not None else "fp64 not evaluated"
        top = f"; top-1 agreement {row.top1.agree}/{row.top1.positions}" if row.top1 is not None else ""
        print(f"  {label}: {row.name}: rel L2 from onnxruntime {row.rel_l2:.2e}; {far}{top}")
    verdict_word = "passes" if verdict.ok else "fails"
    target = "passes" if want_ok else "fails"
    mark = "ok" if verdict.ok == want_ok else "MISSED"
    print(f"{label}: {verdict_word} (target: {target}: {mark}) [{seconds:.1f} s]")


@click.command()
@click.option("--seq", default=128, show_default=True)
@click.option("--vocab", default=1000, show_default=True,
              help="Vocabulary of the generated layer's embedding and lm_head.")
@click.option("--arch", "arch_name", default="dlegion-8x8", show_default=True)
def main(seq, vocab, arch_name):
    machine = arch_mod.load(arch_name)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "layer.onnx"
        save(build_bitnet(preset("2b4t", layers=1, seq=seq, vocab=vocab)), path, external_data=True)
        _, program = compile_model(path, Options(machine))
        inputs = random_inputs(program, 0)
        print(f"2B4T layer, full widths, sequence {seq}, vocabulary {vocab}, {machine.name}")
        start = time.perf_counter()
        verdict = judge(path, inputs, run(program, machine, inputs, keep=False).outputs,
                        program_approximations=program.approximations)
        _verdict("correct program", verdict, True, time.perf_counter() - start)
        data, which = flip_one_weight(program.data, program)
        start = time.perf_counter()
        wrong = run(dataclasses.replace(program, data=data), machine, inputs, keep=False).outputs
        _verdict(f"{which} flipped", judge(path, inputs, wrong, program_approximations=program.approximations), False,
                 time.perf_counter() - start)


if __name__ == "__main__":
    main()
