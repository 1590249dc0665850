"""``dlegion-generate``: greedy token generation with a key/value cache on the emulator."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import click
import numpy as np

from isa import arch as arch_mod
from isa.console import check_outputs, no_empty_path, table_console, version_option
from isa.files import atomic_write
from isa.progress import Progress
from runtime.check import REFERENCES, REL_L2_TOLERANCE
from runtime.generate import (Build, GenerateError, Step, cache_graph, check_prompt, compile_all, emulate,
                              onnxruntime_loop)

EXIT_MISMATCH = 1
CONSOLE_WIDTH = 140


def _prompt(ids: str | None, length: int | None, seed: int, vocab: int | None) -> list[int]:
    """The prompt's token ids: given, or ``length`` seeded random ids in the vocabulary."""
    if (ids is None) == (length is None):
        raise click.UsageError("give the prompt as --prompt-ids A,B,... or --prompt-len N (one of them)")
    if ids is not None:
        try:
            return [int(t) for t in ids.split(",")]
        except ValueError:
            raise click.BadParameter(f"{ids!r} is not token ids separated by commas",
                                     param_hint="--prompt-ids") from None
    if vocab is None:
        raise GenerateError("the model's logits have no fixed vocabulary size: give --prompt-ids")
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


def _finite(ctx, param, value: float) -> float:
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number", ctx, param)
    return value


def _print_steps(steps, console, numbers=None) -> None:
    from rich.table import Table
    t = Table(title="steps (step 0: the prefill)", title_justify="left")
    for name in ("step", "sequence", "past", "token", "cycles", "time (us)"):
        t.add_column(name, justify="right")
    for k, s in zip(numbers or range(len(steps)), steps):
        token = "-" if s.token is None else str(s.token)
        t.add_row(str(k), str(s.seq), str(s.past), token, f"{s.cycles:,}", f"{s.seconds * 1e6:,.3f}")
    console.print(t)


def _summary(build: Build, steps, build_dir: str) -> str:
    decode = [s.cycles for s in steps[1:]]
    mean = f"decode steps {sum(decode) / len(decode):,.0f} cycles on average; " if decode else ""
    made = len(build.compiled)
    return (f"{build.arch.name}: prefill {steps[0].cycles:,} cycles; {mean}{sum(s.cycles for s in steps):,} cycles "
            f"in all ({sum(s.seconds for s in steps) * 1e3:.4g} ms); {made} of {len(steps)} programs compiled "
            f"into {build_dir}, {len(steps) - made} found there")


class Judge:
    """--check's verdict of each step: runtime.check.judge on the step's own inputs (the
    emulator's cache), at the tolerance the program's approximations call for."""

    def __init__(self, model: str, reference: str | None, tolerance: float, tolerance_given: bool):
        self.model, self.reference, self.tolerance, self.given = model, reference, tolerance, tolerance_given
        self.verdicts = []

    def __call__(self, inputs, result) -> None:
        from runtime.check import approximation_tolerance, fp64_evaluated, judge
        approx = result.program.approximations
        tol = self.tolerance
        if approx and not self.given:
            tol = approximation_tolerance(approx, tol, fp64_evaluated(self.model, self.reference))
        try:
            verdict = judge(self.model, inputs, result.outputs, self.reference, tol, approx)
        except ValueError as e:     # the model and the program disagree on an output
            raise GenerateError(f"{self.model}: {e}") from None
        except Exception as e:      # onnxruntime raises its own exception types
            raise GenerateError(f"{self.model}: onnxruntime failed: {str(e).splitlines()[0]}") from None
        self.verdicts.append((verdict, tol))


def _check_rows(judged: Judge, steps, reference_tokens: list[int]) -> list[dict]:
    rows = []
    for k, (s, (verdict, tol)) in enumerate(zip(steps, judged.verdicts)):
        logits = next(r for r in verdict.rows if r.name == "logits")
        rows.append({"step": k, "token": s.token, "onnxruntime_token": reference_tokens[k],
                     "logits_rel_l2": logits.rel_l2 if math.isfinite(logits.rel_l2) else None,
                     "tolerance": tol, "outputs_ok": verdict.ok,
                     "ok": verdict.ok and s.token == reference_tokens[k]})
    return rows


