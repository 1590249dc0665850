"""Grouped-query attention: each query head multiplies the key/value head of its group where it
is, not a copy of it made for every query head.

Source construct (torch's ``repeat_kv``; G key/value heads, r query heads each)::

    kv5 = Unsqueeze(kv)                       # [.., G, 1, S, D]
    kvr = Expand(kv5, [.., G, r, S, D])
    kvh = Reshape(kvr, [.., G * r, S, D])     # strides cannot merge a repeat: a copy
    kvt = Transpose(kvh, last two swapped)    # optional (K^T)
    y = MatMul(x, kvh or kvt)                 # x: [.., G * r, M, K]

becomes ``y = Reshape(MatMul(Reshape(x, [.., G, r, M, K]), kvr or Transpose(kvr)))``: MatMul
broadcasts over the group, the expand is a view with a 0 stride and both reshapes are views,
so nothing is copied. The MatMul node is kept, with what earlier passes marked on it.

Unless the causal pass marked it, the group's query heads are rows of one product instead,
``Reshape(x, [.., G, r * M, K])`` against the key/value head itself (``[.., G, S, D]``): its rows
are read once per group, not once per query head. A decode step (M = 1) is all such reads,
the whole cache's. Each output element is the same dot product, so the bits are the same.
(Marked products keep the repeat: their masks are per head, [M, S].)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlegion_cc.ir import Graph, Node


@dataclass(frozen=True)
class SplitGroupedHeads:
    name: str = "gqa"

    def run(self, graph: Graph, options) -> None:
        for node in list(graph.nodes):
            if node.op == "MatMul" and not node.domain:
                _rewrite(graph, node)


def _swaps_last_two(node: Node, rank: int) -> bool:
    perm = list(node.attrs.get("perm", range(rank)[::-1]))
    return perm == list(range(rank - 2)) + [rank - 1, rank - 2]


def _repeat(graph: Graph, b: str):
    """(Transpose or None, the Expand, the merged axis) if ``b`` is a repeated head, else None.
    Other readers of the copies keep them; this matmul just stops being one."""
    shape = graph.values[b].shape
    t = graph.producer(b)
    if t is not None and t.op == "Transpose" and _swaps_last_two(t, len(shape)):
        b = t.inputs[0]
    else:
        t = None
    r, merged = graph.producer(b), graph.values[b].shape
    e = graph.producer(r.inputs[0]) if r is not None and r.op == "Reshape" else None
    if e is None or e.op != "Expand":
        return None
    full, small = graph.values[e.outputs[0]].shape, graph.values[e.inputs[0]].shape
    small = (1,) * (len(full) - len(small)) + tuple(small)
    for a in range(len(merged) - 2):
        if (full[:a] == merged[:a] and full[a] * full[a + 1] == merged[a] and full[a + 2:] == merged[a + 1:]
                and small[a + 1] == 1 < full[a + 1]):
            return t, e, a
    return None


def _rewrite(graph: Graph, mm: Node) -> None:
    x, b = mm.inputs
    found = _repeat(graph, b)
    xs, ys = graph.values[x].shape, graph.values[mm.outputs[0]].shape
    if found is None or len(xs) != len(graph.values[b].shape):
        return
    t, e, a = found
    groups, each = graph.values[e.outputs[0]].shape[a:a + 2]
    if xs[a] != groups * each:
        return
    if a == len(xs) - 3 and not {"dead", "zero_a"} & set(mm.attrs):
        _rows_of_group(graph, mm, t, e, groups)
        return
    split = lambda shape: tuple(shape[:a]) + (groups, each) + tuple(shape[a + 1:])
    at = graph.nodes.index(mm)
    x5 = _add(graph, at, "Reshape", f"{mm.name}_groups", x, split(xs))
    kv = e.outputs[0]
    if t is not None:
        full = graph.values[kv].shape
        kv = _add(graph, at + 1, "Transpose", f"{t.name}_groups", kv, full[:-2] + full[-2:][::-1],
                  perm=list(range(len(full) - 2)) + [len(full) - 1, len(full) - 2])
    y = mm.outputs[0]
    y5 = graph.add_value(f"{y}_groups", split(ys), graph.values[y].dtype)
    mm.inputs, mm.outputs = [x5, kv], [y5]
    graph.nodes.insert(graph.nodes.index(mm) + 1, Node("Reshape", f"{mm.name}_heads", [y5, _shape(graph, y, ys)], [y]))


def _rows_of_group(graph: Graph, mm: Node, t: Node | None, e: Node, groups: int) -> None:
    """``y = Reshape(MatMul(Reshape(x, [.., G, r * M, K]), kv or Transpose(kv)))``, kv the
    unrepeated head ``[.., G, S, D]``: each group's query heads one product's rows."""
    x, y = mm.inputs[0], mm.outputs[0]
    xs, ys = graph.values[x].shape, graph.values[y].shape
    lead = tuple(xs[:-3])
    at = graph.nodes.index(mm)
    rows = (xs[-3] // groups) * xs[-2]
    x3 = _add(graph, at, "Reshape", f"{mm.name}_groups", x, lead + (groups, rows, xs[-1]))
    full = graph.values[e.outputs[0]].shape
    kv = _add(graph, at + 1, "Reshape", f"{e.name}_heads", e.inputs[0], lead + (groups,) + tuple(full[-2:]))
    if t is not None:
        kv = _add(graph, at + 2, "Transpose", f"{t.name}_groups", kv, lead + (groups, full[-1], full[-2]),
                  perm=list(range(len(lead) + 1)) + [len(lead) + 2, len(lead) + 1])
    y3 = graph.add_value(f"{y}_groups", lead + (groups, rows, ys[-1]), graph.values[y].dtype)
    mm.inputs, mm.outputs = [x3, kv], [y3]
    graph.nodes.insert(graph.nodes.index(mm) + 1, Node("Reshape", f"{mm.name}_heads", [y3, _shape(graph, y, ys)], [y]))


def _shape(graph: Graph, base: str, shape: tuple) -> str:
    """A Reshape's shape constant."""
    return graph.add_value(f"{base}_shape", (len(shape),), np.int64, np.array(shape, np.int64))


def _add(graph: Graph, at: int, op: str, name: str, src: str, shape: tuple, **attrs) -> str:
    """Insert ``out = op(src)`` of ``shape`` before node ``at`` (a Reshape gets its shape
    constant); returns ``out``."""
    out = graph.add_value(f"{src}_groups", shape, graph.values[src].dtype)
    inputs = [src] + ([_shape(graph, out, shape)] if op == "Reshape" else [])
    graph.nodes.insert(at, Node(op, name, inputs, [out], attrs))
    return out
