"""Hypothesis strategies for valid instructions and programs, drawn from the instruction table.

    from strategies import instructions, programs      # tests/ is on sys.path under pytest
    @given(programs())
    def test_something(p): ...

Every value fits its field's encoding (``Instr.bad_fields()`` is empty); fp32 immediates are
NaN-free so programs compare equal after a round trip; DRAM references index the program's
tensor table. Progress conditions name any Legion, queue and count the encoding holds, so a
program is well-formed but need not pass the verifier (a Legion may be out of range, a count
unreachable).
"""
from __future__ import annotations

from hypothesis import strategies as st

from isa.encoding import kind_entry
from isa.fields import ADDR_BITS, QUEUES, Cond, DramRef, View
from isa.instructions import INSTRUCTIONS
from isa.program import DTYPES, KINDS, Program, Tensor

NAME_START = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
NAME_REST = NAME_START + "0123456789"


def uints(bits: int) -> st.SearchStrategy[int]:
    return st.integers(0, (1 << bits) - 1)


def views(spaces, rs_bits: int = 16, cs_bits: int = 16, cs=None) -> st.SearchStrategy[View]:
    cs_values = st.just(cs) if cs is not None else uints(cs_bits)
    return st.builds(View, st.sampled_from(spaces), uints(ADDR_BITS), uints(rs_bits), cs_values)


def fp32s() -> st.SearchStrategy[float]:
    """Every fp32 value but NaN, the largest finite ones and the infinities included."""
    return st.floats(width=32, allow_nan=False)


def conds(kind) -> st.SearchStrategy[Cond]:
    """Absolute and relative conditions, on a named Legion or the waiting one's own."""
    legion = st.none() | uints(kind.legion_bits)
    absolute = st.builds(Cond, legion, st.sampled_from(QUEUES), uints(kind.count_bits))
    relative = st.builds(Cond, legion, st.sampled_from(QUEUES), st.none(), uints(kind.count_bits))
    return absolute | relative


def _dram(kind, n):
    return st.builds(DramRef, st.integers(0, n - 1), uints(kind.offset_bits), uints(kind.rs_bits))


# A strategy for a field's value, by kind class: (kind, number of tensors) -> strategy.
VALUES = {
    "Legion": lambda k, n: uints(k.bits),
    "LegionSet": lambda k, n: st.frozensets(st.integers(0, 63), min_size=1),
    "UInt": lambda k, n: uints(k.bits),
    "OptUInt": lambda k, n: st.none() | uints(k.value_bits),    # looked up before its base, UInt
    "Keyword": lambda k, n: st.sampled_from(k.choices),
    "RowView": lambda k, n: views((k.space,), k.rs_bits, cs=1),
    "ViewKind": lambda k, n: views(k.spaces, k.rs_bits, k.cs_bits),
    "OptAddr": lambda k, n: st.none() | uints(ADDR_BITS),
    "Dram": _dram,
    "OptTensor": lambda k, n: st.none() | st.integers(0, n - 1),
    "ViewOrImm": lambda k, n: fp32s() | views(k.view.spaces, k.view.rs_bits, k.view.cs_bits),
    "Until": lambda k, n: conds(k),
    "After": lambda k, n: st.none() | conds(k),      # looked up before its base, Until
}


def field_values(kind, n_tensors: int) -> st.SearchStrategy:
    make = kind_entry(VALUES, kind)
    if make is None:
        raise KeyError(f"no strategy for operand kind {type(kind).__name__}")
    return make(kind, n_tensors)


def instructions_of(cls: type, n_tensors: int = 1) -> st.SearchStrategy:
    """Valid instructions of one class; DRAM references index ``n_tensors`` tensors."""
    return st.builds(cls, *(field_values(f.metadata["kind"], n_tensors) for f in cls.fields()))


def instructions(n_tensors: int = 1) -> st.SearchStrategy:
    """Valid instructions of every class."""
    return st.sampled_from(INSTRUCTIONS).flatmap(lambda cls: instructions_of(cls, n_tensors))


names = st.builds(lambda a, b: a + b, st.sampled_from(NAME_START), st.text(NAME_REST, max_size=8))
graph_names = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


@st.composite
def tensors(draw, name: str) -> Tensor:
    kind = draw(st.sampled_from(KINDS))
    shape = tuple(draw(st.lists(st.integers(1, 4096), min_size=1, max_size=4)))
    t = Tensor(name, draw(st.sampled_from(DTYPES)), shape, kind, draw(st.none() | graph_names))
    if kind == "const":
        t.offset = draw(st.integers(0, 1 << 40))
    if kind == "input" and draw(st.booleans()):
        lo = draw(st.integers(-(1 << 31), 1 << 31))
        t.range = (lo, lo + draw(st.integers(1, 1 << 31)))
    return t


arch_names = st.sampled_from(["dlegion-tiny", "dlegion-8x8", "my arch.toml", "../a/b.toml"])
data_files = st.none() | st.sampled_from(["prog.s.data", "data dir/w \"q\".bin"])


def regions(n_instrs: int) -> st.SearchStrategy[list[tuple[int, str]]]:
    """Regions in program order over ``n_instrs`` instructions: empty ones, several at one
    index, and one after the last instruction included."""
    starts = st.lists(st.integers(0, n_instrs), max_size=4).map(sorted)
    return starts.flatmap(lambda at: st.lists(graph_names, min_size=len(at), max_size=len(at))
                          .map(lambda ns: list(zip(at, ns))))


@st.composite
def programs(draw, max_tensors: int = 5, max_instrs: int = 12) -> Program:
    """Valid programs: a unique-named tensor table, instructions that index it, regions, counts
    of skipped work, and approximations with the values they are made in."""
    table = draw(st.lists(names, min_size=1, max_size=max_tensors, unique=True))
    ts = [draw(tensors(n)) for n in table]
    instrs = draw(st.lists(instructions(len(ts)), max_size=max_instrs))
    skipped = draw(st.dictionaries(names, st.integers(0, 2**40), max_size=2))
    approximations = draw(st.dictionaries(names, st.lists(graph_names, max_size=3, unique=True), max_size=2))
    return Program(arch=draw(arch_names), tensors=ts, instrs=instrs, data_file=draw(data_files),
                   regions=draw(regions(len(instrs))), skipped=skipped, approximations=approximations)


