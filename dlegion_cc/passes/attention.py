"""Attention's float products on the systolic arrays: QK^T and PV quantized to int8 on the fly.

Source construct (every BitNet and Llama export leaves both products in float)::

    s = MatMul(q, k_t)          # QK^T, k_t = Transpose(k) or any [.., D, S] value
    o = MatMul(p, v)            # PV

becomes, for each MatMul of two run-time float operands::

    a8, ra = dlegion.AbsmaxQuantize(a)          # per row of a: a token of Q, a row of P (P made
                                                # quantized by its softmax: _quantized_softmax)
    bt = Transpose(b)                           # (b's own source when b is a transpose)
    bt = Sub(bt, ReduceMean(bt, axes=[-2]))     # QK^T only: K smoothed (see below)
    b8t, rb = dlegion.AbsmaxQuantize(bt)        # per column of b: a token of K, a channel of V
    y = dlegion.AttnMatMul(a8, ra, Transpose(b8t), rb)

``AttnMatMul`` is a w8 matmul with int32 accumulation whose drain multiplies row i by ``ra[i]``
and column j by ``rb[j]``. Smoothing K (SageAttention, Zhang et al., arXiv 2410.02367):
subtracting K's mean over the sequence from every token changes each score row i by the one
constant ``q_i . mean``, which the softmax cancels; it removes the bias K's channels share, so
the per-token scales resolve what differs between tokens. It is applied only where the scores
reach a softmax over the keys through nothing but a scalar Mul and an added mask.

``--attention int8x2`` gives every operand a second int8 piece, what the first leaves over::

    s = x / r;  lo = Clip(Round(254 (s - Round(s))), -127, 127);  r_lo = r / 254

so ``x ~ r hi + r_lo lo`` to some 15 bits (``|s - Round(s)| <= 1/2``: 254 of them fit int8), and
each product becomes one of the pieces, three products on the arrays (``qmatmul.TWO_PIECE_TERMS``;
lo . lo, 2^-16 of the rest, is left out)::

    y = AttnMatMul(a8, ra, b8, rb, alo, blo)
      = (a8 . b8) ra rb + (alo . b8 + a8 . blo) ra (rb / 254)      # each sum exact in int32

the cross products summed in the accumulators (a's second scale is ra / 254 and b's rb / 254, so
both take ``ra (rb / 254)``) and drained onto hi . hi in fp32, in the vector scratchpad, not in
DRAM.

P's second piece is made in its softmax kernel from ``127 e`` as the first is. Q's and K's
pieces are made as they are quantized (per row, K smoothed), V's in V's own layout, its channel
scales read along the rows, so V's quantization still reads its columns in place.

This is an approximation of ONNX's fp32 semantics, recorded in the program (``int8_attention``
or ``int8x2_attention``, with the output of every product quantized) for ``dlegion-run --check``.
``--attention fp32`` keeps the products in fp32 on the vector lanes; the default quantizes them
in one piece where the model's projections are quantized. A product with fewer rows than the
machine's arrays (a decode step's) stays fp32 by default.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlegion_cc.ir import DLEGION, Graph, Node, Value
from dlegion_cc.passes.causal import Finiteness

APPROXIMATION = "int8_attention"
MODES = ("int8", "int8x2", "fp32")
# The approximation each quantizing mode records, and how many int8 pieces an operand gets.
QUANTIZED = {"int8": (APPROXIMATION, 1), "int8x2": ("int8x2_attention", 2)}
# The second piece's steps per step of the first: the first leaves at most half a step over,
# and 254 halves fit int8's [-127, 127].
LOW_STEPS = 254.0
# The second piece's Clip changes no value (fused.identity_clips emits nothing for it): s - Round(s)
# is exact in fp32 and at most 1/2, so LOW_STEPS times it rounds to at most 127; a NaN passes.
WITHIN = (-127.0, 127.0)


def chosen_mode(graph: Graph, wanted: str | None) -> str:
    """``wanted``, or by default int8 where the model's projections run quantized on the arrays."""
    if wanted is not None:
        return wanted
    return "int8" if any(n.domain == DLEGION and n.op == "QMatMul" for n in graph.nodes) else "fp32"


