"""Functional machine state: DRAM tensors and each Legion's scratchpads, with checked access.

Every access is bounds-checked and fails with a :class:`Trap` naming the space or tensor, the
address range and the capacity. Scratchpads remember which elements were ever written, so a
program that reads data it never produced (often a missing wait) fails loudly instead
of computing on zeros.
"""
from __future__ import annotations

from math import gcd

import numpy as np

from isa.arch import Arch
from isa.fields import SPACE_DTYPE, SPACES, DramRef, View
from isa.program import PACK, STORAGE, Program, ProgramError, Tensor, unpack


class Trap(Exception):
    """A fault of the running program (bad address, uninitialised read, bad operand)."""


# --- conversions -----------------------------------------------------------------------------

def convert(values: np.ndarray, dtype) -> np.ndarray:
    """``values`` as ``dtype``: to integers rounds half to even, saturates, and stores NaN as 0."""
    values = np.asarray(values)
    dtype = np.dtype(dtype)
    if values.dtype == dtype:
        return values
    if dtype.kind == "f":
        return values.astype(dtype)
    if values.dtype.kind == "f":
        return _float_to_int(values, dtype)
    info = np.iinfo(dtype)
    return np.clip(values.astype(np.int64), info.min, info.max).astype(dtype)


def _float_to_int(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    # float64 holds every int8/int32 bound exactly; the int64 top needs the special case below.
    x = np.rint(values.astype(np.float64))
    np.copyto(x, 0.0, where=np.isnan(x))
    info = np.iinfo(dtype)
    top = float(info.max)
    if top == info.max:
        return np.clip(x, info.min, top).astype(dtype)
    out = np.clip(x, info.min, np.nextafter(top, 0.0)).astype(dtype)
    out[x >= top] = info.max
    return out


def move(values: np.ndarray, dtype) -> np.ndarray:
    """A DMA transfer's conversion: byte-wide integers move as raw bytes (the weight
    scratchpad holds bytes, int8 weights included); everything else converts."""
    dtype = np.dtype(dtype)
    same_width = values.dtype.itemsize == 1 and dtype.itemsize == 1
    if same_width and values.dtype.kind in "iu" and dtype.kind in "iu":
        return values.view(dtype)
    return convert(values, dtype)


# --- strided windows -------------------------------------------------------------------------

def window(flat: np.ndarray, addr: int, rows: int, cols: int, rs: int, cs: int,
           writeable: bool = False) -> np.ndarray:
    """The rows x cols view of ``flat``'s last axis with element (i, j) at addr + i*rs + j*cs
    (no copy; leading axes are kept)."""
    item = flat.itemsize
    out = np.ndarray(flat.shape[:-1] + (rows, cols), flat.dtype, flat, addr * item,
                     flat.strides[:-1] + (rs * item, cs * item))
    out.flags.writeable = writeable
    return out


def last_element(addr: int, rows: int, cols: int, rs: int, cs: int) -> int:
    return addr + (rows - 1) * rs + (cols - 1) * cs


def overlaps(rows: int, cols: int, rs: int, cs: int) -> bool:
    """Whether two distinct (i, j) of a rows x cols window share an element.

    (i, j) and (i + a, j - b) coincide when a*rs == b*cs; the smallest such a > 0, b > 0 is
    (cs/g, rs/g) with g = gcd(rs, cs).
    """
    if (rows > 1 and rs == 0) or (cols > 1 and cs == 0):
        return True
    if rows <= 1 or cols <= 1:
        return False
    g = gcd(rs, cs)
    return cs // g < rows and rs // g < cols


# --- scratchpads -----------------------------------------------------------------------------

class Scratchpad:
    """One space of one Legion: elements plus a record of which were ever written.

    A program names the same few windows over and over, so each window's checked views are
    kept by (addr, rows, cols, rs, cs): the bounds and overlap checks run once per window,
    and a window once seen fully written needs no further check, as nothing unwrites."""

    def __init__(self, legion: int, space: str, elems: int):
        self.name = f"L{legion} {space}"
        self.data = np.zeros(elems, SPACE_DTYPE[space])
        self.written = np.zeros(elems, np.bool_)
        self._reads: dict[tuple, np.ndarray] = {}      # window -> read-only view, all written
        self._writes: dict[tuple, tuple] = {}          # window -> (data, written) writeable views
        self._full: set[tuple] = set()                 # windows a whole store has marked written

    def _check_bounds(self, view: View, rows: int, cols: int) -> bool:
        """Whether the window is non-empty; traps when it leaves the scratchpad."""
        if rows == 0 or cols == 0:
            return False
        last = last_element(view.addr, rows, cols, view.rs, view.cs)
        if last >= self.data.size:
            raise Trap(f"{self.name}[{view.addr}..{last}] ({rows}x{cols} of {view}) is outside "
                       f"the scratchpad of {self.data.size} elements")
        return True

    def read(self, view: View, rows: int, cols: int) -> np.ndarray:
        """A read-only rows x cols view of the elements (0 strides broadcast)."""
        key = (view.addr, rows, cols, view.rs, view.cs)
        out = self._reads.get(key)
        if out is not None:
            return out
        if not self._check_bounds(view, rows, cols):
            return np.zeros((rows, cols), self.data.dtype)
        seen = window(self.written, view.addr, rows, cols, view.rs, view.cs)
        if not seen.all():
            i, j = np.unravel_index(np.argmin(seen), seen.shape)
            addr = view.addr + i * view.rs + j * view.cs
            raise Trap(f"read of never-written {self.name}[{addr}] (element ({i}, {j}) of {view})")
        out = self._reads[key] = window(self.data, view.addr, rows, cols, view.rs, view.cs)
        return out

    def write(self, view: View, values: np.ndarray, where: np.ndarray | None = None) -> None:
        """Store a rows x cols array (converted to the space's dtype); ``where`` limits the
        store to the elements where it is true."""
        rows, cols = values.shape
        key = (view.addr, rows, cols, view.rs, view.cs)
        views = self._writes.get(key)
        if views is None:
            views = self._checked_target(view, rows, cols)
            if views is None:
                return
            self._writes[key] = views
        target, seen = views
        values = convert(values, self.data.dtype)
        if where is None:
            target[...] = values
            if key not in self._full:
                seen[...] = True
                self._full.add(key)
            return
        np.copyto(target, values, where=where)
        np.copyto(seen, True, where=where)

    def _checked_target(self, view: View, rows: int, cols: int) -> tuple | None:
        """The writeable (data, written) views of a window a store may use; None when empty."""
        if not self._check_bounds(view, rows, cols):
            return None
        if overlaps(rows, cols, view.rs, view.cs):
            raise Trap(f"write to {self.name} through {view} ({rows}x{cols}) hits some "
                       f"element twice")
        return (window(self.data, view.addr, rows, cols, view.rs, view.cs, writeable=True),
                window(self.written, view.addr, rows, cols, view.rs, view.cs, writeable=True))


# --- the machine -----------------------------------------------------------------------------

def host_array(source: str, t: Tensor, make) -> np.ndarray:
    """``make()``, the host array of tensor ``t``. The emulator holds every DRAM tensor in host
    memory, so a shape the host cannot hold (numpy's MemoryError), or numpy cannot index
    (ValueError, raised before it allocates), is an error naming the tensor."""
    try:
        return make()
    except (MemoryError, ValueError, OverflowError):
        shape = ",".join(map(str, t.shape))
        raise ProgramError(f"{source}: tensor {t.name!r} {t.dtype}[{shape}] ({t.nbytes:,} bytes) "
                           f"is too large for the emulator's host memory") from None


class Machine:
    """DRAM (one flat array per tensor, in its storage dtype) and per-Legion scratchpads."""

    def __init__(self, program: Program, arch: Arch):
        self.program = program
        self.arch = arch
        self.dram = [self._initial(t) for t in program.tensors]
        elems = arch.derived.spad_elems
        self.spads = [{s: Scratchpad(legion, s, elems[s]) for s in SPACES}
                      for legion in range(arch.legions)]
        self.watch = None         # told of every access instructions make (runtime/races.py)

    def _initial(self, t: Tensor) -> np.ndarray:
        dtype = STORAGE[t.dtype]
        if t.kind != "const":
            # Zeros come from the OS on first touch: an untouched tensor costs no memory.
            return host_array(self.program.source, t, lambda: np.zeros(t.storage_elems, dtype))
        # A read-only view of the (memory-mapped) data file; copied only if a store writes it.
        return np.frombuffer(self.program.const_bytes(t), dtype)

    def free(self, index: int) -> None:
        """Give back a tensor no later instruction touches (runtime/liveness.py)."""
        self.dram[index] = None

    # -- tensors by name, for the host side --

    def lookup(self, key: str | int, by: tuple[str, ...] = ("name", "io_name")) -> int:
        """Tensor index of an index, or of a name matched against the attributes ``by`` in
        order (a graph name may equal another tensor's name)."""
        tensors = self.program.tensors
        if isinstance(key, int) and 0 <= key < len(tensors):
            return key
        for attr in by:
            for i, t in enumerate(tensors):
                if getattr(t, attr) == key:
                    return i
        known = ", ".join(t.name + (f" ({t.io_name})" if t.io_name else "") for t in tensors)
        raise ProgramError(f"{self.program.source}: no tensor {key!r} (known: {known or 'none'})")

    def set_input(self, key: str | int, array: np.ndarray) -> None:
        """Store an input's value; ``key`` is its graph name, tensor name or index."""
        index = self.lookup(key, by=("io_name", "name"))
        t = self.program.tensors[index]
        array = np.asarray(array)
        where = f"{self.program.source}: input {t.io_name or t.name!r}"
        if t.kind != "input":
            raise ProgramError(f"{where} is a {t.kind} tensor, not an input")
        if t.dtype in PACK:
            raise ProgramError(f"{where} has packed dtype {t.dtype}, which inputs cannot have")
        if array.dtype == np.bool_ and t.dtype == "u8":     # a graph's bool input is stored as u8: 0 or 1
            array = array.view(np.uint8)
        if array.dtype != STORAGE[t.dtype]:
            raise ProgramError(f"{where} wants {np.dtype(STORAGE[t.dtype])} ({t.dtype}), "
                               f"got {array.dtype}")
        if tuple(array.shape) != tuple(t.shape):
            raise ProgramError(f"{where} wants shape {list(t.shape)}, got {list(array.shape)}")
        self.dram[index] = array.reshape(-1).copy()

    def get(self, key: str | int) -> np.ndarray:
        """A copy of a tensor in its declared shape (packed weights unpacked to int8); ``key``
        is its tensor name, graph name or index."""
        index = self.lookup(key)
        t = self.program.tensors[index]
        flat = self.dram[index]
        if flat is None:
            raise ProgramError(f"{self.program.source}: tensor {t.name!r} was freed after its last use "
                               f"(the run keeps intermediates only when asked to)")
        if t.dtype in PACK:
            flat = unpack(flat, t.dtype, t.numel)
        return flat.reshape(t.shape).copy()

    # -- DRAM as instructions see it --

    def tensor(self, index: int) -> Tensor:
        if not 0 <= index < len(self.program.tensors):
            raise Trap(f"tensor index {index} out of range ({len(self.program.tensors)} tensors)")
        return self.program.tensors[index]

    def _dram_check(self, ref: DramRef, rows: int, cols: int) -> bool:
        """Whether the access is non-empty; traps when it leaves the tensor."""
        t = self.tensor(ref.tensor)
        if rows == 0 or cols == 0:
            return False
        last = last_element(ref.offset, rows, cols, ref.rs, 1)
        if last >= t.storage_elems:
            raise Trap(f"@{t.name}[{ref.offset}..{last}] ({rows}x{cols}, row stride {ref.rs}) "
                       f"is outside tensor {t.name} of {t.storage_elems} storage elements")
        return True

    def dram_read(self, ref: DramRef, rows: int, cols: int) -> np.ndarray:
        """A read-only rows x cols view of a tensor's storage elements."""
        if not self._dram_check(ref, rows, cols):
            return np.zeros((rows, cols), self.dram[ref.tensor].dtype)
        if self.watch is not None:
            self.watch.dram_access(ref.tensor, ref.offset, ref.rs, rows, cols, write=False)
        return window(self.dram[ref.tensor], ref.offset, rows, cols, ref.rs, 1)

    def dram_write(self, ref: DramRef, values: np.ndarray) -> None:
        rows, cols = values.shape
        if not self._dram_check(ref, rows, cols):
            return
        if overlaps(rows, cols, ref.rs, 1):
            name = self.tensor(ref.tensor).name
            raise Trap(f"write to @{name} with row stride {ref.rs} < {cols} columns overlaps rows")
        if self.watch is not None:
            self.watch.dram_access(ref.tensor, ref.offset, ref.rs, rows, cols, write=True)
        flat = self.dram[ref.tensor]
        if not flat.flags.writeable:         # a constant (the verifier refuses that): copy, never the file
            flat = self.dram[ref.tensor] = flat.copy()
        target = window(flat, ref.offset, rows, cols, ref.rs, 1, writeable=True)
        target[...] = convert(values, flat.dtype)

    # -- scratchpads --

    def spad(self, legion: int, space: str) -> Scratchpad:
        if not 0 <= legion < len(self.spads):
            raise Trap(f"Legion L{legion} does not exist (the machine has {len(self.spads)})")
        return self.spads[legion][space]

    def read(self, legion: int, view: View, rows: int, cols: int) -> np.ndarray:
        out = self.spad(legion, view.space).read(view, rows, cols)
        if self.watch is not None:      # after the read: a trap of the read comes first
            self.watch.spad(legion, view, rows, cols, write=False)
        return out

    def write(self, legion: int, view: View, values: np.ndarray,
              where: np.ndarray | None = None) -> None:
        self.spad(legion, view.space).write(view, values, where)
        if self.watch is not None:
            self.watch.spad(legion, view, *values.shape, write=True)
