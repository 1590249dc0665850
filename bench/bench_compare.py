"""D-Legion against its baselines on BitNet attention workloads: the paper's kind of table.

    python bench/bench_compare.py [--seq 128,512] [--shape 2b4t --shape large]
                                  [--workload projections --workload products] [--jobs N]
                                  [--pipelined] [--json FILE]

A workload is one attention layer of a BitNet shape at one sequence length: its Q, K, V and O
projections (BitLinear: per-token absmax 8-bit activations x ternary weights), or its QK^T and
PV products with int8 operands (w8 on the arrays; each K/V head multiplies the queries of its
GQA group, so its tiles are loaded once for the group). Each is
compiled for dlegion-8x8 against ws-64, dip-64 and adip-64, and for dlegion-32x8 against tpuv4i,
and timed with the timing model only (no functional emulation). For each machine it prints the
latency, DRAM and accumulator (psum) traffic, the ratios to its D-Legion, and the term that
bounds it: compute (the busiest Legion's matrix queue), DRAM (bytes at full bandwidth) or vector
(the busiest Legion's vector queue, drains included). A matmul whose output columns fill
fewer array-wide slices than the machine has Legions leaves the others idle unless its rows
are cut across them (products with a run-time B are): each matmul that ran on fewer Legions
is named under its table. Each D-Legion machine is also compiled
with each of its optimizations switched off (the compiler's --no-multicast, --no-accumulators,
--no-sparsity, --no-fusion): the ratios of those rows say what each is worth.

Each baseline stands on three footings (``isa/normalize.py``), named in every row: as published,
at D-Legion's PE count (as many of its arrays as it takes) and at D-Legion's peak w8 TOPS (that
machine clocked to match); a machine two footings share runs once. Baselines pay their psum
read-modify-writes in cycles (``acc_port_words``, docs/MACHINE.md). Last, the papers' headline
figures beside ours (the largest ratio over the workloads, on each footing), with why they differ.
With --pipelined every machine overlaps consecutive passes (``pass_overlap``, off in the presets):
the ratios that fall are the part of the gap that was per-pass fill and drain.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import click
import numpy as np
import onnx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent.parent))

from isa import arch as arch_mod                                   # noqa: E402
from isa.console import table_console                            # noqa: E402
from isa.normalize import EQUAL_PEAK, EQUAL_PES, PUBLISHED  # noqa: E402
from dlegion_cc.dse import int_list                               # noqa: E402
from dlegion_cc.dse_compare import PAIRS, REFERENCE, machines as compared_machines  # noqa: E402
from dlegion_cc.dse_compare import add_ratios as ratios_to_reference, ratio_text as _x  # noqa: E402
from dlegion_cc.dse_measure import config_of, evaluate            # noqa: E402
from models.bitnet import PRESETS, BitLinear, BitNetConfig, save  # noqa: E402
from models.graph import FLOAT, GraphBuilder, tensor_info         # noqa: E402

PROJECTIONS = ("q", "k", "v", "o")
ABLATIONS = ("multicast", "accumulators", "sparsity", "fusion")
TABLE_WIDTH = 200
FOOTINGS = (PUBLISHED, EQUAL_PES, EQUAL_PEAK)

# The papers' headline figures (docs/MACHINE.md), each an "up to" ratio of baseline over D-Legion:
# (claim, published, our ratio, D-Legion machine, why ours differs).
PAPER = (
    ("latency vs WS, DiP, ADiP", 8.2, "latency_x", "dlegion-8x8",
     "as published D-Legion has 4x a 64x64 array's PEs; each 64-wide pass pays its fill and drain "
     "(M + N, M + 2N) and, psums through SRAM, 2M port cycles; the paper's baselines are not published in full"),
    ("memory vs WS, DiP, ADiP", 3.8, "dram_x", "dlegion-8x8",
     "ours counts DRAM bytes with one compiler's reuse for every machine; the paper's memory "
     "metric is not defined in full"),
    ("psum memory vs WS, DiP, ADiP", 3.0, "psum_x", "dlegion-8x8",
     "ours counts accumulator-scratchpad int32 reads and writes; the saving is the cores a "
     "K-split spans, and only where the compiler splits K"),
    ("latency, 32 Legions vs TPUv4i", 2.5, "latency_x", "dlegion-32x8",
     "ours: 4 MXUs of 128x128, each pass paying M + 2N = 3M at 128 rows, and their psums through "
     "SRAM; the paper's TPUv4i model is not published"),
    ("throughput, 32 Legions vs TPUv4i", 2.3, "latency_x", "dlegion-32x8",
     "ours runs one layer at a time, so throughput is the inverse of latency; the paper's "
     "batching is not reproduced"),
    ("memory, 32 Legions vs TPUv4i", 2.7, "dram_x", "dlegion-32x8",
     "DRAM bytes; TPUv4i's 128 MiB on chip keeps its traffic near compulsory"),
)


def attention_projections(config: BitNetConfig, seq: int) -> onnx.ModelProto:
    """x -> Q, K, V (one shared activation quantization) and attn -> O, as the decoder writes them."""
    rng = np.random.default_rng(config.seed)
    proj, b = BitLinear(config, rng), GraphBuilder()
    h = config.hidden
    kv = config.kv_heads * (h // config.heads)
    widths = dict(zip(PROJECTIONS, (h, kv, kv, h)))
    with b.scoped("self_attn"):
        xq = proj.prepare(b, "x")
        outs = [proj.project(b, xq, f"{p}_proj", h, widths[p]) for p in "qkv"]
        outs.append(proj.project(b, proj.prepare(b, "attn"), "o_proj", h, h))
    for out, p in zip(outs, PROJECTIONS):
        b.nodes.append(onnx.helper.make_node("Identity", [out], [p], name=f"self_attn/{p}"))
    return b.model([tensor_info("x", FLOAT, [1, seq, h]), tensor_info("attn", FLOAT, [1, seq, h])],
                   [tensor_info(p, FLOAT, [1, seq, widths[p]]) for p in PROJECTIONS])


def attention_products(config: BitNetConfig, seq: int) -> onnx.ModelProto:
    """QK^T and PV with int8 operands (MatMulInteger, int32 scores and context), each K/V head
    multiplying the query rows of its whole GQA group: [kv_heads, group * seq, head_dim]."""
    d = config.hidden // config.heads
    g, kvh = config.heads // config.kv_heads, config.kv_heads
    b = GraphBuilder()
    b.nodes += [onnx.helper.make_node("MatMulInteger", ["q", "kt"], ["scores"], name="self_attn/QK"),
                onnx.helper.make_node("MatMulInteger", ["p", "v"], ["context"], name="self_attn/PV")]
    int8, int32 = onnx.TensorProto.INT8, onnx.TensorProto.INT32
    ins = {"q": [kvh, g * seq, d], "kt": [kvh, d, seq], "p": [kvh, g * seq, seq], "v": [kvh, seq, d]}
    return b.model([tensor_info(n, int8, s) for n, s in ins.items()],
                   [tensor_info("scores", int32, [kvh, g * seq, seq]), tensor_info("context", int32, [kvh, g * seq, d])])


WORKLOADS = {"projections": (attention_projections, "attention Q/K/V/O projections"),
             "products": (attention_products, "attention QK^T and PV, int8")}


def machines(pipelined: bool = False) -> list[tuple[str, str, str, object, dict]]:
    """(row name, its D-Legion, footing, Arch, compiler switches) of every machine to run;
    ``pipelined``: every one with its passes overlapped (``pass_overlap``)."""
    def load(name: str):
        a = arch_mod.load(name)
        return dataclasses.replace(a, pass_overlap=True) if pipelined else a
    out = []
    for m, ref_name, footing in compared_machines(load):
        if footing == REFERENCE and out:        # the ablations of the D-Legion before follow its baselines
            out += _ablations(out[-1][1], load)
        out.append((m.name, ref_name, footing, m, {}))
    return out + _ablations(out[-1][1], load)


def _ablations(ref_name: str, load) -> list[tuple[str, str, str, object, dict]]:
    ref = load(ref_name)
    return [(f"{ref_name} no-{off}", ref_name, "ablation", ref, {off: False}) for off in ABLATIONS]


def run_all(workloads: list[tuple[str, int, str]], jobs: int, console: Console, pipelined: bool) -> list[dict]:
    """Every workload on every machine, ``jobs`` compilations at a time."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(max_workers=jobs) as pool:
        pending = []
        for shape, seq, kind in workloads:
            path = Path(tmp) / f"{shape}-{seq}-{kind}.onnx"
            save(WORKLOADS[kind][0](PRESETS[shape], seq), path, external_data=True)
            for name, ref, footing, m, switches in machines(pipelined):
                tag = {"shape": shape, "seq": seq, "kind": kind, "name": name, "ref": ref, "footing": footing}
                pending.append((tag, pool.submit(evaluate, path, config_of(m), {}, switches)))
        for i, (tag, future) in enumerate(pending, 1):
            rows.append({**future.result(), **tag})
            console.print(f"[{i}/{len(pending)}] {tag['shape']} seq {tag['seq']} {tag['kind']} on {tag['name']}",
                          highlight=False)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Each machine's ratios to its D-Legion on the same workload."""
    ratios_to_reference(rows, lambda r: (r["shape"], r["seq"], r["kind"]))


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def print_workload(rows: list[dict], shape: str, seq: int, kind: str, console: Console) -> None:
    t = Table(title=f"{shape} {WORKLOADS[kind][1]}, sequence {seq}", title_justify="left")
    for col in ("machine", "footing", "cycles", "us", "DRAM MiB", "psum MiB", "mm^2", "matrix busy", "DRAM B/BW",
                "vector busy", "bound", "latency vs D-Legion", "DRAM vs", "psum vs", "per mm^2 vs"):
        t.add_column(col, justify="left" if col in ("machine", "footing", "bound") else "right", no_wrap=True)
    for r in rows:
        if r["status"] != "ok":
            t.add_row(r["name"], r["footing"], *[""] * 8, "[red]failed[/red]", r["reason"][:60], "", "", "")
            continue
        t.add_row(r["name"] + ("*" if r["warning"] else ""), r["footing"],
                  f"{r['cycles']:,}", f"{r['time_us']:,.1f}", _mib(r["dram_bytes"]),
                  _mib(r["psum_bytes"]), f"{r['area_mm2']:,.1f}", f"{r['compute_cycles']:,}", f"{r['dram_cycles']:,}",
                  f"{r['vector_cycles']:,}", r["bound"], _x(r["latency_x"]), _x(r["dram_x"]), _x(r["psum_x"]),
                  _x(r["per_mm2_x"]))
    console.print(t)
    for r in rows:
        if r["status"] == "ok" and r["warning"]:
            console.print(f"  * {r['name']}: {r['warning']}", highlight=False, soft_wrap=True)
    for r in rows:
        if r["status"] == "ok" and r["name"] in PAIRS:
            for m in r["narrow_matmuls"]:
                console.print(f"  {r['name']}: {m['region']} ran on {m['legions']} of its {r['legions']} Legions "
                              "(its output columns fill that many array-wide slices)", highlight=False, soft_wrap=True)


