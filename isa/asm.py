"""Text format: parse programs with the LALR grammar ``grammar.lark``, print them canonically,
and load/save program files (text or binary) with their sidecar data file.

The parser runs the callbacks below while it reduces (no parse tree is built): operand rules
turn into Python values, and each instruction rule builds its class from its fields, which are
exactly one child each (see ``isa/gen.py`` for how the rules are named).
"""
from __future__ import annotations

import difflib
import functools
import json
import mmap
import os
import re
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import lark

from isa import arch as arch_mod
from isa import encoding, gen
from isa.bulk import no_cycle_collection
from isa.files import Staged, atomic_write_all, check_readable
from isa.fields import (ADDR_BITS, QUEUES, SPACES, After, Cond, Dram, DramRef, Keyword, Legion, LegionSet, OptAddr,
                        OptTensor, OptUInt, UInt, Until, View, ViewKind, ViewOrImm, f32, parse_cond)
from isa.instructions import BY_MNEMONIC, INSTRUCTIONS, OPCODE_BITS, Instr, RowView
from isa.program import Program, ProgramError, Tensor

DIRECTIVES = (".arch", ".data", ".tensor", ".skipped", ".approximation", ".alias", ".region")
ARCH_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
LEGION_SET_BITS = LegionSet.bits


# --- building a program while parsing --------------------------------------------------------

class _Builder:
    """Collects one program, statement by statement in source order."""

    def __init__(self, text: str, source: str):
        self.text, self.source = text, source
        self.p = Program(arch="", source=source)
        self.index: dict[str, int] = {}
        self.words: list[bytes] = []    # of the instructions, checked and packed as they are read
        self.offset = 0             # lines of ``text`` before the piece being parsed

    def error(self, tok, msg: str) -> ProgramError:
        return located(self.text, self.source, tok.line + self.offset, tok.column, msg)

    def set_arch(self, tok) -> None:
        self._directive_first(tok, ".arch")
        if self.p.arch:
            raise self.error(tok, "a second .arch directive")
        self.p.arch = _string(self, tok) if tok.type == "STRING" else str(tok)
        self.p.arch_at = f"{self.source}:{tok.line + self.offset}:{tok.column}"

    def set_data(self, tok) -> None:
        self._directive_first(tok, ".data")
        if self.p.data_file is not None:
            raise self.error(tok, "a second .data directive")
        self.p.data_file = _string(self, tok)

    def add_tensor(self, tok, t: Tensor) -> None:
        self._directive_first(tok, ".tensor")
        if t.name in self.index:
            raise self.error(tok, f"tensor {t.name!r} declared twice")
        why = encoding.tensor_error(t)
        if why:
            raise self.error(tok, why)
        self.index[t.name] = len(self.p.tensors)
        self.p.tensors.append(t)

    def add_skipped(self, tok, count) -> None:
        self._directive_first(tok, ".skipped")
        if str(tok) in self.p.skipped:
            raise self.error(tok, f"a second .skipped {tok}")
        self.p.skipped[str(tok)] = int(count)

    def add_approximation(self, tok, values: list) -> None:
        self._directive_first(tok, ".approximation")
        if str(tok) in self.p.approximations:
            raise self.error(tok, f"a second .approximation {tok}")
        names = [_string(self, v) for v in values]
        for v, name in zip(values, names):
            if names.count(name) > 1:
                raise self.error(v, f".approximation {tok} names {_quoted(name)} twice")
        self.p.approximations[str(tok)] = names

    def add_alias(self, tok, out, offset, strides: tuple) -> None:
        self._directive_first(tok, ".alias")
        if str(tok) in self.p.aliases:
            raise self.error(tok, f"a second .alias {tok}")
        self.p.aliases[str(tok)] = (str(out), int(offset), strides)
        why = encoding.alias_error(self.p)
        if why:
            raise self.error(tok, why)

    def add_region(self, tok) -> None:
        """A ``.region`` may come anywhere: it names the instructions that follow it."""
        self.p.regions.append((len(self.p.instrs), _string(self, tok)))

    def _directive_first(self, tok, what: str) -> None:
        if self.p.instrs:
            raise self.error(tok, f"{what} after the first instruction (directives come first)")

    def tensor(self, tok) -> int:
        if tok not in self.index:
            known = ", ".join(self.index) or "none"
            raise self.error(tok, f"unknown tensor {_quoted(str(tok))} (declared: {known})")
        return self.index[tok]

    def add_instr(self, op, i: Instr) -> None:
        word = encoding.checked_word(i)
        if word is None:
            raise self.error(op, f"{i.MNEMONIC}: {'; '.join(encoding.field_errors(i))}")
        self.p.instrs.append(i)
        self.p.lines.append(op.line + self.offset)
        self.words.append(word)

    def finish(self) -> Program:
        if not self.p.arch:
            raise ProgramError(f"{self.source}: missing .arch directive")
        encoding.keep_words(self.p, b"".join(self.words))
        return self.p


