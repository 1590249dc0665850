"""Tiny decoders with a key/value cache in the operator patterns other exporters write, made with
onnx.helper so that tests need no torch (issue 20's frontends):

- ``genai_fp32`` / ``genai_int4``: onnxruntime-genai's model builder (``-p fp32`` / ``-p int4``, CPU):
  SimplifiedLayerNormalization, then SkipSimplifiedLayerNormalization carrying the residual,
  GroupQueryAttention fed seqlens_k and total_sequence_length made from the attention mask,
  ``present.N.key/value`` outputs. The fp32 form rotates Q and K with com.microsoft's
  RotaryEmbedding at ``position_ids`` (the builder's unfused layout); the int4 form lets the
  attention rotate them (``do_rotary``, the builder's CPU default) and holds its projections and
  lm_head as MatMulNBits (4 bits, blocks of 32, accuracy_level 4).
- ``optimum``: Optimum's ``text-generation-with-past`` export of a Llama: plain ONNX ops, RMSNorm as
  Pow/ReduceMean/Add/Sqrt/Div, rotary with Gather of cos/sin caches at ``position_ids``, the past
  concatenated with the new keys, the attention mask expanded into a causal additive mask.
- ``opset23``: the same decoder in opset 23's RMSNormalization, RotaryEmbedding and Attention
  (with its past_key/past_value inputs and present outputs; the mask is given, as is_causal
  aligns to the upper left and so cannot describe a step after a past).

Each model has symbolic ``batch_size``, ``sequence_length``, ``past_sequence_length`` and
``total_sequence_length`` dims, so one file serves a prefill (empty past) and a decode step.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from models import golden

# A folder of their own: tests that take every models/*.onnx as a one-output model without a cache
# (test_check_verdict) are not about these.
MODELS_DIR = Path(__file__).resolve().parent / "forms"
GOLDEN_DIR = MODELS_DIR.parent.parent / "tests" / "golden"
MANIFEST = "FORMS_MANIFEST.json"
MS = "com.microsoft"
BATCH, SEQ, PAST, TOTAL = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"
NBITS_BLOCK = 32
# The golden runs: a prompt into an empty cache, and one token after a cache of PROMPT tokens;
# (sequence, past, batch). The batch-2 runs' second row has a shorter past at decode (PADDED
# positions of its attention mask are 0): grouped-query attention with a past length per row.
PROMPT = 5
PADDED = 2
STEPS = {"prefill": (PROMPT, 0, 1), "decode": (1, PROMPT, 1),
         "prefill_b2": (PROMPT, 0, 2), "decode_b2": (1, PROMPT, 2)}


@dataclass(frozen=True)
class FormConfig:
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 64
    layers: int = 2
    vocab: int = 64
    positions: int = 32     # rows of the rotary caches
    eps: float = 1e-6
    theta: float = 10000.0
    seed: int = 0

    @property
    def depth(self) -> int:
        return self.hidden // self.heads


class Graph:
    """Nodes and initializers of one model, with scoped node names like the exporters'."""

    def __init__(self):
        self.nodes, self.inits, self._count, self._consts = [], [], 0, {}

    def op(self, op_type: str, inputs: list[str], scope: str, outputs: int = 1, out: list[str] | None = None,
           domain: str = "", **attrs):
        self._count += 1
        name = f"{scope}/{op_type}_{self._count}"
        names = out or [f"{name}_output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=name, domain=domain or None, **attrs))
        return names[0] if len(names) == 1 else names

    def init(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def const(self, value, dtype=np.int64) -> str:
        array = np.asarray(value, dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            self._consts[key] = self.init(f"const_{len(self._consts)}", array)
        return self._consts[key]


@dataclass
class Weights:
    """The decoder's float parameters, drawn once per config so every form holds the same model."""

    config: FormConfig

    def __post_init__(self):
        c, rng = self.config, np.random.default_rng(self.config.seed)
        kv = c.kv_heads * c.depth

        def linear(fan_in, fan_out):
            return (rng.standard_normal((fan_in, fan_out)) * fan_in ** -0.5).astype(np.float32)

        def norm():
            return (1 + 0.1 * rng.standard_normal(c.hidden)).astype(np.float32)

        self.embed = rng.standard_normal((c.vocab, c.hidden)).astype(np.float32)
        self.layers = [dict(input_norm=norm(), q=linear(c.hidden, c.hidden), k=linear(c.hidden, kv),
                            v=linear(c.hidden, kv), o=linear(c.hidden, c.hidden), post_norm=norm(),
                            gate=linear(c.hidden, c.ffn), up=linear(c.hidden, c.ffn), down=linear(c.ffn, c.hidden))
                       for _ in range(c.layers)]
        self.final_norm = norm()
        self.lm_head = linear(c.hidden, c.vocab)
        inv_freq = 1.0 / c.theta ** (np.arange(0, c.depth, 2, dtype=np.float64) / c.depth)
        angles = np.outer(np.arange(c.positions), inv_freq)
        self.cos_half, self.sin_half = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


# --- the cache's graph inputs and outputs ------------------------------------------------------------------

def cache_io(c: FormConfig) -> tuple[list, list]:
    shape = lambda length: [BATCH, c.kv_heads, length, c.depth]  # noqa: E731
    names = [(i, kind) for i in range(c.layers) for kind in ("key", "value")]
    inputs = [helper.make_tensor_value_info(f"past_key_values.{i}.{k}", TensorProto.FLOAT, shape(PAST))
              for i, k in names]
    outputs = [helper.make_tensor_value_info(f"present.{i}.{k}", TensorProto.FLOAT, shape(TOTAL)) for i, k in names]
    return inputs, outputs


def ids_input(name: str, length: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.INT64, [BATCH, length])


def finish(g: Graph, c: FormConfig, inputs: list[str], opsets: dict) -> onnx.ModelProto:
    past, present = cache_io(c)
    lengths = {"input_ids": SEQ, "attention_mask": TOTAL, "position_ids": SEQ}
    graph = helper.make_graph(
        g.nodes, "main_graph", [ids_input(n, lengths[n]) for n in inputs] + past,
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [BATCH, SEQ, c.vocab])] + present, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    model.ir_version = 10
    model.producer_name = "dlegion.models"
    return model


# --- onnxruntime-genai's model builder -----------------------------------------------------------------

def nbits(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' symmetric 4-bit blockwise form of ``w`` [K, N]: packed codes [N, K/32, 16] (low
    nibble first), scales [N * K/32]; codes q in [0, 15] stand for (q - 8) * scale."""
    k, n = w.shape
    blocks = w.T.reshape(n, k // NBITS_BLOCK, NBITS_BLOCK)
    scale = np.abs(blocks).max(axis=-1) / 7
    q = np.clip(np.rint(blocks / scale[..., None]), -8, 7).astype(np.int64) + 8
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return packed, scale.astype(np.float32).reshape(-1)


def genai_linear(g: Graph, x: str, w: np.ndarray, scope: str, int4: bool, out: list[str] | None = None) -> str:
    if not int4:
        return g.op("MatMul", [x, g.init(f"{scope}.MatMul.weight", w)], scope, out=out)
    packed, scales = nbits(w)
    k, n = w.shape
    return g.op("MatMulNBits", [x, g.init(f"{scope}.MatMul.weight_Q4", packed), g.init(f"{scope}.MatMul.weight_scales",
                scales)], scope, out=out, domain=MS, K=k, N=n, bits=4, block_size=NBITS_BLOCK, accuracy_level=4)


def genai_mask(g: Graph) -> tuple[str, str]:
    """seqlens_k (int32 [B]: tokens seen - 1) and total_sequence_length (int32 scalar), as the builder
    makes them from the attention mask."""
    scope = "/model/attn_mask_reformat/attn_mask_subgraph"
    total = g.op("ReduceSum", ["attention_mask", g.const([1])], scope, keepdims=0)
    seqlens = g.op("Cast", [g.op("Sub", [total, g.const(1)], scope)], scope, to=TensorProto.INT32)
    width = g.op("Gather", [g.op("Shape", ["attention_mask"], scope), g.const(1)], scope, axis=0)
    return seqlens, g.op("Cast", [width], scope, to=TensorProto.INT32)


def build_genai(c: FormConfig, int4: bool) -> onnx.ModelProto:
    w, g = Weights(c), Graph()
    cos, sin = g.init("cos_cache", w.cos_half), g.init("sin_cache", w.sin_half)
    seqlens, total = genai_mask(g)
    x = g.op("Gather", [g.init("model.embed_tokens.weight", w.embed), "input_ids"], "/model/embed_tokens")
    skip = None
    for i, p in enumerate(w.layers):
        s = f"/model/layers.{i}"
        if skip is None:
            h = g.op("SimplifiedLayerNormalization", [x, g.init(f"model.layers.{i}.input_layernorm.weight",
                     p["input_norm"])], f"{s}/input_layernorm", axis=-1, epsilon=c.eps, stash_type=1)
            residual = x
        else:
            h, _, _, residual = g.op("SkipSimplifiedLayerNormalization", [x, skip, g.init(
                f"model.layers.{i}.input_layernorm.weight", p["input_norm"])], f"{s}/input_layernorm", domain=MS,
                out=[f"{s}/input_layernorm/output_0", "", "", f"{s}/input_layernorm/output_3"], epsilon=c.eps)
        q, k, v = (genai_linear(g, h, p[n], f"{s}/attn/{n}_proj", int4) for n in ("q", "k", "v"))
        if not int4:
            q, k = (g.op("RotaryEmbedding", [t, "position_ids", cos, sin], f"{s}/attn/{n}_rotary", domain=MS,
                         num_heads=count, interleaved=0) for t, n, count in ((q, "q", c.heads), (k, "k", c.kv_heads)))
        attn = g.op("GroupQueryAttention", [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value",
                                            seqlens, total, cos if int4 else "", sin if int4 else ""],
                    f"{s}/attn/GroupQueryAttention", domain=MS,
                    out=[f"{s}/attn/GroupQueryAttention/output_0", f"present.{i}.key", f"present.{i}.value"],
                    num_heads=c.heads, kv_num_heads=c.kv_heads, do_rotary=int(int4), rotary_interleaved=0,
                    scale=c.depth ** -0.5)[0]
        o = genai_linear(g, attn, p["o"], f"{s}/attn/o_proj", int4)
        h, _, _, x = g.op("SkipSimplifiedLayerNormalization", [residual, o, g.init(
            f"model.layers.{i}.post_attention_layernorm.weight", p["post_norm"])], f"{s}/post_attention_layernorm",
            domain=MS, out=[f"{s}/post_attention_layernorm/output_0", "", "", f"{s}/post_attention_layernorm/output_3"],
            epsilon=c.eps)
        gate = genai_linear(g, h, p["gate"], f"{s}/mlp/gate_proj", int4)
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{s}/mlp/act_fn")], f"{s}/mlp/act_fn")
        up = genai_linear(g, h, p["up"], f"{s}/mlp/up_proj", int4)
        skip = genai_linear(g, g.op("Mul", [act, up], f"{s}/mlp"), p["down"], f"{s}/mlp/down_proj", int4)
    h = g.op("SkipSimplifiedLayerNormalization", [x, skip, g.init("model.norm.weight", w.final_norm)],
             "/model/layers.2/final_norm_layernorm", domain=MS, epsilon=c.eps)
    genai_linear(g, h, w.lm_head, "/lm_head", int4, out=["logits"])
    inputs = ["input_ids", "attention_mask"] + ([] if int4 else ["position_ids"])
    return finish(g, c, inputs, {"": 21, MS: 1})



# --- Optimum's text-generation-with-past export (plain ONNX ops) --------------------------------------

def rms_plain(g: Graph, x: str, weight: str, eps: float, scope: str) -> str:
    var = g.op("ReduceMean", [g.op("Pow", [x, g.const(2.0, np.float32)], scope)], scope, axes=[-1], keepdims=1)
    root = g.op("Sqrt", [g.op("Add", [var, g.const(eps, np.float32)], scope)], scope)
    inv = g.op("Div", [g.const(1.0, np.float32), root], scope)
    return g.op("Mul", [weight, g.op("Mul", [x, inv], scope)], scope)


def heads(g: Graph, x: str, n: int, depth: int, scope: str) -> str:
    """[B, S, n * D] -> [B, n, S, D]."""
    return g.op("Transpose", [g.op("Reshape", [x, g.const([0, 0, n, depth])], scope)], scope, perm=[0, 2, 1, 3])


def rotate_half(g: Graph, x: str, half: int, scope: str) -> str:
    first = g.op("Slice", [x, g.const([0]), g.const([half]), g.const([-1])], scope)
    second = g.op("Slice", [x, g.const([half]), g.const([2**62]), g.const([-1])], scope)
    return g.op("Concat", [g.op("Neg", [second], scope), first], scope, axis=-1)


def optimum_rope(g: Graph, x: str, cos: str, sin: str, half: int, scope: str) -> str:
    return g.op("Add", [g.op("Mul", [x, cos], scope), g.op("Mul", [rotate_half(g, x, half, scope), sin], scope)], scope)


def causal_mask(g: Graph, past_key: str) -> str:
    """[B, 1, S, T] additive mask: 0 where key j is at most the query's position past + i and the
    attention mask holds it, the float minimum elsewhere (transformers' _prepare_4d_causal_attention_mask)."""
    scope = "/model/causal_mask"
    past = g.op("Gather", [g.op("Shape", [past_key], scope), g.const(2)], scope, axis=0)
    seq = g.op("Gather", [g.op("Shape", ["input_ids"], scope), g.const(1)], scope, axis=0)
    total = g.op("Gather", [g.op("Shape", ["attention_mask"], scope), g.const(1)], scope, axis=0)
    rows = g.op("Add", [g.op("Range", [g.const(0), seq, g.const(1)], scope), past], scope)
    cols = g.op("Range", [g.const(0), total, g.const(1)], scope)
    future = g.op("Greater", [g.op("Unsqueeze", [cols, g.const([0])], scope),
                              g.op("Unsqueeze", [rows, g.const([1])], scope)], scope)
    padded = g.op("Equal", [g.op("Unsqueeze", ["attention_mask", g.const([1, 2])], scope), g.const(0)], scope)
    hidden = g.op("Or", [future, padded], scope)
    lowest = float(np.finfo(np.float32).min)
    return g.op("Where", [hidden, g.const(lowest, np.float32), g.const(0.0, np.float32)], scope)


def repeat_kv(g: Graph, x: str, c: FormConfig, scope: str) -> str:
    """[B, Nkv, T, D] -> [B, N, T, D] (transformers' repeat_kv)."""
    group = c.heads // c.kv_heads
    shape = g.op("Shape", [x], scope)
    b = g.op("Gather", [shape, g.const([0])], scope, axis=0)
    t = g.op("Gather", [shape, g.const([2])], scope, axis=0)
    wide = g.op("Concat", [b, g.const([c.kv_heads, group]), t, g.const([c.depth])], scope, axis=0)
    expanded = g.op("Expand", [g.op("Unsqueeze", [x, g.const([2])], scope), wide], scope)
    flat = g.op("Concat", [b, g.const([c.heads]), t, g.const([c.depth])], scope, axis=0)
    return g.op("Reshape", [expanded, flat], scope)


def build_optimum(c: FormConfig) -> onnx.ModelProto:
    w, g = Weights(c), Graph()
    full = lambda t: np.concatenate([t, t], axis=-1)  # noqa: E731  transformers' cos/sin caches repeat the halves
    cos_cache, sin_cache = g.init("cos_cached", full(w.cos_half)), g.init("sin_cached", full(w.sin_half))
    scope = "/model/rotary_emb"
    cos, sin = (g.op("Unsqueeze", [g.op("Gather", [t, "position_ids"], scope, axis=0), g.const([1])], scope)
                for t in (cos_cache, sin_cache))
    mask = causal_mask(g, "past_key_values.0.key")
    x = g.op("Gather", [g.init("model.embed_tokens.weight", w.embed), "input_ids"], "/model/embed_tokens")
    for i, p in enumerate(w.layers):
        s = f"/model/layers.{i}"
        h = rms_plain(g, x, g.init(f"model.layers.{i}.input_layernorm.weight", p["input_norm"]), c.eps,
                      f"{s}/input_layernorm")
        proj = {n: g.op("MatMul", [h, g.init(f"onnx::MatMul_{i}_{n}", p[n])], f"{s}/self_attn/{n}_proj")
                for n in ("q", "k", "v")}
        a = f"{s}/self_attn"
        q = optimum_rope(g, heads(g, proj["q"], c.heads, c.depth, a), cos, sin, c.depth // 2, a)
        k = optimum_rope(g, heads(g, proj["k"], c.kv_heads, c.depth, a), cos, sin, c.depth // 2, a)
        v = heads(g, proj["v"], c.kv_heads, c.depth, a)
        k = g.op("Concat", [f"past_key_values.{i}.key", k], a, out=[f"present.{i}.key"], axis=2)
        v = g.op("Concat", [f"past_key_values.{i}.value", v], a, out=[f"present.{i}.value"], axis=2)
        kt = g.op("Transpose", [repeat_kv(g, k, c, a)], a, perm=[0, 1, 3, 2])
        scores = g.op("Div", [g.op("MatMul", [q, kt], a), g.const(np.sqrt(c.depth), np.float32)], a)
        probs = g.op("Softmax", [g.op("Add", [scores, mask], a)], a, axis=-1)
        ctx = g.op("Transpose", [g.op("MatMul", [probs, repeat_kv(g, v, c, a)], a)], a, perm=[0, 2, 1, 3])
        ctx = g.op("Reshape", [ctx, g.const([0, 0, c.hidden])], a)
        o = g.op("MatMul", [ctx, g.init(f"onnx::MatMul_{i}_o", p["o"])], f"{a}/o_proj")
        x = g.op("Add", [x, o], s)
        h = rms_plain(g, x, g.init(f"model.layers.{i}.post_attention_layernorm.weight", p["post_norm"]), c.eps,
                      f"{s}/post_attention_layernorm")
        m = f"{s}/mlp"
        gate = g.op("MatMul", [h, g.init(f"onnx::MatMul_{i}_gate", p["gate"])], f"{m}/gate_proj")
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{m}/act_fn")], f"{m}/act_fn")
        up = g.op("MatMul", [h, g.init(f"onnx::MatMul_{i}_up", p["up"])], f"{m}/up_proj")
        down = g.op("MatMul", [g.op("Mul", [act, up], m), g.init(f"onnx::MatMul_{i}_down", p["down"])],
                    f"{m}/down_proj")
        x = g.op("Add", [x, down], s)
    h = rms_plain(g, x, g.init("model.norm.weight", w.final_norm), c.eps, "/model/norm")
    g.op("MatMul", [h, g.init("onnx::MatMul_lm_head", w.lm_head)], "/lm_head", out=["logits"])
    return finish(g, c, ["input_ids", "attention_mask", "position_ids"], {"": 14})


# --- opset 23 -------------------------------------------------------------------------------------------

def build_opset23(c: FormConfig) -> onnx.ModelProto:
    w, g = Weights(c), Graph()
    cos, sin = g.init("cos_cache", w.cos_half), g.init("sin_cache", w.sin_half)
    mask = causal_mask(g, "past_key_values.0.key")
    x = g.op("Gather", [g.init("model.embed_tokens.weight", w.embed), "input_ids"], "/model/embed_tokens")
    for i, p in enumerate(w.layers):
        s, a = f"/model/layers.{i}", f"/model/layers.{i}/self_attn"
        h = g.op("RMSNormalization", [x, g.init(f"model.layers.{i}.input_layernorm.weight", p["input_norm"])],
                 f"{s}/input_layernorm", axis=-1, epsilon=c.eps)
        q, k, v = (g.op("MatMul", [h, g.init(f"model.layers.{i}.self_attn.{n}_proj.weight_t", p[n])], f"{a}/{n}_proj")
                   for n in ("q", "k", "v"))
        q, k = (g.op("RotaryEmbedding", [t, cos, sin, "position_ids"], a, num_heads=n, interleaved=0)
                for t, n in ((q, c.heads), (k, c.kv_heads)))
        y = g.op("Attention", [q, k, v, mask, f"past_key_values.{i}.key", f"past_key_values.{i}.value"], a,
                 out=[f"{a}/Attention_output_0", f"present.{i}.key", f"present.{i}.value"],
                 q_num_heads=c.heads, kv_num_heads=c.kv_heads, scale=c.depth ** -0.5)[0]
        x = g.op("Add", [x, g.op("MatMul", [y, g.init(f"model.layers.{i}.self_attn.o_proj.weight_t", p["o"])],
                                 f"{a}/o_proj")], s)
        h = g.op("RMSNormalization", [x, g.init(f"model.layers.{i}.post_attention_layernorm.weight", p["post_norm"])],
                 f"{s}/post_attention_layernorm", axis=-1, epsilon=c.eps)
        m = f"{s}/mlp"
        gate = g.op("MatMul", [h, g.init(f"model.layers.{i}.mlp.gate_proj.weight_t", p["gate"])], f"{m}/gate_proj")
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{m}/act_fn")], f"{m}/act_fn")
        up = g.op("MatMul", [h, g.init(f"model.layers.{i}.mlp.up_proj.weight_t", p["up"])], f"{m}/up_proj")
        down = g.op("MatMul", [g.op("Mul", [act, up], m), g.init(f"model.layers.{i}.mlp.down_proj.weight_t",
                                                                  p["down"])], f"{m}/down_proj")
        x = g.op("Add", [x, down], s)
    h = g.op("RMSNormalization", [x, g.init("model.norm.weight", w.final_norm)], "/model/norm", axis=-1, epsilon=c.eps)
    g.op("MatMul", [h, g.init("lm_head.weight_t", w.lm_head)], "/lm_head", out=["logits"])
    return finish(g, c, ["input_ids", "attention_mask", "position_ids"], {"": 23})


FORMS = {
    "genai_tiny_fp32": lambda: build_genai(FormConfig(), int4=False),
    "genai_tiny_int4": lambda: build_genai(FormConfig(), int4=True),
    "optimum_tiny_llama": lambda: build_optimum(FormConfig()),
    "opset23_tiny_llama": lambda: build_opset23(FormConfig()),
}


# --- golden runs ---------------------------------------------------------------------------------------

def step_inputs(model: onnx.ModelProto, step: str, seed: int = 1) -> dict[str, np.ndarray]:
    """A step's inputs: seeded token ids, an attention mask over past and new tokens (all ones but
    a batch's second row at decode, whose first PADDED positions are 0), positions past .. past +
    sequence - 1, and a standard normal cache of the step's past."""
    seq, past, batch = STEPS[step]
    rng = np.random.default_rng(seed)
    c = FormConfig()
    mask = np.ones((batch, past + seq), np.int64)
    if batch > 1 and past > PADDED:
        mask[1, :PADDED] = 0
    feeds = {"input_ids": rng.integers(0, c.vocab, (batch, seq), dtype=np.int64),
             "attention_mask": mask,
             "position_ids": np.tile(np.arange(past, past + seq, dtype=np.int64), (batch, 1))}
    names = [v.name for v in model.graph.input]
    feeds = {n: feeds[n] for n in names if n in feeds}
    for n in names:
        if n.startswith("past_key_values."):
            feeds[n] = rng.standard_normal((batch, c.kv_heads, past, c.depth)).astype(np.float32)
    return feeds


def dims(step: str) -> dict[str, int]:
    """The symbolic dims bound for a step (what ``dlegion-cc --dim`` takes)."""
    seq, past, batch = STEPS[step]
    return {BATCH: batch, SEQ: seq, PAST: past, TOTAL: past + seq}


def golden_path(name: str, step: str, golden_dir: Path = GOLDEN_DIR) -> Path:
    return golden_dir / f"{name}.{step}.npz"


def write(name: str, models_dir: Path, golden_dir: Path) -> dict:
    path = models_dir / f"{name}.onnx"
    model = FORMS[name]()
    path.write_bytes(model.SerializeToString())
    hashes = {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    for step in STEPS:
        feeds = step_inputs(model, step)
        golden.write_npz(golden_path(name, step, golden_dir), {**feeds, **golden.run(path, feeds)})
    return hashes


@click.command(help="Regenerate the exporter-form models and their golden onnxruntime outputs.")
@click.option("--models-dir", type=click.Path(file_okay=False, path_type=Path), default=MODELS_DIR, show_default=True)
@click.option("--golden-dir", type=click.Path(file_okay=False, path_type=Path), default=GOLDEN_DIR, show_default=True)
def main(models_dir: Path, golden_dir: Path):
    import onnxruntime
    models_dir.mkdir(parents=True, exist_ok=True)
    golden_dir.mkdir(parents=True, exist_ok=True)
    hashes = {name: write(name, models_dir, golden_dir) for name in FORMS}
    record = {"onnxruntime": onnxruntime.__version__, "cpu": golden.machine(), "models": hashes}
    (golden_dir / MANIFEST).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    for name in FORMS:
        click.echo(f"{name}: {name}.onnx, {', '.join(golden_path(name, s, golden_dir).name for s in STEPS)}")


if __name__ == "__main__":
    main()
