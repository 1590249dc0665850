"""``dlegion-dse``: sweep machine configurations for one model and compare them.

Every configuration is compiled and timed with the timing model only; the configurations are the
cross product of Legions x cores per Legion x array size applied to the ``dlegion-8x8`` preset
(scratchpads and everything else unchanged), plus any presets named.
"""
from __future__ import annotations

import csv
import io
import json
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from itertools import product
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from isa import arch as arch_mod
from isa.console import check_not_inputs, no_empty_path, positive_int, printable, table_console, version_option
from dlegion_cc.dse_measure import COLUMNS, Config, config_of, evaluate, failed_row
from dlegion_cc.lower.qplan import OBJECTIVES

BASE = "dlegion-8x8"
TABLE_WIDTH = 170
OUTPUTS = ("dse.json", "dse.csv", "latency.png", "roofline.png", "pareto.png")


# --- configurations --------------------------------------------------------------------------

def sweep_configs(base: arch_mod.Arch, legions, cores, arrays) -> list[Config]:
    """The cross product on ``base``; invalid parameters become configurations that carry the error."""
    out = []
    for n_legions, n_cores, n in product(legions, cores, arrays):
        name = f"L{n_legions}-c{n_cores}-a{n}"
        try:
            machine = replace(base, name=name, legions=n_legions, cores=n_cores, array=n,
                              description=f"{base.name} with {n_legions} Legions x {n_cores} cores of "
                                          f"{n}x{n} arrays")
        except arch_mod.ArchError as e:
            out.append(Config(name, n_legions, n_cores, n, None, str(e)))
            continue
        out.append(config_of(machine))
    return out


