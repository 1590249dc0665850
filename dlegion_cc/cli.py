"""``dlegion-cc``: compile an ONNX model into a D-Legion program."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import click

from isa import arch as arch_mod
from isa.console import check_outputs, no_empty_path, printable, read_arrays, size_int, version_option
from isa.progress import Progress
from dlegion_cc.errors import CompileError
from dlegion_cc.importer import peek
from dlegion_cc.lower import schedules
from dlegion_cc.lower.qplan import OBJECTIVES
from dlegion_cc.passes.attention import MODES as ATTENTION_MODES
from dlegion_cc.passes.quantize import BLOCK as QUANTIZE_BLOCK, MODES as QUANTIZE_MODES
from dlegion_cc.pipeline import PASS_NAMES, Options, compile_model

EMITS = ("asm", "bin", "ir", "schedule")


def _parse_dims(values: tuple[str, ...]) -> dict[str, int]:
    dims = {}
    for v in values:
        name, sep, num = v.partition("=")
        size = size_int(num)      # 0 is a size: a decode step's empty cache (a prefill)
        if not sep or not name or size is None:
            raise click.BadParameter(f"{v!r} is not NAME=SIZE (an integer from 0 to below 2**63)", param_hint="--dim")
        if name in dims:        # a repeat is a slip at best (a copied line), at worst a contradiction
            raise click.BadParameter(f"'{name}' bound twice ({name}={dims[name]} and {v})", param_hint="--dim")
        dims[name] = size
    return dims


def _bound_dims(model: str, shapes: dict, inputs_path: str | None, dims: dict[str, int]) -> dict[str, int]:
    """Symbolic dims bound by --inputs (the arrays' shapes) and --dim; each must name a dim of
    the model, and no dim may be bound to two sizes."""
    bound, where = {}, {}
    arrays = {k: a.shape for k, a in read_arrays(inputs_path).items()} if inputs_path else {}
    stray = [name for name in arrays if name not in shapes]
    if stray:               # a misspelt input would otherwise be silently ignored, and run random
        raise CompileError(f"{inputs_path}: '{stray[0]}' is not an input of {model} "
                           f"(its inputs: {', '.join(shapes) or 'none'})")
    for name, shape in shapes.items():
        if name not in arrays or shape is None:
            continue
        got = arrays[name]
        if len(got) != len(shape) or any(isinstance(d, int) and d != g for d, g in zip(shape, got)):
            raise CompileError(f"{inputs_path}: input '{name}' has shape {list(got)}; {model} expects "
                               f"[{', '.join('?' if d is None else str(d) for d in shape)}]")
        for d, size in zip(shape, got):
            if not isinstance(d, str):
                continue
            if bound.setdefault(d, size) != size:
                raise CompileError(f"{inputs_path}: dim '{d}' is {bound[d]} in '{where[d]}' but {size} in '{name}'")
            where.setdefault(d, name)
    symbolic = sorted({d for shape in shapes.values() for d in shape or () if isinstance(d, str)})
    for name, size in dims.items():
        if name not in symbolic:
            raise CompileError(f"--dim {name}={size}: {model} has no symbolic dim '{name}' "
                               f"(its symbolic dims: {', '.join(symbolic) or 'none'})")
        if bound.get(name, size) != size:
            raise CompileError(f"--dim {name}={size} contradicts {inputs_path}, where input "
                               f"'{where[name]}' gives {name}={bound[name]}")
    return bound | dims


def model_files(model: str, data_files: set[Path]) -> dict[str, str | Path]:
    """The files a model is read from, by description, which no output may replace."""
    return {f"the model {model}": model} | {f"the data file {f} of {model}": f for f in data_files}


def _check_outputs(model: str, data_files: set[Path], output: str, emit: str, schedule: str | None = None) -> None:
    """Refuse to overwrite the model, its weights or the schedules read, and find an unwritable
    output before the long compile rather than after it."""
    check_outputs({"-o": output, "-o's data file": None if emit in ("ir", "schedule") else output + ".data"},
                  model_files(model, data_files) | {f"the schedules {schedule}": schedule})


def _arch_for(arch: str, output: str) -> str:
    """The ``.arch`` a program carries: a preset's name, or a machine file's path relative to
    the program's folder, where ``dlegion-run`` resolves it (the name inside the file means
    nothing to it)."""
    if not arch.endswith(".toml"):
        return arch
    return Path(os.path.relpath(os.path.abspath(arch), os.path.dirname(os.path.abspath(output)))).as_posix()


def _print_after(selected: str | None):
    if not selected:
        return None

    def hook(name, graph):
        if selected in ("all", name):
            click.echo(f"; --- IR after {name} ---", err=True)
            click.echo(graph.text(), err=True, nl=False)
    return hook


def _compile_only(model: str, options: Options, hook, progress: Progress):
    """The whole compile (its errors are the same), its constants discarded: (graph, program)."""
    with open(os.devnull, "wb") as nowhere:
        return compile_model(model, options, None, hook, progress, nowhere)


def _compile_ir(model: str, options: Options, output: str, hook, progress: Progress):
    """--emit ir: the graph the lowering read."""
    from isa.files import atomic_write
    graph, program = _compile_only(model, options, hook, progress)
    atomic_write(output, graph.text())
    return program


def _compile_schedules(model: str, options: Options, output: str, hook, progress: Progress):
    """--emit schedule: the schedule of each quantized matmul (JSON), as the lowering gave it."""
    import json
    from isa.files import atomic_write
    _, program = _compile_only(model, options, hook, progress)
    atomic_write(output, json.dumps(options.schedules.document(options.arch, options.switches()), indent=1) + "\n")
    return program


def _compile_program(model: str, options: Options, output: str, arch: str, emit: str, hook, progress: Progress):
    """The program and its data file, the constants streamed into a temporary beside it as
    each node is lowered; both renamed into place together, or neither (nothing left over)."""
    from isa.asm import save
    from isa.files import Staged
    data_path = output + ".data"
    with Staged(data_path) as data:
        _, program = compile_model(model, options, Path(data_path).name, hook, progress, data)
        program = dataclasses.replace(program, arch=_arch_for(arch, output))
        save(program, output, data if program.data_file else None, binary=(emit == "bin"))
    return program


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@version_option()
@click.argument("model", type=click.Path(dir_okay=False), callback=no_empty_path)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), callback=no_empty_path,
              help="Program to write (its constants go to OUTPUT.data beside it).")
@click.option("--arch", default="dlegion-8x8", show_default=True, metavar="NAME|FILE.toml", callback=no_empty_path,
              help="Target machine. Presets: " + ", ".join(arch_mod.preset_names()))
@click.option("--dim", "dims", multiple=True, metavar="NAME=VALUE",
              help="Bind a symbolic dimension (batch, sequence, ...). Repeatable.")
@click.option("--inputs", "inputs_path", type=click.Path(dir_okay=False, exists=True), metavar="IN.npz",
              callback=no_empty_path,
              help="Bind symbolic dimensions from the shapes of these inputs.")
@click.option("--emit", type=click.Choice(EMITS), default="asm", show_default=True,
              help="Write assembly text, binary instruction words, the graph IR, or each quantized matmul's "
                   "schedule (JSON: deal, loop order, tile, chunk, slots, predicted cycles and bytes).")
@click.option("--schedule", "schedule_path", type=click.Path(dir_okay=False), metavar="FILE.json",
              callback=no_empty_path,
              help="Give the quantized matmuls this file names (as --emit schedule writes it) its schedules "
                   "instead of searching; each is checked against the machine.")
@click.option("--print-ir-after", "print_after", metavar="PASS|all",
              type=click.Choice(("all",) + PASS_NAMES),
              help="Print the graph IR after a pass (to stderr). Passes: " + ", ".join(PASS_NAMES))
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
@click.option("--no-transfers", is_flag=True,
              help="Ablation: activations a matmul reads again come from DRAM, not from another Legion (noc.mv).")
@click.option("--no-ksplit", is_flag=True,
              help="Ablation: no matmul's K is split over the Legions with its partial sums reduced over the NoC (noc.add).")
@click.option("--no-row-blocks", is_flag=True,
              help="Ablation: matmuls and the row kernels between them are not pipelined by row blocks.")
@click.option("--no-head-groups", is_flag=True,
              help="Ablation: attention's QK^T, softmax and P.V run over all heads at once, not by head groups.")
@click.option("--no-cache-alias", is_flag=True,
              help="Ablation: a key/value cache input is not bound inside its present output; the program copies it there.")
@click.option("--overlap/--no-overlap", default=False, show_default=True,
              help="Nodes end in waits for what the next ones share, not in barriers, so one node's work "
                   "overlaps the next one's (costly to compile at full size, hence off by default).")
@click.option("--objective", type=click.Choice(OBJECTIVES), default="latency", show_default=True,
              help="What each quantized matmul's schedule is chosen for: the fewest cycles, the fewest joules "
                   "by the architecture's energy table (mostly DRAM traffic), or the least energy x delay.")
@click.option("--attention", type=click.Choice(ATTENTION_MODES), default=None,
              help="Attention's float products (QK^T, PV): int8 on the systolic arrays (operands quantized by the "
                   "compiler, an approximation --check allows for), int8x2 (each operand in two int8 pieces, three "
                   "products each: operands rounded 254 times finer than int8's, for more cycles) or fp32 on the "
                   "vector lanes "
                   "(ONNX's semantics). Default: int8 where the model's projections are quantized, else fp32.")
@click.option("--quantize", type=click.Choice(QUANTIZE_MODES), default=None,
              help="Quantize float MatMul and Gemm weights so they run on the arrays (activations: int8 per token, "
                   "absmax): w8 per output channel, w4 per block of "
                   f"{QUANTIZE_BLOCK} rows, w2 BitNet's absmean ternary. An approximation the program records "
                   "and --check allows for.")
@click.option("--quantize-skip", "quantize_skip", multiple=True, metavar="NODE",
              help="Keep this MatMul or Gemm (by node name) in float under --quantize. Repeatable.")
@click.option("-q", "--quiet", is_flag=True,
              help="No progress bars (shown only when stderr is a terminal), and no line on where the matmuls run.")
def compile_command(model, output, arch, dims, inputs_path, emit, schedule_path, print_after, no_multicast,
                    no_accumulators, no_sparsity, no_fusion, no_prefetch, no_transfers, no_ksplit, no_row_blocks, no_head_groups, no_cache_alias, overlap, objective,
                    attention, quantize, quantize_skip, quiet):
    """Compile MODEL (ONNX) into a D-Legion program for ``dlegion-run``.

    Ends with a line saying how many of the model's matmuls run on the systolic arrays, in which
    mode, and which run in fp32 on the vector unit, and why."""
    if quantize_skip and not quantize:
        raise click.UsageError("--quantize-skip needs --quantize")
    machine = arch_mod.load(arch)
    shapes, data_files = peek(model)
    bound = _bound_dims(model, shapes, inputs_path, _parse_dims(dims))
    _check_outputs(model, data_files, output, emit, schedule_path)
    options = Options(machine, bound, multicast=not no_multicast, accumulators=not no_accumulators,
                      sparsity=not no_sparsity, fusion=not no_fusion, prefetch=not no_prefetch,
                      transfers=not no_transfers, ksplit=not no_ksplit, row_blocks=not no_row_blocks, head_groups=not no_head_groups, cache_alias=not no_cache_alias, overlap=overlap, objective=objective, attention=attention, quantize=quantize,
                      quantize_skip=tuple(quantize_skip),
                      schedules=schedules.read(schedule_path) if schedule_path else schedules.Schedules())
    hook, progress = _print_after(print_after), Progress.for_terminal(quiet)
    program = (_compile_ir(model, options, output, hook, progress) if emit == "ir"
               else _compile_schedules(model, options, output, hook, progress) if emit == "schedule"
               else _compile_program(model, options, output, arch, emit, hook, progress))
    made = (f"{len(options.schedules.chosen)} quantized-matmul schedules" if emit == "schedule"
            else f"{len(program.instrs)} instructions")
    click.echo(printable(f"{output}: {made} for {machine.name}"), err=True)
    if not quiet:
        click.echo(printable(options.census.line()), err=True)


def main() -> None:
    from isa.console import run_script
    from isa.program import ProgramError
    run_script(compile_command, "dlegion-cc", (CompileError, ProgramError, arch_mod.ArchError),
               listed=(CompileError,))
