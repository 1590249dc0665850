"""``dlegion-dse``: sweep machine configurations for one model and compare them.

Every configuration is compiled and timed with the timing model only; the configurations are the
cross product of Legions x cores per Legion x array size applied to the ``dlegion-8x8`` preset
(scratchpads and everything else unchanged), plus any presets named, or machines an Optuna
search chooses. The parts: where configurations run (``dse_exec``: a process pool or Ray), the
result store (``dse_store``: DuckDB), the search (``dse_search``), what is measured
(``dse_measure``), the plots (``dse_plots``); this file holds the command and its outputs.
"""
from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
from dataclasses import replace
from itertools import product
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from isa import arch as arch_mod
from isa.console import check_not_inputs, no_empty_path, positive_int, printable, table_console, version_option
from dlegion_cc import dse_compare
from dlegion_cc.dse_exec import Job
from dlegion_cc.dse_measure import COLUMNS, Config, config_of
from dlegion_cc.dse_run import Sweep
from dlegion_cc.dse_search import SAMPLERS, search as search_optuna
from dlegion_cc.lower.qplan import OBJECTIVES

BASE = "dlegion-8x8"
DSE_EXTRA = "pip install 'dlegion[dse]'"
TABLE_WIDTH = 170
OUTPUTS = ("dse.json", "dse.csv", "latency.png", "roofline.png", "pareto.png", "heatmap.png")


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


def sort_rows(rows: list[dict]) -> list[dict]:
    """By latency (time, since clocks differ), failed configurations last, ties by name; each
    row that ran marked whether it is on the latency-area Pareto front."""
    return mark_pareto(sorted(rows, key=lambda r: (r["status"] != "ok", r["time_us"] or 0.0, r["name"])))


def pareto_front(points: list[tuple[float, ...]]) -> list[bool]:
    """Whether each point is on the Pareto front of the points, every coordinate minimized: no
    other point is at least as good in every coordinate and better in one."""
    return [not any(o != p and all(a <= b for a, b in zip(o, p)) for o in points) for p in points]


def mark_pareto(rows: list[dict]) -> list[dict]:
    """Set ``pareto`` (latency against area) and ``pareto_energy`` (latency against energy) on
    the rows that ran and that no other row beats on both at once."""
    ok = [r for r in rows if r["status"] == "ok"]
    for flag, other in (("pareto", "area_mm2"), ("pareto_energy", "energy_uj")):
        for r, on in zip(ok, pareto_front([(r["time_us"], r[other]) for r in ok])):
            r[flag] = on
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


def write_outputs(out: Path, rows: list[dict], model: str, dims: dict, objective: str = "latency",
                  meta: dict | None = None) -> list[Path]:
    """All the files, or none (each written to a temporary first, then renamed); ``meta`` says
    how the configurations were chosen."""
    from isa.files import atomic_write_all
    from dlegion_cc.dse_plots import heatmap_png, latency_png, pareto_png, roofline_png
    title = Path(model).name + "".join(f" {k}={v}" for k, v in sorted(dims.items()))
    doc = {"model": str(model), "dims": dims, "base": BASE, "objective": objective, **(meta or {}),
           "columns": list(COLUMNS), "rows": rows}
    bodies = (json.dumps(doc, indent=2) + "\n", _csv_text(rows),
              latency_png(rows, f"latency: {title}"), roofline_png(rows, f"roofline: {title}"),
              pareto_png(rows, title), heatmap_png(rows, f"latency by Legions x cores: {title}"))
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


SEARCH_HELP = ("grid: the cross product of --legions, --cores and --array. optuna: --trials machines chosen "
               "by a multi-objective sampler (latency, energy, area) over Legions, cores, array and the "
               "four scratchpads, powers of two from a quarter (a single one for counts) to twice the "
               "dlegion-8x8 preset's.")


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
@click.option("--search", type=click.Choice(("grid", "optuna")), default="grid", show_default=True, help=SEARCH_HELP)
@click.option("--compare", is_flag=True,
              help="Instead of a sweep: dlegion-8x8 against ws-64, dip-64 and adip-64, and dlegion-32x8 against "
                   "tpuv4i, each baseline as published, at D-Legion's PE count and at its peak w8 TOPS, "
                   "with every figure's ratio to its D-Legion's.")