def _string(b: _Builder, tok) -> str:
    try:
        return json.loads(tok)
    except json.JSONDecodeError:
        raise b.error(tok, f"bad escape in string {tok}") from None


def _imm(b: _Builder, tok) -> float:
    try:
        return f32(float(tok[1:]))
    except OverflowError:
        raise b.error(tok, f"immediate {tok} is outside the fp32 range") from None


def _index(tok) -> int:
    return int(tok[1:])


def _cond(text: str | None):
    """``L0.dma>=5``, ``dma~1``, ... as a Cond (None for an optional condition that is absent)."""
    return None if text is None else parse_cond(text)


# Value of a field whose grammar symbol is a single token, by kind class; other kinds arrive
# as values already built by their rule's callback.
TOKEN_VALUE = {"Legion": _index, "Until": lambda tok: _cond(str(tok)), "UInt": int, "Keyword": str}

# Callbacks of the wrapper rules gen.py generates, by kind class: (builder, kind, children).
WRAPPED = {
    "RowView": lambda b, k, ch: View(k.space, int(ch[0]), int(ch[1]), 1),
    "OptAddr": lambda b, k, ch: None if ch[0].type == "NONE" else int(ch[0]),
    "OptTensor": lambda b, k, ch: None if ch[0].type == "NONE" else b.tensor(ch[0]),
    "ViewOrImm": lambda b, k, ch: ch[0] if isinstance(ch[0], View) else _imm(b, ch[0]),
}


class _Callbacks:
    """Parser callbacks, one per grammar rule; ``b`` is the builder of the current parse."""

    b: _Builder

    def __init__(self):
        for cls in INSTRUCTIONS:
            setattr(self, gen.rule_name(cls), self._instr_callback(cls))
        for kind in filter(gen.needs_wrapper, gen.all_kinds()):
            setattr(self, gen.wrapper_rule(kind), self._wrapped_callback(kind))

    def _instr_callback(self, cls: type):
        convert = [encoding.kind_entry(TOKEN_VALUE, gen.kind_of(f)) for f in cls.fields()]

        def build(ch):
            values = [v if c is None or v is None else c(v) for c, v in zip(convert, ch[1:])]
            self.b.add_instr(ch[0], cls(*values))
        return build

    def _wrapped_callback(self, kind):
        read = encoding.kind_entry(WRAPPED, kind)
        if read is None:
            raise ProgramError(f"no parser callback for operand kind {type(kind).__name__}")
        return lambda ch: read(self.b, kind, ch)

    def start(self, ch):
        return None

    def arch(self, ch):
        self.b.set_arch(ch[0])

    def data(self, ch):
        self.b.set_data(ch[0])

    def tensor(self, ch):
        name, dtype, shape, kind, io, offset, rng = ch
        io = None if io is None else _string(self.b, io)
        offset = None if offset is None else int(offset)
        self.b.add_tensor(name, Tensor(str(name), str(dtype), shape, str(kind), io, offset, rng))

    def skipped(self, ch):
        self.b.add_skipped(ch[0], ch[1])

    def approximation(self, ch):
        self.b.add_approximation(ch[0], ch[1:])

    def alias(self, ch):
        self.b.add_alias(*ch)

    def region(self, ch):
        self.b.add_region(ch[0])

    def shape(self, ch):
        return tuple(int(c) for c in ch if c is not None)

    def tensor_range(self, ch):
        return int(ch[0]), int(ch[1])

    def view(self, ch):
        return View(ch[0][:-1], int(ch[1]), int(ch[2]), int(ch[3]))

    def legion_set(self, ch):
        return frozenset().union(*(c for c in ch if c is not None))

    def legion_range(self, ch):
        lo, hi = int(ch[0]), int(ch[1] if ch[1] is not None else ch[0])
        if not lo <= hi < LEGION_SET_BITS:
            raise self.b.error(ch[0], f"bad Legion range {lo}-{hi} (Legions 0..{LEGION_SET_BITS - 1})")
        return range(lo, hi + 1)

    def dram(self, ch):
        return DramRef(self.b.tensor(ch[0]), int(ch[1]), int(ch[2]))


