"""A graph evaluated in float64: the yardstick both fp32 programs (onnxruntime's and ours) are
measured against.

The copy is the same graph with every float32 tensor made float64: initializers, graph inputs
and outputs, intermediate types, ``Cast``/``ConstantOfShape``/``Constant`` targets; integer
operators are unchanged, and so are the float32 scales and zero points of quantization operators,
which have no float64 kernels: their float inputs are cast to float32 and their float outputs
back to float64. MatMulNBits with constant weights is the exception: it becomes a float64 MatMul by
its dequantized weight, as its definition reads (``_dense_nbits``). Constant int8 MatMulInteger weights are shifted to uint8 as ``--reference
exact`` does (``check.unsigned_integer_weights``), so no CPU's saturating kernel enters the
yardstick. onnxruntime runs it (its CPU kernels take double for the operators
LLM graphs use); a graph with an operator it has no double kernel for (Erf, so GELU; Softplus)
is run by onnx's reference evaluator instead. A BitNet graph's per-token absmax quantization then rounds a few values the
other way than fp32 does, as any fp32 program also may: that spread is what the distances
measure.
"""
from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import numpy as np

_F32, _F64 = 1, 11          # onnx.TensorProto.FLOAT, DOUBLE
# Operators whose float operands onnxruntime takes in float32 only.
# onnxruntime's contrib operators (com.microsoft) have float32 kernels only, and opset 23's
# RotaryEmbedding none in float64 either. (A GroupQueryAttention whose products a program
# quantized is first rewritten into plain ops, in float64 then: _expand_attention.)
FLOAT32_ONLY = {"DequantizeLinear", "QuantizeLinear", "DynamicQuantizeLinear", "MatMulNBits", "QLinearMatMul",
                "GroupQueryAttention", "RotaryEmbedding", "SimplifiedLayerNormalization",
                "SkipSimplifiedLayerNormalization"}


def float64_model(path: str | Path, approximations: bool = False, int8_attention: Collection[str] = (),
                  input_shapes: dict[str, tuple] | None = None, pieces: int = 1):
    """The model at ``path`` (external data loaded) with its float32 tensors made float64;
    with ``approximations``, also the ones the compiler makes (see APPROXIMATIONS), and the
    MatMuls whose outputs ``int8_attention`` names (those the program records it quantized)
    quantized as the program's were, each operand in ``pieces`` int8 pieces (``_int8_product``),
    the shapes they see being those of ``input_shapes`` (the inputs')."""
    import onnx
    from onnx import numpy_helper
    from runtime.check import unsigned_integer_weights
    model = onnx.load(str(path))
    unsigned_integer_weights(model)
    if approximations and int8_attention:
        _expand_attention(model, set(int8_attention), input_shapes or {})
    g = model.graph
    floats = _float32_values(model)
    products = _recorded_products(model, set(int8_attention), input_shapes or {}) if approximations else {}
    for i, t in enumerate(g.initializer):
        if t.data_type == _F32:
            g.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for vi in [*g.input, *g.output, *g.value_info]:
        if vi.type.tensor_type.elem_type == _F32:
            vi.type.tensor_type.elem_type = _F64
    for node in g.node:
        _widen_node(node)
    nodes = []
    for node in g.node:
        if approximations and (node.domain, node.op_type) in APPROXIMATIONS:
            nodes.extend(_absmax_rows(node, floats, model))
        if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
            dense = _dense_nbits(node, model)
            if dense:
                nodes.extend(dense)
                continue
        if node.op_type == "MatMul" and node.output[0] in products:
            nodes.extend(_int8_product(node, products[node.output[0]], floats, model, pieces))
            continue
        nodes.extend(_kept_float32(node, floats) if node.op_type in FLOAT32_ONLY else [node])
    del g.node[:]
    g.node.extend(nodes)
    return model


# The approximations dlegion-cc makes, by the operator it makes them in: what it computes instead
# (dlegion_cc/passes/matmul_nbits.py quantizes MatMulNBits' float activations to int8 per row).
APPROXIMATIONS = {("com.microsoft", "MatMulNBits"): "float activations quantized to int8 per row"}
ABSMAX_FLOOR = 1e-30        # as the compiler's: an all-zero row stays zero


