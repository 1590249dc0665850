"""onnxruntime's GroupQueryAttention (com.microsoft), as onnxruntime's CPU kernel computes it,
in the ops of transformers' attention (which ``passes/gqa.py`` and the lowering know)::

    q, k, v = query (packed: split) as [B, N, S, D] heads
    past_len[b] = 0 at the first prompt (S == total_sequence_length), else seqlens_k[b] + 1 - S
    with do_rotary: q, k rotated at positions past_len[b] + 0 .. S - 1
    present[b, :, j] = past[b, :, j] for j < past_len[b]; k[b, :, j - past_len[b]] for the next
        S positions; 0 beyond (T = max(total_sequence_length, past length) positions)
    y = softmax(q present_k^T * scale, keys j <= past_len[b] + i only) present_v, as [B, S, N * D]

Each query head reads the key/value head of its group, repeated as transformers repeats it.
seqlens_k is read at run time (a padded batch row has a shorter past, so in a batch each row's
new keys are gathered to their own positions). At a first prompt with padded rows, onnxruntime's
outputs at a row's positions past its length are not defined (its softmax reads probabilities
its product did not write); the positions within it match. total_sequence_length
must be known when compiling (it is a shape). Local windows, soft caps, smooth softmax,
attention bias, given position ids and head sinks are refused.
"""
from __future__ import annotations

import numpy as np
import onnx

from dlegion_cc.canon import expands
from dlegion_cc.canon.builder import Builder, attr, io
from dlegion_cc.canon.rotary import rotate
from dlegion_cc.ort_schemas import MS

LOWEST = float(np.finfo(np.float32).min)
REFUSED = {"local_window_size": -1, "softcap": 0.0, "smooth_softmax": 0, "qk_output": 0}


def _i64(b: Builder, value, what: str) -> str:
    return b.const(value, what, np.int64)


def _heads(b: Builder, x: str, batch: int, seq: int, heads: int, depth: int) -> str:
    """[B, S, N * D] -> [B, N, S, D]."""
    return b.op("Transpose", [b.op("Reshape", [x, _i64(b, [batch, seq, heads, depth], "shape")])], perm=[0, 2, 1, 3])


def _past_len(b: Builder, seqlens: str, batch: int, seq: int, prompt: bool) -> str:
    """Each batch row's past length as [B, 1, 1, 1] int64."""
    if prompt:
        return _i64(b, np.zeros((batch, 1, 1, 1)), "past_len")
    total = b.op("Cast", [b.op("Reshape", [seqlens, _i64(b, [batch, 1, 1, 1], "shape")])], to=onnx.TensorProto.INT64)
    return b.op("Sub", [total, _i64(b, seq - 1, "steps")])


def _present(b: Builder, past: str, new: str, past_len: str, dims: list[int], out: str) -> None:
    """``out`` [B, Nkv, T, D]: the past's first past_len rows, then the new ones, then zeros."""
    batch, kv, seq, depth, present, held = dims
    j = _i64(b, np.arange(present).reshape(1, 1, present, 1), "positions")
    if held < present:
        past = b.op("Concat", [past, b.const(np.zeros((batch, kv, present - held, depth)), "pad")], axis=2)
    elif held > present:
        past = b.op("Slice", [past, _i64(b, [0], "start"), _i64(b, [present], "end"), _i64(b, [2], "axis")])
    rows = b.op("Clip", [b.op("Sub", [j, past_len]), _i64(b, 0, "lo"), _i64(b, seq - 1, "hi")])
    moved = _moved(b, new, rows, dims) if batch > 1 else \
        b.op("Gather", [new, b.op("Reshape", [rows, _i64(b, [present], "shape")])], axis=2)
    is_new = b.op("Less", [j, b.op("Add", [past_len, _i64(b, seq, "seq")])])
    fresh = b.op("Where", [is_new, moved, b.const(0.0, "zero")])
    b.op("Where", [b.op("Less", [j, past_len]), past, fresh], out)


