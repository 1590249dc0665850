"""The D-Legion instruction set: the one table every other part is generated from.

Each instruction is a frozen dataclass. Its fields, in order, carry an operand kind (bit width,
text form, grammar; see ``isa/fields.py``) and a one-line doc; its class docstring is its
semantics in pseudo-code; ``QUEUE`` names the Legion queue that executes it. The vector
functions are rows of tables that also hold their numpy definition, which the emulator calls.
The grammar, the encoder, the printer and ``isa/SPEC.md`` are derived from this module.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from isa.fields import (ADDR_BITS, QUEUES, After, Dram, Keyword, Legion, LegionSet, OptAddr, OptTensor, OptUInt,
                        UInt, Until, View, ViewKind, ViewOrImm)

WORD_BITS = 320
OPCODE_BITS = 8
WAIT_DOC = "start only once that queue has completed that many instructions"


def F(kind, doc: str, default=dataclasses.MISSING):
    """Declare an instruction field of operand kind ``kind``."""
    return field(default=default, metadata={"kind": kind, "doc": doc})


SPAN_DOC = "Legions L..L+span-1 each run it on their own scratchpads (absent: L alone)"
LSTRIDE_DOC = "DRAM elements added to the offset per Legion of the span (rank r reads offset + r*lstride)"


def WAIT():
    """The optional dependency every non-sync instruction carries as its last field."""
    return F(After(), WAIT_DOC, default=None)


def SPAN():
    """The optional span of Legions every instruction that names a Legion carries."""
    return F(OptUInt(8), SPAN_DOC, default=None)


def LSTRIDE():
    """How a DMA's DRAM offset moves from one Legion of its span to the next."""
    return F(OptUInt(32), LSTRIDE_DOC, default=None)


class RowView(ViewKind):
    """A matrix operand of the systolic array: rows contiguous (cs = 1), one fixed space."""

    bits = ADDR_BITS + ViewKind.rs_bits          # addr, then rs

    def __init__(self, space: str):
        super().__init__(space)
        self.space = space
        self.grammar = f'"{space}[" INT "," INT "]"'

    def encode(self, v):
        return v.addr | v.rs << ADDR_BITS

    def decode(self, x):
        return View(self.space, x & ((1 << ADDR_BITS) - 1), x >> ADDR_BITS & ((1 << self.rs_bits) - 1), 1)

    def text(self, v, names):
        return f"{v.space}[{v.addr},{v.rs}]"

    def check(self, v):
        return super().check(v) or (None if v.cs == 1 else "matrix operands have cs = 1")