INT8_ATTENTION = "the MatMuls the program names: int8 per row of a and per column of b (K smoothed where its scores reach a softmax alone)"
INT8X2_ATTENTION = ("the MatMuls the program names: a per row and b per column in two int8 pieces each (K smoothed "
                    "where its scores reach a softmax alone), hi.hi + lo.hi + hi.lo")
# The second piece's steps per step of the first (dlegion_cc/passes/attention.py: LOW_STEPS).
LOW_STEPS = 254.0


def approximations(path: str | Path, int8_attention: bool = False, pieces: int = 1) -> list[str]:
    """What the compiler computes instead of ``path``'s operators, one phrase per kind; with
    ``int8_attention``, the program's quantized attention products too (in ``pieces``)."""
    import onnx
    m = onnx.load(str(path), load_external_data=False)
    kinds = {(n.domain, n.op_type) for n in m.graph.node} & set(APPROXIMATIONS)
    phrases = [f"{op}: {APPROXIMATIONS[(d, op)]}" for d, op in sorted(kinds)]
    return phrases + ([INT8X2_ATTENTION if pieces == 2 else INT8_ATTENTION] if int8_attention else [])


def _absmax_rows(node, floats: set[str], model) -> list:
    """Nodes making ``node``'s first input what the compiler feeds it: ``q * r`` with
    ``q = round(x / r)`` (half to even) and ``r = max(max|x|, floor) / 127`` per row; rewires
    ``node`` to it."""
    x = node.input[0]
    p = f"{x}/absmax_rows/{node.name}"
    node.input[0] = p
    floats.add(p)
    return _absmax(x, -1, p, model)


def _absmax(x: str, axis: int, out: str, model, in_float32: bool = False, pieces: int = 1) -> list:
    """Nodes making ``out = q * r`` from ``x``: ``r = max(max|x|, floor) / 127`` along ``axis``
    (-1: per row, -2: per column), ``q = clip(round(x / r), -127, 127)``, round half to even;
    in float64, so only the int8 rounding differs from ``x``, unless ``in_float32``: then ``r`` and
    ``q`` are computed in float32 as the program computes them (see _int8_product). With two
    ``pieces`` (``in_float32`` only), also ``out/lo``: the second piece (``_low_piece``)."""
    from onnx import helper, numpy_helper
    p = out
    t = np.float32 if in_float32 else np.float64
    consts = {f"{p}/floor": ABSMAX_FLOOR, f"{p}/127": 127.0, f"{p}/-127": -127.0, f"{p}/axes": axis}
    for name, v in consts.items():
        value = np.array([v], np.int64) if name.endswith("/axes") else np.array(v, t)
        model.graph.initializer.append(numpy_helper.from_array(value, name))
    src = f"{p}/x32" if in_float32 else x
    nodes = [helper.make_node("Cast", [x], [src], to=_F32)] if in_float32 else []
    nodes += [helper.make_node("Abs", [src], [f"{p}/abs"]),
              _reduce("ReduceMax", f"{p}/abs", f"{p}/max", axis, f"{p}/axes", model),
              helper.make_node("Max", [f"{p}/max", f"{p}/floor"], [f"{p}/floored"]),
              helper.make_node("Div", [f"{p}/floored", f"{p}/127"], [f"{p}/r"]),
              helper.make_node("Div", [src, f"{p}/r"], [f"{p}/scaled"]),
              helper.make_node("Round", [f"{p}/scaled"], [f"{p}/round"]),
              helper.make_node("Clip", [f"{p}/round", f"{p}/-127", f"{p}/127"], [f"{p}/q"])]
    if in_float32:      # q and r are exact in float64: their product is taken there
        nodes += _dequantized(f"{p}/q", f"{p}/r", p)
        if pieces == 2:
            nodes += _low_piece(p, model)
    else:
        nodes.append(helper.make_node("Mul", [f"{p}/q", f"{p}/r"], [p]))
    return nodes


