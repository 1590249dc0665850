"""One BitNet-2B4T decoder layer's decode step with a key/value cache, against what no schedule
can beat on the machine.

    python bench/bench_decode.py [--past 512] [--arch dlegion-8x8]

Beside it, the same step compiled with ``--overlap`` (nodes end in waits, not barriers; off by
default), and the ablation without the cache bound inside ``present`` (``--no-cache-alias``: the
program then writes the whole present cache, not only the new token's rows).

The layer's cycles are the span of its regions (first start to last completion) in the timing
model, leaving out the embedding and the head around it. The bound is the larger of:

- the matmuls on the arrays: the BitLinear MACs at the w2 rate, attention's QK^T and PV (over
  past + 1 keys) at the w8 rate (the rates of the architecture: ``Arch.derived``);
- compulsory DRAM traffic at the DRAM bandwidth: the 2-bit weights, the layer's input and
  output, and one read of the cache the graph takes in (at its dtype).

Target: at most 1.20x the bound.

``--breakdown`` prints, per node (region) of the layer, its span, the DRAM bytes its transfers
move, and the cycles DRAM would need for them at full bandwidth: where a node's span exceeds
its DRAM cycles, DRAM idles (the layer's total idle is printed too). The graph's own floor is
printed beside the bound: the compulsory bytes plus what it must write of the ``present`` cache
(the new rows when the past lies inside it, else all of it).
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))

from isa import arch as arch_mod                               # noqa: E402
from dlegion_cc.pipeline import Options, compile_model        # noqa: E402
from models.bitnet import build_bitnet, preset, save          # noqa: E402
from isa.instructions import DmaLoad, DmaStore, Gather        # noqa: E402
from runtime.costs import Env, cost                           # noqa: E402
from runtime.report import regions_by_name                    # noqa: E402
from runtime.timing import simulate                           # noqa: E402

TARGET = 1.20
LAYER = "layers.0."     # the scope every node of the layer's regions carries
W2_BITS = 2
FP32 = 4


def bound(config, machine) -> dict:
    """The cycles of the layer's matmuls at their modes' peak rates and of its compulsory DRAM bytes."""
    spec = config.spec()
    h, kv, d, keys = spec.hidden, spec.kv_heads * spec.head_dim, spec.head_dim, spec.past + spec.seq
    fan = h * (2 * h + 2 * kv) + 3 * h * spec.ffn     # q, o, k, v; gate, up, down
    bitlinear = spec.seq * fan
    attention = 2 * spec.heads * spec.seq * keys * d   # QK^T and PV
    derived = machine.derived
    peak = derived.macs_per_cycle
    weights = fan * W2_BITS // 8
    activations = 2 * spec.seq * h * FP32               # the layer's input and output
    cache = 2 * spec.kv_heads * spec.past * d * FP32    # past keys and values
    dram = weights + activations + cache
    parts = {"w2 matmuls": bitlinear / peak["w2"], "w8 attention": attention / peak["w8"],
             "DRAM": dram / derived.dram_bytes_per_cycle}
    return {"parts": parts, "cycles": max(parts["w2 matmuls"] + parts["w8 attention"], parts["DRAM"]),
            "bytes": {"weights": weights, "activations": activations, "cache": cache}}


def layer_span(timeline) -> int:
    """Cycles from the first start to the last completion of the layer's regions."""
    program = timeline.program
    members = [k for name, ks in regions_by_name(program).items() if LAYER in name for k in ks]
    members = np.asarray(members, dtype=np.int64)
    return int(timeline.done[members].max() - timeline.start[members].min())


def breakdown(timeline, machine) -> list[tuple[str, float, float, int]]:
    """Per region of the layer, in program order: (name, first start, last completion, DRAM bytes
    its transfers move)."""
    program = timeline.program
    env = Env(tuple(program.tensors), {})
    rows = []
    for name, ks in regions_by_name(program).items():
        if LAYER not in name:
            continue
        at = np.asarray(ks, dtype=np.int64)
        moved = sum(cost(program.instrs[k], machine, env).flow_bytes for k in ks
                    if isinstance(program.instrs[k], (DmaLoad, DmaStore, Gather)))
        rows.append((name, float(timeline.start[at].min()), float(timeline.done[at].max()), moved))
    return rows


