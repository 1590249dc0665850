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
    mismatches: int      # elements that differ (integers) or are non-finite in one only (floats)
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
    nonfinite = int(np.count_nonzero(np.isfinite(a) != np.isfinite(b)))
    fin = np.isfinite(a) & np.isfinite(b)
    err = np.linalg.norm(a[fin] - b[fin])
    norm = np.linalg.norm(b[fin])
    rel = float(err / norm) if norm > 0 else float(err)
    max_abs = float(np.abs(a[fin] - b[fin]).max(initial=0.0))
    return Comparison(name, str(ref.dtype), False, rel, max_abs, nonfinite, rel <= tol and nonfinite == 0)


def compare(ours: dict[str, np.ndarray], ref: dict[str, np.ndarray],
            tol: float = REL_L2_TOLERANCE) -> list[Comparison]:
    missing = sorted(set(ref) - set(ours))
    if missing:
        raise ValueError(f"the program does not produce graph output(s) {', '.join(missing)}")
    return [compare_one(n, ours[n], ref[n], tol) for n in ref]