def run_sweep(model: str, configs: list[Config], dims: dict, jobs: int, console: Console,
              switches: dict | None = None) -> list[dict]:
    """Evaluate every configuration in ``jobs`` worker processes, with a progress bar on ``console``
    (``switches``: Options fields for every compile, such as ``objective``)."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        # Submit (and so start the workers) before the progress bar starts its refresh thread.
        futures = {pool.submit(evaluate, model, c, dims, switches): c for c in configs}
        with Progress(*columns, console=console) as progress:
            rows = _collect(futures, progress, progress.add_task("compiling and timing", total=len(configs)))
    return sort_rows(rows)


def _collect(futures: dict, progress: Progress, task) -> list[dict]:
    rows = []
    for done in as_completed(futures):
        rows.append(_row_of(done, futures[done]))
        progress.update(task, advance=1, description=f"done {futures[done].name}")
    return rows


def _row_of(future, config: Config) -> dict:
    try:
        return future.result()
    except Exception as e:  # noqa: BLE001 - a worker that died (e.g. out of memory) is one failed row
        return failed_row(config, f"worker failed: {type(e).__name__}: {e}")


def sort_rows(rows: list[dict]) -> list[dict]:
    """By latency (time, since clocks differ), failed configurations last, ties by name; each
    row that ran marked whether it is on the latency-area Pareto front."""
    return mark_pareto(sorted(rows, key=lambda r: (r["status"] != "ok", r["time_us"] or 0.0, r["name"])))


def mark_pareto(rows: list[dict]) -> list[dict]:
    """Set ``pareto`` on the rows that ran and that no other row beats on latency and area at
    once (no other is at least as fast and as small, and better in one)."""
    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        r["pareto"] = not any(o["time_us"] <= r["time_us"] and o["area_mm2"] <= r["area_mm2"]
                              and (o["time_us"], o["area_mm2"]) != (r["time_us"], r["area_mm2"]) for o in ok)
    return rows


# --- outputs ---------------------------------------------------------------------------------

def print_table(rows: list[dict], console: Console) -> None:
    """The configurations that ran, by latency; then a line per configuration that failed or whose
    program does not verify (its numbers are shown, flagged)."""
    t = Table(title="configurations by latency (P: on the latency-area Pareto front)", title_justify="left")
    for col in ("configuration", "L x c x N", "cycles", "us", "TOPS", "of peak", "DRAM MiB", "ops/B", "uJ",
                "mm^2", "TOPS/mm^2", "instrs", "bound"):
        t.add_column(col, justify="left" if col in ("configuration", "bound") else "right", no_wrap=True)
    for r in rows:
        if r["status"] != "ok":
            continue
        intensity = f"{r['intensity']:.1f}" if r["intensity"] else "-"
        t.add_row(r["name"] + ("*" if r["warning"] else ""), f"{r['legions']}x{r['cores']}x{r['array']}", f"{r['cycles']:,}",
                  f"{r['time_us']:.2f}", f"{r['achieved_tops']:.3g}", f"{r['peak_fraction']:.2%}",
                  f"{r['dram_bytes'] / 2**20:.2f}", intensity, f"{r['energy_uj']:.3g}",
                  f"{r['area_mm2']:.1f}" + ("P" if r["pareto"] else ""), f"{r['tops_per_mm2']:.3g}",
                  f"{r['instructions']:,}", r["bound"])
    console.print(t)
    for r in rows:
        if r["status"] != "ok":
            named = r["reason"] if r["reason"].startswith(r["name"]) else f"{r['name']}: {r['reason']}"
            console.print(f"[red]failed[/red] {named}", highlight=False, soft_wrap=True)
        elif r["warning"]:
            console.print(f"[yellow]warning[/yellow] {r['name']}: {r['warning']}", highlight=False, soft_wrap=True)


def _stdout() -> Console:
    return table_console(TABLE_WIDTH)


def _csv_text(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def write_outputs(out: Path, rows: list[dict], model: str, dims: dict, objective: str = "latency") -> list[Path]:
    """All the files, or none (each written to a temporary first, then renamed)."""
    from isa.files import atomic_write_all
    from dlegion_cc.dse_plots import latency_png, pareto_png, roofline_png
    title = Path(model).name + "".join(f" {k}={v}" for k, v in sorted(dims.items()))
    doc = {"model": str(model), "dims": dims, "base": BASE, "objective": objective, "columns": list(COLUMNS),
           "rows": rows}
    bodies = (json.dumps(doc, indent=2) + "\n", _csv_text(rows),
              latency_png(rows, f"latency: {title}"), roofline_png(rows, f"roofline: {title}"),
              pareto_png(rows, f"latency against area: {title}"))
    files = [(out / name, body.encode() if isinstance(body, str) else body)
             for name, body in zip(OUTPUTS, bodies)]
    atomic_write_all(files)     # makes the folder
    return [path for path, _ in files]


# --- command line ----------------------------------------------------------------------------

def no_empty_paths(ctx, param, values: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(no_empty_path(ctx, param, v) for v in values)


def int_list(ctx, param, value: str) -> tuple[int, ...]:
    numbers = [positive_int(p.strip()) for p in value.split(",")]
    if None in numbers:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of positive integers (below 2**63)")
    return tuple(dict.fromkeys(numbers))      # in order, without repeats


def _presets(names: tuple[str, ...]) -> list[Config]:
    return [config_of(arch_mod.load(n)) for n in names]


def unique(configs: list[Config]) -> list[Config]:
    """The first of each machine (a preset named twice is one row); two different machines of one
    name would be two rows nobody can tell apart, so that is an error."""
    kept = [c for i, c in enumerate(configs) if c not in configs[:i]]
    names = [c.name for c in kept]
    clash = next((n for n in names if names.count(n) > 1), None)
    if clash:
        raise click.BadParameter(f"two different machines are named {clash!r}", param_hint="--preset")
    return kept


def _check_machines(configs: list[Config]) -> None:
    """A configuration no machine can have is the command line's mistake: said before the sweep,
    not as a failed row after it (nor as a row whose program cannot run)."""
    bad = next((c for c in configs if c.arch is None), None)
    if bad:
        raise click.BadParameter(bad.error, param_hint="--legions/--cores/--array")


def _check_model(model: str, dims: dict, switches: dict) -> None:
    """What fails every configuration alike (a model that does not load, an unbound dimension, an
    unsupported operator) is reported once, before the sweep: importing and the graph passes do not
    depend on the machine; only lowering does."""
    from dlegion_cc.errors import CompileError
    from dlegion_cc.pipeline import Options, graph_of
    try:
        graph_of(model, Options(arch_mod.load(BASE), dims, **switches))
    except CompileError as e:
        # The importer's hint also offers dlegion-cc's --inputs, which this command does not have.
        raise CompileError(str(e).replace(" or --inputs", "")) from None


def _none_compiled(model: str, rows: list[dict]) -> str:
    first = rows[0]
    reason = first["reason"].removeprefix(f"{model}: ")
    named = reason if reason.startswith(first["name"]) else f"{first['name']}: {reason}"
    return f"{model}: all {len(rows)} configuration(s) failed; the first, {named}"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@version_option()
@click.argument("model", type=click.Path(dir_okay=False), callback=no_empty_path)
@click.option("--dim", "dims", multiple=True, metavar="NAME=VALUE",
              help="Bind a symbolic dimension of the model (sequence, batch, ...). Repeatable.")
@click.option("--legions", default="2,4,8", show_default=True, callback=int_list, metavar="N,N,...",
              help="Legion counts to sweep.")
@click.option("--cores", default="4,8", show_default=True, callback=int_list, metavar="N,N,...",
              help="Cores per Legion to sweep.")
@click.option("--array", "arrays", default="8,16,32", show_default=True, callback=int_list, metavar="N,N,...",
              help="Systolic array sizes (N for N x N PEs) to sweep.")
@click.option("--preset", "presets", multiple=True, metavar="NAME|FILE.toml", callback=no_empty_paths,
              help="Also evaluate this machine as it is. Repeatable. Presets: " + ", ".join(arch_mod.preset_names()))
@click.option("--jobs", type=click.IntRange(min=1), default=os.cpu_count() or 1, show_default="CPU count",
              help="Worker processes.")
@click.option("--out", "out_dir", default="dse", show_default=True, type=click.Path(file_okay=False),
              callback=no_empty_path,
              help="Folder (created if missing) to write dse.json, dse.csv, latency.png, roofline.png "
                   "and pareto.png to; all five are replaced, or none.")
@click.option("--objective", type=click.Choice(OBJECTIVES), default="latency", show_default=True,
              help="What each quantized matmul's schedule is chosen for (as dlegion-cc --objective).")
def dse_command(model, dims, legions, cores, arrays, presets, jobs, out_dir, objective):
    """Compile MODEL (ONNX) for many machine configurations, time each with the timing model,
    print them by latency and write JSON, CSV and plots.

    The swept configurations replace the Legions, cores per Legion and array size of the
    dlegion-8x8 preset and keep everything else (scratchpads, DRAM, clock). A configuration
    that cannot compile is a row with the reason. Exit status: 0, or 2 for bad input: a
    configuration no machine can have, a model that cannot compile at all, or for none of the
    configurations (then nothing is written).
    """
    from dlegion_cc.cli import _bound_dims, _parse_dims, model_files
    from dlegion_cc.importer import peek
    from isa.files import check_writable
    given = _parse_dims(dims)
    configs = unique(sweep_configs(arch_mod.load(BASE), legions, cores, arrays) + _presets(presets))
    _check_machines(configs)
    shapes, data_files = peek(model)
    bound = _bound_dims(model, shapes, None, given)        # as dlegion-cc: only dims the model has
    out = Path(out_dir)
    check_not_inputs({f"--out's {name}": out / name for name in OUTPUTS}, model_files(model, data_files))
    switches = {"objective": objective}
    _check_model(model, bound, switches)
    for name in OUTPUTS:            # an unwritable output is found before the sweep, not after it
        check_writable(out / name)
    rows = run_sweep(model, configs, bound, jobs, Console(stderr=True), switches)
    if all(r["status"] != "ok" for r in rows):
        raise click.ClickException(_none_compiled(model, rows))
    print_table(rows, _stdout())
    paths = write_outputs(out, rows, model, bound, objective)
    failed = sum(r["status"] != "ok" for r in rows)
    click.echo(printable(f"{len(rows)} configuration(s), {failed} failed; wrote {', '.join(map(str, paths))}"), err=True)


def main() -> None:
    from dlegion_cc.errors import CompileError
    from isa.console import run_script
    run_script(dse_command, "dlegion-dse", (CompileError, arch_mod.ArchError))


if __name__ == "__main__":
    main()
