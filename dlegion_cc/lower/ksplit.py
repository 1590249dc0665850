"""K split across Legions: each Legion multiplies one K range of the same output tile, and the
int32 partial sums are reduced on Legion 0 over the NoC (``noc.add``) before the store.

The tiled schedules (``qplan``/``qtiles``) deal output columns and row blocks to the Legions;
where M x N is too small to give every Legion work (a decode step's projection at M = 1 with
few output columns) most Legions idle while one streams the whole K. A K split gives each
Legion K / L of the weights instead: the weight loads, which dominate such a matmul, spread
over every Legion's DMA queue and the passes over every Legion's cores, at the price of
log2(L) reducing transfers of the M x N partial sums.

It takes the matmuls whose accumulators are the result (``Problem.exact``: int32 out, no
scales, no zero-point correction), whose whole K range of one Legion fits its scratchpads in
one go, and only where its predicted cycles beat the searched plan's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from isa.arch import MODE_BITS, MODE_TILES, Arch
from isa.fields import DramRef, View
from isa.instructions import DmaLoad, DmaStore, MatMul, NocAdd
from runtime.costs import ACC_BYTES, ceil_cycles, pass_cycles
from dlegion_cc.lower.qplan import Problem


@dataclass(frozen=True)
class KSplit:
    """``parts`` Legions (0..parts-1), Legion i taking K rows ``bounds[i]:bounds[i+1]``."""

    parts: int
    bounds: tuple[int, ...]

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.bounds[:-1], self.bounds[1:]))


def split_k(arch: Arch, K: int, parts: int) -> KSplit:
    """K cut into ``parts`` ranges of whole array slices, as even as they go."""
    slices = math.ceil(K / arch.array)
    parts = max(1, min(parts, slices))
    edges = [min(K, (slices * i // parts) * arch.array) for i in range(parts + 1)]
    return KSplit(parts, tuple(edges))


def eligible(arch: Arch, p: Problem, parts: int) -> bool:
    """Whether ``p`` is a plain int32 matmul whose K ranges over ``parts`` Legions fit their
    scratchpads."""
    if not p.exact or p.corr_row is not None or p.groups != 1 or p.segments or len(p.weights) != 1:
        return False
    if p.k_reach is not None or p.n_reach is not None or p.o_offset or p.o_stride or p.batches != 1:
        return False
    if p.legions is not None and len(p.legions) != arch.legions:
        return False
    ks = split_k(arch, p.K, parts)
    if ks.parts < 2:
        return False
    kc = max(b - a for a, b in ks.ranges())
    cap = arch.derived.spad_elems
    M = len(p.rows)
    return (M * kc <= cap["act"] and kc * row_bytes(p) <= cap["wgt"] and M * p.n_pad <= cap["acc"]
            and M < 1 << 16)


def row_bytes(p: Problem) -> int:
    return p.n_pad * MODE_BITS[p.weights[0][1]] // 8


def steps(parts: int) -> list[list[tuple[int, int]]]:
    """The reduction tree: per step, (sender, receiver) pairs; Legion 0 ends with the sum."""
    out, stride = [], 1
    while stride < parts:
        out.append([(s, s - stride) for s in range(stride, parts, 2 * stride)])
        stride *= 2
    return out


def predict(arch: Arch, p: Problem, ks: KSplit) -> int:
    """Cycles of the K split: every Legion's loads share DRAM, the busiest Legion's passes,
    the reduction tree's transfers one after the other, and the store."""
    d = arch.derived
    M, mode = len(p.rows), p.weights[0][1]
    loads = M * p.K + p.K * row_bytes(p)
    load = arch.dram_latency_cycles + ceil_cycles(loads / d.dram_bytes_per_cycle)
    kc = max(b - a for a, b in ks.ranges())
    windows = math.ceil(kc / arch.array) * math.ceil(p.n_pad / (arch.array * MODE_TILES[mode]))
    mm = pass_cycles(arch, M, math.ceil(windows / arch.cores))
    words = M * p.n_pad
    add = max(ceil_cycles(words * ACC_BYTES / d.link_bytes_per_cycle), math.ceil(2 * words / arch.acc_port_words))
    store = arch.dram_latency_cycles + ceil_cycles(M * p.N * ACC_BYTES / d.dram_bytes_per_cycle)
    return load + mm + len(steps(ks.parts)) * add + store


def choose(arch: Arch, p: Problem, searched_cycles: int, parts: int | None = None) -> KSplit | None:
    """The K split of ``p`` over ``parts`` Legions when it is eligible (0: none), or, with
    ``parts`` None, over every Legion when its predicted cycles beat ``searched_cycles`` (the
    searched plan's); else None."""
    if parts == 0 or not eligible(arch, p, parts or arch.legions):
        return None
    ks = split_k(arch, p.K, parts or arch.legions)
    if parts or predict(arch, p, ks) < searched_cycles:
        return ks
    return None


def emit(em, p: Problem, ks: KSplit) -> None:
    """Each Legion loads its K range of the activations and weights and multiplies them into
    its accumulators; the tree of ``noc.add`` sums them into Legion 0's, which stores them."""
    M, m0, mode = len(p.rows), p.rows.start, p.weights[0][1]
    wtensor, rb = p.weights[0][0], row_bytes(p)
    acc = View("acc", 0, p.n_pad, 1)
    for legion, (k0, k1) in enumerate(ks.ranges()):
        kc = k1 - k0
        em.emit(DmaLoad(legion, frozenset({legion}), View("act", 0, kc, 1), DramRef(p.a8, m0 * p.K + k0, p.K), M, kc))
        em.emit(DmaLoad(legion, frozenset({legion}), View("wgt", 0, rb, 1),
                        DramRef(wtensor, p.w_offset + k0 * rb, rb), kc, rb))
        em.depend((legion, "dma"), (legion, "mat"))
        em.emit(MatMul(legion=legion, acc=acc, act=View("act", 0, kc, 1), wgt=View("wgt", 0, rb, 1), M=M, K=kc,
                       N=p.n_pad, mode=mode, split="k", accumulate="set", mask=None))
    into: dict[int, list[int]] = {}          # Legion -> the senders that added into it so far
    for pairs in steps(ks.parts):
        for sender, receiver in pairs:
            # The sender's own sum is complete, and the receiver's accumulators hold its passes
            # and every earlier addition (each on its sender's DMA queue).
            for src in (sender, receiver):
                em.depend((src, "mat"), (sender, "dma"), across=True)
            for src in into.get(sender, []) + into.get(receiver, []):
                em.depend((src, "dma"), (sender, "dma"), across=True)
            em.emit(NocAdd(sender, frozenset({receiver}), acc, acc, M, p.n_pad))
            into.setdefault(receiver, []).append(sender)
    for src in into.get(0, []):
        em.depend((src, "dma"), (0, "dma"), across=True)
    em.depend((0, "mat"), (0, "dma"))
    em.emit(DmaStore(0, DramRef(p.out, m0 * p.N, p.N), View("acc", 0, p.n_pad, 1), M, p.N))