def _dequantized(q: str, r: str, out: str) -> list:
    """``out = q * r`` in float64 from float32 ``q`` and ``r`` (exact there)."""
    from onnx import helper
    return [helper.make_node("Cast", [q], [f"{q}64"], to=_F64), helper.make_node("Cast", [r], [f"{r}64"], to=_F64),
            helper.make_node("Mul", [f"{q}64", f"{r}64"], [out])]


def _low_piece(p: str, model) -> list:
    """Nodes making ``p/lo``, the second int8 piece of what ``_absmax`` quantized at ``p``, as
    dlegion_cc/passes/attention.py makes it in float32: with ``s = x / r``,
    ``lo = clip(round(LOW_STEPS (s - round(s))), -127, 127)`` of scale ``r / LOW_STEPS``."""
    from onnx import helper, numpy_helper
    model.graph.initializer.append(numpy_helper.from_array(np.array(LOW_STEPS, np.float32), f"{p}/low_steps"))
    return [helper.make_node("Sub", [f"{p}/scaled", f"{p}/round"], [f"{p}/left"]),
            helper.make_node("Mul", [f"{p}/left", f"{p}/low_steps"], [f"{p}/steps"]),
            helper.make_node("Round", [f"{p}/steps"], [f"{p}/lo_round"]),
            helper.make_node("Clip", [f"{p}/lo_round", f"{p}/-127", f"{p}/127"], [f"{p}/lo_q"]),
            helper.make_node("Div", [f"{p}/r", f"{p}/low_steps"], [f"{p}/lo_r"]),
            *_dequantized(f"{p}/lo_q", f"{p}/lo_r", f"{p}/lo")]


def _reduce(op: str, x: str, out: str, axis: int, axes: str, model):
    """``op`` over ``axis`` keeping it; the axes an attribute before opset 18, an input after."""
    from onnx import helper
    if _opset(model) < 18:
        return helper.make_node(op, [x], [out], keepdims=1, axes=[axis])
    return helper.make_node(op, [x, axes], [out], keepdims=1)


# --- MatMulNBits by its definition ---------------------------------------------------------------

def _dense_nbits(node, model) -> list:
    """A MatMulNBits with constant weights as its definition computes it, in float64: a MatMul by
    the dequantized weight ``(q - zero_point) * scale`` (and its bias). onnxruntime's kernel is
    float32 only, and at ``accuracy_level`` 4 it quantizes the activations itself, per block, so
    the yardstick would carry onnxruntime's own approximation; it also computes zeros when the
    scales reach it through a Cast, not as an initializer. [] when the weights are not constant
    (the node then runs as onnxruntime's float32 kernel)."""
    from onnx import helper, numpy_helper
    from dlegion_cc.ir import Node
    from dlegion_cc.passes.matmul_nbits import nbits_weights
    inits = {t.name: t for t in model.graph.initializer}
    attrs = {a.name: a.i for a in node.attribute}

    class Consts:   # the one definition of the weights (the compiler's) reads a graph's constants
        values = {node.input[0]: type("Activations", (), {"dtype": np.float32})}

        def const(self, name):
            return numpy_helper.to_array(inits[name]) if name in inits else None
    try:
        w = nbits_weights(Consts(), Node("MatMulNBits", node.name, list(node.input), list(node.output), attrs))
    except (ValueError, KeyError):
        return []
    scale = np.repeat(w.scales.astype(np.float64), w.block, axis=0)[:w.values.shape[0]]
    name = f"{node.name}/dequantized"
    _constant(model, name, w.values.astype(np.float64) * scale)
    if w.bias is None:
        return [helper.make_node("MatMul", [node.input[0], name], list(node.output))]
    _constant(model, f"{name}/bias", w.bias.astype(np.float64))
    return [helper.make_node("MatMul", [node.input[0], name], [f"{name}/product"]),
            helper.make_node("Add", [f"{name}/product", f"{name}/bias"], list(node.output))]


# --- attention's float products in int8 (dlegion_cc/passes/attention.py) ----------------------