def print_breakdown(timeline, machine) -> None:
    bw = machine.derived.dram_bytes_per_cycle
    rows = breakdown(timeline, machine)
    print(f"  {'region':58s} {'start':>7s} {'cycles':>7s} {'DRAM bytes':>11s} {'DRAM cycles':>11s}")
    for name, start, done, moved in rows:
        short = name if len(name) <= 58 else name[:27] + "..." + name[-28:]
        print(f"  {short:58s} {start:7,.0f} {done - start:7,.0f} {moved:11,} {moved / bw:11,.0f}")
    span = max(d for _, _, d, _ in rows) - min(s for _, s, _, _ in rows)
    busy = sum(m for *_, m in rows) / bw
    print(f"  layer: {span:,.0f} cycles, DRAM busy {busy:,.0f} at full bandwidth ({busy / span:.1%}), "
          f"idle {span - busy:,.0f}")


@click.command()
@click.option("--past", default=512, show_default=True, help="cached positions")
@click.option("--arch", "arch_name", default="dlegion-8x8", show_default=True)
@click.option("--breakdown", "show", is_flag=True, help="per node: span, DRAM bytes and DRAM cycles")
def main(past: int, arch_name: str, show: bool) -> None:
    machine = arch_mod.load(arch_name)
    config = preset("2b4t", layers=1, seq=1, vocab=512, past=past)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "decode.onnx"
        save(build_bitnet(config), path, external_data=True)
        t0 = time.perf_counter()
        _, program = compile_model(path, Options(machine))
        t_compile = time.perf_counter() - t0
        _, overlapped = compile_model(path, Options(machine, overlap=True))
        _, copied = compile_model(path, Options(machine, cache_alias=False))
    timeline, timed_overlap = simulate(program, machine), simulate(overlapped, machine)
    timed_copied = simulate(copied, machine)
    cycles, b = layer_span(timeline), bound(config, machine)
    waits = layer_span(timed_overlap)
    print(f"2B4T layer, decode step with a {past}-position cache, {machine.name}: "
          f"{len(program.instrs):,} instructions, compile {t_compile:.1f} s")
    print("  bound: " + ", ".join(f"{k} {v:,.0f}" for k, v in b["parts"].items())
          + " cycles; DRAM bytes " + ", ".join(f"{k} {v:,}" for k, v in b["bytes"].items()))
    print(f"  layer: {cycles:,} cycles = {cycles / b['cycles']:.3f}x the bound {b['cycles']:,.0f} "
          f"(target {TARGET:.2f}x); whole program {timeline.cycles:,} cycles")
    print(f"  with --overlap (no barrier after a node): {waits:,} cycles = {waits / b['cycles']:.3f}x")
    copy = layer_span(timed_copied)
    print(f"  with --no-cache-alias (the past copied into present): {copy:,} cycles = {copy / b['cycles']:.3f}x")
    spec = config.spec()
    for title, rows in (("the new rows", 1), ("--no-cache-alias, the whole cache", past + 1)):
        present = 2 * spec.kv_heads * rows * spec.head_dim * FP32
        floor = b["parts"]["DRAM"] + present / machine.derived.dram_bytes_per_cycle
        print(f"  the graph's DRAM floor with what it writes of present ({title}, {present:,} bytes): "
              f"{floor:,.0f} cycles = {floor / b['cycles']:.3f}x the bound")
    if show:
        for title, timed in (("default", timeline), ("--overlap", timed_overlap),
                             ("--no-cache-alias", timed_copied)):
            print(f"  breakdown, {title}:")
            print_breakdown(timed, machine)


if __name__ == "__main__":
    main()
