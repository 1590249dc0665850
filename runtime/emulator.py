"""Running a program: verify, load inputs, execute in the timing model's completion order."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from isa.arch import Arch
from isa.bulk import no_cycle_collection
from isa.instructions import Barrier, Wait
from isa.program import Program, ProgramError, Tensor
from isa.progress import SILENT, Progress
from isa.verify import verify
from runtime import semantics
from runtime.liveness import Liveness
from runtime.races import RaceCheck
from runtime.state import Machine, Trap, host_array
from runtime.timing import Timeline, simulate


@dataclass
class RunResult:
    outputs: dict[str, np.ndarray]
    timeline: Timeline
    arch: Arch
    program: Program
    machine: Machine | None   # the final state: DRAM tensors, scratchpads (None: timed only)


# Tasks between two progress updates: often enough to watch, rare enough to cost nothing.
PROGRESS_BLOCK = 1024


def run(program: Program, arch: Arch, inputs: dict[str, np.ndarray], races: bool = True,
        keep: bool = True, progress: Progress = SILENT) -> RunResult:
    """Emulate ``program`` on ``arch``: functional results and timing from one simulation;
    ``races`` also checks that every two conflicting accesses are ordered (runtime/races.py);
    ``keep`` keeps every scratch tensor to the end, for the caller to read (runtime/check.py);
    else each is freed after its last use (dlegion-run, unless --check-all)."""
    with no_cycle_collection():
        program = verify(program, arch)      # and expanded: one task per Legion of each span
    machine = Machine(program, arch)
    bind_inputs(machine, program, inputs)
    if races:
        machine.watch = RaceCheck(program, arch)
    live = None if keep else Liveness(program)

    def execute(i: int) -> None:
        if machine.watch is not None:
            machine.watch.now = i
        try:
            semantics.execute_unguarded(machine, program.instrs[i])
        except Trap as e:
            raise Trap(f"{program.where(i)}: {program.instrs[i].MNEMONIC}: {e}") from None
        for n in live.ran(i) if live is not None else ():
            machine.free(n)
            if machine.watch is not None:
                machine.watch.forget(n)

    with progress.task("emulating", _executed(program)) as advance, np.errstate(all="ignore"):
        timeline = simulate(program, arch, _every(PROGRESS_BLOCK, execute, advance))
    outputs = {t.io_name: machine.get(t.name) for t in program.outputs()}
    return RunResult(outputs, timeline, arch, program, machine)


def time_only(program: Program, arch: Arch, progress: Progress = SILENT) -> RunResult:
    """The timing model alone: the same cycles as :func:`run`, without computing any value
    (instructions' times do not depend on the data they move)."""
    with no_cycle_collection():
        program = verify(program, arch)
    with progress.task("timing", _executed(program)) as advance, no_cycle_collection():
        timeline = simulate(program, arch, progress=advance)
    return RunResult({}, timeline, arch, program, None)


def _executed(program: Program) -> int:
    """Tasks the timing model hands to ``execute``: all but waits and barriers (counted per
    instruction of an expansion, whose tasks are made only when read)."""
    tasks = program.instrs
    runs = np.array([not isinstance(i, (Wait, Barrier)) for i in tasks.source], dtype=bool)
    return int(np.count_nonzero(runs[tasks.origin]))


def _every(block: int, execute, advance):
    """``execute`` that also reports progress once per ``block`` tasks run."""
    count = 0

    def step(i: int) -> None:
        nonlocal count
        execute(i)
        count += 1
        if count == block:
            advance(count)
            count = 0
    return step


def bind_inputs(machine: Machine, program: Program, inputs: dict[str, np.ndarray]) -> None:
    wanted = {t.io_name for t in program.inputs()}
    missing = sorted(wanted - set(inputs))
    if missing:
        raise ProgramError(f"{program.source}: no value for input(s) {', '.join(missing)} "
                           f"(given: {', '.join(sorted(inputs)) or 'none'})")
    for t in program.inputs():
        machine.set_input(t.io_name, inputs[t.io_name])


def random_inputs(program: Program, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic inputs valid for each input tensor (integers inside the declared range)."""
    rng = np.random.default_rng(seed)
    return {t.io_name: _random_value(t, rng, program.source) for t in program.inputs()}


_INT_DEFAULT = {"i8": (-128, 128), "u8": (0, 256), "i32": (-1000, 1000), "i64": (-1000, 1000)}


def _random_value(t: Tensor, rng: np.random.Generator, source: str) -> np.ndarray:
    from isa.program import STORAGE
    if t.dtype == "f32":
        return host_array(source, t, lambda: rng.standard_normal(t.shape).astype(np.float32))
    if t.dtype not in _INT_DEFAULT:
        raise ProgramError(f"input {t.io_name!r} has dtype {t.dtype}, which takes no random values")
    lo, hi = t.range or _INT_DEFAULT[t.dtype]
    return host_array(source, t, lambda: rng.integers(lo, hi, size=t.shape).astype(STORAGE[t.dtype]))