def _int8_product(node, smoothed: bool, floats: set[str], model, pieces: int = 1) -> list:
    """Nodes feeding MatMul ``node`` (a @ b, both computed at run time) what the compiler's
    AttnMatMul multiplies: a quantized per row (a token of Q, a row of P), b per column (a token
    of K, a channel of V), K first smoothed by its mean over the tokens when the scores reach a
    softmax alone. A softmax's P quantized per row is ``round(127 exp(x - max x))`` with scale
    ``1 / (127 sum)``: the same as its absmax (max P = 1 / sum), so absmax serves. The scales
    and the rounding are computed in float32, as the program computes them: a model whose values
    lie on a grid (V dequantized by a static QDQ pair: k * s) puts x / r on exact ties of the
    rounding (127 k / m = n + 1/2), which float64's and float32's divisions break each their own
    way; the products and everything else stay float64. With two ``pieces`` the product is
    the program's three, ``hi . hi + lo . hi + hi . lo``, summed in that order. Returns the
    nodes, ``node`` (rewired) among them."""
    from onnx import helper
    a, b = node.input
    p = f"{node.output[0]}/int8_attention"
    nodes = _absmax(a, -1, f"{p}/a", model, in_float32=True, pieces=pieces)
    if smoothed:
        mean, smooth = f"{p}/b_mean", f"{p}/b_smooth"
        axes = f"{p}/b_mean_axes"
        _constant(model, axes, np.array([-1], np.int64))
        # b is K^T: its tokens run along the last axis
        nodes += [_reduce("ReduceMean", b, mean, -1, axes, model), helper.make_node("Sub", [b, mean], [smooth])]
        b = smooth
    nodes += _absmax(b, -2, f"{p}/b", model, in_float32=True, pieces=pieces)
    node.input[0], node.input[1] = f"{p}/a", f"{p}/b"
    floats.update(node.input)
    if pieces == 1:
        return [*nodes, node]
    y = node.output[0]
    node.output[0] = f"{p}/hi_hi"
    return [*nodes, node, helper.make_node("MatMul", [f"{p}/a/lo", f"{p}/b"], [f"{p}/lo_hi"]),
            helper.make_node("MatMul", [f"{p}/a", f"{p}/b/lo"], [f"{p}/hi_lo"]),
            helper.make_node("Add", [f"{p}/hi_hi", f"{p}/lo_hi"], [f"{p}/sum"]),
            helper.make_node("Add", [f"{p}/sum", f"{p}/hi_lo"], [y])]


def _constant(model, name: str, value: np.ndarray) -> None:
    from onnx import numpy_helper
    model.graph.initializer.append(numpy_helper.from_array(value, name))


def _expand_attention(model, recorded: set[str], input_shapes: dict[str, tuple]) -> None:
    """Replace, in place, each contrib attention (GroupQueryAttention) whose products the program
    names by the plain ONNX ops the compiler rewrote it into (``dlegion_cc.canon``: the one
    definition of the rewrite), so its QK^T and PV are MatMuls the yardstick can quantize. The
    rewrite names its nodes after the attention node's, as it did in the compiler, so the
    recorded names (``<node name>/MatMul_out``...) are those of its MatMuls here. It reads the
    shapes the inputs bind and the constants they make (total_sequence_length), as the compiler
    does once it has bound the dims and folded."""
    from dlegion_cc.canon import EXPANSIONS
    from dlegion_cc.canon.builder import Builder
    from dlegion_cc.canon.gqa import MS
    handler = EXPANSIONS[(MS, "GroupQueryAttention")]
    named = [n for n in model.graph.node if n.domain == MS and n.op_type == "GroupQueryAttention"
             and any(r.startswith(f"{n.name}/") for r in recorded)]
    if not named:
        return
    bound = _bound(model, input_shapes)
    inferred = _inferred(bound)
    known = {n: v for n, v in _constants(bound, _shapes(model, input_shapes)).items() if v is not None}
    b = Builder(model, {n.input[6]: known[n.input[6]] for n in named if n.input[6] in known})
    b.types.update({vi.name: vi.type.tensor_type for vi in [*inferred.input, *inferred.value_info]
                    if vi.type.tensor_type.HasField("shape")})
    for node in list(model.graph.node):
        if node in named:
            b.at(node)
            handler(node, b)
        else:
            b.keep(node)
    b.finish()