@dataclass(frozen=True)
class QuantizeAttention:
    name: str = "attention"

    def run(self, graph: Graph, options) -> None:
        mode = chosen_mode(graph, getattr(options, "attention", None))
        if mode not in QUANTIZED:
            return
        quantized: dict[str, list[tuple[str, str]]] = {}
        finite = Finiteness(graph)
        # By default a product of fewer rows than an array has (a decode step's few query rows
        # against its whole cache) keeps fp32: quantizing the cache on the vector unit would
        # cost more than the product itself. --attention int8 (int8x2) quantizes it all the same.
        rows = 0 if getattr(options, "attention", None) in QUANTIZED else options.arch.array
        for node in list(graph.nodes):
            # A NaN or an infinity would be lost in int8 (stored as 0, or saturated): ONNX
            # spreads it, so such products keep fp32.
            if (_float_product(graph, node) and graph.values[node.inputs[0]].shape[-2] >= rows
                    and all(finite.known(i) for i in node.inputs)):
                _rewrite(graph, node, quantized, *QUANTIZED[mode])


def _float_product(graph: Graph, node: Node) -> bool:
    """A MatMul of two float32 matrices (or batches of them) both computed at run time."""
    if node.op != "MatMul" or node.domain or len(node.inputs) != 2:
        return False
    values = [graph.values[i] for i in node.inputs]
    return all(v.stored is None and len(v.shape) >= 2 and np.dtype(v.dtype) == np.float32 for v in values)


def _rewrite(graph: Graph, mm: Node, quantized: dict, approximation: str, pieces: int) -> None:
    """``mm`` made the sum of the products of its operands' int8 pieces (one or two each)."""
    a, b = mm.inputs
    if a not in quantized:
        quantized[a] = _a_pieces(graph, a, graph.nodes.index(mm), pieces, approximation)
    b_pieces = _b_pieces(graph, mm, pieces, approximation)
    attrs = {k: v for k, v in mm.attrs.items() if k in ("dead", "zero_a")}
    # The program names the product by its output in the model, which --check's yardstick
    # quantizes (runtime/reference64.py): the products this pass leaves fp32 are not named.
    attrs["approximation"], attrs["approximated"] = approximation, graph.origins.get(mm.name, mm.outputs[0])
    (a8, ra), (b8, rb) = quantized[a][0], b_pieces[0]
    inputs = [a8, ra, b8, rb]
    if pieces == 2:     # the second pieces (scales: the first's / LOW_STEPS): lo . hi + hi . lo
        inputs += [quantized[a][1][0], b_pieces[1][0]]
    graph.nodes[graph.nodes.index(mm)] = Node("AttnMatMul", mm.name, inputs, list(mm.outputs), attrs, DLEGION)


def _a_pieces(graph: Graph, a: str, at: int, pieces: int, approximation: str) -> list[tuple[str, str]]:
    """``a``'s int8 pieces per row, each with its row scales, inserted before node ``at``; a
    softmax's made in its kernel."""
    softmax, reshape = _softmax_of(graph, a)
    if softmax is not None:
        return [_reshaped(graph, qr, reshape) for qr in _quantized_softmax(graph, softmax, pieces)]
    a8, ra = absmax(graph, a, at, approximation)
    if pieces == 1:
        return [(a8, ra)]
    return [(a8, ra), _low_piece(graph, a, ra, ra, at + 1)]


def _b_pieces(graph: Graph, mm: Node, pieces: int, approximation: str) -> list[tuple[str, str]]:
    """``mm``'s b in int8 pieces per column, each with its column scales [.., N, 1], inserted
    before ``mm``: quantized as rows of b transposed (K smoothed where its scores reach a
    softmax alone), a repeated K/V head once."""
    b, expand = _repeated(graph, mm.inputs[1])
    bt, nodes = _transposed(graph, b)
    through = not nodes         # bt is b's own source, not a transpose made here
    source, mean = bt, None
    if _feeds_softmax(graph, mm.outputs[0]):
        bt, more = _smoothed(graph, bt)
        mean = more[0].outputs[0]
        nodes += more
    for n in nodes:
        graph.nodes.insert(graph.nodes.index(mm), n)
    b8t, rb = absmax(graph, bt, graph.nodes.index(mm), approximation)
    b8, [swap] = _transposed(graph, b8t, through=False)
    graph.nodes.insert(graph.nodes.index(mm), swap)
    out = [(b8, rb)]
    if pieces == 2:
        out.append(_b_low_piece(graph, mm, b, source, mean, rb, through))
    if expand is not None:          # each query head of a group reads its K/V head in place
        out = [tuple(_expand(graph, v, shape, graph.nodes.index(mm)) for v, shape in zip(piece, expand))
               for piece in out]
    return out


