"""``dlegion-run``: execute a D-Legion program, check it against onnxruntime, report its timing."""
from __future__ import annotations

import io
import json
import math
import sys

import click
import numpy as np
from click.core import ParameterSource

from isa import arch as arch_mod
from isa.asm import arch_of, load
from isa.bulk import no_cycle_collection
from isa.cli import program_files
from isa.console import check_outputs, no_empty_path, printable, read_arrays, version_option
from isa.expand import dram_of
from isa.files import atomic_write_all
from isa.progress import SILENT, Progress
from isa.instructions import DmaStore
from runtime.check import FP64_MAX_PARAMETER_BYTES, FP64_MULTIPLE, REFERENCES

EXIT_MISMATCH = 1


class Failure(Exception):
    """Bad input or a faulting program: one line on stderr, exit status 2."""


def _load_inputs(path: str | None, program, seed: int) -> dict[str, np.ndarray]:
    from runtime.emulator import random_inputs
    if path is None:
        return random_inputs(program, seed)
    arrays = read_arrays(path)
    # a name the program does not take is most likely a misspelt one, whose input got no value
    extra = sorted(set(arrays) - {t.io_name for t in program.inputs()})
    if extra:
        raise Failure(f"{path}: the program has no input(s) {', '.join(extra)} "
                      f"(its inputs: {', '.join(sorted(t.io_name for t in program.inputs())) or 'none'})")
    return arrays


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def unwritten_outputs(program) -> dict[str, tuple[int, int]]:
    """Per graph output that some element of stays unwritten by every store: (elements no
    store writes, elements). Read from the program's stores (each rank of a span too), not
    from a run, so it holds whatever the waits."""
    from runtime.state import window
    tensors = program.tensors
    written = {n: np.zeros(t.storage_elems, np.bool_) for n, t in enumerate(tensors) if t.kind == "output"}
    for i in program.instrs:
        if not isinstance(i, DmaStore) or i.dst.tensor not in written or not i.rows or not i.cols:
            continue
        marks = written[i.dst.tensor]
        for rank in range(i.span or 1):
            start = dram_of(i, rank).offset
            if start + (i.rows - 1) * i.dst.rs + i.cols <= marks.size:     # else the run traps
                window(marks, start, i.rows, i.cols, i.dst.rs, 1, writeable=True)[...] = True
    return {tensors[n].name: (int(marks.size - np.count_nonzero(marks)), marks.size)
            for n, marks in written.items() if not marks.all()}


def _warn_unwritten(program) -> None:
    """A graph output, or part of one, that no instruction stores to stays zero: worth a word,
    not a failure."""
    missing = unwritten_outputs(program)
    whole = [name for name, (left, total) in missing.items() if left == total]
    if whole:
        click.echo(f"dlegion-run: warning: {program.source}: no instruction writes output tensor(s) "
                   f"{', '.join(whole)}; they stay zero", err=True)
    parts = [f"{name} ({left:,} of {total:,})" for name, (left, total) in missing.items() if left < total]
    if parts:
        click.echo(f"dlegion-run: warning: {program.source}: no instruction writes some elements of output "
                   f"tensor(s) {', '.join(parts)}; they stay zero", err=True)


