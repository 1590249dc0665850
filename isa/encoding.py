"""Binary format: a JSON header and one fixed ``WORD_BITS``-bit little-endian word per instruction.

One generic packer serves every instruction: the opcode in the low bits, then each field of
the class in declared order at its kind's width (``isa/fields.py``), lowest bits first. A file
is ``DLGN``, u16 version, u16 reserved (0), u32 header length, the header (UTF-8 JSON: arch,
data file, tensors, regions, skipped work, number of instructions), zero padding to a multiple
of the word size, then the words. The count makes a file cut at a word boundary an error rather
than a shorter program.

Decoding is strict: every word must re-encode to the same bytes, so disassembling and
reassembling a file reproduces it exactly.
"""
from __future__ import annotations

import itertools
import json
import operator
import re
import struct
from dataclasses import replace
from operator import attrgetter

from isa.fields import (ADDR_BITS, QUEUES, SPACES, After, Cond, Dram, DramRef, Legion, OptTensor, OptUInt, UInt,
                        Until, View, ViewKind, ViewOrImm, bits_f32, f32, f32_bits)
from isa.instructions import BY_OPCODE, INSTRUCTIONS, OPCODE_BITS, WORD_BITS, Instr
from isa.program import DTYPES, KINDS, Program, ProgramError, Tensor

MAGIC = b"DLGN"
VERSION = 10         # 2: 320-bit words and progress-counter synchronization; 3: regions; 4: spans,
                     # relative waits; 5: skipped work; 6: 26-bit scratchpad addresses;
                     # 7: the number of instructions in the header; 8: approximations;
                     # 9: approximations name the model's values they are made in;
                     # 10: inputs aliased into outputs (an "aliases" key when there are some)
WORD_BYTES = WORD_BITS // 8
PREFIX = struct.Struct("<4sHHI")
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# Per class: (field name, kind) in declared order; the packer walks this table.
LAYOUT = {cls: tuple((f.name, f.metadata["kind"]) for f in cls.fields()) for cls in INSTRUCTIONS}

# Fields that name a DRAM tensor by index, and how to read the index (None: no tensor).
_TENSOR_OF = {Dram: lambda v: v.tensor, OptTensor: lambda v: v}
TENSOR_FIELDS = {cls: tuple((name, _TENSOR_OF[type(kind)]) for name, kind in layout
                            if type(kind) in _TENSOR_OF)
                 for cls, layout in LAYOUT.items()}


def renamed_tensors(i: Instr, rename) -> Instr:
    """``i`` with each DRAM tensor index it names replaced by ``rename(index)``."""
    changes = {}
    for name, index in TENSOR_FIELDS.get(type(i), ()):
        v = getattr(i, name)
        t = index(v)
        if t is not None:
            changes[name] = rename(t) if isinstance(v, int) else replace(v, tensor=rename(t))
    return replace(i, **changes) if changes else i


def kind_entry(table: dict, kind):
    """The entry of ``table`` (keyed by operand-kind class name) for ``kind``, looked up along
    its class's bases, so a subclass such as RowView may have its own entry or share its base's.
    None if there is none."""
    for base in type(kind).__mro__:
        if base.__name__ in table:
            return table[base.__name__]
    return None


# --- field checks ----------------------------------------------------------------------------
# ``Instr.bad_fields`` asks each kind's ``check``, which is the definition. Asking it for every
# field of every instruction dominates the assembler's time, so the encoder checks as it packs
# (``_word`` below), with quick tests that may only say "valid" when ``check`` would; anything
# they doubt goes to ``check`` for the verdict and the message. No word is written unchecked.

def _uint(bits: int):
    end = 1 << bits
    return lambda v: type(v) is int and 0 <= v < end


def _view_ok(kind, rowview: bool = False):
    # Written out rather than composed from _uint: this runs for every view operand.
    spaces, a, r, c = kind.spaces, 1 << ADDR_BITS, 1 << kind.rs_bits, 1 << kind.cs_bits
    return lambda v: (type(v) is View and v.space in spaces
                      and type(v.addr) is int and 0 <= v.addr < a
                      and type(v.rs) is int and 0 <= v.rs < r
                      and type(v.cs) is int and 0 <= v.cs < c and (v.cs == 1 or not rowview))


def _legion_set_ok(kind):
    member = _uint(6)
    return lambda v: type(v) is frozenset and bool(v) and all(map(member, v))


