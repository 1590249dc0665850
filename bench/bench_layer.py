"""One BitNet-2B4T decoder layer on dlegion-8x8: program size against the ISA's budget, and
how fast the compiler and the timing model handle it.

    python bench/bench_layer.py [--seq 512] [--arch dlegion-8x8] [--no-prefetch] [--attention int8|int8x2|fp32]
                                [--overlap] [--error] [--stack]

Prints the instruction count by family (budget: 20,000 at sequence 512), the simulated
cycles and where they go (the regions of quantized matmuls, of fp32 matmuls on the vector
lanes, and of the other vector kernels and copies), and the wall time of compiling and of
timing the program (median of 3). Then the layer against its bound, max(matmul cycles, DRAM
cycles): every BitLinear matmul in w2 and every attention product in w8 (only the causal
lower triangle) at the arrays' peak, the ternary weights and the layer's fp32 input and
output at the DRAM rate (target: at most 1.25x); and the other attention modes beside it
(int8 and fp32 for int8x2, else the other of the two: the ablation), and the layer compiled the other way about overlap (``dlegion-cc --overlap``:
nodes end in waits, not barriers; off by default, as in the compiler). ``--stack`` times the BitLinear stack instead (below). ``--error`` also emulates both programs on the same inputs and prints the
relative L2 distance of the layer's output (the residual stream before the final norm) with
int8 (or int8x2) attention from the fp32-attention program's (target: at most 1e-2). ``--no-row-blocks``
compiles without matmuls and row kernels pipelined by row blocks (``lower/rowblocks.py``). ``--kernels``
prints the layer region by region (below).

``--stack`` (default sequence 256): the layer's six BitLinear projections without attention,
Q/K/V on the quantized input, gate/up on the quantized Q, down on the quantized
ReLU(gate)^2 * up, against the roofline of their matmuls in w2 (target: at most 1.12x), as
compiled by default and with ``--overlap``, with the busiest Legion's array cycles. With
``--no-row-blocks`` also the same programs with their row kernels (the quantizations between the
matmuls) cut to one element each: what hiding the quantizations entirely would leave.

``--kernels``: each region of the layer (a matmul node, a fused row kernel, a copy) with its
cycles (first start to last completion), its busiest Legion's vector queue, its vector roofline
(lane operations over every lane of every Legion; a transcendental counts its cycles), its DRAM
bytes and their roofline at the DRAM rate, its array MACs at the peak of their mode and its busiest
Legion's passes (``mat max``: the MAC roofline with each pass's fill and drain, and the Legions' uneven
shares): where a region runs far above the largest of its rooflines, its queues wait on each other.
The layer's line gives the same for the whole layer: its busiest Legion's passes against the bound,
and the cycles left, in which those arrays idle.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import fields, replace
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).parent.parent))

import numpy as np                                            # noqa: E402
import onnx                                                   # noqa: E402

from isa import arch as arch_mod                               # noqa: E402
from isa.arch import MODE_TILES                               # noqa: E402
from isa.instructions import MatMul, family                   # noqa: E402
from dlegion_cc.pipeline import Options, compile_model        # noqa: E402
from dlegion_cc.passes.attention import MODES as ATTENTION_MODES  # noqa: E402
from dlegion_cc.lower.qmatmul import TWO_PIECE_TERMS        # noqa: E402
from models.bitnet import BitLinear, build_bitnet, preset, save  # noqa: E402
from models.decoder import relu2                              # noqa: E402
from models.graph import FLOAT, GraphBuilder, tensor_info      # noqa: E402
from runtime.emulator import run                              # noqa: E402
from runtime.costs import Env, cost                           # noqa: E402
from runtime.report import regions_by_name                    # noqa: E402
from runtime.timing import _masks, simulate                           # noqa: E402

BUDGET = 20_000
STACK_TARGET = 1.12


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


def _layer_model(seq: int, path: Path) -> str:
    """The generated layer, its output (the residual stream the final norm reads) made a graph
    output too; returns that value's name."""
    model = build_bitnet(preset("2b4t", layers=1, seq=seq, vocab=512))
    norm = next(n for n in model.graph.node if n.name.startswith("model.norm/"))
    layer_out = norm.input[0]
    shape = [1, seq, preset("2b4t").hidden]
    model.graph.output.append(onnx.helper.make_tensor_value_info(layer_out, onnx.TensorProto.FLOAT, shape))
    save(model, path, external_data=True)
    return layer_out


