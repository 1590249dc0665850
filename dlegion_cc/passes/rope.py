"""Rotary position embeddings by halves: the rotated copy of q is never built.

Source construct (``rotate_half``; q of width D = 2h on its last axis)::

    q1 = Slice(q, 0:h);  q2 = Slice(q, h:D)             # last axis
    rot = Concat(Neg(q2), q1)                            # rotate_half(q)
    y = Add(Mul(q, cos), Mul(rot, sin))                  # operands in either order

becomes, with cos1, cos2 and sin1, sin2 the halves of cos and sin (slices: views)::

    y = Concat(Sub(Mul(q1, cos1), Mul(q2, sin1)), Add(Mul(q2, cos2), Mul(q1, sin2)))

Each half is one row kernel reading q's halves where they are; nothing changes a bit, as
``a + -(b * c)`` is ``a - b * c`` in IEEE arithmetic. Before, the negation, the concat and the
product with cos each went through DRAM.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlegion_cc.ir import Graph, Node


@dataclass(frozen=True)
class SplitRotaryHalves:
    name: str = "rope"

    def run(self, graph: Graph, options) -> None:
        for node in list(graph.nodes):
            if node.op == "Add" and not node.domain:
                found = _match(graph, node)
                if found is not None:
                    _rewrite(graph, node, *found)


def _producer(graph: Graph, name: str, op: str) -> Node | None:
    node = graph.producer(name)
    return node if node is not None and node.op == op and not node.domain else None


def _half(graph: Graph, node: Node | None, width: int) -> tuple[str, int] | None:
    """(input, first) when ``node`` is a Slice of half of its input's last axis (width ``width``)."""
    if node is None or len(node.inputs) < 3:
        return None
    x = node.inputs[0]
    bounds = [graph.const(n) if n else None for n in (node.inputs + ["", ""])[1:5]]
    starts, ends, axes, steps = bounds
    rank = len(graph.values[x].shape)
    if starts is None or ends is None or starts.size != 1 or (steps is not None and int(steps[0]) != 1):
        return None
    if (int(axes[0]) if axes is not None else 0) % rank != rank - 1 or graph.values[x].shape[-1] != width:
        return None
    first, last = (int(v[0]) + (width if int(v[0]) < 0 else 0) for v in (starts, ends))
    first, last, half = min(max(first, 0), width), min(max(last, 0), width), width // 2
    return (x, first) if last - first == half and first in (0, half) else None


def _match(graph: Graph, add: Node):
    """(q, cos, sin) if ``add`` is ``q * cos + rotate_half(q) * sin``, else None."""
    muls = [_producer(graph, i, "Mul") for i in add.inputs]
    if None in muls:
        return None
    for rot_mul, q_mul in (muls, muls[::-1]):
        for rot, sin in (rot_mul.inputs, rot_mul.inputs[::-1]):
            cat = _producer(graph, rot, "Concat")
            if cat is None or len(cat.inputs) != 2:
                continue
            width = graph.values[rot].shape[-1]
            neg = _producer(graph, cat.inputs[0], "Neg")
            hi = _half(graph, _producer(graph, neg.inputs[0], "Slice") if neg else None, width)
            lo = _half(graph, _producer(graph, cat.inputs[1], "Slice"), width)
            if cat.attrs.get("axis", 0) % len(graph.values[rot].shape) != len(graph.values[rot].shape) - 1:
                continue
            if hi is None or lo is None or hi[0] != lo[0] or (lo[1], hi[1]) != (0, width // 2) or width % 2:
                continue
            q = lo[0]
            if q in q_mul.inputs and _fits(graph, add, q_mul, rot_mul, width):
                return q, q_mul.inputs[1 - q_mul.inputs.index(q)], sin
    return None


def _fits(graph: Graph, add: Node, q_mul: Node, rot_mul: Node, width: int) -> bool:
    """Every operand is float32 and D wide on the last axis, as the output is."""
    names = q_mul.inputs + rot_mul.inputs + add.outputs
    return all(graph.values[n].shape and graph.values[n].shape[-1] == width
               and np.dtype(graph.values[n].dtype) == np.float32 for n in names)


def _rewrite(graph: Graph, add: Node, q: str, cos: str, sin: str) -> None:
    out = add.outputs[0]
    width = graph.values[out].shape[-1]
    half = width // 2
    new: list[Node] = []

    def index(base: str, v: int) -> str:
        return graph.add_value(base, (1,), np.int64, np.array([v], np.int64))

    def piece(x: str, role: str, first: int) -> str:
        shape = graph.values[x].shape
        ins = [x, index(f"{x}_from", first), index(f"{x}_to", first + half), index(f"{x}_axis", len(shape) - 1)]
        y = graph.add_value(f"{x}_{'lo' if first == 0 else 'hi'}", shape[:-1] + (half,), np.float32)
        new.append(Node("Slice", f"{add.name}.{role}{1 + (first > 0)}", ins, [y]))
        return y

    def op(kind: str, role: str, a: str, b: str) -> str:
        shape = np.broadcast_shapes(graph.values[a].shape, graph.values[b].shape)
        y = graph.add_value(f"{out}_{role}", shape, np.float32)
        new.append(Node(kind, f"{add.name}.{role}", [a, b], [y]))
        return y

    q1, q2, c1, c2, s1, s2 = (piece(x, role, f) for x, role in ((q, "q"), (cos, "cos"), (sin, "sin"))
                              for f in (0, half))
    lo = op("Sub", "lo", op("Mul", "q1_cos1", q1, c1), op("Mul", "q2_sin1", q2, s1))
    hi = op("Add", "hi", op("Mul", "q2_cos2", q2, c2), op("Mul", "q1_sin2", q1, s2))
    new.append(Node("Concat", add.name, [lo, hi], [out], {"axis": -1}))
    at = graph.nodes.index(add)
    graph.nodes[at:at + 1] = new
