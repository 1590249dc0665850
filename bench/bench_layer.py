"""One BitNet-2B4T decoder layer on dlegion-8x8: program size against the ISA's budget, and
how fast the compiler and the timing model handle it.

    python bench/bench_layer.py [--seq 512] [--arch dlegion-8x8] [--no-prefetch]

Prints the instruction count by family (budget: 20,000 at sequence 512), the simulated
cycles and where they go (the regions of quantized matmuls, of fp32 matmuls on the vector
lanes, and of the other vector kernels and copies), and the wall time of compiling and of
timing the program (median of 3).
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).parent.parent))

from isa import arch as arch_mod                               # noqa: E402
from isa.instructions import family                           # noqa: E402
from dlegion_cc.pipeline import Options, compile_model        # noqa: E402
from models.bitnet import build_bitnet, preset, save          # noqa: E402
from runtime.report import regions_by_name                    # noqa: E402
from runtime.timing import simulate                           # noqa: E402

BUDGET = 20_000


def _median_time(fn, runs: int = 3):
    times, out = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _cycles_by_kind(timeline) -> Counter:
    """Each region's cycles (first start to last completion), by what runs it. A matmul whose
    first weights load during the node before overlaps it, so the shares may pass 100%."""
    program, out = timeline.program, Counter()
    for members in regions_by_name(program).values():
        if members:
            ops = {program.instrs[k].MNEMONIC for k in members}
            kind = "quantized matmuls" if "mm" in ops else "fp32 matmuls" if "vmm" in ops else "other vector work"
            out[kind] += int(timeline.done[members].max() - timeline.start[members].min())
    return out


@click.command()
@click.option("--seq", default=512, show_default=True)
@click.option("--arch", "arch_name", default="dlegion-8x8", show_default=True)
@click.option("--prefetch/--no-prefetch", default=True, show_default=True,
              help="Weights load during the row kernel before each matmul (dlegion-cc --no-prefetch turns it off).")
def main(seq: int, arch_name: str, prefetch: bool) -> None:
    machine = arch_mod.load(arch_name)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "layer.onnx"
        save(build_bitnet(preset("2b4t", layers=1, seq=seq, vocab=512)), path, external_data=True)
        t_compile, (_, program) = _median_time(lambda: compile_model(path, Options(machine, prefetch=prefetch)), runs=1)
    t_time, timeline = _median_time(lambda: simulate(program, machine))
    counts = Counter(family(type(i)) for i in program.instrs)
    n = len(program.instrs)
    print(f"2B4T layer, sequence {seq}, {machine.name}: {n:,} instructions "
          f"({n / BUDGET:.2f}x the {BUDGET:,} budget)")
    print("  by family: " + ", ".join(f"{f} {c:,}" for f, c in counts.most_common()))
    print(f"  {timeline.cycles:,} cycles; compile {t_compile:.1f} s; timing model {t_time:.2f} s "
          f"({timeline.cycles / t_time / 1e6:.1f} M simulated cycles/s, {n / t_time:,.0f} instructions/s)")
    print("  by region: " + ", ".join(f"{kind} {c:,} ({c / timeline.cycles:.0%})"
                                      for kind, c in _cycles_by_kind(timeline).most_common()))


if __name__ == "__main__":
    main()
