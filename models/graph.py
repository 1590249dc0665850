"""A small ONNX graph builder: named scopes, shared constants, one call per node; and where the
initializers' bytes go: inside the proto, or streamed to an external data file as they are made."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper

from isa.files import Staged, atomic_write, atomic_write_all

OPSET = 20
IR_VERSION = 10  # what torch.onnx.export(dynamo=True) writes for opset 20
INT64_MAX = np.iinfo(np.int64).max
MODEL_LIMIT = 2**31  # bytes: protobuf cannot serialize a larger message
# Tensors of EXTERNAL_THRESHOLD bytes or more go to the data file. The size counts the bytes object's
# header, as onnx's save_as_external_data (which wrote these files before) measured it, so a model
# keeps the same tensors inline as before.
EXTERNAL_THRESHOLD = 1024
BYTES_HEADER = sys.getsizeof(b"")
# Tensors past ALIGN_THRESHOLD start on an ALIGNMENT boundary, so onnxruntime can map them in place
# (64 KiB: Windows' allocation granularity, a multiple of every page size); smaller ones follow
# each other without gaps, which keeps the files of small models as they were.
ALIGN_THRESHOLD = 1 << 20
ALIGNMENT = 1 << 16


@dataclass
class RowBlocks:
    """A tensor handed over as blocks of rows, in order, so a vocabulary-sized table is never whole in
    memory. The blocks may be drawn lazily: whoever takes the value reads them all at once."""

    shape: tuple
    dtype: np.dtype
    blocks: Iterable[np.ndarray]

    @classmethod
    def of(cls, array: np.ndarray) -> "RowBlocks":
        return cls(array.shape, array.dtype, [array])

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def little_endian(block: np.ndarray) -> np.ndarray:
    """ONNX raw data is little-endian and contiguous."""
    return np.ascontiguousarray(block).astype(block.dtype.newbyteorder("<"), copy=False)


def goes_external(nbytes: int) -> bool:
    return BYTES_HEADER + nbytes >= EXTERNAL_THRESHOLD


def put_inline(tensor: TensorProto, value: RowBlocks) -> None:
    tensor.raw_data = b"".join(little_endian(block).tobytes() for block in value.blocks)


class InlineStore:
    """Tensor bytes inside the proto (raw_data)."""

    def put(self, tensor: TensorProto, value: RowBlocks) -> None:
        put_inline(tensor, value)


@dataclass
class ExternalStore:
    """Tensors of 1 KiB or more appended to the data ``file`` as they come, with plain writes;
    the proto keeps a stub naming location, offset and length (ONNX external data)."""

    file: Staged
    location: str  # the data file's name, relative to the model's folder
    end: int = 0

    def put(self, tensor: TensorProto, value: RowBlocks) -> None:
        if not goes_external(value.nbytes):
            put_inline(tensor, value)
            return
        offset = self.end if value.nbytes <= ALIGN_THRESHOLD else -(-self.end // ALIGNMENT) * ALIGNMENT
        self.end += self.file.write(bytes(offset - self.end))
        for block in value.blocks:
            self.end += self.file.write(little_endian(block))
        if self.end - offset != value.nbytes:
            raise ValueError(f"tensor {tensor.name!r}: its blocks hold {self.end - offset} bytes, "
                             f"its shape {value.nbytes}")
        set_external(tensor, self.location, offset, value.nbytes)


def set_external(tensor: TensorProto, location: str, offset: int, length: int) -> None:
    """The stub, with its entries in the order onnx writes them."""
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


@dataclass
class GraphBuilder:
    """Collects nodes and initializers; node names carry the module scope (``model.layers.0.mlp``)."""

    proto: onnx.ModelProto = field(default_factory=onnx.ModelProto)
    store: InlineStore | ExternalStore = field(default_factory=InlineStore)
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

    def op(self, op_type: str, *inputs: str, outputs: int = 1, out: str | None = None, **attrs):
        """Append one node; returns its output name (or a list when ``outputs`` > 1). ``out`` names
        a single output (a graph output's name)."""
        names = [self.fresh(op_type.lower()) for _ in range(outputs)]
        names = names if out is None else [out]
        node_name = f"{self.prefix()}/{op_type}_{self._count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=node_name, **attrs))
        return names[0] if outputs == 1 else names

    def weight(self, name: str, value: np.ndarray | RowBlocks) -> str:
        """A named parameter initializer (weights, norms, scales). Its bytes go to the store at once,
        straight into the model or its data file (real-shape models hold gigabytes, and every proto
        copy would cost seconds and memory), so lazily drawn blocks are drawn here, in graph order."""
        value = value if isinstance(value, RowBlocks) else RowBlocks.of(value)
        tensor = self.proto.graph.initializer.add()
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(np.dtype(value.dtype))
        tensor.dims.extend(value.shape)
        self.store.put(tensor, value)
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


def serialized(model: onnx.ModelProto, path: Path) -> bytes:
    if model.ByteSize() >= MODEL_LIMIT:
        raise ValueError(f"{path.name}: the model exceeds 2 GiB; save it with external data")
    return model.SerializeToString()


def data_path(path: Path) -> Path:
    return path.with_name(path.name + ".data")


def write_external(path: str | Path, build: Callable[[ExternalStore], onnx.ModelProto]) -> None:
    """Write the model ``build(store)`` returns to ``path`` and its tensors to ``<path>.data``: the
    tensors stream into a temporary data file while ``build`` adds them, the stub model is written
    last, then both replace their targets together; on any failure neither is left behind."""
    path = Path(path)
    data = data_path(path)
    with Staged(data) as staged:
        model = build(ExternalStore(staged, data.name))
        atomic_write_all([(data, staged), (path, serialized(model, path))])


def save(model: onnx.ModelProto, path: str | Path, external_data: bool) -> None:
    """Write ``path``; with external data every tensor of 1 KiB or more goes to ``<name>.data`` beside
    it, laid out as the streaming writer lays it out. ``model`` is left as it was (no proto copy:
    real-shape models hold gigabytes; the tensors are moved out while it is written, then back)."""
    path = Path(path)
    if not external_data:
        atomic_write(path, serialized(model, path))
        return
    moved: list[tuple[TensorProto, bytes]] = []
    try:
        write_external(path, lambda store: _move_out(model, store, moved))
    finally:
        for tensor, raw in moved:
            del tensor.external_data[:]
            tensor.ClearField("data_location")
            tensor.raw_data = raw


def _move_out(model: onnx.ModelProto, store: ExternalStore, moved: list) -> onnx.ModelProto:
    """Each large initializer's bytes to ``store``, remembered in ``moved`` to be put back."""
    for tensor in model.graph.initializer:
        raw = tensor.raw_data if tensor.HasField("raw_data") else b""
        if not goes_external(len(raw)):
            continue
        moved.append((tensor, raw))
        tensor.ClearField("raw_data")
        store.put(tensor, RowBlocks.of(np.frombuffer(raw, np.uint8)))
    return model


def tensor_info(name: str, elem_type: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


INT64 = TensorProto.INT64
FLOAT = TensorProto.FLOAT
