"""dlegion-dse --search optuna (seeded, stored, within the base machine's ranges) and the plots:
Pareto fronts computed right, files written and not trivial."""
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from isa import arch
from dlegion_cc.dse import mark_pareto, pareto_front
from dlegion_cc.dse_plots import heatmap_png, latency_grid, pareto_png
from dlegion_cc.dse_search import config_for, name_of, space

MODEL = Path(__file__).parent.parent / "models" / "bitnet_tiny_relu2.onnx"
SEARCH = ("--search", "optuna", "--trials", "6", "--seed", "3", "--jobs", "2")


def dlegion_dse(*args):
    code = "import sys; from dlegion_cc.dse import main; sys.argv[0] = 'dlegion-dse'; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)


def png_size(png: bytes) -> tuple[int, int]:
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    return struct.unpack(">II", png[16:24])


def test_pareto_front_of_hand_made_points():
    points = [(1, 9), (2, 5), (3, 5), (2, 7), (5, 1), (6, 1), (4, 4), (5, 5), (1, 9)]
    # (3, 5) and (2, 7) lose to (2, 5); (6, 1) to (5, 1); (5, 5) to (4, 4); a repeated point stays
    assert pareto_front(points) == [True, True, False, False, True, False, True, False, True]
    assert pareto_front([(1.0, 2.0, 3.0), (1.0, 2.0, 2.0), (0.5, 9.0, 9.0)]) == [False, True, True]
    assert pareto_front([]) == []


def test_the_space_lies_within_the_base_machine():
    base = arch.load("dlegion-8x8")
    ranges = space(base)
    assert ranges["legions"] == (0, 4) and ranges["cores"] == (0, 4) and ranges["array"] == (2, 5)
    assert ranges["act_kib"] == (6, 9) and ranges["acc_kib"] == (5, 8)
    p = {"legions": 4, "cores": 8, "array": 16, "act_kib": 256, "wgt_kib": 256, "acc_kib": 32, "vec_kib": 128}
    assert name_of(base, p) == "L4-c8-a16-acc32"
    config = config_for(base, p)
    assert config.arch.acc_kib == 32 and config.arch.dram_gbps == base.dram_gbps


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("optuna")
    db = tmp / "s.duckdb"
    first = dlegion_dse(MODEL, *SEARCH, "--db", db, "--out", tmp / "a")
    again = dlegion_dse(MODEL, *SEARCH, "--db", db, "--out", tmp / "b")
    return first, again, tmp


def _rows(out: Path) -> dict[str, dict]:
    doc = json.loads((out / "dse.json").read_text())
    assert (doc["search"], doc["trials"], doc["seed"], doc["sampler"]) == ("optuna", 6, 3, "tpe")
    return {row["name"]: row for row in doc["rows"]}


def test_a_seeded_search_asks_the_same_machines_and_stores_them(searched):
    first, again, tmp = searched
    assert first.returncode == 0, first.stderr
    assert again.returncode == 0, again.stderr
    rows = _rows(tmp / "a")
    assert 2 <= len(rows) <= 6 and any(r["status"] == "ok" for r in rows.values())
    ranges = space(arch.load("dlegion-8x8"))
    for row in rows.values():
        assert 2 ** ranges["legions"][0] <= row["legions"] <= 2 ** ranges["legions"][1]
        assert 2 ** ranges["array"][0] <= row["array"] <= 2 ** ranges["array"][1]
    # the same seed asks the same machines again: every one is read back from the store
    assert f"0 of {len(rows)} configuration(s) already measured" in first.stderr
    assert f"{len(rows)} of {len(rows)} configuration(s) already measured" in again.stderr
    assert "compiling and timing" not in again.stderr
    assert {n: r["cycles"] for n, r in _rows(tmp / "b").items()} == {n: r["cycles"] for n, r in rows.items()}
    for name in ("pareto.png", "heatmap.png"):
        body = (tmp / "a" / name).read_bytes()
        width, height = png_size(body)
        assert len(body) > 20_000 and width > 400 and height > 300, name


def test_search_options_are_refused_with_a_grid(tmp_path):
    r = dlegion_dse(MODEL, "--trials", "5", "--out", tmp_path / "o")
    assert r.returncode == 2 and "--trials" in r.stderr and "not used by --search grid" in r.stderr
    r = dlegion_dse(MODEL, *SEARCH, "--legions", "2", "--out", tmp_path / "o")
    assert r.returncode == 2 and "--legions" in r.stderr and "not used by --search optuna" in r.stderr


def _row(name, legions, cores, time_us, area, energy):
    return {"name": name, "status": "ok", "legions": legions, "cores": cores, "time_us": time_us,
            "area_mm2": area, "energy_uj": energy}


def test_fronts_and_heatmap_cells_of_hand_made_rows():
    rows = mark_pareto([_row("L1-c1", 1, 1, 9.0, 1.0, 5.0), _row("L2-c1", 2, 1, 5.0, 2.0, 4.0),
                        _row("L2-c2", 2, 2, 4.0, 4.0, 6.0), _row("L4-c2", 4, 2, 4.5, 8.0, 7.0)])
    assert [r["pareto"] for r in rows] == [True, True, True, False]
    assert [r["pareto_energy"] for r in rows] == [False, True, True, False]
    width, height = png_size(pareto_png(rows, "t"))
    assert width > 1.8 * height                                 # two panels side by side
    legions, cores, grid = latency_grid(rows + [_row("L2-c1-a8", 2, 1, 4.2, 3.0, 5.0)])
    assert (legions, cores) == ([1, 2, 4], [1, 2])
    # each cell the fastest of its machines; the pair no machine has is blank
    assert grid[0].tolist() == [9.0, None] and grid[1].tolist() == [4.2, 4.0] and grid[2].tolist() == [None, 4.5]
    assert png_size(heatmap_png(rows, "t"))[0] > 400
