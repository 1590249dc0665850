"""Attention by head groups: the softmax of one group runs on the vector unit while the arrays
multiply the next group's QK^T and the group before's P.V.

The quantized attention of a layer is three nodes over all heads: QK^T and P.V on the arrays
(``AttnMatMul``) and the causal softmax that quantizes P between them (a ``RowKernel``). The
vector queue of a Legion runs in order, so with every head's QK^T drains queued before the
softmax, and the softmax before P.V, the arrays idle while the vector unit computes the softmax
(2B4T at sequence 512 on dlegion-8x8: 75k cycles of a 912k layer). Here the heads are cut into
groups and the three nodes emitted group by group (S: QK^T, R: softmax, V: P.V):

    S(0) | S(1) + R(0) | S(2) V(0) + R(1) | ... | V(G-2) + R(G-1) | V(G-1)

each ``+`` merging the instructions of the row kernel evenly with those of the matmuls before
it, so the vector queue alternates between the matmuls' drains and the softmax. The matmuls
plan their drains in the first part of ``vec`` (``PRODUCTS_VEC``), the softmax runs in the rest,
and the barriers between the steps are replaced by the waits that keep them ordered
(``overlap.py``'s rewrite in the new order), which the race check proves. Nodes between the
three that read none of them (the quantization of V) run beside S(0), in the part of ``vec``
the softmax takes later (2B4T layer at 512 on dlegion-8x8: 858,735 -> 854,069 cycles); the
products' copies (K's rows for the arrays) stay in their own part for it. Before S(0) come K's
mean over the tokens and K's smoothed quantization of only the K heads S(0) reads, the rest of
it beside S(0) the same way (``_ahead``; the layer at 512 801,743 -> 799,561 cycles, at 128
218,698 -> 217,933).
"""
from __future__ import annotations

import math
from collections import Counter
from contextlib import nullcontext

from dataclasses import replace

import numpy as np

from isa.instructions import Barrier, Wait
from isa.program import Program
from dlegion_cc.ir import DLEGION, Node
from dlegion_cc.lower import carry
from dlegion_cc.lower.context import Lowering
from dlegion_cc.lower.fused import head_axis, row_kernel_heads, row_kernel_width
from dlegion_cc.lower.overlap import _Rewrite, _span, _targets, reused
from dlegion_cc.lower.qmatmul import run_time_weights_groups
from dlegion_cc.lower.reduce import down_columns_in_parts, lower_matrices, strips_fit
from dlegion_cc.lower.rowblocks import _apart, _loads_ahead, _shift_vec
from runtime.costs import Env, cost

ATTN, ROWS = (DLEGION, "AttnMatMul"), (DLEGION, "RowKernel")
# The fewest heads a group: the arrays' fill and drain and each group's DRAM round trips are
# paid once a group.
FEWEST_HEADS = 2
# More groups hide more of the first QK^T and last P.V but pay each group's fill, drain and
# DRAM round trips. Products of two int8 pieces (``--attention int8x2``) take three times the
# passes, so the first group's QK^T and the last one's P.V, which nothing hides, weigh more
# (2B4T layer at 512 on dlegion-8x8: 4 groups 1,026,444 cycles, 5 groups 1,021,556, 10 groups
# 1,014,058, 20 groups 1,026,852; at 256, 10 groups 463,340 and 4 464,431; at 128, 4 groups are
# faster by 0.8%); products of one piece take as many groups where each holds enough scores
# (``FEWEST_GROUP_SCORES``).
MOST_GROUPS = 10
# The fewest scores (heads by queries by keys) a group of int8 products: below, a group's fill,
# drain and DRAM round trips cost more than the first QK^T and the last P.V it hides. A group's
# products grow with the square of the sequence, its fill and round trips with the sequence, so
# rows of scores alone (heads by queries, at least 2,560) could not take 10 groups at 512 and 2
# at 256 (2B4T layer on dlegion-8x8, 20 heads: at 512, 2 groups 788,658 cycles, 4 783,078,
# 5 784,821, 10 776,769; at 256, 2 groups 378,774, 4 383,347, 5 385,614, 10 389,916; at 128,
# 2 groups 209,666, 4 212,003, 5 213,243, 10 215,004): between a group's 327,680 scores at 256
# in 4 groups and its 524,288 at 512 in 10.
FEWEST_GROUP_SCORES = 393_216
# Ops between the three nodes that may read them: views, which emit nothing.
VIEWS = ("Reshape", "Unsqueeze", "Squeeze", "Identity")
# Ops between K's smoothed quantization and QK^T (``_ahead``): views of K's codes and scales.
VIEWS_AHEAD = ("Transpose", "Expand", *VIEWS)
MOST_AHEAD_VIEWS = 6
SMOOTH = (DLEGION, "SmoothAbsmaxQuantize")
# The fewest elements of K a Legion for its smoothing to run in two parts (``_ahead``): below,
# the first part takes about as long as the whole, its loads' latency the most of it (8 heads
# of 32 over 2 K heads on dlegion-8x8: at sequence 128, 1,024 a Legion, 10,121 cycles whole and
# 10,433 in parts; at 256, 2,048 a Legion, 20,080 whole and 19,289 in parts).
FEWEST_AHEAD_ELEMS = 2048
# The most nodes between the three: --attention int8x2 has 11 (the views of two pieces of P,
# and V's second piece with its views).
MOST_BETWEEN = 12
# The share of ``vec`` the products plan their drains in; the softmax runs in the rest, whose
# blocks then hold more rows (2B4T layer at 512 on dlegion-8x8: a quarter 892,238 cycles,
# three eighths 886,478, a half 890,586, five eighths 910,583).
PRODUCTS_VEC = (3, 8)

