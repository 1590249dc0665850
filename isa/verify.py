"""Static checks of a program against an architecture, before it runs.

:func:`check` returns one line per problem, ``"{location}: {mnemonic}: {what is wrong}"``;
:func:`verify` raises a :class:`ProgramError` listing them. Each instruction family has one
small check function registered by class; the vector functions are found through their base
class (``VUnary``, ``VBinary``, ``VReduce``) on the MRO. Whole-program checks cover the tensor
declarations. Everything that depends only on the program text and the machine is checked
here; what depends on data (gathered row indices) is left to the emulator.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from isa.arch import MODE_BITS, Arch
from isa.expand import DRAM_FIELD, NONE, Queues, Tasks, bits_at, dram_of, expand, opcodes, word_matrix, word_spans
from isa.fields import View
from isa.fields import QUEUES
from isa.instructions import (TRANSFER_CLASSES, Barrier, DmaLoad, DmaStore, Drain, Gather, Instr, MatMul, NocAdd, NocMove, VBinary,
                              VMatMul, VReduce, VSelect, VUnary, Wait)
from isa.program import DTYPES, KINDS, LOADS, STORES, Program, ProgramError, Tensor
from isa import encoding

MAX_SHOWN = 20          # problems listed in a ProgramError before "... and N more"

Problems = Iterator[str]


@dataclass(frozen=True)
class Context:
    """What a family check may look at besides its instruction."""

    program: Program
    arch: Arch
    lengths: Counter    # (legion, queue) -> instructions that queue runs in the whole program

    def tensor(self, index: int) -> Tensor | None:
        tensors = self.program.tensors
        return tensors[index] if 0 <= index < len(tensors) else None


CHECKS: dict[type, Callable[[Instr, Context], Problems]] = {}


def register(*classes: type):
    """Register a family check for ``classes`` and their subclasses."""
    def add(fn):
        for cls in classes:
            CHECKS[cls] = fn
        return fn
    return add


def family_check(cls: type) -> Callable[[Instr, Context], Problems] | None:
    for base in cls.__mro__:
        if base in CHECKS:
            return CHECKS[base]
    return None


# --- public API ------------------------------------------------------------------------------

def check(program: Program, arch: Arch) -> list[str]:
    """Every problem of ``program`` on ``arch``, one line each; empty when it may run.

    Spans are checked on the program as written, everything else on its expansion into one
    task per Legion (a problem shared by the Legions of a span is listed once)."""
    return _checked(program, arch)[0]


def _checked(program: Program, arch: Arch) -> tuple[list[str], Program | None]:
    """The problems of ``program`` and its expansion (None when a span cannot be expanded)."""
    out = list(tensor_problems(program)) + _span_problems(program, arch)
    if out:
        return out, None
    flat = expand(program, arch.legions)
    tasks = flat.program.instrs
    queues = Queues(tasks, tasks.barrier, arch.legions)
    ctx = Context(flat.program, arch, _lengths(tasks, queues, arch))
    # A program read from text or binary was checked field by field as it was read.
    fields, bad = (([], np.zeros(len(tasks.source), dtype=bool)) if encoding.words_hold(program)
                   else _field_problems(tasks))
    found = fields + _end_problems(tasks, ctx, bad) + _condition_problems(tasks, queues, ctx, bad)
    found.sort(key=lambda x: x[:2])
    out += [f"{flat.program.where(k)}: {tasks[k].MNEMONIC}: {what}" for k, _, what in found]
    return list(dict.fromkeys(out)), flat.program


def _field_problems(tasks: Tasks) -> tuple[list, np.ndarray]:
    """Fields are encoded as written: the tasks of an instruction share its (un)encodable
    fields, and instructions alike in every field (each layer's) share them too. Listed once,
    at the instruction's first task; also, per instruction, whether it has any."""
    alike, fields = tasks.alike(), _FieldChecks()
    out, bad = [], np.zeros(len(tasks.source), dtype=bool)
    for o, ins in enumerate(tasks.source):
        found = alike.get("fields", o, lambda: fields.bad(ins))
        out += [(int(tasks.first[o]), 0, what) for what in found]
        bad[o] = bool(found)
    return out, bad


class _FieldChecks:
    """``Instr.bad_fields`` with each value checked once per field kind: instructions that
    differ (each layer's DMAs, by tensor and offset) still share most field values."""

    def __init__(self):
        self.kinds: dict = {}       # instruction class -> (field name, kind) pairs
        self.seen: dict = {}        # (kind, value type, value) -> why it cannot be encoded, or ""

    def bad(self, ins: Instr) -> list[str]:
        cls = type(ins)
        kinds = self.kinds.get(cls)
        if kinds is None:
            kinds = self.kinds[cls] = tuple((f.name, f.metadata["kind"]) for f in cls.fields())
        out = []
        for name, kind in kinds:
            value = getattr(ins, name)
            key = (id(kind), type(value), value)
            why = self.seen.get(key)
            if why is None:
                why = self.seen[key] = kind.check(value) or ""
            if why:
                out.append(f"{name}: {why}")
        return out


def _checked_tasks(tasks: Tasks) -> np.ndarray:
    """The tasks whose fields the family checks look at: each instruction's first, and the last
    of a DMA span. The ranks of a span differ from the first only by a Legion (checked with the
    span), a DRAM offset and destinations that move linearly with the rank, so the two ends
    cover the DMAs' ranks in between; every task's condition is checked on its own."""
    last = np.concatenate([tasks.first[1:], [len(tasks)]]) - 1
    moving = np.array([type(i) in TRANSFER_CLASSES for i in tasks.source], dtype=bool)
    return np.unique(np.concatenate([tasks.first, last[moving & (last > tasks.first)]])) if len(tasks) else tasks.first


def _end_problems(tasks: Tasks, ctx: Context, bad: np.ndarray) -> list:
    """The family checks (which assume well-formed fields). A first task that moves nothing
    with its rank is checked once per distinct instruction (the layers of a model repeat them)."""
    if tasks.words is not None and not bad.any():
        return _end_problems_words(tasks, ctx)
    out, alike, first = [], tasks.alike(), tasks.first.tolist()
    origin = tasks.origin.tolist()
    first_fine = set()                 # transfers whose first task has no problem
    for k in _checked_tasks(tasks).tolist():
        o = origin[k]
        if bad[o]:
            continue
        # A first task is its instruction but for span, Legion stride and absolute condition,
        # which no family check reads (spans and conditions are checked apart): the
        # instruction is checked, and no task object made for it.
        ins = tasks.source[o]
        if isinstance(ins, Wait):        # its family's check is its condition's, made per task
            found = list(legion(ins.legion, ctx.arch)) if k == first[o] else []
        elif k != first[o]:
            fine = o in first_fine and _rank_fits(ins, k - first[o], ctx)
            found = [] if fine else list(family_problems(tasks[k], ctx))
        elif type(ins) in TRANSFER_CLASSES:
            found = list(family_problems(ins, ctx))
            if not found:
                first_fine.add(o)
        else:
            found = alike.get("family", o, lambda: list(family_problems(ins, ctx)))
        out += [(k, 0, what) for what in found]
    return out


def _end_problems_words(tasks: Tasks, ctx: Context) -> list:
    """:func:`_end_problems` of a program read from a file, the same problems found with
    Python run per distinct instruction rather than per task. The others' checks repeat an
    equal instruction's. A transfer is checked once per group of transfers equal but for
    their DRAM offset (and span, Legion stride and condition, which no family check reads):
    when the group's first has no problem, the others can only have the one an offset
    causes, their DRAM window past their tensor's storage, which is computed for all at
    once, as are the moved Legions, destinations and windows of the last ranks of spans.
    Any task these say may have a problem gets the full check."""
    source, legions = tasks.source, ctx.arch.legions
    n = len(source)
    u = word_matrix(tasks.words, n)
    op = opcodes(u)
    first = tasks.first
    last = np.concatenate([first[1:], [len(tasks)]]) - 1 if n else first
    out = []
    # A wait's family check is its condition's, made per task: here only its Legion.
    for o in np.flatnonzero((op == Wait.OPCODE) & (tasks.legion[first] >= legions)).tolist():
        out += [(int(first[o]), 0, what) for what in legion(source[o].legion, ctx.arch)]
    moving = np.isin(op, [cls.OPCODE for cls in TRANSFER_CLASSES])
    other = ~moving & (op != Wait.OPCODE)
    alike = tasks.alike()
    ids = np.asarray(alike.ids, dtype=np.int64)
    bad_ids = []
    for i in np.unique(ids[other]).tolist():
        ins = source[i]
        if alike.get("family", i, lambda: list(family_problems(ins, ctx))):
            bad_ids.append(i)
    if bad_ids:
        for o in np.flatnonzero(other & np.isin(ids, bad_ids)).tolist():
            out += [(int(first[o]), 0, what) for what in alike.get("family", o, None)]
    rows = np.flatnonzero(moving)
    if len(rows):
        out += _transfer_problems(tasks, ctx, u[rows], op[rows], rows, first, last)
    return out


def _transfer_problems(tasks: Tasks, ctx: Context, w: np.ndarray, op: np.ndarray, rows: np.ndarray,
                       first: np.ndarray, last: np.ndarray) -> list:
    """The first and last tasks' family problems of the transfers ``rows`` (words ``w``)."""
    source, legions = tasks.source, ctx.arch.legions
    m = len(rows)
    keep = np.empty((m, w.shape[1]), dtype=np.uint64)       # each word but the bits set apart
    legion_ = np.zeros(m, np.int64)
    dests = np.zeros(m, np.uint64)
    n_rows, n_cols = np.zeros(m, np.int64), np.zeros(m, np.int64)
    tensor, offset, rs, lstride = (np.zeros(m, np.int64) for _ in range(4))
    window = np.zeros(m, dtype=bool)          # a DRAM window checked against its tensor
    for cls in TRANSFER_CLASSES:
        at = np.flatnonzero(op == cls.OPCODE)
        if not len(at):
            continue
        fields, x = encoding.FIELD_AT[cls], w[at]
        get = lambda name, skip=0, bits=None: bits_at(
            x, fields[name][0] + skip, fields[name][1].bits if bits is None else bits).astype(np.int64)
        legion_[at], n_rows[at], n_cols[at] = get("legion"), get("rows"), get("cols")
        if "dests" in fields:
            dests[at] = bits_at(x, fields["dests"][0], 64)
        apart = [(fields[name][0], fields[name][1].bits) for name in ("span", "lstride", "wait") if name in fields]
        name = DRAM_FIELD.get(cls)
        if name is not None:
            shift, kind = fields[name]
            tensor[at], offset[at] = get(name, 0, kind.tensor_bits), get(name, kind.tensor_bits, kind.offset_bits)
            rs[at] = get(name, kind.tensor_bits + kind.offset_bits, kind.rs_bits)
            ls = get("lstride")
            lstride[at] = np.where(ls & 1, ls >> 1, 0)
            apart.append((shift + kind.tensor_bits, kind.offset_bits))
            window[at] = cls is not Gather         # a gather's rows are checked as it runs
        mask = (1 << encoding.WORD_BITS) - 1
        for shift, bits in apart:
            mask &= ~(((1 << bits) - 1) << shift)
        keep[at] = x & np.frombuffer(mask.to_bytes(encoding.WORD_BYTES, "little"), dtype="<u8")
    window &= (n_rows > 0) & (n_cols > 0)
    # Capped where no window reaches (an offset, strided rows and a moved rank stay below 2**50).
    storage = np.array([min(t.storage_elems, 1 << 62) for t in ctx.program.tensors] + [0], dtype=np.int64)
    declared = tensor < len(ctx.program.tensors)
    limit = storage[np.where(declared, tensor, len(storage) - 1)]
    reach = (n_rows - 1) * rs + n_cols           # past the window's offset

    _, reps, group = np.unique(keep.view(np.dtype((np.void, keep.shape[1] * 8))).ravel(),
                               return_index=True, return_inverse=True)
    group_fine = np.array([not any(True for _ in family_problems(source[rows[r]], ctx)) for r in reps.tolist()],
                          dtype=bool)
    fits = ~window | (offset + reach <= limit)
    first_fine = group_fine[group.ravel()] & fits
    out = []
    for j in np.flatnonzero(~first_fine).tolist():
        o = int(rows[j])
        found = list(family_problems(source[o], ctx))
        first_fine[j] = not found
        out += [(int(first[o]), 0, what) for what in found]
    # The last rank of a span: its Legion, destinations and DRAM window moved by the rank.
    rank = (last[rows] - first[rows])
    spanned = rank > 0
    room = legions - rank
    dests_fit = np.where(room <= 0, dests == 0,
                         (dests >> np.clip(room, 0, 63).astype(np.uint64)) == 0) | (room >= 64)
    rank_fits = ((legion_ + rank < legions) & dests_fit
                 & (~window | (offset + rank * lstride + reach <= limit)))
    for j in np.flatnonzero(spanned & ~(first_fine & rank_fits)).tolist():
        k = int(last[rows[j]])
        out += [(k, 0, what) for what in family_problems(tasks[k], ctx)]
    return out


def _rank_fits(ins: Instr, rank: int, ctx: Context) -> bool:
    """Whether rank ``rank`` of a transfer whose first task has no problem has none either:
    it differs only by its Legion, destinations and DRAM offset, which move with the rank (the
    views, tensor and dtypes are the first task's). False sends it to the full check."""
    legions = ctx.arch.legions
    if ins.legion + rank >= legions:
        return False
    dests = getattr(ins, "dests", None)
    if dests and max(dests) + rank >= legions:
        return False
    # A gather's table bounds are checked as it runs; a NoC move has no DRAM side.
    if isinstance(ins, (Gather, NocMove)) or ins.rows <= 0 or ins.cols <= 0:
        return True
    ref = dram_of(ins, rank)
    return 0 <= ref.offset and ref.offset + (ins.rows - 1) * ref.rs + ins.cols <= ctx.tensor(ref.tensor).storage_elems


def _condition_problems(tasks: Tasks, queues: Queues, ctx: Context, bad: np.ndarray) -> list:
    """Conditions that name a Legion the machine lacks or a count their queue never reaches,
    and conditions on a task's own queue that wait for later work."""
    has = (tasks.cond[:, 0] != NONE) & ~bad[tasks.origin]
    legion, queue, count = tasks.cond[:, 0], tasks.cond[:, 1], tasks.cond[:, 2]
    known = has & (legion < ctx.arch.legions)
    short = np.zeros(len(tasks), dtype=bool)
    short[known] = queues.lengths(legion[known], queue[known]) < count[known]
    out = []
    for k in np.flatnonzero(has & (~known | short)).tolist():
        out += [(k, 0, what) for what in condition(tasks[k].condition(), ctx)]
    own = (tasks.cond[:, 0] != NONE) & (legion == tasks.legion) & (queue == tasks.queue)
    before = queues.before(tasks.legion[own], tasks.queue[own], tasks.origin[own])
    late = count[own] > before
    for k, n in zip(np.flatnonzero(own)[late].tolist(), before[late].tolist()):
        out += [(k, 1, what) for what in own_queue(tasks[k].condition(), n)]
    return out


def _lengths(tasks: Tasks, queues: Queues, arch: Arch) -> Counter:
    """Instructions each queue runs: its own, plus every barrier (a machine's queue)."""
    own = tasks.legion != NONE
    keys, counts = np.unique(queues.key(tasks.legion[own], tasks.queue[own]), return_counts=True)
    q = len(tasks.names)
    out = Counter({(int(k) // q, tasks.names[int(k) % q]): int(c) for k, c in zip(keys, counts)})
    for legion_ in range(arch.legions):
        for q in QUEUES:
            out[(legion_, q)] += len(queues.barriers)
    return out


def span_problem(ins: Instr, arch: Arch) -> str | None:
    span = getattr(ins, "span", None)
    if span is None:
        return None
    if span == 0:
        return "a span of 0 Legions runs nowhere"
    if ins.legion + span > arch.legions:
        first, last = max(ins.legion, arch.legions), ins.legion + span - 1     # the missing ones only
        missing = f"L{first} does not" if first == last else f"L{first} to L{last} do not"
        n = arch.legions
        has = f"{n} Legion: L0" if n == 1 else f"{n} Legions: L0 to L{n - 1}"
        return f"{missing} exist ({arch.name} has {has})"
    return None


def _span_problems(program: Program, arch: Arch) -> list[str]:
    """:func:`span_problem` of every instruction that may have one: of a program read from a
    file, those whose words hold a span of 0 or past the last Legion, found at once (a call
    per instruction costs a tenth of verifying a layer); else every instruction."""
    instrs, words = program.instrs, encoding.kept_words(program)
    maybe = range(len(instrs)) if words is None else _span_candidates(words, len(instrs), arch.legions)
    return [f"{program.where(i)}: {instrs[i].MNEMONIC}: span: {why}" for i in maybe
            if (why := span_problem(instrs[i], arch))]


def _span_candidates(words: bytes, n: int, legions: int) -> list[int]:
    """The instructions whose words name a span of 0 or one reaching past Legion ``legions - 1``."""
    u = word_matrix(words, n)
    start, span, named = word_spans(u, opcodes(u))
    return np.flatnonzero(named & ((span == 0) | (start + span > legions))).tolist()


def own_queue(cond, before: int) -> Problems:
    """A condition on the instruction's own queue, which ``before`` instructions came to
    earlier, can only wait for those."""
    if cond.count > before:
        yield (f"condition {cond} waits on its own queue for instructions after itself "
               f"(only {before} come before it)")


def verify(program: Program, arch: Arch) -> Program:
    """Raise :class:`ProgramError` listing the problems of ``program`` on ``arch``, if any;
    else return the expansion it checked (one task per Legion), for the caller to run."""
    problems, flat = _checked(program, arch)
    if not problems:
        return flat
    shown = problems[:MAX_SHOWN]
    if len(problems) > MAX_SHOWN:
        shown.append(f"... and {len(problems) - MAX_SHOWN} more")
    raise ProgramError("\n".join(shown))


def instr_problems(ins: Instr, ctx: Context) -> Problems:
    """The problems of a task whose fields are well formed (the family checks assume it)."""
    yield from family_problems(ins, ctx)
    cond = getattr(ins, "wait", None)
    if cond is not None:
        yield from condition(cond, ctx)


def family_problems(ins: Instr, ctx: Context) -> Problems:
    """:func:`instr_problems` but for an embedded condition (a wait's is its family's)."""
    fn = family_check(type(ins))
    if fn is None:
        yield f"{type(ins).__name__} is not an instruction of the table"
        return
    if hasattr(ins, "legion"):
        yield from legion(ins.legion, ctx.arch)
    yield from fn(ins, ctx)


# --- operand helpers -------------------------------------------------------------------------

def legion(index: int, arch: Arch) -> Problems:
    if index >= arch.legions:
        yield f"Legion L{index} does not exist ({arch.name} has {arch.legions})"


def bounds(what: str, space: str, last: int | None, arch: Arch) -> Problems:
    """``last`` is the largest element index touched (None: nothing is touched)."""
    cap = arch.derived.spad_elems[space]
    if last is not None and last >= cap:
        yield f"{what} reaches {space} element {last}, past the {cap} it holds"


def view(name: str, v, rows: int, cols: int, arch: Arch, dest: bool = False) -> Problems:
    """A rows x cols view lies inside its scratchpad; a written one does not alias itself."""
    if not isinstance(v, View):
        return      # an fp32 immediate
    last = None if rows <= 0 or cols <= 0 else v.addr + (rows - 1) * v.rs + (cols - 1) * v.cs
    if last is not None and last >= arch.derived.spad_elems[v.space]:     # named only when wrong
        yield from bounds(f"{name} {v} over {rows}x{cols}", v.space, last, arch)
    if not dest:
        return
    if v.rs == 0 and rows > 1:
        yield f"{name} {v} writes {rows} rows with row stride 0"
    if v.cs == 0 and cols > 1:
        yield f"{name} {v} writes {cols} columns with column stride 0"


def vector(name: str, addr: int | None, n: int, space: str, arch: Arch) -> Problems:
    """An optional contiguous vector of ``n`` elements (Drain's per-row/per-column operands)."""
    if addr is None:
        return
    last = addr + n - 1 if n > 0 else None
    yield from bounds(f"{name} {space}[{addr}] of {n} elements", space, last, arch)


def tensor_ref(name: str, index: int, ctx: Context) -> Problems:
    if ctx.tensor(index) is None:
        yield f"{name} names tensor {index}, but only {len(ctx.program.tensors)} are declared"


def dram(name: str, ref, rows: int, cols: int, ctx: Context) -> Problems:
    """A rows x cols DRAM access lies inside its tensor's storage."""
    yield from tensor_ref(name, ref.tensor, ctx)
    t = ctx.tensor(ref.tensor)
    if t is None or rows <= 0 or cols <= 0:
        return
    end = ref.offset + (rows - 1) * ref.rs + cols
    if end > t.storage_elems:
        yield (f"{name} @{t.name}[{ref.offset},{ref.rs}] over {rows}x{cols} reaches storage "
               f"element {end - 1} of tensor {t.name!r}, which has {t.storage_elems}")


def dtype_moves(name: str, t: Tensor | None, table: dict, space: str, verb: str) -> Problems:
    """The DMA can convert between the tensor's dtype and the space's element."""
    if t is None or t.dtype in table[space]:
        return
    allowed = ", ".join(sorted(table[space]))
    yield (f"{name} tensor {t.name!r} is {t.dtype}, which cannot be {verb} {space} "
           f"(allowed: {allowed})")


# --- DMA queue -------------------------------------------------------------------------------

def _dests(ins: DmaLoad | NocMove, arch: Arch) -> Problems:
    """The receiving Legions of a load or a Legion-to-Legion transfer: on the machine (named
    only when one is not: this runs per task), several only where it multicasts."""
    if ins.dests and max(ins.dests) >= arch.legions:
        for dest in sorted(ins.dests):
            yield from (f"dests: {p}" for p in legion(dest, arch))
    if len(ins.dests) > 1 and not arch.multicast:
        yield f"dests multicast to {len(ins.dests)} Legions, but {arch.name} has no multicast"


@register(DmaLoad)
def dma_load(ins: DmaLoad, ctx: Context) -> Problems:
    arch = ctx.arch
    yield from _dests(ins, arch)
    yield from view("dst", ins.dst, ins.rows, ins.cols, arch, dest=True)
    yield from dram("src", ins.src, ins.rows, ins.cols, ctx)
    yield from dtype_moves("src", ctx.tensor(ins.src.tensor), LOADS, ins.dst.space, "loaded into")


@register(NocMove)
def noc_move(ins: NocMove, ctx: Context) -> Problems:
    arch = ctx.arch
    yield from _dests(ins, arch)
    if ins.dst.space != ins.src.space:
        yield f"dst is in {ins.dst.space} but src in {ins.src.space}: a transfer moves elements, it does not convert them"
    yield from view("src", ins.src, ins.rows, ins.cols, arch)
    yield from view("dst", ins.dst, ins.rows, ins.cols, arch, dest=True)


@register(NocAdd)
def noc_add(ins: NocAdd, ctx: Context) -> Problems:
    yield from noc_move(ins, ctx)
    if ins.dst.space != "acc" or ins.src.space != "acc":
        yield f"noc.add adds int32 partial sums: dst and src must be acc, not {ins.dst.space} and {ins.src.space}"


@register(DmaStore)
def dma_store(ins: DmaStore, ctx: Context) -> Problems:
    yield from view("src", ins.src, ins.rows, ins.cols, ctx.arch)
    yield from dram("dst", ins.dst, ins.rows, ins.cols, ctx)
    t = ctx.tensor(ins.dst.tensor)
    yield from dtype_moves("dst", t, STORES, ins.src.space, "stored from")
    if t is not None and t.kind in ("const", "input"):
        yield f"dst tensor {t.name!r} is {t.kind}: programs may not write it"


@register(Gather)
def gather(ins: Gather, ctx: Context) -> Problems:
    # The table rows read depend on the ids, so their range is checked when the program runs.
    yield from view("dst", ins.dst, ins.rows, ins.cols, ctx.arch, dest=True)
    yield from view("ids", ins.ids, ins.rows, 1, ctx.arch)
    yield from tensor_ref("table", ins.table.tensor, ctx)
    table = ctx.tensor(ins.table.tensor)
    yield from dtype_moves("table", table, LOADS, ins.dst.space, "loaded into")


# --- matrix queue ----------------------------------------------------------------------------

@register(MatMul)
def matmul(ins: MatMul, ctx: Context) -> Problems:
    arch = ctx.arch
    if ins.mode not in arch.modes:
        yield f"mode {ins.mode} is not supported by {arch.name} (modes: {', '.join(arch.modes)})"
    if ins.split == "k" and arch.cores > 1 and not arch.parallel_accumulators:
        yield (f"split=k sums the psums of {arch.cores} cores in the parallel accumulators, "
               f"which {arch.name} lacks")
    empty = [f"{d}=0" for d in ("M", "K", "N") if getattr(ins, d) == 0]
    if empty:
        yield f"empty matrix multiplication ({', '.join(empty)})"
        return
    yield from view("acc", ins.acc, ins.M, ins.N, arch, dest=True)
    yield from view("act", ins.act, ins.M, ins.K, arch)
    yield from weights(ins, arch)
    yield from mask(ins, ctx)


def weights(ins: MatMul, arch: Arch) -> Problems:
    """The weights are K rows of N packed weights; a row must be whole bytes."""
    row_bits = ins.N * MODE_BITS[ins.mode]
    if row_bits % 8:
        yield f"N={ins.N} weights of mode {ins.mode} are {row_bits} bits a row, not whole bytes"
        return
    yield from view("wgt", ins.wgt, ins.K, row_bits // 8, arch)


def mask(ins: MatMul, ctx: Context) -> Problems:
    """The sparsity mask holds one u8 per array x array weight block, fixed before the run."""
    if ins.mask is None:
        return
    yield from tensor_ref("mask", ins.mask, ctx)
    t = ctx.tensor(ins.mask)
    if t is None:
        return
    if t.kind != "const":
        yield f"mask tensor {t.name!r} is {t.kind}, not const"
    if t.dtype != "u8":
        yield f"mask tensor {t.name!r} is {t.dtype}, not u8"
    blocks = math.ceil(ins.K / ctx.arch.array) * math.ceil(ins.N / ctx.arch.array)
    if t.numel < blocks:
        yield (f"mask tensor {t.name!r} has {t.numel} elements, "
               f"fewer than the {blocks} weight blocks")


# --- vector queue ----------------------------------------------------------------------------

@register(Drain)
def drain(ins: Drain, ctx: Context) -> Problems:
    arch = ctx.arch
    yield from view("dst", ins.dst, ins.M, ins.N, arch, dest=True)
    yield from view("acc", ins.acc, ins.M, ins.N, arch)
    yield from vector("zp", ins.zp, ins.N, "acc", arch)
    yield from vector("rscale", ins.rscale, ins.M, "vec", arch)
    yield from vector("cscale", ins.cscale, ins.N, "vec", arch)
    yield from vector("bias", ins.bias, ins.N, "vec", arch)


@register(VUnary)
def unary(ins: VUnary, ctx: Context) -> Problems:
    yield from view("dst", ins.dst, ins.rows, ins.cols, ctx.arch, dest=True)
    yield from view("a", ins.a, ins.rows, ins.cols, ctx.arch)


@register(VBinary)
def binary(ins: VBinary, ctx: Context) -> Problems:
    yield from unary(ins, ctx)
    yield from view("b", ins.b, ins.rows, ins.cols, ctx.arch)


@register(VReduce)
def reduce(ins: VReduce, ctx: Context) -> Problems:
    yield from view("dst", ins.dst, ins.rows, 1, ctx.arch, dest=True)
    yield from view("a", ins.a, ins.rows, ins.cols, ctx.arch)


@register(VSelect)
def select(ins: VSelect, ctx: Context) -> Problems:
    yield from view("dst", ins.dst, ins.rows, ins.cols, ctx.arch, dest=True)
    yield from view("cond", ins.cond, ins.rows, ins.cols, ctx.arch)
    yield from view("a", ins.a, ins.rows, ins.cols, ctx.arch)


# --- synchronization -------------------------------------------------------------------------

@register(VMatMul)
def vmatmul(ins: VMatMul, ctx: Context) -> Problems:
    yield from view("dst", ins.dst, ins.M, ins.N, ctx.arch, dest=True)
    yield from view("a", ins.a, ins.M, ins.K, ctx.arch)
    yield from view("b", ins.b, ins.K, ins.N, ctx.arch)


@register(Barrier)
def barrier(ins: Barrier, ctx: Context) -> Problems:
    return iter(())     # every queue takes part; nothing to check


@register(Wait)
def wait(ins: Wait, ctx: Context) -> Problems:
    yield from condition(ins.until, ctx)


def condition(cond, ctx: Context) -> Problems:
    """A progress condition names a real queue and a count that queue can reach."""
    if cond.legion >= ctx.arch.legions:
        yield f"condition {cond} names Legion L{cond.legion} ({ctx.arch.name} has {ctx.arch.legions})"
        return
    n = ctx.lengths[(cond.legion, cond.queue)]
    if n < cond.count:
        yield (f"condition {cond} can never be satisfied: L{cond.legion}.{cond.queue} runs "
               f"{n} instruction{'' if n == 1 else 's'}")


# --- tensors ---------------------------------------------------------------------------------

def tensor_problems(program: Program) -> Problems:
    head = program.source
    for t in program.tensors:
        yield from (f"{head}: tensor {t.name!r}: {p}" for p in tensor_decl(t, program))
    for name, n in Counter(t.name for t in program.tensors).items():
        if n > 1:
            yield f"{head}: tensor name {name!r} is declared {n} times"
    for kind in ("input", "output"):
        bound = Counter(t.io_name for t in program.tensors if t.kind == kind and t.io_name)
        for io_name, n in bound.items():
            if n > 1:
                yield f"{head}: {kind} name {io_name!r} is bound to {n} tensors"
    why = encoding.alias_error(program)
    if why:
        yield f"{head}: {why}"


def tensor_decl(t: Tensor, program: Program) -> Problems:
    if t.dtype not in DTYPES:
        yield f"unknown dtype {t.dtype!r} (dtypes: {', '.join(DTYPES)})"
        return
    if t.kind not in KINDS:
        yield f"unknown kind {t.kind!r} (kinds: {', '.join(KINDS)})"
        return
    if t.kind in ("input", "output") and not t.io_name:
        yield f"{t.kind} tensor has no io_name to bind it to the graph"
    if t.kind != "const":
        return
    if t.offset is None:
        yield "const tensor has no offset in the data file"
        return
    if program.data is not None and t.offset + t.nbytes > len(program.data):
        yield (f"const bytes {t.offset}..{t.offset + t.nbytes} lie beyond the data file "
               f"{program.data_file!r}, which has {len(program.data)}")
