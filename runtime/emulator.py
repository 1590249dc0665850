"""Running a program: verify, load inputs, time it, and execute it in an order its dependencies
allow: program order, an instruction's tasks at once, when every condition waits for an earlier
instruction (as compiled programs do); else task by task in the timing model's completion order."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cache

import numpy as np
from threadpoolctl import ThreadpoolController

from isa.arch import Arch
from isa.bulk import no_cycle_collection
from isa.expand import in_program_order, opcodes, word_matrix
from isa.instructions import Barrier, Wait
from isa.program import Program, ProgramError, Tensor
from isa.progress import SILENT, Progress
from isa.verify import verify
from runtime import semantics
from runtime.liveness import Liveness, last_uses
from runtime.races import RaceCheck, segment_key
from runtime.races_bulk import AccessLog
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


def run(program: Program, arch: Arch, inputs: dict[str, np.ndarray], races: bool | str = True,
        keep: bool = True, progress: Progress = SILENT) -> RunResult:
    """Emulate ``program`` on ``arch``: its timing, and its functional results computed in an
    order that respects every dependency; ``races`` also checks that every two conflicting
    accesses are ordered (runtime/races.py), which makes the results those of any order the
    machine may take. A run in program order is recorded and checked whole
    (runtime/races_bulk.py); only when that finds a pair unordered, or the run traps, is it run
    again and checked access by access, which names the first race, as ``races="each"`` always
    does. ``keep`` keeps every scratch tensor to the end, for the caller to read
    (runtime/check.py); else each is freed after its last use (dlegion-run, unless --check-all)."""
    # The run makes many small objects and no cycles worth collecting: a collection of the
    # oldest generation walks the whole loaded program each time.
    with no_cycle_collection(), one_blas_thread():
        return _run(program, arch, inputs, races, keep, progress)


@cache
def _pools() -> ThreadpoolController:
    return ThreadpoolController()


def one_blas_thread():
    """The BLAS pools held to one thread while the emulator runs. Its products are a window's
    (a few hundred rows), which more threads barely speed up; and where the machine's other
    cores are busy, the pool's threads spin waiting for each other: a layer's 256 x 128 x 256
    products took 10 ms each instead of 0.2 ms beside one other busy process on two cores."""
    return _pools().limit(limits=1, user_api="blas")


def _run(program: Program, arch: Arch, inputs: dict[str, np.ndarray], races: bool | str, keep: bool,
         progress: Progress) -> RunResult:
    program = verify(program, arch)      # and expanded: one task per Legion of each span
    tasks = program.instrs
    ordered = in_program_order(tasks, arch.legions)
    unchecked = (_repeated_segments(tasks.source, program) if races and ordered
                 else np.zeros(len(tasks.source), np.bool_))
    if races and races != "each" and ordered:
        # Recorded, then proven ordered at once; else run again, checked access by access,
        # which stops at the first race, or raises what this run raised, as it always has.
        try:
            result = _emulate(program, arch, inputs, keep, progress, ordered, AccessLog(program, arch, unchecked),
                              unchecked)
        except Exception:
            result = None
        if result is not None and result.machine.watch.ordered():
            result.machine.watch = None
            return result
        result, progress = None, SILENT      # its memory given back before the run again
    return _emulate(program, arch, inputs, keep, progress, ordered,
                    RaceCheck(program, arch, unchecked) if races else None, unchecked)


def _emulate(program: Program, arch: Arch, inputs: dict[str, np.ndarray], keep: bool, progress: Progress,
             ordered: bool, watch, unchecked: np.ndarray) -> RunResult:
    """One run of the emulator, its accesses told to ``watch`` (kept there, for the caller)."""
    machine = Machine(program, arch)
    bind_inputs(machine, program, inputs)
    machine.watch = watch
    with progress.task("emulating", _executed(program)) as advance, np.errstate(all="ignore"):
        if ordered:
            timeline = simulate(program, arch)
            _by_instruction(machine, program, keep, advance, unchecked)
        else:
            timeline = simulate(program, arch, _by_task(machine, program, keep, advance))
    outputs = {t.io_name: machine.get(t.name) for t in program.outputs()}
    return RunResult(outputs, timeline, arch, program, machine)


def _by_instruction(machine: Machine, program: Program, keep: bool, advance, unchecked: np.ndarray) -> None:
    """Every instruction in program order, all its tasks (one per Legion of its span) at once:
    a program whose conditions all wait for earlier instructions is ordered this way. The race
    check skips the segments ``unchecked`` marks (see :func:`_repeated_segments`)."""
    tasks = program.instrs
    source, first = tasks.source, tasks.first.tolist()
    dead = {} if keep else last_uses(program)
    watch = machine.watch
    skip = unchecked.tolist()
    ran = _Blocks(advance)
    for o, ins in enumerate(source):
        if watch is not None and (o == 0 or isinstance(ins, Barrier)):
            machine.watch = None if skip[o] else watch
        if isinstance(ins, (Wait, Barrier)):
            continue
        span = getattr(ins, "span", None) or 1
        _execute(machine, program, ins, first[o], span, dead.get(o, ()), watch)
        ran.add(span)
    machine.watch = watch
    ran.flush()


def _repeated_segments(source: list, program: Program) -> np.ndarray:
    """Per instruction, whether its segment (from a barrier, or the start, to the next
    barrier) repeats an earlier one in the form the race check depends on
    (races.segment_key): its verdict is that one's, so it is not checked again."""
    out = np.zeros(len(source), np.bool_)
    starts = [0] + [o for o in np.flatnonzero(program.instrs.barrier).tolist() if o > 0]
    bounds = list(zip(starts, starts[1:] + [len(source)]))
    # Equal keys have equal lengths: a segment whose length no other has repeats none, and
    # needs no key (a single layer's segments all differ so).
    lengths = Counter(hi - lo for lo, hi in bounds)
    ids = program.instrs.alike().ids
    checked = set()
    for lo, hi in bounds:
        if lengths[hi - lo] == 1:
            continue
        seen = len(checked)
        checked.add(segment_key(source[lo:hi], program.tensors, ids[lo:hi]))   # one hash of the key
        out[lo:hi] = len(checked) == seen
    return out


