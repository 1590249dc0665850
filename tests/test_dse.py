"""The dlegion-dse sweep: rows per configuration, outputs, failures as rows, exit statuses."""
import csv
import json
import subprocess
import sys
from dataclasses import replace
from importlib import resources
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from isa import arch
from dlegion_cc.dse import OUTPUTS, sort_rows, sweep_configs, unique, write_outputs
from dlegion_cc.dse_measure import COLUMNS, config_of, evaluate, failed_row, roof, verify_warning
from dlegion_cc.pipeline import Options, compile_model
from runtime.emulator import RunResult
from runtime.report import summarize
from runtime.timing import simulate

MODEL = Path(__file__).parent.parent / "models" / "bitnet_tiny_relu2.onnx"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def dlegion_dse(*args):
    code = "import sys; from dlegion_cc.dse import main; sys.argv[0] = 'dlegion-dse'; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)


def _tiny_vector_spad(tmp_path) -> Path:
    """dlegion-tiny with a 1 KiB vector scratchpad: too small for a row of the model's norms."""
    text = resources.files("isa.presets").joinpath("dlegion-tiny.toml").read_text()
    text = text.replace('name = "dlegion-tiny"', 'name = "tiny-vec1k"').replace("vec_kib = 64", "vec_kib = 1")
    path = tmp_path / "tiny-vec1k.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dse")
    out = tmp / "out"
    r = dlegion_dse(MODEL, "--legions", "1,2", "--cores", "1", "--array", "4",
                    "--preset", _tiny_vector_spad(tmp), "--jobs", "2", "--out", out, "--objective", "energy")
    return r, out


def test_sweep_writes_one_row_per_configuration(sweep):
    r, out = sweep
    assert r.returncode == 0, r.stderr
    doc = json.loads((out / "dse.json").read_text())
    rows = {row["name"]: row for row in doc["rows"]}
    assert sorted(rows) == ["L1-c1-a4", "L2-c1-a4", "tiny-vec1k"] and doc["objective"] == "energy"
    for name in ("L1-c1-a4", "L2-c1-a4"):
        row = rows[name]
        assert row["status"] == "ok" and row["reason"] == "" and row["warning"] == ""
        assert isinstance(row["cycles"], int) and row["cycles"] > 0
        assert row["dram_bytes"] == row["dram_read_bytes"] + row["dram_write_bytes"] > 0
        assert row["intensity"] == pytest.approx(2 * row["macs"] / row["dram_bytes"])
        assert 0 < row["achieved_tops"] <= row["roof_tops"] <= row["peak_tops"]
        assert row["bound"] in ("compute", "DRAM", "vector")
        assert row["area_mm2"] == pytest.approx(sweep_configs(arch.load("dlegion-8x8"), [row["legions"]], [1], [4])[0]
                                                .arch.derived.total_mm2)
        assert row["tops_per_mm2"] == pytest.approx(row["achieved_tops"] / row["area_mm2"])
    # one Legion is both slower and smaller than two: both on the latency-area front
    assert rows["L1-c1-a4"]["pareto"] and rows["L2-c1-a4"]["pareto"]
    assert (rows["L1-c1-a4"]["legions"], rows["L2-c1-a4"]["legions"]) == (1, 2)
    assert "configurations by latency" in r.stdout and "L1-c1-a4" in r.stdout and "L2-c1-a4" in r.stdout


def test_failing_configuration_is_a_row_with_its_reason(sweep):
    r, out = sweep
    failed = [row for row in json.loads((out / "dse.json").read_text())["rows"] if row["status"] != "ok"]
    assert [row["name"] for row in failed] == ["tiny-vec1k"]
    assert "vector scratchpad" in failed[0]["reason"] and failed[0]["cycles"] is None
    assert "failed tiny-vec1k" in r.stdout


