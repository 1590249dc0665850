"""Attention's quantized K and V made in one pass over their values, not through copies.

Source constructs (left by ``passes/attention.py``)::

    vt = Transpose(v)                      # [.., D, S]: V's channels as rows
    v8t, rv = dlegion.AbsmaxQuantize(vt)   # per channel
    v8 = Transpose(v8t)                    # [.., S, D], as P.V's arrays read it

becomes ``v8, rv = dlegion.ColumnAbsmaxQuantize(v)``: each channel's maximum is read down a
column of V as it is (a maximum is the same in any order), so neither transpose is copied; and::

    ks = Sub(k, ReduceMean(k, axes=[-2]))  # K smoothed
    k8, rk = dlegion.AbsmaxQuantize(ks)    # per token

becomes ``k8, rk = dlegion.SmoothAbsmaxQuantize(k, mean)``: the smoothed K is never stored.
Both compute the same instructions on the same values as before, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlegion_cc.ir import DLEGION, Graph, Node, Value
from dlegion_cc.lower.quant import ABSMAX_FLOOR
from dlegion_cc.passes.attention import LOW_STEPS, WITHIN, _swaps_last_two


@dataclass(frozen=True)
class QuantizeOperandsInPlace:
    name: str = "attention-operands"

    def run(self, graph: Graph, options) -> None:
        for node in list(graph.nodes):
            if node.domain == DLEGION and node.op == "AbsmaxQuantize":
                _by_columns(graph, node) or _smoothed(graph, node)



def _by_columns(graph: Graph, node: Node) -> bool:
    """Transpose -> AbsmaxQuantize -> Transpose of its values: one ColumnAbsmaxQuantize."""
    x, (q, r) = node.inputs[0], node.outputs
    rank = len(graph.values[x].shape)
    before, after = graph.producer(x), graph.only_user(q)
    if (not _swaps_last_two(before, rank) or graph.only_user(x) is not node
            or not _swaps_last_two(after, rank)):
        return False
    at = graph.nodes.index(node)
    graph.nodes[at] = Node("ColumnAbsmaxQuantize", node.name, [before.inputs[0]], [after.outputs[0], r],
                           dict(node.attrs), DLEGION)
    graph.nodes.remove(after)
    graph.nodes.remove(before)
    return True


def _smoothed(graph: Graph, node: Node) -> bool:
    """Sub(k, ReduceMean(k) over the tokens) -> AbsmaxQuantize: one SmoothAbsmaxQuantize."""
    sub = graph.producer(node.inputs[0])
    if sub is None or sub.op != "Sub" or sub.domain or graph.only_user(node.inputs[0]) is not node:
        return False
    k, mean = sub.inputs
    m = graph.producer(mean)
    rank = len(graph.values[k].shape)
    if (m is None or m.op != "ReduceMean" or m.domain or m.inputs[0] != k
            or [a % rank for a in m.attrs.get("axes", [])] != [rank - 2] or not m.attrs.get("keepdims", 1)):
        return False
    graph.nodes[graph.nodes.index(node)] = Node("SmoothAbsmaxQuantize", node.name, [k, mean], list(node.outputs),
                                                dict(node.attrs), DLEGION)
    graph.nodes.remove(sub)
    return True


@dataclass(frozen=True)
class QuantizeInRowKernel:
    """After ``FuseRowwise``: a row kernel whose full-width outputs are concatenated along
    their rows into Q, which AbsmaxQuantize quantizes per row (the rotary halves of Q), also
    computes the quantization: the row maximum of |Q| is the larger of its parts', and each
    part is divided and rounded as AbsmaxQuantize does it, bit for bit. The kernel stores the
    int8 parts straight into the int8 Q (``Clip(Round(.))``: ``context.int8_activations``), so
    the rotated Q never goes to DRAM in fp32 and is not read back. Under ``--attention int8x2``
    Q's second piece, whose row kernel reads Q and the scale beside the quantization, is made in
    the same kernel from the same quotients (the ops of ``passes/attention.py``'s ``_low_piece``)
    and stored int8 the same way.

    The Clips change nothing, and are marked so (``within``: no instruction is emitted for
    them): |x| <= m' = max(max|x|, floor) and r = fl(m' / 127) >= (m' / 127)(1 - 2^-24), so
    |x / r| rounds to at most 127 (a NaN or an infinity gives NaN, which a Clip passes)."""

    name: str = "quantize-in-kernel"

    def run(self, graph: Graph, options) -> None:
        for node in list(graph.nodes):
            if node.domain == DLEGION and node.op == "AbsmaxQuantize":
                _into_kernel(graph, node)


def _into_kernel(graph: Graph, quant: Node) -> bool:
    low = _low_piece_kernel(graph, quant)
    reshapes, name = [], quant.inputs[0]
    while (p := graph.producer(name)) is not None and p.op == "Reshape" and not p.domain:
        if (not _read_by(graph, name, quant, low)
                or graph.values[p.inputs[0]].shape[-1] != graph.values[name].shape[-1]):
            return False
        reshapes.append(p)
        name = p.inputs[0]
    cat = graph.producer(name)
    if cat is None or cat.op != "Concat" or cat.domain or graph.only_user(name) is None:
        return False
    rank = len(graph.values[name].shape)
    kernel = graph.producer(cat.inputs[0])
    if (cat.attrs.get("axis") % rank != rank - 1 or len(set(cat.inputs)) != len(cat.inputs)
            or any(graph.producer(i) is not kernel for i in cat.inputs)):
        return False
    if kernel is None or kernel.domain != DLEGION or kernel.op != "RowKernel":
        return False
    frame = kernel.attrs["frame"]
    if (any(graph.only_user(i) is not cat or graph.values[i].shape != frame.shape for i in cat.inputs)
            or quant.inputs[0] in graph.outputs or graph.values[name].shape[:-1] != frame.shape[:-1]):
        return False
    _quantize_parts(graph, kernel, cat, reshapes, quant, low)
    return True


# The ops of Q's second int8 piece (passes/attention.py's ``_low_piece``): s = Q / r, what
# Round(s) leaves over in LOW_STEPS steps, rounded, its Clip a proven identity.
LOW_PIECE_OPS = ("Div", "Round", "Sub", "Mul", "Round", "Clip")


def _low_piece_kernel(graph: Graph, quant: Node) -> Node | None:
    """The row kernel that makes the second int8 piece (``--attention int8x2``) of what ``quant``
    quantizes, from the same value and row scale, when it is that value's other reader."""
    x, r = quant.inputs[0], quant.outputs[1]
    others = [n for n in graph.consumers(x) if n is not quant]
    if len(others) != 1 or others[0].domain != DLEGION or others[0].op != "RowKernel":
        return None
    kernel = others[0]
    subs = kernel.attrs["nodes"]
    if (tuple(n.op for n in subs) != LOW_PIECE_OPS or subs[0].inputs != [x, r] or len(kernel.outputs) != 1
            or kernel.outputs != subs[-1].outputs or "within" not in subs[-1].attrs
            or graph.const(subs[3].inputs[1]) is None or float(graph.const(subs[3].inputs[1])) != LOW_STEPS):
        return None
    return kernel


def _read_by(graph: Graph, name: str, quant: Node, low: Node | None) -> bool:
    """Whether ``name`` is read by ``quant`` alone, or by it and its second piece's kernel."""
    return graph.only_user(name) is not None or (low is not None and quant.inputs[0] == name
                                                 and name not in graph.outputs and len(graph.consumers(name)) == 2)


def _quantize_parts(graph: Graph, kernel: Node, cat: Node, reshapes: list[Node], quant: Node,
                    low: Node | None = None) -> None:
    values, frame = kernel.attrs["values"], kernel.attrs["frame"]
    col = (*frame.shape[:-1], 1)
    last = {"axes": [len(frame.shape) - 1], "keepdims": 1}
    new = lambda base, shape, dtype=np.float32: _value(graph, values, base, shape, dtype)  # noqa: E731
    c = {k: _value(graph, values, f"{quant.name}_{k}", (), np.float32, np.array(v, np.float32))
         for k, v in (("floor", ABSMAX_FLOOR), ("127", 127.0), ("lo", -128.0), ("hi", 127.0))
         + ((("steps", LOW_STEPS), ("lo127", -127.0)) if low is not None else ())}
    nodes, maxima = [], []
    for part in cat.inputs:                          # the row maximum of |Q|, part by part
        a, m = new(f"{part}_abs", frame.shape), new(f"{part}_absmax", col)
        nodes += [Node("Abs", graph.fresh(f"{part}_abs"), [part], [a]),
                  Node("ReduceMax", graph.fresh(f"{part}_absmax"), [a], [m], dict(last))]
        maxima.append(m)
    m = maxima[0]
    for other in maxima[1:]:
        both = new(f"{quant.name}_max", col)
        nodes.append(Node("Max", graph.fresh(f"{quant.name}_max"), [m, other], [both]))
        m = both
    kept, r = new(f"{quant.name}_kept", col), new(f"{quant.name}_r", col)
    nodes += [Node("Max", graph.fresh(f"{quant.name}_kept"), [m, c["floor"]], [kept]),
              Node("Div", graph.fresh(f"{quant.name}_r"), [kept, c["127"]], [r],
                   {k: v for k, v in quant.attrs.items() if k == "approximation"})]
    parts, lows = [], []
    for part in cat.inputs:                          # each part / r, rounded, to int8
        d, rd, q = new(f"{part}_div", frame.shape), new(f"{part}_round", frame.shape), new(f"{part}_q", frame.shape, np.int8)
        nodes += [Node("Div", graph.fresh(f"{part}_div"), [part, r], [d]),
                  Node("Round", graph.fresh(f"{part}_round"), [d], [rd]),
                  Node("Clip", graph.fresh(f"{part}_q"), [rd, c["lo"], c["hi"]], [q], {"within": (-128.0, 127.0)})]
        parts.append(q)
        if low is not None:                          # its second piece, as _low_piece makes it
            nodes += _second_piece(graph, values, part, d, rd, c, frame.shape)
            lows.append(nodes[-1].outputs[0])
    kernel.attrs["nodes"] = kernel.attrs["nodes"] + nodes
    kernel.inputs = kernel.inputs + [v for v in c.values() if v not in kernel.inputs]
    kernel.outputs = [o for o in kernel.outputs if o not in cat.inputs] + parts + lows + [r]
    cat.inputs = parts
    if low is not None:
        _second_piece_out(graph, cat, lows, low)
    (q, rq), before = quant.outputs, quant.inputs[0]
    int8 = {v: _int8_value(graph, v) for v in [cat.outputs[0]] + [n.outputs[0] for n in reshapes]}
    src = int8[before]
    for n in graph.nodes:
        n.inputs = [src if i == q else i for i in n.inputs]
    dims = graph.add_value(f"{rq}_shape", (len(graph.values[rq].shape),), np.int64,
                           np.array(graph.values[rq].shape, np.int64))
    graph.nodes[graph.nodes.index(quant)] = Node("Reshape", graph.fresh(f"{rq}_reshape"), [r, dims], [rq])


def _second_piece(graph: Graph, values: dict, part: str, d: str, rd: str, c: dict, shape) -> list[Node]:
    """The nodes of ``part``'s second int8 piece from its quotient ``d`` and ``rd = Round(d)``."""
    names = {k: _value(graph, values, f"{part}_lo_{k}", shape, np.float32) for k in ("left", "steps", "round")}
    q = _value(graph, values, f"{part}_lo_q", shape, np.int8)
    return [Node("Sub", graph.fresh(f"{part}_lo_left"), [d, rd], [names["left"]]),
            Node("Mul", graph.fresh(f"{part}_lo_steps"), [names["left"], c["steps"]], [names["steps"]]),
            Node("Round", graph.fresh(f"{part}_lo_round"), [names["steps"]], [names["round"]]),
            Node("Clip", graph.fresh(f"{part}_lo_q"), [names["round"], c["lo127"], c["hi"]], [q], {"within": WITHIN})]


def _second_piece_out(graph: Graph, cat: Node, lows: list[str], low: Node) -> None:
    """The second pieces of the parts concatenated as Q's are, in place of ``low``'s output
    (int8, reshaped as it was: a view)."""
    (out,), full = low.outputs, graph.values[cat.outputs[0]].shape
    joined = graph.add_value(f"{out}_joined", full, np.int8)
    shape = graph.values[out].shape
    graph.values[out] = Value(out, shape, np.dtype(np.int8))
    dims = graph.add_value(f"{out}_shape", (len(shape),), np.int64, np.array(shape, np.int64))
    at = graph.nodes.index(low)
    graph.nodes[at:at + 1] = [Node("Concat", graph.fresh(f"{out}_concat"), lows, [joined], dict(cat.attrs)),
                              Node("Reshape", graph.fresh(f"{out}_reshape"), [joined, dims], [out])]


def _int8_value(graph: Graph, name: str) -> str:
    """``name`` (Q, or a view of it) replaced by an int8 value of its own: Q's codes are not the
    model's value, which ``dlegion-run --check-all`` compares under the model's name."""
    new = graph.add_value(f"{name}_int8", graph.values.pop(name).shape, np.int8)
    for n in graph.nodes:
        n.inputs = [new if i == name else i for i in n.inputs]
        n.outputs = [new if o == name else o for o in n.outputs]
    return new


def _value(graph: Graph, values: dict, base: str, shape, dtype, const=None) -> str:
    """A new value of the graph, also known to the kernel."""
    name = graph.add_value(base, shape, dtype, const)
    values[name] = graph.values[name]
    return name