def _recorded_products(model, recorded: set[str], input_shapes: dict[str, tuple]) -> dict[str, bool]:
    """The MatMuls the program records it quantized (``recorded``: their outputs, as
    passes/attention.py names them; it keeps fp32 a product of fewer rows than an array, or one
    a NaN or an infinity may reach, and does not name it), by output, each with whether its b
    is smoothed. A contrib attention's products are MatMuls by now (``_expand_attention``); a
    recorded product the model holds no MatMul for is an error, which ``check.judge`` reports."""
    wanted = [n for n in model.graph.node if n.op_type == "MatMul" and n.domain in ("", "ai.onnx")
              and len(n.input) == 2 and n.output[0] in recorded]
    missing = recorded - {n.output[0] for n in wanted}
    if missing:     # evaluated unquantized, the yardstick would stand the attention's error away
        raise ValueError(f"the program's int8 attention products {', '.join(sorted(missing))} are no MatMul "
                         f"of the model")
    if not wanted:
        return {}
    shapes = _shapes(model, input_shapes)
    const = _constants(model, shapes)
    users: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    outputs = {o.name for o in model.graph.output}
    only = lambda name: users[name][0] if len(users.get(name, [])) == 1 and name not in outputs else None  # noqa: E731
    return {n.output[0]: _feeds_softmax(n.output[0], only, const, shapes) for n in wanted}


def _feeds_softmax(scores: str, only, const: dict, shapes: dict) -> bool:
    """Whether ``scores`` reach nothing but a softmax over their last axis, through at most one
    each of a Reshape keeping the last axis, a Mul by a scalar constant and an Add of a constant
    keeping the shape: the compiler's condition for smoothing K (passes/attention.py)."""
    node, name, seen = only(scores), scores, set()
    while node is not None and node.op_type in ("Mul", "Add", "Reshape") and node.op_type not in seen:
        out = node.output[0]
        if node.op_type == "Reshape":
            if not _same(shapes, out, name, last=True):
                return False
        else:
            other = node.input[1] if node.input[0] == name else node.input[0]
            c = const.get(other)
            if c is None or (node.op_type == "Mul" and c.size != 1) or not (
                    _broadcasts_into(c.shape, shapes.get(name)) or _same(shapes, out, name)):
                return False
        seen.add(node.op_type)
        name, node = out, only(out)
    if node is None or node.op_type != "Softmax":
        return False
    axis, rank = next((a.i for a in node.attribute if a.name == "axis"), -1), len(shapes.get(name, ()))
    return axis == -1 or (rank > 0 and axis % rank == rank - 1)


def _broadcasts_into(c: tuple, shape: tuple | None) -> bool:
    """Whether a constant of shape ``c`` broadcasts into values of ``shape`` without growing it
    (each of its dimensions 1 or the value's own): an elementwise op with it then keeps the
    value's shape, whatever shape inference names the result's dimensions (it gives a
    symbolic dimension broadcast against 1 a fresh name)."""
    if shape is None or len(c) > len(shape):
        return False
    return all(k == 1 or (isinstance(d, int) and k == d) for k, d in zip(reversed(c), reversed(shape)))


def _same(shapes: dict, x: str, y: str, last: bool = False) -> bool:
    """Whether values ``x`` and ``y`` have the same shape (the same last dimension, ``last``),
    as shape inference knows them (symbolic dimensions by name)."""
    a, b = shapes.get(x), shapes.get(y)
    if a is None or b is None:
        return False
    return a[-1:] == b[-1:] if last else a == b


