"""onnxruntime's RotaryEmbedding (com.microsoft) in the halves form ONNX's RotaryEmbedding
function writes (``passes/rope.py`` then runs it as one row kernel)::

    cos, sin = cos_cache[position_ids], sin_cache[position_ids]      # [B, S, R/2]
    x1, x2 = the two halves of x's first R features (interleaved: even and odd ones)
    y = concat(x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., R:])

x is [B, S, H * D] (num_heads given) or [B, H, S, D]. onnxruntime's position_ids may also be
one start offset, [1]: positions start + 0 .. S - 1 for every batch.
"""
from __future__ import annotations

import numpy as np

from dlegion_cc.canon import expands
from dlegion_cc.canon.builder import Builder, attr
from dlegion_cc.ort_schemas import MS


def positions(b: Builder, pos: str, batch: int, seq: int) -> str:
    """[B, S] position ids from onnxruntime's: as they are, or from a start offset [1]."""
    if b.rank(pos) == 2:
        return pos
    ids = b.op("Add", [pos, b.const(np.arange(seq).reshape(1, seq), "steps", np.int64)])
    return b.op("Expand", [ids, b.const([batch, seq], "shape", np.int64)])


def _slice(b: Builder, x: str, start: int, end: int, step: int = 1) -> str:
    return b.op("Slice", [x, *(b.const([v], what, np.int64) for v, what in
                               ((start, "start"), (end, "end"), (-1, "axis"), (step, "step")))])


def rotate(b: Builder, x: str, cos: str, sin: str, width: int, depth: int, interleaved: bool, out: str,
           shape: list[int]) -> None:
    """``out`` = x (of ``shape``, its last axis ``depth`` long) with its first ``width`` features
    rotated by ``cos`` and ``sin`` (broadcast against x's halves)."""
    half = width // 2
    x1, x2 = (_slice(b, x, 0, width, 2), _slice(b, x, 1, width, 2)) if interleaved else \
        (_slice(b, x, 0, half), _slice(b, x, half, width))
    real = b.op("Sub", [b.op("Mul", [x1, cos]), b.op("Mul", [x2, sin])])
    imag = b.op("Add", [b.op("Mul", [x2, cos]), b.op("Mul", [x1, sin])])
    if interleaved:
        last = b.const([-1], "last", np.int64)
        pairs = b.op("Concat", [b.op("Unsqueeze", [real, last]), b.op("Unsqueeze", [imag, last])], axis=-1)
        parts = [b.op("Reshape", [pairs, b.const(shape[:-1] + [width], "shape", np.int64)])]
    else:
        parts = [real, imag]
    if width < depth:
        parts.append(_slice(b, x, width, depth))
    b.op("Concat", parts, out, axis=-1)


@expands("RotaryEmbedding", domain=MS)
def rotary_embedding(node, b):
    x, pos, cos_cache, sin_cache = node.input[:4]
    if attr(node, "scale", 1.0) != 1.0 or attr(node, "is_packed_batching", 0):
        raise ValueError("scale other than 1 and packed batching are not supported")
    dims = b.dims(x)
    width = 2 * b.dims(cos_cache)[-1]
    if len(dims) == 3:
        heads = attr(node, "num_heads", 0) or dims[2] // int(attr(node, "rotary_embedding_dim", 0) or width)
        batch, seq, depth = dims[0], dims[1], dims[2] // heads
        shape, axis = [batch, seq, heads, depth], 2
    else:
        batch, seq, depth = dims[0], dims[2], dims[3]
        shape, axis = list(dims), 1
    width = attr(node, "rotary_embedding_dim", 0) or width
    ids = positions(b, pos, batch, seq)
    tables = [b.op("Unsqueeze", [b.op("Gather", [t, ids], axis=0), b.const([axis], "axis", np.int64)])
              for t in (cos_cache, sin_cache)]
    x4 = b.op("Reshape", [x, b.const(shape, "shape", np.int64)]) if len(dims) == 3 else x
    y4 = b.fresh("rotated") if len(dims) == 3 else node.output[0]
    rotate(b, x4, *tables, width, depth, bool(attr(node, "interleaved", 0)), y4, shape)
    if len(dims) == 3:
        b.op("Reshape", [y4, b.const(dims, "shape", np.int64)], node.output[0])