def _b_low_piece(graph: Graph, mm: Node, b: str, bt: str, mean: str | None, rb: str,
                 through: bool) -> tuple[str, str]:
    """b's second int8 piece in b's layout: made from b's transposed source when b is a
    transpose of it (K, smoothed again by its mean: the smoothed K stays unstored), else from
    b itself with its column scales read along the rows (V, whose quantization then still reads
    its columns in place: passes/attnoperands.py)."""
    at = graph.nodes.index(mm)
    if not through:
        shape = graph.values[rb].shape
        cols = _reshape(graph, rb, (*shape[:-2], 1, shape[-2]), at)
        return _low_piece(graph, b, cols, rb, graph.nodes.index(mm))
    if mean is not None:
        smooth = graph.add_value(f"{bt}_smooth_lo", graph.values[bt].shape, np.float32)
        graph.nodes.insert(at, Node("Sub", graph.fresh(f"{bt}_smooth_lo"), [bt, mean], [smooth]))
        bt = smooth
    lo_t, rlo = _low_piece(graph, bt, rb, rb, graph.nodes.index(mm))
    lo, [swap] = _transposed(graph, lo_t, through=False)
    graph.nodes.insert(graph.nodes.index(mm), swap)
    return lo, rlo


def _low_piece(graph: Graph, x: str, r: str, scales: str, at: int) -> tuple[str, str]:
    """Insert before node ``at`` the second int8 piece of ``x`` quantized by ``r`` (broadcast
    over ``x``), what ``Round(x / r)`` leaves over in steps of ``r / LOW_STEPS``: ``Clip(Round(
    LOW_STEPS (s - Round(s))))`` with ``s = x / r`` divided as AbsmaxQuantize divides; and its
    scales ``scales / LOW_STEPS``. Plain ONNX ops: the row-kernel fusion makes them one kernel,
    and the piece is stored int8 (``Clip(Round(.))``, ``context.int8_activations``)."""
    shape = graph.values[x].shape
    names = {k: graph.add_value(f"{x}_lo_{k}", shape, np.float32) for k in ("s", "hi", "d", "steps", "round", "q")}
    rlo = graph.add_value(f"{scales}_lo", graph.values[scales].shape, np.float32)
    c = {k: graph.add_value(f"{x}_lo_{k}", (), np.float32, np.array(v, np.float32))
         for k, v in (("steps", LOW_STEPS), ("lo", -127.0), ("hi127", 127.0))}
    n = lambda op, ins, out: Node(op, graph.fresh(f"{x}_lo_{out}"), ins, [names[out]])  # noqa: E731
    nodes = [n("Div", [x, r], "s"), n("Round", [names["s"]], "hi"), n("Sub", [names["s"], names["hi"]], "d"),
             n("Mul", [names["d"], c["steps"]], "steps"), n("Round", [names["steps"]], "round"),
             Node("Clip", graph.fresh(f"{x}_lo_q"), [names["round"], c["lo"], c["hi127"]], [names["q"]],
                  {"within": WITHIN}),
             Node("Div", graph.fresh(f"{scales}_lo"), [scales, c["steps"]], [rlo])]
    graph.nodes[at:at] = nodes
    return names["q"], rlo


def _reshape(graph: Graph, x: str, shape: tuple, at: int) -> str:
    """Insert ``Reshape(x, shape)`` before node ``at``; returns its output (a view)."""
    out = graph.add_value(f"{x}_as", shape, graph.values[x].dtype)
    dims = graph.add_value(f"{x}_as_shape", (len(shape),), np.int64, np.array(shape, np.int64))
    graph.nodes.insert(at, Node("Reshape", graph.fresh(f"{x}_reshape"), [x, dims], [out]))
    return out


def absmax(graph: Graph, x: str, at: int, approximation: str = APPROXIMATION) -> tuple[str, str]:
    """Insert ``q, r = AbsmaxQuantize(x)`` (int8 per row) before node ``at``, recorded in the
    program as ``approximation``."""
    shape = graph.values[x].shape
    q, r = graph.fresh(f"{x}_q"), graph.fresh(f"{x}_r")
    graph.values[q] = Value(q, shape, np.dtype(np.int8))
    graph.values[r] = Value(r, (*shape[:-1], 1), np.dtype(np.float32))
    graph.nodes.insert(at, Node("AbsmaxQuantize", graph.fresh(f"{x}_absmax"), [x], [q, r],
                                {"approximation": approximation}, DLEGION))
    return q, r


def _softmax_of(graph: Graph, p: str) -> tuple[Node | None, Node | None]:
    """The softmax over the last axis that makes ``p``, when nothing else reads ``p``, and the
    Reshape that keeps the last axis between them, if any (the heads split by passes/gqa.py)."""
    node, reshape = graph.producer(p), None
    if graph.only_user(p) is None:
        return None, None
    if node is not None and node.op == "Reshape" and not node.domain:
        reshape, p = node, node.inputs[0]
        if graph.values[p].shape[-1] != graph.values[reshape.outputs[0]].shape[-1] or graph.only_user(p) is None:
            return None, None
        node = graph.producer(p)
    if node is None or node.op != "Softmax" or node.domain:
        return None, None
    rank = len(graph.values[p].shape)
    return (node, reshape) if node.attrs.get("axis", -1) % rank == rank - 1 else (None, None)


