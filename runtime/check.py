"""Comparing emulated outputs with onnxruntime on the same inputs."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

REL_L2_TOLERANCE = 1e-4


@dataclass
class Comparison:
    name: str
    dtype: str
    exact: bool          # compared bit for bit (integer outputs)
    rel_l2: float
    max_abs: float
    mismatches: int      # elements that differ (integer values) or are non-finite in one only
    ok: bool


# What ``--check`` compares with: onnxruntime as it comes, or onnxruntime made to compute the
# integer operators' definition. On x86 CPUs without VNNI its uint8 x int8 kernels (the dynamic
# int8 MatMulInteger, and QDQ int8 matmuls it fuses into QLinearMatMul) sum pairs of products in
# saturating int16 (pmaddubsw), which full-range int8 weights overflow; "exact" shifts constant
# int8 MatMulInteger weights to uint8 with zero point + 128 (the same products, a uint8 x uint8
# kernel that cannot saturate) and optimizes at ORT_ENABLE_BASIC (no QDQ fusion). That run
# equals ONNX's reference evaluator.
REFERENCES = ("onnxruntime", "exact")
INTEGER_OPS = {"MatMulInteger", "QLinearMatMul", "DynamicQuantizeLinear", "QuantizeLinear", "DequantizeLinear"}


def session(model: str | Path, reference: str = "onnxruntime", extra_outputs: list[str] = (),
            threads: int | None = None):
    """An onnxruntime session of ``model`` (``reference``: see REFERENCES), with
    ``extra_outputs`` that are values of the model added as graph outputs (the compiler's own
    values, such as a reshape a pass put in, are not); ``threads``: its intra- and inter-op
    thread counts (default: onnxruntime's)."""
    import onnx
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads is not None:
        opts.intra_op_num_threads = opts.inter_op_num_threads = threads
    if reference == "onnxruntime" and not extra_outputs:
        return ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    m = onnx.load(str(model))
    present, made = {o.name for o in m.graph.output}, {o for n in m.graph.node for o in n.output}
    m.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in extra_outputs
                          if n in made and n not in present)
    if reference == "exact":
        unsigned_integer_weights(m)
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def unsigned_integer_weights(model) -> None:
    """Rewrite each constant int8 B operand of MatMulInteger and its zero point (0 when absent)
    as uint8 + 128, in place: the same differences B - zero point."""
    from onnx import TensorProto, numpy_helper
    inits = {t.name: t for t in model.graph.initializer}
    shifted: set[str] = set()

    def shift(name: str) -> None:
        if name not in shifted:
            a = numpy_helper.to_array(inits[name]).astype(np.int16) + 128
            inits[name].CopyFrom(numpy_helper.from_array(a.astype(np.uint8), name))
            shifted.add(name)

    for node in model.graph.node:
        if node.op_type != "MatMulInteger":
            continue
        b = node.input[1]
        if b not in shifted and (b not in inits or inits[b].data_type != TensorProto.INT8):
            continue                                    # a computed or unsigned B
        zp = node.input[3] if len(node.input) > 3 else ""
        if zp and zp not in inits:
            continue                                    # a computed zero point: left as it is
        shift(b)
        if zp:
            shift(zp)
        else:                                           # the default zero point 0, shifted
            zp = f"{b}_zero_point_128"
            if zp not in inits:
                inits[zp] = numpy_helper.from_array(np.array(128, np.uint8), zp)
                model.graph.initializer.append(inits[zp])
            node.input.extend([""] * (4 - len(node.input)))
            node.input[3] = zp


def integer_ops(model: str | Path) -> bool:
    """Whether ``model`` has quantized integer operators (where the two references can differ)."""
    import onnx
    m = onnx.load(str(model), load_external_data=False)
    return any(n.op_type in INTEGER_OPS for n in m.graph.node)


