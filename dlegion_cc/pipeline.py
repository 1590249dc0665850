"""The whole compiler, one step a line."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from isa.arch import Arch
from isa.program import Program
from isa.progress import SILENT, Progress
from dlegion_cc.errors import CompileError
from dlegion_cc.importer import import_model
from dlegion_cc.ir import Graph
from dlegion_cc.lower.context import Switches
from dlegion_cc.lower.graph import lower_graph
from dlegion_cc.lower.schedules import Schedules
from dlegion_cc.passes.attention import QuantizeAttention
from dlegion_cc.passes.attnoperands import QuantizeInRowKernel, QuantizeOperandsInPlace
from dlegion_cc.passes.bitlinear import RecognizeBitLinear
from dlegion_cc.passes.causal import CausalSkip
from dlegion_cc.passes.fuse import FuseRowwise
from dlegion_cc.passes.gqa import SplitGroupedHeads
from dlegion_cc.passes.rope import SplitRotaryHalves
from dlegion_cc.passes.dynamic_int8 import RecognizeDynamicInt8
from dlegion_cc.passes.legalize import Legalize
from dlegion_cc.passes.matmul_nbits import RecognizeMatMulNBits
from dlegion_cc.passes.gated import GateInDrain
from dlegion_cc.passes.residual import ResidualInDrain
from dlegion_cc.passes.siblings import FuseSiblings
from dlegion_cc.passes.qdq import RecognizeQDQMatMul
from dlegion_cc.passes.census import Census
from dlegion_cc.passes.quantize import QuantizeWeights

# Graph passes in order; each has a ``name`` (for --print-ir-after) and ``run(graph, options)``.
PASSES = (
    RecognizeBitLinear(),       # absmax-quantized x ternary MatMul -> one w2 matmul
    RecognizeDynamicInt8(),     # MatMulInteger + Cast + Mul(scale) -> one w8 matmul
    RecognizeMatMulNBits(),     # blockwise 4-bit weights -> per-row int8 x w4, drained per block
    RecognizeQDQMatMul(),       # DQ(int activations) x DQ(int weights) MatMul -> one w8/w4 matmul
    QuantizeWeights(),          # --quantize: float-weight MatMul/Gemm -> per-token int8 x w8/w4/w2
    FuseSiblings(),             # matmuls sharing their input -> one, each Legion a slice of each
    GateInDrain(),              # ReLU(gate)^2 * up of a fused gate/up matmul -> in its drain
    ResidualInDrain(),          # Add(residual, matmul) -> the residual added in the matmul's drain
    CausalSkip(),               # attention blocks a constant causal mask wipes out are not computed
    SplitGroupedHeads(),        # query heads read their group's key/value head, not a copy of it
    SplitRotaryHalves(),        # rotary embeddings by halves of q, not a rotated copy
    QuantizeAttention(),        # float QK^T and PV -> int8 on the arrays (--attention int8)
    QuantizeOperandsInPlace(),  # K smoothed and quantized in one pass, V by columns as it is
    FuseRowwise(),              # runs of row-local ops -> one kernel per row block
    QuantizeInRowKernel(),      # Q's rotary halves quantized in their kernel, stored int8
    Legalize(),                 # every remaining node has a lowering and supported dtypes
)
PASS_NAMES = ("import",) + tuple(p.name for p in PASSES)


@dataclass(frozen=True)
class Options:
    arch: Arch
    dims: dict = field(default_factory=dict)
    # Ablations: each turns off one feature, to measure what it is worth.
    multicast: bool = True        # off: every Legion loads its own copy of the activations
    accumulators: bool = True     # off: schedule as if the parallel accumulators were absent
    sparsity: bool = True         # off: dense schedule, no block masks
    fusion: bool = True           # off: no FuseSiblings (multi-matrix fusion) and no FuseRowwise
    prefetch: bool = True         # off: a matmul's first weights (a float product's first loads) wait for the row kernel before it
    transfers: bool = True        # off: no activations forwarded Legion to Legion; read from DRAM again
    ksplit: bool = True           # off: no K split over the Legions (ksplit.py)
    row_blocks: bool = True       # off: no matmul and row kernel pipelined by row blocks (lower/rowblocks.py)
    head_groups: bool = True      # off: attention's products and softmax over all heads at once (lower/heads.py)
    cache_alias: bool = True      # off: a cache input is copied into its present output (lower/context.py)
    # on: nodes end in waits for what the next ones share instead of barriers (lower/overlap.py).
    # Off by default until the pass is cheap at full size: at sequence 512 a 2B4T layer with its
    # 128,256-token lm_head took over 15x the compile time with it, for under 1% fewer cycles.
    overlap: bool = False
    # What quantized-matmul schedules are chosen for: "latency", "energy" or "edp" (qplan.OBJECTIVES).
    objective: str = "latency"
    # Quantized matmuls' schedules: pinned ones in, those given out (None: all searched).
    schedules: Schedules | None = field(default=None, compare=False)
    # Attention's float products: "int8" on the arrays, "fp32" on the vector lanes (ONNX's
    # semantics), None: int8 where the model's projections are quantized (passes/attention.py).
    attention: str | None = None
    # --quantize: float MatMul/Gemm weights quantized to "w8", "w4" or "w2" (passes/quantize.py),
    # except the nodes named in ``quantize_skip``; None: they stay fp32.
    quantize: str | None = None
    quantize_skip: tuple[str, ...] = ()
    # Filled by the compile: where each of the model's matmuls runs (passes/census.py).
    census: Census = field(default_factory=Census, compare=False)

    def switches(self) -> Switches:
        return Switches(self.multicast, self.accumulators, self.sparsity, self.prefetch,
                        overlap=self.overlap, objective=self.objective, transfers=self.transfers, ksplit=self.ksplit,
                        row_blocks=self.row_blocks, head_groups=self.head_groups, cache_alias=self.cache_alias)


Hook = Callable[[str, Graph], None]


def compile_model(model: str | Path, options: Options, data_file: str | None = None,
                  after_pass: Hook | None = None, progress: Progress = SILENT,
                  data_out: IO[bytes] | None = None) -> tuple[Graph, Program]:
    """Compile ``model``. The program names ``data_file`` for its constants, whose bytes are
    written to ``data_out`` as they are made (the program then carries none), else kept in
    ``Program.data``."""
    graph = graph_of(model, options, after_pass, progress)
    program = lower_graph(graph, options.arch, data_file, options.switches(),  # tiles, kernels, DMA, sync
                          progress, data_out, options.schedules)
    return graph, program


def graph_of(model: str | Path, options: Options, after_pass: Hook | None = None,
             progress: Progress = SILENT) -> Graph:
    """The graph the passes leave, ready to lower: what no machine parameter changes but the
    switches (what fails here fails on every machine)."""
    graph = import_model(model, options.dims, progress)  # load, check, infer shapes, fold constants
    _hook(after_pass, "import", graph)
    _check_skips(graph, options)
    options.census.start(graph)
    chosen = passes(options)
    with progress.task("passes", len(chosen)) as advance:
        for p in chosen:                                # recognize patterns, then legalize
            p.run(graph, options)
            graph.remove_dead()
            _hook(after_pass, p.name, graph)
            advance()
    options.census.take(graph, options.arch, options.quantize_skip)
    return graph


def _check_skips(graph: Graph, options: Options) -> None:
    """Every node ``--quantize-skip`` names is a MatMul or Gemm of the model."""
    names = {n.name for n in graph.nodes if not n.domain and n.op in ("MatMul", "Gemm")}
    for name in options.quantize_skip:
        if name not in names:
            shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
            raise CompileError(f"{graph.source}: --quantize-skip {name!r}: no MatMul or Gemm of that name "
                               f"(its MatMul and Gemm nodes: {shown or 'none'})")


FUSIONS = (FuseSiblings, GateInDrain, ResidualInDrain, FuseRowwise)


def passes(options: Options) -> tuple:
    """The graph passes to run: all of them, or all but the fusions (``--no-fusion``)."""
    return PASSES if options.fusion else tuple(p for p in PASSES if not isinstance(p, FUSIONS))


def _hook(hook: Hook | None, name: str, graph: Graph) -> None:
    if hook is not None:
        hook(name, graph)
