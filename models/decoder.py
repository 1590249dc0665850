"""The decoder graph shared by the BitNet and Llama generators, node for node as torch.onnx.export
(dynamo=True, opset 20) writes the transformers modules (see PATTERNS.md)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import onnx

from isa.progress import SILENT, Advance, Progress
from models.graph import FLOAT, INT64, INT64_MAX, GraphBuilder, tensor_info
from models.weights import gaussian_rows, norm_weight

MASK_MIN = np.finfo(np.float32).min  # what transformers adds at masked positions
SEQ_DIM = "sequence"
PAST_DIM = "past_sequence_length"  # the cached positions of a decode step's key/value inputs
TOTAL_DIM = "total_sequence_length"  # past + sequence: the present key/value outputs


@dataclass(frozen=True)
class DecoderSpec:
    """Shapes and switches of one decoder; ``sub_norm`` adds BitNet's attn/ffn sub-norms."""

    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    layers: int
    vocab: int
    seq: int
    act: str = "silu"
    sub_norm: bool = True
    dynamic: bool = False
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    past: int | None = None  # cached positions per key/value input; None: no cache inputs or outputs

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def matrix_bytes(self) -> int:
        """fp32 bytes of the embedding, head and projection matrices: all of the model but a sliver."""
        kv = self.kv_heads * self.head_dim
        layer = self.hidden * (2 * self.hidden + 2 * kv + 3 * self.ffn)  # q and o, k and v, gate, up and down
        return 4 * (2 * self.vocab * self.hidden + self.layers * layer)

    def check(self) -> None:
        if min(self.hidden, self.heads, self.kv_heads, self.ffn, self.vocab) < 1:
            raise ValueError(f"decoder sizes must be positive: {self}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden {self.hidden}, heads {self.heads}, kv heads {self.kv_heads} do not divide")
        if self.head_dim % 2:
            raise ValueError(f"head dim {self.head_dim} must be even for rotary embedding")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"activation {self.act!r} is not one of {sorted(ACTIVATIONS)}")
        if self.seq < 1 or self.layers < 1:
            raise ValueError(f"sequence {self.seq} and layers {self.layers} must be positive")
        if self.past is not None and self.past < 0:
            raise ValueError(f"past {self.past} must not be negative")

    @property
    def cached(self) -> bool:
        return self.past is not None

    @property
    def offset(self) -> int:
        """The position of the first new token: the cached positions come before it."""
        return self.past or 0


class Projection(Protocol):
    """How a linear layer is written: ``prepare`` runs once per input (shared by q/k/v and gate/up)."""

    def prepare(self, b: GraphBuilder, x: str) -> str: ...

    def project(self, b: GraphBuilder, x: str, name: str, fan_in: int, fan_out: int) -> str: ...


@dataclass
class Tables:
    """Per-sequence values shared by all layers: causal mask, rotary cos/sin, the [1] sequence length
    and the [1] length of the keys (past + sequence; the sequence without a cache).

    With a symbolic sequence, values derived from these are built once at first use (in layer 0) and
    reused, as the exporter's common-subexpression pass leaves them."""

    mask: str
    cos: str
    sin: str
    seq: str | None = None
    keys: str | None = None
    derived: dict = field(default_factory=dict)

    def once(self, key: str, make) -> str:
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]


def rms_norm(b: GraphBuilder, x: str, name: str, size: int, eps: float, rng) -> str:
    """x * 1/sqrt(mean(x^2) + eps) * weight: Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul."""
    with b.scoped(name):
        mean = b.op("ReduceMean", b.op("Pow", x, b.f32(2.0)), b.const([-1]), keepdims=1, noop_with_empty_axes=0)
        inv = b.op("Reciprocal", b.op("Sqrt", b.op("Add", mean, b.f32(eps))))
        scaled = b.op("Mul", x, inv)
        return b.op("Mul", b.weight(f"{b.prefix()}.weight", norm_weight(rng, size)), scaled)


def relu2(b: GraphBuilder, x: str) -> str:
    return b.op("Pow", b.op("Relu", x), b.f32(2.0))


def silu(b: GraphBuilder, x: str) -> str:
    return b.op("Mul", x, b.op("Sigmoid", x))


