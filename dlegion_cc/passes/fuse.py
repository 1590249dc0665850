"""Fuse runs of row-local nodes into one ``dlegion.RowKernel``.

A node is row-local when each output row depends only on the same row of its inputs: the
element-wise ops, Clip, Where, float casts, and reductions / Softmax over the last axis. A run
of such nodes that share one frame (rows = everything but the last axis, cols = the last axis)
becomes a kernel that loads each row block once, runs every op on the vector unit with its
intermediates in the scratchpad, and stores only the values used outside the run. Inputs may
be full ``[rows, cols]``, a column ``[rows, 1]``, a row ``[cols]`` broadcast to every row, a
scalar, or a value that numpy-broadcasts to the frame's own shape along its leading dimensions
(an attention mask ``[seq, seq]`` added to scores ``[heads, seq, seq]``); anything else stays
unfused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dlegion_cc.ir import DLEGION, Graph, Node

ELEMENTWISE = {"Abs", "Neg", "Exp", "Log", "Sqrt", "Reciprocal", "Relu", "Sigmoid", "Tanh", "Floor",
               "Ceil", "Round", "Sign", "IsNaN", "Not", "Sin", "Cos", "Identity", "Add", "Sub", "Mul",
               "Div", "Pow", "Max", "Min", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual",
               "And", "Or", "Clip", "Where"}
ROW_REDUCE = {"ReduceMean", "ReduceMax", "ReduceMin", "ReduceSum"}
FLOATS = {np.dtype(np.float32), np.dtype(np.bool_)}


@dataclass(frozen=True)
class Frame:
    shape: tuple             # the N-D shape whose rows (all but the last axis) the kernel walks

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def cols(self) -> int:
        return self.shape[-1]


def shape_kind(shape: tuple[int, ...], frame: Frame, tiled: bool = False) -> str | None:
    """How a value of ``shape`` sits in ``frame``: full, col, row, scalar (None: it does not).
    With ``tiled``, also "tiled": a value that repeats along leading dimensions of the frame
    (``is_tiled``), read in the frame's own shape."""
    lead, last = shape[:-1], (shape[-1] if shape else 1)
    rows = math.prod(lead)
    if last not in (1, frame.cols):
        return None
    if rows == frame.rows and frame.rows > 1 or rows == frame.rows == 1:
        return "full" if last == frame.cols else "col"
    if rows == 1:
        return "row" if last == frame.cols and frame.cols > 1 else "scalar"
    if tiled and is_tiled(shape, frame):
        return "tiled"
    return None


def is_tiled(shape: tuple[int, ...], frame: Frame) -> bool:
    """Whether a value of ``shape`` repeats along some leading dimensions of ``frame.shape``
    (numpy broadcasting), holding neither one row nor all of them."""
    rows = math.prod(shape[:-1])
    if rows in (1, frame.rows) or len(shape) > len(frame.shape):
        return False
    return all(d in (1, f) for d, f in zip(shape[::-1], frame.shape[::-1]))


def _frame_of(graph: Graph, node: Node) -> Frame | None:
    src = node.inputs[0] if node.op in ROW_REDUCE or node.op == "Softmax" else node.outputs[0]
    shape = graph.values[src].shape
    if not shape:
        return None
    return Frame(tuple(shape))


def _last_axis_only(graph: Graph, node: Node) -> bool:
    rank = len(graph.values[node.inputs[0]].shape)
    if node.op == "Softmax":
        return node.attrs.get("axis", -1) % rank == rank - 1
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1]:
        axes = graph.const(node.inputs[1])
    if axes is None or len(axes) != 1 or int(np.asarray(axes).reshape(-1)[0]) % rank != rank - 1:
        return False
    return node.attrs.get("keepdims", 1) == 1


def row_local(graph: Graph, node: Node, frame: Frame) -> bool:
    if node.domain or len(node.outputs) != 1:
        return False
    if node.op not in ELEMENTWISE | ROW_REDUCE | {"Softmax", "Cast"}:
        return False
    if node.op in ROW_REDUCE | {"Softmax"} and not _last_axis_only(graph, node):
        return False
    if node.op == "Cast" and np.dtype(graph.values[node.outputs[0]].dtype) not in FLOATS:
        return False
    if node.op in ("Max", "Min") and len(node.inputs) != 2:
        return False
    values = [graph.values[n] for n in node.inputs + node.outputs if n]
    if any(np.dtype(v.dtype) not in FLOATS and v.const is None for v in values):
        return False
    ins = [graph.values[n] for n in node.inputs if n]
    out = graph.values[node.outputs[0]]
    # an output broadcast over the frame's rows (a mask next to the scores) has no rows to store
    return (shape_kind(out.shape, frame) in ("full", "col")
            and all(shape_kind(v.shape, frame, tiled=True) is not None for v in ins if v.const is None or v.const.size > 1))


@dataclass(frozen=True)
class FuseRowwise:
    name: str = "fuse"

    def run(self, graph: Graph, options) -> None:
        out, run_, frame = [], [], None
        for node in graph.nodes:
            if run_ and row_local(graph, node, frame):
                run_.append(node)
                continue
            out.extend(self._close(graph, run_, frame))
            f = _frame_of(graph, node) if not node.domain else None
            run_, frame = ([node], f) if f is not None and row_local(graph, node, f) else ([], None)
            if not run_:
                out.append(node)
        out.extend(self._close(graph, run_, frame))
        graph.nodes = out

    @staticmethod
    def _close(graph: Graph, run_: list[Node], frame: Frame | None) -> list[Node]:
        if len(run_) < 2:
            return run_
        produced = {o for n in run_ for o in n.outputs}
        inputs = list(dict.fromkeys(i for n in run_ for i in n.inputs if i and i not in produced))
        later = {i for n in graph.nodes if n not in run_ for i in n.inputs}
        outputs = [o for o in produced if o in later or o in graph.outputs]
        outputs = [o for n in run_ for o in n.outputs if o in outputs]
        values = {n: graph.values[n] for n in inputs + list(produced)}
        attrs = {"nodes": list(run_), "frame": frame, "values": values}
        return [Node("RowKernel", f"{run_[0].name}..{run_[-1].name}", inputs, outputs, attrs, DLEGION)]
