"""``dlegion-cc``: compile an ONNX model into a D-Legion program."""
from __future__ import annotations

from pathlib import Path

import click

from isa import arch as arch_mod
from dlegion_cc.lower.qplan import OBJECTIVES

EMITS = ("asm", "bin", "ir")


def _parse_dims(values: tuple[str, ...]) -> dict[str, int]:
    dims = {}
    for v in values:
        name, sep, num = v.partition("=")
        if not sep or not name or not num.isdigit() or int(num) <= 0:
            raise click.BadParameter(f"{v!r} is not NAME=POSITIVE_INTEGER", param_hint="--dim")
        dims[name] = int(num)
    return dims


def _dims_from_inputs(model: str, path: str) -> dict[str, int]:
    """Bind symbolic dims from the shapes of the arrays a user will run with."""
    import numpy as np
    import onnx
    graph = onnx.load(model, load_external_data=False).graph
    with np.load(path) as npz:
        shapes = {k: npz[k].shape for k in npz.files}
    dims = {}
    for inp in graph.input:
        if inp.name not in shapes:
            continue
        for d, size in zip(inp.type.tensor_type.shape.dim, shapes[inp.name]):
            if d.dim_param:
                dims[d.dim_param] = int(size)
    return dims


def _print_after(selected: str | None):
    if not selected:
        return None

    def hook(name, graph):
        if selected in ("all", name):
            click.echo(f"; --- IR after {name} ---", err=True)
            click.echo(graph.text(), err=True, nl=False)
    return hook


def _write(program, graph, output: str, emit: str) -> None:
    from isa.asm import save
    from isa.files import atomic_write
    if emit == "ir":
        atomic_write(output, graph.text())
        return
    save(program, output, program.data, binary=(emit == "bin"))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Program to write (its constants go to OUTPUT.data beside it).")
@click.option("--arch", default="dlegion-8x8", show_default=True, metavar="NAME|FILE.toml",
              help="Target machine. Presets: " + ", ".join(arch_mod.preset_names()))
@click.option("--dim", "dims", multiple=True, metavar="NAME=VALUE",
              help="Bind a symbolic dimension (batch, sequence, ...). Repeatable.")
@click.option("--inputs", "inputs_path", type=click.Path(dir_okay=False, exists=True), metavar="IN.npz",
              help="Bind symbolic dimensions from the shapes of these inputs.")
@click.option("--emit", type=click.Choice(EMITS), default="asm", show_default=True,
              help="Write assembly text, binary instruction words, or the graph IR.")
@click.option("--print-ir-after", "print_after", metavar="PASS|all",
              help="Print the graph IR after a pass (to stderr). Passes: " + ", ".join(
                  __import__("dlegion_cc.pipeline", fromlist=["PASS_NAMES"]).PASS_NAMES))
@click.option("--no-multicast", is_flag=True, help="Ablation: every Legion loads its own copy of the activations.")
@click.option("--no-accumulators", is_flag=True,
              help="Ablation: schedule as if the parallel accumulators were absent (passes split by output windows).")
@click.option("--no-sparsity", is_flag=True,
              help="Ablation: dense schedule; all-zero weight blocks and causally masked attention blocks are not skipped.")
@click.option("--no-fusion", is_flag=True,
              help="Ablation: no fusion of matmuls sharing an input, nor of row-local ops into kernels.")
@click.option("--no-prefetch", is_flag=True,
              help="Ablation: a quantized matmul's first weights do not load during the row kernel before it "
                   "(at decode, while the kernel runs on one Legion).")
@click.option("--objective", type=click.Choice(OBJECTIVES), default="latency", show_default=True,
              help="What each quantized matmul's schedule is chosen for: the fewest cycles, the fewest joules "
                   "by the architecture's energy table (mostly DRAM traffic), or the least energy x delay.")
def compile_command(model, output, arch, dims, inputs_path, emit, print_after, no_multicast, no_accumulators,
                    no_sparsity, no_fusion, no_prefetch, objective):
    """Compile MODEL (ONNX) into a D-Legion program for ``dlegion-run``."""
    from dlegion_cc.pipeline import Options, compile_model
    bound = _dims_from_inputs(model, inputs_path) if inputs_path else {}
    bound.update(_parse_dims(dims))
    machine = arch_mod.load(arch)
    data_file = Path(output).name + ".data"
    options = Options(machine, bound, multicast=not no_multicast, accumulators=not no_accumulators,
                      sparsity=not no_sparsity, fusion=not no_fusion, prefetch=not no_prefetch,
                      objective=objective)
    graph, program = compile_model(model, options, data_file, _print_after(print_after))
    _write(program, graph, output, emit)
    click.echo(f"{output}: {len(program.instrs)} instructions for {machine.name}", err=True)


def main() -> None:
    from dlegion_cc.errors import CompileError
    from isa.console import run_script
    from isa.program import ProgramError
    run_script(compile_command, "dlegion-cc", (CompileError, ProgramError, arch_mod.ArchError),
               listed=(CompileError,))
