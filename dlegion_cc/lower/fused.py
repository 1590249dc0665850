"""Lowering ``dlegion.RowKernel``: a fused run of row-local ops over one row frame.

Each value of the run lives in a scratchpad *slot* of its shape kind (a full row or one value
per row). Slots are reused once their value is dead, and an op may write over an input that
dies at that op, so a long chain needs only a few slots and blocks hold many rows.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from isa.fields import View
from isa.instructions import BY_MNEMONIC, VSelect
from dlegion_cc.ir import DLEGION, Node
from dlegion_cc.lower.context import Lowering, lowers
from dlegion_cc.lower.elementwise import BINARY, UNARY, squares
from dlegion_cc.lower.layout import Operand, broadcast, reshaped
from dlegion_cc.lower.rowwise import LEAD, Arg, past_columns, rowwise
from dlegion_cc.passes.fuse import ROW_REDUCE, Frame, shape_kind
from dlegion_cc.lower.reduce import REDUCE

NO_IN_PLACE = {"Where"}      # its first step overwrites the output before reading cond and x


def _frame_operand(op: Operand, shape: tuple, kind: str, frame: Frame) -> Operand | None:
    """``op``, a value of ``shape`` (a strided view, maybe), walked in the frame's N-D shape;
    None when strides cannot say it."""
    if kind == "tiled":
        return broadcast(op, shape, frame.shape)
    last = op.strides[-1] if shape and kind in ("full", "row") else 0
    if kind in ("row", "scalar"):
        return Operand(op.tensor, op.offset, (0,) * (len(frame.shape) - 1) + (last,))
    lead = reshaped(Operand(op.tensor, op.offset, op.strides[:-1]), shape[:-1], frame.shape[:-1])
    return None if lead is None else Operand(op.tensor, op.offset, lead.strides + (last,))


def frame_view(node: Node, name: str, op: Operand) -> bool:
    """Whether the kernel reads input ``name`` from view ``op``: in rows of its frame."""
    frame, shape = node.attrs["frame"], node.attrs["values"][name].shape
    kind = shape_kind(shape, frame, tiled=True)
    framed = _frame_operand(op, shape, kind, frame) if kind else None
    return framed is not None and framed.strides[-1] in (0, 1)


class _Slots:
    """Scratchpad slots by kind, handed out and taken back as values live and die."""

    def __init__(self):
        self.free: dict[str, list[str]] = {"full": [], "col": []}
        self.temps: list[Arg] = []

    def take(self, kind: str) -> str:
        if self.free[kind]:
            return self.free[kind].pop()
        name = f"#t{len(self.temps)}"
        self.temps.append(Arg(name, col=(kind == "col")))
        return name

    def reuse(self, value: str) -> str:
        """A free full-width slot (of an input or temp that died: a block of full rows, laid out
        as the output's), else ``value``'s own."""
        return self.free["full"].pop() if self.free["full"] else value

    def give(self, kind: str, slot: str) -> None:
        self.free[kind].append(slot)


def _plan(node: Node, kinds: dict, scalars: dict, inputs: set, outputs: set, split: bool) -> tuple[dict, list[Arg]]:
    """Slot of every value: inputs have their own; the rest share temps, and a full-width
    output takes the temp of a value that died making it, when there is one (``in_place``).
    With ``split``, each row sum has a column temp for its runs (``split_sum``)."""
    subs = node.attrs["nodes"]
    last = {}
    for k, n in enumerate(subs):
        for i in n.inputs:
            last[i] = k
    slot = {v: v for v in inputs | outputs if v not in scalars}
    slots = _Slots()
    for k, n in enumerate(subs):
        dying = [i for i in dict.fromkeys(n.inputs) if last.get(i) == k and i in slot
                 and i not in outputs and kinds.get(i) in ("full", "col")]
        if n.op not in NO_IN_PLACE:
            for i in dying:
                slots.give(kinds[i], slot[i])
        for o in n.outputs:
            if o not in outputs:
                slot[o] = slots.take(kinds[o])
            elif n.op not in NO_IN_PLACE and kinds.get(o) == "full":
                slot[o] = slots.reuse(o)
        if n.op in NO_IN_PLACE:
            for i in dying:
                slots.give(kinds[i], slot[i])
        if n.op == "Softmax":
            slot[n.outputs[0] + "#stat"] = slots.take("col")
        if split and n.op in ("Softmax", "ReduceSum"):
            slot[n.outputs[0] + "#sum"] = slots.take("col")
    return slot, slots.temps


@lowers("RowKernel", domain=DLEGION, views=frame_view, writes=frame_view)
def row_kernel(low: Lowering, node) -> None:
    for _ in row_kernel_blocks(low, node):
        pass


def row_kernel_blocks(low: Lowering, node, blocks: list[range] | None = None, resumed: bool = False):
    """``row_kernel``, a generator that emits the frame rows of each of ``blocks`` in turn (all
    of them when None; blocks need no causal reach, and cut the frame's second last axis: of
    each matrix of a frame with leading dimensions, as a rotary's heads) and yields after each
    (``rowblocks.py``); ``resumed``: the outputs are where earlier blocks wrote them."""
    frame = node.attrs["frame"]
    args, body, keep, reach, where = _kernel(low, node, resumed)
    if blocks is None:
        rowwise(low.em, frame.shape, args, body, keep_last=keep, where=where, reach=reach)
        return
    if reach is not None:
        raise ValueError(f"{where}row blocks of a frame {list(frame.shape)} with a causal reach")
    lead = frame.shape[:-2] if math.prod(frame.shape[:-2]) != 1 else ()
    for j, rows in enumerate(blocks):
        if j:
            low.em.barrier()    # each block's rows reuse the scratchpad of the one before
        shifted = [a if a.operand is None else replace(a, operand=_rows_from(a.operand, rows.start, len(lead)))
                   for a in args]
        rowwise(low.em, (*lead, len(rows), frame.shape[-1]), shifted, body, keep_last=keep, where=where)
        yield rows


def _kernel(low: Lowering, node, resumed: bool = False) -> tuple:
    """(arguments, body, whether rows are kept whole, causal reach, error prefix) of a row
    kernel; ``resumed``: its outputs are where earlier blocks wrote them."""
    frame, values = node.attrs["frame"], node.attrs["values"]
    kinds, scalars, ins = _kinds(node)
    reach = _reach(node, frame)
    slot, temps = _plan(node, kinds, scalars, set(ins), set(node.outputs), reach is not None)
    skips = _zero_lead_adds(low, node, slot, kinds, ins)
    args = [Arg(n, _frame_operand(low.operand(n), values[n].shape, kinds[n], frame), const=skips.get(n, (None,))[-1])
            for n in ins]
    args += [Arg(n, _frame_operand(low.operands[n] if resumed else low.result(n), values[n].shape, kinds[n], frame), out=True,
                 alias=slot[n] if slot.get(n, n) != n else None) for n in node.outputs]
    args += temps
    widths = {n: (frame.cols if kinds.get(n) in ("full", "row") else 1) for n in values}
    idle = identity_clips(node.attrs["nodes"], scalars)

    def body(em, legion, views, rows, cols):
        view = {v: views[s] for v, s in slot.items()}
        for n in node.attrs["nodes"]:
            if n.outputs[0] in idle:
                _moved(em, legion, view[n.outputs[0]], view[n.inputs[0]], rows, cols)
                continue
            skip = max((views.get(i + LEAD, 0) for i in n.inputs if skips.get(i, (None,))[0] is n), default=0)
            if skip:            # the columns a constant holds +0.0 in keep the other input (in place)
                if skip < cols:
                    shifted = {v: past_columns(x, skip) if isinstance(x, View) and x.cs else x for v, x in view.items()}
                    emit_op(em, legion, n, shifted, scalars, rows, cols - skip, cols - skip, frame.cols)
                continue
            emit_op(em, legion, n, view, scalars, rows, cols, cols if widths[n.outputs[0]] > 1 else 1, frame.cols)
    keep = any(k in ("col", "row") for k in kinds.values()) or any(
        n.op in ROW_REDUCE or n.op == "Softmax" for n in node.attrs["nodes"])
    where = f"node '{node.name}': "
    return args, body, keep, reach, where


def _zero_lead_adds(low: Lowering, node, slot: dict, kinds: dict, ins: list) -> dict:
    """Constant inputs (a causal mask) that only an Add reads, in place over its other input,
    whose result's zeros may change sign unseen (``_sign_free``): by input, (that Add, the
    constant's values flat). Where a block's rows of one hold +0.0 from its first column, the
    Add and the load leave those columns out (``rowwise.lead``): x + 0.0 is x but for x = -0.0."""
    subs, out = node.attrs["nodes"], {}
    for n in subs if low.switches.sparsity else ():
        if n.op != "Add" or len(set(n.inputs)) != 2 or n.outputs[0] in node.outputs:
            continue
        for c, x in (n.inputs, n.inputs[::-1]):
            stored = low.graph.stored(c) if c in ins and kinds.get(c) in ("full", "tiled") else None
            if (stored is None or sum(c in m.inputs for m in subs) != 1 or x not in slot
                    or [v for v, s in slot.items() if s == slot[c]] != [c] or slot[x] != slot[n.outputs[0]]
                    or not _sign_free(subs, n.outputs[0], node.outputs)):
                continue
            out[c] = (n, np.ascontiguousarray(stored, dtype=np.float32).reshape(-1))
    return out


def _sign_free(subs: list, value: str, outputs: list) -> bool:
    """Whether the sign of a zero of ``value`` changes no result of the kernel: it is read by
    ReduceMax (whose result is so too) and by Sub whose result only Exp reads (exp(-0) = exp(0))."""
    if value in outputs:
        return False
    for m in (m for m in subs if value in m.inputs):
        after = [r for r in subs if m.outputs[0] in r.inputs]
        if m.op == "ReduceMax" and _sign_free(subs, m.outputs[0], outputs):
            continue
        if m.op == "Sub" and after and all(r.op == "Exp" for r in after) and m.outputs[0] not in outputs:
            continue
        return False
    return True


def head_axis(node) -> int | None:
    """The one leading axis of a row kernel's frame longer than 1 (attention's heads), None
    when there is not exactly one."""
    lead = [d for d, n in enumerate(node.attrs["frame"].shape[:-2]) if n > 1]
    return lead[0] if len(lead) == 1 else None


def row_kernel_heads(low: Lowering, node, groups: list[range]):
    """``row_kernel`` over the frame's matrices (its ``head_axis``) of each of ``groups`` in
    turn, yielding after each (``heads.py``): each group is the kernel over the part of the
    frame, its operands' views starting at the group's first matrix (a broadcast one stays)."""
    frame, axis = node.attrs["frame"], head_axis(node)
    args, body, keep, reach, where = _kernel(low, node)
    for j, group in enumerate(groups):
        if j:
            low.em.barrier()    # each group's rows reuse the scratchpad of the one before
        shape = frame.shape[:axis] + (len(group),) + frame.shape[axis + 1:]
        part = [a if a.operand is None else replace(a, operand=_from_matrix(a.operand, axis, group.start)) for a in args]
        cut = None if reach is None else np.take(reach, list(group), axis=axis)
        rowwise(low.em, shape, part, body, keep_last=keep, where=where, reach=cut)
        yield group


def _from_matrix(op: Operand, axis: int, first: int) -> Operand:
    return replace(op, offset=op.offset + first * op.strides[axis])


def _kinds(node) -> tuple[dict, dict, list[str]]:
    """The shape kind of each value of a row kernel, its constant scalars, and the inputs it
    loads."""
    frame, values = node.attrs["frame"], node.attrs["values"]
    # A tiled input may come in as one row broadcast over the block: its slot is never reused.
    kinds = {n: shape_kind(v.shape, frame, tiled=True) for n, v in values.items()}
    scalars = {n: float(np.float32(v.const.reshape(()))) for n, v in values.items()
               if v.const is not None and v.const.size == 1 and n not in _read_as_views(node)}
    # A scalar the kernel computes (a reduction of a row every block reads alike, as Attention-23's
    # test for an all-masked row at one query) is held as a column: the same value in every row.
    kinds = {n: "col" if k == "scalar" and n not in scalars and n not in node.inputs else k for n, k in kinds.items()}
    return kinds, scalars, [n for n in node.inputs if n not in scalars]


def row_kernel_width(node) -> int:
    """Vector elements one frame row of a row kernel holds at once, at most: a row of each
    loaded input, output not computed in place and full temp, one element of each column (what
    ``rowwise`` needs for one row of a block; ``rowblocks`` leaves it beside a matmul)."""
    kinds, scalars, ins = _kinds(node)
    slot, temps = _plan(node, kinds, scalars, set(ins), set(node.outputs), _reach(node, node.attrs["frame"]) is not None)
    cols = node.attrs["frame"].cols
    # An output computed in place lies in the slot of the value it replaced: no row of its own.
    own = ins + [n for n in node.outputs if slot.get(n, n) == n]
    return (sum(cols if kinds.get(n) in ("full", "row") else 1 for n in own)
            + sum(1 if t.col else cols for t in temps))


def _rows_from(op: Operand, r0: int, lead: int = 0) -> Operand:
    """``op`` (framed: its last two strides walk rows and columns) from frame row ``r0`` on,
    keeping the strides of its ``lead`` leading axes (of every matrix of the frame)."""
    row = op.strides[-2] if len(op.strides) > 1 else 0
    kept = op.strides[-2 - lead:] if len(op.strides) > 1 else op.strides
    return Operand(op.tensor, op.offset + r0 * row, kept)


def _moved(em, legion: int, out, src, rows: int, cols: int) -> None:
    """A value that is its input unchanged: nothing to do in place, else a copy."""
    if out != src:
        em.emit(BY_MNEMONIC["vmov"](legion, out, src, rows, cols))


# The largest integer K for which Round(x * K / m), |x| <= m, stays within [-K, K] in fp32:
# x * fl(fl(1 / m) * K) is at most K (1 + 2^-24)^3, which must stay below K + 1/2, when m is
# at least SMALLEST_MAX (1 / m and K / m then are normal numbers, each rounded to within 2^-24).
ROUNDED_BOUND = 1 << 20
SMALLEST_MAX = 2.0 ** -100


def identity_clips(nodes: list[Node], scalars: dict) -> set[str]:
    """Outputs of the kernel's Clips proven to change no value: the clip of a rounded absmax
    quantization (``Round(x * (K / max|x|))``, within [-K, K]) or of a quantized softmax
    (``Round(Exp(x - max x) * K)``, within [0, K]) to bounds that hold that range. A NaN passes
    a Clip as it is (``vmax``/``vmin`` propagate it), so every value is the same without it."""
    made = {o: n for n in nodes for o in n.outputs}
    out = set()
    for n in nodes:
        lo, hi = _clip_bounds(n, scalars)
        if hi is None:
            continue
        if n.attrs.get("within") == (lo, hi):     # a pass proved its input within the bounds
            out.add(n.outputs[0])
            continue
        rounded = made.get(n.inputs[0])
        if rounded is None or rounded.op != "Round":
            continue
        r = _rounded_range(made, rounded.inputs[0], scalars)
        if r is not None and lo <= r[0] and r[1] <= hi:
            out.add(n.outputs[0])
    return out


def _clip_bounds(n: Node, scalars: dict) -> tuple:
    """(lo, hi) of a Clip whose bounds are constants (a missing one is infinite), else (None, None)."""
    if n.op != "Clip":
        return None, None
    names = (n.inputs + ["", ""])[1:3]
    if any(name and name not in scalars for name in names):
        return None, None
    lo, hi = (scalars[name] if name else default for name, default in zip(names, (-np.inf, np.inf)))
    return lo, hi


def _scaled(made: dict, value: str, scalars: dict) -> tuple:
    """(x, K) when ``value`` is a product x * K of a value and an integer constant 0 < K <=
    ROUNDED_BOUND, in either order; else (None, None)."""
    n = made.get(value)
    if n is None or n.op != "Mul":
        return None, None
    for x, k in (n.inputs, n.inputs[::-1]):
        K = scalars.get(k)
        if K is not None and x not in scalars and float(K).is_integer() and 0 < K <= ROUNDED_BOUND:
            return x, K
    return None, None


def _rounded_range(made: dict, value: str, scalars: dict) -> tuple | None:
    """The range of Round(value) when ``value`` is a quantized softmax's or absmax's product."""
    e, K = _scaled(made, value, scalars)
    if e is not None and _unit_exp(made, e):
        return 0.0, K                  # 0 <= exp(x - max x) <= 1, so 0 <= fl(e K) <= K
    n = made.get(value)
    if n is None or n.op != "Mul":
        return None
    for x, s in (n.inputs, n.inputs[::-1]):
        r, K = _scaled(made, s, scalars)
        if r is not None and _over_absmax(made, r, x, scalars):
            return -K, K
    return None


def _unit_exp(made: dict, e: str) -> bool:
    """Whether ``e`` is Exp(x - ReduceMax(x)) over the row: at most 1."""
    n = made.get(e)
    d = made.get(n.inputs[0]) if n is not None and n.op == "Exp" else None
    m = made.get(d.inputs[1]) if d is not None and d.op == "Sub" else None
    return m is not None and m.op == "ReduceMax" and m.inputs[0] == d.inputs[0]


def _over_absmax(made: dict, r: str, x: str, scalars: dict) -> bool:
    """Whether ``r`` is Reciprocal(c) with c = max(ReduceMax(Abs(x)), lo) over the row, lo at
    least SMALLEST_MAX (a Clip with no upper bound)."""
    n = made.get(r)
    c = made.get(n.inputs[0]) if n is not None and n.op == "Reciprocal" else None
    lo, hi = _clip_bounds(c, scalars) if c is not None else (None, None)
    if hi != np.inf or lo < SMALLEST_MAX:
        return False
    m = made.get(c.inputs[0])
    a = made.get(m.inputs[0]) if m is not None and m.op == "ReduceMax" else None
    return a is not None and a.op == "Abs" and a.inputs[0] == x


def _read_as_views(node: Node) -> set[str]:
    """Constants in a place no instruction takes an immediate: the first operand of a binary op
    that cannot swap its operands (``1 / x``, ``2 ** x``), a Where's condition. They are loaded
    like any input, broadcast by 0 strides: making them in a slot from the other operand
    (``b * 0 + c``) is NaN where b is infinite, and overwrites b where the op works in place."""
    return {n.inputs[0] for n in node.attrs["nodes"]
            if n.op == "Where" or _family(n.op) == "binary" and n.op not in SWAPPED and n.op != "Sub"}


def _reach(node: Node, frame: Frame) -> np.ndarray | None:
    """How many leading columns each row of the frame needs, when the kernel ends in a causal
    softmax (``passes/causal.py``) that is its one output, after elementwise ops only: the
    columns beyond a row's reach are P's exact zeros, which stay zeros in DRAM. Each reach is
    widened to where a row sum adds the same as over the whole row (``split_width``)."""
    subs = node.attrs["nodes"]
    last = subs[-1]
    if last.op != "Softmax" or "reach" not in last.attrs:
        return _quantized_reach(node, frame)
    if node.outputs != last.outputs or any(_family(n.op) not in ("unary", "binary") for n in subs[:-1]):
        return None
    return _widened(last.attrs["reach"], frame)


def _quantized_reach(node: Node, frame: Frame) -> np.ndarray | None:
    """The reach of a kernel that quantizes a causal softmax (``passes/attention.py``): its
    full-width outputs are the quantized P (in one or two int8 pieces, each marked with the same
    reach), whose row maximum and sum, marked ``softmax_part``, see past each row's reach only
    the mask's exact zeros of exp; its other outputs are per row."""
    subs = node.attrs["nodes"]
    marked = [n for n in subs if "reach" in n.attrs]
    if not marked or any(not np.array_equal(n.attrs["reach"], marked[0].attrs["reach"]) for n in marked):
        return None
    full = [o for o in node.outputs if shape_kind(node.attrs["values"][o].shape, frame) == "full"]
    if full != [n.outputs[0] for n in marked]:
        return None
    if any(_family(n.op) not in ("unary", "binary", "Clip") and not n.attrs.get("softmax_part") for n in subs):
        return None
    return _widened(marked[0].attrs["reach"], frame)


def _widened(reach: np.ndarray, frame: Frame) -> np.ndarray | None:
    if frame.shape[-2:] != (reach.size, frame.cols):
        return None
    widths = np.array([split_width(frame.cols, int(r)) for r in reach])
    return np.broadcast_to(widths, frame.shape[:-1])


# numpy's pairwise summation, which ``vrsum`` follows: runs of at most this many elements are
# summed in 8 interleaved partial sums; longer ones are split in two halves, each a multiple of 8.
PAIRWISE_BLOCK = 8 * 16


def _half(n: int) -> int:
    return n // 2 - n // 2 % 8


def split_width(n: int, need: int) -> int:
    """The fewest leading columns, at least ``need``, whose ``split_sum`` adds up bit for bit
    as ``vrsum`` adds all ``n`` when the others are zeros: at each split of the pairwise sum the
    first half whole where ``need`` passes it, and in the run where ``need`` falls, whole
    groups of 8 (at least one). A causal row past half the sequence runs to its reach rounded
    to 8, not to the whole row (2B4T at 512: the softmax's elements -13%)."""
    if need >= n:
        return n
    if n > PAIRWISE_BLOCK:
        half = _half(n)
        return split_width(half, need) if need <= half else half + split_width(n - half, need - half)
    width = max(8, -(-need // 8) * 8)
    return width if width <= n - n % 8 else n


def split_parts(n: int, width: int) -> list[tuple[int, int]]:
    """The runs (first column, columns) whose ``vrsum``s, added from the last, give numpy's
    pairwise sum of a row of ``n`` that is zero past ``width`` (a ``split_width``): the pairwise
    sum of a row longer than PAIRWISE_BLOCK is that of its first half plus that of the rest."""
    if width >= n or n <= PAIRWISE_BLOCK:
        return [(0, min(width, n))]
    half = _half(n)
    if width <= half:
        return split_parts(half, width)         # the rest adds a sum of zeros: +0
    return [(0, half)] + [(half + c, w) for c, w in split_parts(n - half, width - half)]


def split_sum(em, legion: int, out, x, tmp, rows: int, n: int, width: int) -> None:
    """``out`` = the sum of each row of ``x`` as ``vrsum`` over all ``n`` columns gives it, from
    its first ``width`` (``split_width``): one ``vrsum`` a run, the first run's sum added last,
    through one column temp ``tmp``."""
    parts = split_parts(n, width)
    c, w = parts[-1]
    em.emit(BY_MNEMONIC["vrsum"](legion, out, _shifted(x, c), rows, w))
    for c, w in reversed(parts[:-1]):
        em.emit(BY_MNEMONIC["vrsum"](legion, tmp, _shifted(x, c), rows, w))
        em.emit(BY_MNEMONIC["vadd"](legion, out, tmp, out, rows, 1))


def _shifted(view, cols: int):
    return replace(view, addr=view.addr + cols * view.cs) if cols else view


def emit_op(em, legion: int, n: Node, view: dict, scalars: dict, rows: int, width: int, cols: int,
            whole: int) -> None:
    """The vector instructions of one row-local node on scratchpad views: ``width`` is the row
    length of the block, ``cols`` that of the node's output (1 for a column), ``whole`` that of
    the frame (a causal block runs narrower)."""
    out = view[n.outputs[0]]

    def arg(name):
        return scalars[name] if name in scalars else view[name]

    def row_sum(dst, x):
        if width < whole:
            split_sum(em, legion, dst, x, view[n.outputs[0] + "#sum"], rows, whole, width)
        else:
            em.emit(BY_MNEMONIC["vrsum"](legion, dst, x, rows, width))
    if n.op in REDUCE:
        _reduce(em, legion, n, out, arg, rows, width, row_sum)
        return
    if n.op == "Softmax":
        _softmax(em, legion, n, out, arg, rows, cols, row_sum)
        return
    OPS[_family(n.op)](em, legion, n, out, arg, rows, cols)


def _family(op: str) -> str:
    if op in UNARY:
        return "unary"
    if op in BINARY:
        return "binary"
    return op


def _unary(em, l, n, out, arg, rows, cols):
    em.emit(BY_MNEMONIC[UNARY[n.op]](l, out, arg(n.inputs[0]), rows, cols))


# An immediate can only be the second operand: ops that allow it swap, flipping comparisons.
SWAPPED = {"Add": "Add", "Mul": "Mul", "Max": "Max", "Min": "Min", "Equal": "Equal", "And": "And",
           "Or": "Or", "Less": "Greater", "Greater": "Less", "LessOrEqual": "GreaterOrEqual",
           "GreaterOrEqual": "LessOrEqual"}


def _binary(em, l, n, out, arg, rows, cols):
    op, a, b = n.op, arg(n.inputs[0]), arg(n.inputs[1])
    if squares(op, b) and not isinstance(a, float):
        op, b = "Mul", a
    elif isinstance(a, float) and op in SWAPPED:
        op, a, b = SWAPPED[op], b, a
    elif isinstance(a, float) and op == "Sub":            # a - b = -(b - a), exactly
        em.emit(BY_MNEMONIC["vsub"](l, out, b, a, rows, cols))
        em.emit(BY_MNEMONIC["vneg"](l, out, out, rows, cols))
        return
    em.emit(BY_MNEMONIC[BINARY[op]](l, out, a, b, rows, cols))


def _reduce(em, l, n, out, arg, rows, width, row_sum):
    if n.op == "ReduceSum":
        row_sum(out, arg(n.inputs[0]))
    else:
        em.emit(BY_MNEMONIC[REDUCE[n.op]](l, out, arg(n.inputs[0]), rows, width))
    if n.op == "ReduceMean":
        em.emit(BY_MNEMONIC["vdiv"](l, out, out, float(width), rows, 1))


def _softmax(em, l, n, out, arg, rows, cols, row_sum):
    x, stat = arg(n.inputs[0]), arg(n.outputs[0] + "#stat")
    em.emit(BY_MNEMONIC["vrmax"](l, stat, x, rows, cols))
    em.emit(BY_MNEMONIC["vsub"](l, out, x, stat, rows, cols))
    em.emit(BY_MNEMONIC["vexp"](l, out, out, rows, cols))
    row_sum(stat, out)
    em.emit(BY_MNEMONIC["vdiv"](l, out, out, stat, rows, cols))


def _clip(em, l, n, out, arg, rows, cols):
    x, lo, hi = (n.inputs + ["", ""])[:3]
    src = arg(x)
    for name, mnemonic in ((lo, "vmax"), (hi, "vmin")):
        if name:
            em.emit(BY_MNEMONIC[mnemonic](l, out, src, arg(name), rows, cols))
            src = out
    if src is not out:
        em.emit(BY_MNEMONIC["vmov"](l, out, src, rows, cols))


def _where(em, l, n, out, arg, rows, cols):
    cond, x, y = (arg(i) for i in n.inputs)
    if isinstance(y, float):
        em.emit(BY_MNEMONIC["vmul"](l, out, cond, 0.0, rows, cols))
        em.emit(BY_MNEMONIC["vadd"](l, out, out, y, rows, cols))
    else:
        em.emit(BY_MNEMONIC["vmov"](l, out, y, rows, cols))
    em.emit(VSelect(l, out, cond, x, rows, cols))


def _cast(em, l, n, out, arg, rows, cols):
    x = arg(n.inputs[0])
    em.emit(BY_MNEMONIC["vmov"](l, out, x, rows, cols))


OPS = {"unary": _unary, "binary": _binary, "Clip": _clip,
       "Where": _where, "Cast": _cast}
