"""Row blocks pipelined across nodes: the vector work of one row block runs while the arrays
multiply the next.

A row kernel after a quantized matmul needs whole rows of its output (an absmax over every
column), which a matmul that streams all its rows through each weight tile finishes only at
its end; with a barrier after every node the arrays then idle while the vector unit works.
A *chain* is a run of quantized matmuls and row kernels over the same M rows, each reading
rows of the ones before it only as the same rows (norm, quantize, matmul, ReLU^2 * up and
quantize, matmul, residual). Its rows are cut into a few blocks and the nodes emitted so
that one block's row kernels come before the next block of the matmul before them:

    R(0) R(1) | Q(0) S(0) R(2) Q(1) S(1) Q(2) S(2) | T(0) U(0) T(1) U(1) T(2) U(2)

(row kernels before the first matmul first, then each matmul with the row kernels after
it, block by block; one row kernel before the first matmul, a norm, runs its block b + 1
right before the matmul's block b). Each matmul block is merged with the row kernel blocks
right before it (Q(1) with S(0) and R(2)). The queues of a Legion run in order, so the vector
queue then drains block 0, computes S(0) and drains block 1 while the arrays multiply block 1. The barriers
between the steps are replaced by the waits that keep them ordered (``overlap.py``'s rewrite
of the chain alone), which the race check proves. A step's first loads go ahead of the last
pass of the step before it (``_hoisted``). Each matmul re-reads its weights once per block:
``blocks`` weighs that against the vector work hidden.
"""
from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import fields, replace

import numpy as np

from isa.arch import MODE_BITS, Arch
from isa.fields import View
from isa.instructions import Barrier, DmaLoad, DmaStore, MatMul, NocMove, Wait
from isa.program import Program
from dlegion_cc.errors import CompileError
from dlegion_cc.ir import Node
from dlegion_cc.lower import carry
from dlegion_cc.lower.context import Lowering
from dlegion_cc.lower.fused import row_kernel_blocks, row_kernel_width
from dlegion_cc.lower.layout import whole
from dlegion_cc.lower.overlap import _Rewrite, _span, _targets, accesses, footprint, reused
from dlegion_cc.lower.qmatmul import GATED_STEPS, gated_cut, mode_for, pick_mode, qmatmul_blocks
from dlegion_cc.lower.tails import MATMUL, ROWS, causal, kernel_rooms, split_tail, tail_of, with_tails

MOST_BLOCKS = 4
# The matmuls of a chain plan in the first 1 / VEC_SHARE of ``vec``; the row kernels
# interleaved with them run in the rest.
VEC_SHARE = 2
# A matmul leaves a wide row kernel before it all of ``vec`` but a row of the kernel, down to
# 1 / LEAST_VEC_SHARE of it: a kernel that does not fit beside the matmul's drains runs after it,
# and the next block of the matmul waits for it in the in-order DMA queue (2B4T layer at
# sequence 512 on dlegion-8x8: ReLU^2 * up needs 27,650 elements of 32,768, the gate/up
# matmul's drains took 8,640).
LEAST_VEC_SHARE = 8
# The fewest rows of a block: below, each block's fill, drain and DRAM round trips cost more
# than the vector work hidden (2B4T layer at sequence 128 on dlegion-8x8, in blocks of 64 rows:
# 282,391 cycles instead of 269,811; at 256 the cost model took blocks of 64: 409,544 -> 471,628).
# A chain too short for two such blocks may take two of half as many rows, where it would
# otherwise hide nothing (the layer at 128: 255,519 -> 240,012 cycles).
FEWEST_ROWS = 128
# A row kernel merged with a matmul step ends before the step's last this many passes (2B4T
# BitLinear stack at 256 on dlegion-8x8: 2 passes 291,747 cycles, 3 291,186, 4 291,170).
KERNEL_AHEAD = 3
# A row kernel merged with a matmul step starts at the step's pass this many passes in (from
# 0): its first loads read the rows the step before stores last, after its last drain, and in
# the in-order DMA queue ahead of the step's own first loads they held those back, the arrays
# idle (2B4T BitLinear stack at 256 on dlegion-8x8: 0 288,547 cycles, 4 287,002, 7 286,172,
# 8 286,082, 9 286,384, 24 285,770; the layer at 128 240,715 -> 233,516 with 8, 245,983 with 24).
# A step with fewer passes starts it at most half-way through those before its last
# ``KERNEL_AHEAD``, so that it spreads over half of them at least (the layer at 128, whose o_proj
# blocks take 15 passes a Legion: 221,133 -> 219,993 cycles; starting a third of the way in,
# 219,898, but with every step capped at a quarter, 225,811).
KERNEL_BEHIND = 8
# A step's loads for each Legion's first passes up to this one (from 0) go ahead of the last pass of the
# step before it (``_hoisted``; the same stack, its row blocks forwarding with 4 spare activation
# slots, ``qplan.CHAIN_SPARE_SLOTS``: 0 291,997 cycles, 1 290,582, 2 289,605, 3 288,794, 4 289,093;
# since its down_proj was cut by columns, 3 281,026, 4 280,498, 5 280,376, 6 280,708; with 5 the
# layer at 256 384,312 -> 383,712, at 512 789,914 -> 789,036, at 128 212,170 -> 212,142).
HOISTED_PASSES = 5
# A chain of blocks of fewer rows than this puts each step's loads ahead of its stores
# (``_loads_ahead``): a pass of 64 rows takes 80 cycles, against a load's DRAM round trip of some 300,
# so its next loads must not wait for the stores before them (2B4T layer on dlegion-8x8 at 128: 211,864
# -> 211,093 cycles; in the blocks of 128 rows at 256 and 512, 384,132 -> 385,676 and 789,914 -> 793,550).
LOADS_AHEAD_ROWS = FEWEST_ROWS
# The row kernel steps at most merged with the matmul step after them: the kernel of the matmul
# before's block and the next block of the kernel before the matmul, or that one and the block
# before of a chain's tail kernels.
MOST_MERGED = 3