def _print_check(rows: list[dict], console) -> None:
    from rich.table import Table
    t = Table(title="--check: each step against onnxruntime on its inputs; tokens against onnxruntime's own loop",
              title_justify="left")
    for name in ("step", "token", "onnxruntime", "logits rel L2", "tolerance", "outputs", "verdict"):
        t.add_column(name, justify="right")
    for r in rows:
        distance = "inf" if r["logits_rel_l2"] is None else f"{r['logits_rel_l2']:.2e}"
        t.add_row(str(r["step"]), str(r["token"]), str(r["onnxruntime_token"]), distance,
                  f"{r['tolerance']:g}", "ok" if r["outputs_ok"] else "MISMATCH", "ok" if r["ok"] else "MISMATCH")
    console.print(t)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@version_option()
@click.pass_context
@click.argument("model", type=click.Path(dir_okay=False), callback=no_empty_path)
@click.option("--arch", default="dlegion-8x8", show_default=True, metavar="NAME|FILE.toml", callback=no_empty_path,
              help="Machine to compile for and run on. Presets: " + ", ".join(arch_mod.preset_names()))
@click.option("--prompt-ids", metavar="A,B,...", help="The prompt's token ids.")
@click.option("--prompt-len", type=click.IntRange(min=1), metavar="N", help="A prompt of N seeded random token ids.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of --prompt-len's ids.")
@click.option("-n", "--tokens", "new_tokens", type=click.IntRange(min=1), default=16, show_default=True,
              help="Tokens to generate (the prefill gives the first, a decode step each other).")
@click.option("--build-dir", type=click.Path(file_okay=False), default=".dlegion-build", show_default=True,
              help="Folder of the compiled programs, one per step shape, reused by later runs.")
@click.option("--attention", type=click.Choice(("int8", "fp32")), default=None,
              help="Attention's float products, as dlegion-cc --attention (default: the compiler's).")
@click.option("--check", "check", is_flag=True,
              help="Run the same loop in onnxruntime: its tokens must be the same, and every step's outputs "
                   "within the tolerance of onnxruntime's on the step's inputs (dlegion-run --check's verdict); "
                   "exit 1 otherwise.")
@click.option("--reference", type=click.Choice(REFERENCES), default=None, help="With --check: as dlegion-run's.")
@click.option("--tolerance", type=click.FloatRange(min=0), default=REL_L2_TOLERANCE, show_default=True,
              callback=_finite, help="With --check: as dlegion-run's (default: loosened for the program's "
                                     "approximations, and said).")
@click.option("--race-check/--no-race-check", "races", default=True, show_default=True,
              help="Check every step's program for unordered conflicting accesses, as dlegion-run.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), metavar="FILE", callback=no_empty_path,
              help="Write the prompt, tokens, steps' cycles and the check's rows as JSON.")
@click.option("--timing-only", is_flag=True,
              help="Time the prefill and the decode steps on the timing model alone, computing no value (for "
                   "sizes the emulator cannot hold): no token can be chosen then, so none is printed, only the "
                   "prompt's length counts, and each step is given only its cache's shapes. Prints time to first "
                   "token, time per output token, tokens/s and J/token, as bench/bench_llm.py.")
@click.option("--every", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
              help="With --timing-only: time every N-th decode step and the last, the others interpolated "
                   "(each past length is its own program to compile).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars on stderr.")
