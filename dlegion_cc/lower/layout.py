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


def is_contiguous(op: Operand, shape: tuple[int, ...]) -> bool:
    """Whether ``op`` walks ``shape`` in row-major order without gaps (size-1 dimensions'
    strides do not matter)."""
    return all(d == 1 or s == c for d, s, c in zip(shape, op.strides, contiguous_strides(shape)))


def transposed(op: Operand, perm) -> Operand:
    """``op`` with its axes in the order ``perm`` (axis i of the result is axis ``perm[i]``)."""
    return Operand(op.tensor, op.offset, tuple(op.strides[p] for p in perm))


def reshaped(op: Operand, shape: tuple[int, ...], new_shape: tuple[int, ...]) -> Operand | None:
    """``op`` (of ``shape``) read in ``new_shape``, the same elements in row-major order, with
    no copy; None when strides cannot say it. As numpy decides: dimensions merge or split only
    within a run that is contiguous in itself."""
    if 0 in shape or 0 in new_shape:
        return None
    old = [(d, s) for d, s in zip(shape, op.strides) if d != 1]
    strides, oi, ni = [0] * len(new_shape), 0, 0
    while ni < len(new_shape):
        if new_shape[ni] == 1:
            ni += 1
            continue
        if oi == len(old):
            return None
        nj, oj, n_size, o_size = ni + 1, oi + 1, new_shape[ni], old[oi][0]
        while n_size != o_size:
            if n_size < o_size and nj < len(new_shape):
                n_size, nj = n_size * new_shape[nj], nj + 1
            elif n_size > o_size and oj < len(old):
                o_size, oj = o_size * old[oj][0], oj + 1
            else:
                return None
        if any(old[k][1] != old[k + 1][1] * old[k + 1][0] for k in range(oi, oj - 1)):
            return None
        step = old[oj - 1][1]
        for k in reversed(range(ni, nj)):
            strides[k], step = step, step * new_shape[k]
        ni, oi = nj, oj
    return Operand(op.tensor, op.offset, tuple(strides)) if oi == len(old) else None


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
