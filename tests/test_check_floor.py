"""The floor under ``--check``'s fp32 spread: onnxruntime's fp32 distance from the float64 yardstick
is one sample, and on an output of few rows it can be small by chance; the spread is at least
FP32_FLOOR times the yardstick's own float32 rounding distance, which still fails a flipped weight."""
import dataclasses
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from isa import arch as arch_mod
from dlegion_cc.pipeline import Options, compile_model
from runtime.check import FP32_FLOOR, FP64_MULTIPLE, flip_one_weight, float32_rounding, fp64_distances, judge
from runtime.emulator import random_inputs, run

ROOT = Path(__file__).parent.parent
ARCH = arch_mod.load("dlegion-8x8")         # dlegion-cc's default machine


def test_the_floor_is_the_yardsticks_own_float32_rounding():
    rng = np.random.default_rng(0)
    f64 = rng.standard_normal((4, 64))
    r = float32_rounding(f64)
    assert 1e-8 < r < 6e-8                  # about 2^-24 / sqrt(3) for values spread over binades
    assert float32_rounding(f64.astype(np.float32).astype(np.float64)) == 0.0
    assert float32_rounding(np.zeros(5)) == 0.0


def _noisy(f64, rel, seed):
    """``f64`` moved by relative L2 ``rel`` in a random direction."""
    d = np.random.default_rng(seed).standard_normal(f64.shape)
    return f64 + d * rel * np.linalg.norm(f64) / np.linalg.norm(d)


def test_a_small_spread_is_raised_to_the_floor_and_no_further():
    """An onnxruntime run that happens to equal the yardstick's rounding (spread r) would fail a
    program 5 r away; the floor passes it, and still fails one at 3 FP32_FLOOR r."""
    f64 = np.random.default_rng(1).standard_normal((1, 256))
    fp32 = f64.astype(np.float32)
    r = float32_rounding(f64)
    near = _noisy(f64, 5 * r, 2)
    f = fp64_distances(near, fp32, f64, f64, 1e-9)
    assert f.reference == pytest.approx(r) and f.ours > FP64_MULTIPLE * f.reference
    assert f.floor == pytest.approx(FP32_FLOOR * r) and f.ok
    far = fp64_distances(_noisy(f64, 1.5 * FP64_MULTIPLE * FP32_FLOOR * r, 3), fp32, f64, f64, 1e-9)
    assert not far.ok
    # a spread larger than the floor is the one that counts
    wide = fp64_distances(_noisy(f64, 30 * FP32_FLOOR * r, 4), _noisy(f64, 20 * FP32_FLOOR * r, 5), f64, f64, 1e-9)
    assert wide.reference > wide.floor and wide.ok


@cache
def decode_step(past: int):
    path = ROOT / "models" / "llama_tiny_decode.onnx"
    _, program = compile_model(path, Options(ARCH, {"sequence": 1, "past_sequence_length": past}, attention="int8"))
    return path, program


@pytest.mark.parametrize("past, seed", [(11, 2), (11, 7), (15, 8)])
def test_a_decode_step_fails_no_longer_on_a_spread_small_by_chance(past, seed):
    """llama_tiny_decode, one token with int8 attention: these seeds failed with onnxruntime's
    single fp32 sample as the spread (the program 5-7 r from its yardstick, more than twice
    onnxruntime's distance); the floor passes them. The same step with a flipped weight fails."""
    path, program = decode_step(past)
    inputs = random_inputs(program, seed)
    verdict = judge(path, inputs, run(program, ARCH, inputs).outputs, program_approximations=program.approximations)
    assert verdict.ok, verdict.rows
    raised = [r for r in verdict.rows if not r.within_tolerance and r.fp64.ours > FP64_MULTIPLE * r.fp64.reference]
    assert raised, "no output needed the floor: the case no longer shows it"
    for r in raised:
        assert r.fp64.ours <= FP64_MULTIPLE * r.fp64.floor < 1e-6
    data, which = flip_one_weight(program.data, program, "q_proj")
    wrong = run(dataclasses.replace(program, data=data), ARCH, inputs).outputs
    bad = judge(path, inputs, wrong, program_approximations=program.approximations)
    assert not bad.ok, which
    assert all(r.fp64.ours > 1e4 * r.fp64.floor for r in bad.rows if not r.ok)