@dataclass(frozen=True)
class Instr:
    """Base of all instructions."""

    OPCODE = -1
    MNEMONIC = ""
    QUEUE = ""          # the Legion queue that runs it; "" when a field names it

    @classmethod
    def fields(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    @classmethod
    def doc(cls) -> str:
        return " ".join((cls.__doc__ or "").split())

    def queue(self) -> str:
        """The queue that runs it; ``*`` for a barrier, which every queue runs."""
        return self.QUEUE or self.queue_name

    def condition(self):
        """The progress condition it waits for before starting, if any."""
        return getattr(self, "wait", None)

    def bad_fields(self) -> list[str]:
        """Fields whose value the encoding cannot hold."""
        out = []
        for f in self.fields():
            why = f.metadata["kind"].check(getattr(self, f.name))
            if why:
                out.append(f"{f.name}: {why}")
        return out


# --- DMA queue -------------------------------------------------------------------------------

@dataclass(frozen=True)
class DmaLoad(Instr):
    """for l in dests, i < rows, j < cols: spad[l].dst(i, j) = convert(T[src.offset + i*src.rs + j]); one DRAM read serves every Legion in dests (multicast)"""

    OPCODE, MNEMONIC, QUEUE = 0x01, "dma.ld", "dma"
    legion: int = F(Legion(), "Legion whose DMA queue issues the transfer")
    dests: frozenset = F(LegionSet(), "Legions that receive the data (more than one: multicast)")
    dst: View = F(ViewKind(), "destination view in each receiving Legion's scratchpad")
    src: object = F(Dram(), "source tensor, element offset and row stride")
    rows: int = F(UInt(16), "rows transferred")
    cols: int = F(UInt(16), "elements per row")
    span: object = SPAN()
    lstride: object = LSTRIDE()
    wait: object = WAIT()


@dataclass(frozen=True)
class DmaStore(Instr):
    """for i < rows, j < cols: T[dst.offset + i*dst.rs + j] = convert(spad[legion].src(i, j))"""

    OPCODE, MNEMONIC, QUEUE = 0x02, "dma.st", "dma"
    legion: int = F(Legion(), "Legion whose scratchpad is read")
    dst: object = F(Dram(), "destination tensor, element offset and row stride")
    src: View = F(ViewKind(), "source view")
    rows: int = F(UInt(16), "rows transferred")
    cols: int = F(UInt(16), "elements per row")
    span: object = SPAN()
    lstride: object = LSTRIDE()
    wait: object = WAIT()


@dataclass(frozen=True)
class Gather(Instr):
    """for i < rows, j < cols: spad.dst(i, j) = convert(T[table.offset + int(ids(i, 0))*table.rs + j])"""

    OPCODE, MNEMONIC, QUEUE = 0x03, "gather", "dma"
    legion: int = F(Legion(), "Legion that receives the rows")
    dst: View = F(ViewKind("vec", "act"), "destination view")
    table: object = F(Dram(), "table tensor, offset of row 0 and row stride")
    ids: View = F(ViewKind("vec"), "row indices, one per destination row (exact integers)")
    rows: int = F(UInt(16), "rows gathered")
    cols: int = F(UInt(16), "elements per row")
    span: object = SPAN()
    lstride: object = LSTRIDE()
    wait: object = WAIT()


@dataclass(frozen=True)
class NocMove(Instr):
    """for l in dests, i < rows, j < cols: spad[l].dst(i, j) = spad[legion].src(i, j); one send over the source Legion's NoC link serves every Legion in dests (multicast); DRAM is not touched"""

    OPCODE, MNEMONIC, QUEUE = 0x04, "noc.mv", "dma"
    legion: int = F(Legion(), "Legion whose scratchpad is read and whose DMA queue sends it")
    dests: frozenset = F(LegionSet(), "Legions that receive the data (more than one: multicast; the source itself: a local copy)")
    dst: View = F(ViewKind(), "destination view in each receiving Legion's scratchpad, of the source's space")
    src: View = F(ViewKind(), "source view in the sending Legion's scratchpad")
    rows: int = F(UInt(16), "rows transferred")
    cols: int = F(UInt(16), "elements per row")
    span: object = F(OptUInt(8), "Legions L..L+span-1 each send their own src, rank r to each of dests moved by r (absent: L alone)", default=None)
    wait: object = WAIT()


@dataclass(frozen=True)
class NocAdd(NocMove):
    """for l in dests, i < rows, j < cols: spad[l].dst(i, j) += spad[legion].src(i, j) in int32 (acc to acc, wrapping as the accumulators do); one send over the source Legion's NoC link, each receiver adding as the words arrive (the reduction of a K split's partial sums)"""

    OPCODE, MNEMONIC, QUEUE = 0x05, "noc.add", "dma"


# --- matrix queue ----------------------------------------------------------------------------

@dataclass(frozen=True)
class MatMul(Instr):
    """acc(m, n) = [acc(m, n) +] sum_k act(m, k) * W(k, n) for m < M, k < K, n < N, in int32; N x N blocks of W whose mask bit is 0 are skipped"""

    OPCODE, MNEMONIC, QUEUE = 0x10, "mm", "mat"
    legion: int = F(Legion(), "Legion whose cores run the passes")
    acc: View = F(RowView("acc"), "int32 accumulators, M x N")
    act: View = F(RowView("act"), "int8 input rows, M x K, streamed through the arrays")
    wgt: View = F(RowView("wgt"), "weights, K x N packed at the mode's width; rs in bytes")
    M: int = F(UInt(16), "input rows streamed per pass")
    K: int = F(UInt(16), "contraction depth")
    N: int = F(UInt(16), "output columns")
    mode: str = F(Keyword("w8", "w4", "w2"), "precision: weights of 8, 4 or 2 bits, 1/2/4 tiles a window")
    split: str = F(Keyword("k", "n"), "how passes spread over cores: K-slices summed by the parallel accumulators, or output windows")
    accumulate: str = F(Keyword("set", "add"), "overwrite or add to the accumulators")
    mask: object = F(OptTensor(), "u8 tensor [ceil(K/array), ceil(N/array)]: 0 marks an all-zero weight block")
    span: object = SPAN()
    wait: object = WAIT()


# --- vector queue ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Drain(Instr):
    """v = fp32(acc(m, n) + zp[n]) * rscale[m] * cscale[n] + bias[n]; dst(m, n) = [dst(m, n) +] v for m < M, n < N (absent operands drop out)"""

    OPCODE, MNEMONIC, QUEUE = 0x20, "drain", "vec"
    legion: int = F(Legion(), "Legion")
    dst: View = F(ViewKind("vec", "act"), "destination (act: rounded half to even and saturated)")
    acc: View = F(RowView("acc"), "int32 accumulators")
    M: int = F(UInt(16), "rows")
    N: int = F(UInt(16), "columns")
    zp: object = F(OptAddr("acc"), "int32 per-column correction added before conversion (zero points)")
    rscale: object = F(OptAddr("vec"), "fp32 per-row scale (activation scale per token)")
    cscale: object = F(OptAddr("vec"), "fp32 per-column scale (weight scale per channel or block)")
    bias: object = F(OptAddr("vec"), "fp32 per-column bias")
    accumulate: str = F(Keyword("set", "add"), "overwrite or add to dst")
    span: object = SPAN()
    wait: object = WAIT()


@dataclass(frozen=True)
class VUnary(Instr):
    """dst(i, j) = f(a(i, j)) for i < rows, j < cols"""

    QUEUE = "vec"
    FUNC = staticmethod(lambda a: a)
    legion: int = F(Legion(), "Legion")
    dst: View = F(ViewKind(), "destination (integer spaces: rounded half to even, saturated)")
    a: View = F(ViewKind(), "operand (a stride of 0 broadcasts)")
    rows: int = F(UInt(16), "rows")
    cols: int = F(UInt(16), "columns")
    span: object = SPAN()
    wait: object = WAIT()


@dataclass(frozen=True)
class VBinary(Instr):
    """dst(i, j) = f(a(i, j), b(i, j)) for i < rows, j < cols; b may be an fp32 immediate"""

    QUEUE = "vec"
    FUNC = staticmethod(lambda a, b: a)
    legion: int = F(Legion(), "Legion")
    dst: View = F(ViewKind(), "destination (integer spaces: rounded half to even, saturated)")
    a: View = F(ViewKind(), "first operand (a stride of 0 broadcasts)")
    b: object = F(ViewOrImm(), "second operand, or #immediate")
    rows: int = F(UInt(16), "rows")
    cols: int = F(UInt(16), "columns")
    span: object = SPAN()
    wait: object = WAIT()


@dataclass(frozen=True)
class VReduce(Instr):
    """dst(i, 0) = f(a(i, 0), ..., a(i, cols-1)) for i < rows"""

    QUEUE = "vec"
    FUNC = staticmethod(lambda a: a)
    legion: int = F(Legion(), "Legion")
    dst: View = F(ViewKind(), "destination column (rows x 1; cs unused)")
    a: View = F(ViewKind(), "operand")
    rows: int = F(UInt(16), "rows")
    cols: int = F(UInt(16), "columns reduced")
    span: object = SPAN()
    wait: object = WAIT()


@dataclass(frozen=True)
class VSelect(Instr):
    """dst(i, j) = a(i, j) if cond(i, j) != 0 else dst(i, j) for i < rows, j < cols"""

    OPCODE, MNEMONIC, QUEUE = 0x30, "vsel", "vec"
    legion: int = F(Legion(), "Legion")
    dst: View = F(ViewKind(), "destination, kept where cond is 0")
    cond: View = F(ViewKind(), "condition")
    a: object = F(ViewOrImm(), "value taken where cond is not 0, or #immediate")
    rows: int = F(UInt(16), "rows")
    cols: int = F(UInt(16), "columns")
    span: object = SPAN()
    wait: object = WAIT()


@dataclass(frozen=True)
class VMatMul(Instr):
    """dst(m, n) = fp32(sum_k a(m, k) * b(k, n)) for m < M, n < N, k < K: the exact sum of the fp32 products rounded once to fp32, so no summation order or blocking changes it (float activation x activation products on the vector lanes)"""

    OPCODE, MNEMONIC, QUEUE = 0x31, "vmm", "vec"
    legion: int = F(Legion(), "Legion")
    dst: View = F(ViewKind("vec"), "destination, M x N")
    a: View = F(ViewKind("vec"), "left operand, M x K")
    b: View = F(ViewKind("vec"), "right operand, K x N")
    M: int = F(UInt(16), "rows")
    K: int = F(UInt(16), "contraction depth")
    N: int = F(UInt(16), "columns")
    span: object = SPAN()
    wait: object = WAIT()


# --- synchronization -------------------------------------------------------------------------

@dataclass(frozen=True)
class Wait(Instr):
    """queue (legion, queue_name) issues nothing further until queue until.legion/until.queue has completed until.count instructions"""

    OPCODE, MNEMONIC = 0x41, "wait"
    legion: int = F(Legion(), "Legion of the waiting queue")
    queue_name: str = F(Keyword(*QUEUES, keyed=False), "queue that waits")
    until: object = F(Until(), "the progress it waits for")
    span: object = SPAN()

    def condition(self):
        return self.until


@dataclass(frozen=True)
class Barrier(Instr):
    """every queue of every Legion stops here until all of them have completed every earlier instruction"""

    OPCODE, MNEMONIC, QUEUE = 0x42, "barrier", "*"


# --- vector functions: one row each, numpy is the definition ---------------------------------

def _rsqrt(a):
    return np.float32(1) / np.sqrt(a)


def _sigmoid(a):
    return np.float32(1) / (np.float32(1) + np.exp(-a))


def _bool(x):
    return x.astype(np.float32)


# (name, semantics doc, numpy function, transcendental: costs the arch's transcendental cycles)
UNARY = [
    ("mov", "a", lambda a: a, False),
    ("neg", "-a", np.negative, False),
    ("abs", "|a|", np.abs, False),
    ("relu", "max(a, 0)", lambda a: np.maximum(a, np.float32(0)), False),
    ("round", "round half to even", np.rint, False),
    ("floor", "floor(a)", np.floor, False),
    ("ceil", "ceil(a)", np.ceil, False),
    ("trunc", "round toward zero", np.trunc, False),
    ("sign", "sign(a)", np.sign, False),
    ("isnan", "1 if a is NaN else 0", lambda a: _bool(np.isnan(a)), False),
    ("isinf", "1 if a is +-inf else 0", lambda a: _bool(np.isinf(a)), False),
    ("not", "1 if a == 0 else 0", lambda a: _bool(a == 0), False),
    ("exp", "exp(a)", np.exp, True),
    ("log", "ln(a)", np.log, True),
    ("sqrt", "sqrt(a)", np.sqrt, True),
    ("rsqrt", "1 / sqrt(a)", _rsqrt, True),
    ("recip", "1 / a", lambda a: np.float32(1) / a, True),
    ("sigmoid", "1 / (1 + exp(-a))", _sigmoid, True),
    ("tanh", "tanh(a)", np.tanh, True),
    ("sin", "sin(a)", np.sin, True),
    ("cos", "cos(a)", np.cos, True),
]

BINARY = [
    ("add", "a + b", np.add, False),
    ("sub", "a - b", np.subtract, False),
    ("mul", "a * b", np.multiply, False),
    ("max", "max(a, b), NaN if either is", np.maximum, False),
    ("min", "min(a, b), NaN if either is", np.minimum, False),
    ("eq", "1 if a == b else 0", lambda a, b: _bool(a == b), False),
    ("lt", "1 if a < b else 0", lambda a, b: _bool(a < b), False),
    ("le", "1 if a <= b else 0", lambda a, b: _bool(a <= b), False),
    ("gt", "1 if a > b else 0", lambda a, b: _bool(a > b), False),
    ("ge", "1 if a >= b else 0", lambda a, b: _bool(a >= b), False),
    ("and", "1 if a != 0 and b != 0 else 0", lambda a, b: _bool((a != 0) & (b != 0)), False),
    ("or", "1 if a != 0 or b != 0 else 0", lambda a, b: _bool((a != 0) | (b != 0)), False),
    ("div", "a / b", np.divide, True),
    ("pow", "a ** b", np.power, True),
    ("fmod", "fmod(a, b), sign of a", np.fmod, True),
]

REDUCE = [
    ("rsum", "a(i, 0) + ... + a(i, cols-1) in fp32, in numpy's pairwise order (its rounding depends on cols)",
     lambda a: np.sum(a, axis=-1, dtype=np.float32), False),
    ("rmax", "max over the row", lambda a: np.max(a, axis=-1), False),
    ("rmin", "min over the row", lambda a: np.min(a, axis=-1), False),
]


def _define(base: type, name: str, opcode: int, doc: str, fn, transcendental: bool) -> type:
    operands = "a, b" if base is VBinary else "a"
    cls = type(f"V{name.capitalize()}", (base,), {
        "__doc__": f"{base.__doc__.strip()}; f({operands}) = {doc}",
        "OPCODE": opcode, "MNEMONIC": "v" + name, "FUNC": staticmethod(fn),
        "TRANSCENDENTAL": transcendental, "__module__": __name__,
    })
    return dataclass(frozen=True)(cls)


VECTOR_FUNCS: list[type] = (
    [_define(VUnary, n, 0x50 + i, d, fn, t) for i, (n, d, fn, t) in enumerate(UNARY)]
    + [_define(VBinary, n, 0x80 + i, d, fn, t) for i, (n, d, fn, t) in enumerate(BINARY)]
    + [_define(VReduce, n, 0xB0 + i, d, fn, t) for i, (n, d, fn, t) in enumerate(REDUCE)]
)

INSTRUCTIONS: tuple[type, ...] = (DmaLoad, DmaStore, Gather, NocMove, NocAdd, MatMul, Drain, VSelect, VMatMul,
                                  Wait, Barrier,
                                  *VECTOR_FUNCS)
BY_MNEMONIC = {c.MNEMONIC: c for c in INSTRUCTIONS}
BY_OPCODE = {c.OPCODE: c for c in INSTRUCTIONS}
TRANSCENDENTAL = frozenset(c for c in VECTOR_FUNCS if c.TRANSCENDENTAL)
DMA_CLASSES = frozenset({DmaLoad, DmaStore, Gather})      # DRAM transfers
NOC_CLASSES = frozenset({NocMove, NocAdd})                 # Legion-to-Legion transfers, on the DMA queue
TRANSFER_CLASSES = DMA_CLASSES | NOC_CLASSES               # the DMA queue's instructions
SYNC_CLASSES = frozenset({Wait, Barrier})
VECTOR_CLASSES = frozenset({Drain, VSelect, VMatMul, *VECTOR_FUNCS})


def family(cls: type) -> str:
    """Instruction family used by counters and reports: dma, matrix, drain, vector, sync."""
    if cls in TRANSFER_CLASSES:
        return "dma"
    if cls is MatMul:
        return "matrix"
    if cls is Drain:
        return "drain"
    if cls in SYNC_CLASSES:
        return "sync"
    return "vector"


def word_bits(cls: type) -> int:
    """Bits an instruction class uses of its fixed-width word, opcode included."""
    return OPCODE_BITS + sum(f.metadata["kind"].bits for f in cls.fields())
