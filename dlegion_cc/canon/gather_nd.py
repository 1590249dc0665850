"""GatherND with constant indices, as torch.onnx writes advanced indexing (transformers' masks
index the attention mask by ``[batch, kv]`` index grids): a Gather of the data's leading axes
merged into one, at the flat positions the index tuples name. Its indices are usually shape
computations, constant once folded: until then the node is kept, and a later round rewrites it;
one whose indices depend on the inputs stays, and is refused as unsupported."""
from __future__ import annotations

import math

import numpy as np

from dlegion_cc.canon import expands
from dlegion_cc.canon.builder import attr


@expands("GatherND")
def gather_nd(node, b):
    data, indices = node.input
    given = b.value(indices)
    dims = b.dims(data)
    if given is None or None in dims:
        b.keep(node)
        return
    if attr(node, "batch_dims", 0):
        raise ValueError("batch_dims other than 0 is not supported")
    k = given.shape[-1]
    lead = np.array(dims[:k], np.int64)
    if np.any((given < -lead) | (given >= lead)):
        raise ValueError(f"invalid ONNX model: an index lies outside data of shape {dims}")
    strides = np.array([math.prod(dims[i + 1:k]) for i in range(k)], np.int64)
    flat = ((given % lead) * strides).sum(axis=-1)
    merged = b.op("Reshape", [data, b.const([math.prod(dims[:k])] + dims[k:], "shape", np.int64)])
    b.op("Gather", [merged, b.const(flat, "rows", np.int64)], node.output[0], axis=0)
