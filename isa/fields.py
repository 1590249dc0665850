"""Operand kinds: how one instruction field is encoded in bits, printed as text and parsed.

Each instruction declares its fields with one of these kinds (see ``isa/instructions.py``).
The grammar, the binary encoder, the printer and the SPEC tables are all generated from the
kinds, so an instruction's text syntax and encoding cannot drift apart.

Text forms (``name`` is the field's name):

========================  ==========================  =====================================
kind                      text                        value in Python
========================  ==========================  =====================================
Legion                    ``L3``                      int
LegionSet                 ``{0-3,5}``                 frozenset[int]
UInt (keyed)              ``name=12``                 int
Keyword (keyed or bare)   ``name=w2`` or ``dma``      str
View                      ``vec[addr,rs,cs]``         View(space, addr, rs, cs)
OptAddr (keyed)           ``name=vec[addr]``/``none`` int or None
Dram                      ``@tensor[offset,rs]``      DramRef(tensor index, offset, rs)
OptTensor (keyed)         ``name=@tensor``/``none``   int (tensor index) or None
ViewOrImm                 a View or ``#1.5``          View or float (an fp32 value)
Until                     ``L0.dma>=5``, ``L0.dma``,  Cond(legion, queue, count, back)
                          ``dma``, ``dma~1``
After (keyed, optional)   ``wait=L0.dma>=5`` or       Cond or None
                          nothing
OptUInt (keyed, optional) ``name=12`` or nothing      int or None
========================  ==========================  =====================================

An *optional* kind's field is left out of the text when its value is None.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

# Scratchpad spaces of a Legion and the element each holds.
SPACES = ("act", "wgt", "acc", "vec")
QUEUES = ("dma", "mat", "vec")     # the queues of a Legion
SPACE_DTYPE = {"act": "int8", "wgt": "uint8", "acc": "int32", "vec": "float32"}
SPACE_DOC = {
    "act": "activation scratchpad, int8 elements",
    "wgt": "weight scratchpad, bytes (packed w2/w4 weights or int8 w8 weights)",
    "acc": "accumulator scratchpad, int32 elements",
    "vec": "vector scratchpad, fp32 elements",
}
ADDR_BITS = 26          # elements: 64 Mi, the largest scratchpad of the presets (tpuv4i, 48 MiB) fits


@dataclass(frozen=True)
class View:
    """A 2-D strided window of a Legion scratchpad: element (i, j) is at addr + i*rs + j*cs."""

    space: str
    addr: int
    rs: int
    cs: int = 1

    def __str__(self) -> str:
        return f"{self.space}[{self.addr},{self.rs},{self.cs}]"


@dataclass(frozen=True)
class DramRef:
    """Row-strided DRAM access: element (i, j) of tensor ``tensor`` is at offset + i*rs + j."""

    tensor: int
    offset: int
    rs: int


def f32(x: float) -> float:
    """Round a Python float to the nearest fp32 value (immediates are fp32)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def f32_text(x: float) -> str:
    """Shortest text that parses back to the same fp32 value."""
    if x != x:
        return "nan"
    if x in (float("inf"), float("-inf")):
        return "inf" if x > 0 else "-inf"
    for digits in range(1, 18):
        s = f"{x:.{digits}g}"
        try:
            if f32(float(s)) == x:
                return s
        except OverflowError:      # rounding up past the largest fp32
            continue
    return repr(x)


class Kind:
    """Base class of operand kinds. ``keyed`` kinds print as ``name=value``."""

    bits: int = 0
    keyed: bool = False
    optional: bool = False      # left out of the text when None
    grammar: str = ""           # Lark expression for the value part of the text

    def encode(self, v) -> int:
        raise NotImplementedError

    def decode(self, x: int):
        raise NotImplementedError

    def text(self, v, names) -> str:
        """``names`` maps a tensor index to its name."""
        raise NotImplementedError

    def check(self, v) -> str | None:
        """Why ``v`` cannot be encoded in this kind, or None."""
        return None


def _uint_fits(v, bits: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << bits)


class Legion(Kind):
    bits = 8
    grammar = "LEGION"

    def encode(self, v):
        return v

    def decode(self, x):
        return x

    def text(self, v, names):
        return f"L{v}"

    def check(self, v):
        return None if _uint_fits(v, self.bits) else f"Legion index {v!r} out of range"


class LegionSet(Kind):
    bits = 64
    grammar = "legion_set"

    def encode(self, v):
        return sum(1 << i for i in v)

    def decode(self, x):
        return frozenset(i for i in range(self.bits) if x >> i & 1)

    def text(self, v, names):
        parts, run = [], []
        for i in sorted(v):
            if run and i == run[-1] + 1:
                run.append(i)
                continue
            if run:
                parts.append(_run_text(run))
            run = [i]
        if run:
            parts.append(_run_text(run))
        return "{" + ",".join(parts) + "}"

    def check(self, v):
        if not isinstance(v, frozenset) or not v:
            return "Legion set must be a non-empty frozenset"
        return None if all(_uint_fits(i, 6) for i in v) else f"Legion set {sorted(v)} out of range"


