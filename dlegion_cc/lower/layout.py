"""N-D views of DRAM tensors and their reduction to the 2-D blocks instructions move.

An :class:`Operand` addresses an N-D tensor in DRAM by strides; broadcasting is a 0 stride.
Before emitting, adjacent dimensions that every operand walks contiguously are merged
(``coalesce``), so most element-wise ops become one 2-D loop of row blocks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Operand:
    """Element ``idx`` of the view is DRAM element ``offset + sum(idx[d] * strides[d])``."""

    tensor: int
    offset: int
    strides: tuple[int, ...]

    def at(self, index: tuple[int, ...]) -> "Operand":
        """The sub-view after fixing the leading ``len(index)`` dimensions."""
        off = self.offset + sum(i * s for i, s in zip(index, self.strides))
        return Operand(self.tensor, off, self.strides[len(index):])


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def whole(tensor: int, shape: tuple[int, ...]) -> Operand:
    return Operand(tensor, 0, contiguous_strides(shape))


def broadcast(op: Operand, shape: tuple[int, ...], out_shape: tuple[int, ...]) -> Operand:
    """View ``op`` (of ``shape``) in the frame of ``out_shape`` under numpy broadcasting."""
    lead = len(out_shape) - len(shape)
    strides = [0] * lead
    for d, s in zip(shape, op.strides):
        strides.append(0 if d == 1 else s)
    return Operand(op.tensor, op.offset, tuple(strides))


def coalesce(shape: tuple[int, ...], ops: list[Operand], keep_last: bool = False):
    """Merge dimensions every operand walks contiguously; drop size-1 dimensions.

    With ``keep_last`` the last dimension is never merged into (row reductions need it whole).
    Returns the new shape and operands, always with at least two dimensions.
    """
    dims = [(d, [o.strides[k] for o in ops]) for k, d in enumerate(shape)]
    last = dims.pop() if keep_last and dims else None
    dims = [x for x in dims if x[0] != 1]
    merged: list[tuple[int, list[int]]] = []
    for d, strides in dims:
        if merged and all(sp == s * d for sp, s in zip(merged[-1][1], strides)):
            merged[-1] = (merged[-1][0] * d, strides)
            continue
        merged.append((d, strides))
    if last is not None:
        merged.append(last)
    while len(merged) < 2:
        merged.insert(0, (1, [0] * len(ops)))
    new_shape = tuple(d for d, _ in merged)
    new_ops = [Operand(o.tensor, o.offset, tuple(m[1][k] for m in merged)) for k, o in enumerate(ops)]
    return new_shape, new_ops


def outer_indices(shape: tuple[int, ...]):
    """All indices of the dimensions before the last two (one 2-D loop each)."""
    outer = shape[:-2]
    for flat in range(math.prod(outer)):
        idx, rest = [], flat
        for d in reversed(outer):
            idx.append(rest % d)
            rest //= d
        yield tuple(reversed(idx))
