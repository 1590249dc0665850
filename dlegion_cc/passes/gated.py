"""ReLU(gate)^2 * up in the drain of the fused gate/up matmul.

A gated MLP's gate and up projections fuse into one ``dlegion.QMatMul`` (``siblings.py``)
whose outputs meet again at once: ``Mul(Pow(Relu(gate), 2), up)``. Stored apart, the two fp32
products are written to DRAM and read back a row at a time by the kernel that multiplies them,
twice the bytes of their product. Here the matmul takes that product over as its one output
(attribute ``gated``: which segment is the gate); its lowering lays every Legion's gate and up
columns out in pairs of granules side by side (``qmatmul.gated_major``), so that each tile's
drain holds both, and multiplies them on the vector unit before the store (``qtiles``): the
same fp32 operations in the graph's order, so the product is the one the kernel made.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from isa.arch import MODE_TILES
from dlegion_cc.ir import DLEGION, Graph, Node
from dlegion_cc.lower.elementwise import squares


@dataclass
class GateInDrain:
    name: str = "gate-in-drain"

    def run(self, graph: Graph, options=None) -> None:
        if options is None:         # the granule is the machine's
            return
        granule = gate_granule(options.arch)
        for node in [n for n in graph.nodes if n.domain == DLEGION and n.op == "QMatMul"]:
            found = _gated(graph, node, granule * options.arch.legions)
            if found is not None:
                gate, tail = found
                node.attrs["gated"] = gate
                node.outputs = [tail[-1].outputs[0]]
                for n in tail:
                    graph.nodes.remove(n)


def gate_granule(arch) -> int:
    """Columns of a gate or up granule: half the widest weight window, so a tile of whole
    windows holds whole pairs."""
    return arch.array * max(MODE_TILES[m] for m in arch.modes) // 2


def _gated(graph: Graph, node: Node, unit: int) -> tuple[int, list[Node]] | None:
    """(the gate's segment, the Relu, Pow and Mul after it) when ``node`` is a fused matmul of
    two equal segments, each a multiple of ``unit`` columns (a granule on every Legion), whose
    only use is ReLU(one)^2 * other; else None."""
    segs = node.attrs.get("segments")
    if (not segs or len(segs) != 2 or segs[0] != segs[1] or segs[0] % unit
            or node.attrs.get("requant") is not None):
        return None
    for gate in (0, 1):
        g, u = node.outputs[gate], node.outputs[1 - gate]
        relu = graph.only_user(g)
        power = relu and relu.op == "Relu" and not relu.domain and graph.only_user(relu.outputs[0])
        if not power or power.op != "Pow" or power.domain or power.inputs[0] != relu.outputs[0]:
            continue
        exp = graph.const(power.inputs[1])
        if exp is None or np.size(exp) != 1 or not squares("Pow", float(np.asarray(exp).reshape(()))):
            continue
        mul = graph.only_user(power.outputs[0])
        if (mul is None or mul.op != "Mul" or mul.domain or sorted(mul.inputs) != sorted([power.outputs[0], u])
                or graph.only_user(u) is not mul or graph.values[mul.outputs[0]].shape != graph.values[u].shape):
            continue
        return gate, [relu, power, mul]
    return None
