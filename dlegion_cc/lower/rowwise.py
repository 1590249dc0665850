"""Row-block kernels on the vector unit: load, compute, store, block after block.

A kernel names its operands (:class:`Arg`) in one N-D frame and a ``body`` that emits vector
instructions on their scratchpad views. ``rowwise`` merges dimensions, cuts the 2-D loop into
row blocks that fit a Legion's vector scratchpad, deals the blocks to the Legions, and for each
block loads the inputs (dma queue), runs the body (vec queue) and stores the outputs (dma queue),
with the dependencies in between. Inputs every block reads whole (a norm's weight row) sit
below the blocks and each Legion loads them once (``_Resident``). When a Legion gets several
blocks, each takes half of the rest of the scratchpad (a third, where its outputs in place let
a third hold as many rows) and the next blocks' loads are issued before the current one's body,
so they overlap (``_InFlight``). Equal blocks dealt to adjacent
Legions are one group: its instructions are emitted once with a span of Legions, each DMA's DRAM
offset stepping one block per Legion (``lstride``). A kernel whose rows need only their first
columns (``reach``: a causal softmax) loads, computes and stores each group only as wide as its
rows reach; the columns beyond are left as they are in DRAM.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from isa.fields import DramRef, View
from isa.instructions import DmaLoad, DmaStore
from dlegion_cc.errors import CompileError
from dlegion_cc.lower.emitter import Emitter
from dlegion_cc.lower.layout import Operand, coalesce, outer_indices, transposed
from runtime.costs import cost


@dataclass(frozen=True)
class Arg:
    """A kernel operand: a DRAM view (input or output), or a scratch temp when ``operand`` is None.

    Temps are a full block (``col=False``) or one value per row (``col=True``). An output with
    an ``alias`` is computed in the block of that argument (an input or temp of the same shape
    that died making it) and stored from there: it takes no block of its own, so the blocks of
    a wide kernel may fit half the scratchpad, the next one loading while one computes.
    ``const``: the values of a constant input's DRAM tensor, flat, when the body reads only the
    columns past a block's leading +0.0 of it (``lead``): those are not loaded.
    """

    name: str
    operand: Operand | None = None
    out: bool = False
    col: bool = False
    alias: str | None = None
    const: np.ndarray | None = field(default=None, compare=False, repr=False)


Body = Callable[[Emitter, int, dict, int, int], None]   # (em, legion, views, rows, cols)


def _shape_of(rs: int, cs: int, col_temp: bool) -> tuple[bool, bool]:
    """(per row?, full width?) of an operand's block in the scratchpad."""
    if col_temp:
        return True, False
    return rs != 0, cs != 0


def _footprint(arg: Arg, rs: int, cs: int, rows: int, cols: int) -> int:
    per_row, full = _shape_of(rs, cs, arg.operand is None and arg.col)
    return (rows if per_row else 1) * (cols if full else 1)


def _view(addr: int, rs: int, cs: int, cols: int, col_temp: bool) -> View:
    per_row, full = _shape_of(rs, cs, col_temp)
    if full:
        return View("vec", addr, cols if per_row else 0, 1)
    return View("vec", addr, 1 if per_row else 0, 0)


