"""dlegion-dse on Ray: a tiny sweep on a local Ray instance gives the process pool's rows; an
address no cluster answers at is a one-line error."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from isa import arch
from dlegion_cc.dse import sweep_configs
from dlegion_cc.dse_measure import evaluate

MODEL = Path(__file__).parent.parent / "models" / "bitnet_tiny_relu2.onnx"


def dlegion_dse(*args):
    code = "import sys; from dlegion_cc.dse import main; sys.argv[0] = 'dlegion-dse'; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def ray_sweep(tmp_path_factory):
    """One local Ray instance (starting it takes seconds) for a sweep of three machines."""
    out = tmp_path_factory.mktemp("ray") / "out"
    r = dlegion_dse(MODEL, "--executor", "ray", "--jobs", "2", "--legions", "1,2", "--cores", "1,2", "--array", "4",
                    "--out", out)
    return r, out


def test_a_sweep_on_a_local_ray_instance(ray_sweep):
    r, out = ray_sweep
    assert r.returncode == 0, r.stderr
    assert "running on a local Ray instance (2 CPUs)" in r.stderr
    rows = {row["name"]: row for row in json.loads((out / "dse.json").read_text())["rows"]}
    assert sorted(rows) == ["L1-c1-a4", "L1-c2-a4", "L2-c1-a4", "L2-c2-a4"]
    for config in sweep_configs(arch.load("dlegion-8x8"), [1, 2], [1, 2], [4]):
        here = evaluate(MODEL, config, {}, {"objective": "latency"})
        assert rows[config.name]["status"] == "ok"
        assert rows[config.name]["cycles"] == here["cycles"] and rows[config.name]["dram_bytes"] == here["dram_bytes"]


@pytest.mark.parametrize("address, message", [
    ("127.0.0.1:1", "no Ray cluster answers at 127.0.0.1:1"),
    ("nocolon", "is not HOST:PORT"),
])
def test_an_address_no_cluster_answers_at_exits_2(tmp_path, address, message):
    r = dlegion_dse(MODEL, "--legions", "1", "--cores", "1", "--array", "4", "--address", address,
                    "--out", tmp_path / "o")
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("dlegion-dse: error: ") and message in line and "--address" in line
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


def test_the_model_is_shipped_with_its_data_files(tmp_path):
    """A node that does not see this file system gets the model (and its data) from the object
    store, written beside each other under a folder named by their bytes."""
    import onnx
    from dlegion_cc.dse_exec import Job, _files, _materialized
    model = onnx.load(MODEL)
    path = tmp_path / "m.onnx"
    (tmp_path / "w").mkdir()
    onnx.save(model, path, save_as_external_data=True, location="w/m.data", size_threshold=0)
    files = _files(Job(str(path), (str(tmp_path / "w" / "m.data"),), {}, {}))
    assert sorted(files) == ["m.onnx", "w/m.data"]
    copy = Path(_materialized(files, "m.onnx"))
    assert copy != path and copy.read_bytes() == path.read_bytes()
    assert (copy.parent / "w" / "m.data").read_bytes() == (tmp_path / "w" / "m.data").read_bytes()
    assert _materialized(files, "m.onnx") == str(copy)          # written once
    outside = Job(str(path), (str(tmp_path.parent / "elsewhere.data"),), {}, {})
    assert _files(outside) is None                              # then the nodes read the model's own path