def generate_command(ctx, model, arch, prompt_ids, prompt_len, seed, new_tokens, build_dir, attention, check,
                     reference, tolerance, races, json_path, timing_only, every, quiet):
    """Generate tokens greedily from MODEL (an ONNX decode graph with a key/value cache, its
    sequence and past dims symbolic): a prefill of the prompt, then a decode step per token, each
    a program compiled for its past length (kept in --build-dir) and run on the emulator.

    Exit status: 0 when all is well, 1 when --check finds a mismatch, 2 for bad input.
    """
    from click.core import ParameterSource
    for name in ("reference", "tolerance"):
        if not check and ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE:
            raise click.UsageError(f"--{name} needs --check", ctx)
    if timing_only and check:
        raise click.UsageError("--check needs values: it cannot go with --timing-only", ctx)
    if not timing_only and ctx.get_parameter_source("every") is ParameterSource.COMMANDLINE:
        raise click.UsageError("--every needs --timing-only", ctx)
    check_outputs({"--json": json_path}, {"the model": model})
    graph = cache_graph(model)
    prompt = _prompt(prompt_ids, prompt_len, seed, graph.vocab) if not (timing_only and prompt_len) else [0] * prompt_len
    check_prompt(graph, prompt, new_tokens)
    progress = Progress.for_terminal(quiet)
    build = Build(graph, arch_mod.load(arch), arch, Path(build_dir), attention, progress)
    if timing_only:
        _timing_only(build, model, len(prompt), new_tokens, every, json_path)
        return
    compile_all(build, len(prompt), new_tokens)
    judged = Judge(model, reference, tolerance, ctx.get_parameter_source("tolerance") is ParameterSource.COMMANDLINE)
    steps = emulate(build, prompt, new_tokens, races, judged if check else None)
    console = table_console(CONSOLE_WIDTH)
    console.print(f"prompt ({len(prompt)}): {','.join(map(str, prompt))}", highlight=False)
    console.print(f"generated ({new_tokens}): {','.join(str(s.token) for s in steps)}", highlight=False)
    _print_steps(steps, console)
    console.print(_summary(build, steps, build_dir), highlight=False)
    rows = _checked(graph, prompt, new_tokens, reference, judged, steps, console) if check else None
    record = {"model": model, "arch": build.arch.name, "prompt": prompt, "tokens": [s.token for s in steps],
              "steps": [{"sequence": s.seq, "past": s.past, "token": s.token, "cycles": s.cycles,
                         "seconds": s.seconds} for s in steps], "check": rows}
    if json_path:
        atomic_write(json_path, json.dumps(record, indent=1) + "\n")
    if rows is not None and not all(r["ok"] for r in rows):
        sys.exit(EXIT_MISMATCH)


def _timing_only(build: Build, model: str, prompt: int, new_tokens: int, every: int, json_path) -> None:
    """The loop's steps on the timing model (runtime/llm_metrics.serve): their cycles, and the
    serving numbers. The longest past is compiled first, so a past the model cannot take is
    refused before any work."""
    from runtime.generate import steps
    from runtime.llm_metrics import serve
    build.ensure(*steps(prompt, new_tokens)[-1])
    r = serve(build, prompt, new_tokens, every)
    console = table_console(CONSOLE_WIDTH)
    timed = [r["prefill"], *r["decode_samples"]]
    _print_steps([Step(t["seq"], t["past"], None, t["cycles"], t["seconds"], None) for t in timed], console,
                 [0] + [t["past"] - prompt + 1 for t in timed[1:]])
    console.print(_serving_line(r), highlight=False, soft_wrap=True)
    if json_path:
        atomic_write(json_path, json.dumps({"model": model, "timing_only": True, **r}, indent=1) + "\n")


def _serving_line(r: dict) -> str:
    tpot = "-" if r["tpot_s"] is None else f"{r['tpot_s'] * 1e3:,.4g} ms"
    return (f"{r['arch']}: TTFT {r['ttft_s'] * 1e3:,.4g} ms, TPOT {tpot}, {r['tokens_per_s']:,.1f} tokens/s, "
            f"{r['joules_per_token']:.4g} J/token, {r['average_watts']:.3g} W average (timing model only, no "
            f"values; prompt {r['prompt']}, {r['generate']} tokens, {r['decode_steps_timed']} of "
            f"{r['decode_steps']} decode steps timed)")


def _checked(graph, prompt, new_tokens, reference, judged: Judge, steps, console) -> list[dict]:
    from runtime.check import integer_ops
    fp32 = reference if reference in ("onnxruntime", "exact") else "exact" if integer_ops(graph.path) else "onnxruntime"
    try:
        tokens = onnxruntime_loop(graph, prompt, new_tokens, fp32)
    except Exception as e:  # onnxruntime raises its own exception types
        raise GenerateError(f"{graph.path}: onnxruntime failed: {str(e).splitlines()[0]}") from None
    rows = _check_rows(judged, steps, tokens)
    _print_check(rows, console)
    same = sum(s.token == t for s, t in zip(steps, tokens))
    console.print(f"tokens: {same} of {len(tokens)} the same as onnxruntime's loop "
                  f"({'ok' if all(r['ok'] for r in rows) else 'MISMATCH'})", highlight=False)
    return rows


def main() -> None:
    from isa.console import run_script
    from isa.program import ProgramError
    from runtime.state import Trap
    from runtime.timing import Deadlock
    run_script(generate_command, "dlegion-generate",
               (GenerateError, ProgramError, arch_mod.ArchError, Trap, Deadlock))
