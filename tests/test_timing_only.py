"""``dlegion-run --timing-only``: the timing model without values, the same cycles as a full run;
progress on stderr only for a terminal."""
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from rich.console import Console

from dlegion_cc.pipeline import Options, compile_model
from isa import arch
from isa.asm import load, save
from isa.instructions import Barrier, Wait
from isa.progress import Progress
from runtime.cli import run_command
from isa.verify import verify
from runtime.emulator import _executed, random_inputs, run, time_only

ROOT = Path(__file__).parent.parent
TINY = arch.load("dlegion-tiny")


def dlegion_run(*args):
    code = "import sys; from runtime.cli import main; sys.argv[0] = 'dlegion-run'; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """bitnet_tiny_relu2, and the block-pruned model whose masks the timing model reads."""
    out = {}
    for name in ("bitnet_tiny_relu2", "bitnet_tiny_sparse"):
        _, program = compile_model(ROOT / "models" / f"{name}.onnx", Options(TINY, {}), "prog.s.data")
        path = tmp_path_factory.mktemp(name) / "prog.s"
        save(program, path, program.data)
        out[name] = (program, path)
    return out


@pytest.mark.parametrize("name", ["bitnet_tiny_relu2", "bitnet_tiny_sparse"])
def test_timing_only_gives_the_cycles_of_a_full_run(compiled, name):
    program, _ = compiled[name]
    full = run(program, TINY, random_inputs(program, 0))
    timed = time_only(program, TINY)
    assert timed.timeline.cycles == full.timeline.cycles > 0
    np.testing.assert_array_equal(timed.timeline.done, full.timeline.done)
    assert timed.machine is None and timed.outputs == {}


def test_timing_only_command_reports_the_same_cycles(compiled, tmp_path):
    _, path = compiled["bitnet_tiny_sparse"]
    full, timed = tmp_path / "full.json", tmp_path / "timed.json"
    assert dlegion_run(path, "--json", full).returncode == 0
    r = dlegion_run(path, "--timing-only", "--json", timed, "--report")
    assert r.returncode == 0, r.stderr
    import json
    a, b = json.loads(full.read_text()), json.loads(timed.read_text())
    assert a["cycles"] == b["cycles"] and a["sparsity"] == b["sparsity"] and a["energy_joules"] == b["energy_joules"]
    assert f"{a['cycles']:,} cycles" in r.stdout


@pytest.mark.parametrize("option", [["--out", "o.npz"], ["--check", "m.onnx"], ["--inputs", "in.npz"],
                                    ["--no-race-check"]])
def test_timing_only_refuses_options_about_values(compiled, tmp_path, option):
    _, path = compiled["bitnet_tiny_relu2"]
    r = dlegion_run(path, "--timing-only", *option)
    assert r.returncode == 2
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(f"dlegion-run: error: {option[0]} has no effect with --timing-only")
    assert not (tmp_path / "o.npz").exists()


def test_progress_is_drawn_on_a_terminal(compiled):
    program, _ = compiled["bitnet_tiny_relu2"]
    screen = io.StringIO()
    run(program, TINY, random_inputs(program, 0), progress=Progress(True, Console(file=screen, force_terminal=True)))
    assert "emulating" in screen.getvalue()
    screen = io.StringIO()
    time_only(program, TINY, progress=Progress(True, Console(file=screen, force_terminal=True)))
    assert "timing" in screen.getvalue()


def test_progress_counts_the_tasks_run_from_the_words_as_from_the_instructions(compiled):
    # Read from its file, the program's waits and barriers are told apart by their words.
    _, path = compiled["bitnet_tiny_relu2"]
    program = verify(load(path), TINY)
    assert program.instrs.words is not None
    runs = [not isinstance(i, (Wait, Barrier)) for i in program.instrs.source]
    assert _executed(program) == sum(runs[o] for o in program.instrs.origin.tolist()) < len(program.instrs)


@pytest.mark.parametrize("flags", [[], ["-q"], ["--timing-only"], ["--timing-only", "--quiet"]])
def test_no_progress_without_a_terminal_or_with_quiet(compiled, flags):
    _, path = compiled["bitnet_tiny_relu2"]
    r = CliRunner().invoke(run_command, [str(path), *flags])
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