def onnx_reference(model: str | Path, inputs: dict[str, np.ndarray],
                   reference: str = "onnxruntime") -> dict[str, np.ndarray]:
    """Run onnxruntime on ``model`` with ``inputs``; every graph output by name."""
    sess = session(model, reference)
    feeds = {i.name: inputs[i.name] for i in sess.get_inputs() if i.name in inputs}
    missing = [i.name for i in sess.get_inputs() if i.name not in inputs]
    if missing:
        raise ValueError(f"{model}: the model takes input(s) {', '.join(missing)}, which the program has not "
                         f"(program inputs: {', '.join(sorted(inputs)) or 'none'})")
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def compare_one(name: str, ours: np.ndarray, ref: np.ndarray, tol: float = REL_L2_TOLERANCE) -> Comparison:
    if ours.shape != ref.shape:
        return Comparison(name, str(ref.dtype), False, float("inf"), float("inf"), ref.size, False)
    if not np.issubdtype(ref.dtype, np.floating):
        diff = int(np.count_nonzero(ours != ref))
        big = np.abs(ours.astype(np.float64) - ref.astype(np.float64))
        return Comparison(name, str(ref.dtype), True, 0.0 if diff == 0 else float("inf"),
                          float(big.max(initial=0.0)), diff, diff == 0)
    a, b = ours.astype(np.float64), ref.astype(np.float64)
    differing = int(np.count_nonzero(np.isfinite(a) != np.isfinite(b)))
    if b.size and np.array_equal(b, np.round(b)):      # integers carried in floats (quantized values)
        differing += int(np.count_nonzero(a != b))
    fin = np.isfinite(a) & np.isfinite(b)
    err = np.linalg.norm(a[fin] - b[fin])
    norm = np.linalg.norm(b[fin])
    rel = float(err / norm) if norm > 0 else float(err)
    max_abs = float(np.abs(a[fin] - b[fin]).max(initial=0.0))
    return Comparison(name, str(ref.dtype), False, rel, max_abs, differing, rel <= tol and differing == 0)


def compare(ours: dict[str, np.ndarray], ref: dict[str, np.ndarray],
            tol: float = REL_L2_TOLERANCE) -> list[Comparison]:
    missing = sorted(set(ref) - set(ours))
    if missing:
        raise ValueError(f"the program does not produce graph output(s) {', '.join(missing)}")
    # a different shape is a program built for another model, not a numerical mismatch
    for n in ref:
        if ours[n].shape != ref[n].shape:
            raise ValueError(f"output {n!r}: the program's shape {list(ours[n].shape)} is not "
                             f"the model's {list(ref[n].shape)}")
    return [compare_one(n, ours[n], ref[n], tol) for n in ref]


def intermediates(program, machine) -> dict[str, np.ndarray]:
    """Every DRAM tensor the compiler bound to a graph value, as the run left it."""
    out = {}
    for t in program.tensors:
        if t.kind == "scratch" and t.io_name:
            out[t.io_name] = machine.get(t.name)
    return out


def onnx_intermediates(model: str | Path, inputs: dict[str, np.ndarray], names: list[str],
                       reference: str = "onnxruntime") -> dict:
    """onnxruntime's values of ``names``: the model is run with them added as graph outputs."""
    sess = session(model, reference, names)
    wanted = [n for n in names if n in {o.name for o in sess.get_outputs()}]
    feeds = {i.name: inputs[i.name] for i in sess.get_inputs()}
    return dict(zip(wanted, sess.run(wanted, feeds)))


def compare_intermediates(model, inputs, result, tol: float = REL_L2_TOLERANCE,
                          reference: str = "onnxruntime") -> list[Comparison]:
    """Each surviving intermediate against onnxruntime's, in program order."""
    ours = intermediates(result.program, result.machine)
    ref = onnx_intermediates(model, inputs, list(ours), reference)
    rows = []
    for name, value in ours.items():
        if name not in ref:
            continue
        want = ref[name]
        rows.append(compare_one(name, value.astype(want.dtype, copy=False).reshape(want.shape), want, tol))
    return rows
