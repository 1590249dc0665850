"""Golden outputs: seeded inputs, one onnxruntime run, stored as byte-stable .npz files."""
from __future__ import annotations

import io
import platform
import zipfile
from pathlib import Path

import numpy as np
import onnx

from models.decoder import PAST_DIM, SEQ_DIM

FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # zip entries carry no wall-clock time, so reruns give the same bytes
ELEM_TYPES = {onnx.TensorProto.INT64: np.int64, onnx.TensorProto.FLOAT: np.float32}


def seeded_inputs(model: onnx.ModelProto, seq: int, vocab: int, seed: int, past: int = 0) -> dict[str, np.ndarray]:
    """Token ids in [0, vocab) for every int64 graph input, shape [1, seq]; then standard normal
    values for every float32 input (a key/value cache), its symbolic dims bound to ``seq`` and
    ``past`` (the token ids are drawn first, so a model without a cache gets the ids it got)."""
    rng = np.random.default_rng(seed)
    inputs, floats = {}, []
    for value in model.graph.input:
        elem = value.type.tensor_type.elem_type
        if elem == onnx.TensorProto.FLOAT:
            floats.append(value)
        elif elem == onnx.TensorProto.INT64:
            inputs[value.name] = rng.integers(0, vocab, (1, seq), dtype=np.int64)
        else:
            raise ValueError(f"graph input {value.name!r} is neither int64 token ids nor a float32 cache")
    sizes = {SEQ_DIM: seq, PAST_DIM: past}
    for value in floats:
        shape = [d.dim_value if d.HasField("dim_value") else sizes[d.dim_param] for d in value.type.tensor_type.shape.dim]
        inputs[value.name] = rng.standard_normal(shape).astype(np.float32)
    return inputs


def run(path: str | Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Graph outputs by name from a fresh single-threaded onnxruntime session (thread counts
    change how some kernels split their sums). A model with quantized integer operators runs
    with the kernels that compute their definition (``runtime.check``'s "exact" reference):
    onnxruntime's default uint8 x int8 kernels saturate on CPUs without VNNI and not on others,
    and a golden must not depend on the CPU's instruction set."""
    from runtime.check import integer_ops, session
    sess = session(path, "exact" if integer_ops(path) else "onnxruntime", threads=1)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, inputs)))


def write_npz(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    """Like numpy.savez, but with fixed entry times and sorted names."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name in sorted(arrays):
            entry = zipfile.ZipInfo(f"{name}.npy", date_time=FIXED_TIME)
            with archive.open(entry, "w") as handle:
                np.lib.format.write_array(handle, np.ascontiguousarray(arrays[name]), allow_pickle=False)
    Path(path).write_bytes(buffer.getvalue())


def read_npz(path: str | Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def machine() -> str:
    """The CPU model, which decides which onnxruntime kernels run (and so the last bits of float results)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
