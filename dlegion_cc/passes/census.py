"""Where each of a model's matmuls runs: on the systolic arrays (in which mode) or in fp32 on the
vector unit (and why), for the line ``dlegion-cc`` ends with.

The matmul-like nodes (MatMul, Gemm, MatMulNBits, MatMulInteger, QLinearMatMul; QDQ and BitNet
matmuls are MatMuls) are counted as the importer leaves the graph, then found again by name in the
graph the passes leave: a recognized or quantized one is a ``dlegion.QMatMul`` under its own name
(fused ones joined by ``+``), a quantized attention product a ``dlegion.AttnMatMul``. A node the
passes made dead (nothing reads it) is not counted.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from dlegion_cc.ir import DLEGION, Graph, Node

MATMULS = {("", "MatMul"), ("", "Gemm"), ("com.microsoft", "MatMulNBits"), ("", "MatMulInteger"),
           ("com.microsoft", "MatMulInteger"), ("", "QLinearMatMul")}
INTEGER = {"MatMulInteger", "QLinearMatMul"}    # lowered on the arrays as they are, in w8
NAMED = 3                                       # fp32 matmuls named in the line, then "and N more"
PRODUCT = "activation x activation"


@dataclass
class Census:
    """The model's matmuls by name, in graph order; after ``take``, where each runs."""
    names: list[str] = field(default_factory=list)
    arrays: dict[str, str] = field(default_factory=dict)     # name -> mode
    fp32: dict[str, str] = field(default_factory=dict)       # name -> why

    def start(self, graph: Graph) -> None:
        """Note the matmuls of the graph as imported (forgetting any earlier compile's)."""
        self.names = [n.name for n in graph.nodes if (n.domain, n.op) in MATMULS]
        self.arrays, self.fp32 = {}, {}

    def take(self, graph: Graph, arch, skipped=()) -> None:
        """Find each matmul in the graph the passes left."""
        final: dict[str, Node] = {}
        for n in graph.nodes:
            final[n.name] = n
            if n.domain == DLEGION and n.op == "QMatMul" and "segments" in n.attrs:
                final.update((part, n) for part in n.name.split("+"))
        for name in self.names:
            node = final.get(name)
            if node is None:
                continue
            mode = _array_mode(node, arch)
            if mode:
                self.arrays[name] = mode
            else:
                self.fp32[name] = "--quantize-skip" if name in skipped else _why_fp32(graph, node)

    def line(self) -> str:
        total = len(self.arrays) + len(self.fp32)
        if not total:
            return "no matmuls"
        modes = Counter(self.arrays.values())
        how = ", ".join(f"{c} {m}" if len(modes) > 1 else m for m, c in sorted(modes.items()))
        text = f"{len(self.arrays)} of {total} matmuls on the arrays" + (f" ({how})" if how else "")
        if not self.fp32:
            return text
        # the ones a user can act on first: float weights (--quantize), then products of activations
        first = sorted(self.fp32.items(), key=lambda item: item[1] == PRODUCT)
        named = [f"{n} ({why})" for n, why in first[:NAMED]]
        more = len(self.fp32) - NAMED
        return f"{text}; {len(self.fp32)} in fp32 on the vector unit: {', '.join(named)}" + \
            (f", and {more} more" if more > 0 else "")


def _array_mode(node: Node, arch) -> str | None:
    """The weight mode a node runs in on the arrays, or None when it runs on the vector unit."""
    from dlegion_cc.lower.qmatmul import pick_mode
    if node.domain == DLEGION and node.op == "QMatMul":
        try:
            return pick_mode(arch, node.attrs.get("mode", "w8"))
        except ValueError:
            return node.attrs.get("mode", "w8")
    if (node.domain == DLEGION and node.op == "AttnMatMul") or (not node.domain and node.op in INTEGER):
        return "w8"
    return None


def _why_fp32(graph: Graph, node: Node) -> str:
    values = [graph.values[i] for i in node.inputs[:2] if i in graph.values]
    if any(np.dtype(v.dtype) != np.float32 for v in values):
        return f"{np.dtype(values[0].dtype).name} operands"
    if all(v.stored is None for v in values):
        return PRODUCT
    return "float weights"
