"""A small ONNX graph builder: named scopes, shared constants, one call per node."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

OPSET = 20
IR_VERSION = 10  # what torch.onnx.export(dynamo=True) writes for opset 20
INT64_MAX = np.iinfo(np.int64).max


@dataclass
class GraphBuilder:
    """Collects nodes and initializers; node names carry the module scope (``model.layers.0.mlp``)."""

    proto: onnx.ModelProto = field(default_factory=onnx.ModelProto)
    nodes: list = field(default_factory=list)
    scope: list = field(default_factory=list)
    _consts: dict = field(default_factory=dict)
    _count: int = 0

    @contextmanager
    def scoped(self, name: str):
        """Nodes built inside carry ``name`` in their scope, like the exporter's name_scopes."""
        self.scope.append(name)
        try:
            yield
        finally:
            self.scope.pop()

    def prefix(self) -> str:
        return ".".join(self.scope)

    def fresh(self, stem: str) -> str:
        self._count += 1
        return f"{stem}_{self._count}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, **attrs):
        """Append one node; returns its output name (or a list when ``outputs`` > 1)."""
        names = [self.fresh(op_type.lower()) for _ in range(outputs)]
        node_name = f"{self.prefix()}/{op_type}_{self._count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=node_name, **attrs))
        return names[0] if outputs == 1 else names

    def weight(self, name: str, array: np.ndarray) -> str:
        """A named parameter initializer (weights, norms, scales), written straight into the model:
        real-shape models hold gigabytes, and every proto copy would cost seconds and memory."""
        tensor = self.proto.graph.initializer.add()
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        tensor.dims.extend(array.shape)
        tensor.raw_data = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        return name

    def const(self, value, dtype=np.int64) -> str:
        """A shared anonymous constant; equal constants share one initializer, as the exporter's optimizer does."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            self._consts[key] = self.weight(f"val_{len(self._consts)}", array)
        return self._consts[key]

    def f32(self, value) -> str:
        return self.const(value, np.float32)

    def model(self, inputs: list, outputs: list, opsets: dict | None = None) -> onnx.ModelProto:
        """Finish the model in place and hand it over; the builder is spent afterwards."""
        model = self.proto
        model.graph.name = "main_graph"
        model.graph.node.extend(self.nodes)
        model.graph.input.extend(inputs)
        model.graph.output.extend(outputs)
        for domain, version in (opsets or {"": OPSET}).items():
            model.opset_import.append(helper.make_opsetid(domain, version))
        model.producer_name = "dlegion.models"
        model.ir_version = IR_VERSION
        return model


def tensor_info(name: str, elem_type: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


INT64 = TensorProto.INT64
FLOAT = TensorProto.FLOAT
