"""``dlegion-dse --compare``: each baseline against its D-Legion on the three footings of
isa/normalize.py, every row naming its footing, the ratios those of the timing model's rows."""
import json

import pytest

from isa import arch
from isa.normalize import EQUAL_PEAK, EQUAL_PES, PUBLISHED, pe_count
from dlegion_cc.dse_compare import PAIRS, REFERENCE, add_ratios, machines
from test_dse import MODEL, dlegion_dse


def test_every_baseline_stands_on_each_footing_once():
    rows = machines()
    for ref_name, bases in PAIRS.items():
        ref = arch.load(ref_name)
        mine = [(m, footing) for m, r, footing in rows if r == ref_name]
        assert mine[0] == (ref, REFERENCE)
        footings = [label for _, f in mine[1:] for label in f.split(" = ")]
        assert sorted(footings) == sorted([PUBLISHED, EQUAL_PES, EQUAL_PEAK] * len(bases))
        for m, f in mine[1:]:
            if EQUAL_PES in f:
                assert pe_count(m) >= pe_count(ref)
            if EQUAL_PEAK in f:
                assert m.derived.peak_tops["w8"] == pytest.approx(ref.derived.peak_tops["w8"])


def test_ratios_are_over_the_reference_of_the_same_workload():
    rows = [{"name": "d", "ref": "d", "status": "ok", "time_us": 2.0, "dram_bytes": 10, "psum_bytes": 4,
             "area_mm2": 5.0, "w": 1},
            {"name": "b", "ref": "d", "status": "ok", "time_us": 6.0, "dram_bytes": 15, "psum_bytes": 4,
             "area_mm2": 1.0, "w": 1},
            {"name": "b", "ref": "d", "status": "ok", "time_us": 6.0, "dram_bytes": 15, "psum_bytes": 4,
             "area_mm2": 1.0, "w": 2},          # no reference on workload 2
            {"name": "c", "ref": "d", "status": "failed", "time_us": None, "w": 1}]
    add_ratios(rows, lambda r: r["w"])
    assert (rows[1]["latency_x"], rows[1]["dram_x"], rows[1]["psum_x"], rows[1]["per_mm2_x"]) == (3.0, 1.5, 1.0, 0.6)
    assert rows[0]["latency_x"] == 1.0
    assert rows[2]["latency_x"] is None and rows[3]["latency_x"] is None


def test_compare_prints_every_footing_and_writes_the_ratios(tmp_path):
    out = tmp_path / "out"
    r = dlegion_dse(MODEL, "--compare", "--jobs", "2", "--out", out)
    assert r.returncode == 0, r.stderr
    assert "each baseline against its D-Legion" in r.stdout
    for words in ("as published", "equal PEs = equal w8 peak", "ws-64 x4", "tpuv4i @1GHz", "reference"):
        assert words in r.stdout
    rows = {row["name"]: row for row in json.loads((out / "dse.json").read_text())["rows"]}
    assert len(rows) == len(machines())
    ws, ref = rows["ws-64 x4"], rows["dlegion-8x8"]
    assert ws["footing"] == "equal PEs = equal w8 peak" and ws["ref"] == "dlegion-8x8"
    assert ws["latency_x"] == pytest.approx(ws["time_us"] / ref["time_us"])
    assert rows["tpuv4i"]["dram_x"] == pytest.approx(rows["tpuv4i"]["dram_bytes"] / rows["dlegion-32x8"]["dram_bytes"])


@pytest.mark.parametrize("args, option", [(["--legions", "2"], "--legions"), (["--search", "optuna"], "--search")])
def test_compare_refuses_the_sweep_options(tmp_path, args, option):
    r = dlegion_dse(MODEL, "--compare", *args, "--out", tmp_path / "out")
    assert r.returncode == 2 and option in r.stderr and "not with --compare" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()