def _dram_ok(kind):
    t, o, r = 1 << kind.tensor_bits, 1 << kind.offset_bits, 1 << kind.rs_bits
    return lambda v: (type(v) is DramRef and type(v.tensor) is int and 0 <= v.tensor < t
                      and type(v.offset) is int and 0 <= v.offset < o
                      and type(v.rs) is int and 0 <= v.rs < r)


def _optional(ok):
    return lambda v: v is None or ok(v)


def _fp32_ok(v) -> bool:
    try:
        return type(v) is float and (v != v or f32(v) == v)
    except OverflowError:
        return False


def _cond_ok(kind):
    queues, end, legions = frozenset(QUEUES), 1 << kind.count_bits, 1 << kind.legion_bits
    return lambda v: (type(v) is Cond and v.queue in queues
                      and (v.legion is None or type(v.legion) is int and 0 <= v.legion < legions)
                      and (type(v.back) is int and 0 <= v.back < end if v.count is None
                           else type(v.count) is int and 0 <= v.count < end and v.back == 0))


def _imm_ok(kind):
    view = _view_ok(kind.view)
    return lambda v: _fp32_ok(v) or view(v)


QUICK_OK = {
    "Legion": lambda k: _uint(k.bits), "UInt": lambda k: _uint(k.bits),
    "OptUInt": lambda k: _optional(_uint(k.value_bits)),
    "Until": _cond_ok, "After": lambda k: _optional(_cond_ok(k)),
    "Keyword": lambda k: lambda v, c=frozenset(k.choices): type(v) is str and v in c,
    "LegionSet": _legion_set_ok, "RowView": lambda k: _view_ok(k, rowview=True), "ViewKind": _view_ok,
    "OptAddr": lambda k: _optional(_uint(ADDR_BITS)), "Dram": _dram_ok,
    "OptTensor": lambda k: _optional(_uint(Dram.tensor_bits)), "ViewOrImm": _imm_ok,
}


def quick_ok(kind):
    make = kind_entry(QUICK_OK, kind)
    return make(kind) if make else lambda v: False    # an unknown kind: always ask its check


def _check(kind, v) -> str | None:
    try:
        return kind.check(v)
    except (OverflowError, TypeError, ValueError) as e:
        return f"{v!r} cannot be encoded ({e})"


def field_errors(i: Instr) -> list[str]:
    """Same answer as ``i.bad_fields()``, quicker on valid instructions."""
    if _word(i) is not None:
        return []
    return [f"{name}: {why}" for name, kind in LAYOUT[type(i)] if (why := _check(kind, getattr(i, name)))]


def instr_error(i: Instr) -> str | None:
    if type(i) not in LAYOUT:
        return f"{type(i).__name__} is not an instruction of the table"
    bad = field_errors(i)
    return f"{i.MNEMONIC}: {'; '.join(bad)}" if bad else None


def ref_error(i: Instr, n_tensors: int) -> str | None:
    """Why instruction ``i`` names a tensor that is not declared, or None."""
    for name, index in TENSOR_FIELDS.get(type(i), ()):
        t = index(getattr(i, name))
        if t is not None and t >= n_tensors:
            return f"{name}: tensor index {t} but only {n_tensors} tensor(s) declared"
    return None


def check_instrs(p: Program) -> None:
    for n, i in enumerate(p.instrs):
        why = instr_error(i) or ref_error(i, len(p.tensors))
        if why:
            raise ProgramError(f"{p.where(n)}: {why}")


# --- tensor checks (shared with the text format) ---------------------------------------------