def _moved(b: Builder, new: str, rows: str, dims: list[int]) -> str:
    """The new rows at each present position, [B, Nkv, T, D], when batch rows have their own past
    length (``rows`` [B, 1, T, 1], the new row each position reads): one Gather of the new rows
    flattened over batch and head, at (b * Nkv + h) * S + rows[b, j]."""
    batch, kv, seq, depth, present, _ = dims
    base = _i64(b, (np.arange(batch * kv) * seq).reshape(batch, kv, 1, 1), "row_base")
    ids = b.op("Reshape", [b.op("Add", [rows, base]), _i64(b, [batch * kv * present], "shape")])
    flat = b.op("Reshape", [new, _i64(b, [batch * kv * seq, depth], "shape")])
    return b.op("Reshape", [b.op("Gather", [flat, ids], axis=0), _i64(b, [batch, kv, present, depth], "shape")])


def _repeat(b: Builder, kv: str, dims: list[int], group: int) -> str:
    """[B, Nkv, T, D] -> [B, Nkv * group, T, D], each head repeated for its group."""
    batch, heads, length, depth = dims
    wide = b.op("Expand", [b.op("Unsqueeze", [kv, _i64(b, [2], "axis")]),
                           _i64(b, [batch, heads, group, length, depth], "shape")])
    return b.op("Reshape", [wide, _i64(b, [batch, heads * group, length, depth], "shape")])


def _check(node: onnx.NodeProto) -> None:
    for name, default in REFUSED.items():
        if attr(node, name, default) != default:
            raise ValueError(f"{name}={attr(node, name)} is not supported")
    extra = [n for n in io(node.input, 12)[9:] if n]
    if extra:
        raise ValueError("position_ids, attention_bias and head_sink inputs are not supported")


@expands("GroupQueryAttention", domain=MS)
def group_query_attention(node, b):
    _check(node)
    query, key, value, past_k, past_v, seqlens, total_len, cos, sin = io(node.input, 12)[:9]
    y, present_k, present_v = io(node.output, 3)
    heads, kv_heads = attr(node, "num_heads"), attr(node, "kv_num_heads")
    batch, seq, hidden = b.dims(query)
    depth = hidden // (heads + 2 * kv_heads) if not key else hidden // heads
    total = b.value(total_len)
    if total is None:
        raise ValueError("total_sequence_length must be known when compiling (bind the sequence dims)")
    if attr(node, "do_rotary", 0) and cos and b.dims(cos)[0] < int(total.reshape(-1)[0]):
        # onnxruntime refuses it too: the last positions would have no rotation
        raise ValueError(f"total_sequence_length {int(total.reshape(-1)[0])} is past the model's "
                         f"{b.dims(cos)[0]} positions (the rows of '{cos}')")
    held = b.dims(past_k)[2] if past_k else 0
    length = max(int(total.reshape(-1)[0]), held)
    if not key:
        query, key, value = (b.fresh(w) for w in ("q", "k", "v"))
        b.nodes.append(onnx.helper.make_node("Split", [node.input[0], _i64(b, [heads * depth, kv_heads * depth,
                                              kv_heads * depth], "sizes")], [query, key, value], axis=-1,
                                             name=b.fresh("Split")))
    q, k, v = (_heads(b, x, batch, seq, n, depth) for x, n in ((query, heads), (key, kv_heads), (value, kv_heads)))
    prompt = seq == int(total.reshape(-1)[0])
    if batch > 1 and seq > 1 and not prompt:
        raise ValueError("a batch of more than one row with more than one new token after a past is not "
                         "supported (onnxruntime's kernel refuses it too)")
    past_len = _past_len(b, seqlens, batch, seq, prompt)
    if attr(node, "do_rotary", 0):
        q, k = _rotated(b, node, [q, k], past_len, cos, sin, batch, seq, [heads, kv_heads], depth)
    for past, new, out in ((past_k, k, present_k), (past_v, v, present_v)):
        if not past:
            raise ValueError("past_key and past_value are needed")
        _present(b, past, new, past_len, [batch, kv_heads, seq, depth, length, held], out or b.fresh("present"))
    _attend(b, node, q, present_k, present_v, past_len, [batch, heads, kv_heads, seq, depth, length], y)


