"""fp32 products whose result does not depend on the BLAS kernel: each element of ``a @ b`` is
the exact sum of its products, rounded once to fp32 (to nearest, ties to even).

Any summation order gives its own fp32 result, and BLAS kernels pick their order by CPU and by
blocking; the exact sum has one. It is found fast: the products of fp32 values are exact in
fp64, so one fp64 BLAS product is within ``gamma_K * sum |a_k b_k|`` of the exact sum (whatever
its order), and wherever that interval holds no fp32 rounding boundary the fp64 result rounds
to the right fp32 value. The few elements whose interval does hold one are summed exactly.
"""
from __future__ import annotations

import math

import numpy as np

_UNIT = 2.0 ** -53                       # fp64's unit roundoff
_OVERFLOW = 2.0 ** 128 - 2.0 ** 103      # the smallest magnitude that rounds to fp32 infinity


def rounded_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a`` (... x M x K) times ``b`` (... x K x N), both fp32: the exact sums rounded once
    to fp32 (leading axes: a batch, as np.matmul)."""
    with np.errstate(all="ignore"):      # infinities and NaN are results here, not faults
        return _rounded(np.asarray(a, np.float64), np.asarray(b, np.float64))


def _rounded(a64: np.ndarray, b64: np.ndarray) -> np.ndarray:
    s = a64 @ b64
    out = s.astype(np.float32)
    k = a64.shape[-1]
    if k <= 1 or out.size == 0:
        return out                       # one product is exact in fp64: nothing to round twice
    err = _row_bounds(a64, b64, k)
    doubt = _doubtful(s, err, out)
    if not len(doubt):                   # the common case: no element to sum exactly
        return out
    batch = out.shape[:-2]
    a64, b64 = np.broadcast_to(a64, batch + a64.shape[-2:]), np.broadcast_to(b64, batch + b64.shape[-2:])
    for at in doubt.tolist():
        *batch, m, n = np.unravel_index(at, out.shape)
        out[(*batch, m, n)] = _exact_dot(a64[(*batch, m)], b64[(*batch, slice(None), n)])
    return out


def _row_bounds(a64: np.ndarray, b64: np.ndarray, k: int) -> np.ndarray:
    """Per row of ``a64 @ b64`` (... x M x 1), a bound on how far its fp64 sums may be from
    the exact ones: sum |a_k b_k| <= |a| |b| (Cauchy-Schwarz), with the largest finite column
    norm of ``b64`` for every column, so that the bound is one column to broadcast and not a
    matrix to compute (a column with an infinity or NaN has non-finite sums, which need no
    bound). Twice gamma_K: room for the rounding of the bound itself (the squares of fp32
    values are exact in fp64, their sums within gamma_K in any order)."""
    rows = np.sqrt(np.einsum("...k,...k->...", a64, a64))[..., :, None]
    cols = np.sqrt(np.einsum("...kn,...kn->...n", b64, b64))
    cols[~np.isfinite(cols)] = 0.0
    top = cols.max(axis=-1, initial=0.0)[..., None, None]
    err = rows * top                    # a batch of ``b64`` may broadcast ``a64``'s rows
    err *= 2.0 * k * _UNIT
    return err


def _rounds_alike(s: np.ndarray, err: np.ndarray, out: np.ndarray) -> np.ndarray:
    """True where every value within ``err`` of ``s`` rounds to ``out``; also where ``s`` is
    not finite, as any order gives the same infinity or NaN from the same products."""
    alike = np.ones(s.shape, np.bool_)
    alike.reshape(-1)[_doubtful(s, err, out)] = False
    return alike


def _doubtful(s: np.ndarray, err: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The flat indices where :func:`_rounds_alike` is False (``s`` contiguous): in the common
    case, none, three passes over the products."""
    # Rounding to fp32 is monotone: when both ends of the interval round to one value, so does
    # every value between them (out, the rounded s, among them). The ends' own fp64 rounding
    # is covered by err's margin (twice gamma_K). A tie on an end that err does not widen
    # (zero) is left to the midpoints, as a tie is the exact sum's to settle. Each end is
    # computed in fp64 and rounded once to fp32 as it is stored (the ufunc's cast).
    lo = np.subtract(s, err, out=np.empty(s.shape, np.float32), casting="same_kind")
    hi = np.add(s, err, out=np.empty(s.shape, np.float32), casting="same_kind")
    alike = lo == hi
    if not (err > 0).all():              # err: a column per row, or what broadcasts to s
        alike &= err > 0
    elif alike.all():
        return _NONE
    doubt = np.flatnonzero(~alike)
    at = np.unravel_index(doubt, s.shape)
    edges = _within_edges(s[at], np.broadcast_to(err, s.shape)[at], out[at])
    return doubt[~edges]


_NONE = np.zeros(0, np.int64)


def _within_edges(s: np.ndarray, err: np.ndarray, out: np.ndarray) -> np.ndarray:
    """:func:`_rounds_alike` by the midpoints to ``out``'s fp32 neighbours."""
    r = out.astype(np.float64)
    below = np.nextafter(out, np.float32(-np.inf)).astype(np.float64)
    above = np.nextafter(out, np.float32(np.inf)).astype(np.float64)
    low = np.where(np.isinf(below), -_OVERFLOW, (r + below) / 2)
    high = np.where(np.isinf(above), _OVERFLOW, (r + above) / 2)
    inside = (s - err > low) & (s + err < high) & np.isfinite(r)
    return inside | ~np.isfinite(s)


def _exact_dot(x: np.ndarray, y: np.ndarray) -> np.float32:
    """The exact sum of ``x * y`` (fp64 vectors of fp32 values) rounded once to fp32."""
    products = (x * y).tolist()              # each exact: 24 + 24 bits fit fp64's 53
    d = math.fsum(products)                  # the exact sum rounded to fp64
    r = np.float32(d)
    if float(r) == d:
        return r
    toward = np.float32(np.inf) if d > float(r) else np.float32(-np.inf)
    other = np.nextafter(r, toward)
    if abs(float(other) - d) != abs(float(r) - d):
        return r                             # d is no tie: rounding it rounds the exact sum
    # d is halfway between two fp32 values: the exact sum's side of d decides. Its remainder
    # is a multiple of 2**-298 (the products' least bit), so fsum cannot lose its sign.
    rest = math.fsum(products + [-d])
    if rest == 0:
        return r                             # a true tie: numpy's rounding is to even
    return other if (rest > 0) == (float(other) > float(r)) else r
