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


def onnx_reference(model: str | Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run onnxruntime on ``model`` with ``inputs``; every graph output by name."""
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    feeds = {i.name: inputs[i.name] for i in sess.get_inputs() if i.name in inputs}
    missing = [i.name for i in sess.get_inputs() if i.name not in inputs]
    if missing:
        raise ValueError(f"{model}: the program does not produce inputs {', '.join(missing)}")
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
    return [compare_one(n, ours[n], ref[n], tol) for n in ref]


def intermediates(program, machine) -> dict[str, np.ndarray]:
    """Every DRAM tensor the compiler bound to a graph value, as the run left it."""
    out = {}
    for t in program.tensors:
        if t.kind == "scratch" and t.io_name:
            out[t.io_name] = machine.get(t.name)
    return out


def onnx_intermediates(model: str | Path, inputs: dict[str, np.ndarray], names: list[str]) -> dict:
    """onnxruntime's values of ``names``: the model is run with them added as graph outputs."""
    import onnx
    import onnxruntime as ort
    m = onnx.load(str(model))
    present = {o.name for o in m.graph.output}
    for n in names:
        if n not in present:
            m.graph.output.append(onnx.helper.make_empty_tensor_value_info(n))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    wanted = [n for n in names if n in {o.name for o in sess.get_outputs()}]
    feeds = {i.name: inputs[i.name] for i in sess.get_inputs()}
    return dict(zip(wanted, sess.run(wanted, feeds)))


def compare_intermediates(model, inputs, result, tol: float = REL_L2_TOLERANCE) -> list[Comparison]:
    """Each surviving intermediate against onnxruntime's, in program order."""
    ours = intermediates(result.program, result.machine)
    ref = onnx_intermediates(model, inputs, list(ours))
    rows = []
    for name, value in ours.items():
        if name not in ref:
            continue
        want = ref[name]
        rows.append(compare_one(name, value.astype(want.dtype, copy=False).reshape(want.shape), want, tol))
    return rows
