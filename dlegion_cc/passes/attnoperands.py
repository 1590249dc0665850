"""Attention's quantized K and V made in one pass over their values, not through copies.

Source constructs (left by ``passes/attention.py``)::

    vt = Transpose(v)                      # [.., D, S]: V's channels as rows
    v8t, rv = dlegion.AbsmaxQuantize(vt)   # per channel
    v8 = Transpose(v8t)                    # [.., S, D], as P.V's arrays read it

becomes ``v8, rv = dlegion.ColumnAbsmaxQuantize(v)``: each channel's maximum is read down a
column of V as it is (a maximum is the same in any order), so neither transpose is copied; and::

    ks = Sub(k, ReduceMean(k, axes=[-2]))  # K smoothed
    k8, rk = dlegion.AbsmaxQuantize(ks)    # per token

becomes ``k8, rk = dlegion.SmoothAbsmaxQuantize(k, mean)``: the smoothed K is never stored.
Both compute the same instructions on the same values as before, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

from dlegion_cc.ir import DLEGION, Graph, Node
from dlegion_cc.passes.attention import _swaps_last_two


@dataclass(frozen=True)
class QuantizeOperandsInPlace:
    name: str = "attention-operands"

    def run(self, graph: Graph, options) -> None:
        for node in list(graph.nodes):
            if node.domain == DLEGION and node.op == "AbsmaxQuantize":
                _by_columns(graph, node) or _smoothed(graph, node)


def _only_user(graph: Graph, name: str) -> Node | None:
    users = graph.consumers(name)
    return users[0] if len(users) == 1 and name not in graph.outputs else None


def _by_columns(graph: Graph, node: Node) -> bool:
    """Transpose -> AbsmaxQuantize -> Transpose of its values: one ColumnAbsmaxQuantize."""
    x, (q, r) = node.inputs[0], node.outputs
    rank = len(graph.values[x].shape)
    before, after = graph.producer(x), _only_user(graph, q)
    if (not _swaps_last_two(before, rank) or _only_user(graph, x) is not node
            or not _swaps_last_two(after, rank)):
        return False
    at = graph.nodes.index(node)
    graph.nodes[at] = Node("ColumnAbsmaxQuantize", node.name, [before.inputs[0]], [after.outputs[0], r],
                           dict(node.attrs), DLEGION)
    graph.nodes.remove(after)
    graph.nodes.remove(before)
    return True


def _smoothed(graph: Graph, node: Node) -> bool:
    """Sub(k, ReduceMean(k) over the tokens) -> AbsmaxQuantize: one SmoothAbsmaxQuantize."""
    sub = graph.producer(node.inputs[0])
    if sub is None or sub.op != "Sub" or sub.domain or _only_user(graph, node.inputs[0]) is not node:
        return False
    k, mean = sub.inputs
    m = graph.producer(mean)
    rank = len(graph.values[k].shape)
    if (m is None or m.op != "ReduceMean" or m.domain or m.inputs[0] != k
            or [a % rank for a in m.attrs.get("axes", [])] != [rank - 2] or not m.attrs.get("keepdims", 1)):
        return False
    graph.nodes[graph.nodes.index(node)] = Node("SmoothAbsmaxQuantize", node.name, [k, mean], list(node.outputs),
                                                dict(node.attrs), DLEGION)
    graph.nodes.remove(sub)
    return True