def _run_text(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


class UInt(Kind):
    keyed = True
    grammar = "INT"

    def __init__(self, bits: int):
        self.bits = bits

    def encode(self, v):
        return v

    def decode(self, x):
        return x

    def text(self, v, names):
        return str(v)

    def check(self, v):
        return None if _uint_fits(v, self.bits) else f"{v!r} does not fit in {self.bits} bits"


class Keyword(Kind):
    """One of a few words; ``keyed=False`` prints the bare word (``signal L0 dma s0``)."""

    def __init__(self, *choices: str, keyed: bool = True):
        self.choices = choices
        self.keyed = keyed
        self.bits = max(1, (len(choices) - 1).bit_length())
        self.grammar = "(" + " | ".join(f'"{c}"' for c in choices) + ")"

    def encode(self, v):
        return self.choices.index(v)

    def decode(self, x):
        return self.choices[x]

    def text(self, v, names):
        return v

    def check(self, v):
        return None if v in self.choices else f"{v!r} is not one of {', '.join(self.choices)}"


class ViewKind(Kind):
    """A scratchpad view; ``spaces`` restricts which spaces the operand may name."""

    rs_bits = 16
    cs_bits = 16
    # Bit positions: the space's code, then addr, rs and cs.
    addr_at = 2
    rs_at = addr_at + ADDR_BITS
    cs_at = rs_at + rs_bits
    bits = cs_at + cs_bits
    grammar = "view"

    def __init__(self, *spaces: str):
        self.spaces = spaces or SPACES

    def encode(self, v):
        x = SPACES.index(v.space)
        return x | v.addr << self.addr_at | v.rs << self.rs_at | v.cs << self.cs_at

    def decode(self, x):
        addr = x >> self.addr_at & ((1 << ADDR_BITS) - 1)
        rs = x >> self.rs_at & ((1 << self.rs_bits) - 1)
        cs = x >> self.cs_at & ((1 << self.cs_bits) - 1)
        return View(SPACES[x & 3], addr, rs, cs)

    def text(self, v, names):
        return str(v)

    def check(self, v):
        if not isinstance(v, View):
            return f"expected a scratchpad view, got {v!r}"
        if v.space not in self.spaces:
            return f"space {v.space!r} not allowed here (allowed: {', '.join(self.spaces)})"
        for part, bits in (("addr", ADDR_BITS), ("rs", self.rs_bits), ("cs", self.cs_bits)):
            if not _uint_fits(getattr(v, part), bits):
                return f"view {part} {getattr(v, part)!r} does not fit in {bits} bits"
        return None


class OptAddr(Kind):
    """An optional address in one fixed space (a vector of per-row or per-column values)."""

    keyed = True
    bits = 1 + ADDR_BITS

    def __init__(self, space: str):
        self.space = space
        self.grammar = f'(NONE | "{space}[" INT "]")'

    def encode(self, v):
        return 0 if v is None else 1 | v << 1

    def decode(self, x):
        return None if not x & 1 else x >> 1

    def text(self, v, names):
        return "none" if v is None else f"{self.space}[{v}]"

    def check(self, v):
        return None if v is None or _uint_fits(v, ADDR_BITS) else f"address {v!r} out of range"


class Dram(Kind):
    tensor_bits, offset_bits, rs_bits = 12, 32, 24
    bits = tensor_bits + offset_bits + rs_bits
    grammar = "dram"

    def encode(self, v):
        return v.tensor | v.offset << self.tensor_bits | v.rs << (self.tensor_bits + self.offset_bits)

    def decode(self, x):
        t = x & ((1 << self.tensor_bits) - 1)
        off = x >> self.tensor_bits & ((1 << self.offset_bits) - 1)
        return DramRef(t, off, x >> (self.tensor_bits + self.offset_bits))

    def text(self, v, names):
        return f"@{names[v.tensor]}[{v.offset},{v.rs}]"

    def check(self, v):
        if not isinstance(v, DramRef):
            return f"expected a DRAM reference, got {v!r}"
        ok = (_uint_fits(v.tensor, self.tensor_bits) and _uint_fits(v.offset, self.offset_bits)
              and _uint_fits(v.rs, self.rs_bits))
        return None if ok else f"DRAM reference {v} out of range"


class OptTensor(Kind):
    keyed = True
    bits = 1 + Dram.tensor_bits
    grammar = '(NONE | "@" NAME)'

    def encode(self, v):
        return 0 if v is None else 1 | v << 1

    def decode(self, x):
        return None if not x & 1 else x >> 1

    def text(self, v, names):
        return "none" if v is None else f"@{names[v]}"

    def check(self, v):
        return None if v is None or _uint_fits(v, Dram.tensor_bits) else f"tensor {v!r} out of range"


class ViewOrImm(Kind):
    """Second operand of a binary vector op: a view, or an fp32 immediate broadcast everywhere."""

    bits = 1 + ViewKind.bits
    grammar = '(view | IMM)'

    def __init__(self, *spaces: str):
        self.view = ViewKind(*spaces)

    def encode(self, v):
        if isinstance(v, View):
            return self.view.encode(v) << 1
        return 1 | f32_bits(v) << 1

    def decode(self, x):
        return bits_f32(x >> 1 & 0xFFFFFFFF) if x & 1 else self.view.decode(x >> 1)

    def text(self, v, names):
        return str(v) if isinstance(v, View) else "#" + f32_text(v)

    def check(self, v):
        if isinstance(v, View):
            return self.view.check(v)
        if not isinstance(v, float):
            return f"immediate {v!r} is not an fp32 value"
        try:
            return None if v != v or f32(v) == v else f"immediate {v!r} is not an fp32 value"
        except OverflowError:
            return f"immediate {v!r} is outside the fp32 range"


@dataclass(frozen=True)
class Cond:
    """Queue ``queue`` of Legion ``legion`` has completed instructions, in order.

    ``legion`` None names the Legion that runs the waiting instruction (each Legion of a span its
    own). ``count`` is absolute (at least that many completed); None makes the condition relative
    to program order: every instruction dispatched to that queue before the waiting one, but the
    last ``back``. Relative conditions need no counting by whoever writes them, hold for every
    Legion of a span whatever its history, and can never wait for a later instruction.
    """

    legion: int | None
    queue: str
    count: int | None = None
    back: int = 0

    @property
    def relative(self) -> bool:
        return self.count is None

    def __str__(self) -> str:
        where = self.queue if self.legion is None else f"L{self.legion}.{self.queue}"
        if self.count is not None:
            return f"{where}>={self.count}"
        return f"{where}~{self.back}" if self.back else where


COND_PATTERN = r"(?:L[0-9]+\.)?(?:dma|mat|vec)(?:>=[0-9]+|~[0-9]+)?"


def parse_cond(text: str) -> Cond:
    """``L0.dma>=5``, ``L0.dma``, ``dma~1``, ... as a Cond."""
    where, ge, count = text.partition(">=")
    where, tilde, back = where.partition("~")
    legion, dot, queue = where.rpartition(".")
    return Cond(int(legion[1:]) if dot else None, queue, int(count) if ge else None, int(back) if tilde else 0)


class Until(Kind):
    """A progress condition on one queue: ``L0.dma>=5``, ``L0.dma``, ``dma``, ``dma~1``."""

    legion_bits, count_bits = 8, 24
    # Bit positions: "own Legion", the Legion, the queue, "relative", the count (or back).
    legion_at = 1
    queue_at = legion_at + legion_bits
    rel_at = queue_at + 2
    count_at = rel_at + 1
    bits = count_at + count_bits
    grammar = "COND"

    def encode(self, v):
        own, rel = v.legion is None, v.count is None
        return (int(own) | (0 if own else v.legion) << self.legion_at | QUEUES.index(v.queue) << self.queue_at
                | int(rel) << self.rel_at | (v.back if rel else v.count) << self.count_at)

    def decode(self, x):
        legion = None if x & 1 else x >> self.legion_at & ((1 << self.legion_bits) - 1)
        n = x >> self.count_at & ((1 << self.count_bits) - 1)
        queue = QUEUES[x >> self.queue_at & 3]
        return Cond(legion, queue, None, n) if x >> self.rel_at & 1 else Cond(legion, queue, n)

    def text(self, v, names):
        return str(v)

    def check(self, v):
        if not isinstance(v, Cond) or v.queue not in QUEUES:
            return f"expected a condition like L0.dma>=5 or dma~1, got {v!r}"
        n = v.back if v.count is None else v.count
        if not ((v.legion is None or _uint_fits(v.legion, self.legion_bits)) and _uint_fits(n, self.count_bits)):
            return f"condition {v} out of range"
        if v.count is not None and v.back:
            return f"condition {v} is absolute and relative at once"
        return None


class After(Until):
    """The optional ``wait=`` of an instruction: it starts only once the condition holds."""

    keyed = True
    optional = True
    bits = 1 + Until.bits

    def encode(self, v):
        return 0 if v is None else 1 | super().encode(v) << 1

    def decode(self, x):
        return None if not x & 1 else super().decode(x >> 1)

    def check(self, v):
        return None if v is None else super().check(v)


class OptUInt(UInt):
    """An optional unsigned integer, ``name=12``, left out of the text when absent."""

    optional = True

    def __init__(self, bits: int):
        super().__init__(bits)
        self.bits = 1 + bits
        self.value_bits = bits

    def encode(self, v):
        return 0 if v is None else 1 | v << 1

    def decode(self, x):
        return None if not x & 1 else x >> 1

    def check(self, v):
        if v is None or _uint_fits(v, self.value_bits):
            return None
        return f"{v!r} does not fit in {self.value_bits} bits"
