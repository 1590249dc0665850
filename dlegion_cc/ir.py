"""The compiler's graph IR: ONNX nodes over statically shaped values, some of them constant.

Passes rewrite a :class:`Graph` in place; recognized patterns become nodes of the ``dlegion``
domain (see ``dlegion_cc/passes``). ``Graph.text()`` prints it for ``--emit ir`` and
``--print-ir-after``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

DLEGION = "dlegion"


@dataclass
class Value:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    const: np.ndarray | None = None

    def text(self) -> str:
        dims = ",".join(map(str, self.shape))
        return f"{np.dtype(self.dtype).name}[{dims}]"


@dataclass
class Node:
    op: str
    name: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    domain: str = ""

    def text(self, values: dict[str, Value]) -> str:
        def arg(n: str) -> str:
            v = values.get(n)
            return "_" if not n else f"%{n}" if v is None or v.const is None else f"%{n}:const"
        attrs = "".join(f" {k}={_short(v)}" for k, v in sorted(self.attrs.items()))
        outs = ", ".join(f"%{o}: {values[o].text()}" if o in values else f"%{o}" for o in self.outputs)
        op = f"{self.domain}.{self.op}" if self.domain else self.op
        return f"{outs} = {op}({', '.join(arg(i) for i in self.inputs)}){attrs}  # {self.name}"


def _short(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return f"array{list(v.shape)}"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class Graph:
    name: str
    source: str
    values: dict[str, Value]
    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]

    def const(self, name: str) -> np.ndarray | None:
        v = self.values.get(name)
        return None if v is None else v.const

    def producer(self, name: str) -> Node | None:
        for n in self.nodes:
            if name in n.outputs:
                return n
        return None

    def consumers(self, name: str) -> list[Node]:
        return [n for n in self.nodes if name in n.inputs]

    def fresh(self, base: str) -> str:
        """A value name not yet in the graph."""
        i = 0
        while f"{base}_{i}" in self.values:
            i += 1
        return f"{base}_{i}"

    def add_value(self, base: str, shape, dtype, const: np.ndarray | None = None) -> str:
        """A new value (a constant when ``const`` is given) named after ``base``; its name."""
        name = self.fresh(base)
        self.values[name] = Value(name, tuple(shape), np.dtype(dtype), const)
        return name

    def remove_dead(self) -> None:
        """Drop nodes and constants that no graph output depends on."""
        live = set(self.outputs)
        kept = []
        for n in reversed(self.nodes):
            if any(o in live for o in n.outputs):
                kept.append(n)
                live.update(i for i in n.inputs if i)
        self.nodes = kept[::-1]
        self.values = {k: v for k, v in self.values.items() if k in live or k in self.inputs}

    def text(self) -> str:
        ins = ", ".join(f"%{i}: {self.values[i].text()}" for i in self.inputs)
        lines = [f"graph {self.name}({ins}) -> ({', '.join('%' + o for o in self.outputs)})"]
        lines += ["  " + n.text(self.values) for n in self.nodes]
        return "\n".join(lines) + "\n"
