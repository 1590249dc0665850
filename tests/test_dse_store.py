"""dlegion-dse --db: every row stored as it is measured, a killed sweep resumed, exports, bad files."""
import contextlib
import json
import os
import signal
import subprocess
from dataclasses import replace
import sys
from pathlib import Path

import duckdb
import pytest

from isa import arch
from dlegion_cc.dse import sweep_configs
from dlegion_cc.dse_measure import evaluate
from dlegion_cc.dse_store import Store, options_key

MODEL = Path(__file__).parent.parent / "models" / "bitnet_tiny_relu2.onnx"
SWEEP = ("--legions", "1,2,4", "--cores", "1", "--array", "4", "--jobs", "1")

# dlegion-dse whose process kills itself (SIGKILL: no cleanup, no atexit) right after the store
# has committed its second row.
KILLED_AFTER_TWO = """
import os, signal, sys
from dlegion_cc import dse_store
put = dse_store.Store.put
committed = []
def put_then_die(self, arch, row, search):
    put(self, arch, row, search)
    committed.append(row["name"])
    if len(committed) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
dse_store.Store.put = put_then_die
from dlegion_cc.dse import main
sys.argv[0] = "dlegion-dse"
main()
"""


def dlegion_dse(*args, code="import sys; from dlegion_cc.dse import main; sys.argv[0] = 'dlegion-dse'; main()"):
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)


