"""``dlegion-run``: execute a D-Legion program, check it against onnxruntime, report its timing."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import click
import numpy as np

from isa import arch as arch_mod
from isa.asm import load
from isa.files import atomic_path, atomic_write
from runtime.check import REFERENCES

EXIT_MISMATCH = 1


class Failure(Exception):
    """Bad input or a faulting program: one line on stderr, exit status 2."""


def _load_inputs(path: str | None, program, seed: int) -> dict[str, np.ndarray]:
    from runtime.emulator import random_inputs
    if path is None:
        return random_inputs(program, seed)
    try:
        with np.load(path) as npz:
            return {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as e:
        raise Failure(f"{path}: cannot read inputs ({e})") from None


def _save_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write(path, buf.getvalue())


def _check(model: str, inputs, result, tol: float, check_all: bool = False,
           reference: str = "onnxruntime") -> bool:
    from runtime.check import compare, integer_ops, onnx_reference
    from runtime.report import print_comparisons
    try:
        ref = onnx_reference(model, inputs, reference)
        rows = compare(result.outputs, ref, tol)
    except (OSError, ValueError) as e:
        raise Failure(f"{model}: {e}") from None
    except Exception as e:  # onnxruntime raises its own exception types
        raise Failure(f"{model}: onnxruntime failed: {str(e).splitlines()[0]}") from None
    print_comparisons(rows, tol)
    if reference == "onnxruntime" and not all(r.ok for r in rows) and integer_ops(model):
        print("note: onnxruntime's uint8 x int8 kernels sum pairs of products in saturating int16 on CPUs "
              "without VNNI; --reference exact compares with its kernels that compute the operators' definition")
    if check_all:
        from runtime.check import compare_intermediates
        from runtime.report import print_intermediates
        try:
            print_intermediates(compare_intermediates(model, inputs, result, tol, reference), tol)
        except Exception as e:  # onnxruntime raises its own exception types
            raise Failure(f"{model}: onnxruntime failed on intermediates: {str(e).splitlines()[0]}") from None
    return all(r.ok for r in rows)


def _execute(prog_path, arch, inputs_path, seed, races=True):
    from runtime.emulator import run
    program = load(prog_path)
    machine = arch_mod.load(arch or program.arch, base=Path(prog_path).parent)
    inputs = _load_inputs(inputs_path, program, seed)
    return inputs, run(program, machine, inputs, races=races)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("program", type=click.Path(dir_okay=False))
@click.option("--arch", metavar="NAME|FILE.toml",
              help="Machine to run on (default: the program's .arch). Presets: "
                   + ", ".join(arch_mod.preset_names()))
@click.option("--inputs", "inputs_path", type=click.Path(dir_okay=False), metavar="IN.npz",
              help="Input values keyed by graph input name (default: seeded random inputs).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), metavar="OUT.npz",
              help="Write the outputs, keyed by graph output name.")
@click.option("--check", "check_model", type=click.Path(dir_okay=False), metavar="MODEL.onnx",
              help="Run onnxruntime on the same inputs and compare every graph output; exit 1 on mismatch.")
@click.option("--check-all", is_flag=True,
              help="With --check: also compare every intermediate tensor that survives compilation "
                   "and name the first that diverges.")
@click.option("--reference", type=click.Choice(REFERENCES), default="onnxruntime", show_default=True,
              help="With --check: onnxruntime as it comes, or 'exact': onnxruntime made to compute the integer "
                   "operators' definition (uint8 x uint8 MatMulInteger kernels, no QDQ fusion), which its "
                   "default uint8 x int8 kernels do not on CPUs without VNNI.")
@click.option("--tolerance", type=float, default=1e-4, show_default=True,
              help="Largest relative L2 error accepted for float outputs (integers must be exact).")
@click.option("--report", is_flag=True, help="Print cycles, throughput, utilization and traffic.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write the report's numbers as JSON.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write a Chrome/Perfetto trace (one track per Legion queue, one for DRAM).")
@click.option("--race-check/--no-race-check", "races", default=True, show_default=True,
              help="Check that every two instructions touching the same element (one writing) are "
                   "ordered by the program's waits, whatever order the timing model runs them in.")
def run_command(program, arch, inputs_path, seed, out_path, check_model, check_all, reference, tolerance,
                report, json_path, trace_path, races):
    """Run PROGRAM (text .s or binary .bin) in the functional emulator and timing model.

    Exit status: 0 when all is well, 1 when --check finds a mismatch, 2 for bad input.
    """
    from runtime import report as rep
    inputs, result = _execute(program, arch, inputs_path, seed, races)
    if out_path:
        _save_npz(out_path, result.outputs)
    numbers = rep.summarize(result)
    if report:
        rep.print_report(numbers)
    if json_path:
        atomic_write(json_path, json.dumps(numbers, indent=2) + "\n")
    if trace_path:
        with atomic_path(trace_path) as tmp:
            tmp.write_text(json.dumps(rep.chrome_trace(result)))
    if check_model and not _check(check_model, inputs, result, tolerance, check_all, reference):
        sys.exit(EXIT_MISMATCH)


def main() -> None:
    from isa.console import run_script
    from isa.program import ProgramError
    from runtime.state import Trap
    from runtime.timing import Deadlock
    run_script(run_command, "dlegion-run", (ProgramError, arch_mod.ArchError, Trap, Deadlock, Failure))