def _reshaped(graph: Graph, qr: tuple[str, str], reshape: Node | None) -> tuple[str, str]:
    """The quantized values and their row scales in the shape ``reshape`` gives (views)."""
    if reshape is None:
        return qr
    shape = graph.values[reshape.outputs[0]].shape
    out = []
    for name, want in zip(qr, (shape, (*shape[:-1], 1))):
        new = graph.add_value(f"{name}_rows", want, graph.values[name].dtype)
        dims = graph.add_value(f"{name}_shape", (len(want),), np.int64, np.array(want, np.int64))
        graph.nodes.insert(graph.nodes.index(reshape), Node("Reshape", graph.fresh(f"{name}_reshape"), [name, dims],
                                                            [new]))
        out.append(new)
    return out[0], out[1]


def _quantized_softmax(graph: Graph, softmax: Node, pieces: int = 1) -> list[tuple[str, str]]:
    """``softmax`` replaced by P quantized per row, without P: with e = exp(x - max x), whose
    row maximum is exactly 1, ``q = round(127 e)`` and the row scale ``1 / (127 sum e)``, so
    ``q * scale`` is P to int8 precision (absmax per row). Plain ONNX ops, so the row-kernel
    fusion makes them one kernel with the scores' scale and mask, and P never goes to DRAM in
    fp32; ``q`` is kept there as int8 (``Clip(Round(.))``, ``context.int8_activations``). With
    two ``pieces``, also P's second piece from the same ``127 e`` (``_low_piece``'s, s = 127 e)."""
    x, (p,) = softmax.inputs[0], softmax.outputs
    shape, rank = graph.values[x].shape, len(graph.values[x].shape)
    col = (*shape[:-1], 1)
    rows = ("max", "sum", "sum127", "r", "r_lo")
    names = {k: graph.add_value(f"{p}_{k}", col if k in rows else shape, np.float32)
             for k in ("max", "d", "e", "sum", "e127", "round", "q", "sum127", "r")
             + ("left", "steps", "lo_round", "lo", "r_lo")[:5 * (pieces - 1)]}
    c = {k: graph.add_value(f"{p}_{k}", (), np.float32, np.array(v, np.float32))
         for k, v in (("127", 127.0), ("lo", -128.0), ("hi", 127.0), ("lo127", -127.0),
                      ("low_steps", LOW_STEPS))[:3 + 2 * (pieces - 1)]}
    last = {"axes": [rank - 1], "keepdims": 1}
    n = lambda op, ins, out, **attrs: Node(op, graph.fresh(f"{p}_{out}"), ins, [names[out]], attrs)  # noqa: E731
    # Under a causal mask, q's columns past each row's reach are zeros and its reductions see
    # the same there as over the whole row, as for the softmax (fused._reach).
    reach = {"reach": softmax.attrs["reach"]} if "reach" in softmax.attrs else {}
    nodes = [n("ReduceMax", [x], "max", **last, softmax_part=True), n("Sub", [x, names["max"]], "d"),
             n("Exp", [names["d"]], "e"), n("ReduceSum", [names["e"]], "sum", **last, softmax_part=True),
             n("Mul", [names["e"], c["127"]], "e127"), n("Round", [names["e127"]], "round"),
             n("Clip", [names["round"], c["lo"], c["hi"]], "q", **reach),
             n("Mul", [names["sum"], c["127"]], "sum127"), n("Reciprocal", [names["sum127"]], "r")]
    out = [(names["q"], names["r"])]
    if pieces == 2:
        nodes += [n("Sub", [names["e127"], names["round"]], "left"), n("Mul", [names["left"], c["low_steps"]], "steps"),
                  n("Round", [names["steps"]], "lo_round"),
                  n("Clip", [names["lo_round"], c["lo127"], c["hi"]], "lo", **reach, within=WITHIN),
                  n("Div", [names["r"], c["low_steps"]], "r_lo")]
        out.append((names["lo"], names["r_lo"]))
    at = graph.nodes.index(softmax)
    graph.nodes[at:at + 1] = nodes
    return out


def _swaps_last_two(node: Node | None, rank: int) -> bool:
    if node is None or node.op != "Transpose" or node.domain:
        return False
    perm = list(node.attrs.get("perm", range(rank)[::-1]))
    return perm == list(range(rank - 2)) + [rank - 1, rank - 2]


