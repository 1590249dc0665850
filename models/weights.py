"""Seeded parameter values: ternary BitLinear weights with per-tensor scales, float weights, block sparsity."""
from __future__ import annotations

import numpy as np

from models.graph import RowBlocks

TERNARY_ZERO = 0.4  # share of zeros; absmean quantization of trained weights leaves about this many
ROW_BLOCK_BYTES = 64 << 20  # how much of a row-block table is in memory at once


def ternary(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """A [rows, cols] float32 matrix of {-1, 0, 1}, zeros at TERNARY_ZERO, signs equally likely."""
    draw = rng.random((rows, cols), dtype=np.float32)
    low = (1.0 - TERNARY_ZERO) / 2
    return ((draw >= 1.0 - low).astype(np.float32) - (draw < low).astype(np.float32)).astype(np.float32)


def ternary_scale(rng: np.random.Generator, fan_in: int) -> np.ndarray:
    """The per-tensor weight_scale [1]: sized so a projection keeps unit variance, jittered by +-50 %."""
    base = 1.0 / np.sqrt((1.0 - TERNARY_ZERO) * fan_in)
    return np.array([base * rng.uniform(0.5, 1.5)], dtype=np.float32)


def gaussian(rng: np.random.Generator, shape: tuple, std: float) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def gaussian_rows(rng: np.random.Generator, shape: tuple[int, int], std: float) -> RowBlocks:
    """gaussian() drawn one block of rows at a time, when read: the generator yields the same stream
    in pieces as in one call, so the values are those of gaussian(rng, shape, std)."""
    rows, cols = shape
    step = max(1, ROW_BLOCK_BYTES // (4 * max(cols, 1)))
    blocks = (gaussian(rng, (min(step, rows - start), cols), std) for start in range(0, rows, step))
    return RowBlocks(shape, np.dtype(np.float32), blocks)


def norm_weight(rng: np.random.Generator, size: int) -> np.ndarray:
    """RMSNorm gains near 1, as trained models have them."""
    return (1.0 + gaussian(rng, (size,), 0.1)).astype(np.float32)


def block_grid(shape: tuple, block: int) -> tuple[int, int]:
    """How many block x block tiles cover a matrix; edge tiles may be partial."""
    return -(-shape[0] // block), -(-shape[1] // block)


def zero_blocks(rng: np.random.Generator, matrix: np.ndarray, fraction: float, block: int) -> np.ndarray:
    """Zero round(fraction * tiles) distinct block x block tiles chosen at random; returns a new matrix."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"block sparsity {fraction} is outside [0, 1]")
    if block < 1:
        raise ValueError(f"block size {block} must be positive")
    rows, cols = block_grid(matrix.shape, block)
    count = int(round(fraction * rows * cols))
    out = matrix.copy()
    for tile in rng.permutation(rows * cols)[:count]:
        r, c = divmod(int(tile), cols)
        out[r * block:(r + 1) * block, c * block:(c + 1) * block] = 0
    return out


def zero_block_fraction(matrix: np.ndarray, block: int) -> float:
    """The share of block x block tiles that are all zero."""
    rows, cols = block_grid(matrix.shape, block)
    zero = sum(
        not matrix[r * block:(r + 1) * block, c * block:(c + 1) * block].any()
        for r in range(rows) for c in range(cols)
    )
    return zero / (rows * cols)
