"""Exact int8 products through onnxruntime's MatMulInteger: equal to int64 numpy, extremes
included, and taken only for weights whose pairs of products fit int16."""
import numpy as np
import pytest

from runtime.intdot import exact_int8, int8_matmul


def _reference(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.matmul(a.astype(np.int64), w.astype(np.int64)).astype(np.int32)


@pytest.mark.parametrize("lo, hi", [(-2, 2), (-8, 8)])          # w2 and w4 weights
@pytest.mark.parametrize("shape", [((256, 128), (128, 512)), ((8, 1, 256), (8, 256, 96)), ((3, 5, 7), (3, 7, 2))])
def test_random_products_are_exact(lo, hi, shape):
    rng = np.random.default_rng(hash((lo, shape)) % 2**32)
    a = rng.integers(-128, 128, shape[0]).astype(np.int8)
    w = rng.integers(lo, hi, shape[1]).astype(np.int8)
    out = int8_matmul(a, w)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, _reference(a, w))


@pytest.mark.parametrize("w_value", [-8, 7, -2, 1])
def test_extreme_values_are_exact(w_value):
    # Every product at its largest magnitude, over a deep K: no pair saturates, no sum is lost.
    a = np.full((4, 8192), -128, np.int8)
    a[1] = 127
    w = np.full((8192, 3), w_value, np.int8)
    np.testing.assert_array_equal(int8_matmul(a, w), _reference(a, w))


def test_strided_activations():
    rng = np.random.default_rng(1)
    big = rng.integers(-128, 128, (64, 300)).astype(np.int8)
    a = big[::2, 10:138]                       # a window of a scratchpad: strided rows
    w = rng.integers(-2, 2, (128, 40)).astype(np.int8)
    np.testing.assert_array_equal(int8_matmul(a, w), _reference(a, w))


def test_only_weights_whose_pairs_fit_int16():
    # 2 * 255 * w_max <= 32767: up to 64; w8 weights (128) go through the fp32 path.
    assert exact_int8(2) and exact_int8(8) and exact_int8(64)
    assert not exact_int8(65) and not exact_int8(128)
