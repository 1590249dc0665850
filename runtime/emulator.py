"""Running a program: verify, load inputs, execute in the timing model's completion order."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from isa.arch import Arch
from isa.program import Program, ProgramError, Tensor
from isa.expand import expand
from isa.verify import verify
from runtime import semantics
from runtime.races import RaceCheck
from runtime.state import Machine, Trap, host_array
from runtime.timing import Timeline, simulate


@dataclass
class RunResult:
    outputs: dict[str, np.ndarray]
    timeline: Timeline
    arch: Arch
    program: Program
    machine: Machine          # the final state: DRAM tensors, scratchpads


def run(program: Program, arch: Arch, inputs: dict[str, np.ndarray], races: bool = True) -> RunResult:
    """Emulate ``program`` on ``arch``: functional results and timing from one simulation;
    ``races`` also checks that every two conflicting accesses are ordered (runtime/races.py)."""
    verify(program, arch)
    program = expand(program, arch.legions).program      # one task per Legion of each span
    machine = Machine(program, arch)
    bind_inputs(machine, program, inputs)
    if races:
        machine.watch = RaceCheck(program, arch)

    def execute(i: int) -> None:
        if machine.watch is not None:
            machine.watch.now = i
        try:
            semantics.execute(machine, program.instrs[i])
        except Trap as e:
            raise Trap(f"{program.where(i)}: {program.instrs[i].MNEMONIC}: {e}") from None

    timeline = simulate(program, arch, execute)
    outputs = {t.io_name: machine.get(t.name) for t in program.outputs()}
    return RunResult(outputs, timeline, arch, program, machine)


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