def print_summary(rows: list[dict], console: Console, kind: str | None = None) -> None:
    """Geometric means over the workloads (of one ``kind``, or all) of each baseline's ratios to
    its D-Legion."""
    rows = [r for r in rows if kind is None or r["kind"] == kind]
    what = "workloads" if kind is None else WORKLOADS[kind][1]
    t = Table(title=f"geometric mean over {what} (baseline / D-Legion)", title_justify="left")
    for col in ("baseline", "footing", "vs", "workloads", "latency", "DRAM", "psum", "latency x mm^2"):
        t.add_column(col, justify="left" if col in ("baseline", "footing", "vs") else "right")
    named = {(r["name"], r["footing"], r["ref"]): None for r in rows if r["footing"] != "reference"}
    for name, footing, ref in named:
        mine = [r for r in rows if r["name"] == name and r["latency_x"] is not None]
        t.add_row(name, footing, ref, str(len(mine)), *(_x(_geomean([r[k] for r in mine]))
                                                        for k in ("latency_x", "dram_x", "psum_x", "per_mm2_x")))
    console.print(t)


def print_paper(rows: list[dict], console: Console) -> None:
    """The papers' figures beside ours: the largest ratio over the workloads of the baselines on
    each footing (a row standing for several footings counts for each)."""
    t = Table(title="the papers' figures beside ours (up to, baseline / D-Legion)", title_justify="left")
    for col in ("claim", "paper", *(f"ours, {f}" for f in FOOTINGS), "why they differ"):
        t.add_column(col, justify="left" if col in ("claim", "why they differ") else "right",
                     no_wrap=col != "why they differ")
    for claim, published, key, ref, why in PAPER:
        ours = [max((r[key] for r in rows if r["ref"] == ref and footing in r["footing"].split(" = ")
                     and r[key] is not None), default=None) for footing in FOOTINGS]
        t.add_row(claim, f"{published:g}x", *map(_x, ours), why)
    console.print(t)


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


