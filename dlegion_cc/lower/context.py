"""The state of lowering one graph: which DRAM view holds each value, and the op registry."""
from __future__ import annotations

from typing import Callable

import numpy as np

from dlegion_cc.errors import node_error
from dlegion_cc.ir import Graph, Node
from dlegion_cc.lower.emitter import Emitter
from dlegion_cc.lower.layout import Operand, whole

DRAM_DTYPE = {np.dtype(np.float32): "f32", np.dtype(np.int64): "i64", np.dtype(np.int32): "i32",
              np.dtype(np.int8): "i8", np.dtype(np.uint8): "u8", np.dtype(np.bool_): "u8"}

Lowerer = Callable[["Lowering", Node], None]
LOWERINGS: dict[tuple[str, str], Lowerer] = {}


def lowers(*ops: str, domain: str = ""):
    """Register a lowering for ONNX op types ``ops``."""
    def deco(fn: Lowerer) -> Lowerer:
        for op in ops:
            LOWERINGS[(domain, op)] = fn
        return fn
    return deco


class Lowering:
    """Maps graph values to DRAM operands while nodes are lowered in order."""

    def __init__(self, graph: Graph, em: Emitter):
        self.graph, self.em = graph, em
        self.operands: dict[str, Operand] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.graph.values[name].shape

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self.graph.values[name].dtype)

    def const(self, name: str) -> np.ndarray | None:
        return self.graph.const(name) if name else None

    def scalar(self, name: str) -> float | None:
        """The fp32 value of a one-element constant, else None."""
        c = self.const(name)
        return None if c is None or c.size != 1 else float(np.float32(c.reshape(())))

    def operand(self, name: str) -> Operand:
        if name in self.operands:
            return self.operands[name]
        c = self.const(name)
        if c is None:
            raise KeyError(f"value '{name}' is used before it is computed")
        arr = np.ascontiguousarray(c, dtype=np.float32)
        self.operands[name] = whole(self.em.const(name, arr, "f32"), arr.shape)
        return self.operands[name]

    def result(self, name: str) -> Operand:
        """A fresh contiguous DRAM tensor for ``name``: an output tensor if the graph returns it."""
        shape = self.shape(name)
        if name in self.graph.outputs:
            dtype = DRAM_DTYPE.get(self.dtype(name))
            idx = self.em.tensor(name, dtype or "f32", shape, "output", io_name=name)
        else:
            idx = self.em.tensor(name, "f32", shape, "scratch", io_name=name)
        self.operands[name] = whole(idx, shape)
        return self.operands[name]

    def alias(self, name: str, src: str) -> bool:
        """Let ``name`` share ``src``'s DRAM (a reshape); False when it needs its own copy."""
        if name in self.graph.outputs or src not in self.operands:
            return False
        op = self.operands[src]
        self.operands[name] = whole(op.tensor, self.shape(name)) if op.offset == 0 else op
        return op.offset == 0

    def declare_inputs(self) -> None:
        for name in self.graph.inputs:
            dtype = DRAM_DTYPE.get(self.dtype(name))
            if dtype is None:
                raise node_error(self.graph.source, name, "input", f"dtype {self.dtype(name)} is not supported")
            idx = self.em.tensor(name, dtype, self.shape(name), "input", io_name=name,
                                 rng=self._index_range(name))
            self.operands[name] = whole(idx, self.shape(name))

    def _index_range(self, name: str) -> tuple[int, int] | None:
        """Token ids: the rows of the table they index, so random inputs are valid."""
        for n in self.graph.consumers(name):
            if n.op == "Gather" and n.inputs[1] == name:
                return (0, self.shape(n.inputs[0])[n.attrs.get("axis", 0)])
        return None
