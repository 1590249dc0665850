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
    if dtype.itemsize <= 2 and values.dtype.itemsize >= 4:
        return _float_to_narrow(values, dtype)
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


def _float_to_narrow(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """:func:`_float_to_int` into 8 or 16 bits from fp32 or wider, without the fp64 copy: those
    bounds are fp32 values, and rounding a float to an integer is exact in its own type."""
    info = np.iinfo(dtype)
    x = np.rint(values)
    np.copyto(x, 0.0, where=np.isnan(x))
    np.clip(x, info.min, info.max, out=x)
    return x.astype(dtype)


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


# Rows up to this many bytes, contiguous in both arrays, are copied as one raw element each.
WIDE_ROW = 256


def copy_into(target: np.ndarray, values: np.ndarray) -> None:
    """``target[...] = values`` for arrays of one dtype and shape (or ``values`` of one rank,
    for every rank of ``target``). numpy's copy pays per call
    of its inner loop, which runs along the last axis: a window of short rows (16 bytes of
    packed weights in a row of a DRAM matrix) costs a call per row. Rows contiguous in both
    arrays are copied instead as one raw element each (bytes, whatever the dtype holds), so
    the inner loop runs down the rows."""
    cols = target.shape[-1] if target.ndim else 0
    width = cols * target.itemsize
    if 1 < cols and width <= WIDE_ROW and target.strides[-1] == values.strides[-1] == target.itemsize \
            and values.shape[1:] == target.shape[1:] and values.shape[0] in (1, target.shape[0]):
        raw = _RAW[width]
        target.view(raw)[..., 0] = values.view(raw)[..., 0]
        return
    target[...] = values


# The raw element of each row width copy_into copies as one (made once: a dtype per call costs
# as much as a short copy).
_RAW = [np.dtype((np.void, width)) if width else None for width in range(WIDE_ROW + 1)]


# --- scratchpads ---------------------------------------------------------------------------

class Bank:
    """One space of every Legion, stacked: row L is Legion L's scratchpad, with a record of
    which elements were ever written. An instruction spanning Legions L..L+S-1 reads and
    writes rows L..L+S-1 through one strided view (span x rows x cols), so its S tasks are one
    numpy operation.

    A program names the same few windows over and over, so each window's checked views are
    kept by (first Legion, span, addr, rows, cols, rs, cs): the bounds and overlap checks run
    once per window, and a window once seen fully written needs no further check, as nothing
    unwrites."""

    def __init__(self, space: str, legions: int, elems: int, first: int = 0):
        self.space, self.first = space, first        # first: the Legion row 0 stands for
        self.data = np.zeros((legions, elems), SPACE_DTYPE[space])
        self.written = np.zeros((legions, elems), np.bool_)
        self._reads: dict[tuple, np.ndarray] = {}      # window -> read-only view, all written
        self._writes: dict[tuple, tuple] = {}          # window -> (data, written) writeable views
        self._full: dict[tuple, np.ndarray] = {}       # window a whole store has marked written -> data view

    def name(self, legion: int) -> str:
        return f"L{legion + self.first} {self.space}"

    def _check_bounds(self, legion: int, span: int, view: View, rows: int, cols: int) -> bool:
        """Whether the window is non-empty; traps when a Legion of the span does not exist or
        the window leaves the scratchpad. Only a window not seen before is checked: the
        machine's accesses look their bank up unchecked (they run per instruction)."""
        if legion < 0 or legion + span > len(self.data):
            bad = legion if legion < 0 else legion + span - 1
            raise Trap(f"Legion L{bad} does not exist (the machine has {len(self.data)})")
        if rows == 0 or cols == 0:
            return False
        last = last_element(view.addr, rows, cols, view.rs, view.cs)
        if last >= self.data.shape[1]:
            raise Trap(f"{self.name(legion)}[{view.addr}..{last}] ({rows}x{cols} of {view}) is outside "
                       f"the scratchpad of {self.data.shape[1]} elements")
        return True

    def _rows(self, flat: np.ndarray, legion: int, span: int, view: View, rows: int, cols: int,
              writeable: bool = False) -> np.ndarray:
        return window(flat[legion:legion + span], view.addr, rows, cols, view.rs, view.cs, writeable)

    def read(self, legion: int, span: int, view: View, rows: int, cols: int) -> np.ndarray:
        """A read-only span x rows x cols view of the elements (0 strides broadcast)."""
        key = (legion, span, view.addr, rows, cols, view.rs, view.cs)
        out = self._reads.get(key)
        if out is not None:
            return out
        if not self._check_bounds(legion, span, view, rows, cols):
            return np.zeros((span, rows, cols), self.data.dtype)
        seen = self._rows(self.written, legion, span, view, rows, cols)
        if not seen.all():
            r, i, j = np.unravel_index(np.argmin(seen), seen.shape)
            addr = view.addr + i * view.rs + j * view.cs
            raise Trap(f"read of never-written {self.name(legion + r)}[{addr}] "
                       f"(element ({i}, {j}) of {view})")
        out = self._reads[key] = self._rows(self.data, legion, span, view, rows, cols)
        return out

    def write(self, legion: int, view: View, values: np.ndarray, where: np.ndarray | None = None) -> None:
        """Store a span x rows x cols array (converted to the space's dtype) into Legions
        legion.. of the span; ``where`` limits the store to the elements where it is true."""
        span, rows, cols = values.shape
        if where is None:
            target = self.target(legion, span, view, rows, cols)
            if target is not None:
                copy_into(target, convert(values, self.data.dtype))
            return
        views = self._views(legion, span, view, rows, cols)
        if views is not None:
            np.copyto(views[0], convert(values, self.data.dtype), where=where)
            np.copyto(views[1], True, where=where)

    def target(self, legion: int, span: int, view: View, rows: int, cols: int) -> np.ndarray | None:
        """The writeable window a whole store fills, marked written (the caller fills it before
        anything reads it); None when empty."""
        key = (legion, span, view.addr, rows, cols, view.rs, view.cs)
        out = self._full.get(key)
        if out is not None:
            return out
        views = self._views(legion, span, view, rows, cols)
        if views is None:
            return None
        views[1][...] = True
        out = self._full[key] = views[0]
        return out

    def add_into(self, legion: int, view: View, values: np.ndarray) -> None:
        """``write(legion, view, read(...) + values)`` for a window already read whole (so
        written), ``values`` of the space's dtype: added in place, without a sum to copy
        (integers wrap, as the sum would)."""
        views = self._views(legion, values.shape[0], view, *values.shape[1:])
        if views is not None:
            np.add(views[0], values, out=views[0])

    def _views(self, legion: int, span: int, view: View, rows: int, cols: int) -> tuple | None:
        """The checked, writeable (data, written) views of a window, kept by window; None when
        empty."""
        key = (legion, span, view.addr, rows, cols, view.rs, view.cs)
        views = self._writes.get(key)
        if views is None:
            views = self._checked_target(legion, span, view, rows, cols)
            if views is not None:
                self._writes[key] = views
        return views

    def _checked_target(self, legion: int, span: int, view: View, rows: int, cols: int) -> tuple | None:
        """The writeable (data, written) views of a window a store may use; None when empty."""
        if not self._check_bounds(legion, span, view, rows, cols):
            return None
        if overlaps(rows, cols, view.rs, view.cs):
            raise Trap(f"write to {self.name(legion)} through {view} ({rows}x{cols}) hits some "
                       f"element twice")
        return (self._rows(self.data, legion, span, view, rows, cols, writeable=True),
                self._rows(self.written, legion, span, view, rows, cols, writeable=True))


class Scratchpad:
    """One space of one Legion, as a :class:`Bank` of one row: rows x cols reads and writes."""

    def __init__(self, legion: int, space: str, elems: int):
        self.bank = Bank(space, 1, elems, first=legion)

    @property
    def data(self) -> np.ndarray:
        return self.bank.data[0]

    def read(self, view: View, rows: int, cols: int) -> np.ndarray:
        return self.bank.read(0, 1, view, rows, cols)[0]

    def write(self, view: View, values: np.ndarray, where: np.ndarray | None = None) -> None:
        self.bank.write(0, view, values[None], None if where is None else where[None])


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
        self.banks = {s: Bank(s, arch.legions, elems[s]) for s in SPACES}
        self.legions = arch.legions
        self.watch = None         # told of every access instructions make (runtime/races.py)
        self.unpacked: dict = {}  # a matmul's unpacked weights, by shape (runtime/semantics.py)

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
        alias = self.program.aliases.get(t.name)
        if alias is None:
            self.dram[index] = array.reshape(-1).copy()
            return
        out, offset, strides = alias       # the input lives in an output's storage (Program.aliases)
        flat = self.dram[self.lookup(out, by=("name",))]
        place = np.lib.stride_tricks.as_strided(flat[offset:], array.shape,
                                                tuple(s * flat.itemsize for s in strides))
        place[...] = array

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

    def _dram_check(self, ref: DramRef, rows: int, cols: int, span: int, lstride: int) -> bool:
        """Whether the access is non-empty; traps when a rank's window leaves the tensor (rank
        r's starts ``r * lstride`` past ``ref.offset``)."""
        t = self.tensor(ref.tensor)
        if rows == 0 or cols == 0:
            return False
        first_last = last_element(ref.offset, rows, cols, ref.rs, 1)
        if first_last + (span - 1) * lstride >= t.storage_elems:
            over = first_last >= t.storage_elems or not lstride
            r = 0 if over else -(-(t.storage_elems - first_last) // lstride)    # the first rank out
            offset = ref.offset + r * lstride
            raise Trap(f"@{t.name}[{offset}..{first_last + r * lstride}] ({rows}x{cols}, row stride "
                       f"{ref.rs}) is outside tensor {t.name} of {t.storage_elems} storage elements")
        return True

    def dram_read(self, ref: DramRef, rows: int, cols: int, span: int = 1, lstride: int = 0) -> np.ndarray:
        """A read-only span x rows x cols view of a tensor's storage elements."""
        if not self._dram_check(ref, rows, cols, span, lstride):
            return np.zeros((span, rows, cols), self.dram[ref.tensor].dtype)
        if self.watch is not None:
            self.watch.dram_access(ref.tensor, ref.offset, ref.rs, rows, cols, False, span, lstride)
        return _ranks(self.dram[ref.tensor], ref, rows, cols, span, lstride)

    def dram_write(self, ref: DramRef, values: np.ndarray, lstride: int = 0) -> None:
        span, rows, cols = values.shape
        if not self._dram_check(ref, rows, cols, span, lstride):
            return
        if overlaps(rows, cols, ref.rs, 1):
            name = self.tensor(ref.tensor).name
            raise Trap(f"write to @{name} with row stride {ref.rs} < {cols} columns overlaps rows")
        if self.watch is not None:
            self.watch.dram_access(ref.tensor, ref.offset, ref.rs, rows, cols, True, span, lstride)
        flat = self.dram[ref.tensor]
        if not flat.flags.writeable:         # a constant (the verifier refuses that): copy, never the file
            flat = self.dram[ref.tensor] = flat.copy()
        values = convert(values, flat.dtype)
        if span > 1 and not _ranks_apart(span, rows, cols, ref.rs, lstride):
            for r in range(span):            # ranks that share elements (a race): in rank order
                _ranks(flat, ref, rows, cols, 1, 0, offset=ref.offset + r * lstride, writeable=True)[...] = values[r]
            return
        copy_into(_ranks(flat, ref, rows, cols, span, lstride, writeable=True), values)

    # -- scratchpads --

    def read(self, legion: int, view: View, rows: int, cols: int, span: int = 1) -> np.ndarray:
        """Legions legion..legion+span-1's windows, span x rows x cols; rows x cols for one."""
        out = self.banks[view.space].read(legion, span, view, rows, cols)
        if self.watch is not None:      # after the read: a trap of the read comes first
            self.watch.spad(legion, span, view, rows, cols, False)
        return out

    def add_into(self, legion: int, view: View, values: np.ndarray) -> None:
        """Legions legion..legion+span-1's windows plus span x rows x cols ``values`` (of the
        space's dtype), stored back: the read and the write of an accumulation, as
        ``write(legion, view, read(...) + values)`` makes them, without the sum's copy."""
        span, rows, cols = values.shape
        bank = self.banks[view.space]
        bank.read(legion, span, view, rows, cols)      # traps on a never-written element
        if self.watch is not None:
            self.watch.spad(legion, span, view, rows, cols, False)
        bank.add_into(legion, view, values)
        if self.watch is not None:
            self.watch.spad(legion, span, view, rows, cols, True)

    def target(self, legion: int, view: View, rows: int, cols: int, span: int = 1) -> np.ndarray | None:
        """The writeable span x rows x cols window of Legions legion.. a whole store fills,
        for the caller to compute into at once (None when empty): checked, marked written and
        told as :meth:`write` does."""
        out = self.banks[view.space].target(legion, span, view, rows, cols)
        if self.watch is not None:
            self.watch.spad(legion, span, view, rows, cols, True)
        return out

    def multicast(self, dests, view: View, values: np.ndarray) -> None:
        """``write(legion, view, values)`` for each Legion of ``dests`` in order (``values``:
        1 x rows x cols, not a view of a window it overwrites), as one store per run of
        consecutive Legions: the same bytes, marks and told accesses, one copy call per run."""
        legions = sorted(dests)
        if values.shape[0] != 1 or not legions or legions[0] < 0 or legions[-1] >= self.arch.legions:
            for legion in legions:       # a missing Legion traps where the plain stores would
                self.write(legion, view, values)
            return
        bank = self.banks[view.space]
        values = convert(values, bank.data.dtype)
        rows, cols = values.shape[1:]
        lo = 0
        for hi in range(1, len(legions) + 1):
            if hi < len(legions) and legions[hi] == legions[hi - 1] + 1:
                continue
            target = bank.target(legions[lo], hi - lo, view, rows, cols)
            if target is not None:
                copy_into(target, values)     # the one rank into every Legion of the run
            if self.watch is not None:
                for legion in legions[lo:hi]:
                    self.watch.spad(legion, 1, view, rows, cols, True)
            lo = hi

    def write(self, legion: int, view: View, values: np.ndarray,
              where: np.ndarray | None = None) -> None:
        """Store span x rows x cols ``values`` into Legions legion..legion+span-1."""
        span = values.shape[0]
        self.banks[view.space].write(legion, view, values, where)
        if self.watch is not None:
            self.watch.spad(legion, span, view, *values.shape[1:], True)


def _ranks_apart(span: int, rows: int, cols: int, rs: int, lstride: int) -> bool:
    """Whether no two ranks of a DRAM store share an element (rank r's rows x cols window,
    row stride ``rs``, starts ``r * lstride`` further): each starts past the last one's end,
    or the ranks sit side by side in every row (lstride >= cols) and all of them fit in a
    row stride, so an element's row, rank and column are its index's quotients."""
    if lstride >= last_element(0, rows, cols, rs, 1) + 1:
        return True
    return cols <= lstride and (span - 1) * lstride + cols <= rs


def _ranks(flat: np.ndarray, ref: DramRef, rows: int, cols: int, span: int, lstride: int,
           offset: int | None = None, writeable: bool = False) -> np.ndarray:
    """The span x rows x cols view of ``flat`` whose rank r starts ``r * lstride`` past
    ``offset`` (default: the reference's)."""
    item = flat.itemsize
    start = ref.offset if offset is None else offset
    out = np.ndarray((span, rows, cols), flat.dtype, flat, start * item,
                     (lstride * item, ref.rs * item, item))
    out.flags.writeable = writeable
    return out