def rowwise(em: Emitter, shape: tuple[int, ...], args: list[Arg], body: Body,
            keep_last: bool = False, where: str = "", reach: np.ndarray | None = None) -> None:
    """Emit ``body`` over every row block of the frame ``shape``. ``reach`` (with
    ``keep_last``), of the frame's rows (``shape[:-1]``): how many leading columns each row
    needs; a group of blocks runs as wide as the widest of its rows."""
    if not math.prod(shape):
        return          # an empty frame (a value emptied by a dim bound to 0): nothing to do
    shape, args, reach = _broadcast_rows(em, shape, args, keep_last, reach)
    shape2, bound, strides = _coalesced(shape, args, keep_last)
    reach = _Reach(reach.reshape(shape2[:-1]) if reach is not None and keep_last else None, shape2[-1])
    rows, cols = shape2[-2], shape2[-1]
    # Sized as if every output had a block of its own, but for the one choice an output in
    # place changes for the better: blocks that fit half the scratchpad only so.
    sized = [replace(a, alias=None) for a in args]
    width = cols if keep_last else _cols_per_block(em, sized, strides, cols)
    if width > em.extent():
        raise CompileError(f"{where}rows of {cols} elements are longer than one instruction can name "
                           f"({em.extent()})")
    if not keep_last and cols > width:
        _folded(em, args, shape2, bound, width, body, where)
        return
    resident = _Resident(args, bound, cols)
    # Where a row sized so does not fit (beside a matmul's buffers, ``rowblocks``), its outputs
    # in place make it fit.
    block = (_rows_per_block(em, sized, strides, rows, width, where, resident, strict=False)
             or _rows_per_block(em, args, strides, rows, width, where, resident))
    if block >= rows and len(shape2) > 2:
        _whole_frames(em, args, shape2, bound, strides, body, resident, reach)
        return
    half = resident.half(em)
    in_half = _rows_per_block(em, sized, strides, rows, cols, where, resident, half, strict=False)
    if not 0 < in_half < rows:
        shared = _rows_per_block(em, args, strides, rows, cols, where, resident, half, strict=False)
        in_half = shared if 0 < shared < rows else in_half
    overlap = 0 < in_half < rows                 # several blocks, each fitting half the scratchpad
    depth = _depth(em, args, strides, rows, cols, resident, dealt(rows, in_half, em.arch.legions)) if overlap else 2
    blocks = _InFlight(em, (em.capacity("vec") - resident.size) // depth if overlap else 0, resident, depth)
    most = in_half if overlap else block
    ring = None if overlap else _Ring.fitting(em, args, strides, rows, cols, resident)
    if ring is not None:
        blocks, most = ring, ring.rows
    for outer in outer_indices(shape2):
        at = {n: op.at(outer) for n, op in bound.items()}
        for r0, n, count in _groups(rows, most, em.arch.legions):
            steps = {name: op.strides[-2] * n for name, op in at.items()}
            width = reach.widest(outer, slice(r0, r0 + n * count))
            blocks.add(args, at, strides, r0, n, count, cols, body, steps, width)
    blocks.flush()


class _Reach:
    """How wide a group of rows runs: as far as its rows reach (all ``cols`` when not said)."""

    def __init__(self, reach: np.ndarray | None, cols: int):
        self.reach, self.cols = reach, cols

    def widest(self, outer: tuple, rows: slice) -> int:
        return self.cols if self.reach is None else int(self.reach[outer][rows].max())


# The fewest rows of a block worth making the row axis for inputs it shares: blocks of fewer
# rows pay more in DRAM round trips than the reloads save (2B4T at 256 on dlegion-8x8: rotary
# of the 20 query heads 17,467 -> 10,083 cycles, of the 5 key heads 4,658 -> 5,240).
SHARED_ROWS = 16


def _coalesced(shape: tuple[int, ...], args: list[Arg], keep_last: bool) -> tuple:
    """(the frame with its mergeable axes merged, each operand's view of it by name, each
    argument's (row, column) strides)."""
    ops = [a.operand for a in args if a.operand is not None]
    shape2, ops2 = coalesce(shape, ops, keep_last)
    bound = dict(zip([a.name for a in args if a.operand is not None], ops2))
    strides = {a.name: (bound[a.name].strides[-2:] if a.name in bound else (1, 1)) for a in args}
    return shape2, bound, strides


def _broadcast_rows(em: Emitter, shape: tuple[int, ...], args: list[Arg], keep_last: bool, reach) -> tuple:
    """The frame with the leading axis along which the most input elements are broadcast (stride
    0) as its row axis, if that is more than along the row axis now and a block of all its rows
    still fits half the vector scratchpad (the next one loading meanwhile). Rows are independent,
    so any order of the leading axes computes the same; a block then loads such an input's row
    once for all its rows, not once a row (rotary tables shared by the heads)."""
    if len(shape) < 3:
        return shape, args, reach
    ins = [a.operand for a in args if a.operand is not None and not a.out]

    def shared(axis: int) -> int:
        return sum(shape[-1] if op.strides[-1] else 1 for op in ins if op.strides[axis] == 0) if shape[axis] > 1 else 0
    row = len(shape) - 2
    best = max(range(row), key=shared, default=row)
    if shared(best) <= shared(row) or shape[best] < SHARED_ROWS:
        return shape, args, reach
    order = [a for a in range(row + 1) if a != best] + [best, row + 1]
    moved = [a if a.operand is None else replace(a, operand=transposed(a.operand, order)) for a in args]
    new = tuple(shape[k] for k in order)
    shape2, bound, strides = _coalesced(new, moved, keep_last)
    resident = _Resident(moved, bound, shape2[-1])
    sized = [replace(a, alias=None) for a in moved]
    fits = _rows_per_block(em, sized, strides, shape2[-2], shape2[-1], "", resident, resident.half(em), strict=False)
    if fits < shape2[-2]:
        return shape, args, reach
    return new, moved, (None if reach is None else reach.transpose(order[:-1]))


class _Resident:
    """The inputs every block of a kernel reads whole and alike (a row broadcast over all the
    frame, a scalar): they sit below the blocks in the vector scratchpad and each Legion loads
    them once, not with every block. ``size``: the elements they take."""

    def __init__(self, args: list[Arg], bound: dict, cols: int):
        self.views, addr = {}, 0
        written = {a.alias for a in args}       # an output overwrites it: loaded with every block
        for a in args:
            if (a.operand is not None and not a.out and not any(bound[a.name].strides[:-1])
                    and a.name not in written):
                self.views[a.name] = _view(addr, 0, bound[a.name].strides[-1], cols, False)
                addr += cols if bound[a.name].strides[-1] else 1
        self.size = addr
        self.held: set = set()          # (Legion, name) loaded

    def half(self, em: Emitter) -> int:
        return (em.capacity("vec") - self.size) // 2

    def wanted(self, name: str, legion: int, count: int) -> bool:
        """Whether a load of ``name`` on Legions legion.. must be issued: always for a streamed
        input; for a resident one, unless every Legion of the span holds it already (then none
        loads it, so the span stays uniform)."""
        if name not in self.views:
            return True
        want = {(legion + j, name) for j in range(count)}
        if want <= self.held:
            return False
        self.held |= want
        return True


def _whole_frames(em, args, shape, bound, strides, body, resident, reach: _Reach) -> None:
    """A block holds a whole 2-D frame: the frames along the innermost outer dimension go to
    spans of Legions."""
    rows, cols = shape[-2:]
    half = resident.half(em)
    sized = [replace(a, alias=None) for a in args]
    fits = _rows_per_block(em, sized, strides, rows, cols, "", resident, half, strict=False) >= rows
    blocks = _InFlight(em, half if fits else 0, resident)
    for outer in outer_indices(shape[:-1]):
        for i0, _, count in _groups(shape[-3], 1, em.arch.legions):
            at = {n: op.at(outer + (i0,)) for n, op in bound.items()}
            steps = {name: op.strides[-3] for name, op in bound.items()}
            width = reach.widest(outer, slice(i0, i0 + count))
            blocks.add(args, at, strides, 0, rows, count, cols, body, steps, width)
    blocks.flush()


def _folded(em, args, shape, bound, width, body, where) -> None:
    """Rows longer than a block, element by element: each row is cut into rows of ``fold``
    elements (and a shorter last one), which row blocks then take several at a time. A block
    takes half the scratchpad, so the next one loads while this one is computed and stored
    (a whole one would leave DRAM idle between them: a 2B4T decode step's copy of a
    512-position cache into its present output went 5,837 -> 4,469 cycles)."""
    cols = shape[-1]
    fold = _fold_width(cols, max(1, width // 2))
    whole_rows, rest = divmod(cols, fold)
    ops = list(bound.values())
    folded = [Operand(o.tensor, o.offset, o.strides[:-1] + (fold * o.strides[-1], o.strides[-1])) for o in ops]
    _call(em, args, shape[:-1] + (whole_rows, fold), folded, body, where)
    if rest:
        tail = [Operand(o.tensor, o.offset + whole_rows * fold * o.strides[-1], o.strides[:-1] + (0, o.strides[-1]))
                for o in ops]
        _call(em, args, shape[:-1] + (1, rest), tail, body, where)


def _fold_width(cols: int, width: int) -> int:
    """The widest divisor of ``cols`` a block holds, or ``width`` (and a shorter last row) when
    every divisor is much narrower."""
    for w in range(width, max(1, width // 4) - 1, -1):
        if cols % w == 0:
            return w
    return width


def _call(em, args, shape, ops, body, where) -> None:
    it = iter(ops)
    bound_args = [replace(a, operand=next(it)) if a.operand is not None else a for a in args]
    rowwise(em, shape, bound_args, body, keep_last=True, where=where)


def _balanced(rows: int, most: int, legions: int) -> int:
    """Rows per block, at most ``most``, that deal ``rows`` to the Legions in as few rounds of
    ``legions`` blocks as ``most`` allows, with every block full where a divisor of ``rows``
    allows: a shorter last block goes alone, and a group on other Legions than the one before
    it does not overlap it (``_InFlight``). Rows one block holds stay one block, on one Legion:
    the next kernel's independent blocks go to the next Legions (``take_legions``)."""
    if rows <= most:
        return rows
    rounds = -(-rows // (most * legions))
    block = -(-rows // (rounds * legions))
    full = next((d for d in range(block, most + 1) if rows % d == 0), block)
    # In a single round a shorter last block overlaps nothing anyway: full blocks only where they
    # leave no Legion more rows (a decode step's softmax, 20 heads: 7 blocks of 3, not 5 of 4)
    return block if rounds == 1 and full > block else full


def _groups(rows: int, most: int, legions: int):
    """(first row, rows per block, blocks) of each group of blocks of at most ``most`` rows.
    Rows that split evenly over the Legions go in as few rounds of ``legions`` blocks as
    ``most`` allows, the rounds differing by at most a row, so every Legion gets the same rows
    (2B4T's causal softmax at 512, 512 rows of a head in blocks of at most 10: rounds of
    10, 9, ..., 9 rows a Legion, where blocks of 10 left a round of 3 Legions and a block of 2
    rows, and three Legions held up the rest by a fifth); otherwise ``_balanced`` blocks."""
    if rows <= most or rows % legions:
        yield from _uneven(rows, _balanced(rows, most, legions), legions)
        return
    per = rows // legions
    rounds = -(-per // most)
    r0 = 0
    for k in range(rounds):
        n = per // rounds + (k < per % rounds)
        yield r0, n, legions
        r0 += n * legions


def _uneven(rows: int, block: int, legions: int):
    """Full blocks by up to ``legions``, then the last, shorter block alone."""
    full = rows // block
    for b in range(0, full, legions):
        yield b * block, block, min(legions, full - b)
    if rows % block:
        yield full * block, rows % block, 1


def dealt(rows: int, most: int, legions: int) -> int:
    """The most rows of a block of ``rows`` dealt in blocks of at most ``most`` (``_groups``):
    fewer than ``most`` where the rows spread over the Legions in fewer (K's smoothed
    quantization at 128 on dlegion-8x8: 16 rows a Legion a head, where half the scratchpad holds
    63; three blocks in flight, not two, let each head's loads go ahead of the stores of the
    head two before: the 2B4T layer at 128 210,756 -> 210,639 cycles, at 512 788,213 ->
    788,058, at 256 381,631 -> 381,680)."""
    return max(n for _, n, _ in _groups(rows, most, legions))


def _depth(em, args, strides, rows: int, cols: int, resident: _Resident, in_half: int) -> int:
    """Blocks in flight on a Legion: three where three blocks of ``in_half`` rows (as dealt),
    their outputs in place, fit the scratchpad, else two. With two, a block's stores wait in the in-order DMA
    queue for its body, and the next block's loads, which reuse its part, behind them: the queue
    idles a DRAM round trip and a body each block (2B4T BitLinear stack at 256 on dlegion-8x8:
    its first quantization, before any pass, 3,972 -> 3,342 cycles)."""
    third = (em.capacity("vec") - resident.size) // 3
    return 3 if _rows_per_block(em, args, strides, rows, cols, "", resident, third, strict=False) >= in_half else 2


def _cols_per_block(em, args, strides, cols) -> int:
    """Columns one block may hold: a row longer than the scratchpad is cut into chunks."""
    cap = em.capacity("vec")
    own = [a for a in args if a.alias is None]
    full = sum(1 for a in own if _shape_of(*strides[a.name], a.operand is None and a.col)[1])
    narrow = len(own) - full
    return max(1, min(cols, (cap - narrow) // max(full, 1), em.extent()))


def _rows_per_block(em, args, strides, rows, cols, where, resident: _Resident, cap: int | None = None,
                    strict: bool = True) -> int:
    """Rows a block of ``cap`` vector elements (default: all of them but the resident inputs')
    holds; 0 when not one row fits and not ``strict`` (else an error)."""
    cap = em.capacity("vec") - resident.size if cap is None else cap
    streamed = [a for a in args if a.name not in resident.views and a.alias is None]
    fixed = sum(_footprint(a, *strides[a.name], 0, cols) for a in streamed)
    per_row = sum(_footprint(a, *strides[a.name], 1, cols) for a in streamed) - fixed
    if fixed + per_row > cap:
        if not strict:
            return 0
        raise CompileError(f"{where}a row of {cols} elements needs {resident.size + fixed + per_row} vector "
                           f"scratchpad elements, more than the {em.capacity('vec')} a Legion has")
    return max(1, min(rows, (cap - fixed) // max(per_row, 1), em.extent()))


class _InFlight:
    """Row blocks ``depth`` at a time on each Legion: a group's loads go to one of ``depth``
    parts of the vector scratchpad, each ``part`` elements, and are issued before the body and
    stores of the group ``depth - 1`` before it, which use another part, so the next blocks load
    while the current one computes (``part`` = 0: one block at a time, the whole scratchpad).
    Only a group on the same span of Legions as the previous one overlaps it: a relative wait
    counts the same instructions on every Legion of a span only when they were all issued them."""

    def __init__(self, em: Emitter, part: int, resident: _Resident, depth: int = 2):
        self.em, self.part, self.resident, self.depth = em, part, resident, depth
        self.pending = []              # (span, what emits its body and stores) of groups loaded, oldest first
        self.turn = 0

    def add(self, args, at, strides, r0, n, count, cols, body, steps, width) -> None:
        span = (self.em.take_legions(count), count)
        if self.pending and (self.pending[-1][0] != span or not self.part):
            self.flush()
        base = self.resident.size + self.turn * self.part
        rest = _emit_group(self.em, span, base, args, at, strides, r0, n, cols, width, body, steps,
                           self.resident)
        if len(self.pending) == self.depth - 1:
            self.pending.pop(0)[1]()
        self.pending.append((span, rest))
        self.turn = (self.turn + 1) % self.depth if self.part else 0

    def flush(self) -> None:
        for _, rest in self.pending:
            rest()
        self.pending = []


class _Ring:
    """Row blocks on a ring of buffers, each as large as one block's full-width operand, when
    two whole blocks do not fit the vector scratchpad but one block and one buffer more do: the
    next block's first input loads into the spare buffer while the current block computes, its
    other inputs into the buffers the current block's body frees, and the buffers its outputs
    are computed in free once they are stored (2B4T's ReLU^2 * up, norm and quantization at
    512: rows of 6912 beside the resident norm weight, which left DRAM and the vector unit
    taking turns). Per-row operands alternate between two small areas above the ring."""

    def __init__(self, em: Emitter, resident: _Resident, rows: int, cols: int, buffers: int, per_row: int):
        self.em, self.resident, self.rows, self.cols = em, resident, rows, cols
        self.size = rows * cols
        self.columns = resident.size + buffers * self.size      # the two per-row areas
        self.per_row = per_row
        self.free = list(range(buffers))
        self.pending = None            # (span, its buffers by name, what emits its body, its stores)
        self.turn = 0

    @classmethod
    def fitting(cls, em, args, strides, rows: int, cols: int, resident: _Resident) -> "_Ring | None":
        streamed = [a for a in args if a.name not in resident.views and a.alias is None]
        kinds = [_shape_of(*strides[a.name], a.operand is None and a.col) for a in streamed]
        full = sum(1 for per_row, wide in kinds if per_row and wide)
        per_row = sum(1 for per_row, wide in kinds if per_row and not wide)
        wide = _full_args(args, strides, resident)
        inputs = [a for a in wide if a.operand is not None and not a.out]
        if not inputs or full + per_row != len(streamed):
            return None
        # The block in flight keeps the buffers its outputs are stored from (an aliased output's
        # input included) until the next block has taken the spare and, once the body ran, the
        # rest of its own: a spare for each of them.
        kept = {a.alias or a.name for a in args if a.out} & {a.name for a in wide}
        buffers = full + max(1, len(kept))
        room = em.capacity("vec") - resident.size
        n = min(rows, room // (buffers * cols + 2 * per_row), em.extent())
        if n < 1 or n >= rows:
            return None
        return cls(em, resident, n, cols, buffers, per_row)

    def add(self, args, at, strides, r0, n, count, cols, body, steps, width) -> None:
        em = self.em
        span = (em.take_legions(count), count)
        if self.pending is not None and self.pending[0] != span:
            self.flush()
        legion = span[0]
        steps = {name: (step if count > 1 else None) for name, step in steps.items()}
        full = _full_args(args, strides, self.resident)
        first = [a for a in full if a.operand is not None and not a.out][:1]
        slots = {}
        with em.spanning(legion, count):
            self._load(first, slots, at, r0, n, width, steps, legion, count)
        if self.pending is not None:
            self._body(self.pending)
        rest = [a for a in full if a not in first]
        views = self._views(args, strides, slots, rest)
        with em.spanning(legion, count):
            self._resident_loads(args, at, r0, n, width, steps, legion, count, views)
            self._load([a for a in rest if a.operand is not None and not a.out], slots, at, r0, n, width, steps,
                       legion, count, views)
        if self.pending is not None:
            self._stores(self.pending)
        loaded = em.issued.get((legion, "dma"), 0)
        self.pending = (span, slots, views, args, at, r0, n, width, body, steps, loaded)
        self.turn ^= 1

    def _views(self, args, strides, slots, rest) -> dict:
        """Every operand's view: the buffers of the full-width ones (those not loaded yet taken
        now, from the ring's free buffers), this block's per-row area, the resident inputs."""
        for a in rest:
            slots[a.name] = self._take()
        views, addr = dict(self.resident.views), self.columns + self.turn * self.per_row * self.rows
        for a in args:
            if a.name in slots:
                views[a.name] = View("vec", self.resident.size + slots[a.name] * self.size, self.cols, 1)
            elif a.name not in self.resident.views and a.alias is None:
                rs, cs = strides[a.name]
                views[a.name] = _view(addr, rs, cs, self.cols, a.operand is None and a.col)
                addr += self.rows
        views.update({a.name: views[a.alias] for a in args if a.alias is not None})
        return views

    def _take(self) -> int:
        if not self.free:
            raise CompileError("internal: a row block's ring of buffers ran out")
        return self.free.pop(0)

    def _load(self, args, slots, at, r0, n, width, steps, legion, count, views=None) -> None:
        for a in args:
            if a.name not in slots:
                slots[a.name] = self._take()
            view = views[a.name] if views else View("vec", self.resident.size + slots[a.name] * self.size, self.cols, 1)
            _load(self.em, legion, view, at[a.name], r0, n, self.cols, width, steps[a.name])

    def _resident_loads(self, args, at, r0, n, width, steps, legion, count, views) -> None:
        for a in args:
            if a.name in self.resident.views and not a.out and self.resident.wanted(a.name, legion, count):
                _load(self.em, legion, views[a.name], at[a.name], r0, n, self.cols, self.cols, steps[a.name])

    def _body(self, pending) -> None:
        span, slots, views, args, at, r0, n, width, body, steps, loaded = pending
        _compute(self.em, span, views, n, self.cols, width, body, loaded)
        stored = {a.alias or a.name for a in args if a.out}
        for name in [name for name in slots if name not in stored]:
            self.free.append(slots.pop(name))       # free once the body is done: the next loads wait for it

    def _stores(self, pending) -> None:
        span, slots, views, args, at, r0, n, width, body, steps, loaded = pending
        _store_outputs(self.em, span, args, views, at, r0, n, self.cols, width, steps)
        self.free.extend(slots.pop(name) for name in list(slots))

    def flush(self) -> None:
        if self.pending is not None:
            self._body(self.pending)
            self._stores(self.pending)
            self.pending = None


def _full_args(args, strides, resident: _Resident) -> list[Arg]:
    """The streamed operands a block holds full width, each in a buffer of its own."""
    return [a for a in args if a.name not in resident.views and a.alias is None
            and _shape_of(*strides[a.name], a.operand is None and a.col) == (True, True)]


def _emit_group(em, span, base, args, at, strides, r0, n, cols, width, body, steps, resident):
    """Load ``count`` blocks of ``n`` rows from row ``r0``, one per Legion of the span, into the
    vector scratchpad from ``base`` (the resident inputs where they are, if not held yet);
    ``steps``: the DRAM elements from one Legion's block of each operand to the next one's.
    Blocks are laid out rows of ``cols`` apart, of which the first ``width`` are loaded, computed
    and stored. Returns what emits their body and stores."""
    legion, count = span
    steps = {name: (step if count > 1 else None) for name, step in steps.items()}
    views, addr = dict(resident.views), base
    for a in args:
        if a.name not in resident.views and a.alias is None:
            rs, cs = strides[a.name]
            views[a.name] = _view(addr, rs, cs, cols, a.operand is None and a.col)
            addr += _footprint(a, rs, cs, n, cols)
    views.update({a.name: views[a.alias] for a in args if a.alias is not None})
    with em.spanning(legion, count):
        for a in args:
            if (a.operand is not None and not a.out
                    and resident.wanted(a.name, legion, count)):
                whole = a.name in resident.views        # loaded once, for every group's width
                skip = 0 if whole else lead(a, at[a.name], r0, n, count, steps[a.name], width)
                if skip:
                    views[a.name + LEAD] = skip
                if skip < width:
                    _load(em, legion, past_columns(views[a.name], skip), past_columns(at[a.name], skip), r0, n, cols,
                          (cols if whole else width) - skip, steps[a.name])
    loaded = em.issued.get((legion, "dma"), 0)

    def rest() -> None:
        _compute(em, span, views, n, cols, width, body, loaded)
        _store_outputs(em, span, args, views, at, r0, n, cols, width, steps)
    return rest


# The key of ``views`` that gives the body the leading columns of a ``const`` input it skips.
LEAD = "#lead"


def lead(arg: Arg, op: Operand, r0: int, n: int, count: int, step: int | None, width: int) -> int:
    """Leading columns of the blocks of ``count`` Legions, ``n`` rows from ``r0`` each, in
    which the constant ``arg`` holds +0.0 in every row (0 for an input that is not one)."""
    if arg.const is None or op.strides[-1] != 1 or not width:
        return 0
    rows = np.arange(count)[:, None] * (step or 0) + (r0 + np.arange(n))[None, :] * op.strides[-2]
    block = arg.const[(op.offset + rows.reshape(-1))[:, None] + np.arange(width)[None, :]]
    zero = ((block == 0) & ~np.signbit(block)).all(axis=0)
    return width if zero.all() else int(zero.argmin())


def past_columns(x, skip: int):
    """A view or operand from ``skip`` columns on."""
    if not skip:
        return x
    if isinstance(x, View):
        return replace(x, addr=x.addr + skip * x.cs)
    return replace(x, offset=x.offset + skip * x.strides[-1])


def _compute(em, span, views, n, cols, width, body, loaded: int) -> None:
    """The body of ``span``'s blocks, once the DMA queue has ``loaded`` their inputs; their
    stores wait for it."""
    legion, count = span
    with em.spanning(legion, count):
        em.depend((legion, "dma"), (legion, "vec"), upto=loaded)
        first = len(em.instrs)
        body(em, legion, views, n, width)
        if width < cols:
            em.skipped["causal_skipped_vector_ops"] += count * _left_out(em, em.instrs[first:], legion, views,
                                                                         n, cols, body)
        em.depend((legion, "vec"), (legion, "dma"))


def _store_outputs(em, span, args, views, at, r0, n, cols, width, steps) -> None:
    legion, count = span
    with em.spanning(legion, count):
        for a in args:
            if a.out:
                _store(em, legion, views[a.name], at[a.name], r0, n, cols, width, steps[a.name])


def _left_out(em: Emitter, emitted: list, legion: int, views: dict, rows: int, cols: int, body: Body) -> int:
    """Lane operations the body would have taken over all ``cols`` columns beyond what the
    narrower ``emitted`` takes (for the report)."""
    def ops(instrs) -> int:
        return sum(cost(i, em.arch, None).counters.get("vector_ops", 0) for i in instrs)
    whole = _Recorder(em)
    body(whole, legion, views, rows, cols)
    return ops(whole.instrs) - ops(emitted)


class _Recorder:
    """An emitter that only records what a body emits (the same body at another width)."""

    def __init__(self, em: Emitter):
        self.arch, self.instrs = em.arch, []

    def emit(self, instr) -> None:
        self.instrs.append(instr)


def _dram(op: Operand, r0: int, per_row: bool) -> DramRef:
    rs = op.strides[-2]
    return DramRef(op.tensor, op.offset + (r0 * rs if per_row else 0), rs if per_row else 0)


def _check_cols(op: Operand) -> None:
    if op.strides[-1] not in (0, 1):
        raise CompileError(f"internal: operand with column stride {op.strides[-1]} reached a row kernel")


def _load(em, legion, view: View, op: Operand, r0, n, cols, width, lstride) -> None:
    _check_cols(op)
    per_row, full = op.strides[-2] != 0, op.strides[-1] != 0
    dst = View("vec", view.addr, cols if full else 1, 1)
    em.emit(DmaLoad(legion, frozenset({legion}), dst, _dram(op, r0, per_row),
                    n if per_row else 1, width if full else 1, lstride=lstride))


def _store(em, legion, view: View, op: Operand, r0, n, cols, width, lstride) -> None:
    if op.strides[-2] == 1 and op.strides[-1] > 1:
        _store_transposed(em, legion, view, op, r0, n, cols, width, lstride)
        return
    _check_cols(op)
    full = op.strides[-1] != 0
    src = View("vec", view.addr, cols if full else 1, 1)
    em.emit(DmaStore(legion, _dram(op, r0, True), src, n, width if full else 1, lstride=lstride))


def _store_transposed(em, legion, view: View, op: Operand, r0, n, cols, width, lstride) -> None:
    """A block's columns stored as rows of an output laid out transposed (rows consecutive in
    DRAM): the scratchpad read down its columns, DRAM written along its rows, the same bytes as
    a row store (K's int8 codes where the arrays read them, ``reduce.smooth_absmax_quantize``)."""
    src = View("vec", view.addr, 1, cols)
    em.emit(DmaStore(legion, DramRef(op.tensor, op.offset + r0, op.strides[-1]), src, width, n, lstride=lstride))