def _check(model: str, inputs, result, tol: float, check_all: bool = False, reference: str | None = None,
           approximations=None, intermediate_tol: float | None = None):
    """The verdict of --check (runtime.check.judge), printed; ``approximations``: the program's;
    ``intermediate_tol``: --check-all's for values no approximation reaches (default ``tol``)."""
    from runtime.check import integer_ops, judge
    from runtime.report import print_verdict
    try:
        verdict = judge(model, inputs, result.outputs, reference, tol, approximations)
    except OSError as e:
        raise Failure(f"{model}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        why = str(e)        # some name the model already
        raise Failure(why if why.startswith(f"{model}: ") else f"{model}: {why}") from None
    except Exception as e:  # onnxruntime raises its own exception types
        raise Failure(f"{model}: onnxruntime failed: {str(e).splitlines()[0]}") from None
    print_verdict(verdict, tol)
    if verdict.reference == "onnxruntime" and not verdict.ok and integer_ops(model):
        print("note: onnxruntime's uint8 x int8 kernels sum pairs of products in saturating int16 on CPUs "
              "without VNNI; --reference exact compares with its kernels that compute the operators' definition")
    if check_all:
        from runtime.intermediates import compare_intermediates
        from runtime.report import print_intermediates
        at = tol if intermediate_tol is None else intermediate_tol
        try:
            print_intermediates(compare_intermediates(model, inputs, result, at, verdict.reference,
                                                      approximations), at)
        except Exception as e:  # onnxruntime raises its own exception types
            raise Failure(f"{model}: onnxruntime failed on intermediates: {str(e).splitlines()[0]}") from None
    return verdict


def _execute(program, arch, inputs_path, seed, races=True, keep=False, progress=SILENT):
    from runtime.emulator import run
    machine = arch_mod.load(arch) if arch else arch_of(program)
    inputs = _load_inputs(inputs_path, program, seed)
    _warn_unwritten(program)
    try:
        return inputs, run(program, machine, inputs, races=races, keep=keep, progress=progress)
    except MemoryError:     # the tensors themselves are named where they are made (runtime/state.py)
        raise Failure(f"{program.source}: the emulator ran out of host memory") from None


def _time_only(program, arch, progress):
    from runtime.emulator import time_only
    return time_only(program, arch_mod.load(arch) if arch else arch_of(program), progress)


def _approximated(program, tolerance: float, model: str, reference: str | None) -> float:
    """The tolerance for a program that records approximations, said with them: the float64
    evaluation applies those it models, so only the others loosen it."""
    from runtime.check import approximation_tolerance, describe_approximations, fp64_evaluated
    try:
        fp64 = fp64_evaluated(model, reference)
    except OSError as e:
        raise Failure(f"{model}: cannot read ({e.strerror or e})") from None
    tol = approximation_tolerance(program.approximations, tolerance, fp64)
    how = (f"float outputs are judged at relative L2 <= {tol:g} (--tolerance to choose another)" if tol != tolerance
           else "float outputs are measured from the float64 evaluation with them applied")
    print(f"{program.source}: the compiler approximated the model's semantics: "
          f"{'; '.join(describe_approximations(program.approximations))}; {how}")
    return tol


def _given(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)


def _needs_check(ctx: click.Context, check_model: str | None, inputs_path: str | None) -> None:
    """Options that only mean something with --check are an error without it, when given; so
    is --seed with --inputs, which leaves nothing random."""
    for name in ("check_all", "reference", "tolerance"):
        if not check_model and _given(ctx, name):
            raise click.UsageError(f"--{name.replace('_', '-')} needs --check", ctx)
    if inputs_path is not None and _given(ctx, "seed"):
        raise click.UsageError("--seed has no effect with --inputs (it seeds the random inputs)", ctx)


def _values_unused(ctx: click.Context) -> None:
    """--timing-only computes no values: the options about values are an error with it."""
    flags = {"inputs_path": "--inputs", "seed": "--seed", "out_path": "--out", "check_model": "--check",
             "check_all": "--check-all", "reference": "--reference", "tolerance": "--tolerance",
             "races": "--race-check" if ctx.params.get("races") else "--no-race-check"}
    for name, flag in flags.items():
        if _given(ctx, name):
            raise click.UsageError(f"{flag} has no effect with --timing-only (it computes no values)", ctx)


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """A NaN tolerance fails every comparison and an infinite one passes any; neither is a bound."""
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number", ctx, param)
    return value


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@version_option()
@click.pass_context
@click.argument("program", type=click.Path(dir_okay=False), callback=no_empty_path)
@click.option("--arch", metavar="NAME|FILE.toml", callback=no_empty_path,
              help="Machine to run on (default: the program's .arch); a FILE.toml is relative to the "
                   "current folder. Presets: "
                   + ", ".join(arch_mod.preset_names()))
@click.option("--inputs", "inputs_path", type=click.Path(dir_okay=False), metavar="IN.npz",
              callback=no_empty_path, help="Input values keyed by graph input name (default: seeded random inputs).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), metavar="OUT.npz",
              callback=no_empty_path, help="Write the outputs, keyed by graph output name.")
@click.option("--check", "check_model", type=click.Path(dir_okay=False), metavar="MODEL.onnx",
              callback=no_empty_path,
              help="Run onnxruntime on the same inputs and compare every graph output; exit 1 on mismatch.")
@click.option("--check-all", is_flag=True,
              help="With --check: also compare every intermediate tensor that survives compilation "
                   "and name the first that diverges (a value computed from an approximation the program "
                   "records is judged at its tolerance).")
@click.option("--reference", type=click.Choice(REFERENCES), default=None,
              help="With --check: what to judge against. Default: onnxruntime's fp32 run (the 'exact' one on graphs "
                   "with integer operators) and the graph evaluated in float64, when the model's parameters take "
                   f"at most {FP64_MAX_PARAMETER_BYTES / 2**30:g} GiB; 'fp64': the same whatever the size; "
                   "'onnxruntime': onnxruntime as it comes, at the tolerance alone; 'exact': onnxruntime made "
                   "to compute the integer operators' definition (uint8 x uint8 MatMulInteger kernels, no QDQ "
                   "fusion), which its default uint8 x int8 kernels do not on CPUs without VNNI, at the "
                   "tolerance alone.")
@click.option("--tolerance", type=click.FloatRange(min=0), default=1e-4, show_default=True, callback=_finite,
              help="Relative L2 error from onnxruntime accepted for float outputs without more (integers must "
                   "be exact); past it, a float output passes when no farther from the float64 evaluation than "
                   f"{FP64_MULTIPLE:g} times onnxruntime's own fp32 output is.")
@click.option("--report", is_flag=True, help="Print cycles, throughput, utilization and traffic.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), metavar="FILE", callback=no_empty_path,
              help="Write the report's numbers as JSON.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), metavar="FILE", callback=no_empty_path,
              help="Write a Chrome/Perfetto trace (one track per Legion queue, one for DRAM).")
@click.option("--race-check/--no-race-check", "races", default=True, show_default=True,
              help="Check that every two instructions touching the same element (one writing) are "
                   "ordered by the program's waits, whatever order the timing model runs them in.")
@click.option("--timing-only", is_flag=True,
              help="Run the timing model alone, computing no values (of the data file only block masks are "
                   "read), for programs too large to emulate; the same cycles as a full run. Not with --inputs, "
                   "--out or --check.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar on stderr.")
def run_command(ctx, program, arch, inputs_path, seed, out_path, check_model, check_all, reference, tolerance,
                report, json_path, trace_path, races, timing_only, quiet):
    """Run PROGRAM (text .s or binary .bin) in the functional emulator and timing model.

    Exit status: 0 when all is well, 1 when --check finds a mismatch, 2 for bad input (a
    malformed program, machine description or file, a bad option) or a program that faults,
    races or deadlocks. Outputs are written together at the end, all or none.
    """
    from runtime import report as rep
    if timing_only:
        _values_unused(ctx)
    _needs_check(ctx, check_model, inputs_path)
    outputs = {"--out": out_path, "--json": json_path, "--trace": trace_path}
    check_outputs(outputs, {"the program": program, "the --inputs file": inputs_path,
                            "the --check model": check_model,
                            "the --arch machine description": arch if arch and arch.endswith(".toml") else None})
    prog = load(program)        # the data file is mapped, not read: --timing-only touches only block masks
    check_outputs(outputs, program_files(prog))
    progress = Progress.for_terminal(quiet)
    if timing_only:
        inputs, result = None, _time_only(prog, arch, progress)
    else:   # --check-all reads the intermediates at the end: keep them
        inputs, result = _execute(prog, arch, inputs_path, seed, races, keep=check_all, progress=progress)
    with no_cycle_collection():     # a whole model's program holds millions of objects
        numbers = rep.summarize(result)
        if report:
            rep.print_report(numbers)
        else:       # the run's result in a line, as dlegion-cc ends with its program's
            click.echo(printable(f"{program}: {rep.headline(numbers)} (--report: utilization and traffic)"))
    given = tolerance       # --check-all judges values no approximation reaches at it
    if check_model and prog.approximations and not _given(ctx, "tolerance"):
        tolerance = _approximated(prog, tolerance, check_model, reference)
    verdict = (_check(check_model, inputs, result, tolerance, check_all, reference, prog.approximations, given)
               if check_model else None)
    if verdict:
        numbers["check"] = verdict.as_json(tolerance) | {"program_approximations": list(prog.approximations)}
    files = []
    if out_path:
        files.append((out_path, _npz_bytes(result.outputs)))
    if json_path:
        files.append((json_path, (json.dumps(numbers, indent=2) + "\n").encode()))
    if trace_path:
        files.append((trace_path, json.dumps(rep.chrome_trace(result)).encode()))
    atomic_write_all(files)
    if verdict and not verdict.ok:
        sys.exit(EXIT_MISMATCH)


def main() -> None:
    from isa.console import run_script
    from isa.program import ProgramError
    from runtime.state import Trap
    from runtime.timing import Deadlock
    run_script(run_command, "dlegion-run", (ProgramError, arch_mod.ArchError, Trap, Deadlock, Failure))