def test_rows_are_sorted_by_latency_in_json_and_csv(sweep):
    _, out = sweep
    rows = json.loads((out / "dse.json").read_text())["rows"]
    times = [row["time_us"] for row in rows if row["status"] == "ok"]
    assert times == sorted(times) and rows[-1]["status"] == "failed"
    with open(out / "dse.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [t["name"] for t in table] == [row["name"] for row in rows]
    assert list(table[0]) == list(COLUMNS)
    assert [int(t["cycles"]) for t in table[:2]] == [row["cycles"] for row in rows[:2]]


def test_plots_are_png(sweep):
    _, out = sweep
    for name in ("latency.png", "roofline.png", "pareto.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC), name


def test_row_matches_the_timing_model(sweep):
    _, out = sweep
    row = next(r for r in json.loads((out / "dse.json").read_text())["rows"] if r["name"] == "L2-c1-a4")
    (config,) = sweep_configs(arch.load("dlegion-8x8"), [2], [1], [4])
    _, program = compile_model(MODEL, Options(config.arch, objective="energy"))
    tl = simulate(program, config.arch)
    assert row["cycles"] == tl.cycles
    energy = summarize(RunResult({}, tl, config.arch, tl.program, None))["energy_joules"]
    assert row["energy_uj"] == pytest.approx(energy * 1e6)
    assert row["instructions"] == len(program.instrs)
    assert row["dram_read_bytes"] == tl.counters["dram_read_bytes"]
    # The sweep changes only Legions, cores and array; scratchpads stay the base's.
    assert config.arch.vec_kib == arch.load("dlegion-8x8").vec_kib


def test_invalid_parameters_become_a_failed_row():
    (config,) = sweep_configs(arch.load("dlegion-8x8"), [65], [1], [4])
    assert config.arch is None
    row = evaluate(MODEL, config, {})
    assert row["status"] == "failed" and "at most 64 Legions" in row["reason"]
    assert (row["legions"], row["cores"], row["array"]) == (65, 1, 4)


def test_a_program_that_does_not_verify_is_flagged():
    tiny = arch.load("dlegion-tiny")
    _, program = compile_model(MODEL, Options(tiny))
    assert verify_warning(program, tiny) == ""
    warning = verify_warning(program, replace(tiny, legions=1))     # the program uses Legion 1
    assert warning.startswith("does not verify: ") and "instruction" in warning


def test_roof_and_sorting():
    assert roof(10.0, 614.0, 1.0) == pytest.approx(0.614)
    assert roof(10.0, 614.0, 1000.0) == 10.0
    assert roof(10.0, 614.0, None) == 10.0
    rows = [{"name": "b", "status": "failed", "time_us": None},
            {"name": "c", "status": "ok", "time_us": 2.0, "area_mm2": 5.0, "energy_uj": 1.0},
            {"name": "a", "status": "ok", "time_us": 3.0, "area_mm2": 4.0, "energy_uj": 1.0},
            {"name": "d", "status": "ok", "time_us": 3.0, "area_mm2": 6.0, "energy_uj": 0.5}]
    assert [r["name"] for r in sort_rows(rows)] == ["c", "a", "d", "b"]
    # slower and larger than "a": off the latency-area front; "b" never ran
    assert {r["name"]: r.get("pareto") for r in rows} == {"a": True, "b": None, "c": True, "d": False}
    # against energy, "a" is slower than "c" for the same energy; "d" is the least energy
    assert {r["name"]: r.get("pareto_energy") for r in rows} == {"a": False, "b": None, "c": True, "d": True}


@pytest.mark.parametrize("args, message", [
    (["missing.onnx"], "no such file"),
    ([MODEL, "--legions", "2,x"], "comma-separated list of positive integers"),
    ([MODEL, "--array", "0"], "comma-separated list of positive integers"),
    ([MODEL, "--preset", "no-such-machine"], "unknown architecture 'no-such-machine'"),
    ([MODEL, "--dim", "seq"], "NAME=SIZE"),
    ([MODEL, "--jobs", "0"], "--jobs"),
    ([MODEL, "--dim", "foo=3"], "has no symbolic dim 'foo'"),
    ([MODEL, "--dim", "sequence=8", "--dim", "sequence=8"], "'sequence' bound twice"),
])
def test_bad_input_exits_2(tmp_path, args, message):
    out = tmp_path / "out"
    r = dlegion_dse(*args, "--out", out)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def _one_node_model(tmp_path, op: str, shape: list, out_shape: list) -> Path:
    """A model of a single float ``op`` node (names in a shape are symbolic dimensions)."""
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)])
    path = tmp_path / f"{op.lower()}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _error_line(r) -> str:
    """The one error line of a run that exited 2, with nothing else said about the failure."""
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("dlegion-dse: error: "), r.stderr
    assert "Traceback" not in r.stderr and "configurations by latency" not in r.stdout
    return errors[0]


TINY = ("--legions", "2", "--cores", "2", "--array", "8", "--jobs", "1")


def test_a_model_that_cannot_compile_fails_before_the_sweep(tmp_path):
    out = tmp_path / "out"
    r = dlegion_dse(_one_node_model(tmp_path, "Det", [4, 4], []), *TINY, "--out", out)
    line = _error_line(r)
    assert "det.onnx: node 'Det_0' (Det): operator not supported" in line
    assert "L2-c2-a8" not in r.stderr and not out.exists()     # no configuration was compiled


