"""How fast the functional emulator runs one large ``mm``, against numpy's own fp32 matmul.

Run: ``python bench/bench_emulator.py [--arch dlegion-8x8]``. Each block fills the act, wgt and
acc scratchpads of one Legion as far as the shape allows; the target is a ratio of at most 2.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from isa import arch as arch_mod
from isa.arch import MODE_BITS
from isa.fields import View
from isa.instructions import MatMul
from isa.program import Program, pack
from runtime.semantics import execute
from runtime.state import Machine

# (mode, M, K, N): w8 stores a byte per weight, so its N is halved to fit the weight scratchpad.
BLOCKS = [("w2", 128, 2048, 256), ("w4", 128, 2048, 256), ("w8", 128, 2048, 128)]
REPEATS = 5


def median_seconds(fn) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def packed_weights(rng, mode: str, K: int, N: int) -> np.ndarray:
    half = 1 << (MODE_BITS[mode] - 1)
    w = rng.integers(-half, half, size=(K, N))
    if mode == "w8":
        return w.astype(np.int8).view(np.uint8)
    return pack(w, mode).reshape(K, -1)


def machine_with_block(arch, mode: str, M: int, K: int, N: int) -> tuple[Machine, MatMul]:
    rng = np.random.default_rng(0)
    m = Machine(Program(arch=arch.name), arch)
    w = packed_weights(rng, mode, K, N)
    m.write(0, View("act", 0, K), rng.integers(-128, 128, size=(M, K)).astype(np.int8))
    m.write(0, View("wgt", 0, w.shape[1]), w)
    instr = MatMul(0, View("acc", 0, N), View("act", 0, K), View("wgt", 0, w.shape[1]),
                   M, K, N, mode, "k", "set", None)
    return m, instr


def bench(arch, mode: str, M: int, K: int, N: int) -> float:
    m, instr = machine_with_block(arch, mode, M, K, N)
    emulated = median_seconds(lambda: execute(m, instr))
    a = np.ones((M, K), np.float32)
    w = np.ones((K, N), np.float32)
    reference = median_seconds(lambda: np.matmul(a, w))
    ratio = emulated / reference
    print(f"{mode}  M={M} K={K} N={N}:  mm {emulated * 1e3:7.2f} ms   "
          f"np.matmul fp32 {reference * 1e3:7.2f} ms   ratio {ratio:4.2f}")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="dlegion-8x8")
    arch = arch_mod.load(parser.parse_args().arch)
    worst = max(bench(arch, *block) for block in BLOCKS)
    print(f"worst ratio {worst:.2f} (target <= 2)")


if __name__ == "__main__":
    main()
