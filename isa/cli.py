"""Command-line tools of the ISA: ``dlegion-as``, ``dlegion-dis`` and ``dlegion-arch``.

Every error a user can cause (a malformed program or architecture, an unreadable or unwritable
file, an output that would replace an input) is one line ``NAME: error: ...`` on stderr, without
a traceback, and exit status 2; outputs are written atomically, so a failed run leaves no
half-written file.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from types import SimpleNamespace

import click

from isa import arch as arch_mod
from isa import asm
from isa.arch import ArchError
from isa.console import check_outputs, no_empty_path, run_script, stdout_path, version_option
from isa.program import Program, ProgramError
from isa.verify import verify


class Script(click.Command):
    """A console script named as its command: run through ``isa.console.run_script``, so every
    error a user can cause is one line ``NAME: error: ...`` and exit status 2, whether a
    console script or click's test runner calls it."""

    def main(self, args=None, prog_name=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, standalone_mode=False, **extra)
        command = SimpleNamespace(main=functools.partial(super().main, args, **extra))
        run_script(command, self.name, (ProgramError, ArchError))


def program_files(p: Program) -> dict[str, Path]:
    """The files a program read from ``p.source`` names, which no output may replace."""
    folder = Path(p.source).parent
    files = {"the program's data file": p.data_file and folder / p.data_file}
    if p.arch.endswith(".toml"):
        files["the program's machine description"] = folder / p.arch
    return files


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
    moved = dataclasses.replace(p, arch=arch, data_file=_moved(p.data_file, src_dir, dst_dir), source=dst)
    if moved.data_file is not None:
        asm.data_path(moved)        # a program reads data only from its own folder: refuse one that could not
    return dataclasses.replace(moved, source=p.source)


@click.command("dlegion-as", cls=Script, context_settings={"help_option_names": ["-h", "--help"]})
@version_option()
@click.argument("program", type=click.Path(dir_okay=False), callback=no_empty_path)
@click.option("-o", "--output", type=click.Path(dir_okay=False), callback=no_empty_path,
              help="Binary to write (default: PROGRAM with the suffix .bin).")
def assemble_main(program: str, output: str | None) -> None:
    """Assemble a D-Legion program (text, or a binary to re-encode) into a binary.

    The program's .arch must name a preset or a TOML file (relative to the program), and the
    program must pass the checks dlegion-run makes before running it on that machine. The
    output's .data and .arch paths are rewritten so they still name the same files when
    OUTPUT is in another folder.

    Exit status: 0 on success, 2 on any error.
    """
    outputs = {"-o": output} if output else {"the default output": str(Path(program).with_suffix(".bin"))}
    output = next(iter(outputs.values()))
    check_outputs(outputs, {"the program": program})
    p = asm.load(program, read_data=False)
    check_outputs(outputs, program_files(p))
    # What dlegion-run would refuse before running (a Legion the machine lacks, a view past a
    # scratchpad's end) is refused here, rather than written into a binary.
    verify(p, asm.arch_of(p))
    asm.save(relocate(p, program, output), output, binary=True)


@click.command("dlegion-dis", cls=Script, context_settings={"help_option_names": ["-h", "--help"]})
@version_option()
@click.argument("program", type=click.Path(dir_okay=False), callback=no_empty_path)
@click.option("-o", "--output", type=click.Path(dir_okay=False), callback=stdout_path,
              help="Text file to write (default, or '-': standard output).")
def disassemble_main(program: str, output: str | None) -> None:
    """Disassemble a D-Legion binary into canonical program text.

    A text program is accepted too and printed in canonical form. Exit status: 0 on
    success, 2 on any error.
    """
    check_outputs({"-o": output}, {"the program": program})
    p = asm.load(program, read_data=False)
    if output is None:
        click.echo(asm.format_program(p), nl=False)
        return
    check_outputs({"-o": output}, program_files(p))
    asm.save(relocate(p, program, output), output)


def _arch_json(a: arch_mod.Arch) -> dict:
    return {"arch": dataclasses.asdict(a), "derived": dataclasses.asdict(a.derived)}


@click.command("dlegion-arch", cls=Script, context_settings={"help_option_names": ["-h", "--help"]})
@version_option()
@click.argument("name", required=False, callback=no_empty_path)
@click.option("--json", "as_json", is_flag=True,
              help="Print the parameters and derived figures as JSON.")
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
