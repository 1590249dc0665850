"""Quantized matmuls on the systolic arrays (``dlegion.QMatMul``).

Activations are stored as exact int8 in DRAM, then each row block is multicast to every
Legion with one DRAM read. Each Legion owns a slice of output columns: it streams its packed
weights through w2/w4/w8 passes split over its cores' K-slices (summed by the parallel
accumulators), drains the int32 accumulators with the per-row and per-column scales, and
stores fp32 results.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from isa.arch import MODE_BITS, Arch
from isa.fields import DramRef, View
from isa.instructions import BY_MNEMONIC, DmaLoad, DmaStore, Drain, MatMul
from dlegion_cc.ir import DLEGION
from dlegion_cc.lower.context import Lowering, lowers
from dlegion_cc.lower.emitter import Emitter
from dlegion_cc.lower.layout import Operand, whole
from dlegion_cc.lower.movement import nd_copy
from dlegion_cc.lower.rowwise import Arg, rowwise

WEIGHT_DTYPE = {"w2": "w2", "w4": "w4", "w8": "i8"}


def pick_mode(arch: Arch, wanted: str) -> str:
    """The narrowest mode the machine has that holds weights of ``wanted``'s width."""
    fits = [m for m in arch.modes if MODE_BITS[m] >= MODE_BITS[wanted]]
    if not fits:
        raise ValueError(f"{arch.name} has no mode that holds {wanted} weights")
    return min(fits, key=lambda m: MODE_BITS[m])


@dataclass(frozen=True)
class Tiles:
    """How one quantized matmul is cut: row blocks, column steps and weight chunks."""

    rows: int          # activation rows multicast at once (Mb)
    cols: int          # output columns one Legion handles per drain (nb)
    depth: int         # weight rows loaded at once (Kc)
    per_legion: int    # output columns owned by each Legion


