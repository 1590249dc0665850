"""A chain's last matmul in long passes for most of its columns.

In a chain (``rowblocks.py``) each matmul passes its rows block by block, so that the row
kernel before it works on one block while the arrays multiply another; every pass then pays
the array's fill and drain (M + N cycles for M rows) once a block: 1/8 more than the rows' own
cycles at blocks of 128 rows on 16-wide arrays. Only the blocks before the last run beside a
kernel. A matmul whose rows nothing else in the chain reads (its last: down_proj in the
BitLinear stack) is therefore cut by columns: its first weight windows a Legion pass block by
block as before, beside the kernel's blocks, as many as their passes take to cover the kernel's
vector work on a block (``head_windows``), and the rest pass all the rows at once with the last
block, their fill and drain paid once.

A gated matmul (``passes/gated.py``) in the middle of a chain of two row blocks is cut in three
(``gated_windows``): its first windows pass block by block, the first block beside the kernel
before it; its middle windows over all the rows; its last windows block by block, the last block
beside the first block of the kernel after it, which needs every column of that block.
"""
from __future__ import annotations

import math

from isa.arch import Arch


def head_windows(arch: Arch, mode: str, K: int, tiles: int, rows: int, beside: float, ops: float = 1) -> int:
    """The fewest weight windows (of ``tiles`` tiles, ``K`` deep, in ``mode``) a Legion passes
    over a block of ``rows`` rows in at least ``beside`` cycles, the vector work of the row
    kernels beside the block, besides the ``ops`` vector operations an element of the window's
    drains take on the same vector unit: fewer leave it exposed, more pay fill and drain a
    block. 2B4T BitLinear stack at 256 on dlegion-8x8, down_proj (5 w2 windows a Legion) beside
    the quantization of ReLU^2 x up: 1 window 291,382 cycles, 2 (the rule's) 282,075, 3 283,029."""
    return max(1, math.ceil(beside / _window_cycles(arch, mode, K, tiles, rows, ops)[1]))


def _window_cycles(arch: Arch, mode: str, K: int, tiles: int, rows: int, ops: float) -> tuple[float, float]:
    """A weight window's passes over ``rows`` rows at the arrays' peak, and the cycles they
    leave the vector unit beside them: with fill and drain, less the drains' ``ops`` vector
    operations an element."""
    d = arch.derived
    window = rows * K * arch.array * tiles * arch.legions / d.macs_per_cycle[mode]
    drains = ops * rows * arch.array * tiles / arch.vector_lanes
    return window, window * (1 + d.pass_overhead / rows) - drains


def head_columns(arch: Arch, mode: str, K: int, N: int, tiles: int, blocks: list[range], beside: float) -> int:
    """The columns passed block by block (the rest pass all the rows with the last block) of a
    chain's last matmul of ``N`` columns, ``K`` deep, whose passes hold ``tiles`` windows, beside
    row kernels of ``beside`` vector cycles a block; 0: no cut (one block, a part-empty window,
    or no whole window left for the long passes)."""
    share = arch.legions * arch.array * tiles
    if len(blocks) < 2 or N % share:
        return 0
    head = head_windows(arch, mode, K, tiles, len(blocks[0]), beside)
    return head * share if head < N // share else 0


# The shallowest chunks of weight rows (``arch.array * arch.cores``, ``qplan.candidates``) a
# pass contracts, for the passes a kernel starts behind: the plans' pick in the 2B4T BitLinear
# stack's gate/up and down_proj at 256 on dlegion-8x8 (256 weight rows, 10 passes a window of
# gate/up's 128 rows). Taking the shallowest (1) the rule keeps the stack's gate/up at 3 first
# and 6 last windows, 275,955 cycles against 275,255 with 7.
PASS_CHUNKS = 2

# The row blocks of a chain in which a gated matmul is cut (``gated_windows`` says why two).
GATED_BLOCKS = 2


def gated_windows(arch: Arch, mode: str, K: int, N: int, tiles: int, blocks: list[range], before: float,
                  after: float, ops: float, late: int) -> tuple[int, int]:
    """(first, last) windows a Legion of a gated matmul of ``N`` laid-out columns (``K`` deep,
    passes of ``tiles`` windows, drains of ``ops`` vector operations an element) that pass
    block by block beside row kernels of ``before`` and ``after`` vector cycles a block, each
    starting ``late`` passes into its step, the rest over all the rows; (0, 0): no cut (not two
    blocks, a part-empty window, or no window left for the long passes). Three steps more than
    the blocks' two: only two blocks leave the kernel after it one block to run beside the last
    windows' last block."""
    share = arch.legions * arch.array * tiles
    if len(blocks) != GATED_BLOCKS or N % share:
        return 0, 0
    windows = N // share
    first, last = (_cheapest_windows(arch, mode, K, tiles, len(blocks[0]), windows, v, ops, late)
                   for v in (before, after))
    return (first, last) if first + last < windows else (0, 0)


def _cheapest_windows(arch: Arch, mode: str, K: int, tiles: int, rows: int, most: int, beside: float,
                      ops: float, late: int) -> int:
    """The windows (up to ``most``) that a Legion passes block by block beside a kernel of
    ``beside`` vector cycles starting ``late`` passes in at the least cost: the kernel's cycles
    left exposed past the windows' passes (less their drains' vector work; the passes before
    its start, ``PASS_CHUNKS``, add to it), plus the fill and drain each window pays once more
    in blocks than over all the rows. 2B4T BitLinear stack at 256 on dlegion-8x8, gate/up (27
    w2 windows a Legion, steps in ``qmatmul.GATED_STEPS``' order): the rule's 3 first and 7 last
    275,255 cycles; without the late start (as ``head_windows``) 2 and 6, 277,398; 2/7 277,139,
    3/6 275,955, 3/8 275,759, 4/7 276,246. The layer at 256 (5 and 11): 382,654."""
    window, covered = _window_cycles(arch, mode, K, tiles, rows, ops)
    exposed = beside + late * window * PASS_CHUNKS * arch.array * arch.cores / K

    def cost(w: int) -> float:
        return max(0.0, exposed - w * covered) + w * window * arch.derived.pass_overhead / rows

    return min(range(1, most + 1), key=cost)
