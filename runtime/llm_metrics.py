"""Serving an LLM in MLPerf Inference's terms, from the timing model alone (no values computed,
so any size the compiler takes): time to first token (the prefill's latency), time per output
token (the decode steps' mean), tokens per second, joules per token and average watts (the
energy model of runtime/report.py).

A decode step's program depends on its past length, and compiling one for every position of a
long generation at full model size takes minutes each: the decode steps are timed at sampled
past lengths (every ``every`` positions, and the last) and the others interpolated linearly
between them; the output says which were measured."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from runtime.generate import Build, steps


@dataclass(frozen=True)
class Timed:
    """One program timed: its shape, cycles, seconds and joules on the machine."""
    seq: int
    past: int
    cycles: int
    seconds: float
    joules: float
    approximations: tuple = ()      # the program's (int8 attention, ...)


def time_step(build: Build, seq: int, past: int, keep: bool = True) -> Timed:
    """The program of a step, timed; without ``keep`` its files are removed after."""
    from isa.bulk import no_cycle_collection
    from runtime.emulator import time_only
    from runtime.report import summarize
    program = build.program(seq, past)
    result = time_only(program, build.arch, build.progress)
    with no_cycle_collection():
        n = summarize(result)
    if not keep:
        build.discard(seq, past)
    return Timed(seq, past, n["cycles"], n["time_s"], n["energy_joules"], tuple(program.approximations))


def sampled_pasts(prompt: int, new_tokens: int, every: int) -> list[int]:
    """The decode steps' past lengths that are timed: every ``every``-th from the first, and the
    last (1: all of them)."""
    pasts = [p for _, p in steps(prompt, new_tokens)[1:]]
    if not pasts:
        return []
    return sorted(set(pasts[::every]) | {pasts[-1]})


def interpolated(samples: list[Timed], pasts: list[int], key: str) -> np.ndarray:
    """``key`` (seconds or joules) of a decode step at each of ``pasts``, linear between samples."""
    xs = [t.past for t in samples]
    return np.interp(pasts, xs, [getattr(t, key) for t in samples])


def serve(build: Build, prompt: int, new_tokens: int, every: int = 1, keep: bool = True) -> dict:
    """The MLPerf-style numbers of generating ``new_tokens`` after a ``prompt``-token prompt, batch
    1, on ``build``'s machine; without ``keep`` each program is removed once timed."""
    prefill = time_step(build, prompt, 0, keep)
    samples = [time_step(build, 1, p, keep) for p in sampled_pasts(prompt, new_tokens, every)]
    pasts = [p for _, p in steps(prompt, new_tokens)[1:]]
    decode_s = interpolated(samples, pasts, "seconds") if samples else np.zeros(0)
    decode_j = interpolated(samples, pasts, "joules") if samples else np.zeros(0)
    total_s = prefill.seconds + float(decode_s.sum())
    joules = prefill.joules + float(decode_j.sum())
    return {
        "arch": build.arch.name, "prompt": prompt, "generate": new_tokens,
        "ttft_s": prefill.seconds,
        "tpot_s": float(decode_s.mean()) if pasts else None,
        "tokens_per_s": new_tokens / total_s,
        "joules_per_token": joules / new_tokens,
        "average_watts": joules / total_s,
        "total_s": total_s, "joules": joules,
        "decode_steps": len(pasts), "decode_steps_timed": len(samples), "sampled_every": every,
        "prefill": asdict(prefill), "decode_samples": [asdict(t) for t in samples],
    }
