"""A chain's tail: the row kernels over heads after a chain that ends in a matmul (a query's
and a key's rotary after the q/k/v projections), which ``rowblocks.lower_chain`` runs block by
block beside the matmul's row blocks, and where each takes its part of the vector scratchpad.
"""
from __future__ import annotations

import math

from isa.arch import Arch
from dlegion_cc.ir import DLEGION, Node
from dlegion_cc.lower import carry
from dlegion_cc.lower.context import Lowering

MATMUL, ROWS = (DLEGION, "QMatMul"), (DLEGION, "RowKernel")
# Ops between a chain and the row kernel of its tail (``tail_of``): views, which emit nothing.
VIEWS = ("Reshape", "Transpose", "Slice", "Unsqueeze", "Squeeze", "Identity")
MOST_VIEWS = 16
# The share of the part of ``vec`` beside a chain's matmul block that the second of two tail
# kernels takes (the key's rotary beside the query's, which needs the rest for blocks of every
# head's rows: 2B4T layer on dlegion-8x8 at 512, the tails beside the last block only, one after
# the other in the same part 837,472 cycles; 1/5 836,250, 1/4 833,663, 3/10 833,355, 7/20
# 842,216, 1/2 843,280; block by block, 1/5 829,313, 1/4 and 3/10 827,511, 7/20 834,412).
TAIL_SHARE = (3, 10)
# The row kernels at most in a chain's tail (the query's and the key's rotary).
MOST_TAILS = 2


def tail_of(low: Lowering, nodes: list[Node], at: int, chain: list[Node], M: int) -> list[Node]:
    """The views and row kernels after a chain that ends in a matmul, each kernel working on
    the matrices of heads (leading dimensions) of M rows each, reading the matmul's outputs
    through the views (a query's and a key's rotary): each block's rows run while the arrays
    multiply the next block (``rowblocks.lower_chain``). A Concat of a tail kernel's outputs
    between them (the quantized query's halves) is lowered after the tail, which does
    not read it. Nothing when there is no such kernel."""
    if (chain[-1].domain, chain[-1].op) != MATMUL:
        return []
    made, found, tail, views, kernels = set(chain[-1].outputs), set(), [], 0, 0
    for node in nodes[at:]:
        if (node.op in VIEWS or _joins(node, found)) and not node.domain and views < MOST_VIEWS:
            tail.append(node)
            views += 1
            if made & set(node.inputs) and node.op in VIEWS:
                made |= set(node.outputs)
            continue
        if kernels == MOST_TAILS or not over_heads(low, node, made, M):
            break
        tail.append(node)
        found |= set(node.outputs)
        views, kernels = 0, kernels + 1
    while tail and (tail[-1].domain, tail[-1].op) != ROWS:
        tail.pop()
    return tail


def over_heads(low: Lowering, node: Node, made: set, M: int) -> bool:
    """Whether ``node`` is a row kernel over heads of M rows reading ``made`` (a chain's tail)."""
    frame = node.attrs.get("frame") if (node.domain, node.op) == ROWS else None
    return not (frame is None or len(frame.shape) < 3 or math.prod(frame.shape[:-2]) == 1 or frame.shape[-2] != M
                or causal(node) or not made & set(node.inputs) or carry.pending(low, node))


def _joins(node: Node, made: set) -> bool:
    """A Concat of outputs of tail kernels only."""
    return node.op == "Concat" and bool(node.inputs) and set(node.inputs) <= made


def split_tail(chain: list[Node]) -> tuple[list[Node], list[Node], list[Node], list[Node]]:
    """(the chain proper, the views before its tail kernels, the tail kernels, the Concats of
    their outputs) of ``plan``'s nodes."""
    at = next((k for k, n in enumerate(chain) if n.op in VIEWS and not n.domain), len(chain))
    rest = chain[at:]
    kernels = [n for n in rest if (n.domain, n.op) == ROWS]
    joins = [n for n in rest if n.op == "Concat" and not n.domain]
    return chain[:at], [n for n in rest if n not in kernels and n not in joins], kernels, joins


def causal(node: Node) -> bool:
    return any(n.op in ("Softmax", "Trilu") or "reach" in n.attrs for n in node.attrs["nodes"])


def kernel_rooms(arch: Arch, end: int, kernels: list[Node], tails: list[Node]) -> list[tuple[int, int]]:
    """(the first element of ``vec`` each kernel merged with a matmul step may take, the elements
    it leaves at the end): all from ``end`` on; the second of a chain's two tail kernels, a share
    of it (``TAIL_SHARE``) at the end, which the others leave it, so that it touches nothing they
    do and their instructions interleave (``rowblocks._merged``): the loads of the key's rotary cross DRAM
    while the vector unit computes the query's."""
    vec = arch.derived.spad_elems["vec"]
    if len(tails) != 2 or len(kernels) < 2 or not any(k is tails[1] for k in kernels):
        return [(end, 0)] * len(kernels)
    share, of = TAIL_SHARE
    second = (vec - end) * share // of
    return [(vec - second, 0) if k is tails[1] else (end, second) for k in kernels]


def with_tails(steps: list[Node], matmul: Node, tails: list[Node]) -> list[Node]:
    """``steps`` with a step of each tail kernel right before each block of the chain's last
    matmul but its first, so merged with it (``rowblocks._kernels_before``): the tail's rows of a block
    are computed while the arrays multiply the next block, not all but the last block's rows
    beside the last block alone (2B4T layer on dlegion-8x8 at 512: 829,648 -> 827,511 cycles);
    the last block's rows follow the chain (``rowblocks._last_rows_beside``)."""
    first = min(k for k, n in enumerate(steps) if n is matmul)
    out = []
    for k, node in enumerate(steps):
        if node is matmul and k != first:
            out.extend(tails)
        out.append(node)
    return out
