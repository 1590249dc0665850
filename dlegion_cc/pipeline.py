"""The whole compiler, one step a line."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from isa.arch import Arch
from isa.program import Program
from dlegion_cc.importer import import_model
from dlegion_cc.ir import Graph
from dlegion_cc.lower.graph import lower_graph
from dlegion_cc.passes.bitlinear import RecognizeBitLinear
from dlegion_cc.passes.legalize import Legalize

# Graph passes in order; each has a ``name`` (for --print-ir-after) and ``run(graph, options)``.
PASSES = (
    RecognizeBitLinear(),       # absmax-quantized x ternary MatMul -> one w2 matmul
    Legalize(),                 # every remaining node has a lowering and supported dtypes
)
PASS_NAMES = ("import",) + tuple(p.name for p in PASSES)


@dataclass(frozen=True)
class Options:
    arch: Arch
    dims: dict = field(default_factory=dict)


Hook = Callable[[str, Graph], None]


def compile_model(model: str | Path, options: Options, data_file: str | None = None,
                  after_pass: Hook | None = None) -> tuple[Graph, Program]:
    graph = import_model(model, options.dims)          # load, check, infer shapes, fold constants
    _hook(after_pass, "import", graph)
    for p in PASSES:                                    # recognize patterns, then legalize
        p.run(graph, options)
        graph.remove_dead()
        _hook(after_pass, p.name, graph)
    program = lower_graph(graph, options.arch, data_file)  # tiles, vector kernels, DMA, sync
    return graph, program


def _hook(hook: Hook | None, name: str, graph: Graph) -> None:
    if hook is not None:
        hook(name, graph)