def _constants(model, shapes: dict[str, tuple]) -> dict[str, np.ndarray | None]:
    """Values the graph computes from constants alone (initializers, Constant nodes, the
    Shape of a value whose dimensions are bound, and what only they feed), by name, as the
    compiler folds them once it has bound the inputs' dimensions (a causal mask made from the
    sequence length): onnx's reference evaluator computes the non-initializers."""
    from onnx import numpy_helper
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    inputs = {i.name for i in model.graph.input}
    for n in model.graph.node:
        if n.op_type == "Shape" and all(isinstance(d, int) and d >= 0 for d in shapes.get(n.input[0], ("?",))):
            attrs = {a.name: a.i for a in n.attribute}
            dims = shapes[n.input[0]][attrs.get("start", 0):attrs.get("end", None)]
            values[n.output[0]] = np.array(dims, np.int64)
        elif n.op_type == "Constant" or (n.input and all(i == "" or (i in values and i not in inputs) for i in n.input)):
            try:
                if n.domain not in ("", "ai.onnx"):
                    raise NotImplementedError(n.domain)
                values.update(zip(n.output, _evaluate_node(n, values, model)))
            except Exception:
                # An operator (a contrib one, or a dtype: int4) the evaluator lacks: still a
                # constant, as the compiler folds it, though of no known value (None).
                values.update({o: None for o in n.output})
    return values


def _evaluate_node(node, values: dict, model) -> list:
    from onnx import helper
    from onnx.reference import ReferenceEvaluator
    g = helper.make_graph([node], "c", [], [helper.make_empty_tensor_value_info(o) for o in node.output],
                          [_tensor(i, values[i]) for i in node.input if i])
    m = helper.make_model(g, opset_imports=list(model.opset_import))
    return ReferenceEvaluator(m).run(None, {})


def _tensor(name: str, value: np.ndarray):
    from onnx import numpy_helper
    return numpy_helper.from_array(np.asarray(value), name)


def _shapes(model, input_shapes: dict[str, tuple]) -> dict[str, tuple]:
    """Each value's dimensions as shape inference gives them with the graph inputs' bound to
    ``input_shapes``, as the compiler binds them (a symbolic one left by its name)."""
    graph = _inferred(_bound(_light(model), input_shapes))
    # An unknown dimension is None, not 0: a bound empty cache (past 0) is a known 0.
    dim = lambda d: d.dim_param if d.HasField("dim_param") else d.dim_value if d.HasField("dim_value") else None  # noqa: E731
    dims = lambda vi: tuple(dim(d) for d in vi.type.tensor_type.shape.dim)  # noqa: E731
    return {vi.name: dims(vi) for vi in [*graph.input, *graph.output, *graph.value_info]
            if vi.type.tensor_type.HasField("shape")}


def _bound(model, input_shapes: dict[str, tuple]):
    """A copy of ``model`` whose graph inputs have the dimensions of ``input_shapes``."""
    import onnx
    bound = onnx.ModelProto()
    bound.CopyFrom(model)
    for vi in bound.graph.input:
        if vi.name in input_shapes:
            for d, n in zip(vi.type.tensor_type.shape.dim, input_shapes[vi.name]):
                d.dim_value = int(n)
    return bound


def _opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


# Initializers up to this many bytes keep their elements in the copy shape inference is given
# (shapes, axes, scalars: what inference propagates); larger ones are shown to it as graph inputs.
KEPT_BYTES = 1 << 16


def _tensor_bytes(t) -> int:
    """Bytes of initializer ``t``'s elements, from its type and dims (its data not read)."""
    from onnx import helper
    size = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize if t.data_type else 0
    return int(np.prod(t.dims, dtype=np.int64)) * size


def _light(model):
    """``model`` for shape inference: a copy whose initializers over KEPT_BYTES are graph inputs
    of their type and shape, the rest of the graph, its functions and opsets as they are
    (``model`` itself when it has none). onnx's inference serializes the model it is given,
    weights and all: on 4 2B4T layers at 256 each float64 evaluation took 24-28 s with it and
    12-16 s with this copy, the same outputs bit for bit."""
    import onnx
    from onnx import helper
    large = [t for t in model.graph.initializer if _tensor_bytes(t) > KEPT_BYTES]
    if not large:
        return model
    names = {t.name for t in large}
    light = onnx.ModelProto()
    for field in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(light, field, getattr(model, field))
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    g, src = light.graph, model.graph
    g.name = src.name
    for field in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(g, field).extend(getattr(src, field))
    g.initializer.extend(t for t in src.initializer if t.name not in names)
    g.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in large)
    return light