def tensor_error(t: Tensor) -> str | None:
    """Why tensor ``t`` is malformed, or None."""
    if not isinstance(t.name, str) or not NAME_RE.fullmatch(t.name):
        return f"bad tensor name {t.name!r}"
    if t.dtype not in DTYPES:
        return f"tensor {t.name!r}: unknown dtype {t.dtype!r} (dtypes: {' '.join(DTYPES)})"
    if t.kind not in KINDS:
        return f"tensor {t.name!r}: unknown kind {t.kind!r} (kinds: {' '.join(KINDS)})"
    least = 0 if t.kind == "input" else 1      # an empty input (a decode step's empty cache) is legal ONNX
    if not all(_is_int(d) and d >= least for d in t.shape):
        rule = "dimensions >= 0 for an input, >= 1 otherwise" if t.kind == "input" else "dimensions >= 1"
        return f"tensor {t.name!r}: bad shape {list(t.shape)} ({rule}; [] for a scalar)"
    return _tensor_extras_error(t)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tensor_extras_error(t: Tensor) -> str | None:
    if t.io_name is not None and not isinstance(t.io_name, str):
        return f"tensor {t.name!r}: graph name must be a string"
    if (t.kind == "const") != (t.offset is not None):
        return f"tensor {t.name!r}: a const tensor needs a data-file offset, and only a const has one"
    if t.offset is not None and not (_is_int(t.offset) and t.offset >= 0):
        return f"tensor {t.name!r}: bad data-file offset {t.offset!r}"
    if t.range is None:
        return None
    lo_hi_ok = len(t.range) == 2 and all(map(_is_int, t.range)) and t.range[0] < t.range[1]
    if t.kind != "input" or not lo_hi_ok:
        return f"tensor {t.name!r}: range {t.range!r} needs an input tensor and lo < hi"
    return None


def check_tensors(p: Program) -> None:
    seen = set()
    for t in p.tensors:
        why = tensor_error(t)
        if why:
            raise ProgramError(f"{p.source}: {why}")
        if t.name in seen:
            raise ProgramError(f"{p.source}: tensor {t.name!r} declared twice")
        seen.add(t.name)


def check_bindings(p: Program) -> None:
    """Two tensors of one kind may not bind one graph name: its value would be given, or read
    back, twice. An input may also be an output, as when a graph returns an input. (Not part
    of the format, whose graph names are free text: checked when a program file is read.)"""
    bound: dict[tuple[str, str], str] = {}
    for t in p.tensors:
        if t.io_name is None:
            continue
        first = bound.setdefault((t.kind, t.io_name), t.name)
        if first != t.name:
            raise ProgramError(f"{p.source}: tensors {first!r} and {t.name!r} are both {t.kind} tensors "
                               f"bound to graph name {t.io_name!r}")


# --- regions (shared with the text format) ---------------------------------------------------

def region_error(p: Program) -> str | None:
    """Why ``p.regions`` is malformed, or None: each is (first instruction index, name), the
    indices nondecreasing and at most the number of instructions (a region may be empty)."""
    prev = 0
    for k, r in enumerate(p.regions):
        if not (isinstance(r, (tuple, list)) and len(r) == 2 and _is_int(r[0]) and isinstance(r[1], str)):
            return f"region {k}: expected (instruction index, name), got {r!r}"
        if not prev <= r[0] <= len(p.instrs):
            return (f"region {k} ({r[1]!r}): starts at instruction {r[0]}, expected "
                    f"{prev}..{len(p.instrs)} (regions in program order)")
        prev = r[0]
    return None


def skipped_error(p: Program) -> str | None:
    """Why ``p.skipped`` is malformed, or None: names, each with a count of at least 0."""
    for kind, count in p.skipped.items():
        if not (isinstance(kind, str) and NAME_RE.fullmatch(kind)):
            return f"skipped work {kind!r} is not a name"
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            return f"skipped work {kind}: {count!r} is not a count"
    return None


def approximations_error(p: Program) -> str | None:
    """Why ``p.approximations`` is malformed, or None: names, each with a list of distinct
    value names (strings)."""
    if not isinstance(p.approximations, dict):
        return "approximations are not a table of names"
    for name, values in p.approximations.items():
        if not (isinstance(name, str) and NAME_RE.fullmatch(name)):
            return f"approximation {name!r} is not a name"
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            return f"approximation {name}: {values!r} is not a list of value names"
        if len(set(values)) != len(values):
            return f"approximation {name}: a value named twice"
    return None


def alias_error(p: Program) -> str | None:
    """Why ``p.aliases`` is malformed, or None: each an input of the program inside an output of
    the same dtype, at distinct elements (a positive stride per axis longer than 1, larger than
    the span of the axes after it)."""
    tensors = {t.name: t for t in p.tensors}
    for name, (out, offset, strides) in p.aliases.items():
        t, o = tensors.get(name), tensors.get(out)
        if t is None or t.kind != "input":
            return f"alias {name!r} is not an input tensor"
        if o is None or o.kind != "output":
            return f"alias {name!r}: {out!r} is not an output tensor"
        if o.dtype != t.dtype:
            return f"alias {name!r}: dtype {t.dtype}, output {out!r} {o.dtype}"
        if len(strides) != len(t.shape) or offset < 0:
            return f"alias {name!r}: offset {offset} and strides {list(strides)} do not fit shape {list(t.shape)}"
        span = 1
        for n, s in sorted(((n, s) for n, s in zip(t.shape, strides) if n > 1), key=lambda a: a[1]):
            if s < span:
                return f"alias {name!r}: strides {list(strides)} overlap elements"
            span = s * (n - 1) + span
        last = offset + sum(s * (n - 1) for n, s in zip(t.shape, strides))
        if t.numel and last >= o.numel:
            return f"alias {name!r}: element {last} is outside output {out!r} of {o.numel}"
    return None