def bound(graph, machine) -> dict:
    """The layer's bound: BitLinear MACs in w2 and attention MACs in w8 (causal lower triangle
    where a mask makes the rest dead; an int8x2 product's three products of pieces) at the arrays' peak, ternary weights and the layer's fp32
    input and output at the DRAM rate."""
    per_cycle = machine.legions * machine.cores * machine.array ** 2
    linear = attention = weight_bytes = 0
    for node in graph.nodes:
        if node.op == "QMatMul" and node.domain == "dlegion" and np.ndim(node.attrs["weight"]) == 2:
            K, N = np.shape(node.attrs["weight"])
            M = int(np.prod(graph.values[node.inputs[0]].shape[:-1]))
            linear += M * K * N
            weight_bytes += K * N * 2 // 8
        elif node.op == "AttnMatMul" or (node.op == "MatMul" and all(graph.values[i].stored is None
                                                                     for i in node.inputs)):
            a, out = graph.values[node.inputs[0]].shape, graph.values[node.outputs[0]].shape
            macs = int(np.prod(out)) * a[-1] * (len(TWO_PIECE_TERMS) if len(node.inputs) > 4 else 1)
            live = node.attrs.get("dead")
            live = node.attrs.get("zero_a") if live is None else live
            if live is not None:        # the causal triangle's share of the product
                macs = macs * (1 - float(np.mean(live)))
            attention += macs
    cycles = linear / (per_cycle * MODE_TILES["w2"]) + attention / (per_cycle * MODE_TILES["w8"])
    return {"matmul": cycles, "weights": weight_bytes}


def _bound_cycles(graph, machine, seq: int) -> tuple[float, float]:
    b = bound(graph, machine)
    hidden = preset("2b4t").hidden
    dram = (b["weights"] + 2 * seq * hidden * 4) / machine.derived.dram_bytes_per_cycle
    return b["matmul"], dram


def _stack_model(seq: int, path: Path) -> None:
    """Q, K, V, gate, up and down of one 2B4T layer, each after absmax quantization, ReLU^2
    between gate and up; no attention (Q feeds the MLP)."""
    config = preset("2b4t", layers=1, seq=seq)
    spec, b = config.spec(), GraphBuilder()
    proj = BitLinear(config, np.random.default_rng(config.seed))
    h, kv = spec.hidden, spec.kv_heads * spec.head_dim
    xq = proj.prepare(b, "x")
    q, k, v = (proj.project(b, xq, name, h, n) for name, n in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)))
    qq = proj.prepare(b, q)
    up = proj.project(b, qq, "up_proj", h, spec.ffn)
    hidden = b.op("Mul", relu2(b, proj.project(b, qq, "gate_proj", h, spec.ffn)), up)
    down = proj.project(b, proj.prepare(b, hidden), "down_proj", spec.ffn, h)
    outs = [tensor_info(name, FLOAT, [1, seq, n]) for name, n in ((k, kv), (v, kv), (down, h))]
    save(b.model([tensor_info("x", FLOAT, [1, seq, h])], outs), path, external_data=True)