def plan_tiles(arch: Arch, M: int, K: int, N: int, mode: str) -> Tiles:
    d, na = arch.derived, arch.array
    per_legion = math.ceil(N / na / arch.legions) * na
    rows = min(M, d.spad_elems["act"] // K, d.spad_elems["acc"] // na)
    vec_left = d.spad_elems["vec"] - N - rows
    cols = min(per_legion, d.spad_elems["acc"] // rows, vec_left // rows) // na * na
    if rows < 1 or cols < na:
        raise ValueError(f"a {na}-column tile of depth {K} does not fit the scratchpads of {arch.name}")
    depth = min(K, d.spad_elems["wgt"] * 8 // (cols * MODE_BITS[mode]))
    depth = depth if depth == K else depth // na * na
    return Tiles(rows, cols, depth, per_legion)


@lowers("QMatMul", domain=DLEGION)
def qmatmul(low: Lowering, node) -> None:
    q, s = node.inputs
    weight: np.ndarray = node.attrs["weight"]
    em, arch = low.em, low.em.arch
    mode = pick_mode(arch, node.attrs["mode"])
    K, N = weight.shape
    M = math.prod(low.shape(q)[:-1])
    q8, rscale = _quantized_rows(low, q, s, M, K, node.attrs.get("row_divisor", False))
    em.barrier()
    n_pad = math.ceil(N / arch.array) * arch.array
    padded = np.zeros((K, n_pad), np.int8)
    padded[:, :N] = weight
    w = em.const(f"{node.name}_w", padded, WEIGHT_DTYPE[mode])
    cscale = node.attrs.get("cscale")
    cs = None if cscale is None else em.const(f"{node.name}_cs", np.pad(cscale, (0, n_pad - N)), "f32")
    out = low.result(node.outputs[0])
    tiles = plan_tiles(arch, M, K, n_pad, mode)
    _emit_tiles(em, Problem(q8, rscale, w, cs, out.tensor, M, K, N, n_pad, mode), tiles)


def _quantized_rows(low: Lowering, q: str, s: str, M: int, K: int, divisor: bool):
    """int8 copy of the activations and the per-row scale (1/s when the graph divides by s)."""
    em = low.em
    q8 = em.tensor(f"{q}_i8", "i8", (M, K), "scratch")
    src = low.operand(q)
    nd_copy(em, whole(q8, (M, K)), Operand(src.tensor, src.offset, (K, 1)), (M, K))
    rs = em.tensor(f"{s}_rscale", "f32", (M,), "scratch")
    s_op = low.operand(s)
    mnemonic = "vrecip" if divisor else "vmov"
    body = lambda e, l, v, r, c: e.emit(BY_MNEMONIC[mnemonic](l, v["out"], v["s"], r, c))
    rowwise(em, (M, 1), [Arg("s", Operand(s_op.tensor, s_op.offset, (1, 0))),
                         Arg("out", Operand(rs, 0, (1, 0)), out=True)], body)
    return q8, rs


@dataclass(frozen=True)
class Problem:
    q8: int
    rscale: int
    weight: int
    cscale: int | None
    out: int
    M: int
    K: int
    N: int
    n_pad: int
    mode: str


def _emit_tiles(em: Emitter, p: Problem, t: Tiles) -> None:
    owners = [l for l in range(em.arch.legions) if l * t.per_legion < p.n_pad]
    layout = _VecLayout(t.rows, p.n_pad)
    if p.cscale is not None:
        em.emit(DmaLoad(0, frozenset(owners), View("vec", layout.cscale, p.n_pad, 1),
                        DramRef(p.cscale, 0, p.n_pad), 1, p.n_pad))
    for m0 in range(0, p.M, t.rows):
        m = min(t.rows, p.M - m0)
        for l in owners:                       # the previous block is done with act and rscale
            if m0:
                em.depend((l, "mat"), (0, "dma"))
                em.depend((l, "vec"), (0, "dma"))
        em.emit(DmaLoad(0, frozenset(owners), View("act", 0, p.K, 1), DramRef(p.q8, m0 * p.K, p.K), m, p.K))
        em.emit(DmaLoad(0, frozenset(owners), View("vec", layout.rscale, 1, 1), DramRef(p.rscale, m0, 1), m, 1))
        for l in owners:
            em.depend((0, "dma"), (l, "mat"))
            em.depend((0, "dma"), (l, "vec"))
            _legion_block(em, p, t, layout, l, m0, m)


@dataclass(frozen=True)
class _VecLayout:
    rows: int
    n_pad: int

    @property
    def rscale(self) -> int:
        return 0

    @property
    def cscale(self) -> int:
        return self.rows

    @property
    def result(self) -> int:
        return self.rows + self.n_pad


def _legion_block(em: Emitter, p: Problem, t: Tiles, layout: _VecLayout, l: int, m0: int, m: int) -> None:
    bits = MODE_BITS[p.mode]
    row_bytes = p.n_pad * bits // 8
    split = "k" if em.arch.parallel_accumulators and em.arch.cores > 1 else "n"
    start = l * t.per_legion
    for n0 in range(start, min(start + t.per_legion, p.n_pad), t.cols):
        nb = min(t.cols, start + t.per_legion - n0, p.n_pad - n0)
        for k0 in range(0, p.K, t.depth):
            kc = min(t.depth, p.K - k0)
            em.depend((l, "mat"), (l, "dma"))          # the weight buffer is free again
            em.emit(DmaLoad(l, frozenset({l}), View("wgt", 0, nb * bits // 8, 1),
                            DramRef(p.weight, k0 * row_bytes + n0 * bits // 8, row_bytes), kc, nb * bits // 8))
            em.depend((l, "dma"), (l, "mat"))
            em.emit(MatMul(l, View("acc", 0, nb, 1), View("act", k0, p.K, 1), View("wgt", 0, nb * bits // 8, 1),
                           m, kc, nb, p.mode, split, "set" if k0 == 0 else "add", None))
        _drain_and_store(em, p, layout, l, m0, m, n0, nb)


def _drain_and_store(em: Emitter, p: Problem, layout: _VecLayout, l: int, m0: int, m: int, n0: int, nb: int) -> None:
    em.depend((l, "mat"), (l, "vec"))
    em.depend((l, "dma"), (l, "vec"))                  # the previous store has read the result
    cscale = None if p.cscale is None else layout.cscale + n0
    em.emit(Drain(l, View("vec", layout.result, nb, 1), View("acc", 0, nb, 1), m, nb,
                  None, layout.rscale, cscale, None, "set"))
    em.depend((l, "vec"), (l, "dma"))
    em.depend((l, "vec"), (l, "mat"))                  # the accumulators may be overwritten
    cols = min(nb, p.N - n0)
    if cols > 0:
        em.emit(DmaStore(l, DramRef(p.out, m0 * p.N + n0, p.N), View("vec", layout.result, nb, 1), m, cols))