def plan(low: Lowering, nodes: list[Node], at: int) -> tuple[list[Node], list[range]]:
    """The chain starting at ``nodes[at]`` and its row blocks; no nodes when there is no chain
    or one block is best."""
    chain = chain_at(low, nodes, at)
    if not chain:
        return [], []
    arch, M = low.em.arch, _rows(low, chain[0])
    count = blocks(arch, chain, M)
    return (chain + tail_of(low, nodes, at + len(chain), chain, M), split(M, count, arch.array)) if count > 1 else ([], [])


def chain_at(low: Lowering, nodes: list[Node], at: int) -> list[Node]:
    """The chain starting at ``nodes[at]`` (empty when there is none): the longest run of
    matmuls and row kernels over the same rows, each but the first reading an output of the
    run, with at least one matmul and one row kernel."""
    rows = _rows(low, nodes[at])
    if rows is None:
        return []
    chain, made = [nodes[at]], set(nodes[at].outputs)
    for node in nodes[at + 1:]:
        if _rows(low, node) != rows or not made & set(node.inputs) or carry.pending(low, node):
            break
        chain.append(node)
        made |= set(node.outputs)
    kinds = {(n.domain, n.op) for n in chain}
    if carry.pending(low, chain[0]) or kinds != {MATMUL, ROWS}:
        return []
    return chain


def _rows(low: Lowering, node: Node) -> int | None:
    """The rows a chain node works on, None when it cannot be one."""
    key = (node.domain, node.op)
    if key == MATMUL:
        w = node.attrs.get("weight")
        if w is None or np.ndim(w) != 2 or not node.inputs or not low.shape(node.inputs[0]):
            return None
        rows = math.prod(low.shape(node.inputs[0])[:-1])
        return rows if all(math.prod(low.shape(o)[:-1]) == rows for o in node.outputs) else None
    if key == ROWS:
        frame = node.attrs["frame"]
        if len(frame.shape) < 2 or math.prod(frame.shape[:-2]) != 1 or causal(node):
            return None
        if any(_frame_rows(node, n) not in (None, frame.shape[-2]) for n in node.inputs + node.outputs):
            return None
        return frame.shape[-2]
    return None


def _frame_rows(node: Node, name: str) -> int | None:
    """Rows of a kernel value that has the frame's rows (None: one row every row reads alike)."""
    shape = node.attrs["values"][name].shape
    return math.prod(shape[:-1]) if shape and math.prod(shape[:-1]) > 1 else None