def check_regions(p: Program) -> None:
    """Regions, skipped work, approximations and aliases, which the text and binary formats
    carry alongside the words."""
    why = region_error(p) or skipped_error(p) or approximations_error(p) or alias_error(p)
    if why:
        raise ProgramError(f"{p.source}: {why}")


# --- instruction words -----------------------------------------------------------------------
# Each field is packed by its kind's *packer*: one call that returns the bits of a value the
# kind's quick check accepts, and None for anything it doubts. The hot kinds (integers, views,
# immediates) check and pack inline; the others ask their quick check, then their encode.

CANONICAL_NAN = bits_f32(0x7FC00000)
NAN_IMM_BITS = 1 | f32_bits(CANONICAL_NAN) << 1   # every NaN immediate, as a ViewOrImm field
F32, U32 = struct.Struct("<f"), struct.Struct("<I")


def _one_nan(v):
    return CANONICAL_NAN if isinstance(v, float) and v != v else v


# Kinds whose values have more than one bit pattern, and the value to encode instead: every NaN
# immediate encodes as the quiet NaN, since the text form prints any NaN as #nan.
_NORMALIZE = {ViewOrImm: _one_nan}


def _encoder(kind):
    normalize = _NORMALIZE.get(type(kind))
    return (lambda v: kind.encode(normalize(v))) if normalize else kind.encode


def _uint_packer(kind):
    """Legion, UInt: the value is its own bits."""
    end = 1 << kind.bits
    return lambda v: v if type(v) is int and 0 <= v < end else None


def _opt_uint_packer(kind):
    """OptUInt.encode: a presence bit, then the value."""
    end = 1 << kind.value_bits
    return lambda v: 0 if v is None else (1 | v << 1 if type(v) is int and 0 <= v < end else None)


def _view_packer(kind):
    """ViewKind.encode, with its check inline."""
    codes = {s: SPACES.index(s) for s in kind.spaces}
    a, r, c = 1 << ADDR_BITS, 1 << kind.rs_bits, 1 << kind.cs_bits
    addr_at, rs_at, cs_at = kind.addr_at, kind.rs_at, kind.cs_at

    def pack(v):
        if type(v) is not View or type(v.space) is not str or v.space not in codes:
            return None
        addr, rs, cs = v.addr, v.rs, v.cs
        if not (type(addr) is int and type(rs) is int and type(cs) is int):
            return None
        ok = 0 <= addr < a and 0 <= rs < r and 0 <= cs < c
        return codes[v.space] | addr << addr_at | rs << rs_at | cs << cs_at if ok else None
    return pack


def _imm_packer(kind):
    """ViewOrImm.encode, with its check inline: a presence bit for an immediate, then its bits
    (every NaN the quiet one), or a view."""
    view = _view_packer(kind.view)

    def pack(v):
        if type(v) is not float:
            x = view(v)
            return None if x is None else x << 1
        try:
            b = F32.pack(v)
        except OverflowError:
            return None
        if v != v:
            return NAN_IMM_BITS
        return 1 | U32.unpack(b)[0] << 1 if F32.unpack(b)[0] == v else None
    return pack


def _cond_packer(kind):
    """Until.encode (After.encode: a presence bit first), with its check inline."""
    queues, legions, counts = {q: n << kind.queue_at for n, q in enumerate(QUEUES)}, 1 << kind.legion_bits, \
        1 << kind.count_bits
    legion_at, rel, count_at = kind.legion_at, 1 << kind.rel_at, kind.count_at
    present = isinstance(kind, After)

    def pack(v):
        if v is None or type(v) is not Cond:
            return 0 if v is None and present else None
        legion, count, back = v.legion, v.count, v.back
        if not (type(v.queue) is str and v.queue in queues and type(back) is int and 0 <= back < counts):
            return None
        if not (legion is None or type(legion) is int and 0 <= legion < legions):
            return None
        if count is not None and not (type(count) is int and 0 <= count < counts and back == 0):
            return None
        where = 1 if legion is None else legion << legion_at      # own Legion, or which one
        x = where | queues[v.queue] | (rel | back << count_at if count is None else count << count_at)
        return 1 | x << 1 if present else x
    return pack