# A step puts its loads ahead of its stores (``rowblocks._loads_ahead``), the softmax's too where its
# passes take this many times its vector work on the busiest Legions (``_staying``): the passes then
# wait for loads queued behind the drains' stores, where nearer the vector work the softmax waits
# for the stores held back (2B4T layer on dlegion-8x8, in every step: at 512 789,914 -> 790,739
# cycles, at 128 212,170 -> 211,753, int8x2 at 512 941,025 -> 928,257; where the passes outweigh
# the vector work, 790,613 at 512; at 3/2 and 5/4, 789,914, 211,864 and 929,656; at 6/5, 790,122
# at 512; at 2, int8x2 941,025: its steps between the first and the last take 1.9 times their
# vector work in passes).
ARRAYS_BOUND = (3, 2)


def products_room(arch) -> int:
    """Elements of ``vec`` from 0 the products' plans may take."""
    share, of = PRODUCTS_VEC
    return arch.derived.spad_elems["vec"] * share // of


def plan(low: Lowering, nodes: list[Node], at: int) -> tuple[dict, list[range]]:
    """The attention at ``nodes[at]`` (``{"qk", "softmax", "pv", "between", "ahead"}``: its
    nodes, those between them and K's mean and smoothing before them) and its head groups;
    nothing when there is none or one group."""
    ahead = _ahead(nodes, at)
    found = _attention_at(low, nodes, at + len(ahead))
    if not found:
        return {}, []
    heads, scores = found["heads"], math.prod(found["softmax"].attrs["frame"].shape[-2:])
    pieces = len(found["qk"].inputs) > 4
    fits = [g for g in range(2, MOST_GROUPS + 1) if heads % g == 0 and heads // g >= FEWEST_HEADS]
    # Too few scores for any more groups: two, which hide the most for their cost.
    count = max([g for g in fits if pieces or heads // g * scores >= FEWEST_GROUP_SCORES] or fits[:1], default=1)
    if count < 2:
        return {}, []
    per = heads // count
    groups = [range(g * per, (g + 1) * per) for g in range(count)]
    found["ahead"] = _ahead_split(low, found, ahead, groups[0])
    if ahead and not found["ahead"]:
        return {}, []       # K's mean and smoothing lowered as nodes; the attention after them
    return found, groups


def _ahead(nodes: list[Node], at: int) -> list[Node]:
    """K's mean over the tokens at ``nodes[at]``, its smoothed quantization and the views up to
    the QK^T after them; nothing when ``nodes[at]`` is not such a mean."""
    if nodes[at].op != "ReduceMean" or nodes[at].domain:
        return []
    made, out = set(nodes[at].outputs), [nodes[at]]
    for node in nodes[at + 1:at + 2 + MOST_AHEAD_VIEWS]:
        if (node.domain, node.op) == ATTN:
            kernels = [n for n in out if n.op not in VIEWS_AHEAD]
            return out if [n.op for n in kernels] == ["ReduceMean", "SmoothAbsmaxQuantize"] else []
        if not made & set(node.inputs) or ((node.domain, node.op) != SMOOTH and node.op not in VIEWS_AHEAD):
            return []
        made |= set(node.outputs)
        out.append(node)
    return []


def _ahead_split(low: Lowering, found: dict, ahead: list[Node], first: range) -> dict:
    """K's mean and smoothing (``ahead``) as lowered: ``{"kernels", "views", "part", "total"}``,
    the mean over all ``total`` K heads and the smoothing over the ``part`` the first group
    reads before its QK^T, the smoothing of the rest beside it; nothing when they do not run
    so."""
    kernels = [n for n in ahead if n.op not in VIEWS_AHEAD]
    if not ahead or any(carry.pending(low, n) for n in ahead) or kernels[1].inputs[1] != kernels[0].outputs[0] \
            or not all(down_columns_in_parts(low, n) for n in kernels):
        return {}
    room, S = products_room(low.em.arch), low.shape(kernels[0].inputs[0])[-2]
    if not strips_fit(low.em, S, room) or 4 * low.shape(kernels[1].inputs[0])[-1] > low.em.capacity("vec") - room:
        return {}
    k_lead, q_lead = low.shape(kernels[1].inputs[0])[:-2], low.shape(found["qk"].outputs[0])[:-2]
    if len(k_lead) != len(q_lead) or any(k not in (1, q) for k, q in zip(k_lead, q_lead)):
        return {}
    # The K matrix each query head of the first group reads (a K head repeated: index 0).
    reads = [np.ravel_multi_index([i if k > 1 else 0 for i, k in zip(np.unravel_index(h, q_lead), k_lead)], k_lead)
             for h in first]
    part = int(max(reads)) + 1
    elems = math.prod(low.shape(kernels[1].inputs[0]))
    if part >= math.prod(k_lead) or elems < FEWEST_AHEAD_ELEMS * low.em.arch.legions:
        return {}
    return {"kernels": kernels, "views": [n for n in ahead if n not in kernels], "part": part,
            "total": math.prod(k_lead)}


def _attention_at(low: Lowering, nodes: list[Node], at: int) -> dict:
    qk = nodes[at]
    if (qk.domain, qk.op) != ATTN or carry.pending(low, qk):
        return {}
    made, between, sm = set(qk.outputs), {"before": [], "after": [], "views": set()}, None
    for node in nodes[at + 1:]:
        reads = bool(made & set(node.inputs))
        if sm is None and (node.domain, node.op) == ROWS and reads:
            sm = node
        elif sm is not None and (node.domain, node.op) == ATTN and made & set(node.inputs[:1]):
            return _checked(low, qk, sm, node, between)
        elif reads and node.op not in VIEWS:
            return {}
        else:
            between["after" if sm else "before"].append(node)
            if reads:
                between["views"].add(node.name)
        if reads or node is sm:
            made |= set(node.outputs)
        if len(between["before"]) + len(between["after"]) > MOST_BETWEEN:
            return {}
    return {}


def _checked(low: Lowering, qk: Node, sm: Node, pv: Node, between: list[Node]) -> dict:
    """The attention found, if its three nodes agree on the heads and the softmax fits beside
    the matmuls' drains."""
    axis = head_axis(sm)
    if axis is None or any(carry.pending(low, n) for n in (sm, pv)):
        return {}
    heads = sm.attrs["frame"].shape[axis]
    for mm in (qk, pv):
        if math.prod(low.shape(mm.outputs[0])[:-2]) != heads:
            return {}
    vec = low.em.arch.derived.spad_elems["vec"]
    if row_kernel_width(sm) > vec - products_room(low.em.arch):
        return {}
    return {"qk": qk, "softmax": sm, "pv": pv, "between": between, "heads": heads}


def lower_attention(low: Lowering, found: dict, groups: list[range], lower_node, regions: list,
                    region_name) -> None:
    """Emit the attention ``found`` by head ``groups`` (the module docstring); ``lower_node``
    lowers a node between the three as the graph would."""
    em, arch = low.em, low.em.arch
    room = products_room(arch)
    start, spans, own_regions = len(em.instrs), {}, []

    def run(key, gen):
        for g, _ in enumerate(groups):
            at = len(em.instrs)
            low.schedules.begin(key[1].name)
            next(gen)
            em.barrier()
            spans[key[0], g] = (at, len(em.instrs))
        for _ in gen:
            raise AssertionError("more head groups than planned")

    qk, sm, pv = found["qk"], found["softmax"], found["pv"]
    ahead = found.get("ahead") or {}
    if ahead:       # K's mean, and its smoothing for the heads the first group reads
        mean, smooth = ahead["kernels"]
        _lower_ahead(low, [(mean, range(ahead["total"])), (smooth, range(ahead["part"]))], spans, ("ahead", 0))
        for node in ahead["views"]:
            _lower_between(low, node, lower_node, spans, own_regions, {node.name}, room)
    # K's copy into the rows the arrays take as weights stays in the products' part too, so
    # that V's quantization can run beside the first group (``_steps``).
    with em.reserving("vec", em.capacity("vec") - room):
        run(("qk", qk), _attn(low, qk, groups, room))
    if ahead:       # and for the rest, beside the first group
        own_regions.append(region_name(smooth))
        _lower_ahead(low, [(smooth, range(ahead["part"], ahead["total"]))], spans, ("node", len(own_regions) - 1),
                     room)
    for node in found["between"]["before"]:
        _lower_between(low, node, lower_node, spans, own_regions, found["between"]["views"], room)
    with em.reserving("vec", room):
        run(("softmax", sm), row_kernel_heads(low, sm, groups))
    for g in range(len(groups)):
        _shift_vec(em, (sm, *spans["softmax", g]), room)
    for node in found["between"]["after"]:
        _lower_between(low, node, lower_node, spans, own_regions, found["between"]["views"], room)
    run(("pv", pv), _attn(low, pv, groups, room))
    program = Program(arch.name, list(em.tensors), em.instrs[start:])

    def make(program):
        steps = _steps(program, arch, spans, len(groups), start, [k for k in spans if k[0] == "node"])
        if ("ahead", 0) in spans:
            steps.insert(0, (("ahead",), [k - start for k in range(*spans["ahead", 0])
                                          if not isinstance(program.instrs[k - start], Barrier)]))
        targets = _targets(program, arch)
        softmax = {k - start for g in range(len(groups)) for k in range(*spans["softmax", g])}
        steps = [(label, _loads_ahead(program, arch, ks, targets, _staying(program, arch, ks, softmax)))
                 for label, ks in steps]
        out, starts = _Rewrite(program, arch, order=[k for _, ks in steps for k in ks]).run()
        return out, (steps, starts)
    how = (tuple(sorted((key, lo - start, hi - start) for key, (lo, hi) in spans.items())), len(groups))
    out, (steps, starts) = reused(program, low.rewrites, how, make)
    em.instrs[start:] = out
    names = {"qk": region_name(qk), "softmax": region_name(sm), "pv": region_name(pv),
             "between": " + ".join(own_regions),
             "ahead": " + ".join(region_name(n) for n in ahead.get("kernels", []))}
    for label, ks in steps:
        if ks:
            name = own_regions[label[1]] if label[0] == "node" else " + ".join(names[p] for p in label)
            regions.append((start + min(starts[k] for k in ks), name))


def _lower_ahead(low: Lowering, parts: list[tuple[Node, range]], spans: dict, key, room: int | None = None) -> None:
    """K's mean or smoothed quantization, each node over its K heads of ``parts``; given a
    ``room``, in the part of ``vec`` past it, which the first group's QK^T leaves alone."""
    em, at = low.em, len(low.em.instrs)
    with em.reserving("vec", room) if room else nullcontext():
        for node, part in parts:
            lower_matrices(low, node, part)
            em.barrier()
    if room:
        _shift_vec(em, (None, at, len(em.instrs)), room)
    spans[key] = (at, len(em.instrs))


def _attn(low: Lowering, node: Node, groups: list[range], room: int):
    a8, ra, b8, rb, *lo = node.inputs
    return run_time_weights_groups(low, a8, b8, node.outputs[0], ra, rb, node.attrs.get("zero_a"),
                                   node.attrs.get("dead"), groups, room, tuple(lo) or None)


def _lower_between(low, node, lower_node, spans, own_regions, views, room: int | None = None) -> None:
    """Lower a node between the three; a kernel given a ``room`` plans in the part of
    ``vec`` past it, which the first group's QK^T leaves alone, to run beside it (``_steps``)."""
    em = low.em
    at, problems, regions = len(em.instrs), [], []
    shifted = room is not None and _fits_beside(low, node, room)
    with em.reserving("vec", room) if shifted else nullcontext():
        lower_node(low, node, problems, regions)
    if shifted and len(em.instrs) > at:
        _shift_vec(em, (node, at, len(em.instrs)), room)
    if problems:
        raise ValueError(f"node '{node.name}' between attention's products: {problems[0][2]}")
    if len(em.instrs) > at and node.name in views:
        # It runs before the products (``_steps``): only what reads none of them may emit.
        raise AssertionError(f"node '{node.name}' between attention's products is not a view")
    if len(em.instrs) > at:
        spans["node", len(own_regions)] = (at, len(em.instrs))
        own_regions.append(regions[0][1] if regions else node.name)


def _fits_beside(low, node, room: int) -> bool:
    """Whether ``node`` is a kernel that plans in what ``vec`` has past ``room`` and fits there."""
    if (node.domain, node.op) == ROWS:
        return row_kernel_width(node) <= low.em.capacity("vec") - room
    if (node.domain, node.op) == (DLEGION, "ColumnAbsmaxQuantize"):
        return strips_fit(low.em, low.shape(node.inputs[0])[-2], room)
    return False


def _steps(program: Program, arch, spans: dict, count: int, start: int, others: list) -> list:
    """The steps in order, each (label, its instructions in program order): the nodes between
    first, then S(0), each softmax merged with the matmuls before it, the last P.V."""
    def own(key) -> list[int]:
        if key not in spans:
            return []
        lo, hi = spans[key]
        return [k - start for k in range(lo, hi) if not isinstance(program.instrs[k - start], Barrier)]

    # The nodes between (V's quantization) run on the vector unit while the arrays multiply the
    # first group's QK^T, where they share nothing with it; else before it.
    first, between = own(("qk", 0)), [k for key in others for k in own(key)]
    if first and between and _apart(program, first, between):
        steps = [(("qk", "between"), _timed(program, arch, first, between))]
    else:
        steps = [(key, own(key)) for key in others] + [(("qk",), first)]
    for g in range(count):
        # The next group's QK^T first: the next softmax's input is ready the sooner.
        mats = (own(("qk", g + 1)) if g + 1 < count else []) + (own(("pv", g - 1)) if g else [])
        rows = own(("softmax", g))
        label = (("qk",) if g + 1 < count else ()) + (("pv",) if g else ()) + ("softmax",)
        steps.append((label, _timed(program, arch, mats, rows) if mats and _apart(program, mats, rows) else mats + rows))
    steps.append((("pv",), own(("pv", count - 1))))
    return steps


def _timed(program: Program, arch, mats: list[int], rows: list[int]) -> list[int]:
    """``mats`` and ``rows`` merged, each in its order, so that the row kernel's vector work is
    spread over the matmuls' array time: each instruction placed at the share of its own
    list's busiest-queue cycles done before it (``mat`` for the matmuls, ``vec`` for the row
    kernel), a DMA with the instruction before it."""
    a, b = _progress(program, arch, mats, "mat"), _progress(program, arch, rows, "vec")
    keyed = sorted([(x, 0, n, k) for n, (k, x) in enumerate(zip(mats, a))] +
                   [(x, 1, n, k) for n, (k, x) in enumerate(zip(rows, b))])
    return [k for *_, k in keyed]


def _staying(program: Program, arch, ks: list[int], softmax: set[int]) -> set[int]:
    """The loads of the step ``ks`` that keep their place: the softmax's (among ``softmax``) unless
    the arrays bound the step (``ARRAYS_BOUND``). The products' loads go ahead of the softmax's
    stores in every step: queued behind them, they waited for the softmax's vector work, and the
    arrays idled (2B4T layer on dlegion-8x8: at 512 776,769 -> 774,784 cycles, at 256 378,774 ->
    378,660, at 128 209,666 -> 209,141, int8x2 at 512 926,959 -> 926,803; past the softmax's
    loads too, at 512 774,098 but at 256 379,133)."""
    return set() if _arrays_bound(program, arch, ks) else softmax


def _arrays_bound(program: Program, arch, ks: list[int]) -> bool:
    """Whether the busiest Legion's passes among ``ks`` take ``ARRAYS_BOUND`` times the busiest
    Legion's vector work there."""
    env, busy = Env(tuple(program.tensors), {}), Counter()
    for k in ks:
        i = program.instrs[k]
        if not isinstance(i, Wait) and i.queue() in ("mat", "vec"):
            for legion in range(i.legion, i.legion + _span(i)):
                busy[i.queue(), legion] += _cycles(i, arch, env)
    most = {q: max((c for (queue, _), c in busy.items() if queue == q), default=0) for q in ("mat", "vec")}
    times, of = ARRAYS_BOUND
    return most["mat"] * of > most["vec"] * times


def _cycles(i, arch, env) -> int:
    """An instruction's cycles, a masked one's dense: an upper bound."""
    i = replace(i, mask=None) if getattr(i, "mask", None) is not None else i
    return cost(i, arch, env).cycles


def _progress(program: Program, arch, ks: list[int], queue: str) -> list[float]:
    """For each of ``ks``, the share of its ``queue`` cycles done before it."""
    env = Env(tuple(program.tensors), {})
    cycles = []
    for k in ks:
        i = program.instrs[k]
        if isinstance(i, Wait) or i.queue() != queue:
            cycles.append(0)
            continue
        cycles.append(_cycles(i, arch, env) * _span(i))
    total = sum(cycles) or 1
    done = np.cumsum([0] + cycles[:-1]) / total
    return done.tolist()
