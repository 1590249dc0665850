"""The sweeps' result store: one DuckDB file, a row per (model, program version, options, machine).

A row is committed as soon as its configuration is measured, so a sweep that is killed loses only
the configurations still running, and the next sweep with the same store runs only what is
missing. The machine is keyed by its parameters (not its name): a machine measured once, by a
grid sweep or a search, is never measured again for the same model, version and options.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

import click

from isa.arch import Arch
from dlegion_cc.dse_measure import COLUMNS

# SQL types of the measured columns; ``pareto`` is relative to one sweep, so it is not stored.
_TEXT = {"name", "status", "reason", "warning", "dataflow", "peak_mode", "bound"}
_INT = {"legions", "cores", "array", "cycles", "macs", "dram_read_bytes", "dram_write_bytes", "dram_bytes",
        "psum_bytes", "instructions", "compute_cycles", "dram_cycles", "vector_cycles"}
MEASURED = tuple(c for c in COLUMNS if not c.startswith("pareto"))
KEY = ("model_hash", "version", "options", "machine_hash")
# Rows that say nothing about the machine (a worker that died) are measured again next time.
TRANSIENT = "worker failed"


def _sql_type(column: str) -> str:
    return "VARCHAR" if column in _TEXT else "BIGINT" if column in _INT else "DOUBLE"


def _names(columns) -> str:
    return ", ".join(f'"{c}"' for c in columns)     # quoted: "array" is an SQL keyword


STORED = (*KEY, "model", "machine", "search", *MEASURED, "narrow_matmuls")
SCHEMA = ("CREATE TABLE IF NOT EXISTS results (model_hash VARCHAR, version VARCHAR, options VARCHAR, "
          "machine_hash VARCHAR, model VARCHAR, machine JSON, search VARCHAR, "
          + ", ".join(f'"{c}" {_sql_type(c)}' for c in MEASURED)
          + ", narrow_matmuls JSON, measured_at TIMESTAMP DEFAULT current_timestamp, "
          f"PRIMARY KEY ({_names(KEY)}))")


# --- what a row is keyed by --------------------------------------------------------------------

def model_hash(model: str | Path, data_files) -> str:
    """SHA-256 of the model's bytes and of each external data file (by its path relative to the
    model's folder, as the model names it)."""
    h = hashlib.sha256()
    folder = Path(model).parent
    for path in [Path(model), *sorted(map(Path, data_files))]:
        h.update(str(path.relative_to(folder) if path != Path(model) else "").encode() + b"\0")
        with open(path, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def program_version() -> str:
    """The installed version, the binary program format's version and a hash of the source that
    compiles and times a program (isa, dlegion_cc, runtime; the sweep's own files aside), so an
    edit to the compiler or the timing model measures every machine again."""
    from isa import encoding
    import dlegion_cc
    import isa
    import runtime
    h = hashlib.sha256()
    for pkg in (isa, dlegion_cc, runtime):
        root = Path(pkg.__file__).parent
        for path in sorted(root.rglob("*.py")):
            if path.name.startswith("dse") and path.name != "dse_measure.py":
                continue
            h.update(str(path.relative_to(root.parent)).encode() + b"\0" + path.read_bytes())
    return f"{metadata.version('dlegion')}+format{encoding.VERSION}+src{h.hexdigest()[:12]}"


def options_key(dims: dict, switches: dict) -> str:
    return json.dumps({"dims": dims, **switches}, sort_keys=True)


def machine_of(arch: Arch) -> dict:
    """The machine's parameters, name and description aside (they do not change a result)."""
    doc = asdict(arch)
    for k in ("name", "description", "published_peak_tops"):
        doc.pop(k)
    return doc


def machine_hash(arch: Arch) -> str:
    return hashlib.sha256(json.dumps(machine_of(arch), sort_keys=True).encode()).hexdigest()


# --- the store -----------------------------------------------------------------------------------

class Store:
    """Rows of one model, version and options in a DuckDB file (created if missing)."""

    def __init__(self, path: str | Path, model: str, model_hash: str, version: str, options: str):
        import duckdb
        try:
            self.con = duckdb.connect(str(path))
        except duckdb.Error as e:
            raise click.ClickException(f"{path}: not a DuckDB database that can be opened "
                                       f"({str(e).splitlines()[0]})") from None
        self.con.execute(SCHEMA)
        columns = [c[0] for c in self.con.execute("SELECT * FROM results LIMIT 0").description]
        if columns != [*STORED, "measured_at"]:
            self.con.close()
            raise click.ClickException(f"{path}: its results table has other columns than dlegion-dse's "
                                       f"(made by another version?)")
        self.path = path
        self.model = str(model)
        self.key = (model_hash, version, options)

    def close(self) -> None:
        self.con.close()

    def measured(self, arch: Arch) -> dict | None:
        """The stored row of ``arch`` for this model, version and options, or None."""
        cur = self.con.execute(f"SELECT {_names(MEASURED)}, narrow_matmuls FROM results WHERE "
                               + " AND ".join(f"{k} = ?" for k in KEY), [*self.key, machine_hash(arch)])
        found = cur.fetchone()
        if found is None:
            return None
        row = dict(zip((*MEASURED, "narrow_matmuls"), found))
        row["narrow_matmuls"] = json.loads(row["narrow_matmuls"]) if row["narrow_matmuls"] else []
        row.update(name=arch.name, pareto=False, pareto_energy=False)
        return row

    def put(self, arch: Arch, row: dict, search: str) -> None:
        """Commit ``row`` (its own transaction): a later kill does not lose it."""
        if row["status"] != "ok" and row["reason"].startswith(TRANSIENT):
            return
        values = [*self.key, machine_hash(arch), self.model, json.dumps(machine_of(arch)), search,
                  *(row[c] for c in MEASURED), json.dumps(row.get("narrow_matmuls") or [])]
        self.con.execute(f"INSERT OR REPLACE INTO results ({_names(STORED)}) VALUES "
                         f"({', '.join('?' * len(STORED))})", values)

    def export(self, target: str | Path) -> None:
        """Every row of the store (all models) to CSV or Parquet, by the file's suffix."""
        import os
        target = Path(target)
        fmt = "PARQUET" if target.suffix.lower() == ".parquet" else "CSV, HEADER"
        temp = target.with_name(f".{target.name}.tmp")      # then renamed: whole, or not at all
        quoted = str(temp).replace("'", "''")
        try:
            self.con.execute(f"COPY (SELECT * FROM results ORDER BY model, search, time_us NULLS LAST, name) "
                             f"TO '{quoted}' (FORMAT {fmt})")
            os.replace(temp, target)
        finally:
            temp.unlink(missing_ok=True)
