"""A program as the Legions run it: one task per (instruction, Legion of its span).

An instruction with ``span=S`` runs on Legions L..L+S-1; rank r of the span moves its DMA's DRAM
offset by ``r * lstride`` and its multicast destinations by r. A relative condition (``dma``,
``L0.mat~1``) becomes the absolute count it stands for at that point of the program. The
verifier, the emulator and the timing model all work on the expanded program, so they handle
single-Legion instructions with absolute conditions only; ``origin`` maps each task back to the
instruction (and so the text line) it came from.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from isa.fields import QUEUES, Cond, DramRef
from isa.instructions import Barrier, DmaLoad, DmaStore, Gather, Instr, Wait
from isa.program import Program

DRAM_FIELD = {DmaLoad: "src", DmaStore: "dst", Gather: "table"}


@dataclass
class Expanded:
    program: Program          # single-Legion instructions, absolute conditions
    origin: list[int]         # task index -> instruction index in the source program


def is_flat(program: Program) -> bool:
    """True when no instruction spans Legions or waits relatively: expansion changes nothing."""
    for i in program.instrs:
        if getattr(i, "span", None) is not None:
            return False
        cond = i.condition()
        if cond is not None and (cond.legion is None or cond.count is None):
            return False
    return True


def expand(program: Program, legions: int) -> Expanded:
    """One task per (instruction, Legion); ``legions`` is the machine's (a barrier counts in each)."""
    if program.origin is not None:
        return Expanded(program, program.origin)
    if is_flat(program):
        return Expanded(program, list(range(len(program.instrs))))
    issued: Counter = Counter()
    tasks, origin, first = [], [], []
    for k, ins in enumerate(program.instrs):
        first.append(len(tasks))
        new = _tasks(ins, issued)
        _count(ins, new, issued, legions)
        tasks += new
        origin += [k] * len(new)
    flat = replace(program, instrs=tasks, origin=origin,
                   regions=[(first[at] if at < len(first) else len(tasks), name) for at, name in program.regions])
    return Expanded(flat, origin)


def _tasks(ins: Instr, issued: Counter) -> list[Instr]:
    if isinstance(ins, Barrier):
        return [ins]
    span = ins.span or 1
    return [_task(ins, ins.legion + r, r, issued) for r in range(span)]


def _task(ins: Instr, legion: int, rank: int, issued: Counter) -> Instr:
    changes: dict = {"legion": legion}
    if ins.span is not None:
        changes["span"] = None
    cond = ins.condition()
    if cond is not None and (cond.legion is None or cond.count is None):
        changes["until" if isinstance(ins, Wait) else "wait"] = absolute(cond, legion, issued)
    name = DRAM_FIELD.get(type(ins))
    if name is not None:
        _shift_dram(ins, name, rank, changes)
    if isinstance(ins, DmaLoad) and rank:
        changes["dests"] = frozenset(d + rank for d in ins.dests)
    return _replaced(ins, changes)


def _replaced(ins: Instr, changes: dict) -> Instr:
    """``dataclasses.replace`` without running ``__init__`` again (instructions have no
    ``__post_init__``): a large program expands into hundreds of thousands of tasks."""
    task = object.__new__(type(ins))
    task.__dict__.update(ins.__dict__)
    task.__dict__.update(changes)
    return task


def _shift_dram(ins: Instr, name: str, rank: int, changes: dict) -> None:
    if ins.lstride is None:
        return
    changes["lstride"] = None
    ref = getattr(ins, name)
    changes[name] = DramRef(ref.tensor, ref.offset + rank * ins.lstride, ref.rs)


def absolute(cond: Cond, legion: int, issued: Counter) -> Cond:
    """``cond`` as seen by a task on ``legion``, given the tasks issued to each queue before it."""
    target = legion if cond.legion is None else cond.legion
    if cond.count is not None:
        return Cond(target, cond.queue, cond.count)
    return Cond(target, cond.queue, max(0, issued[(target, cond.queue)] - cond.back))


def _count(ins: Instr, tasks: list[Instr], issued: Counter, legions: int) -> None:
    """Count the tasks after all of them took their conditions: ranks of one span don't wait
    on each other."""
    if isinstance(ins, Barrier):
        for legion in range(legions):
            for q in QUEUES:
                issued[(legion, q)] += 1
        return
    for t in tasks:
        issued[(t.legion, t.queue())] += 1
