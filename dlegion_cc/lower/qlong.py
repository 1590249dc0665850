"""A chain's last matmul in long passes for most of its columns.

In a chain (``rowblocks.py``) each matmul passes its rows block by block, so that the row
kernel before it works on one block while the arrays multiply another; every pass then pays
the array's fill and drain (M + N cycles for M rows) once a block: 1/8 more than the rows' own
cycles at blocks of 128 rows on 16-wide arrays. Only the blocks before the last run beside a
kernel. A matmul whose rows nothing else in the chain reads (its last: down_proj in the
BitLinear stack) is therefore cut by columns: its first ``HEAD_WINDOWS`` weight windows a
Legion pass block by block as before, beside the kernel's blocks, and the rest pass all the
rows at once with the last block, their fill and drain paid once.
"""
from __future__ import annotations

from isa.arch import Arch

# 2B4T BitLinear stack at 256 on dlegion-8x8 (down_proj: 5 w2 windows a Legion): 1 window
# 291,382 cycles (the quantization's block is no longer covered), 2 282,075, 3 283,029; uncut 283,112.
HEAD_WINDOWS = 2


def head_columns(arch: Arch, N: int, tiles: int, blocks: list[range]) -> int:
    """The columns passed block by block (the rest pass all the rows with the last block) of a
    chain's last matmul of ``N`` columns whose passes hold ``tiles`` windows; 0: no cut (one
    block, or too few whole windows a Legion)."""
    share = arch.legions * arch.array * tiles
    if len(blocks) < 2 or N % share or N // share <= HEAD_WINDOWS:
        return 0
    return HEAD_WINDOWS * share