@click.command()
@click.option("--seq", "seqs", default="128,512", show_default=True, callback=int_list, metavar="N,N,...",
              help="Sequence lengths (the paper's range is 128..2048).")
@click.option("--shape", "shapes", multiple=True, type=click.Choice(["2b4t", "large"]),
              help="BitNet shapes (repeatable; default both).")
@click.option("--workload", "kinds", multiple=True, type=click.Choice(list(WORKLOADS)),
              help="Workloads (repeatable; default all).")
@click.option("--jobs", type=click.IntRange(min=1), default=os.cpu_count() or 1, show_default="CPU count")
@click.option("--pipelined", is_flag=True,
              help="Every machine, baselines included, with its passes overlapped (pass_overlap).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write every row as JSON.")
def main(seqs, shapes, kinds, jobs, pipelined, json_path):
    console = table_console(TABLE_WIDTH)
    workloads = [(shape, seq, kind) for kind in kinds or WORKLOADS for shape in (shapes or ("2b4t", "large"))
                 for seq in seqs]
    rows = run_all(workloads, jobs, Console(stderr=True), pipelined)
    add_ratios(rows)
    for shape, seq, kind in workloads:
        print_workload([r for r in rows if (r["shape"], r["seq"], r["kind"]) == (shape, seq, kind)],
                       shape, seq, kind, console)
    kinds = list(dict.fromkeys(k for _, _, k in workloads))
    for kind in kinds if len(kinds) > 1 else ():
        print_summary(rows, console, kind)
    print_summary(rows, console)
    print_paper(rows, console)
    if json_path:
        from isa.files import atomic_write
        atomic_write(json_path, json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