def _checked_packer(kind):
    ok, encode = quick_ok(kind), _encoder(kind)
    if not takes_none(kind):
        return lambda v: encode(v) if ok(v) else None
    absent = encode(None)       # optional fields are mostly absent: answer those at once
    return lambda v: absent if v is None else (encode(v) if ok(v) else None)


# By exact kind class (a subclass such as RowView or OptUInt encodes differently); else checked.
_PACKERS = {Legion: _uint_packer, UInt: _uint_packer, OptUInt: _opt_uint_packer, ViewKind: _view_packer,
            ViewOrImm: _imm_packer, Until: _cond_packer, After: _cond_packer}


def packer(kind):
    """The bits of a value of ``kind`` that its quick check accepts, else None."""
    return _PACKERS.get(type(kind), _checked_packer)(kind)


def takes_none(kind) -> bool:
    """Whether None is a value of ``kind`` (an optional field, or one that may say none)."""
    try:
        return kind.check(None) is None
    except (TypeError, ValueError):
        return False


def _getter(names: list[str]):
    """All of an instruction's field values as a tuple."""
    return attrgetter(*names) if len(names) > 1 else lambda i: tuple(getattr(i, n) for n in names)


# Per class: the field getter, and per field its packer and bit offset.
_FIELDS = {cls: (_getter([name for name, _ in layout]), tuple(packer(k) for _, k in layout),
                 tuple(itertools.accumulate([OPCODE_BITS] + [k.bits for _, k in layout[:-1]])))
           for cls, layout in LAYOUT.items()}


# Per class: each field's (bit offset in the word, kind), for readers of words in bulk.
FIELD_AT = {cls: {name: (shift, kind) for (name, kind), shift in zip(layout, _FIELDS[cls][2])}
            for cls, layout in LAYOUT.items()}


def _word(i: Instr) -> bytes | None:
    """The word of ``i``, or None when a quick check doubts a field (or ``i`` is no instruction)."""
    fields = _FIELDS.get(type(i))
    if fields is None:
        return None
    get, packers, shifts = fields
    x = i.OPCODE
    for v, pack, shift in zip(get(i), packers, shifts):
        bits = pack(v)
        if bits is None:
            return None
        x |= bits << shift
    return x.to_bytes(WORD_BYTES, "little")


def encode_instr(i: Instr) -> bytes:
    """The word of ``i``; a ProgramError naming the fields its word cannot hold."""
    word = _word(i)
    if word is not None:
        return word
    why = instr_error(i)           # the kinds' own checks decide what the quick ones doubted
    if why:
        raise ProgramError(why)
    x, shift = i.OPCODE, OPCODE_BITS
    for name, kind in LAYOUT[type(i)]:
        x |= _encoder(kind)(getattr(i, name)) << shift
        shift += kind.bits
    return x.to_bytes(WORD_BYTES, "little")


def checked_word(i: Instr) -> bytes | None:
    """The word of ``i``, or None when a field's value is not one its kind holds
    (``field_errors`` says which)."""
    try:
        return encode_instr(i)
    except ProgramError:
        return None


def decode_instr(b: bytes) -> Instr:
    if len(b) != WORD_BYTES:
        raise ProgramError(f"an instruction word is {WORD_BYTES} bytes, got {len(b)}")
    x = int.from_bytes(b, "little")
    cls = BY_OPCODE.get(x & ((1 << OPCODE_BITS) - 1))
    if cls is None:
        raise ProgramError(f"unknown opcode 0x{x & 0xFF:02x}")
    i = _unpack(cls, x >> OPCODE_BITS)
    why = instr_error(i)
    if why:
        raise ProgramError(why)
    if encode_instr(i) != bytes(b):
        raise ProgramError(f"{cls.MNEMONIC}: non-canonical word (unused bits set, or a field "
                           "value with more than one encoding)")
    return i


