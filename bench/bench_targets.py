"""The scheduling targets: BitLinear matmuls against their roofline, and ws-32 against SCALE-Sim.

    python bench/bench_targets.py [--seq 256 --seq 1] [--gemm 256] [--big 1024]

1. The BitLinear matmuls of one BitNet-2B4T decoder layer (Q, K, V, O, gate, up, down, each
   with its activation quantization) on dlegion-8x8: their simulated cycles against the sum of
   their roofline bounds (target <= 1.10x), and the DRAM bytes they move against the compulsory
   bytes of the tensors they touch (target <= 1.10x), for prefill (sequence 256) and decode (1),
   each matmul scheduled on its own (``--no-row-blocks``).
   The same with Legion-to-Legion transfers off (``--no-transfers``: activations a matmul reads
   again come from DRAM). With them, the floors of ``dlegion_cc.lower.qbound`` for schedules
   without transfers: what passes of all the rows re-read, and the fewest cycles any schedule
   within the DRAM target can take; on dlegion-8x8 at 256 more than the cycle target allows.
   Forwarding activations over the NoC lifts that floor (see docs/DESIGN.md, "What no schedule
   can beat").
2. An int8 GEMM (MatMulInteger) of --gemm cubed on ws-32, compiled and timed, against SCALE-Sim
   v3's 22,399 cycles for 256^3 on a 32x32 weight-stationary array (target within 5%). SCALE-Sim
   counts the array's compute cycles with its operands already in SRAM: that is our matrix
   queue's busy time; the whole program adds the DRAM transfers around it.
3. The wall time of timing a --big cubed GEMM on ws-32 (target under a second), median of 3.
4. The K split over Legions (``noc.add``): int32 GEMMs at M = 1 with ternary weights on
   dlegion-8x8, searched and with ``--no-ksplit``: narrow ones split (N 64), 2B4T's k/v shape
   (N 640, every Legion already has columns) not.
"""
from __future__ import annotations

import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper

sys.path.insert(0, str(Path(__file__).parent.parent))

from isa import arch as arch_mod                                  # noqa: E402
from isa.instructions import DMA_CLASSES                         # noqa: E402
from isa.program import STORAGE                                  # noqa: E402
from dlegion_cc.lower.qbound import Shape, fewest_cycles, reread_floor  # noqa: E402
from dlegion_cc.lower.qplan import OBJECTIVES                    # noqa: E402
from dlegion_cc.pipeline import Options, compile_model           # noqa: E402
from models.bitnet import build_bitnet, preset, save             # noqa: E402
from runtime.emulator import RunResult                           # noqa: E402
from runtime.report import matmul_table, region_dram_bytes, regions_by_name  # noqa: E402
from runtime.timing import simulate                              # noqa: E402

SCALE_SIM_256 = 22_399
DRAM_TARGET = 1.10
BITLINEAR = re.compile(r"(q|k|v|o|gate|up|down)_proj")


def _timed(program, arch) -> RunResult:
    tl = simulate(program, arch)
    return RunResult(outputs={}, timeline=tl, arch=arch, program=tl.program, machine=None)


def _dram_bytes(program, members) -> int:
    """Bytes the DMA tasks of ``members`` move (a multicast is one read)."""
    total = 0
    for k in members:
        i = program.instrs[k]
        if type(i) in DMA_CLASSES:
            ref = i.dst if type(i).__name__ == "DmaStore" else (i.src if hasattr(i, "src") else i.table)
            total += i.rows * i.cols * np.dtype(STORAGE[program.tensors[ref.tensor].dtype]).itemsize
    return total