def _transposed(graph: Graph, x: str, through: bool = True) -> tuple[str, list[Node]]:
    """``x`` with its last two axes swapped: the input of the transpose that made ``x`` (with
    ``through``), else a new Transpose node (returned, not inserted)."""
    shape = graph.values[x].shape
    rank = len(shape)
    src = graph.producer(x)
    if through and _swaps_last_two(src, rank):
        return src.inputs[0], []
    out = graph.add_value(f"{x}_t", (*shape[:-2], shape[-1], shape[-2]), graph.values[x].dtype)
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    return out, [Node("Transpose", graph.fresh(f"{x}_transpose"), [x], [out], {"perm": perm})]


def _repeated(graph: Graph, b: str) -> tuple[str, tuple | None]:
    """``b`` before the Expand that repeats it along leading axes (grouped-query attention's
    K/V heads, ``passes/gqa.py``), looking through a transpose of the last two axes, and the
    shapes of ``b`` and of its per-column scales; else ``b`` and None. The repeats are
    quantized once, and the matmul reads each repeat in place (a 0 stride)."""
    shape = graph.values[b].shape
    swap = graph.producer(b) if _swaps_last_two(graph.producer(b), len(shape)) else None
    src = swap.inputs[0] if swap is not None else b
    e = graph.producer(src)
    if e is None or e.op != "Expand" or e.domain or len(graph.values[e.inputs[0]].shape) != len(shape):
        return b, None
    small = graph.values[e.inputs[0]].shape
    if tuple(small[-2:]) != tuple(graph.values[src].shape[-2:]):
        return b, None
    if swap is None:
        return e.inputs[0], (shape, (*shape[:-2], shape[-1], 1))
    # b = Transpose(Expand(s)): the same as Expand(Transpose(s)), with Transpose(s) made here.
    base, [t] = _transposed(graph, e.inputs[0], through=False)
    graph.nodes.insert(graph.nodes.index(swap), t)
    return base, (shape, (*shape[:-2], shape[-1], 1))


def _expand(graph: Graph, x: str, shape: tuple, at: int) -> str:
    """Insert ``Expand(x, shape)`` before node ``at``; returns its output."""
    out = graph.add_value(f"{x}_repeats", shape, graph.values[x].dtype)
    dims = graph.add_value(f"{x}_repeats_shape", (len(shape),), np.int64, np.array(shape, np.int64))
    graph.nodes.insert(at, Node("Expand", graph.fresh(f"{x}_expand"), [x, dims], [out]))
    return out


def _smoothed(graph: Graph, kt: str) -> tuple[str, list[Node]]:
    """``kt - mean(kt)`` over its tokens (axis -2): the nodes and the result."""
    shape = graph.values[kt].shape
    mean = graph.add_value(f"{kt}_mean", (*shape[:-2], 1, shape[-1]), np.float32)
    out = graph.add_value(f"{kt}_smooth", shape, np.float32)
    return out, [Node("ReduceMean", graph.fresh(f"{kt}_mean"), [kt], [mean], {"axes": [len(shape) - 2], "keepdims": 1}),
                 Node("Sub", graph.fresh(f"{kt}_smooth"), [kt, mean], [out])]



def _feeds_softmax(graph: Graph, scores: str) -> bool:
    """Whether ``scores`` reach nothing but a softmax over their last axis, through an optional
    Reshape that keeps the last axis, Mul by a scalar constant and Add of a constant (a mask):
    adding a constant to every score of a row is then invisible."""
    node, name, seen = graph.only_user(scores), scores, set()
    while node is not None and node.op in ("Mul", "Add", "Reshape") and not node.domain and node.op not in seen:
        if node.op == "Reshape":        # rows stay rows (the heads split by passes/gqa.py, merged again)
            if graph.values[node.outputs[0]].shape[-1] != graph.values[name].shape[-1]:
                return False
            seen.add(node.op)
            name = node.outputs[0]
            node = graph.only_user(name)
            continue
        other = node.inputs[1] if node.inputs[0] == name else node.inputs[0]
        c = graph.const(other)
        if c is None or (node.op == "Mul" and c.size != 1):
            return False
        if graph.values[node.outputs[0]].shape != graph.values[name].shape:
            return False
        seen.add(node.op)
        name = node.outputs[0]
        node = graph.only_user(name)
    if node is None or node.op != "Softmax" or node.domain:
        return False
    rank = len(graph.values[name].shape)
    return node.attrs.get("axis", -1) % rank == rank - 1