LONGEST_NUMBER = 40     # digits: more than any field holds, far fewer than int() refuses (4,300)
_LONG_NUMBER = re.compile(f"[0-9]{{{LONGEST_NUMBER + 1},}}")
NUMBER_TOKENS = ("INT", "SIGNED_INT", "LEGION", "COND")     # the tokens whose numbers are read with int()


def _short_numbers(callbacks: _Callbacks):
    """A lexer callback refusing a token with a number too long for any field, where it stands;
    the callbacks' int() would otherwise fail with an error naming no line."""
    def check(tok):
        m = _LONG_NUMBER.search(tok)
        if m:
            raise located(callbacks.b.text, callbacks.b.source, tok.line + callbacks.b.offset,
                          tok.column + m.start(), f"number of {len(m.group())} digits is out of range")
        return tok
    return check


@functools.cache
def _parser() -> tuple[lark.Lark, _Callbacks]:
    callbacks = _Callbacks()
    grammar = resources.files("isa").joinpath("grammar.lark").read_text()
    check = _short_numbers(callbacks)
    parser = lark.Lark(grammar, parser="lalr", lexer="contextual", maybe_placeholders=True,
                       transformer=callbacks, lexer_callbacks={t: check for t in NUMBER_TOKENS})
    return parser, callbacks


_LOCK = threading.Lock()   # the parser's callbacks hold the current builder


def parse(text: str, source: str = "<text>") -> Program:
    """Parse program text; errors are ProgramError naming ``source:line:col``."""
    b = _Builder(text, source)
    lines = text.split("\n")
    first = _first_instr(lines)
    with no_cycle_collection():
        _lark_parse("\n".join(lines[:first]), b)
        _instrs(b, lines, first)
    return b.finish()


def _lark_parse(text: str, b: _Builder, first_line: int = 1) -> None:
    """Run the LALR parser over ``text``, the part of ``b.text`` from line ``first_line`` on."""
    parser, callbacks = _parser()
    with _LOCK:
        callbacks.b, b.offset = b, first_line - 1
        try:
            parser.parse(text)
        except lark.exceptions.UnexpectedInput as e:
            raise syntax_error(e, parser, text, b) from None
        finally:
            del callbacks.b


# --- fast path -------------------------------------------------------------------------------
# The grammar above defines the text format, but Lark's pure-Python LALR parser spends about
# twenty tokens on an instruction, which is too slow for the programs the compiler writes.
# So each instruction line is first matched against one regex per class, built from the same
# operand kinds, that accepts a subset of the grammar (canonical spacing, valid values). Any
# other line (a directive after the header, other spacing, any error) goes to Lark, which alone
# decides what is wrong and says where. Statements never span lines, so this is the same parse.
#
# The regex's groups are then read by a function generated once per class from its fields'
# kinds (as ``dataclasses`` generates ``__init__``): straight-line code that builds each field's
# value, checks its range and packs its bits as the kind's ``encode`` does, then packs the word.
# A call or a loop per field would cost more than the work itself. The words are kept with the
# program (``encoding.keep_words``), so saving it as a binary need not check and pack it again;
# tests hold them to the encoder's.

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_IMM = r"#[-+]?(?:inf|nan|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)"
_NEW = object.__new__


def _set_text(s: str) -> frozenset:
    out: set[int] = set()
    for part in s.split(","):
        bounds = part.split("-")
        lo, hi = int(bounds[0]), int(bounds[-1])
        if len(bounds) > 2 or not lo <= hi < LEGION_SET_BITS:
            raise ValueError(part)
        out.update(range(lo, hi + 1))
    return frozenset(out)


# Code generation: each function below returns (regex of the field's value, the statements that
# set ``v`` to its value and ``v_bits`` to its bits, or return None) for the texts ``g`` of the
# value's groups; ``env`` receives the names the statements use. Every kind but LegionSet (rare)
# is written out inline: a function call costs as much as the work.

def _new(obj: str, cls: str, fields: dict) -> list[str]:
    """Statements that make ``obj``, an instance of frozen dataclass ``cls``, without
    ``__init__``, which sets each field through ``object.__setattr__`` and takes three times as
    long. These classes have no state but their fields, so the object is the same."""
    return [f"{obj} = _NEW({cls})", f"{obj}_d = {obj}.__dict__",
            *(f"{obj}_d[{name!r}] = {value}" for name, value in fields.items())]


def _int_code(kind, v: str, env: dict):
    """Legion, UInt: the value is its own bits."""
    pattern = r"L([0-9]+)" if isinstance(kind, Legion) else r"([0-9]+)"
    return pattern, lambda g: [f"{v} = {v}_bits = int({g[0]})", f"if {v} >= {1 << kind.bits}: return None"]


