"""bench/bench_attention_error.py's refinements of the int8 scheme are exact rewrites: with the
operands unquantized, K's channels smoothed into Q and V's mean re-added through P's row sums
give the exact attention output, so what the bench prints for them is quantization alone."""
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

from bench_attention_error import EXACT, Attention, Scheme  # noqa: E402


def _operands(seed: int = 0, heads: int = 2, seq: int = 16, dim: int = 8) -> SimpleNamespace:
    rng = np.random.default_rng(seed)
    mask = np.triu(np.full((seq, seq), -1e9), 1)[None, None]
    return SimpleNamespace(q=rng.normal(size=(1, heads, seq, dim)) * rng.uniform(0.1, 3, dim),
                           kt=rng.normal(1.0, 1.0, (1, heads, dim, seq)) * rng.uniform(0.1, 3, (dim, 1)),
                           v=rng.normal(0.5, 1.0, (1, heads, seq, dim)), chain=[("Mul", 0.35), ("Add", mask)])


def test_refinements_are_exact_without_quantization():
    att = _operands()
    exact = Attention.output(att, EXACT)
    refined = Attention.output(att, Scheme(0, 0, 0, 0, channels=True, v_mean=True))
    np.testing.assert_allclose(refined, exact, rtol=1e-12, atol=1e-12)


def test_int8_scheme_is_not_exact_and_refinements_change_it():
    att = _operands(1)
    exact = Attention.output(att, EXACT)
    int8 = Attention.output(att, Scheme())
    refined = Attention.output(att, Scheme(p=255, channels=True, v_mean=True))
    rel = lambda x: np.linalg.norm(x - exact) / np.linalg.norm(exact)  # noqa: E731
    assert 1e-4 < rel(int8) < 5e-2
    assert 1e-5 < rel(refined) < 5e-2 and not np.allclose(refined, int8)


def test_two_int8_pieces_as_the_compiler_splits_them_are_far_closer_than_int8():
    """The --attention int8x2 model (three products of pieces, lo.lo left out): an
    approximation, far closer to exact than one int8 piece per operand."""
    att = _operands(2)
    exact = Attention.output(att, EXACT)
    rel = lambda x: np.linalg.norm(x - exact) / np.linalg.norm(exact)  # noqa: E731
    int8, split = rel(Attention.output(att, Scheme())), rel(Attention.output(att, Scheme(split=True)))
    assert 0 < split < int8 / 50