def blocks(arch: Arch, chain: list[Node], M: int) -> int:
    """How many row blocks: the fewest cycles of max(passes, weight reads) of each matmul (the
    weights read once per block) plus the vector work of the row kernels left unhidden (one
    block's worth, the rest runs while the arrays multiply)."""
    d = arch.derived
    mats = [_matmul_cycles(arch, n, M) for n in chain if (n.domain, n.op) == MATMUL]
    vector = sum(_vector_cycles(arch, n) for n in chain if (n.domain, n.op) == ROWS)

    def cycles(b: int) -> float:
        passes = sum(max(mac * (1 + b * d.pass_overhead / M), b * wgt) for mac, wgt in mats)
        return passes + vector / b

    fits = [b for b in range(1, MOST_BLOCKS + 1) if M // b >= FEWEST_ROWS]
    if fits == [1] and M // 2 >= FEWEST_ROWS // 2:
        # One block hides none of the kernels: two of fewer rows may still pay (``FEWEST_ROWS``).
        fits.append(2)
    return min(fits, key=cycles) if fits else 1


def _matmul_cycles(arch: Arch, node: Node, M: int) -> tuple[float, float]:
    """(cycles of the arrays at peak, cycles of reading the weights once) of a chain matmul."""
    w = np.asarray(node.attrs["weight"])
    mode = pick_mode(arch, mode_for(w) or "w8")
    K, N = w.shape
    d = arch.derived
    return M * K * N / d.macs_per_cycle[mode], K * N * MODE_BITS[mode] / 8 / d.dram_bytes_per_cycle


def _vector_cycles(arch: Arch, node: Node) -> float:
    """The lane operations of a row kernel over every lane of every Legion: one a member op and
    element of its frame."""
    return len(node.attrs["nodes"]) * math.prod(node.attrs["frame"].shape) / (arch.vector_lanes * arch.legions)


def split(M: int, count: int, align: int) -> list[range]:
    """``count`` row ranges covering ``M``, all but the last a multiple of ``align`` rows."""
    step = math.ceil(M / count / align) * align
    return [range(r, min(r + step, M)) for r in range(0, M, step)]


def lower_chain(low: Lowering, chain: list[Node], ranges: list[range], regions: list, region_name,
                lower_node=None) -> None:
    """Emit ``chain`` in the row blocks ``ranges`` (the module docstring), each step opening a
    region named after its node, ordered by waits instead of barriers. A row kernel's block
    followed by a matmul's block that shares nothing with it is interleaved with it: the
    matmul is emitted first, the row kernel in the part of the vector scratchpad the matmul
    leaves, and their instructions are merged, so that the matmul's drains do not wait behind
    the whole row kernel on the vector queue. A tail (``tails.tail_of``: views, then row kernels over
    heads) runs its rows before the last block so beside the matmul's last block, the rest
    after it; ``lower_node`` lowers its views and Concats as the graph would."""
    em, arch = low.em, low.em.arch
    read = {name for n in chain for name in n.inputs}
    chain, views, tails, joins = split_tail(chain)
    start, spans, pairs, last = len(em.instrs), [], {}, None
    steps, done = list(_order(chain, ranges)), Counter()
    # A gated matmul cut by windows takes more steps than the blocks (``qmatmul.GATED_STEPS``);
    # not in blocks below ``FEWEST_ROWS``, where its three joins more cost more than the fill and
    # drain its long passes save (the 2B4T layer at 128 on dlegion-8x8, blocks of 64: 212,170
    # cycles uncut, 215,944 to 217,188 cut with 3 to 8 windows first and 9 to 14 last).
    beside, after = _vector_beside(arch, steps, ranges), _vector_after(arch, chain, ranges)
    gated = {n.name: gated_cut(low, n, ranges, beside[n.name], after[n.name], KERNEL_BEHIND)
             if len(ranges[0]) >= FEWEST_ROWS else (0, 0) for n in chain if (n.domain, n.op) == MATMUL}
    steps = list(_order(chain, ranges, {k: len(GATED_STEPS) - len(ranges) for k, c in gated.items() if any(c)}))
    cuts = {n.name: ranges for n in chain}
    if tails:
        steps = with_tails(steps, chain[-1], tails)
        cuts.update({t.name: ranges for t in tails})
    rooms = _vec_rooms(arch, steps)
    rings: dict = {}                # the slots each matmul block leaves the next (``emit_tiles``)
    # A matmul's columns split off (``qrest``, of its last output) wait for the chain's end
    # unless the chain reads them.
    gens = {n.name: qmatmul_blocks(low, n, ranges, rooms[n.name], rings, n.outputs[-1] not in read, beside[n.name],
                                   gated[n.name])
            if (n.domain, n.op) == MATMUL else row_kernel_blocks(low, n, cuts[n.name]) for n in [*chain, *tails]}
    s = 0
    while s < len(steps):
        node, kernels = steps[s], _kernels_before(low, steps, s)
        if views and any(t is n for t in tails for n in (node, *kernels)):
            _lower_views(low, views, lower_node, spans)
            views = []
        if kernels:
            x = _step(low, steps[s + len(kernels)], gens, spans, done)
            end = _vec_end(em, spans[x]) if x is not None else 0
            merged, rooms = [], kernel_rooms(arch, end, kernels, tails)
            for kernel, (base, above) in zip(kernels, rooms):
                # Paired only while each kernel before it was: the merged order keeps theirs.
                em.reserved["vec"] = base if len(merged) == kernels.index(kernel) else 0
                em.above["vec"] = above if len(merged) == kernels.index(kernel) else 0
                try:
                    r = _step(low, kernel, gens, spans, done)
                except CompileError:        # its rows do not fit beside the matmul's: after it
                    em.reserved["vec"] = em.above["vec"] = 0
                    gens[kernel.name] = row_kernel_blocks(low, kernel, cuts[kernel.name][done[kernel.name]:], resumed=True)
                    r = _step(low, kernel, gens, spans, done)
                used = em.reserved.pop("vec", 0)
                em.above.pop("vec", 0)
                if x is not None and r is not None and used:
                    _shift_vec(em, spans[r], used)
                    merged.append(r)
            if merged:
                pairs[x] = tuple(merged)
            s += len(kernels) + 1
        elif (node.domain, node.op) == ROWS and s and (steps[s - 1].domain, steps[s - 1].op) == MATMUL \
                and not any((n.domain, n.op) == MATMUL for n in steps[s:]):
            last = _last_rows(low, node, gens, cuts, spans, done)
            s += 1
        else:
            _step(low, node, gens, spans, done)
            s += 1
    tails = _last_rows_beside(low, tails, gens, cuts, spans, done, pairs)
    for node in reversed(chain):    # the last matmul's first: its rows are passed and stored longest
        _leftovers(low, node, gens, spans)
    program = Program(arch.name, list(em.tensors), em.instrs[start:])

    ahead = len(ranges[0]) < LOADS_AHEAD_ROWS

    def make(program):
        return _Rewrite(program, arch, order=_merged(program, arch, spans, pairs, start, last, ahead)).run()
    how = (tuple((lo - start, hi - start) for _, lo, hi in spans), tuple(sorted(pairs.items())), last, ahead)
    out, starts = reused(program, low.rewrites, how, make)
    em.instrs[start:] = out
    merged = {r: x for x, rs in pairs.items() for r in rs}
    for j, (node, lo, hi) in enumerate(spans):
        if j in merged:
            continue
        name = region_name(node) + (" with " + " + ".join(region_name(spans[r][0]) for r in pairs[j]) if j in pairs else "")
        ks = [k - start for k in range(lo, hi) if not isinstance(program.instrs[k - start], Barrier)]
        regions.append((start + min(starts[k] for k in ks), name))
    for tail in tails:
        # The tail's last rows, after the barrier: none of the chain's waits need tracking them.
        em.barrier()
        at = len(em.instrs)
        low.schedules.begin(tail.name)
        next(gens[tail.name])
        if len(em.instrs) > at:
            regions.append((at, region_name(tail)))
    for node in joins:              # nothing in the chain read them
        problems = []
        lower_node(low, node, problems, regions)
        if problems:
            raise ValueError(f"node '{node.name}' after a chain's tail: {problems[0][2]}")
    for gen in gens.values():
        for _ in gen:
            raise AssertionError("a chain node has more row blocks than the chain")


def _last_rows(low: Lowering, node: Node, gens: dict, cuts: dict, spans: list, done: Counter) -> int | None:
    """Emit a block of a row kernel after the chain's last matmul block (its last rows: the
    residual Add and final norm after down_proj) in the part of ``vec`` above what that block
    keeps there, so that its first loads share nothing with the block's last pass and go ahead
    of it (``_hoisted``) while DRAM has room, not all after it (2B4T layer on dlegion-8x8: at
    128 219,898 -> 219,510 cycles, at 256 391,393 -> 391,005, at 512 803,957 -> 803,570); in all
    of ``vec`` when its rows do not fit there. The index of its span when it went above, else None."""
    em = low.em
    em.reserved["vec"] = _vec_end(em, next(sp for sp in reversed(spans) if (sp[0].domain, sp[0].op) == MATMUL))
    try:
        r = _step(low, node, gens, spans, done)
    except CompileError:            # nothing emitted: its rows in all of ``vec``
        em.reserved.pop("vec", 0)
        gens[node.name] = row_kernel_blocks(low, node, cuts[node.name][done[node.name]:], resumed=True)
        _step(low, node, gens, spans, done)
        return None
    used = em.reserved.pop("vec", 0)
    if r is not None and used:
        _shift_vec(em, spans[r], used)
    return r


def _last_rows_beside(low: Lowering, tails: list[Node], gens: dict, cuts: dict, spans: list, done: Counter,
                      pairs: dict) -> list[Node]:
    """The last rows of a chain's two tail kernels as one step of the chain, each in its part
    of ``vec`` (``tails.kernel_rooms``), their instructions interleaved (``_merged``): the key's
    rotary loads while the vector unit computes the query's. Returns the tails left to emit
    after the chain: all of them when there is one, those whose rows do not fit their part."""
    em = low.em
    if len(tails) != 2:
        return tails
    made = []
    for k, (tail, (base, above)) in enumerate(zip(tails, kernel_rooms(em.arch, 0, tails, tails))):
        em.reserved["vec"], em.above["vec"] = base, above
        try:
            made.append(_step(low, tail, gens, spans, done))
        except CompileError:        # nothing emitted: its rows, whole, after the chain
            gens[tail.name] = row_kernel_blocks(low, tail, cuts[tail.name][done[tail.name]:], resumed=True)
            return tails[k:]
        finally:
            em.reserved.pop("vec", 0)
            em.above.pop("vec", 0)
        if made[-1] is not None and base:
            _shift_vec(em, spans[made[-1]], base)
    if None not in made:
        pairs[made[0]] = (made[1],)
    return []


def _lower_views(low: Lowering, views: list[Node], lower_node, spans: list) -> None:
    """The views before a chain's tail, each a step of its own should it emit (a copy)."""
    em = low.em
    for node in views:
        at, problems = len(em.instrs), []
        lower_node(low, node, problems, [])
        if problems:
            raise ValueError(f"node '{node.name}' before a chain's tail: {problems[0][2]}")
        if len(em.instrs) > at:
            if not isinstance(em.instrs[-1], Barrier):
                em.barrier()
            spans.append((node, at, len(em.instrs)))


def _vec_rooms(arch: Arch, steps: list[Node]) -> dict[str, int]:
    """The part of ``vec`` each matmul of the chain plans in: half of it, less when a row
    kernel interleaved with it (the steps before it) needs more than the other half for a row."""
    vec = arch.derived.spad_elems["vec"]
    rooms = {n.name: vec // VEC_SHARE for n in steps if (n.domain, n.op) == MATMUL}
    for at, node in enumerate(steps):
        for before in _rows_before(steps, at):
            left = vec - row_kernel_width(before)
            if node.name in rooms and left < rooms[node.name]:
                rooms[node.name] = max(left, vec // LEAST_VEC_SHARE)
    return rooms


def _vector_beside(arch: Arch, steps: list[Node], ranges: list[range]) -> dict[str, float]:
    """The vector cycles (``_vector_cycles``, for a row block) of the row kernels merged with
    each matmul's first block."""
    share = len(ranges[0]) / ranges[-1].stop
    at = {n.name: k for k, n in reversed(list(enumerate(steps))) if (n.domain, n.op) == MATMUL}
    return {name: share * sum(_vector_cycles(arch, n) for n in _rows_before(steps, k)) for name, k in at.items()}


def _vector_after(arch: Arch, chain: list[Node], ranges: list[range]) -> dict[str, float]:
    """The vector cycles (``_vector_cycles``, for a row block) of the row kernels after each
    matmul of the chain, up to the next."""
    share, out, last = len(ranges[0]) / ranges[-1].stop, {}, None
    for node in chain:
        if (node.domain, node.op) == MATMUL:
            out[node.name], last = 0.0, node.name
        elif last is not None:
            out[last] += share * _vector_cycles(arch, node)
    return out


def _rows_before(steps: list[Node], at: int) -> list[Node]:
    """The row kernel steps merged with ``steps[at]`` when it is a matmul (``lower_chain``): the
    run of row kernel steps right before it, from its end, each a node of its own and at most
    ``MOST_MERGED``. The same node twice is a kernel before the matmul whose earlier block the
    matmul's block reads: that block runs before it."""
    out = []
    for node in reversed(steps[max(0, at - MOST_MERGED):at]):
        if (node.domain, node.op) != ROWS or node in out:
            break
        out.insert(0, node)
    return out


def _kernels_before(low: Lowering, steps: list[Node], s: int) -> list[Node]:
    """The row kernel steps from ``steps[s]`` on that are merged with the silent matmul step
    after them (``_rows_before``); none when ``steps[s]`` is not the first of them."""
    at = s
    while at < len(steps) and (steps[at].domain, steps[at].op) == ROWS:
        at += 1
    if at == s or at == len(steps) or not _silent(low, steps[at]):
        return []
    kernels = _rows_before(steps, at)
    return kernels if at - len(kernels) == s else []


def _step(low: Lowering, node: Node, gens: dict, spans: list, done: dict) -> int | None:
    """Emit the next row block of ``node`` (``done``: blocks emitted, by node); the index of its
    span in ``spans`` (None: nothing emitted)."""
    em = low.em
    at = len(em.instrs)
    low.schedules.begin(node.name)
    next(gens[node.name])
    done[node.name] += 1
    if len(em.instrs) == at:
        return None
    spans.append((node, at, len(em.instrs)))
    em.barrier()
    return len(spans) - 1


def _leftovers(low: Lowering, node: Node, gens: dict, spans: list) -> None:
    """What a matmul emits after its last row block (the columns ``qrest`` splits off, where
    no node of the chain reads its outputs), a step of its own at the chain's end: its passes
    run while the last step's drains and stores finish, and its first loads go ahead of that
    step's last pass (``_hoisted``). 2B4T BitLinear stack at 256 on dlegion-8x8, before each
    part's first loads went ahead (``_first_passes_end``): 283,837 cycles, 284,627 with the
    columns a step of their own after the matmul's last block."""
    if (node.domain, node.op) != MATMUL:
        return
    em, at = low.em, len(low.em.instrs)
    low.schedules.begin(node.name)
    for _ in gens[node.name]:
        raise CompileError(f"internal: matmul '{node.name}' has more row blocks than its chain")
    if len(em.instrs) > at:
        spans.append((node, at, len(em.instrs)))
        em.barrier()


def _silent(low: Lowering, node: Node) -> bool:
    """Whether a matmul reads its activations as they are (no copy, no zero point: it emits
    nothing before its row blocks that would read rows of a block not yet written)."""
    if (node.domain, node.op) != MATMUL:
        return False
    a, q = node.attrs, node.inputs[0]
    op = low.operands.get(q)
    if op is None or a.get("act_offset", 0) or a.get("act_zero_point", 0) or node.inputs[2:3] != [""] * len(node.inputs[2:3]):
        return False
    return low.em.tensors[op.tensor].dtype == "i8" and op == whole(op.tensor, low.shape(q))


def _vec_end(em, span) -> int:
    """One past the last element of ``vec`` the instructions of ``span`` touch."""
    _, lo, hi = span
    end = 0
    for i in em.instrs[lo:hi]:
        if isinstance(i, (Barrier, Wait)):
            continue
        for r in range(_span(i)):
            for space, win, _, _ in footprint(i, r, em.tensors):
                if isinstance(space, tuple) and space[1] == "vec":
                    end = max(end, win[1])
    return end


def _shift_vec(em, span, base: int) -> None:
    """Move what the instructions of ``span`` keep in ``vec`` up by ``base`` elements."""
    _, lo, hi = span
    for k in range(lo, hi):
        i = em.instrs[k]
        moved = {f.name: _moved(getattr(i, f.name), base) for f in fields(i)}
        em.instrs[k] = replace(i, **{n: v for n, v in moved.items() if v is not getattr(i, n)})


def _moved(v, base: int):
    if isinstance(v, View) and v.space == "vec":
        return replace(v, addr=v.addr + base)
    return v


def _merged(program: Program, arch: Arch, spans: list, pairs: dict, start: int, last: int | None = None,
            loads_ahead: bool = False) -> list[int]:
    """The chain's instructions (not its barriers) span by span, each matmul span of ``pairs``
    merged evenly with its row kernel's span, each step's loads before its first pass hoisted
    into the step before it (``_hoisted``), and those of the span ``last`` (``_last_rows``); given
    ``loads_ahead``, each step's loads ahead of its stores (``_loads_ahead``)."""
    instrs, merged = program.instrs, {r for rs in pairs.values() for r in rs}
    ahead = set()

    def own(span) -> list[int]:
        _, lo, hi = span
        return [k - start for k in range(lo, hi) if not isinstance(instrs[k - start], Barrier)]

    steps = []
    for j, span in enumerate(spans):
        if j in merged:
            continue
        mine = own(span)
        if j == last:
            ahead.add(len(steps))
        if j in pairs:
            other = _interleaved(program, [own(spans[r]) for r in pairs[j]])
            steps.append(_before_last_passes(program, mine, other) if _apart(program, mine, other) else mine + other)
        else:
            steps.append(mine)
    steps = _hoisted(program, arch, steps, ahead, not loads_ahead)
    if loads_ahead:
        targets = _targets(program, arch)
        steps = [_loads_ahead(program, arch, step, targets) for step in steps]
    return [k for step in steps for k in step]


def _interleaved(program: Program, kernels: list[list[int]]) -> list[int]:
    """The instructions of the kernels merged with one matmul step: spread evenly among each
    other where they touch nothing in common (``tails.kernel_rooms``), else one kernel after another."""
    out = kernels[0]
    for kernel in kernels[1:]:
        out = _even(out, kernel) if _apart(program, out, kernel) else out + kernel
    return out


def _before_last_passes(program: Program, mine: list[int], kernel: list[int]) -> list[int]:
    """``kernel`` spread evenly over the matmul step ``mine`` from its pass ``KERNEL_BEHIND`` (at
    most half-way to its last ``KERNEL_AHEAD`` passes; from its start, when it has too few) up to
    those (all but its first pass, when it has fewer), so that its last rows are stored while the
    arrays still multiply and the next step's loads of them can go ahead of this step's last pass
    (``_hoisted``)."""
    passes = [n for n, k in enumerate(mine) if isinstance(program.instrs[k], MatMul)]
    ahead = min(KERNEL_AHEAD, len(passes) - 1)      # the first pass runs beside it, at least
    cut = passes[-ahead] if ahead > 0 else len(mine)
    behind = min(KERNEL_BEHIND, (len(passes) - ahead) // 2)
    lead = passes[behind] if KERNEL_BEHIND < len(passes) - max(ahead, 1) else 0
    merged, ks = _even(mine[lead:cut], kernel), set(kernel)
    return mine[:lead] + _loads_early(program, _stores_late(program, merged, ks), ks) + mine[cut:]


def _stores_late(program: Program, merged: list[int], kernel: set[int]) -> list[int]:
    """``merged`` with each of the kernel's stores put as late as the kernel's own order lets it
    (right before its next instruction): a store waits for the kernel's vector work, and ahead
    of the matmul's next loads in the in-order DMA queue it held them back, the arrays idle. The
    two share nothing (``_apart``), so only the queues' order changes (2B4T layer on dlegion-8x8
    at sequence 128: 230,417 -> 224,014 cycles; at 512 818,706 -> 817,280)."""
    out, held = [], []              # held: the kernel's stores since its last other instruction
    for k in merged:
        if k not in kernel:
            out.append(k)
        elif isinstance(program.instrs[k], DmaStore):
            held.append(k)
        else:
            out += held + [k]
            held = []
    return out + held


def _loads_early(program: Program, merged: list[int], kernel: set[int]) -> list[int]:
    """``merged`` with each of the matmul's loads put as early as the matmul's own order lets
    it (right after its instruction before), ahead of the kernel's loads and stores ``_even``
    spread there, for the same reason (the layer at 128: 224,014 -> 222,419 cycles; at 512
    817,280 -> 815,430)."""
    out, mark = [], 0               # mark: right after the matmul's last instruction so far
    for k in merged:
        if k in kernel:
            out.append(k)
        elif isinstance(program.instrs[k], DmaLoad):
            out.insert(mark, k)
            mark += 1
        else:
            out.append(k)
            mark = len(out)
    return out


def _hoisted(program: Program, arch: Arch, steps: list[list[int]], ahead: set[int] = frozenset(),
             late: bool = True) -> list[list[int]]:
    """``steps`` with what each step with passes emits before every Legion's pass ``HOISTED_PASSES`` (its
    first activation and weight loads, the row kernel's first rows; not its passes) moved
    before the last pass of the step before it, where it shares nothing with what it passes over (nor with what stays
    behind it, nor waits for either): the queues run in order, and left after that step's last
    stores, which wait for its last pass and drain, the loads would start only then and the
    arrays idle while they cross DRAM. What the moved loads fill is free by then: a matmul's
    next row block takes the slots its block before used least recently (``emit_tiles``'
    ``rings``), and a row kernel merged with a step stores its rows before the step's last
    passes (``_before_last_passes``). 2B4T BitLinear stack at 256 on dlegion-8x8: 296,938 ->
    291,186 cycles; the layer at 512: 869,618 -> 858,735. The steps ``ahead`` (row kernels after
    a chain's last matmul block, ``_last_rows``) move their loads only: their vector work ahead
    of the last pass would hold its drains back in the in-order vector queue. Given ``late``,
    the stores behind the last pass go behind the step's first loads (``_stores_after``; not in
    a chain that puts each step's loads ahead of its stores: the layer at 128, 211,377 ->
    211,634 cycles)."""
    # Nothing of the arrays' queue moves: a wait there serves a pass of the step, which stays
    # behind, and ahead of the last pass it held that pass back until the step's first loads
    # were in (2B4T layer at sequence 128 on dlegion-8x8: 216,733 -> 212,988 cycles).
    is_pass = lambda k: program.instrs[k].queue() == MatMul.QUEUE   # noqa: E731
    out, targets = [list(step) for step in steps], _targets(program, arch)
    for at, (before, step) in enumerate(zip(out, out[1:]), 1):
        passes = [n for n, k in enumerate(before) if is_pass(k)]
        first = len(step) if at in ahead else _first_passes_end(program, step)
        if not passes or not first:
            continue
        over, moved, kept = before[passes[-1]:], [], []
        behind, staying = _Touched(_spans(program, over)), set(over)       # what stays behind: over and kept
        for k in step[:first]:
            after = {t[2] for t in (targets.get((k, l)) for l in range(arch.legions)) if t}
            mine = _spans(program, [k])
            free = (not is_pass(k) and (at not in ahead or isinstance(program.instrs[k], DmaLoad))
                    and not after & staying and behind.apart(mine))
            if free:
                moved.append(k)
            else:
                kept.append(k)
                behind.add(mine)
                staying.add(k)
        before[passes[-1]:passes[-1]] = moved
        step[:first] = kept
        if late:
            _stores_after(program, arch, before, step, targets)
    return out


def _stores_after(program: Program, arch: Arch, before: list[int], step: list[int], targets: dict) -> None:
    """``before``'s stores after its last pass that nothing behind them (in ``before``, or in
    ``step`` up to its first instruction that is neither a load, a wait nor a pass) waits for or
    touches, moved to that instruction: ahead of the step's loads that could not go before the
    last pass (their slots freed by the step's own first passes) they held those back in the
    in-order DMA queue, the arrays idle (2B4T BitLinear stack at 256 on dlegion-8x8: qrest's
    fourth pass on Legions 0-3 waited 344 cycles behind down_proj's last stores; 275,255 ->
    275,011 cycles; the layer at 512 789,036 -> 788,573, at 256 382,474 -> 382,293)."""
    quiet = (DmaLoad, Wait, MatMul, NocMove)
    tail = max((n for n, k in enumerate(before) if program.instrs[k].queue() == MatMul.QUEUE), default=None)
    if tail is None:
        return
    at = next((n for n, k in enumerate(step) if not isinstance(program.instrs[k], quiet)), len(step))
    named = {t[2] for k in before[tail:] + step for t in (targets.get((k, l)) for l in range(arch.legions)) if t}
    stores, behind = [], _Touched(_spans(program, step[:at]))     # from the last: what is behind each
    for k in reversed(before[tail:]):
        mine = _spans(program, [k])
        if isinstance(program.instrs[k], DmaStore) and k not in named and behind.apart(mine):
            stores.append(k)
        behind.add(mine)
    stores.reverse()
    if stores:
        moved = set(stores)
        before[:] = [k for k in before if k not in moved]
        step[at:at] = stores


def _loads_ahead(program: Program, arch: Arch, step: list[int], targets: dict,
                 staying: set[int] = frozenset()) -> list[int]:
    """``step`` with each load but those ``staying`` put ahead of the instructions before it that it
    shares nothing with (by the bounds of their windows), up to the load before it, a wait its
    Legion's DMA queue issues or an instruction its condition names (``targets``, overlap's
    ``_targets``). The DMA queue runs in order: a drain's stores wait for their pass and drain,
    and the loads of the passes after the next, queued behind them, started a DRAM round trip too
    late (2B4T layer at sequence 128 on dlegion-8x8: attention's last P.V passed for 160 cycles
    and idled 342 after each pass)."""
    out = []
    for k in step:
        at = len(out)
        if isinstance(program.instrs[k], DmaLoad) and k not in staying:
            named = {t[2] for t in (targets.get((k, legion)) for legion in range(arch.legions)) if t}
            mine = _spans(program, [k])
            while at and out[at - 1] not in named and _passable(program, out[at - 1], k, mine):
                at -= 1
        out.insert(at, k)
    return out


def _passable(program: Program, j: int, k: int, mine: dict) -> bool:
    """Whether the load ``k`` may go ahead of ``j``: neither a load (loads keep their order) nor
    a wait its Legion's DMA queue issues (a wait issued for a span of Legions may be passed: 2B4T
    layer at 128 on dlegion-8x8, 211,225 -> 211,093 cycles; any wait, 211,087, but at 512 789,914
    -> 790,106), and touching nothing ``k`` touches (``mine``: its ``_spans``), one of them
    writing."""
    i, load = program.instrs[j], program.instrs[k]
    if isinstance(i, DmaLoad):
        return False
    if isinstance(i, Wait) and i.queue() == DmaLoad.QUEUE and i.legion == load.legion:
        return False
    return _apart(program, [j], [k], mine)


def _first_passes_end(program: Program, step: list[int]) -> int | None:
    """Where in ``step`` every Legion with passes there has come to its pass ``HOISTED_PASSES``
    (or its last): the parts of a matmul's rows on Legions of their own (``qparts``) are emitted
    one after another, and each part's first loads go ahead as the first part's do."""
    seen: dict[int, int] = {}
    last: dict[int, int] = {}
    for n, k in enumerate(step):
        i = program.instrs[k]
        if not isinstance(i, MatMul):
            continue
        for legion in range(i.legion, i.legion + _span(i)):
            seen[legion] = seen.get(legion, 0) + 1
            if seen[legion] <= HOISTED_PASSES + 1:
                last[legion] = n
    return max(last.values()) if last else None


def _even(a: list[int], b: list[int]) -> list[int]:
    """``a`` and ``b`` merged, each in its order, ``b``'s items spread evenly among ``a``'s."""
    out, j = [], 0
    for n, k in enumerate(a, 1):
        out.append(k)
        while j < len(b) and (j + 1) * len(a) <= n * len(b):
            out.append(b[j])
            j += 1
    return out + b[j:]


def _apart(program: Program, a: list[int], b: list[int], sb: dict | None = None) -> bool:
    """Whether no element is touched by an instruction of ``a`` and one of ``b``, one of them
    writing (by the bounds of their windows); ``sb``: ``b``'s ``_spans``, if known."""
    sa, sb = _spans(program, a), _spans(program, b) if sb is None else sb
    for space in sa.keys() & sb.keys():
        # Sorted unions of b's windows and of its written ones: each window of a is then
        # checked in log time, not against every window of b.
        touched = _union([(lo, hi) for lo, hi, _ in sb[space]])
        written = _union([(lo, hi) for lo, hi, w in sb[space] if w])
        for lo, hi, write in sa[space]:
            if _meets(touched if write else written, lo, hi):
                return False
    return True


class _Touched:
    """What some instructions touch, space by space, given their ``_spans``: the sorted union of
    their windows and of those they write, grown as instructions are added. ``apart`` is
    ``_apart`` against all of them, each window checked in log time: checking each instruction
    of a step against those before it one ``_apart`` at a time made the unions again for each,
    which took most of a compile at long sequences (2B4T layer at 2048 on dlegion-8x8)."""

    def __init__(self, spans: dict):
        self.touched, self.written = {}, {}
        self.add(spans)

    def add(self, spans: dict) -> None:
        for space, found in spans.items():
            for lo, hi, write in found:
                _insert(self.touched.setdefault(space, ([], [])), lo, hi)
                if write:
                    _insert(self.written.setdefault(space, ([], [])), lo, hi)

    def apart(self, spans: dict) -> bool:
        """Whether no element is touched by the instructions of ``spans`` and by these, one of
        them writing."""
        for space, found in spans.items():
            for lo, hi, write in found:
                union = (self.touched if write else self.written).get(space)
                if union and _meets(union, lo, hi):
                    return False
        return True


def _insert(union: tuple[list[int], list[int]], lo: int, hi: int) -> None:
    """The window [lo, hi) added to a union of ``_union``'s form, merged with those it meets."""
    if lo >= hi:
        return
    starts, ends = union
    i, j = bisect.bisect_left(ends, lo), bisect.bisect_right(starts, hi)
    if i < j:
        lo, hi = min(lo, starts[i]), max(hi, ends[j - 1])
    starts[i:j], ends[i:j] = [lo], [hi]


def _spans(program: Program, ks: list[int]) -> dict:
    """Space -> [(first, end, write)] of every access the instructions ``ks`` make."""
    return {space: [(win[0], win[1], write) for win, write in found]
            for space, found in accesses(program, ks).items()}


def _union(windows: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """The union of half-open windows as sorted disjoint (starts, ends)."""
    starts, ends = [], []
    for lo, hi in sorted(w for w in windows if w[0] < w[1]):
        if ends and lo <= ends[-1]:
            ends[-1] = max(ends[-1], hi)
        else:
            starts.append(lo)
            ends.append(hi)
    return starts, ends


def _meets(union: tuple[list[int], list[int]], lo: int, hi: int) -> bool:
    """Whether the window [lo, hi) shares an element with the union."""
    starts, ends = union
    k = bisect.bisect_right(starts, lo)
    return lo < hi and ((k > 0 and ends[k - 1] > lo) or (k < len(starts) and starts[k] < hi))


def _order(chain: list[Node], ranges: list[range], more: dict[str, int] | None = None):
    """The chain's nodes, one for each row block step, in the pipelined order; a matmul that
    takes ``more`` steps than the blocks (by name) takes them before its first block's row
    kernels."""
    more = more or {}
    first = next(k for k, n in enumerate(chain) if (n.domain, n.op) == MATMUL)
    after = next((k for k in range(first + 1, len(chain)) if (chain[k].domain, chain[k].op) == MATMUL), len(chain))
    if first == 1:
        # One row kernel before the first matmul (a norm and quantize before the projections):
        # block b + 1 of the kernel comes right before matmul block b, which it is merged with
        # (after the row kernels of block b - 1 of the matmul's segment), so the vector unit
        # computes it while the arrays multiply.
        yield chain[0]
        for b in range(len(ranges)):
            if b + 1 < len(ranges):
                yield chain[0]
            yield from [chain[1]] * (more.get(chain[1].name, 0) if b == 0 else 0)
            yield from chain[1:after]
        first = after
    else:
        for n in chain[:first]:
            for _ in ranges:
                yield n
    segment = []
    for n in chain[first:] + [None]:
        if segment and (n is None or (n.domain, n.op) == MATMUL):
            yield from [segment[0]] * more.get(segment[0].name, 0)
            for _ in ranges:
                yield from segment
            segment = []
        if n is not None:
            segment.append(n)