def _rotated(b, node, xs, past_len, cos, sin, batch, seq, heads, depth) -> list[str]:
    pos = b.op("Add", [b.op("Reshape", [past_len, _i64(b, [batch, 1], "shape")]),
                       _i64(b, np.arange(seq).reshape(1, seq), "steps")])
    tables = [b.op("Unsqueeze", [b.op("Gather", [t, pos], axis=0), _i64(b, [1], "axis")]) for t in (cos, sin)]
    width = 2 * b.dims(cos)[-1]
    outs = []
    for x, n in zip(xs, heads):
        out = b.fresh("rotated")
        rotate(b, x, *tables, width, depth, bool(attr(node, "rotary_interleaved", 0)), out, [batch, n, seq, depth])
        outs.append(out)
    return outs


def _attend(b, node, q, present_k, present_v, past_len, dims, y) -> None:
    batch, heads, kv_heads, seq, depth, length = dims
    group = heads // kv_heads
    k = _repeat(b, present_k, [batch, kv_heads, length, depth], group)
    v = _repeat(b, present_v, [batch, kv_heads, length, depth], group)
    scale = attr(node, "scale", 0.0) or 1 / np.sqrt(depth)
    scores = b.op("Mul", [b.op("MatMul", [q, b.op("Transpose", [k], perm=[0, 1, 3, 2])]), b.const(scale, "scale")])
    reach = b.op("Add", [past_len, _i64(b, np.arange(seq).reshape(1, 1, seq, 1), "rows")])
    seen = b.op("LessOrEqual", [_i64(b, np.arange(length).reshape(1, 1, 1, length), "keys"), reach])
    probs = b.op("Softmax", [b.op("Where", [seen, scores, b.const(LOWEST, "lowest")])], axis=-1)
    out = b.op("Transpose", [b.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
    b.op("Reshape", [out, _i64(b, [batch, seq, heads * depth], "shape")], y)


def cache_head_dims(model: onnx.ModelProto) -> dict[str, int]:
    """The symbolic head size of GroupQueryAttention's past inputs (onnxruntime-genai's builder
    names it ``kv_cache_dim``), read from the width of the projection feeding its query: a
    size the compiler can bind when neither --dim nor generation gives it."""
    producers = {o: n for n in model.graph.node for o in n.output}
    weights = {t.name: list(t.dims) for t in model.graph.initializer}
    inputs = {i.name: i.type.tensor_type.shape.dim for i in model.graph.input}
    found = {}
    for node in model.graph.node:
        if node.op_type != "GroupQueryAttention" or len(node.input) < 4 or node.input[3] not in inputs:
            continue
        head = inputs[node.input[3]][-1] if inputs[node.input[3]] else None
        width = _width(node.input[0], producers, weights)
        if head is None or head.HasField("dim_value") or not head.dim_param or width is None:
            continue
        packed = len(node.input) < 2 or not node.input[1]     # query, key and value in one tensor
        heads = attr(node, "num_heads") + (2 * attr(node, "kv_num_heads") if packed else 0)
        if width % heads == 0:
            found[head.dim_param] = width // heads
    return found


def _width(name: str, producers: dict, weights: dict, depth: int = 2) -> int | None:
    """The last dim of ``name`` where a projection makes it (a MatMul by a weight, MatMulNBits,
    either plus a bias), else None."""
    node = producers.get(name)
    if node is None or depth < 0:
        return None
    if node.op_type == "MatMulNBits":
        return attr(node, "N")
    if node.op_type == "MatMul" and node.input[1] in weights:
        return weights[node.input[1]][-1]
    if node.op_type == "Add":
        made = [i for i in node.input if i not in weights]
        return _width(made[0], producers, weights, depth - 1) if len(made) == 1 else None
    return None