def _inferred(model):
    """``model``'s graph with the types and shapes of its intermediates inferred (from
    ``_light(model)``)."""
    import onnx
    model = _light(model)
    if any(n.domain not in ("", "ai.onnx") for n in model.graph.node):
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
        # Its handlers know ReduceSum's axes input (opset 18) but not ReduceMax's, whose output
        # (the per-token absmax runtime/quantized64.py inserts) it leaves without a shape and then
        # fails on: the inference sees ReduceSum there, of the same type and shape.
        renamed = [n for n in model.graph.node if n.op_type == "ReduceMax" and n.domain in ("", "ai.onnx")]
        for n in renamed:
            n.op_type = "ReduceSum"
        try:
            return SymbolicShapeInference.infer_shapes(model, auto_merge=True).graph
        finally:
            for n in renamed:
                n.op_type = "ReduceMax"
    return onnx.shape_inference.infer_shapes(model, data_prop=True).graph


def _float32_values(model) -> set[str]:
    """The names of the graph's float32 values, intermediates included (by shape inference)."""
    inferred = _inferred(model)
    typed = [*inferred.input, *inferred.output, *inferred.value_info]
    return ({vi.name for vi in typed if vi.type.tensor_type.elem_type == _F32}
            | {t.name for t in model.graph.initializer if t.data_type == _F32})


def _kept_float32(node, floats: set[str]) -> list:
    """``node`` computing in float32 between casts from and back to float64."""
    from onnx import helper
    before, after = [], []
    for k, name in enumerate(node.input):
        if name in floats:
            node.input[k] = f"{name}/as_f32/{node.name}"
            before.append(helper.make_node("Cast", [name], [node.input[k]], to=_F32))
    for k, name in enumerate(node.output):
        if name in floats:
            node.output[k] = f"{name}/f32"
            after.append(helper.make_node("Cast", [node.output[k]], [name], to=_F64))
    return [*before, node, *after]


def _widen_node(node) -> None:
    from onnx import numpy_helper
    for a in node.attribute:
        if node.op_type == "Cast" and a.name == "to" and a.i == _F32:
            a.i = _F64
        elif a.HasField("t") and a.t.data_type == _F32:
            a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64), a.t.name))


def float64_outputs(path: str | Path, inputs: dict[str, np.ndarray], threads: int | None = None,
                    approximations: bool = False, int8_attention: Collection[str] = (),
                    pieces: int = 1) -> dict[str, np.ndarray]:
    """The graph's outputs evaluated in float64 on ``inputs`` (float inputs widened); with
    ``approximations``, those of the graph as the compiler computes it (see APPROXIMATIONS and
    ``float64_model``)."""
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # No fusions: a fused kernel (MatMulIntegerToFloat, QLinearMatMul) would take float32 again.
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if threads is not None:
        opts.intra_op_num_threads = opts.inter_op_num_threads = threads
    model = float64_model(path, approximations, int8_attention, {k: v.shape for k, v in inputs.items()}, pieces)
    feed = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in inputs.items()}
    try:
        sess = _session(model, opts)
    except Exception as e:              # onnxruntime's own error types, one per status code
        if "NOT_IMPLEMENTED" not in str(e):
            raise
        return _evaluated(model, feed)  # an operator without a double kernel (Erf, Softplus, ...)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feed)))