def _stack(seq: int, machine, prefetch: bool, row_blocks: bool = True) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stack.onnx"
        _stack_model(seq, path)
        runs = {ov: compile_model(path, Options(machine, prefetch=prefetch, overlap=ov,
                                                             row_blocks=row_blocks)) for ov in (True, False)}
    roofline = bound(runs[False][0], machine)["matmul"]
    timelines = {ov: simulate(program, machine) for ov, (_, program) in runs.items()}
    cycles = {ov: t.cycles for ov, t in timelines.items()}
    arrays = _arrays_busy(timelines[False])
    print(f"2B4T BitLinear stack (Q, K, V, gate, up, down with absmax quantization, ReLU^2), sequence {seq}, "
          f"{machine.name}: {len(runs[False][1].instrs):,} instructions, {cycles[False]:,} cycles, "
          f"{cycles[False] / roofline:.3f}x its matmul roofline of {roofline:,.0f} (target <= {STACK_TARGET}x), "
          f"the busiest Legion's arrays busy {arrays:,} ({arrays / roofline:.3f}x); "
          f"with --overlap: {cycles[True]:,} cycles, {cycles[True] / roofline:.3f}x")
    if not row_blocks:
        free = {ov: simulate(_without_row_kernels(program), machine).cycles for ov, (_, program) in runs.items()}
        print(f"  its row kernels cut to one element each (their waits and DRAM round trips stay, their work "
              f"goes): {free[False]:,} cycles, {free[False] / roofline:.3f}x; with --overlap: {free[True]:,} "
              f"cycles, {free[True] / roofline:.3f}x")


def _without_row_kernels(program):
    """``program`` with every instruction of its regions without passes (the row kernels between
    the matmuls) cut to one row of one element: what hiding their work entirely would leave."""
    instrs = list(program.instrs)
    for members in regions_by_name(program).values():
        if any(isinstance(instrs[k], MatMul) for k in members):
            continue
        for k in members:
            if {"rows", "cols"} <= {f.name for f in fields(instrs[k])}:
                instrs[k] = replace(instrs[k], rows=1, cols=1)
    return replace(program, instrs=instrs)


def _arrays_busy(timeline) -> int:
    """The cycles the busiest Legion's arrays pass (the rest of the program they idle)."""
    return max((c for (_, queue), c in timeline.busy.items() if queue == "mat"), default=0)


@click.command()
@click.option("--seq", default=None, type=int, help="sequence length [default: 512; 256 with --stack]")
@click.option("--arch", "arch_name", default="dlegion-8x8", show_default=True)
@click.option("--prefetch/--no-prefetch", default=True, show_default=True,
              help="Weights load during the row kernel before each matmul (dlegion-cc --no-prefetch turns it off).")
@click.option("--attention", type=click.Choice(ATTENTION_MODES), default="int8", show_default=True,
              help="Attention's products on the arrays in int8 (the default for BitNet), in two int8 pieces per "
                   "operand, or on the vector lanes.")
@click.option("--overlap/--no-overlap", default=False, show_default=True,
              help="Nodes end in waits for what the next ones share, not barriers (dlegion-cc --overlap).")
@click.option("--error", is_flag=True,
              help="Emulate the quantized and the fp32 attention and print the quantized one's error.")
@click.option("--stack", is_flag=True, help="Time the BitLinear stack without attention instead of the layer.")
@click.option("--kernels", is_flag=True, help="Print the layer's regions with their rooflines.")
@click.option("--row-blocks/--no-row-blocks", default=True, show_default=True,
              help="Pipeline matmuls and row kernels by row blocks (off: the ablation).")
