"""What ONNX's function bodies write, in the forms the passes know: ``CastLike(c, x)`` is a
Cast to x's type (so a constant one folds), and a Sum of two is an Add (which fuses)."""
from __future__ import annotations

from dlegion_cc.canon import expands


@expands("CastLike")
def cast_like(node, b):
    target = b.types.get(node.input[1])
    if target is None or not target.elem_type:
        b.keep(node)
        return
    b.op("Cast", [node.input[0]], node.output[0], to=target.elem_type)


@expands("Sum")
def sum_of_two(node, b):
    if len(node.input) != 2:
        b.keep(node)
        return
    b.op("Add", list(node.input), node.output[0])
