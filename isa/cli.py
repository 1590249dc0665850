"""Command-line tools of the ISA: ``dlegion-as``, ``dlegion-dis`` and ``dlegion-arch``.

Every error a user can cause (a malformed program or architecture, an unreadable or unwritable
file) is printed on stderr without a traceback and exits with status 2; outputs are written
atomically, so a failed run leaves no half-written file.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import click

from isa import arch as arch_mod
from isa import asm
from isa.arch import ArchError
from isa.program import Program, ProgramError

EXIT_ERROR = 2


def _reports_errors(fn):
    """Turn the errors a user can cause into a message on stderr and exit status 2."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ProgramError, ArchError) as e:
            click.echo(str(e), err=True)          # already names the file (and line) at fault
        except OSError as e:
            click.echo(f"{e.filename or 'error'}: {e.strerror or e}", err=True)
        sys.exit(EXIT_ERROR)
    return run


def _moved(path: str | None, src_dir: Path, dst_dir: Path) -> str | None:
    """A path relative to ``src_dir`` rewritten relative to ``dst_dir`` (absolute ones kept)."""
    if path is None or Path(path).is_absolute():
        return path
    return Path(os.path.relpath(src_dir / path, dst_dir)).as_posix()


def relocate(p: Program, src: str, dst: str) -> Program:
    """``p`` read from ``src`` as it must be written to ``dst``: the data file and an arch file
    are relative to the program, so they are re-pointed when the program changes folder."""
    src_dir, dst_dir = Path(src).parent.resolve(), Path(dst).parent.resolve()
    if src_dir == dst_dir:
        return p
    arch = _moved(p.arch, src_dir, dst_dir) if p.arch.endswith(".toml") else p.arch
    return dataclasses.replace(p, arch=arch, data_file=_moved(p.data_file, src_dir, dst_dir))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("program", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Binary to write (default: PROGRAM with the suffix .bin).")
@_reports_errors
def assemble_main(program: str, output: str | None) -> None:
    """Assemble a D-Legion program (text, or a binary to re-encode) into a binary.

    The output's .data and .arch paths are rewritten so they still name the same files
    when OUTPUT is in another folder. Exit status: 0 on success, 2 on any error.
    """
    output = output or str(Path(program).with_suffix(".bin"))
    p = asm.load(program, read_data=False)
    asm.save(relocate(p, program, output), output, binary=True)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("program", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Text file to write (default: standard output).")
@_reports_errors
def disassemble_main(program: str, output: str | None) -> None:
    """Disassemble a D-Legion binary into canonical program text.

    A text program is accepted too and printed in canonical form. Exit status: 0 on
    success, 2 on any error.
    """
    p = asm.load(program, read_data=False)
    if output is None:
        click.echo(asm.format_program(p), nl=False)
        return
    asm.save(relocate(p, program, output), output)


def _arch_json(a: arch_mod.Arch) -> dict:
    return {"arch": dataclasses.asdict(a), "derived": dataclasses.asdict(a.derived)}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True,
              help="Print the parameters and derived figures as JSON.")
@_reports_errors
def arch_main(name: str | None, as_json: bool) -> None:
    """Show an architecture: a preset NAME or a FILE.toml.

    Without NAME, list the presets with one-line summaries. Exit status: 0 on success,
    2 on an unknown or malformed architecture.
    """
    if name is not None:
        a = arch_mod.load(name)
        click.echo(json.dumps(_arch_json(a), indent=2) if as_json else arch_mod.summary(a))
        return
    presets = {n: arch_mod.load(n) for n in arch_mod.preset_names()}
    if as_json:
        click.echo(json.dumps({n: _arch_json(a) for n, a in presets.items()}, indent=2))
        return
    width = max(map(len, presets))
    for n, a in presets.items():
        click.echo(f"{n:<{width}}  {a.description}")
