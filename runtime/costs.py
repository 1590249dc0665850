"""What one instruction costs: pure functions of the instruction, the arch and the program's tensors.

One function per instruction family (``COSTS``), each ``f(instr, arch, env) -> Cost``. A
:class:`Cost` gives the time the instruction holds its queue (or, for a DMA, the bytes of its
DRAM flow, whose time depends on who else shares DRAM) and the counters it adds to the report.
The formulas are the timing model's; ``runtime/timing.py`` documents the model as a whole.

MatMul (array Na x Na = ``arch.array``, ``t`` tiles a window by mode, ``C`` cores):
  the K x N weights are ceil(K/Na) x ceil(N/Na) blocks; a mask zeroes some. Each K-slice packs its
  nonzero blocks into ceil(nonzero / t) windows (partially-sparse windows are compacted); one
  pass holds one window. split=k gives core c the K-slices kb % C == c; split=n gives core c
  window w of every K-slice with w % C == c. The busiest core sets the time:
  passes_max * (M + pass_overhead), plus a weight-window load per pass when the weight
  registers are single-buffered. Double-buffered, only the first window's load can show: it is
  the instruction's ``lead`` (see ``Cost``), hidden behind the queue's previous work when the
  operands were in the Legion early enough. With ``pass_overlap`` the passes of one instruction
  pipeline: (passes_max - 1) * max(M, weight load) + M + pass_overhead.
  Psum traffic per column block with nk nonzero K-slices: ceil(nk / C) accumulator updates
  when split=k and the parallel accumulators sum the cores' outputs, else nk; each update
  reads and writes M x width int32s, except that the first update of a `set` only writes.
  The accumulator port moves ``acc_port_words`` of them a cycle, while the passes stream: the
  instruction takes max(pass cycles, ceil(psum words / acc_port_words)).
  MACs: ``macs`` are the useful ones, M x (rows x columns of each nonzero block, an edge block
  as narrow as K and N leave it). A pass occupies the whole array for each of its ``t`` tiles:
  M x Na x Na x t MAC slots, and ``padded_macs`` are the slots of all passes that carry no
  useful product (edge blocks narrower than the array, windows holding fewer than ``t``
  blocks). Zero columns a program adds itself are, to the machine, work the instruction asks
  for, and count as useful.

DMA: rows * cols elements of the DRAM tensor's storage dtype; a multicast load is one read.
Scratchpad traffic (``spad_bytes``, apart from psum traffic): what each instruction reads from
and writes to the Legion scratchpads; a pass streams M x Na activation bytes and loads one
window of Na x Na weight bytes (every mode packs a window into Na x Na bytes).
Vector unit (``vector_lanes`` lanes): ceil(elements / lanes) cycles, times
``vector_transcendental_cycles`` for a transcendental function; a drain moves M x N elements;
``vmm`` does M x K x N fp32 multiply-adds, its ``vector_macs``. ``vector_ops`` counts lane-ops
for the energy estimate: one per element (a multiply-add for ``vmm``, a scaling for a drain),
and a transcendental as many as the cycles it holds a lane.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from isa.arch import ELEM_BYTES, MODE_TILES, Arch
from isa.instructions import TRANSCENDENTAL, DmaLoad, DmaStore, Gather, Instr, NocAdd, NocMove, VMatMul, family
from isa.program import STORAGE

ACC_BYTES = 4          # an accumulator scratchpad element is int32

# DMA class -> (field naming its DRAM side, counter of the bytes it moves)
DMA_SIDE = {DmaLoad: ("src", "dram_read_bytes"), DmaStore: ("dst", "dram_write_bytes"),
            Gather: ("table", "dram_read_bytes")}


class CostError(ValueError):
    """An instruction whose cost cannot be computed (the caller adds its location)."""


@dataclass(frozen=True)
class Blocks:
    """Which weight blocks of a MatMul are nonzero: a hashable bool matrix [K-slices, column blocks]."""

    shape: tuple[int, int]
    bits: bytes

    @classmethod
    def from_mask(cls, mask: np.ndarray) -> "Blocks":
        nz = np.ascontiguousarray(np.asarray(mask) != 0)
        return cls(tuple(nz.shape), nz.tobytes())

    def array(self) -> np.ndarray:
        return np.frombuffer(self.bits, dtype=bool).reshape(self.shape)


@dataclass(frozen=True)
class Env:
    """What costs need from the program: its tensors and the decoded MatMul masks by tensor index."""

    tensors: tuple
    masks: dict


@dataclass(frozen=True)
class Cost:
    cycles: int = 0                   # time on its queue (not used for a DMA)
    lead: int = 0                     # cycles needed after its inputs are ready, before ``cycles``,
                                      # which the queue's previous work can hide (a first weight load)
    flow_bytes: int | None = None     # a DMA: bytes its DRAM flow moves
    counters: dict = field(default_factory=dict)
    detail: dict | None = None        # a per-instruction report row (MatMul)


# --- DMA -------------------------------------------------------------------------------------

def dma(i: Instr, arch: Arch, env: Env) -> Cost:
    ref = getattr(i, DMA_SIDE[type(i)][0])
    if ref.tensor >= len(env.tensors):
        raise CostError(f"tensor index {ref.tensor} out of range ({len(env.tensors)} tensors)")
    fanout = len(getattr(i, "dests", ())) or 1      # only a load has several receivers
    return _dma(type(i), i.rows, i.cols, env.tensors[ref.tensor].dtype, _spad_view(i).space, fanout, arch.multicast)


@lru_cache(maxsize=4096)
def _dma(cls: type, rows: int, cols: int, dtype: str, space: str, fanout: int, multicast: bool) -> Cost:
    """A DMA's cost from the fields it depends on: a program's many DMAs that differ only in
    their offsets share it."""
    counter = DMA_SIDE[cls][1]
    nbytes = rows * cols * np.dtype(STORAGE[dtype]).itemsize
    spad = rows * cols * ELEM_BYTES[space] * fanout
    if not multicast:
        # Without multicast every receiving Legion needs its own read.
        return Cost(flow_bytes=nbytes * fanout, counters={counter: nbytes * fanout, "spad_bytes": spad})
    return Cost(flow_bytes=nbytes,
                counters={counter: nbytes, "multicast_saved_bytes": nbytes * (fanout - 1),
                          "spad_bytes": spad})


def noc(i: Instr, arch: Arch, env: Env) -> Cost:
    """A Legion-to-Legion transfer holds its DMA queue while the source's link sends its bytes
    once; every destination's link takes them in at the same rate (a multicast is one send)."""
    nbytes = i.rows * i.cols * ELEM_BYTES[i.src.space]
    return Cost(cycles=ceil_cycles(nbytes / arch.derived.link_bytes_per_cycle),
                counters={"noc_bytes": nbytes, "spad_bytes": nbytes * (1 + len(i.dests))})


