"""Serving a BitNet LLM in MLPerf Inference terms, per machine, from the timing model alone.

    python bench/bench_llm.py [--layers 30] [--vocab 128256] [--prompt 512 --generate 128]
                              [--arch dlegion-8x8 --arch dlegion-32x8] [--every 32] [--dir DIR]
                              [--quantize w8|w4|w2]

For each machine: time to first token (TTFT: the prefill of the prompt, with an empty key/value
cache), time per output token (TPOT: the mean of the decode steps after the first token), tokens
per second (all generated tokens over the whole time), joules per token and average watts (the
architecture's energy table, runtime/report.py). Batch 1, one stream, greedy: MLPerf's
single-stream scenario. The model is the BitNet 2B4T shape with a symbolic cache
(``python -m models.bitnet --preset 2b4t --dynamic --past 0 --external-data``), generated into
``--dir`` unless a model is there already; ``--model`` benches any other decode graph with a
symbolic cache (e.g. models/llama_tiny_decode.onnx). Decode steps are timed every ``--every`` positions of
the context and the last, the others interpolated linearly (runtime/llm_metrics.py); the table's
caption says how many were timed. Writes a JSON file and a PNG plot of latency per token against
context length, one line per machine.

The 2B4T shape's projections are ternary (w2 on the arrays) but its lm_head is float, so by
default the lm_head runs in fp32 on the vector unit; ``--quantize MODE`` also compiles every
program with ``dlegion-cc --quantize MODE`` (the lm_head on the arrays) and prints each machine's
row that way beside its fp32-lm_head row.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).parent.parent))

from isa import arch as arch_mod                    # noqa: E402
from isa.files import atomic_write                  # noqa: E402
from isa.progress import Progress                   # noqa: E402
from dlegion_cc.passes.quantize import MODES as QUANTIZE_MODES   # noqa: E402
from runtime.generate import Build, cache_graph     # noqa: E402
from runtime.llm_metrics import serve               # noqa: E402


def model_in(folder: Path, layers: int, vocab: int, progress: Progress) -> Path:
    """The 2B4T-shaped decode graph in ``folder``, generated (weights streamed to its .data) if absent."""
    from models.bitnet import preset, write_bitnet
    path = folder / f"bitnet_2b4t_{layers}l_v{vocab}_decode.onnx"
    if not path.exists():
        config = preset("2b4t", layers=layers, vocab=vocab, dynamic=True, past=0)
        write_bitnet(config, path, external_data=True, progress=progress)
    return path


def table(rows: list[dict], caption: str):
    from rich.table import Table
    t = Table(title=caption, title_justify="left")
    for name in ("machine", "lm_head", "attention (prefill/decode)", "TTFT (ms)", "TPOT (ms)", "tokens/s", "J/token", "avg W", "bench wall (s)"):
        t.add_column(name, justify="left" if name == "machine" else "right")
    for r in rows:
        attention = "/".join("int8" if "int8_attention" in t["approximations"] else "fp32"
                             for t in (r["prefill"], (r["decode_samples"] or [r["prefill"]])[0]))
        t.add_row(r["arch"], r["lm_head"], attention, f"{r['ttft_s'] * 1e3:,.2f}", "-" if r["tpot_s"] is None else f"{r['tpot_s'] * 1e3:,.3f}",
                  f"{r['tokens_per_s']:,.1f}",
                  f"{r['joules_per_token']:.4g}", f"{r['average_watts']:.3g}", f"{r['wall_s']:.0f}")
    return t


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Latency per decode step against context length (cached positions), one line per machine:
    the timed steps as markers, the interpolation between them as the line."""
    import io
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        xs = [s["past"] for s in r["decode_samples"]]
        ax.plot(xs, [s["seconds"] * 1e3 for s in r["decode_samples"]], marker="o", label=f"{r['arch']}, lm_head {r['lm_head']}")
    ax.set_xlabel("context length (cached positions before the token)")
    ax.set_ylabel("latency per output token (ms)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if rows:
        ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    atomic_write(path, buf.getvalue())


@click.command()
@click.option("--model", "model_path", type=click.Path(dir_okay=False, exists=True),
              help="Any decode graph with a symbolic key/value cache instead of the generated 2B4T shape.")
@click.option("--layers", default=30, show_default=True)
@click.option("--vocab", default=128256, show_default=True)
@click.option("--prompt", default=512, show_default=True, help="prompt tokens (the prefill's sequence)")
@click.option("--generate", "new_tokens", default=128, show_default=True, help="tokens generated")
@click.option("--arch", "arches", multiple=True, default=("dlegion-8x8", "dlegion-32x8"), show_default=True)
@click.option("--every", default=32, show_default=True, help="time a decode step every this many positions")
@click.option("--attention", type=click.Choice(("int8", "fp32")), default=None,
              help="attention's products (default: the compiler's, int8 for BitNet)")
@click.option("--quantize", type=click.Choice(QUANTIZE_MODES), default=None,
              help="Also time each machine with dlegion-cc --quantize MODE (float weights, the lm_head, on the arrays).")
@click.option("--dir", "keep", type=click.Path(file_okay=False), help="Work here and keep the model.")
@click.option("--keep-programs", is_flag=True,
              help="Keep the compiled programs in DIR/build (at full size, gigabytes of weights each).")
@click.option("--json", "json_path", default="bench_llm.json", show_default=True, type=click.Path(dir_okay=False))
@click.option("--plot", "png_path", default="bench_llm.png", show_default=True, type=click.Path(dir_okay=False))
@click.option("-q", "--quiet", is_flag=True)
def main(model_path, layers, vocab, prompt, new_tokens, arches, every, attention, quantize, keep, keep_programs,
         json_path, png_path, quiet):
    from rich.console import Console
    progress = Progress.for_terminal(quiet)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        graph = cache_graph(model_path or model_in(work, layers, vocab, progress))
        rows = []
        for name in arches:
            for mode in (None, quantize) if quantize else (None,):
                t0 = time.perf_counter()
                build = Build(graph, arch_mod.load(name), name, work / "build", attention, progress, mode)
                rows.append(serve(build, prompt, new_tokens, every, keep_programs)
                            | {"lm_head": mode or "fp32", "quantize": mode,
                               "wall_s": time.perf_counter() - t0, "compiled": len(build.compiled)})
    shape = Path(model_path).name if model_path else f"BitNet 2B4T shape ({layers} layers, vocabulary {vocab:,})"
    what = f"{shape}, prompt {prompt}, {new_tokens} tokens"
    r = rows[0]
    caption = (f"{what}; batch 1, timing model only; {r['decode_steps_timed']} of {r['decode_steps']} decode steps "
               f"timed (every {every} positions and the last), the rest interpolated linearly")
    Console(width=140).print(table(rows, caption))
    atomic_write(json_path, json.dumps({"model": what, "rows": rows}, indent=1) + "\n")
    plot(rows, Path(png_path), f"{what}\ndecode latency per token")
    print(f"wrote {json_path}, {png_path}")


if __name__ == "__main__":
    main()
