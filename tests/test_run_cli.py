"""The dlegion-run command contract: options, outputs, exit statuses."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
from onnx import TensorProto, helper

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"


def dlegion_run(*args):
    code = "import sys; from runtime.cli import main; sys.argv[0] = 'dlegion-run'; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)


def _softmax_model(path):
    node = helper.make_node("Softmax", ["x"], ["y"], axis=1)
    g = helper.make_graph([node], "softmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 32])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_outputs_json_and_trace(tmp_path):
    out, js, trace = tmp_path / "out.npz", tmp_path / "r.json", tmp_path / "t.json"
    r = dlegion_run(EXAMPLES / "softmax.s", "--out", out, "--json", js, "--trace", trace, "--report")
    assert r.returncode == 0, r.stderr
    assert "cycles" in r.stdout and "roofline:" in r.stdout and "average power" in r.stdout
    numbers = json.loads(js.read_text())
    for key in ("cycles", "dram_read_bytes", "dram_write_bytes", "macs", "arch", "roofline_cycles",
                "compulsory_dram_bytes", "psum_bytes", "energy_joules", "average_watts", "matmuls"):
        assert key in numbers
    # softmax reads x f32[8,32] and writes y f32[8,32]; it has no matmul
    assert numbers["compulsory_dram_bytes"] == 2 * 8 * 32 * 4 and numbers["matmuls"] == []
    assert numbers["dram_read_bytes"] == numbers["dram_write_bytes"] == 8 * 32 * 4
    with np.load(out) as npz:
        assert npz["y"].shape == (8, 32)
        np.testing.assert_allclose(npz["y"].sum(axis=1), 1.0, rtol=1e-5)
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in spans} >= {"dma.ld", "vexp", "dma.st"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)


def test_a_run_without_report_says_its_cycles_in_a_line():
    plain, report = dlegion_run(EXAMPLES / "softmax.s"), dlegion_run(EXAMPLES / "softmax.s", "--report")
    assert plain.returncode == report.returncode == 0, plain.stderr + report.stderr
    [line] = plain.stdout.splitlines()
    headline = report.stdout.splitlines()[0]        # the report's first line: the machine and its cycles
    assert " cycles = " in headline and line == f"{EXAMPLES / 'softmax.s'}: {headline} (--report: utilization and traffic)"


def test_inputs_and_check_against_onnxruntime(tmp_path):
    model = tmp_path / "softmax.onnx"
    _softmax_model(model)
    inputs = tmp_path / "in.npz"
    np.savez(inputs, x=np.random.default_rng(1).standard_normal((8, 32)).astype(np.float32))
    r = dlegion_run(EXAMPLES / "softmax.s", "--inputs", inputs, "--check", model)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok" in r.stdout


def test_check_mismatch_exits_1(tmp_path):
    model = tmp_path / "neg.onnx"
    node = helper.make_node("Neg", ["x"], ["y"])
    g = helper.make_graph([node], "neg", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 32])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), model)
    r = dlegion_run(EXAMPLES / "softmax.s", "--check", model)
    assert r.returncode == 1
    assert "MISMATCH" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["missing.s"], "missing.s"),
    (["{ex}/softmax.s", "--arch", "no-such-arch"], "unknown architecture"),
    (["{ex}/softmax.s", "--inputs", "nowhere.npz"], "nowhere.npz"),
    (["{ex}/softmax.s", "--bogus"], "--bogus"),
])
def test_bad_input_exits_2_without_traceback(args, message):
    r = dlegion_run(*[a.format(ex=EXAMPLES) for a in args])
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_fault_names_the_instruction(tmp_path):
    prog = tmp_path / "bad.s"
    prog.write_text((EXAMPLES / "softmax.s").read_text().replace(
        "vrmax L0 vec[256,1,0] vec[0,32,1]", "vrmax L0 vec[256,1,0] vec[4000,32,1]"))
    r = dlegion_run(prog)
    assert r.returncode == 2
    assert "bad.s:8: vrmax: read of never-written" in r.stderr
    assert "Traceback" not in r.stderr


def test_deadlock_is_reported(tmp_path):
    # vrmax now waits for the store, the second DMA, which itself waits for the vector queue
    prog = tmp_path / "dead.s"
    prog.write_text((EXAMPLES / "softmax.s").read_text().replace("wait=L0.dma>=1", "wait=L0.dma>=2"))
    r = dlegion_run(prog)
    assert r.returncode == 2
    assert ("dead.s:8: vrmax on L0 vec waits for L0.dma>=2, never satisfied (L0.dma completed 1); "
            "1 other instruction(s) blocked too") in r.stderr
    assert "Traceback" not in r.stderr


def test_unsatisfiable_condition_is_rejected_before_running(tmp_path):
    prog = tmp_path / "never.s"
    prog.write_text((EXAMPLES / "softmax.s").read_text().replace("wait=L0.vec>=5", "wait=L0.vec>=6"))
    r = dlegion_run(prog)
    assert r.returncode == 2
    assert ("never.s:13: dma.st: condition L0.vec>=6 can never be satisfied: L0.vec runs 5 "
            "instructions") in r.stderr
    assert "Traceback" not in r.stderr


def _int8_matmul(path, zero_point: bool):
    """uint8 activations x full-range int8 weights, with or without B's zero point: products
    whose int16 pair sums overflow in saturating kernels."""
    rng = np.random.default_rng(2)
    w = rng.integers(-128, 128, (64, 16)).astype(np.int8)
    w[:2] = -128                                     # pairs of 255 * -128 overflow int16
    inputs = ["a", "w", "az", "wz"] if zero_point else ["a", "w"]
    inits = [onnx.numpy_helper.from_array(w, "w")]
    if zero_point:
        inits += [onnx.numpy_helper.from_array(np.uint8(3), "az"), onnx.numpy_helper.from_array(np.int8(-2), "wz")]
    g = helper.make_graph([helper.make_node("MatMulInteger", inputs, ["y"])], "mmi",
                          [helper.make_tensor_value_info("a", TensorProto.UINT8, [4, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.INT32, [4, 16])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return w.astype(np.int64) - (-2 if zero_point else 0), 3 if zero_point else 0


@pytest.mark.parametrize("zero_point", [True, False])
def test_exact_reference_computes_the_definition(tmp_path, zero_point):
    """--reference exact: onnxruntime with the int8 weights shifted to uint8 (and their zero point
    with them, 0 when absent) gives the integer product the operator defines."""
    from runtime.check import onnx_reference
    w, az = _int8_matmul(tmp_path / "mmi.onnx", zero_point)
    a = np.full((4, 64), 255, np.uint8)
    a[1:] = np.random.default_rng(3).integers(0, 256, (3, 64))
    y = onnx_reference(tmp_path / "mmi.onnx", {"a": a}, "exact")["y"]
    np.testing.assert_array_equal(y, (a.astype(np.int64) - az) @ w)


def test_check_with_the_exact_reference(tmp_path):
    model = ROOT / "models" / "llama_tiny_qdq.onnx"
    prog = tmp_path / "qdq.s"
    r = subprocess.run([sys.executable, "-c", "import sys; from dlegion_cc.cli import main; sys.argv[0] = "
                        "'dlegion-cc'; main()", str(model), "-o", str(prog), "--arch", "dlegion-tiny"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    r = dlegion_run(prog, "--check", model, "--reference", "exact")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok" in r.stdout


def test_a_race_is_bad_input_unless_the_check_is_off(tmp_path):
    """A store that does not wait for the load it stores: exit 2 naming both lines."""
    prog = tmp_path / "racy.s"
    prog.write_text(".arch dlegion-tiny\n.tensor x f32[4,8] input \"x\"\n.tensor y f32[4,8] output \"y\"\n"
                    "dma.ld L0 {0} vec[0,8,1] @x[0,8] rows=4 cols=8\n"
                    "dma.st L0 @y[0,8] vec[0,8,1] rows=4 cols=8\n")
    r = dlegion_run(prog)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{prog}:5: dma.st: race on L0 vec[0]: line 4 (dma.ld) wrote it" in r.stderr
    assert dlegion_run(prog, "--no-race-check").returncode == 0
