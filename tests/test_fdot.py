"""vmm's products are the exact sums rounded once to fp32, whatever the BLAS kernel or blocking."""
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from runtime.fdot import rounded_matmul


def _round_fp32(x: Fraction) -> np.float32:
    """``x`` rounded to the nearest fp32, ties to even, by exact comparison."""
    r = np.float32(float(x))
    best = r
    for other in (np.nextafter(r, np.float32(-np.inf)), np.nextafter(r, np.float32(np.inf))):
        if not np.isfinite(other):
            continue
        d_best, d_other = abs(Fraction(float(best)) - x), abs(Fraction(float(other)) - x)
        even = int(np.array(other).view(np.int32)) % 2 == 0
        if d_other < d_best or (d_other == d_best and even):
            best = other
    return best


def _reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.empty((a.shape[0], b.shape[1]), np.float32)
    for m in range(a.shape[0]):
        for n in range(b.shape[1]):
            out[m, n] = _round_fp32(sum((Fraction(float(x)) * Fraction(float(y))
                                         for x, y in zip(a[m], b[:, n])), Fraction(0)))
    return out


def _same(x: np.ndarray, y: np.ndarray) -> bool:
    return x.dtype == y.dtype and x.tobytes() == y.tobytes()


floats = st.floats(width=32, min_value=-1e6, max_value=1e6, allow_subnormal=True)
# Values of very different sizes, so that the products cancel and the sums sit near ties.
wild = st.one_of(floats, st.sampled_from([1.0, -1.0, 2.0 ** -24, 2.0 ** -60, 3.0, 1e-30, 0.0]))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 9), st.integers(1, 5), st.data())
def test_each_element_is_the_exact_sum_rounded_once(m, k, n, data):
    a = data.draw(hnp.arrays(np.float32, (m, k), elements=wild))
    b = data.draw(hnp.arrays(np.float32, (k, n), elements=wild))
    assert _same(rounded_matmul(a, b), _reference(a, b))


def test_a_sum_just_past_a_tie_rounds_up_where_fp64_would_round_to_the_tie():
    # 1 + 2**-24 is halfway between fp32's 1 and 1 + 2**-23; 2**-60 is lost in fp64.
    a = np.array([[1.0, 2.0 ** -24, 2.0 ** -60]], np.float32)
    b = np.ones((3, 1), np.float32)
    assert rounded_matmul(a, b)[0, 0] == np.float32(1 + 2.0 ** -23)
    assert rounded_matmul(a[:, :2], b[:2])[0, 0] == np.float32(1.0)     # a true tie: to even


def test_cancellation_is_exact():
    a = np.array([[1e8, 1.0, -1e8]], np.float32)
    assert rounded_matmul(a, np.ones((3, 1), np.float32))[0, 0] == 1.0


@pytest.mark.parametrize("value, want", [(3e38, np.inf), (np.inf, np.inf), (np.nan, np.nan)])
def test_overflow_infinity_and_nan_follow_ieee(value, want):
    a = np.array([[value, value, 1.0]], np.float32)
    got = rounded_matmul(a, np.ones((3, 1), np.float32))[0, 0]
    assert (np.isnan(got) and np.isnan(want)) or got == want


def test_blocking_and_zero_padding_change_nothing():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((37, 300)).astype(np.float32)
    b = rng.standard_normal((300, 29)).astype(np.float32)
    whole = rounded_matmul(a, b)
    assert _same(np.vstack([rounded_matmul(a[:20], b), rounded_matmul(a[20:], b)]), whole)
    assert _same(np.hstack([rounded_matmul(a, b[:, :7]), rounded_matmul(a, b[:, 7:])]), whole)
    padded = rounded_matmul(np.pad(a, ((0, 0), (0, 45))), np.pad(b, ((0, 45), (0, 0))))
    assert _same(padded, whole)
    assert _same(whole[:3, :4], _reference(a[:3], b[:, :4]))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(2, 7), st.integers(1, 4), st.data())
def test_a_batch_rounds_each_product_as_alone(batch, m, k, n, data):
    # Near-ties in every product of the batch: the elements summed exactly are found by their
    # flat place in the batch, and each is its own product's.
    a = data.draw(hnp.arrays(np.float32, (batch, m, k), elements=wild))
    b = data.draw(hnp.arrays(np.float32, (batch, k, n), elements=wild))
    got = rounded_matmul(a, b)
    for i in range(batch):
        assert _same(got[i], _reference(a[i], b[i]))
    assert _same(rounded_matmul(a, b[0]), np.stack([_reference(x, b[0]) for x in a]))