def _present(v: str, group: str, value: str, end: int) -> list[str]:
    """An optional field (OptUInt, OptAddr, OptTensor): None when its group is, else ``value``
    below ``end``; packed as a presence bit, then the value."""
    return [f"if {group} is None: {v} = None; {v}_bits = 0",
            "else:", f"    {v} = {value}", f"    if {v} >= {end}: return None", f"    {v}_bits = 1 | {v} << 1"]


def _opt_int_code(kind, v: str, env: dict):
    return r"([0-9]+)", lambda g: _present(v, g[0], f"int({g[0]})", 1 << kind.value_bits)


def _opt_addr_code(kind, v: str, env: dict):
    """``none`` or an address in the kind's space."""
    pattern = r"(?:none|" + re.escape(kind.space) + r"\[([0-9]+)\])"
    return pattern, lambda g: _present(v, g[0], f"int({g[0]})", 1 << ADDR_BITS)


def _dram_code(kind, v: str, env: dict):
    """Dram: a declared tensor (an unknown name raises KeyError: Lark says why), offset, row
    stride; packed as Dram.encode packs."""
    at_offset, at_rs = kind.tensor_bits, kind.tensor_bits + kind.offset_bits
    pattern = f"@({_NAME})" + r"\[([0-9]+),([0-9]+)\]"
    return pattern, lambda g: [
        f"{v}_t = index[{g[0]}]; {v}_o = int({g[1]}); {v}_r = int({g[2]})",
        f"if {v}_t >= {1 << kind.tensor_bits} or {v}_o >= {1 << kind.offset_bits} or {v}_r >= {1 << kind.rs_bits}:"
        " return None",
        *_new(v, "DramRef", {"tensor": f"{v}_t", "offset": f"{v}_o", "rs": f"{v}_r"}),
        f"{v}_bits = {v}_t | {v}_o << {at_offset} | {v}_r << {at_rs}"]


def _opt_tensor_code(kind, v: str, env: dict):
    """``none`` or a declared tensor (an unknown name raises KeyError: Lark says why)."""
    return f"(?:none|@({_NAME}))", lambda g: _present(v, g[0], f"index[{g[0]}]", 1 << Dram.tensor_bits)


def _keyword_code(kind, v: str, env: dict):
    """Keyword: the regex admits only the kind's words; the text is the value."""
    env[f"words_{v}"] = {c: n for n, c in enumerate(kind.choices)}
    pattern = "(" + "|".join(map(re.escape, kind.choices)) + ")"
    return pattern, lambda g: [f"{v} = {g[0]}", f"{v}_bits = words_{v}[{v}]"]


def _view_code(kind, v: str, env: dict):
    """A group per view leaf, so that no text is split twice; the space is one of the kind's."""
    env["SPACE_CODE"] = {s: SPACES.index(s) for s in SPACES}
    pattern = "(" + "|".join(kind.spaces) + r")\[([0-9]+),([0-9]+),([0-9]+)\]"
    return pattern, lambda g: _view_body(kind, v, g)


def _view_body(kind, v: str, g: list[str]) -> list[str]:
    ends = (1 << ADDR_BITS, 1 << kind.rs_bits, 1 << kind.cs_bits)
    return [f"{v}_a = int({g[1]}); {v}_r = int({g[2]}); {v}_c = int({g[3]})",
            f"if {v}_a >= {ends[0]} or {v}_r >= {ends[1]} or {v}_c >= {ends[2]}: return None",
            *_new(v, "View", {"space": g[0], "addr": f"{v}_a", "rs": f"{v}_r", "cs": f"{v}_c"}),
            f"{v}_bits = SPACE_CODE[{g[0]}] | {v}_a << {kind.addr_at} | {v}_r << {kind.rs_at} | {v}_c << {kind.cs_at}"]


def _view_or_imm_code(kind, v: str, env: dict):
    """ViewOrImm: a view's groups, or an immediate's; packed as ViewOrImm.encode packs (every
    NaN the quiet one). A value past the fp32 range raises OverflowError: Lark says why."""
    view, _ = _view_code(kind.view, v, env)
    env["F32"], env["NAN_BITS"] = encoding.F32, encoding.NAN_IMM_BITS
    pattern = f"(?:{view}|#({_IMM[1:]}))"

    def code(g):
        return [f"if {g[4]} is None:", *("    " + line for line in _view_body(kind.view, v, g[:4])),
                f"    {v}_bits <<= 1", "else:",
                f"    {v}_f = F32.pack(float({g[4]}))", f"    {v} = F32.unpack({v}_f)[0]",
                f"    {v}_bits = NAN_BITS if {v} != {v} else 1 | int.from_bytes({v}_f, 'little') << 1"]
    return pattern, code


