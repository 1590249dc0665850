"""A graph evaluated in float64: the yardstick both fp32 programs (onnxruntime's and ours) are
measured against.

The copy is the same graph with every float32 tensor made float64: initializers, graph inputs
and outputs, intermediate types, ``Cast``/``ConstantOfShape``/``Constant`` targets; integer
operators are unchanged, and so are the float32 scales and zero points of quantization operators,
which have no float64 kernels: their float inputs are cast to float32 and their float outputs
back to float64. Constant int8 MatMulInteger weights are shifted to uint8 as ``--reference
exact`` does (``check.unsigned_integer_weights``), so no CPU's saturating kernel enters the
yardstick. onnxruntime runs it (its CPU kernels take double for the operators
LLM graphs use); a graph with an operator it has no double kernel for (Erf, so GELU; Softplus)
is run by onnx's reference evaluator instead. A BitNet graph's per-token absmax quantization then rounds a few values the
other way than fp32 does, as any fp32 program also may: that spread is what the distances
measure.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

_F32, _F64 = 1, 11          # onnx.TensorProto.FLOAT, DOUBLE
# Operators whose float operands onnxruntime takes in float32 only.
FLOAT32_ONLY = {"DequantizeLinear", "QuantizeLinear", "DynamicQuantizeLinear", "MatMulNBits", "QLinearMatMul"}


def float64_model(path: str | Path, approximations: bool = False):
    """The model at ``path`` (external data loaded) with its float32 tensors made float64;
    with ``approximations``, also the ones the compiler makes (see APPROXIMATIONS)."""
    import onnx
    from onnx import numpy_helper
    from runtime.check import unsigned_integer_weights
    model = onnx.load(str(path))
    unsigned_integer_weights(model)
    g = model.graph
    floats = _float32_values(model)
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
        nodes.extend(_kept_float32(node, floats) if node.op_type in FLOAT32_ONLY else [node])
    del g.node[:]
    g.node.extend(nodes)
    return model


# The approximations dlegion-cc makes, by the operator it makes them in: what it computes instead
# (dlegion_cc/passes/matmul_nbits.py quantizes MatMulNBits' float activations to int8 per row).
APPROXIMATIONS = {("com.microsoft", "MatMulNBits"): "float activations quantized to int8 per row"}
ABSMAX_FLOOR = 1e-30        # as the compiler's: an all-zero row stays zero


def approximations(path: str | Path) -> list[str]:
    """What the compiler computes instead of ``path``'s operators, one phrase per kind."""
    import onnx
    m = onnx.load(str(path), load_external_data=False)
    kinds = {(n.domain, n.op_type) for n in m.graph.node} & set(APPROXIMATIONS)
    return [f"{op}: {APPROXIMATIONS[(d, op)]}" for d, op in sorted(kinds)]


def _absmax_rows(node, floats: set[str], model) -> list:
    """Nodes making ``node``'s first input what the compiler feeds it: ``q * r`` with
    ``q = round(x / r)`` (half to even) and ``r = max(max|x|, floor) / 127`` per row; rewires
    ``node`` to it."""
    from onnx import helper, numpy_helper
    x = node.input[0]
    p = f"{x}/absmax_rows/{node.name}"
    consts = {f"{p}/floor": ABSMAX_FLOOR, f"{p}/127": 127.0, f"{p}/axes": None}
    for name, v in consts.items():
        value = np.array([-1], np.int64) if v is None else np.array(v, np.float64)
        model.graph.initializer.append(numpy_helper.from_array(value, name))
    nodes = [helper.make_node("Abs", [x], [f"{p}/abs"]),
             helper.make_node("ReduceMax", [f"{p}/abs", f"{p}/axes"], [f"{p}/max"], keepdims=1),
             helper.make_node("Max", [f"{p}/max", f"{p}/floor"], [f"{p}/floored"]),
             helper.make_node("Div", [f"{p}/floored", f"{p}/127"], [f"{p}/r"]),
             helper.make_node("Div", [x, f"{p}/r"], [f"{p}/scaled"]),
             helper.make_node("Round", [f"{p}/scaled"], [f"{p}/q"]),
             helper.make_node("Mul", [f"{p}/q", f"{p}/r"], [p])]
    if _opset(model) < 18:          # ReduceMax takes its axes as an attribute before opset 18
        del nodes[1].input[1:]
        nodes[1].attribute.append(helper.make_attribute("axes", [-1]))
    node.input[0] = p
    floats.add(p)
    return nodes


def _opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def _float32_values(model) -> set[str]:
    """The names of the graph's float32 values, intermediates included (by shape inference)."""
    import onnx
    if any(n.domain not in ("", "ai.onnx") for n in model.graph.node):
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
        inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True).graph
    else:
        inferred = onnx.shape_inference.infer_shapes(model).graph
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
                    approximations: bool = False) -> dict[str, np.ndarray]:
    """The graph's outputs evaluated in float64 on ``inputs`` (float inputs widened); with
    ``approximations``, those of the graph as the compiler computes it (see APPROXIMATIONS)."""
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # No fusions: a fused kernel (MatMulIntegerToFloat, QLinearMatMul) would take float32 again.
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if threads is not None:
        opts.intra_op_num_threads = opts.inter_op_num_threads = threads
    model = float64_model(path, approximations)
    feed = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in inputs.items()}
    try:
        sess = _session(model, opts)
    except Exception as e:              # onnxruntime's own error types, one per status code
        if "NOT_IMPLEMENTED" not in str(e):
            raise
        return _evaluated(model, feed)  # an operator without a double kernel (Erf, Softplus, ...)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feed)))


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
    from onnx import helper
    m = onnx.load(str(path), load_external_data=False)
    total = 0
    for t in m.graph.initializer:
        size = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize if t.data_type else 0
        total += int(np.prod(t.dims, dtype=np.int64)) * size
    return total


def rel_l2(x: np.ndarray, ref: np.ndarray) -> float:
    """``|x - ref| / |ref|`` in float64 (the L2 norm over all elements)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / denom) if denom else float(np.linalg.norm(x - ref))