def approximated_float32_outputs(path: str | Path, inputs: dict[str, np.ndarray], int8_attention: Collection[str],
                                 pieces: int, exact_products: bool = False) -> dict[str, np.ndarray]:
    """The graph as the compiler computes it (``float64_model`` with ``approximations``) run in
    float32: its float64 tensors, types and casts made float32. Its distance from the float64
    run is fp32's own spread on that graph, where rounding in fp32 moves the int8 pieces'
    roundings (a second piece's steps are LOW_STEPS times finer than the first's). Given
    ``exact_products``, each product of int8 pieces multiplies their codes and then scales the
    sums, as the program does (``_products_of_codes``): its sums are then exact, as the
    program's int32 accumulation is, where the dequantized pieces' fp32 sums round (``--check``
    takes those: its floor's cases were measured with them, tests/test_check_floor.py)."""
    import onnxruntime as ort
    from onnx import numpy_helper
    model = float64_model(path, True, int8_attention, {k: v.shape for k, v in inputs.items()}, pieces)
    if exact_products:
        _products_of_codes(model)
    g = model.graph

    def narrow(t):
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))
    for t in g.initializer:
        if t.data_type == _F64:
            narrow(t)
    for vi in [*g.input, *g.output, *g.value_info]:
        if vi.type.tensor_type.elem_type == _F64:
            vi.type.tensor_type.elem_type = _F32
    for n in g.node:
        for a in n.attribute:
            if n.op_type == "Cast" and a.name == "to" and a.i == _F64:
                a.i = _F32
            elif a.HasField("t") and a.t.data_type == _F64:
                narrow(a.t)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = _session(model, opts)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, inputs)))


def _products_of_codes(model) -> None:
    """Each MatMul of two int8 pieces dequantized (``_dequantized``'s ``q * r``, a row scale
    on the left and a column scale on the right) made the MatMul of their codes, times the
    left scale, times the right one: the drain's order (runtime/semantics.py). Integer codes'
    sums are exact in float32 below 2**24 (127 * 127 * 512 at sequence 512), so run in float32
    the products round only where the program's do."""
    from onnx import helper
    made = {o: n for n in model.graph.node for o in n.output}

    def codes(name: str):
        mul = made.get(name)
        if mul is None or mul.op_type != "Mul" or len(mul.input) != 2:
            return None
        q, r = (made.get(x) for x in mul.input)
        return tuple(mul.input) if q is not None and r is not None and q.op_type == r.op_type == "Cast" else None

    nodes = []
    for n in model.graph.node:
        a, b = (codes(x) for x in n.input) if n.op_type == "MatMul" and len(n.input) == 2 else (None, None)
        if a is None or b is None:
            nodes.append(n)
            continue
        y = n.output[0]
        nodes += [helper.make_node("MatMul", [a[0], b[0]], [f"{y}/codes"]),
                  helper.make_node("Mul", [f"{y}/codes", a[1]], [f"{y}/row_scaled"]),
                  helper.make_node("Mul", [f"{y}/row_scaled", b[1]], [y])]
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _evaluated(model, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``model`` run by onnx's reference evaluator: every operator the standard defines, in
    float64 where its operands are (slow, but only for graphs onnxruntime cannot run so)."""
    from onnx.reference import ReferenceEvaluator
    names = [o.name for o in model.graph.output]
    return dict(zip(names, ReferenceEvaluator(model, new_ops=[_erf64()]).run(names, feed)))


def _erf64():
    """Erf in its operand's precision: the reference evaluator's own rounds to float32."""
    import math
    from onnx.reference.ops.op_erf import Erf

    class Erf64(Erf):
        def _run(self, x):
            return (np.vectorize(math.erf, otypes=[x.dtype])(x),)
    Erf64.__name__ = "Erf"
    return Erf64


def _session(model, opts):
    """A session of ``model``, through a file with external data: a float64 copy of a few
    layers already passes protobuf's 2 GiB."""
    import tempfile
    import onnx
    import onnxruntime as ort
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/model.onnx"
        onnx.save_model(model, path, save_as_external_data=True, location="model.onnx.data")
        return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def parameter_bytes(path: str | Path) -> int:
    """Bytes of the model's initializers as stored (external data counted, not read)."""
    import onnx
    m = onnx.load(str(path), load_external_data=False)
    return sum(_tensor_bytes(t) for t in m.graph.initializer)


def rel_l2(x: np.ndarray, ref: np.ndarray) -> float:
    """``|x - ref| / |ref|`` in float64 (the L2 norm over all elements)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / denom) if denom else float(np.linalg.norm(x - ref))