def _row_view_code(kind, v: str, env: dict):
    """RowView: one fixed space, cs = 1; packed as RowView.encode packs."""
    ends = (1 << ADDR_BITS, 1 << kind.rs_bits)
    pattern = re.escape(kind.space) + r"\[([0-9]+),([0-9]+)\]"
    return pattern, lambda g: [
        f"{v}_a = int({g[0]}); {v}_r = int({g[1]})",
        f"if {v}_a >= {ends[0]} or {v}_r >= {ends[1]}: return None",
        *_new(v, "View", {"space": repr(kind.space), "addr": f"{v}_a", "rs": f"{v}_r", "cs": "1"}),
        f"{v}_bits = {v}_a | {v}_r << {ADDR_BITS}"]      # as RowView.encode packs


def _cond_code(kind, v: str, env: dict):
    """Until, After: a group per condition leaf (Legion, queue, count, back); packed as
    Until.encode packs (After: a presence bit first)."""
    env["QUEUE_CODE"] = {q: n << kind.queue_at for n, q in enumerate(QUEUES)}
    legions, counts = 1 << kind.legion_bits, 1 << kind.count_bits
    pattern = r"(?:L([0-9]+)\.)?(dma|mat|vec)(?:>=([0-9]+)|~([0-9]+))?"
    optional = isinstance(kind, After)

    def code(g):
        legion, queue, count, back = g
        body = [
            f"if {legion} is None: {v}_l = None; {v}_bits = 1",
            "else:", f"    {v}_l = int({legion})", f"    if {v}_l >= {legions}: return None",
            f"    {v}_bits = {v}_l << {kind.legion_at}",
            f"if {count} is not None:", f"    {v}_n = int({count}); {v}_b = 0; {v}_rel = 0",
            "else:", f"    {v}_n = None; {v}_b = 0 if {back} is None else int({back}); {v}_rel = {1 << kind.rel_at}",
            f"if ({v}_b if {v}_n is None else {v}_n) >= {counts}: return None",
            *_new(v, "Cond", {"legion": f"{v}_l", "queue": queue, "count": f"{v}_n", "back": f"{v}_b"}),
            f"{v}_bits |= QUEUE_CODE[{queue}] | {v}_rel | ({v}_b if {v}_n is None else {v}_n) << {kind.count_at}"]
        if not optional:
            return body
        return [f"if {queue} is None: {v} = None; {v}_bits = 0", "else:",
                *("    " + line for line in body), f"    {v}_bits = 1 | {v}_bits << 1"]
    return pattern, code


def _legion_set_code(kind, v: str, env: dict):
    """LegionSet: converted from its text, then checked and packed by the encoder."""
    env[f"pack_{v}"] = encoding.packer(kind)
    return r"\{([0-9,\-]*)\}", lambda g: [
        f"{v} = SET_TEXT({g[0]})", f"{v}_bits = pack_{v}({v})", f"if {v}_bits is None: return None"]


# By exact kind class (a subclass such as OptUInt or RowView encodes differently).
_CODE = {Legion: _int_code, UInt: _int_code, OptUInt: _opt_int_code, Keyword: _keyword_code,
         ViewKind: _view_code, RowView: _row_view_code, ViewOrImm: _view_or_imm_code, Until: _cond_code,
         After: _cond_code, OptAddr: _opt_addr_code, Dram: _dram_code, OptTensor: _opt_tensor_code,
         LegionSet: _legion_set_code}


@dataclass(frozen=True)
class _Form:
    """How the fast path reads one instruction class."""

    cls: type
    regex: re.Pattern           # the line after the mnemonic
    read: object                # (line, where the mnemonic ends, tensor table) -> (instruction, word) or None
    source: str                 # of ``read``