ACTIVATIONS = {"relu2": relu2, "silu": silu}


def static_tables(b: GraphBuilder, spec: DecoderSpec) -> Tables:
    """Static shapes: the exporter folds mask and cos/sin into [1,1,S,P+S] and [1,1,S,D] initializers
    (P cached positions, 0 without a cache): token i sees keys 0..P+i; positions start at P."""
    s, p = spec.seq, spec.offset
    mask = np.where(np.tri(s, p + s, p, dtype=bool), np.float32(0), MASK_MIN).astype(np.float32)
    cos, sin = rotary_tables(spec, np.arange(p, p + s))
    return Tables(
        mask=b.weight("causal_mask", mask.reshape(1, 1, s, p + s)),
        cos=b.weight("rotary_cos", cos.reshape(1, 1, s, -1)),
        sin=b.weight("rotary_sin", sin.reshape(1, 1, s, -1)),
    )


def inv_freq(spec: DecoderSpec) -> np.ndarray:
    d = spec.head_dim
    return (1.0 / (np.float32(spec.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))).astype(
        np.float32)


def rotary_tables(spec: DecoderSpec, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    freqs = positions.astype(np.float32)[:, None] * inv_freq(spec)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def dynamic_tables(b: GraphBuilder, spec: DecoderSpec, ids: str) -> Tables:
    """Symbolic sequence: positions from Range; rotary as the exporter computes it; a plain causal mask.
    With a cache, the new tokens' positions start at the cached length P and the keys run 0..P+S-1."""
    seq = b.op("Shape", ids, start=1, end=2)
    if spec.cached:
        past = b.op("Shape", past_name(0, "key"), start=2, end=3)
        keys = b.op("Add", past, seq)
        positions = b.op("Range", b.op("Squeeze", past), b.op("Squeeze", keys), b.const(1))
        key_positions = b.op("Range", b.const(0), b.op("Squeeze", keys), b.const(1))
    else:
        keys = seq
        positions = key_positions = b.op("Range", b.const(0), b.op("Squeeze", seq), b.const(1))
    # mask[i, j] = 0 where j <= i else MASK_MIN (transformers' vmapped mask reduces to this for one sequence)
    allowed = b.op("LessOrEqual", b.op("Unsqueeze", key_positions, b.const([0])),
                   b.op("Unsqueeze", positions, b.const([1])))
    mask = b.op("Where", allowed, b.f32(0.0), b.f32(MASK_MIN))
    mask = b.op("Unsqueeze", mask, b.const([0, 1]))
    pos = b.op("Cast", b.op("Unsqueeze", positions, b.const([0, 2])), to=FLOAT)
    freqs = b.op("Mul", pos, b.weight("model.rotary_emb.inv_freq", inv_freq(spec)))
    emb = b.op("Concat", freqs, freqs, axis=-1)
    return Tables(mask=mask, cos=b.op("Cos", emb), sin=b.op("Sin", emb), seq=seq, keys=keys)


def rotary_4d(b: GraphBuilder, t: Tables) -> tuple[str, str]:
    """cos/sin as [1,1,S,D]; a symbolic sequence unsqueezes them once, inside layer 0."""
    if t.seq is None:
        return t.cos, t.sin
    return (t.once("cos", lambda: b.op("Unsqueeze", t.cos, b.const([1]))),
            t.once("sin", lambda: b.op("Unsqueeze", t.sin, b.const([1]))))


def split_heads(b: GraphBuilder, x: str, spec: DecoderSpec, heads: int) -> str:
    """[1,S,heads*D] -> [1,heads,S,D]: Reshape then Transpose(0,2,1,3)."""
    shape = [1, -1, heads, spec.head_dim] if spec.dynamic else [1, spec.seq, -1, spec.head_dim]
    return b.op("Transpose", b.op("Reshape", x, b.const(shape), allowzero=1), perm=[0, 2, 1, 3])


def rotate(b: GraphBuilder, x: str, spec: DecoderSpec, t: Tables) -> str:
    """x*cos + cat(-x2, x1)*sin, with x1, x2 the two halves of the head dim."""
    half = spec.head_dim // 2
    cos, sin = rotary_4d(b, t)
    x_cos = b.op("Mul", x, cos)
    x1 = b.op("Slice", x, b.const([0]), b.const([half]), b.const([3]), b.const([1]))
    x2 = b.op("Slice", x, b.const([half]), b.const([INT64_MAX]), b.const([3]), b.const([1]))
    rotated = b.op("Concat", b.op("Neg", x2), x1, axis=-1)
    return b.op("Add", x_cos, b.op("Mul", rotated, sin))


def expand_shape(b: GraphBuilder, spec: DecoderSpec, t: Tables) -> tuple[str, str]:
    """The Expand target [1,KV,rep,T,D] and the Reshape target [1,H,T,D] of repeat_kv (T keys)."""
    rep, d, keys = spec.heads // spec.kv_heads, spec.head_dim, spec.offset + spec.seq
    if t.seq is None:
        return b.const([1, spec.kv_heads, rep, keys, d]), b.const([1, spec.heads, keys, d])
    parts = [b.const([1]), b.const([spec.kv_heads]), b.const([rep]), t.keys, b.const([d])]
    return t.once("expand", lambda: b.op("Concat", *parts, axis=0)), b.const([1, spec.heads, -1, d])


def repeat_kv(b: GraphBuilder, x: str, spec: DecoderSpec, t: Tables) -> str:
    """GQA: [1,KV,S,D] -> [1,H,S,D] by Unsqueeze(2), Expand, Reshape; identity when KV == H."""
    if spec.heads == spec.kv_heads:
        return x
    grouped = b.op("Unsqueeze", x, b.const([2]))
    target, flat = expand_shape(b, spec, t)
    return b.op("Reshape", b.op("Expand", grouped, target), flat, allowzero=1)


def past_name(layer: int, kind: str) -> str:
    return f"past_key_values.{layer}.{kind}"


def present_name(layer: int, kind: str) -> str:
    return f"present.{layer}.{kind}"


def with_cache(b: GraphBuilder, spec: DecoderSpec, layer: int, kind: str, new: str) -> str:
    """transformers' cache update: the layer's cached keys (or values) and the new ones, Concat on
    the sequence axis, are both the ``present`` output and what attention reads."""
    if not spec.cached:
        return new
    return b.op("Concat", past_name(layer, kind), new, axis=2, out=present_name(layer, kind))


def attention(b: GraphBuilder, x: str, spec: DecoderSpec, t: Tables, proj: Projection, rng, layer: int) -> str:
    """Self-attention of one layer, scope ``self_attn``; returns the o_proj output."""
    h, kv, d = spec.hidden, spec.kv_heads, spec.head_dim
    with b.scoped("self_attn"):
        xq = proj.prepare(b, x)
        q = split_heads(b, proj.project(b, xq, "q_proj", h, spec.heads * d), spec, spec.heads)
        k = split_heads(b, proj.project(b, xq, "k_proj", h, kv * d), spec, kv)
        v = split_heads(b, proj.project(b, xq, "v_proj", h, kv * d), spec, kv)
        q, k = rotate(b, q, spec, t), rotate(b, k, spec, t)
        k, v = with_cache(b, spec, layer, "key", k), with_cache(b, spec, layer, "value", v)
        k, v = repeat_kv(b, k, spec, t), repeat_kv(b, v, spec, t)
        scores = b.op("MatMul", q, b.op("Transpose", k, perm=[0, 1, 3, 2]))
        scores = b.op("Add", b.op("Mul", scores, b.f32(d ** -0.5)), t.mask)
        context = b.op("MatMul", b.op("Softmax", scores, axis=-1), v)
        merged = [1, -1, h] if spec.dynamic else [1, spec.seq, -1]
        out = b.op("Reshape", b.op("Transpose", context, perm=[0, 2, 1, 3]), b.const(merged), allowzero=1)
        if spec.sub_norm:
            out = rms_norm(b, out, "attn_sub_norm", h, spec.rms_eps, rng)
        return proj.project(b, proj.prepare(b, out), "o_proj", spec.heads * d, h)


def mlp(b: GraphBuilder, x: str, spec: DecoderSpec, proj: Projection, rng) -> str:
    """down(act(gate(x)) * up(x)), with BitNet's ffn_sub_norm before down_proj."""
    with b.scoped("mlp"):
        xq = proj.prepare(b, x)
        gate = ACTIVATIONS[spec.act](b, proj.project(b, xq, "gate_proj", spec.hidden, spec.ffn))
        out = b.op("Mul", gate, proj.project(b, xq, "up_proj", spec.hidden, spec.ffn))
        if spec.sub_norm:
            out = rms_norm(b, out, "ffn_sub_norm", spec.ffn, spec.rms_eps, rng)
        return proj.project(b, proj.prepare(b, out), "down_proj", spec.ffn, spec.hidden)


def decoder_layer(b: GraphBuilder, x: str, spec: DecoderSpec, t: Tables, proj: Projection, rng, layer: int) -> str:
    normed = rms_norm(b, x, "input_layernorm", spec.hidden, spec.rms_eps, rng)
    x = b.op("Add", x, attention(b, normed, spec, t, proj, rng, layer))
    normed = rms_norm(b, x, "post_attention_layernorm", spec.hidden, spec.rms_eps, rng)
    return b.op("Add", x, mlp(b, normed, spec, proj, rng))


def build_decoder(spec: DecoderSpec, proj: Projection, rng: np.random.Generator, b: GraphBuilder | None = None,
                  progress: Progress = SILENT) -> onnx.ModelProto:
    """input_ids int64 [1, S] -> logits float32 [1, S, vocab]; the lm_head stays a float MatMul.

    Each parameter goes to ``b``'s store as it is drawn, in graph order, so with a streaming store
    only the matrix being drawn is in memory. One progress step for the embedding, each layer and
    the head."""
    spec.check()
    b = GraphBuilder() if b is None else b
    seq = SEQ_DIM if spec.dynamic else spec.seq
    with progress.task("writing weights", spec.layers + 2) as advance:
        x = decoder_stack(b, spec, proj, rng, advance)
        with b.scoped("lm_head"):
            head = b.weight("lm_head.weight_t", gaussian_rows(rng, (spec.hidden, spec.vocab), spec.hidden ** -0.5))
            b.nodes.append(onnx.helper.make_node("MatMul", [x, head], ["logits"], name="lm_head/MatMul"))
        advance()
    inputs, outputs = cache_infos(spec)
    return b.model([tensor_info("input_ids", INT64, [1, seq])] + inputs,
                   [tensor_info("logits", FLOAT, [1, seq, spec.vocab])] + outputs)


def cache_infos(spec: DecoderSpec) -> tuple[list, list]:
    """past_key_values.N.key/value inputs [1, KV, P, D] and present.N.key/value outputs [1, KV, P+S, D],
    in transformers' order (layer by layer, key then value); none without a cache."""
    if not spec.cached:
        return [], []
    kv, d = spec.kv_heads, spec.head_dim
    past, total = (PAST_DIM, TOTAL_DIM) if spec.dynamic else (spec.past, spec.past + spec.seq)
    pairs = [(i, kind) for i in range(spec.layers) for kind in ("key", "value")]
    return ([tensor_info(past_name(i, kind), FLOAT, [1, kv, past, d]) for i, kind in pairs],
            [tensor_info(present_name(i, kind), FLOAT, [1, kv, total, d]) for i, kind in pairs])


def decoder_stack(b: GraphBuilder, spec: DecoderSpec, proj: Projection, rng, advance: Advance) -> str:
    """Embedding, layers and final norm in scope ``model``; returns the normed hidden state."""
    with b.scoped("model"):
        embed = b.weight("model.embed_tokens.weight", gaussian_rows(rng, (spec.vocab, spec.hidden), 1.0))
        x = b.op("Gather", embed, "input_ids", axis=0)
        advance()
        tables = dynamic_tables(b, spec, "input_ids") if spec.dynamic else static_tables(b, spec)
        for i in range(spec.layers):
            with b.scoped(f"layers.{i}"):
                x = decoder_layer(b, x, spec, tables, proj, rng, i)
            advance()
        return rms_norm(b, x, "norm", spec.hidden, spec.rms_eps, rng)
