"""Asymmetric multi-matrix fusion: quantized matmuls that share their input become one.

The Q, K and V projections of an attention block read the same quantized activations, and
so do the gate and up projections of a gated MLP. Separately, each is cut into Legions' column
slices of its own: K and V (a fifth of Q's width under GQA) leave most of a w2 window empty
(a pass holds 4 weight tiles sharing the streamed input). As one ``dlegion.QMatMul`` whose
weight is theirs side by side, every Legion streams the input once through full windows that
hold its slice of each, and the drain writes each slice to its own output (``segments``).

Matmuls fuse when they are ``dlegion.QMatMul`` nodes with the same inputs, the same attributes
apart from their weights, column scales and bias, 2-D weights of the same depth, float outputs
and no requantization. Off with ``--no-fusion``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlegion_cc.ir import DLEGION, Graph, Node, concatenate

PER_COLUMN = ("weight", "scales", "cscale", "bias")   # attributes that differ, joined by column


@dataclass
class FuseSiblings:
    name: str = "fuse-siblings"

    def run(self, graph: Graph, options=None) -> None:
        for family in _families(graph):
            fused = fuse(family)
            at = graph.nodes.index(family[0])
            graph.nodes[at] = fused
            for node in family[1:]:
                graph.nodes.remove(node)


def _families(graph: Graph) -> list[list[Node]]:
    """Groups of two or more fusable matmuls, in program order, each keyed by its first."""
    by_key: dict = {}
    for node in graph.nodes:
        if _fusable(graph, node):
            by_key.setdefault(_key(node), []).append(node)
    return [family for family in by_key.values() if len(family) > 1]


def _fusable(graph: Graph, node: Node) -> bool:
    if node.domain != DLEGION or node.op != "QMatMul" or len(node.outputs) != 1:
        return False
    a = node.attrs
    return (np.ndim(a["weight"]) == 2 and a.get("requant") is None and "segments" not in a
            and graph.values[node.outputs[0]].dtype == np.float32)


def _key(node: Node) -> tuple:
    """What fused matmuls share: inputs, depth, and every attribute but the per-column ones."""
    rest = tuple(sorted((k, _hashable(v)) for k, v in node.attrs.items() if k not in PER_COLUMN))
    return tuple(node.inputs), np.shape(node.attrs["weight"])[0], rest


def _hashable(v):
    if isinstance(v, np.ndarray):
        return (v.dtype.str, v.shape, v.tobytes())
    return tuple(map(_hashable, v)) if isinstance(v, (list, tuple)) else v


def fuse(family: list[Node]) -> Node:
    """One QMatMul computing every member; output ``i`` is columns ``segments[i]`` wide."""
    first = family[0]
    attrs = {k: v for k, v in first.attrs.items() if k not in PER_COLUMN}
    weights = [n.attrs["weight"] for n in family]
    attrs["weight"] = concatenate(weights, axis=1)       # lazy when they are
    attrs["segments"] = [w.shape[1] for w in weights]
    scales = [_scales(n) for n in family]
    if any(s is not None for s in scales):
        groups = max(len(s) for s in scales if s is not None)
        attrs["scales"] = np.concatenate([np.broadcast_to(np.ones((1, w.shape[1]), np.float32) if s is None else s,
                                                          (groups, w.shape[1])) for s, w in zip(scales, weights)], axis=1)
    if any(n.attrs.get("bias") is not None for n in family):
        attrs["bias"] = np.concatenate([np.asarray(n.attrs["bias"], np.float32).reshape(-1)
                                        if n.attrs.get("bias") is not None
                                        else np.zeros(np.shape(n.attrs["weight"])[1], np.float32)
                                        for n in family])
    name = "+".join(n.name for n in family)
    outputs = [n.outputs[0] for n in family]
    return Node("QMatMul", name, list(first.inputs), outputs, attrs, DLEGION)


def _scales(node: Node) -> np.ndarray | None:
    """The node's column scales as [groups, N], or None when it has none."""
    a, n = node.attrs, np.shape(node.attrs["weight"])[1]
    if a.get("scales") is not None:
        return np.asarray(a["scales"], np.float32).reshape(-1, n)
    if a.get("cscale") is not None:
        return np.broadcast_to(np.asarray(a["cscale"], np.float32).reshape(1, -1), (1, n))
    return None
