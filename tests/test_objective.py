"""--objective end to end: a product whose activations outgrow the ``act`` scratchpad, compiled
for fewest cycles and for fewest joules, both checked against onnxruntime by ``dlegion-run``."""
import json
import subprocess
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

M, K, N = 256, 512, 256          # x [M, K] int8 is twice dlegion-tiny's 64 KiB act scratchpad


def _cli(module, name, *args):
    code = f"import sys; from {module} import main; sys.argv[0] = '{name}'; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)


def _gemm(path):
    w = np.random.default_rng(0).integers(-128, 128, (K, N)).astype(np.int8)
    node = helper.make_node("MatMulInteger", ["x", "w"], ["y"])
    g = helper.make_graph([node], "gemm", [helper.make_tensor_value_info("x", TensorProto.INT8, [M, K])],
                          [helper.make_tensor_value_info("y", TensorProto.INT32, [M, N])],
                          [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]), path)


def test_energy_reads_each_operand_once_and_stays_exact(tmp_path):
    model = tmp_path / "gemm.onnx"
    _gemm(model)
    runs = {}
    for objective in ("latency", "energy"):
        prog, js = tmp_path / f"{objective}.s", tmp_path / f"{objective}.json"
        r = _cli("dlegion_cc.cli", "dlegion-cc", model, "-o", prog, "--arch", "dlegion-tiny", "--objective", objective)
        assert r.returncode == 0, r.stderr
        r = _cli("runtime.cli", "dlegion-run", prog, "--check", model, "--json", js)
        assert r.returncode == 0, r.stdout + r.stderr
        runs[objective] = json.loads(js.read_text())
    moved = {o: n["dram_read_bytes"] + n["dram_write_bytes"] for o, n in runs.items()}
    compulsory = runs["energy"]["compulsory_dram_bytes"]
    assert compulsory == M * K + K * N + 4 * M * N
    # Fastest, x streams again for each column tile; frugal, it is read once, at a few % of time.
    assert moved["energy"] == compulsory < moved["latency"]
    assert runs["latency"]["cycles"] < runs["energy"]["cycles"] <= 1.10 * runs["latency"]["cycles"]
    assert runs["energy"]["energy_joules"] < runs["latency"]["energy_joules"]


def test_an_unknown_objective_exits_2(tmp_path):
    model = tmp_path / "gemm.onnx"
    _gemm(model)
    r = _cli("dlegion_cc.cli", "dlegion-cc", model, "-o", tmp_path / "p.s", "--objective", "speed")
    assert r.returncode == 2 and "'speed' is not one of" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "p.s").exists()
