"""Assembler throughput: parse + encode a program of random valid instructions.

Run as ``python bench/bench_asm.py [N] [RUNS]``. Prints instructions per second (median of RUNS
runs, five by default), the parse/encode split, and the ratio to the target of 50,000
instructions per second. About half the optional fields are present (``span=``, ``lstride=``,
``wait=``), and conditions are absolute or relative (``wait=dma~1``), as in compiled programs.
"""
from __future__ import annotations

import random
import statistics
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from isa import asm, encoding  # noqa: E402
from isa.encoding import kind_entry  # noqa: E402
from isa.fields import QUEUES, Cond, DramRef, View  # noqa: E402
from isa.instructions import INSTRUCTIONS  # noqa: E402
from isa.program import Program, Tensor  # noqa: E402

TARGET = 50_000
RUNS = 5


def _u(r: random.Random, bits: int) -> int:
    return r.randrange(1 << min(bits, 20))


def _view(r, spaces, cs=None):
    return View(r.choice(spaces), _u(r, 24), _u(r, 16), _u(r, 16) if cs is None else cs)


def _cond(r: random.Random, kind) -> Cond:
    """Absolute or relative, on a named Legion or the waiting one's own."""
    legion = None if r.random() < 0.5 else _u(r, 3)
    if r.random() < 0.5:
        return Cond(legion, r.choice(QUEUES), _u(r, kind.count_bits))
    return Cond(legion, r.choice(QUEUES), None, r.choice((0, 0, 1, 2, _u(r, kind.count_bits))))


def _imm(r):
    return struct.unpack("<f", struct.pack("<f", r.uniform(-1e6, 1e6)))[0]


# A random valid value of a field, by kind class name: (random, kind, number of tensors).
VALUES = {
    "Legion": lambda r, k, n: _u(r, 3),
    "LegionSet": lambda r, k, n: frozenset(r.sample(range(64), r.randint(1, 8))),
    "Until": lambda r, k, n: _cond(r, k),
    "After": lambda r, k, n: None if r.random() < 0.5 else _cond(r, k),   # before its base, Until
    "UInt": lambda r, k, n: _u(r, k.bits),
    "OptUInt": lambda r, k, n: None if r.random() < 0.5 else _u(r, k.value_bits),  # before UInt
    "Keyword": lambda r, k, n: r.choice(k.choices),
    "RowView": lambda r, k, n: _view(r, (k.space,), 1),
    "ViewKind": lambda r, k, n: _view(r, k.spaces),
    "OptAddr": lambda r, k, n: None if r.random() < 0.5 else _u(r, 24),
    "Dram": lambda r, k, n: DramRef(r.randrange(n), _u(r, 32), _u(r, 24)),
    "OptTensor": lambda r, k, n: None if r.random() < 0.5 else r.randrange(n),
    "ViewOrImm": lambda r, k, n: _imm(r) if r.random() < 0.5 else _view(r, k.view.spaces),
}


def value(r: random.Random, kind, n_tensors: int):
    make = kind_entry(VALUES, kind)
    if make is None:
        raise KeyError(type(kind).__name__)
    return make(r, kind, n_tensors)


def random_program(count: int, seed: int = 0) -> Program:
    r = random.Random(seed)
    tensors = [Tensor(f"t{i}", "f32", (64, 64), "scratch") for i in range(16)]
    instrs = []
    for _ in range(count):
        cls = r.choice(INSTRUCTIONS)
        instrs.append(cls(*(value(r, f.metadata["kind"], len(tensors)) for f in cls.fields())))
    return Program(arch="dlegion-tiny", tensors=tensors, instrs=instrs)


def time_once(text: str) -> tuple[float, float]:
    """Seconds to parse ``text``, and to encode the parsed program."""
    start = time.perf_counter()
    p = asm.parse(text, "bench.s")
    parsed = time.perf_counter()
    encoding.encode_program(p)
    return parsed - start, time.perf_counter() - parsed


def main(argv: list[str]) -> int:
    count = int(argv[0]) if argv else 50_000
    runs = int(argv[1]) if len(argv) > 1 else RUNS
    text = asm.format_program(random_program(count))
    asm.parse(".arch x\n")                      # build the parser outside the timing
    times = [time_once(text) for _ in range(runs)]
    seconds = statistics.median(p + e for p, e in times)
    parse, encode = (statistics.median(t[k] for t in times) for k in (0, 1))
    rate = count / seconds
    print(f"parse+encode {count} instructions: {seconds:.3f} s (median of {runs}; parse {parse:.3f} s, "
          f"encode {encode:.3f} s), {rate:,.0f} instructions/s, {rate / TARGET:.2f}x the {TARGET:,}/s target")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