def noc_add(i: Instr, arch: Arch, env: Env) -> Cost:
    """A reducing transfer: the link sends the partial sums as ``noc.mv`` does, and each
    receiver's accumulator port reads and writes every word (a read-modify-write moves two)
    as they arrive; the slower of the two sets its cycles."""
    move = noc(i, arch, env)
    words = i.rows * i.cols
    cycles = max(move.cycles, psum_cycles(arch, 2 * words))
    return Cost(cycles=cycles, counters={**move.counters, "psum_bytes": ACC_BYTES * 2 * words * len(i.dests)})


def _spad_view(i: Instr):
    return i.src if isinstance(i, DmaStore) else i.dst


# --- MatMul ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class BlockStats:
    """Figures of a MatMul's block structure that do not depend on M."""

    passes: int          # windows over all cores
    passes_max: int      # windows of the busiest core
    block_macs: int      # MACs per streamed input row
    psum_rmw: int        # accumulator elements read+written per input row (2 per update)
    psum_first: int      # of those, first updates per row (a `set` only writes them)


def _edges(total: int, na: int) -> np.ndarray:
    """Width of each N-wide block of a dimension of ``total`` (the last one may be narrower)."""
    starts = np.arange(-(-total // na), dtype=np.int64) * na
    return np.minimum(na, total - starts)


def _core_passes(windows: np.ndarray, cores: int, split: str) -> np.ndarray:
    c = np.arange(cores, dtype=np.int64)
    if split == "k":
        return np.bincount(np.arange(windows.size) % cores, weights=windows,
                           minlength=cores).astype(np.int64)
    # Core c takes windows c, c + C, ... of each K-slice: ceil((W - c) / C) of them.
    return np.clip((windows[:, None] - c[None, :] + cores - 1) // cores, 0, None).sum(axis=0)


@lru_cache(maxsize=4096)
def block_stats(K: int, N: int, na: int, tiles: int, cores: int, split: str, kreduce: bool,
                blocks: Blocks | None) -> BlockStats:
    rows, cols = _edges(K, na), _edges(N, na)
    nz = np.ones((rows.size, cols.size), bool) if blocks is None else blocks.array()
    windows = -(-nz.sum(axis=1, dtype=np.int64) // tiles)
    per_core = _core_passes(windows, cores, split)
    nk = nz.sum(axis=0, dtype=np.int64)
    # The parallel accumulators add the C cores' outputs of one column block in one update.
    updates = -(-nk // cores) if kreduce else nk
    return BlockStats(passes=int(windows.sum()), passes_max=int(per_core.max(initial=0)),
                      block_macs=int(rows @ nz.astype(np.int64) @ cols),
                      psum_rmw=int((cols * 2 * updates).sum()),
                      psum_first=int((cols * (updates > 0)).sum()))


def pass_cycles(arch: Arch, M: int, passes_max: int) -> int:
    """The busiest core's passes, with the weight loads no double buffer hides."""
    if arch.pass_overlap and passes_max:
        return overlapped_pass_cycles(arch, M, passes_max)
    loads = 0 if arch.double_buffered_weights else passes_max
    return passes_max * (M + arch.derived.pass_overhead) + loads * arch.derived.weight_load_cycles


def overlapped_pass_cycles(arch: Arch, M: int, passes: int) -> int:
    """Pipelined passes: a pass's first row enters the array the cycle after the previous pass's
    last row, so only the last pass's fill and drain show. The next window loads into the shadow
    weight registers while a pass streams, so passes start at most every weight load apart."""
    interval = max(M, arch.derived.weight_load_cycles)
    return (passes - 1) * interval + M + arch.derived.pass_overhead


def psum_cycles(arch: Arch, words: int) -> int:
    """Cycles the accumulator scratchpad's port needs for ``words`` int32 psum reads and writes;
    it works while the array streams, so a MatMul takes the longer of this and its passes."""
    return -(-words // arch.acc_port_words)


def weight_lead(arch: Arch, passes_max: int) -> int:
    """The first window's load, before a double-buffered instruction's first pass."""
    return arch.derived.weight_load_cycles if passes_max and arch.double_buffered_weights else 0


def _mask_blocks(i: Instr, arch: Arch, env: Env) -> Blocks | None:
    if i.mask is None:
        return None
    if i.mask not in env.masks:
        raise CostError(f"mask tensor index {i.mask} is not a u8 const tensor")
    blocks = env.masks[i.mask]
    want = (-(-i.K // arch.array), -(-i.N // arch.array))
    if blocks.shape != want:
        raise CostError(f"mask @{env.tensors[i.mask].name} has shape {list(blocks.shape)}, "
                        f"expected {list(want)} for K={i.K} N={i.N} on a {arch.array}-wide array")
    return blocks


def matmul(i: Instr, arch: Arch, env: Env) -> Cost:
    return _matmul(arch, i.M, i.K, i.N, i.mode, i.split, i.accumulate, _mask_blocks(i, arch, env))


@lru_cache(maxsize=4096)
def _matmul(arch: Arch, M: int, K: int, N: int, mode: str, split: str, accumulate: str,
            blocks: Blocks | None) -> Cost:
    """A MatMul's cost from the fields it depends on: the many matmuls of a program that differ
    only in their operands' places share it."""
    kreduce = split == "k" and arch.parallel_accumulators
    shape = (K, N, arch.array, MODE_TILES[mode], arch.cores, split, kreduce)
    s = block_stats(*shape, blocks)
    d = block_stats(*shape, None)
    first = s.psum_first if accumulate == "set" else 0
    dense_first = d.psum_first if accumulate == "set" else 0
    psum_words = M * (s.psum_rmw - first)
    cycles = max(pass_cycles(arch, M, s.passes_max), psum_cycles(arch, psum_words))
    dense_cycles = max(pass_cycles(arch, M, d.passes_max), psum_cycles(arch, M * (d.psum_rmw - dense_first)))
    macs = M * s.block_macs
    counters = {"macs": macs, "dense_macs": M * K * N,
                "padded_macs": s.passes * M * arch.array * arch.array * MODE_TILES[mode] - macs,
                "passes": s.passes, "dense_passes": d.passes,
                "windows_skipped": d.passes - s.passes,
                "sparsity_cycles_saved": dense_cycles - cycles,
                "psum_bytes": ACC_BYTES * psum_words,
                "spad_bytes": s.passes * (M * arch.array + arch.array * arch.array)}
    detail = {"mode": mode, "split": split, "M": M, "K": K, "N": N,
              "passes_max": s.passes_max, "psum_cycles": psum_cycles(arch, psum_words), "cycles": cycles,
              "dense_cycles": dense_cycles,
              **counters}
    return Cost(cycles=cycles, lead=weight_lead(arch, s.passes_max), counters=counters, detail=detail)


# --- vector unit and sync --------------------------------------------------------------------

def drain(i: Instr, arch: Arch, env: Env) -> Cost:
    elems = i.M * i.N
    written = elems * ELEM_BYTES[i.dst.space] * (2 if i.accumulate == "add" else 1)
    spad = elems * ACC_BYTES + written
    return Cost(cycles=-(-elems // arch.vector_lanes),
                counters={"vector_elems": elems, "vector_ops": elems, "spad_bytes": spad})


def vector(i: Instr, arch: Arch, env: Env) -> Cost:
    elems = i.rows * i.cols
    per_op = arch.vector_transcendental_cycles if type(i) in TRANSCENDENTAL else 1
    views = [v for v in (getattr(i, n, None) for n in ("dst", "a", "b", "cond")) if hasattr(v, "space")]
    spad = i.rows * sum(ELEM_BYTES[v.space] for v in views) * i.cols
    return Cost(cycles=-(-elems // arch.vector_lanes) * per_op,
                counters={"vector_elems": elems, "vector_ops": elems * per_op, "spad_bytes": spad})


def vector_matmul(i: Instr, arch: Arch, env: Env) -> Cost:
    # fp32 products on the lanes, one multiply-add per lane per cycle
    elems = i.M * i.K * i.N
    spad = 4 * (i.M * i.K + i.K * i.N + i.M * i.N)
    return Cost(cycles=-(-elems // arch.vector_lanes),
                counters={"vector_elems": elems, "vector_ops": elems, "vector_macs": elems, "spad_bytes": spad})


SYNC = Cost()          # what a wait or barrier costs: nothing, shared by all of them


def sync(i: Instr, arch: Arch, env: Env) -> Cost:
    return SYNC


# By family; a class listed in BY_CLASS has a formula of its own within its family.
COSTS = {"dma": dma, "matrix": matmul, "drain": drain, "vector": vector, "sync": sync}
BY_CLASS = {VMatMul: vector_matmul, NocMove: noc, NocAdd: noc_add}


def cost(i: Instr, arch: Arch, env: Env) -> Cost:
    return BY_CLASS.get(type(i), COSTS[family(type(i))])(i, arch, env)


def ceil_cycles(x: float) -> int:
    """Whole cycles covering ``x``, forgiving the rounding of float arithmetic."""
    return math.ceil(x - 1e-9 * max(1.0, abs(x)))