def test_an_unbound_dimension_names_the_option_dse_has(tmp_path):
    r = dlegion_dse(_one_node_model(tmp_path, "Relu", ["seq", 4], ["seq", 4]), *TINY, "--out", tmp_path / "out")
    line = _error_line(r)
    assert "unbound symbolic dimension 'seq'" in line and line.endswith("pass --dim seq=N")
    assert "--inputs" not in r.stderr


def test_when_every_configuration_fails_nothing_is_written(tmp_path):
    out = tmp_path / "new" / "out"
    model = _one_node_model(tmp_path, "Softmax", [1, 1 << 17], [1, 1 << 17])   # rows too long for any
    r = dlegion_dse(model, "--legions", "1", "--cores", "1", "--array", "4", "--preset", _tiny_vector_spad(tmp_path),
                    "--jobs", "1", "--out", out)
    line = _error_line(r)
    assert line.startswith(f"dlegion-dse: error: {model}: all 2 configuration(s) failed; the first, ")
    assert not (tmp_path / "new").exists()      # the folders made to check the outputs are gone too


@pytest.mark.parametrize("args, reason", [
    (["--legions", "2,65", "--array", "4"], "L65-c1-a4: at most 64 Legions (the multicast set is a 64-bit mask)"),
    (["--legions", "2", "--array", "4,7"], "L2-c1-a7: array 7: a row of 7 w4 weights is 28 bits, not whole bytes"),
])
def test_a_configuration_no_machine_can_have_is_refused_before_the_sweep(tmp_path, args, reason):
    out = tmp_path / "out"
    r = dlegion_dse(MODEL, "--cores", "1", "--jobs", "1", *args, "--out", out)
    line = _error_line(r)
    assert reason in line and "--array" in line and "configuration(s) failed" not in line
    assert "done L2-c1-a4" not in r.stderr and not out.exists()      # nothing was compiled


@pytest.mark.parametrize("case", ["model", "model's data"])
def test_the_outputs_never_overwrite_the_model(tmp_path, case):
    out = tmp_path / "out"
    out.mkdir()
    model = onnx.load(MODEL)
    if case == "model":
        path = out / "dse.csv"
        onnx.save(model, path)
    else:
        path = tmp_path / "m.onnx"
        onnx.save(model, path, save_as_external_data=True, location="out/latency.png", size_threshold=0)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    line = _error_line(dlegion_dse(path, *TINY, "--out", out))
    assert "would overwrite" in line and str(path) in line
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_an_unwritable_output_is_found_before_the_sweep_and_nothing_changes(tmp_path):
    out = tmp_path / "out"
    (out / "dse.csv").mkdir(parents=True)
    old = {name: f"old {name}".encode() for name in OUTPUTS if name != "dse.csv"}
    for name, body in old.items():
        (out / name).write_bytes(body)
    line = _error_line(dlegion_dse(MODEL, *TINY, "--out", out))
    assert line == f"dlegion-dse: error: {out / 'dse.csv'}: is a directory"
    assert {name: (out / name).read_bytes() for name in old} == old
    # Writing itself is all or nothing too, should the file become unwritable during the sweep.
    (config,) = sweep_configs(arch.load("dlegion-8x8"), [65], [1], [4])
    with pytest.raises(IsADirectoryError):
        write_outputs(out, [failed_row(config, config.error)], str(MODEL), {})
    assert {name: (out / name).read_bytes() for name in old} == old
    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUTS)     # no temporaries left


def test_a_machine_named_twice_is_one_configuration():
    base = arch.load("dlegion-8x8")
    tiny = config_of(arch.load("dlegion-tiny"))
    configs = unique(sweep_configs(base, [2, 2], [1], [4]) + [tiny, config_of(arch.load("dlegion-tiny"))])
    assert [c.name for c in configs] == ["L2-c1-a4", "dlegion-tiny"]
    other = config_of(replace(arch.load("dlegion-tiny"), vec_kib=1))     # same name, another machine
    with pytest.raises(Exception, match="two different machines are named 'dlegion-tiny'"):
        unique([tiny, other])


def test_presets_named_twice_give_one_row(tmp_path):
    out = tmp_path / "out"
    r = dlegion_dse(MODEL, *TINY, "--legions", "2,2", "--preset", "dlegion-tiny", "--preset", "dlegion-tiny",
                    "--out", out)
    assert r.returncode == 0, r.stderr
    names = [row["name"] for row in json.loads((out / "dse.json").read_text())["rows"]]
    assert sorted(names) == ["L2-c2-a8", "dlegion-tiny"]


def test_help_says_what_out_holds():
    r = dlegion_dse("--help")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "created if missing" in text
    assert all(name in text for name in OUTPUTS)
