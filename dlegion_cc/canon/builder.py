"""What a canonicalizing handler writes with: new nodes and small constants, fresh names."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dlegion_cc.ort_schemas import default_opset


def attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def io(names, count: int) -> list[str]:
    """``names`` padded with "" (absent optional inputs or outputs) to ``count``."""
    names = list(names)
    return names + [""] * (count - len(names))


class Builder:
    """The node list a rewrite makes: kept nodes and handlers' replacements, in order."""

    def __init__(self, model: onnx.ModelProto, lazy: dict):
        self.graph, self.lazy = model.graph, lazy
        self.opset = default_opset(model)
        self.nodes: list[onnx.NodeProto] = []
        g = self.graph
        self.types = {v.name: v.type.tensor_type for v in [*g.input, *g.value_info, *g.output]}
        self.types.update({t.name: _tensor_type(t) for t in g.initializer})
        self.taken = set(self.types) | {o for n in g.node for o in n.output} | {n.name for n in g.node}
        self.base = "canon"
        self.changed = False        # whether a handler wrote a node

    def keep(self, node: onnx.NodeProto) -> None:
        self.nodes.append(node)

    def at(self, node: onnx.NodeProto) -> None:
        """New names after ``node``'s from here on."""
        self.base = node.name or node.op_type

    def finish(self) -> None:
        del self.graph.node[:]
        self.graph.node.extend(self.nodes)

    def fresh(self, what: str) -> str:
        k, name = 0, f"{self.base}/{what}"
        while name in self.taken:
            k += 1
            name = f"{self.base}/{what}_{k}"
        self.taken.add(name)
        return name

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs) -> str:
        """A node of one output (``out``, or a fresh name); the output's name."""
        out = out or self.fresh(f"{op_type}_out")
        self.changed = True
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=self.fresh(op_type), **attrs))
        return out

    def const(self, value, what: str = "const", dtype=np.float32) -> str:
        name = self.fresh(what)
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def value(self, name: str) -> np.ndarray | None:
        """A constant's elements (an initializer's), or None."""
        if name in self.lazy:
            return np.asarray(self.lazy[name])
        for t in self.graph.initializer:
            if t.name == name:
                return numpy_helper.to_array(t)
        return None

    def rank(self, name: str) -> int:
        t = self.types.get(name)
        if t is None or not t.HasField("shape"):
            raise ValueError(f"the rank of '{name}' is unknown")
        return len(t.shape.dim)

    def dims(self, name: str) -> list[int | None]:
        self.rank(name)
        return [d.dim_value if d.HasField("dim_value") else None for d in self.types[name].shape.dim]

    def reduce_mean(self, x: str, axes: list[int], out: str | None = None) -> str:
        """ReduceMean keeping the reduced axes, its axes an input from opset 18."""
        if self.opset >= 18:
            return self.op("ReduceMean", [x, self.const(axes, "axes", np.int64)], out, keepdims=1)
        return self.op("ReduceMean", [x], out, axes=axes, keepdims=1)


def _tensor_type(t: onnx.TensorProto):
    return helper.make_tensor_type_proto(t.data_type, list(t.dims)).tensor_type
