"""A D-Legion program: the DRAM tensors it declares and its instruction stream.

DRAM holds named tensors. Instructions address a tensor by its index in ``Program.tensors``
and an offset in *storage elements*: the dtype's element for f32/i64/i32/i8/u8, a byte for
the packed weight types w2 (four 2-bit weights a byte, lowest bits first) and w4 (two 4-bit
weights a byte, low nibble first), both two's complement.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from isa.instructions import Instr

DTYPES = ("f32", "i64", "i32", "i8", "u8", "w2", "w4")
STORAGE = {"f32": np.float32, "i64": np.int64, "i32": np.int32, "i8": np.int8, "u8": np.uint8,
           "w2": np.uint8, "w4": np.uint8}
PACK = {"w2": 4, "w4": 2}          # logical elements per storage byte
KINDS = ("input", "output", "const", "scratch")

# Which DRAM dtypes a DMA may move into (load) or out of (store) each scratchpad space.
# Loads into vec convert to fp32; stores from vec round half to even and saturate to ints.
LOADS = {"vec": {"f32", "i64", "i32", "i8", "u8"}, "act": {"i8"}, "wgt": {"w2", "w4", "i8", "u8"},
         "acc": {"i32"}}
STORES = {"vec": {"f32", "i64", "i32", "i8", "u8"}, "act": {"i8"}, "wgt": {"w2", "w4", "i8", "u8"},
          "acc": {"i32"}}


class ProgramError(ValueError):
    """A program that is malformed or cannot run; the message names file and line."""


@dataclass
class Tensor:
    """A DRAM tensor. ``io_name`` binds inputs/outputs to graph names; ``offset`` is the byte
    offset of a constant's bytes in the data file; ``range`` bounds random integer inputs."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str
    io_name: str | None = None
    offset: int | None = None
    range: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def storage_elems(self) -> int:
        pack = PACK.get(self.dtype, 1)
        return -(-self.numel // pack)

    @property
    def nbytes(self) -> int:
        return self.storage_elems * np.dtype(STORAGE[self.dtype]).itemsize


@dataclass
class Program:
    arch: str
    tensors: list[Tensor] = field(default_factory=list)
    instrs: list[Instr] = field(default_factory=list)
    data_file: str | None = None
    # Provenance: (index of the first instruction, name) in program order; instruction i belongs
    # to the last region starting at or before i (instructions before the first belong to none).
    regions: list[tuple[int, str]] = field(default_factory=list)
    # Work the compiler proved unneeded and left out, by kind (``causal_skipped_macs``: the
    # multiply-adds of attention blocks a causal mask makes dead or zero;
    # ``causal_skipped_vector_ops``: the lane operations of softmax columns past P's nonzeros):
    # for the report.
    skipped: dict[str, int] = field(default_factory=dict)
    # What the compiler computes instead of the model's own semantics, by name (``int8_attention``:
    # attention's float products quantized to int8; ``int8_activations``: a weight-only quantized
    # matmul's float activations quantized per row), each with the model's values it computes so,
    # where it is made per operator (``int8_attention``: the output of every product quantized; a
    # product not named kept fp32): ``dlegion-run --check`` judges the outputs with each one's
    # documented tolerance, and its float64 yardstick makes the same ones (runtime/check.py).
    approximations: dict[str, list[str]] = field(default_factory=dict)
    # Inputs that live inside an output's storage, by input tensor name: (output tensor name,
    # offset, strides), the input's element (i0, i1, ...) at ``offset + sum(i * stride)`` of the
    # output (a decode step's key/value cache: ``past`` inside ``present = Concat(past, new)``).
    # The host binds such an input into that region; the program reads it there and writes only
    # the rest of the output.
    aliases: dict[str, tuple[str, int, tuple[int, ...]]] = field(default_factory=dict)
    # Where each instruction came from, for messages; not part of a program's identity.
    lines: list[int] = field(default_factory=list, compare=False, repr=False)
    source: str = field(default="<program>", compare=False, repr=False)
    arch_at: str | None = field(default=None, compare=False, repr=False)   # the .arch's file:line:col
    data: bytes | None = field(default=None, compare=False, repr=False)   # or a view of the mapped data file
    # Of an expanded program (isa/expand.py): the source instruction of each task.
    origin: list[int] | None = field(default=None, compare=False, repr=False)

    def tensor_index(self, name: str) -> int:
        for i, t in enumerate(self.tensors):
            if t.name == name:
                return i
        known = ", ".join(t.name for t in self.tensors) or "none"
        raise ProgramError(f"{self.source}: unknown tensor {name!r} (declared: {known})")

    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def region_ranges(self) -> list[range]:
        """The instructions of each region: from its start to the next region's."""
        ends = [at for at, _ in self.regions[1:]] + [len(self.instrs)]
        return [range(at, end) for (at, _), end in zip(self.regions, ends)]

    def where(self, i: int) -> str:
        """Location of instruction ``i`` for messages: ``file:line`` or ``file: instruction i``."""
        if self.origin is not None:
            i = self.origin[i]
        if i < len(self.lines) and self.lines[i]:
            return f"{self.source}:{self.lines[i]}"
        return f"{self.source}: instruction {i}"

    def const_bytes(self, t: Tensor) -> memoryview:
        """The initial bytes of constant tensor ``t`` from the data file: a view, not a copy
        (the data file is memory-mapped, isa/asm.py)."""
        if self.data is None:
            raise ProgramError(f"{self.source}: tensor {t.name!r} needs the data file "
                               f"{self.data_file!r}, which was not loaded")
        end = t.offset + t.nbytes
        if end > len(self.data):
            raise ProgramError(f"{self.source}: tensor {t.name!r} needs bytes {t.offset}..{end} "
                               f"of {self.data_file!r}, which has {len(self.data)}")
        return memoryview(self.data)[t.offset:end]

    def inputs(self) -> list[Tensor]:
        return [t for t in self.tensors if t.kind == "input"]

    def outputs(self) -> list[Tensor]:
        return [t for t in self.tensors if t.kind == "output"]


def pack(values: np.ndarray, dtype: str) -> np.ndarray:
    """Pack signed weights (any int array) into the storage bytes of ``dtype``, row-major."""
    if dtype not in PACK:
        return np.ascontiguousarray(values, dtype=STORAGE[dtype]).reshape(-1)
    per = PACK[dtype]
    bits = 8 // per
    v = np.asarray(values).reshape(-1)
    if not np.issubdtype(v.dtype, np.integer):
        v = v.astype(np.int64)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if v.size and (v.min() < lo or v.max() > hi):
        raise ValueError(f"values outside [{lo}, {hi}] cannot be packed as {dtype}")
    # In range, the low byte of a two's complement integer holds its low bits: work on bytes.
    u = np.zeros(-(-v.size // per) * per, np.uint8)
    u[:v.size] = v.view(np.uint8) if v.dtype.itemsize == 1 else v
    u = u.reshape(-1, per) & np.uint8((1 << bits) - 1)
    out = u[:, 0].copy()
    for j in range(1, per):
        out |= u[:, j] << np.uint8(j * bits)
    return out


def _unpack_table(bits: int) -> np.ndarray:
    per = 8 // bits
    b = np.arange(256, dtype=np.int64)[:, None] >> (np.arange(per) * bits)
    u = b & ((1 << bits) - 1)
    return np.where(u >= 1 << (bits - 1), u - (1 << bits), u).astype(np.int8)


UNPACK = {"w2": _unpack_table(2), "w4": _unpack_table(4)}


def unpack(storage: np.ndarray, dtype: str, count: int | None = None) -> np.ndarray:
    """Inverse of :func:`pack`: storage bytes to int8 weights (the last axis expands)."""
    if dtype not in PACK:
        return storage.view(np.int8) if storage.dtype == np.uint8 else storage
    out = UNPACK[dtype][storage]
    out = out.reshape(*storage.shape[:-1], storage.shape[-1] * PACK[dtype])
    return out if count is None else out[..., :count]
