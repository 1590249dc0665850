"""The whole BitNet b1.58 2B4T, end to end as a user runs it: generate, compile, time.

    python bench/bench_model.py [--layers 30] [--vocab 128256] [--seq 512 --seq 1] [--dir DIR]

Each step runs the command a user would (``python -m models.bitnet``, ``dlegion-cc``,
``dlegion-run --timing-only``) in a child process, whose CPU time and peak RSS come from the
kernel (``wait4``). The per-layer figures compare the full model with a 1-layer model of the
same vocabulary: (full - one layer) / (layers - 1). The full model is ~11 GB of fp32 external
data; ``--dir`` keeps it (default: a temporary folder, removed at the end). One run of each
step: compiling the full model twice takes minutes, so these are single measurements.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click

PY = sys.executable
BIN = Path(PY).parent
GB = 1e9


@dataclass
class Usage:
    wall: float
    cpu: float
    rss: float          # bytes
    out: str


def measured(args: list[str]) -> Usage:
    """Run ``args``; its wall time, CPU time (user + system) and peak RSS. A failure stops the bench."""
    t0 = time.perf_counter()
    child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = child.stdout.read()
    _, status, ru = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if child.returncode != 0:
        raise SystemExit(f"bench_model: {' '.join(args)} failed ({child.returncode}):\n{out[-2000:]}")
    return Usage(wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024, out)


def generate(path: Path, layers: int, vocab: int) -> Usage:
    return measured([PY, "-m", "models.bitnet", "--preset", "2b4t", "--layers", str(layers), "--vocab",
                     str(vocab), "--dynamic", "--external-data", "-q", str(path)])


def compile_(model: Path, seq: int, arch: str) -> Usage:
    out = model.with_name(f"{model.stem}.seq{seq}.s")
    return measured([str(BIN / "dlegion-cc"), str(model), "-o", str(out), "--arch", arch,
                     "--dim", f"sequence={seq}", "-q"])


def timing_only(program: Path) -> Usage:
    return measured([str(BIN / "dlegion-run"), str(program), "--timing-only", "--report", "-q"])


def row(figure: str, value: str, target: str, ok: bool | None) -> None:
    verdict = "" if ok is None else ("ok" if ok else "MISSED")
    print(f"  {figure:<46} {value:>16}   {target:<22} {verdict}")


def cycles_of(report: str) -> str:
    for line in report.splitlines():
        if "cycles" in line.lower():
            return " ".join(line.split())[:60]
    return "?"


@click.command()
@click.option("--layers", default=30, show_default=True)
@click.option("--vocab", default=128256, show_default=True)
@click.option("--seq", "seqs", multiple=True, type=int, default=(512, 1), show_default=True)
@click.option("--arch", default="dlegion-8x8", show_default=True)
@click.option("--dir", "keep", type=click.Path(file_okay=False), help="Work here and keep the files.")
def main(layers, vocab, seqs, arch, keep):
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        full, one = work / f"2b4t_{layers}l.onnx", work / "2b4t_1l.onnx"
        print(f"BitNet b1.58 2B4T, {layers} layers, vocabulary {vocab:,}, on {arch}")
        gen = generate(full, layers, vocab)
        generate(one, 1, vocab)
        data = sum(f.stat().st_size for f in work.glob(f"{full.name}*"))
        row("generate: wall", f"{gen.wall:.0f} s", "", None)
        row("generate: peak RSS", f"{gen.rss / GB:.2f} GB", f"model {data / GB:.1f} GB", None)
        for seq in seqs:
            c_full, c_one = compile_(full, seq, arch), compile_(one, seq, arch)
            per_cpu = (c_full.cpu - c_one.cpu) / max(layers - 1, 1)
            per_rss = (c_full.rss - c_one.rss) / max(layers - 1, 1)
            row(f"seq {seq}: compile peak RSS", f"{c_full.rss / GB:.2f} GB", "< 3 GB", c_full.rss < 3 * GB)
            row(f"seq {seq}: compile CPU per layer after the first", f"{per_cpu:.2f} s", "< 5 s", per_cpu < 5)
            row(f"seq {seq}: compile RSS growth per layer", f"{per_rss / 1e6:.1f} MB", "< 50 MB", per_rss < 50e6)
            row(f"seq {seq}: compile wall (CPU)", f"{c_full.wall:.0f} s ({c_full.cpu:.0f} s)", "", None)
            t = timing_only(full.with_name(f"{full.stem}.seq{seq}.s"))
            row(f"seq {seq}: dlegion-run --timing-only wall (CPU)", f"{t.wall:.1f} s ({t.cpu:.1f} s)", "< 60 s",
                t.wall < 60)
            row(f"seq {seq}: dlegion-run --timing-only peak RSS", f"{t.rss / GB:.2f} GB", "", None)
            print(f"    {cycles_of(t.out)}")


if __name__ == "__main__":
    main()