def bitlinear_layer(seq: int, arch, objective: str = "latency", transfers: bool = True) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "layer.onnx"
        save(build_bitnet(preset("2b4t", layers=1, seq=seq, vocab=512)), path, external_data=True)
        # Row blocks off: they interleave each matmul with the row kernels beside it (merged regions,
        # weights streamed once per row block), so a region is no longer one matmul's; the target
        # is the matmuls' schedules. bench_layer.py times the layer with them.
        _, program = compile_model(path, Options(arch, objective=objective, transfers=transfers, row_blocks=False))
    result = _timed(program, arch)
    rows = [r for r in matmul_table(result) if BITLINEAR.search(r["region"])]
    ranges = regions_by_name(result.program)
    moved = sum(_dram_bytes(result.program, ranges[r["region"]]) for r in rows)
    compulsory = sum(region_dram_bytes(result.program, ranges[r["region"]]) for r in rows)
    return {"seq": seq, "matmuls": len(rows), "cycles": sum(r["cycles"] for r in rows),
            "roofline": sum(r["roofline_cycles"] for r in rows), "dram": moved, "compulsory": compulsory,
            "rows": rows}


def bitlinear_shapes(seq: int) -> list[Shape]:
    """The layer's quantized matmuls as the compiler fuses them: QKV, O, gate and up, down."""
    c = preset("2b4t")
    kv = c.hidden // c.heads * c.kv_heads
    return [Shape(seq, c.hidden, c.hidden + 2 * kv, "w2"), Shape(seq, c.hidden, c.hidden, "w2"),
            Shape(seq, c.hidden, 2 * c.ffn, "w2"), Shape(seq, c.ffn, c.hidden, "w2")]


def floors(seq: int, arch, compulsory: int) -> dict:
    """What ``qbound`` says every schedule of the layer's matmuls costs: the bytes read again
    with passes of all ``seq`` rows (the fewest pass overheads), and the fewest pass cycles of
    any schedule within the DRAM target, whose partial sums stay in the accumulators (as all the
    compiler's do) or also fill ``vec``. Each matmul's span adds at least a DRAM latency before
    its first pass (its operands' load) and one after its last (its results' store)."""
    shapes = bitlinear_shapes(seq)
    allowance = (DRAM_TARGET - 1) * compulsory
    return {"full_height_extra": sum(reread_floor(arch, s, 1) for s in shapes),
            "passes_within_dram": fewest_cycles(arch, shapes, allowance),
            "passes_within_dram_vec": fewest_cycles(arch, shapes, allowance, vec=True),
            "latencies": 2 * arch.dram_latency_cycles * len(shapes)}


def gemm_model(n: int, path: Path) -> None:
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TP.INT8, (n, n), rng.integers(-128, 128, (n, n)).astype(np.int8).tobytes(), raw=True)
    node = helper.make_node("MatMulInteger", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "gemm", [helper.make_tensor_value_info("x", TP.INT8, [n, n])],
                              [helper.make_tensor_value_info("y", TP.INT32, [n, n])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), path)