def _unpack(cls: type, x: int) -> Instr:
    values = []
    for name, kind in LAYOUT[cls]:
        try:
            values.append(kind.decode(x & ((1 << kind.bits) - 1)))
        except (IndexError, ValueError):
            raise ProgramError(f"{cls.MNEMONIC}: field {name} has no valid value") from None
        x >>= kind.bits
    return cls(*values)


# --- words kept from reading a program --------------------------------------------------------
# The parser (isa/asm.py) checks and packs each instruction as it reads it, and decoding checks
# every word, so both leave the words with the program, together with the instruction objects
# they are the words of. Instructions are immutable: while the program holds exactly those
# objects (and no fewer tensors, so every tensor index is still declared), the words still hold
# and encode_program need not check and pack them again. Any change falls back to doing so.

_KEPT = "_kept_words"


def keep_words(p: Program, words: bytes) -> None:
    """Remember ``words``, the checked words of ``p.instrs`` as they are now."""
    setattr(p, _KEPT, (tuple(p.instrs), words, len(p.tensors)))


def words_hold(p: Program) -> bool:
    """Whether ``p``'s instructions are still those it was read with, every one of them
    encodable (each field's value one its kind holds: ``field_errors`` finds none)."""
    return kept_words(p) is not None


def kept_words(p: Program) -> bytes | None:
    """The words ``p`` was read with, while they are still its instructions' (else None)."""
    kept = getattr(p, _KEPT, None)
    if kept is None:
        return None
    instrs, words, n_tensors = kept
    same = len(instrs) == len(p.instrs) and all(map(operator.is_, instrs, p.instrs))
    return words if same and len(p.tensors) >= n_tensors else None


# --- whole programs --------------------------------------------------------------------------

def header(p: Program) -> dict:
    tensors = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "kind": t.kind,
                "io_name": t.io_name, "offset": t.offset,
                "range": None if t.range is None else list(t.range)} for t in p.tensors]
    regions = [[at, name] for at, name in p.regions]
    return {"arch": p.arch, "data_file": p.data_file, "tensors": tensors, "regions": regions,
            "skipped": dict(sorted(p.skipped.items())),
            "approximations": {k: list(v) for k, v in p.approximations.items()},
            "instructions": len(p.instrs),
            **({"aliases": {k: [o, off, list(st)] for k, (o, off, st) in p.aliases.items()}} if p.aliases else {})}


def json_text(value, **options) -> str:
    """``value`` as JSON, non-ASCII characters as they are, unless one cannot be UTF-8 (a lone
    surrogate: the byte of a file name that is not UTF-8); then escaped, which reads back as it was."""
    text = json.dumps(value, ensure_ascii=False, **options)
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(value, **options)
    return text


def encode_program(p: Program) -> bytes:
    check_tensors(p)
    check_regions(p)
    head = json_text(header(p), separators=(",", ":")).encode()
    out = bytearray(PREFIX.pack(MAGIC, VERSION, 0, len(head)) + head)
    out += bytes(-len(out) % WORD_BYTES)
    kept = kept_words(p)
    if kept is not None:
        return bytes(out + kept)
    n_tensors = len(p.tensors)
    for n, i in enumerate(p.instrs):
        word = _word(i)
        if word is None or TENSOR_FIELDS[type(i)] and ref_error(i, n_tensors):
            word = _program_word(p, n, n_tensors)
        out += word
    return bytes(out)


def _program_word(p: Program, n: int, n_tensors: int) -> bytes:
    """The word of instruction ``n`` after the full checks, or a ProgramError naming it."""
    i = p.instrs[n]
    why = instr_error(i) or ref_error(i, n_tensors)
    if why:
        raise ProgramError(f"{p.where(n)}: {why}")
    return encode_instr(i)


