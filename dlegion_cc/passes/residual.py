"""A residual Add in the drain of the quantized matmul before it.

A decoder layer adds each block's last projection to the residual stream:
``Add(residual, QMatMul(...))``. Apart, the matmul stores its fp32 product and the row kernel
of the Add loads it again beside the residual rows. Here the matmul takes the sum over as its
output and the residual as its fourth input (after the row scale and the zero point, "" where
it has none): each tile's residual rows load into its result slot and its one drain adds to
them (``qtiles``), so the product is neither stored nor loaded again. One fp32 addition of the
same two values, so the sum is the one the Add made. Only a plain matmul's single output,
drained once (one group of K rows), read by the Add alone, and a residual of the same shape;
not where the sum's readers would place it into another tensor (a Concat or a view), whose
layout the drain's residual rows would not follow.

The 2B4T layer on dlegion-8x8 (o_proj and down_proj): at sequence 128 218,698 -> 216,733
cycles (the rows after down_proj's last pass: 2.6 -> 1.3 MB of DRAM), at 512 801,743 ->
794,697. A plan with one result slot waits for a tile's stores before the next tile's
residual rows load: with tiles of few passes that costs more than it saves (a
512 x 1024 block in row blocks of 128: 40,446 -> 42,079 cycles).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlegion_cc.ir import DLEGION, Graph, Node
from dlegion_cc.lower.context import VIEW_OPS

# Readers that place their input inside another tensor (``Lowering.result``): a Concat, a view.
PLACING = VIEW_OPS | {"Concat"}


@dataclass
class ResidualInDrain:
    name: str = "residual-in-drain"

    def run(self, graph: Graph, options=None) -> None:
        for node in [n for n in graph.nodes if n.domain == DLEGION and n.op == "QMatMul"]:
            found = _residual(graph, node)
            if found is None:
                continue
            add, residual = found
            node.inputs = (node.inputs + ["", ""])[:3] + [residual]
            node.outputs = list(add.outputs)
            graph.nodes.remove(add)


def _residual(graph: Graph, node: Node) -> tuple[Node, str] | None:
    """(the Add, its other operand) when ``node``'s one output is read only by an fp32 Add of a
    value of the same shape computed before ``node``; else None."""
    a = node.attrs
    if (len(node.outputs) != 1 or len(node.inputs) > 3 or a.get("segments") or a.get("gated") is not None
            or a.get("requant") is not None or np.ndim(a.get("weight")) != 2):
        return None
    if 0 < a.get("block", 0) < np.shape(a["weight"])[0]:
        return None             # drained once per group of K rows: the sum of the groups comes first
    out = node.outputs[0]
    add = graph.only_user(out)
    if add is None or add.op != "Add" or add.domain or len(add.inputs) != 2 or add.inputs[0] == add.inputs[1]:
        return None
    residual = add.inputs[1 - add.inputs.index(out)]
    values = graph.values
    if any(values[v].shape != values[out].shape or np.dtype(values[v].dtype) != np.float32
           for v in (residual, add.outputs[0])):
        return None
    made = graph.producer(residual)
    if made is not None and graph.nodes.index(made) > graph.nodes.index(node):
        return None
    if any(n.op in PLACING and not n.domain for n in graph.consumers(add.outputs[0])):
        return None
    return add, residual