def _form(cls: type) -> _Form:
    env = {"_NEW": _NEW, "View": View, "Cond": Cond, "DramRef": DramRef, "SET_TEXT": _set_text, "cls": cls}
    parts, body, n = [], [], 0
    word, shift = [str(cls.OPCODE)], OPCODE_BITS
    for f in cls.fields():
        kind, v = gen.kind_of(f), f"f_{f.name}"
        pattern, code = _CODE[type(kind)](kind, v, env)
        groups = re.compile(pattern).groups
        body += code([f"g[{k}]" for k in range(n, n + groups)])
        n += groups
        key = re.escape(f.name + "=") if kind.keyed else ""
        part = f" {key}{pattern}"        # canonical spacing; other spacing is left to Lark
        parts.append(f"(?:{part})?" if kind.optional else part)
        word.append(f"{v}_bits << {shift}")
        shift += kind.bits
    regex = re.compile("".join(parts) + r"[ \t\r]*(?:;.*)?")
    env["match"] = regex.fullmatch
    source = "\n    ".join(["def read(line, start, index):", "m = match(line, start)", "if m is None: return None",
                            "g = m.groups()", *body, *_new("i", "cls", {f.name: f"f_{f.name}" for f in cls.fields()}),
                            f"return i, ({' | '.join(word)}).to_bytes({encoding.WORD_BYTES}, 'little')"]) + "\n"
    exec(source, env)
    return _Form(cls, regex, env["read"], source)


FAST_LINES = {cls.MNEMONIC: _form(cls) for cls in INSTRUCTIONS}
_FIRST_WORD = re.compile(r"[ \t\r]*([^\s;]*)")
# The compiler writes a `.region` line per ONNX node; the grammar's STRING, canonical spacing.
_REGION = re.compile(r'\.region[ \t]+("(?:\\.|[^"\\\n])*")[ \t\r]*(?:;.*)?')


def _first_instr(lines: list[str]) -> int:
    for n, line in enumerate(lines):
        if _FIRST_WORD.match(line).group(1) in FAST_LINES:
            return n
    return len(lines)


def _instrs(b: _Builder, lines: list[str], first: int) -> None:
    """Add the statements of ``lines[first:]``: each by its regex, or else by Lark."""
    index, instrs, numbers, words = b.index, b.p.instrs, b.p.lines, b.words
    for n, line in enumerate(lines[first:], first + 1):
        head = line.partition(" ")[0]
        form = FAST_LINES.get(head)
        try:
            read = form and form.read(line, len(head), index)     # (instruction, word) or None
        except (ValueError, LookupError, OverflowError):     # Lark will say what is wrong
            read = None
        if read:
            instrs.append(read[0])
            numbers.append(n)
            words.append(read[1])
        elif not _fast_region(b, line) and line.strip() and not line.lstrip().startswith(";"):
            _lark_parse(line, b, n)


def _fast_region(b: _Builder, line: str) -> bool:
    """Add the region ``line`` opens if it is in the fast subset; False leaves it to Lark."""
    m = _REGION.fullmatch(line)
    if m is None:
        return False
    try:
        name = json.loads(m.group(1))
    except json.JSONDecodeError:
        return False
    b.p.regions.append((len(b.p.instrs), name))
    return True


# --- error messages --------------------------------------------------------------------------

SHOWN = 120       # characters of a source line an error shows: a long line is cut around the error
SHOWN_WORD = 40   # of a word a message quotes


def located(text: str, source: str, line: int, col: int, msg: str) -> ProgramError:
    """``file:line:col: msg``, then the offending line (its part around the column) and a caret
    under the column."""
    lines = text.split("\n")
    src = lines[line - 1].rstrip("\r") if 0 < line <= len(lines) else ""
    src, at = _around(src, col)
    return ProgramError(f"{source}:{line}:{col}: {msg}\n  {src}\n  {' ' * (at - 1)}^")