def killed_after_two(tmp_path: Path, *args) -> int:
    """The exit status of a sweep killed after two commits. Its orphaned pool worker (a process
    killed so leaves its workers behind) is ended with the process group it was started in."""
    with open(tmp_path / "killed.err", "w") as err:
        p = subprocess.Popen([sys.executable, "-c", KILLED_AFTER_TWO, *map(str, args)], stdout=subprocess.DEVNULL,
                             stderr=err, start_new_session=True)
        try:
            status = p.wait(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    return status


def stored(db: Path) -> dict[str, tuple]:
    with duckdb.connect(str(db), read_only=True) as con:
        return {r[0]: r[1:] for r in con.execute("SELECT name, cycles, measured_at, search FROM results").fetchall()}


def test_a_killed_sweep_is_resumed_and_measures_only_what_is_missing(tmp_path):
    db = tmp_path / "sweeps.duckdb"
    assert killed_after_two(tmp_path, MODEL, *SWEEP, "--db", db, "--out", tmp_path / "a") == -signal.SIGKILL
    before = stored(db)
    assert sorted(before) == ["L1-c1-a4", "L2-c1-a4"]       # both commits survived the kill
    r = dlegion_dse(MODEL, *SWEEP, "--db", db, "--out", tmp_path / "b")
    assert r.returncode == 0, r.stderr
    assert f"2 of 3 configuration(s) already measured in {db}" in r.stderr
    assert "done L4-c1-a4" in r.stderr and "1/1" in r.stderr and "done L1" not in r.stderr
    after = stored(db)
    assert sorted(after) == ["L1-c1-a4", "L2-c1-a4", "L4-c1-a4"]
    assert all(after[name] == before[name] for name in before)      # not measured again
    rows = {row["name"]: row for row in json.loads((tmp_path / "b" / "dse.json").read_text())["rows"]}
    for config in sweep_configs(arch.load("dlegion-8x8"), [1, 4], [1], [4]):
        fresh = evaluate(MODEL, config, {}, {"objective": "latency"})
        assert rows[config.name]["cycles"] == fresh["cycles"] == after[config.name][0]
        assert rows[config.name]["energy_uj"] == pytest.approx(fresh["energy_uj"])


def test_rows_are_keyed_by_model_version_options_and_machine(tmp_path):
    (config,) = sweep_configs(arch.load("dlegion-8x8"), [2], [1], [4])
    row = evaluate(MODEL, config, {})
    key = ("modelhash", "v1", options_key({}, {"objective": "latency"}))
    store = Store(tmp_path / "s.duckdb", str(MODEL), *key)
    store.put(config.arch, row, "grid")
    again = store.measured(config.arch)
    assert {k: again[k] for k in ("cycles", "energy_uj", "area_mm2", "status", "bound")} == \
           {k: row[k] for k in ("cycles", "energy_uj", "area_mm2", "status", "bound")}
    renamed = replace(config.arch, name="other", description="another name")
    assert store.measured(renamed)["name"] == "other"           # a machine is its parameters, not its name
    store.close()
    for other in [("modelhash2", *key[1:]), (key[0], "v2", key[2]),
                  (*key[:2], options_key({}, {"objective": "energy"}))]:
        s = Store(tmp_path / "s.duckdb", str(MODEL), *other)
        assert s.measured(config.arch) is None, other
        s.close()
    s = Store(tmp_path / "s.duckdb", str(MODEL), *key)
    (bigger,) = sweep_configs(arch.load("dlegion-8x8"), [4], [1], [4])
    assert s.measured(bigger.arch) is None
    s.close()


def test_a_dead_worker_is_not_stored(tmp_path):
    (config,) = sweep_configs(arch.load("dlegion-8x8"), [2], [1], [4])
    store = Store(tmp_path / "s.duckdb", str(MODEL), "h", "v", "o")
    from dlegion_cc.dse_measure import failed_row
    store.put(config.arch, failed_row(config, "worker failed: BrokenProcessPool: killed"), "grid")
    assert store.measured(config.arch) is None                  # measured again next time
    store.put(config.arch, failed_row(config, "L2-c1-a4: scratchpad too small"), "grid")
    assert store.measured(config.arch)["reason"] == "L2-c1-a4: scratchpad too small"
    store.close()


def test_export_and_the_readme_query(tmp_path):
    """A sweep exported to Parquet, then the store to CSV; the query the README shows runs on it."""
    db, parquet = tmp_path / "sweeps.duckdb", tmp_path / "rows.parquet"
    r = dlegion_dse(MODEL, "--legions", "1,2", "--cores", "1", "--array", "4", "--jobs", "2", "--db", db,
                    "--export", parquet, "--out", tmp_path / "o")
    assert r.returncode == 0, r.stderr
    store = Store(db, str(MODEL), "h", "v", "o")
    store.export(tmp_path / "rows.csv")
    store.close()
    for reader, path in (("read_parquet", parquet), ("read_csv_auto", tmp_path / "rows.csv")):
        with duckdb.connect() as con:
            rows = con.execute(f"SELECT name, cycles, area_mm2, energy_uj, version FROM {reader}('{path}') "
                               "ORDER BY name").fetchall()
        assert [r[0] for r in rows] == ["L1-c1-a4", "L2-c1-a4"] and all(r[1] > 0 and r[2] > 0 and r[3] > 0 for r in rows)
        assert "+format" in rows[0][4]
    assert not list(tmp_path.glob(".*tmp"))
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    query = readme.split("```sql\n", 1)[1].split("```", 1)[0]
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute(query).fetchall()
    assert len(rows) == 2 and rows[0][0] == "L1-c1-a4"


@pytest.mark.parametrize("case, message", [
    ("text", "not a DuckDB database that can be opened"),
    ("folder", ": is a directory"),
])
def test_a_db_that_is_not_duckdb_exits_2(tmp_path, case, message):
    db = tmp_path / "s.duckdb"
    if case == "text":
        db.write_text("name,cycles\n" * 100)
    r = dlegion_dse(MODEL, *SWEEP, "--db", tmp_path if case == "folder" else db, "--out", tmp_path / "o")
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("dlegion-dse: error: ") and message in line and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()
    if case == "text":
        assert db.read_text() == "name,cycles\n" * 100


def test_export_needs_a_db(tmp_path):
    r = dlegion_dse(MODEL, *SWEEP, "--export", tmp_path / "x.csv", "--out", tmp_path / "o")
    assert r.returncode == 2 and "--export" in r.stderr and "give one" in r.stderr