def narrow_cycles(M: int, K: int, N: int, arch, ksplit: bool) -> int:
    """Cycles of an int32 GEMM of ternary weights (w2), K split allowed or not."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TP.INT8, (K, N), rng.integers(-1, 2, (K, N)).astype(np.int8).tobytes(), raw=True)
    node = helper.make_node("MatMulInteger", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "gemm", [helper.make_tensor_value_info("x", TP.INT8, [M, K])],
                              [helper.make_tensor_value_info("y", TP.INT32, [M, N])], [w])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "narrow.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), path)
        return simulate(compile_model(path, Options(arch, ksplit=ksplit))[1], arch).cycles


def compiled_gemm(n: int, arch):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gemm.onnx"
        gemm_model(n, path)
        return compile_model(path, Options(arch))[1]


@click.command()
@click.option("--seq", "seqs", multiple=True, type=int, default=(256, 1), show_default=True)
@click.option("--gemm", default=256, show_default=True)
@click.option("--big", default=1024, show_default=True)
def main(seqs, gemm, big) -> None:
    dlegion, ws32 = arch_mod.load("dlegion-8x8"), arch_mod.load("ws-32")
    for seq in seqs:
        r = bitlinear_layer(seq, dlegion)
        print(f"2B4T BitLinear matmuls, sequence {seq}, {dlegion.name}: {r['cycles']:,} cycles against a "
              f"roofline of {r['roofline']:,.0f} ({r['cycles'] / r['roofline']:.3f}x, target <= 1.10x); DRAM "
              f"{r['dram'] / 1e6:.1f} MB against {r['compulsory'] / 1e6:.1f} MB compulsory "
              f"({r['dram'] / r['compulsory']:.3f}x, target <= 1.10x)")
        plain = bitlinear_layer(seq, dlegion, transfers=False)
        print(f"    without Legion-to-Legion transfers (--no-transfers): {plain['cycles']:,} cycles "
              f"({plain['cycles'] / plain['roofline']:.3f}x), DRAM {plain['dram'] / 1e6:.1f} MB "
              f"({plain['dram'] / plain['compulsory']:.3f}x)")
        floor = floors(seq, dlegion, r["compulsory"])
        if floor["full_height_extra"]:
            passes = floor["passes_within_dram"]
            spans, spans_vec = passes + floor["latencies"], floor["passes_within_dram_vec"] + floor["latencies"]
            print(f"    floors without transfers (activations read again from DRAM): passes of all {seq} rows (the fewest pass overheads) read activations again, at least "
                  f"{1 + floor['full_height_extra'] / r['compulsory']:.3f}x compulsory; within {DRAM_TARGET:.2f}x "
                  f"compulsory, with partial sums in the accumulators, the passes alone take at least {passes:,.0f} "
                  f"cycles ({passes / r['roofline']:.3f}x the roofline), {spans:,.0f} with each matmul's first load "
                  f"and last store ({spans / r['roofline']:.3f}x); with partial sums in vec as well, at least "
                  f"{spans_vec / r['roofline']:.3f}x")
            for objective in OBJECTIVES[1:]:        # latency is the run above
                o = bitlinear_layer(seq, dlegion, objective)
                print(f"    schedules chosen for {objective} (--objective {objective}): {o['cycles']:,} cycles "
                      f"({o['cycles'] / o['roofline']:.3f}x), DRAM {o['dram'] / 1e6:.1f} MB ({o['dram'] / o['compulsory']:.3f}x)")
        for row in r["rows"]:
            print(f"    {row['region']:<48} {row['cycles']:>10,} / {row['roofline_cycles']:>10,.0f} "
                  f"({row['cycles'] / row['roofline_cycles']:.2f}x, {row['roofline_bound']}-bound)")
    tl = simulate(compiled_gemm(gemm, ws32), ws32)
    matrix = tl.counters["busy_matrix"]
    print(f"int8 GEMM {gemm}^3 on ws-32 (compiled): the matrix queue busy {matrix:,} cycles, the whole program "
          f"{tl.cycles:,} with its DRAM loads and stores"
          + (f"; SCALE-Sim v3 {SCALE_SIM_256:,} compute cycles (matrix {matrix / SCALE_SIM_256 - 1:+.1%}, "
             f"whole {tl.cycles / SCALE_SIM_256 - 1:+.1%}; target within 5%)" if gemm == 256 else ""))
    program = compiled_gemm(big, ws32)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        tl = simulate(program, ws32)
        times.append(time.perf_counter() - t0)
    print(f"timing the {big}^3 GEMM on ws-32: {statistics.median(times):.3f} s median of 3 "
          f"({len(program.instrs):,} instructions, {tl.cycles:,} cycles; target under 1 s)")
    for M, K, N in ((1, 2560, 64), (1, 6912, 64), (1, 2560, 640)):
        split, plain = narrow_cycles(M, K, N, dlegion, True), narrow_cycles(M, K, N, dlegion, False)
        print(f"K split over Legions, int32 GEMM {M}x{K}x{N} w2 on {dlegion.name}: {split:,} cycles, "
              f"{plain:,} with --no-ksplit ({plain / split:.2f}x)")


if __name__ == "__main__":
    main()