@click.option("--trials", type=click.IntRange(min=1), default=50, show_default=True,
              help="Machines --search optuna measures.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="The sampler's seed: the same seed asks the same machines.")
@click.option("--sampler", type=click.Choice(SAMPLERS), default="tpe", show_default=True,
              help="Optuna's multi-objective TPE or NSGA-II.")
@click.option("--executor", type=click.Choice(("ray", "pool")), default=None,
              help="Where configurations run: Ray tasks (a local Ray instance, or --address's cluster) or "
                   "a process pool.  [default: pool when --jobs is given, else ray]")
@click.option("--jobs", type=click.IntRange(min=1), default=None, show_default="CPU count",
              help="Worker processes (or the local Ray instance's CPUs).")
@click.option("--address", default=None, metavar="HOST:PORT",
              help="Join the Ray cluster there (ray://HOST:PORT for Ray Client, auto for the one on this host) "
                   "instead of starting a local instance.")
@click.option("--db", default=None, metavar="FILE.duckdb", callback=no_empty_path,
              help="DuckDB file (created if missing) storing every row; a machine it holds for this model, "
                   "program version and options is not measured again.")
@click.option("--export", default=None, metavar="FILE.csv|FILE.parquet", callback=no_empty_path,
              help="Write every row of --db (all models) to CSV, or Parquet for a .parquet name.")
@click.option("--out", "out_dir", default="dse", show_default=True, type=click.Path(file_okay=False),
              callback=no_empty_path,
              help="Folder (created if missing) to write " + ", ".join(OUTPUTS[:-1]) + " and " + OUTPUTS[-1]
                   + " to; all are replaced, or none.")
@click.option("--objective", type=click.Choice(OBJECTIVES), default="latency", show_default=True,
              help="What each quantized matmul's schedule is chosen for (as dlegion-cc --objective).")
@click.pass_context
def dse_command(ctx, model, dims, legions, cores, arrays, presets, search, compare, trials, seed, sampler, executor,
                jobs, address, db, export, out_dir, objective):
    """Compile MODEL (ONNX) for many machine configurations, time each with the timing model,
    print them by latency and write JSON, CSV and plots.

    The swept configurations replace the Legions, cores per Legion and array size of the
    dlegion-8x8 preset and keep everything else (scratchpads, DRAM, clock); --search optuna
    varies the scratchpads too. A configuration that cannot compile is a row with the reason.
    Exit status: 0, or 2 for bad input: a configuration no machine can have, a model that
    cannot compile at all, a --db that is not a DuckDB file, an --address no cluster answers
    at, or for none of the configurations (then nothing is written).
    """
    from dlegion_cc.cli import _bound_dims, _parse_dims, model_files
    from dlegion_cc.importer import peek
    from isa.files import check_writable
    _check_search_options(ctx, search, db, export, compare)
    if search == "optuna":
        _need("optuna", "--search optuna")
    base = arch_mod.load(BASE)
    grid = sweep_configs(base, legions, cores, arrays) if search == "grid" and not compare else []
    compared = dse_compare.machines() if compare else []
    configs = unique(grid + [config_of(m) for m, _, _ in compared] + _presets(presets))
    _check_machines(configs)
    shapes, data_files = peek(model)
    bound = _bound_dims(model, shapes, None, _parse_dims(dims))      # as dlegion-cc: only dims the model has
    out = Path(out_dir)
    check_not_inputs({f"--out's {name}": out / name for name in OUTPUTS} | {"--db": db, "--export": export},
                     model_files(model, data_files))
    switches = {"objective": objective}
    _check_model(model, bound, switches)
    for path in [out / name for name in OUTPUTS] + [p for p in (db, export) if p]:
        check_writable(path)        # an unwritable output is found before the sweep, not after it
    job = Job(model, tuple(map(str, data_files)), bound, switches)
    store = _store(db, model, data_files, bound, switches)
    with Sweep(job, _executor(executor, jobs, address), store, Console(stderr=True)) as sweep:
        rows = sweep.measure(configs, "grid") if configs else []
        if search == "optuna":
            rows += search_optuna(sweep, base, trials, seed, sampler, jobs or os.cpu_count() or 1)
            sweep.say_known()
        rows = sort_rows(rows)
        if all(r["status"] != "ok" for r in rows):
            raise click.ClickException(_none_compiled(model, rows))
        print_table(rows, _stdout())
        if compare:
            _print_compared(rows, compared)
        meta = {"search": search} | ({"trials": trials, "seed": seed, "sampler": sampler} if search == "optuna" else {})
        paths = write_outputs(out, rows, model, bound, objective, meta)
        if export:
            store.export(export)
            paths.append(Path(export))
    failed = sum(r["status"] != "ok" for r in rows)
    click.echo(printable(f"{len(rows)} configuration(s), {failed} failed; wrote {', '.join(map(str, paths))}"), err=True)


def _print_compared(rows: list[dict], compared: list) -> None:
    """The rows of --compare's machines, each with its footing and ratios (also in dse.json)."""
    of = {m.name: (ref, footing) for m, ref, footing in compared}
    mine = [r for r in rows if r["name"] in of]
    for r in mine:
        r["ref"], r["footing"] = of[r["name"]]
    dse_compare.add_ratios(mine)
    dse_compare.print_compare(mine, _stdout(), "each baseline against its D-Legion (ratios: baseline / D-Legion)")


def _check_search_options(ctx, search: str, db: str | None, export: str | None, compare: bool = False) -> None:
    """Options that mean nothing with the others given are refused, not ignored."""
    given = {p: ctx.get_parameter_source(p) == click.core.ParameterSource.COMMANDLINE
             for p in ("legions", "cores", "arrays", "trials", "seed", "sampler")}
    option = lambda p: "--array" if p == "arrays" else f"--{p}"      # noqa: E731
    if compare:
        wrong = [p for p in ("legions", "cores", "arrays") if given[p]] or (["search"] if search != "grid" else [])
        if wrong:
            raise click.BadParameter("not with --compare, which runs its own machines", param_hint=option(wrong[0]))
    wrong = [p for p in (("legions", "cores", "arrays") if search == "optuna" else ("trials", "seed", "sampler"))
             if given[p]]
    if wrong:
        raise click.BadParameter(f"not used by --search {search}", param_hint=option(wrong[0]))
    if export and not db:
        raise click.BadParameter("exports the rows of a --db; give one", param_hint="--export")


def _executor(name: str | None, jobs: int | None, address: str | None):
    """Ray unless a process pool is asked for (or implied by --jobs without --executor ray)."""
    from dlegion_cc.dse_exec import Pool, Ray
    if address and name == "pool":
        raise click.BadParameter("joins a Ray cluster; not with --executor pool", param_hint="--address")
    if name == "pool" or (name is None and jobs is not None and not address):
        return Pool(jobs or os.cpu_count() or 1)
    if importlib.util.find_spec("ray") is None:
        if name or address:
            raise click.ClickException(f"{'--address' if address else '--executor ray'} needs Ray: {DSE_EXTRA}")
        click.echo(f"Ray is not installed ({DSE_EXTRA}): running on a process pool", err=True)
        return Pool(jobs or os.cpu_count() or 1)
    return Ray(jobs, address)


def _need(module: str, option: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise click.ClickException(f"{option} needs {module}: {DSE_EXTRA}")


def _store(db: str | None, model: str, data_files, dims: dict, switches: dict):
    if db is None:
        return None
    _need("duckdb", "--db")
    from dlegion_cc.dse_store import Store, model_hash, options_key, program_version
    return Store(db, model, model_hash(model, data_files), program_version(), options_key(dims, switches))


def main() -> None:
    from dlegion_cc.errors import CompileError
    from isa.console import run_script
    run_script(dse_command, "dlegion-dse", (CompileError, arch_mod.ArchError))


if __name__ == "__main__":
    main()