def _by_task(machine: Machine, program: Program, keep: bool, advance):
    """``execute(k)`` for the timing model to call on each task in completion order (a program
    with a condition on a later instruction)."""
    live = None if keep else Liveness(program)
    ran = _Blocks(advance)

    def execute(k: int) -> None:
        _execute(machine, program, program.instrs[k], k, 1, live.ran(k) if live is not None else (),
                 machine.watch)
        ran.add(1)
    return execute


class _Blocks:
    """Tasks run, told to ``advance`` once per PROGRESS_BLOCK of them (and the rest at ``flush``)."""

    def __init__(self, advance):
        self.advance, self.count = advance, 0

    def add(self, n: int) -> None:
        self.count += n
        if self.count >= PROGRESS_BLOCK:
            self.flush()

    def flush(self) -> None:
        self.advance(self.count)
        self.count = 0


def _execute(machine: Machine, program: Program, ins, k: int, span: int, dead, watch) -> None:
    """Run tasks k..k+span-1 (``ins``), then free the tensors they were the last use of (and
    their race ledgers in ``watch``)."""
    if machine.watch is not None:
        machine.watch.start(k, span)
    try:
        semantics.execute_unguarded(machine, ins)
    except Trap as e:
        raise Trap(f"{program.where(k)}: {ins.MNEMONIC}: {e}") from None
    for n in dead:
        machine.free(n)
        if watch is not None:
            watch.forget(n)


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
    instruction of an expansion, whose tasks are made only when read; from its words, when it
    was read from a file)."""
    tasks = program.instrs
    if tasks.words is not None:
        op = opcodes(word_matrix(tasks.words, len(tasks.source)))
        runs = (op != Wait.OPCODE) & (op != Barrier.OPCODE)
    else:
        runs = np.array([not isinstance(i, (Wait, Barrier)) for i in tasks.source], dtype=bool)
    return int(np.count_nonzero(runs[tasks.origin]))


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