def main(seq: int | None, arch_name: str, prefetch: bool, attention: str, overlap: bool, error: bool,
         stack: bool, kernels: bool, row_blocks: bool) -> None:
    machine = arch_mod.load(arch_name)
    if stack:
        _stack(seq or 256, machine, prefetch, row_blocks)
        return
    seq = seq or 512
    others = {"int8": ["fp32"], "fp32": ["int8"]}.get(attention, ["int8", "fp32"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "layer.onnx"
        layer_out = _layer_model(seq, path)
        t_compile, (graph, program) = _median_time(
            lambda: compile_model(path, Options(machine, prefetch=prefetch, attention=attention, overlap=overlap, row_blocks=row_blocks)), runs=1)
        other_programs = {other: compile_model(path, Options(machine, prefetch=prefetch, attention=other,
                                                             overlap=overlap, row_blocks=row_blocks))[1]
                          for other in others}
        _, barriers = compile_model(path, Options(machine, prefetch=prefetch, attention=attention, overlap=not overlap, row_blocks=row_blocks))
    t_time, timeline = _median_time(lambda: simulate(program, machine))
    counts = Counter(family(type(i)) for i in program.instrs)
    n = len(program.instrs)
    print(f"2B4T layer, sequence {seq}, {machine.name}, attention {attention}: {n:,} instructions "
          f"({n / BUDGET:.2f}x the {BUDGET:,} budget)")
    print("  by family: " + ", ".join(f"{f} {c:,}" for f, c in counts.most_common()))
    print(f"  {timeline.cycles:,} cycles; compile {t_compile:.1f} s; timing model {t_time:.2f} s "
          f"({timeline.cycles / t_time / 1e6:.1f} M simulated cycles/s, {n / t_time:,.0f} instructions/s)")
    print("  by region: " + ", ".join(f"{kind} {c:,} ({c / timeline.cycles:.0%})"
                                      for kind, c in _cycles_by_kind(timeline).most_common()))
    matmul, dram = _bound_cycles(graph, machine, seq)
    limit = max(matmul, dram)
    layer = _layer_cycles(timeline)
    other_layers = {other: _layer_cycles(simulate(p, machine)) for other, p in other_programs.items()}
    flipped = _layer_cycles(simulate(barriers, machine))
    arrays, streamed = _layer_arrays_busy(timeline, machine)
    print(f"  the layer alone (without the embedding and the fp32 lm head): {layer:,} cycles, {layer / limit:.2f}x its "
          f"bound of {limit:,.0f} (matmuls {matmul:,.0f}, DRAM {dram:,.0f}; target <= 1.25x), the busiest Legion's "
          f"arrays busy {arrays:,} ({arrays / limit:.2f}x by themselves: rows streaming through its passes {streamed:,}, "
          f"{streamed - matmul:+,.0f} on the matmuls' bound for attention's whole diagonal blocks, windows left part "
          f"empty and Legions loaded unevenly, and the passes' fill and drain {arrays - streamed:,}) and idle "
          f"{layer - arrays:,}; "
          + "; ".join(f"attention {other} (ablation): {c:,} cycles, {c / limit:.2f}x" for other, c in other_layers.items())
          + f"; {'no ' if overlap else 'with '}overlap: {flipped:,} cycles, {flipped / limit:.2f}x")
    if kernels:
        _print_kernels(timeline, machine)
    if error:
        quantized = other_programs["int8"] if attention == "fp32" else program
        _print_error(machine, quantized, other_programs.get("fp32", program), layer_out,
                     "int8" if attention == "fp32" else attention)


def _print_kernels(timeline, machine) -> None:
    """The layer's regions in program order: cycles against each one's rooflines."""
    tasks, env = timeline.program.instrs, Env(tuple(timeline.program.tensors), _masks(timeline.program))
    lanes, peak = machine.vector_lanes * machine.legions, machine.derived.macs_per_cycle
    print(f"  {'region':<58} {'cycles':>9} {'vec max':>9} {'vec roof':>9} {'DRAM MB':>8} {'DRAM roof':>9} "
          f"{'MAC roof':>9} {'mat max':>9}")
    for name, members in _layer_regions(timeline):
        start, done = _span(timeline, members)
        most = {q: _busiest(timeline, members, q) for q in ("vec", "mat")}
        sums, mac_cycles = Counter(), 0.0
        for k in members:
            c = cost(tasks[k], machine, env)
            sums.update(c.counters)
            mac_cycles += c.counters["macs"] / peak[c.detail["mode"]] if c.detail else 0.0
        nbytes = sums["dram_read_bytes"] + sums["dram_write_bytes"]
        print(f"  {name[:58]:<58} {int(done - start):>9,} {most['vec']:>9,} "
              f"{sums['vector_ops'] / lanes:>9,.0f} {nbytes / 1e6:>8.2f} "
              f"{nbytes / machine.derived.dram_bytes_per_cycle:>9,.0f} {mac_cycles:>9,.0f} {most['mat']:>9,}")


def _layer_arrays_busy(timeline, machine) -> tuple[int, int]:
    """The busiest Legion's arrays in the layer: cycles busy, and of those the cycles its passes
    stream rows (each pass's M; the rest is the passes' fill and drain)."""
    members = np.concatenate([np.asarray(m) for _, m in _layer_regions(timeline)])
    mat = _on_queue(timeline, members, "mat")
    per = _per_legion(timeline, mat)
    legion = int(per.argmax())
    tasks, program = timeline.program.instrs, timeline.program
    env = Env(tuple(program.tensors), _masks(program))
    passes = (tasks.source[tasks.origin[k]] for k in mat[tasks.legion[mat] == legion].tolist())
    streamed = sum(cost(i, machine, env).detail["passes_max"] * i.M for i in passes if isinstance(i, MatMul))
    return int(per[legion]), streamed


def _busiest(timeline, members, queue: str) -> int:
    """The busiest Legion's cycles on ``queue`` among the tasks ``members``."""
    return int(_per_legion(timeline, _on_queue(timeline, members, queue)).max(initial=0))


def _on_queue(timeline, members, queue: str) -> np.ndarray:
    """The tasks among ``members`` on a Legion's ``queue``."""
    tasks, members = timeline.program.instrs, np.asarray(members)
    return members[(np.array(tasks.names)[tasks.queue[members]] == queue) & (tasks.legion[members] >= 0)]


def _per_legion(timeline, tasks_on_queue: np.ndarray) -> np.ndarray:
    """Each Legion's cycles busy with ``tasks_on_queue``."""
    legion = timeline.program.instrs.legion[tasks_on_queue]
    return np.bincount(legion, timeline.free[tasks_on_queue] - timeline.start[tasks_on_queue])


def _layer_regions(timeline) -> list:
    """The regions from the layer's first to the lm head, in program order."""
    regions = [(name, members) for name, members in regions_by_name(timeline.program).items() if members]
    first = next(k for k, (name, _) in enumerate(regions) if "model.layers." in name)
    last = next(k for k, (name, _) in enumerate(regions) if name.startswith("lm_head"))
    return regions[first:last]


def _layer_cycles(timeline) -> int:
    """From the first region of the decoder layer to the first of the lm head."""
    spans = [(name, _span(timeline, members)) for name, members in regions_by_name(timeline.program).items() if members]
    start = min(s for name, (s, _) in spans if "model.layers." in name)
    end = min(s for name, (s, _) in spans if name.startswith("lm_head"))
    return int(end - start)


def _span(timeline, members) -> tuple[float, float]:
    return float(timeline.start[members].min()), float(timeline.done[members].max())


def _print_error(machine, int8_program, fp32_program, layer_out: str, mode: str = "int8") -> None:
    """The layer output of the ``mode``-attention program against the fp32-attention one's, on
    the same random inputs."""
    from runtime.emulator import random_inputs
    inputs = random_inputs(int8_program, 0)
    t0 = time.perf_counter()
    a = run(int8_program, machine, inputs, races=False, keep=False).outputs
    b = run(fp32_program, machine, inputs, races=False, keep=False).outputs
    rel = lambda x, y: float(np.linalg.norm(x.astype(np.float64) - y) / np.linalg.norm(y.astype(np.float64)))  # noqa: E731
    same = float(np.mean(a["logits"].argmax(-1) == b["logits"].argmax(-1)))
    print(f"  {mode} attention against fp32 attention (emulated, {time.perf_counter() - t0:.0f} s): layer output "
          f"relative L2 {rel(a[layer_out], b[layer_out]):.2e} (target <= 1e-2), logits {rel(a['logits'], b['logits']):.2e}, "
          f"top-1 the same at {same:.1%} of positions")


if __name__ == "__main__":
    main()
