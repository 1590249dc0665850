"""The compiler's graph IR: ONNX nodes over statically shaped values, some of them constant.

Passes rewrite a :class:`Graph` in place; recognized patterns become nodes of the ``dlegion``
domain (see ``dlegion_cc/passes``). ``Graph.text()`` prints it for ``--emit ir`` and
``--print-ir-after``.
"""
from __future__ import annotations

import math
import mmap
import tempfile
from dataclasses import dataclass, field
from typing import IO, Any, Callable

import numpy as np

DLEGION = "dlegion"


class Lazy:
    """A constant too large to keep in memory: its elements are made each time they are asked
    for (``np.asarray``) and freed when the caller drops them, so a compile holds the weights
    of the node at hand, not the model's."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def load(self) -> np.ndarray:
        raise NotImplementedError

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        arr = self.load()
        return arr if dtype is None else arr.astype(dtype, copy=False)


@dataclass(frozen=True, eq=False)
class Mapped(Lazy):
    """Elements stored at byte ``offset`` of a file (a path, or an open temporary), mapped
    read-only: the pages a reader touches leave memory with the array."""

    file: str | IO[bytes]
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype

    def load(self) -> np.ndarray:
        count = self.size * np.dtype(self.dtype).itemsize
        if count == 0:
            return np.zeros(self.shape, self.dtype)
        start = self.offset - self.offset % mmap.ALLOCATIONGRANULARITY
        if isinstance(self.file, str):
            with open(self.file, "rb") as f:
                m = mmap.mmap(f.fileno(), self.offset - start + count, access=mmap.ACCESS_READ, offset=start)
        else:
            m = mmap.mmap(self.file.fileno(), self.offset - start + count, access=mmap.ACCESS_READ, offset=start)
        return np.ndarray(self.shape, self.dtype, buffer=m, offset=self.offset - start)

    def pieces(self, limit: int = 1 << 26):
        """The elements in order, flat, mapped ``limit`` bytes at a time: copying a 1 GB table
        never holds more than a piece of it."""
        item, total = np.dtype(self.dtype).itemsize, self.size
        per = max(1, limit // item)
        for start in range(0, total, per):
            yield Mapped(self.file, self.offset + start * item, (min(per, total - start),), self.dtype).load()


@dataclass(frozen=True, eq=False)
class Derived(Lazy):
    """Elements computed from other constants when asked for (an int8 copy of a float weight,
    weights side by side), so they are never all in memory at once."""

    shape: tuple[int, ...]
    dtype: np.dtype
    make: Callable[[], np.ndarray]

    def load(self) -> np.ndarray:
        return self.make()


def astype(a, dtype) -> np.ndarray | Lazy:
    """``a`` converted to ``dtype``: at once for an array, when asked for for a lazy constant."""
    if not isinstance(a, Lazy):
        return np.asarray(a).astype(dtype)
    return Derived(a.shape, np.dtype(dtype), lambda: np.asarray(a).astype(dtype))


def concatenate(parts: list, axis: int) -> np.ndarray | Lazy:
    """``np.concatenate(parts, axis)``, lazily when a part is lazy."""
    if not any(isinstance(p, Lazy) for p in parts):
        return np.concatenate([np.asarray(p) for p in parts], axis=axis)
    shape = list(parts[0].shape)
    shape[axis] = sum(p.shape[axis] for p in parts)
    return Derived(tuple(shape), np.result_type(*(p.dtype for p in parts)),
                   lambda: np.concatenate([np.asarray(p) for p in parts], axis=axis))


SPILL_ALIGN = 64


class Spill:
    """Large constants computed while compiling (folded weights), kept in an anonymous
    temporary file, which the system removes however the compile ends, and read back mapped."""

    def __init__(self):
        self._file: IO[bytes] | None = None

    def keep(self, arr: np.ndarray) -> Mapped:
        arr = np.ascontiguousarray(arr)
        if self._file is None:
            self._file = tempfile.TemporaryFile()
        f = self._file
        end = f.seek(0, 2)
        f.write(bytes(-end % SPILL_ALIGN))
        offset = f.tell()
        f.write(arr.data)
        f.flush()               # a mapping reads the file, not this object's buffer
        return Mapped(f, offset, arr.shape, arr.dtype)


@dataclass
class Value:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    stored: np.ndarray | Lazy | None = None     # a constant's elements, in memory or read when needed

    @property
    def const(self) -> np.ndarray | None:
        """The constant's elements, or None. A lazy one is read afresh: use it and drop it."""
        return None if self.stored is None else np.asarray(self.stored)

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
    if isinstance(v, (np.ndarray, Lazy)):
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
    # Each imported node's first output as the model names it, by node name: passes may give a
    # node new outputs, but what the program records of it names the model's value.
    origins: dict[str, str] = field(default_factory=dict)

    def const(self, name: str) -> np.ndarray | None:
        v = self.values.get(name)
        return None if v is None else v.const

    def stored(self, name: str) -> np.ndarray | Lazy | None:
        """A constant as it is kept (``Lazy`` when large), for a pass that hands it on unread."""
        v = self.values.get(name)
        return None if v is None else v.stored

    def producer(self, name: str) -> Node | None:
        for n in self.nodes:
            if name in n.outputs:
                return n
        return None

    def consumers(self, name: str) -> list[Node]:
        return [n for n in self.nodes if name in n.inputs]

    def only_user(self, name: str) -> Node | None:
        """The one node that reads ``name``, which is not a graph output; None otherwise."""
        users = self.consumers(name)
        return users[0] if len(users) == 1 and name not in self.outputs else None

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
        """Drop nodes and constants that no graph output depends on. A kept node keeps all its
        outputs' values, the unused ones too (a Split's): its lowering lays them out."""
        live = set(self.outputs)
        kept = []
        for n in reversed(self.nodes):
            if any(o in live for o in n.outputs):
                kept.append(n)
                live.update(i for i in n.inputs if i)
        live.update(o for n in kept for o in n.outputs)
        self.nodes = kept[::-1]
        self.values = {k: v for k, v in self.values.items() if k in live or k in self.inputs}

    def text(self) -> str:
        ins = ", ".join(f"%{i}: {self.values[i].text()}" for i in self.inputs)
        lines = [f"graph {self.name}({ins}) -> ({', '.join('%' + o for o in self.outputs)})"]
        lines += ["  " + n.text(self.values) for n in self.nodes]
        return "\n".join(lines) + "\n"