def decode_program(b: bytes, source: str = "<binary>") -> Program:
    start, head = _read_prefix(b, source)
    p = _program_from_header(head, source)
    check_tensors(p)
    body, count = b[start:], head["instructions"]
    if len(body) != count * WORD_BYTES:
        holds = f"{len(body) // WORD_BYTES} instructions" + (f" and {len(body) % WORD_BYTES} bytes"
                                                              if len(body) % WORD_BYTES else "")
        raise ProgramError(f"{source}: {'truncated' if len(body) < count * WORD_BYTES else 'corrupt'}: "
                           f"the header says {count} instructions, the file holds {holds}")
    for n in range(len(body) // WORD_BYTES):
        p.instrs.append(_decode_at(body, n, len(p.tensors), source))
    why = region_error(p)          # region indices can only be checked against the words
    if why:
        raise ProgramError(f"{source}: corrupt header: {why}")
    keep_words(p, bytes(body))
    return p


def _decode_at(body: bytes, n: int, n_tensors: int, source: str) -> Instr:
    try:
        i = decode_instr(body[n * WORD_BYTES:(n + 1) * WORD_BYTES])
    except ProgramError as e:
        raise ProgramError(f"{source}: instruction {n}: {e}") from None
    why = ref_error(i, n_tensors)
    if why:
        raise ProgramError(f"{source}: instruction {n}: {i.MNEMONIC}: {why}")
    return i


def _read_prefix(b: bytes, source: str) -> tuple[int, dict]:
    """Offset of the first instruction word, and the parsed header."""
    if len(b) < PREFIX.size or b[:4] != MAGIC:
        raise ProgramError(f"{source}: not a D-Legion binary (no {MAGIC.decode()} header)")
    _, version, reserved, n = PREFIX.unpack_from(b)
    if version != VERSION or reserved:
        raise ProgramError(f"{source}: unsupported binary version {version}.{reserved} "
                           f"(this tool reads {VERSION}.0)")
    end = PREFIX.size + n
    start = end + (-end % WORD_BYTES)
    if len(b) < start:
        raise ProgramError(f"{source}: truncated header ({len(b)} bytes, header needs {start})")
    if any(b[end:start]):
        raise ProgramError(f"{source}: corrupt header padding")
    try:
        return start, json.loads(b[PREFIX.size:end].decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ProgramError(f"{source}: corrupt header ({e})") from None
    except ValueError:      # an integer past int()'s 4,300 digits: no field holds one
        raise ProgramError(f"{source}: corrupt header (a number out of range)") from None


# Header keys and the Python types their values may have.
_HEAD_KEYS = {"arch": (str,), "data_file": (str, type(None)), "tensors": (list,), "regions": (list,),
              "skipped": (dict,), "approximations": (dict,), "instructions": (int,)}
_TENSOR_KEYS = {"name": (str,), "dtype": (str,), "shape": (list,), "kind": (str,),
                "io_name": (str, type(None)), "offset": (int, type(None)), "range": (list, type(None))}


def _typed(d, keys: dict, what: str, source: str) -> dict:
    if not isinstance(d, dict) or set(d) != set(keys):
        raise ProgramError(f"{source}: corrupt header: {what} needs exactly the keys {', '.join(keys)}")
    for k, types in keys.items():
        if not isinstance(d[k], types) or isinstance(d[k], bool):
            raise ProgramError(f"{source}: corrupt header: {what} {k} {d[k]!r}")
    return d


def _program_from_header(head, source: str) -> Program:
    aliases = head.pop("aliases", {}) if isinstance(head, dict) else {}    # only when there are some
    if not isinstance(aliases, dict):
        raise ProgramError(f"{source}: corrupt header: aliases {aliases!r}")
    head = _typed(head, _HEAD_KEYS, "header", source)
    p = Program(arch=head["arch"], data_file=head["data_file"], source=source)
    for d in head["tensors"]:
        d = _typed(d, _TENSOR_KEYS, "tensor", source)
        rng = None if d["range"] is None else tuple(d["range"])
        p.tensors.append(Tensor(d["name"], d["dtype"], tuple(d["shape"]), d["kind"], d["io_name"],
                                d["offset"], rng))
    p.regions = [tuple(r) if isinstance(r, list) else r for r in head["regions"]]
    p.skipped = head["skipped"]
    p.approximations = head["approximations"]
    p.aliases = _aliases(aliases, source)
    why = skipped_error(p) or approximations_error(p) or alias_error(p)
    if why:
        raise ProgramError(f"{source}: corrupt header: {why}")
    return p


def _aliases(d: dict, source: str) -> dict:
    out = {}
    for name, a in d.items():
        ok = (isinstance(a, list) and len(a) == 3 and isinstance(a[0], str) and type(a[1]) is int
              and isinstance(a[2], list) and all(type(s) is int for s in a[2]))
        if not ok:
            raise ProgramError(f"{source}: corrupt header: alias {name!r}: {a!r}")
        out[name] = (a[0], a[1], tuple(a[2]))
    return out
