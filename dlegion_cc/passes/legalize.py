"""Reject what cannot be compiled, naming every culprit node at once."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlegion_cc.errors import UnsupportedNodes, not_supported
from dlegion_cc.ir import Graph

SUPPORTED_DTYPES = {np.dtype(t) for t in (np.float32, np.bool_, np.int64, np.int32, np.int8, np.uint8)}


@dataclass(frozen=True)
class Legalize:
    name: str = "legalize"

    def run(self, graph: Graph, options) -> None:
        from dlegion_cc.lower.graph import LOWERINGS
        problems = []
        for node in graph.nodes:
            why = self._why(graph, node, LOWERINGS)
            if why:
                problems.append((node.name, node.op, why))
        if problems:
            raise UnsupportedNodes(graph.source, problems)

    @staticmethod
    def _why(graph: Graph, node, lowerings) -> str | None:
        if (node.domain, node.op) not in lowerings:
            return not_supported(node.op, node.domain)
        for name in node.inputs + node.outputs:
            v = graph.values.get(name)
            if v is not None and v.const is None and np.dtype(v.dtype) not in SUPPORTED_DTYPES:
                return f"dtype {np.dtype(v.dtype).name} of '{name}' is not supported"
        return None