def _around(src: str, col: int) -> tuple[str, int]:
    """At most SHOWN characters of ``src`` around column ``col``, '...' marking each cut; and
    the column in what is shown."""
    if len(src) <= SHOWN:
        return src, col
    start = min(max(col - 1 - SHOWN // 2, 0), len(src) - SHOWN)
    head, tail = "..." if start else "", "..." if start + SHOWN < len(src) else ""
    return head + src[start:start + SHOWN] + tail, col - start + len(head)


def _quoted(word: str) -> str:
    """``word`` for a message, its start only if it is long (a whole line of junk, say)."""
    return repr(word if len(word) <= SHOWN_WORD else word[:SHOWN_WORD] + "...")


DESCRIBE = {
    "LEGION": "a Legion (L0)", "COND": "a condition (L0.dma>=5)", "INT": "an integer",
    "SIGNED_INT": "an integer", "IMM": "an immediate (#1.5)", "NONE": "none",
    "NAME": "a name", "ARCH_NAME": "an architecture name",
    "STRING": "a quoted string", "_NL": "end of line", "$END": "end of line",
}


KEYWORD_CHOICES = {gen.kw_terminal(k): k.choices for k in gen.all_kinds() if isinstance(k, Keyword)}


def _describe(name: str, parser: lark.Lark) -> str:
    if name in DESCRIBE:
        return DESCRIBE[name]
    if name.startswith("OP_"):
        return "an instruction"
    if name in KEYWORD_CHOICES:
        return "one of " + ", ".join(KEYWORD_CHOICES[name])
    pattern = parser.get_terminal(name).pattern
    return repr(pattern.value) if pattern.type == "str" else name


def _position(e: lark.exceptions.UnexpectedInput, text: str) -> tuple[int, int]:
    token = getattr(e, "token", None)
    if (token is not None and token.type == "$END") or e.line < 1:
        last = text.rstrip("\n").split("\n")
        return len(last), len(last[-1]) + 1
    return e.line, e.column


def _got(e: lark.exceptions.UnexpectedInput, line_text: str, col: int) -> str:
    token = getattr(e, "token", None)
    if token is not None and token.type in ("_NL", "$END"):
        return DESCRIBE[token.type]
    word = re.match(r"\S*", line_text[col - 1:]).group()
    return _quoted(word) if word else "end of line"


def _unknown_word(line_text: str) -> tuple[int, str] | None:
    """Column and message if the line starts with an unknown mnemonic or directive."""
    m = re.match(r"\s*([^\s;]+)", line_text)
    if not m or m.group(1) in BY_MNEMONIC or m.group(1) in DIRECTIVES:
        return None
    word = m.group(1)
    known = DIRECTIVES if word.startswith(".") else list(BY_MNEMONIC)
    what = "directive" if word.startswith(".") else "mnemonic"
    close = difflib.get_close_matches(word, known, n=4, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return m.start(1) + 1, f"unknown {what} {_quoted(word)}{hint}"


def _expected(e: lark.exceptions.UnexpectedInput) -> set[str]:
    """Terminals the parser could take here. LALR merges states that end an operand, so the
    error's own set is a union over every context; replaying the parser gives the exact one."""
    parser = getattr(e, "interactive_parser", None)
    if parser is not None:
        try:
            return parser.accepts()
        except (lark.exceptions.LarkError, KeyError):
            pass
    return set(getattr(e, "expected", None) or getattr(e, "allowed", None) or ())


def usage(cls: type) -> str:
    return "usage: " + gen.syntax(cls)


def syntax_error(e, parser: lark.Lark, text: str, b: _Builder) -> ProgramError:
    """A clear message for a Lark error in ``text``, the part of ``b.text`` after ``b.offset`` lines."""
    line, col = _position(e, text)
    line_text = text.split("\n")[line - 1]
    unknown = _unknown_word(line_text)
    if unknown:
        return located(b.text, b.source, line + b.offset, unknown[0], unknown[1])
    wanted = sorted({_describe(n, parser) for n in _expected(e)})
    msg = f"unexpected {_got(e, line_text, col)}; expected {' or '.join(wanted) or 'nothing'}"
    err = located(b.text, b.source, line + b.offset, col, msg)
    words = line_text.split()
    cls = BY_MNEMONIC.get(words[0]) if words else None
    return ProgramError(f"{err}\n  {usage(cls)}") if cls else err


# --- printing --------------------------------------------------------------------------------

def format_instr(i: Instr, names: list[str]) -> str:
    parts = [i.MNEMONIC]
    for f in i.fields():
        kind = gen.kind_of(f)
        if kind.optional and getattr(i, f.name) is None:
            continue
        value = kind.text(getattr(i, f.name), names)
        parts.append(f"{f.name}={value}" if kind.keyed else value)
    return " ".join(parts)


def format_tensor(t: Tensor) -> str:
    parts = [".tensor", t.name, f"{t.dtype}[{','.join(map(str, t.shape))}]", t.kind]
    if t.io_name is not None:
        parts.append(encoding.json_text(t.io_name))
    if t.offset is not None:
        parts.append(str(t.offset))
    if t.range is not None:
        parts += ["range", str(t.range[0]), str(t.range[1])]
    return " ".join(parts)


def format_program(p: Program) -> str:
    """Canonical text: directives, then one instruction per line, each region's ``.region``
    line just before its first instruction."""
    encoding.check_regions(p)
    arch = p.arch if ARCH_NAME_RE.fullmatch(p.arch) else encoding.json_text(p.arch)
    lines = [f".arch {arch}"]
    if p.data_file is not None:
        lines.append(f".data {encoding.json_text(p.data_file)}")
    lines += [format_tensor(t) for t in p.tensors]
    lines += [f".skipped {kind} {count}" for kind, count in sorted(p.skipped.items())]
    lines += [" ".join([".approximation", name, *map(encoding.json_text, values)])
              for name, values in p.approximations.items()]
    lines += [f".alias {name} {out} {offset} [{', '.join(map(str, strides))}]"
              for name, (out, offset, strides) in p.aliases.items()]
    names, marks = p.names(), _region_lines(p)
    for n, i in enumerate(p.instrs):
        why = encoding.ref_error(i, len(names))
        if why:
            raise ProgramError(f"{p.where(n)}: {i.MNEMONIC}: {why}")
        lines += marks.get(n, ())
        lines.append(format_instr(i, names))
    lines += marks.get(len(p.instrs), ())
    return "\n".join(lines) + "\n"


def _region_lines(p: Program) -> dict[int, list[str]]:
    """The ``.region`` lines to print before each instruction index."""
    out: dict[int, list[str]] = {}
    for at, name in p.regions:
        out.setdefault(at, []).append(f".region {encoding.json_text(name)}")
    return out


# --- files -----------------------------------------------------------------------------------

def arch_of(p: Program) -> arch_mod.Arch:
    """The machine ``p``'s ``.arch`` names: a preset, or a TOML file relative to the program's
    folder. An error names the directive (file:line:col of a text program)."""
    try:
        return arch_mod.load(p.arch, base=Path(p.source).parent)
    except arch_mod.ArchError as e:
        where = p.arch_at or f"{p.source}: .arch"
        raise arch_mod.ArchError(f"{where}: {e}") from None


def load(path, read_data: bool = True) -> Program:
    """Read a program, text or binary (``DLGN`` magic), and its sidecar data file."""
    source = str(path)
    try:
        check_readable(path)
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ProgramError(f"{source}: cannot read ({e.strerror})") from None
    binary = raw.startswith(encoding.MAGIC)
    with no_cycle_collection():      # a binary's instructions too
        p = encoding.decode_program(raw, source) if binary else _parse_bytes(raw, source)
    encoding.check_bindings(p)
    where = None if p.data_file is None else data_path(p)     # checked even when not read
    if read_data and where is not None:
        p.data = _read_data(where, p)
    return p


def data_path(p: Program) -> Path:
    """The data file of ``p`` read from ``p.source``: a path relative to the program's folder
    that stays inside it, so a program cannot make a tool read any other file."""
    folder = Path(p.source).parent
    path = folder / p.data_file
    if p.data_file and not Path(p.data_file).is_absolute() and folder.resolve() in path.resolve().parents:
        return path
    raise ProgramError(f"{p.source}: .data {encoding.json_text(p.data_file)} must name a file "
                       f"in the program's folder")


def _parse_bytes(raw: bytes, source: str) -> Program:
    try:
        text = raw.decode("utf-8-sig")        # some editors start UTF-8 text with a byte-order mark
    except UnicodeDecodeError:
        raise ProgramError(f"{source}: neither UTF-8 program text nor a D-Legion binary") from None
    return parse(text, source)


def _read_data(path: Path, p: Program):
    """The data file, memory-mapped read-only: a multi-GB file is paged in as constants are
    used, never read whole (an empty file, which mmap refuses, is empty bytes)."""
    try:
        check_readable(path)        # a device would be read forever
        with open(path, "rb") as f:
            return _mapped(f)
    except OSError as e:
        raise ProgramError(f"{p.source}: cannot read data file {p.data_file!r} "
                           f"({e.strerror})") from None


def _mapped(f):
    if os.fstat(f.fileno()).st_size == 0:
        return b""
    try:
        # a view: compares equal to the same bytes, and slices without copying
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    except (OSError, ValueError):     # a file that cannot be mapped (some file systems)
        return f.read()


def save(p: Program, path, data=None, binary: bool = False) -> None:
    """Write ``p`` (and its data file when ``data`` is given: bytes, or an ``isa.files.Staged``
    file already written beside it) atomically: all or nothing."""
    body = encoding.encode_program(p) if binary else _checked_text(p).encode()
    files = [(Path(path), body)]
    if data is not None:
        if p.data_file is None:
            raise ProgramError(f"{path}: data given but the program names no .data file")
        files.append((Path(path).parent / p.data_file, data if isinstance(data, Staged) else bytes(data)))
    _write_all(files)


def _checked_text(p: Program) -> str:
    encoding.check_tensors(p)
    encoding.check_instrs(p)
    return format_program(p)


def _write_all(files: list[tuple[Path, bytes]]) -> None:
    try:
        atomic_write_all(files)
    except OSError as e:
        raise ProgramError(f"{e.filename or files[0][0]}: cannot write ({e.strerror})") from None
