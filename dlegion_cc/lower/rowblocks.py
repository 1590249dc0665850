"""Row blocks pipelined across nodes: the vector work of one row block runs while the arrays
multiply the next.

A row kernel after a quantized matmul needs whole rows of its output (an absmax over every
column), which a matmul that streams all its rows through each weight tile finishes only at
its end; with a barrier after every node the arrays then idle while the vector unit works.
A *chain* is a run of quantized matmuls and row kernels over the same M rows, each reading
rows of the ones before it only as the same rows (norm, quantize, matmul, ReLU^2 * up and
quantize, matmul, residual). Its rows are cut into a few blocks and the nodes emitted so
that one block's row kernels come before the next block of the matmul before them:

    R(0) R(1) | Q(0) S(0) Q(1) S(1) | T(0) U(0) T(1) U(1)

(row kernels before the first matmul first, then each matmul with the row kernels after
it, block by block). The queues of a Legion run in order, so the vector queue then drains
block 0, computes S(0) and drains block 1 while the arrays multiply block 1. The barriers
between the steps are replaced by the waits that keep them ordered (``overlap.py``'s rewrite
of the chain alone), which the race check proves. Each matmul re-reads its weights once per
block: ``blocks`` weighs that against the vector work hidden.
"""
from __future__ import annotations

import math

import numpy as np

from isa.arch import MODE_BITS, Arch
from isa.program import Program
from dlegion_cc.ir import DLEGION, Node
from dlegion_cc.lower import carry
from dlegion_cc.lower.context import Lowering
from dlegion_cc.lower.fused import row_kernel_blocks
from dlegion_cc.lower.overlap import _Rewrite
from dlegion_cc.lower.qmatmul import mode_for, pick_mode, qmatmul_blocks

MATMUL, ROWS = (DLEGION, "QMatMul"), (DLEGION, "RowKernel")
MOST_BLOCKS = 4
# Rows of a block below which a matmul's passes are mostly fill and drain.
FEWEST_ROWS = 64


def plan(low: Lowering, nodes: list[Node], at: int) -> tuple[list[Node], list[range]]:
    """The chain starting at ``nodes[at]`` and its row blocks; no nodes when there is no chain
    or one block is best."""
    chain = chain_at(low, nodes, at)
    if not chain:
        return [], []
    arch, M = low.em.arch, _rows(low, chain[0])
    count = blocks(arch, chain, M)
    return (chain, split(M, count, arch.array)) if count > 1 else ([], [])


def chain_at(low: Lowering, nodes: list[Node], at: int) -> list[Node]:
    """The chain starting at ``nodes[at]`` (empty when there is none): the longest run of
    matmuls and row kernels over the same rows, each but the first reading an output of the
    run, with at least one matmul and one row kernel."""
    rows = _rows(low, nodes[at])
    if rows is None:
        return []
    chain, made = [nodes[at]], set(nodes[at].outputs)
    for node in nodes[at + 1:]:
        if _rows(low, node) != rows or not made & set(node.inputs) or carry.pending(low, node):
            break
        chain.append(node)
        made |= set(node.outputs)
    kinds = {(n.domain, n.op) for n in chain}
    if carry.pending(low, chain[0]) or kinds != {MATMUL, ROWS}:
        return []
    return chain


def _rows(low: Lowering, node: Node) -> int | None:
    """The rows a chain node works on, None when it cannot be one."""
    key = (node.domain, node.op)
    if key == MATMUL:
        w = node.attrs.get("weight")
        if w is None or np.ndim(w) != 2 or not node.inputs or not low.shape(node.inputs[0]):
            return None
        rows = math.prod(low.shape(node.inputs[0])[:-1])
        return rows if all(math.prod(low.shape(o)[:-1]) == rows for o in node.outputs) else None
    if key == ROWS:
        frame = node.attrs["frame"]
        if len(frame.shape) < 2 or math.prod(frame.shape[:-2]) != 1 or _causal(node):
            return None
        if any(_frame_rows(node, n) not in (None, frame.shape[-2]) for n in node.inputs + node.outputs):
            return None
        return frame.shape[-2]
    return None


def _causal(node: Node) -> bool:
    return any(n.op in ("Softmax", "Trilu") or "reach" in n.attrs for n in node.attrs["nodes"])


def _frame_rows(node: Node, name: str) -> int | None:
    """Rows of a kernel value that has the frame's rows (None: one row every row reads alike)."""
    shape = node.attrs["values"][name].shape
    return math.prod(shape[:-1]) if shape and math.prod(shape[:-1]) > 1 else None


def blocks(arch: Arch, chain: list[Node], M: int) -> int:
    """How many row blocks: the fewest cycles of max(passes, weight reads) of each matmul (the
    weights read once per block) plus the vector work of the row kernels left unhidden (one
    block's worth, the rest runs while the arrays multiply)."""
    d = arch.derived
    mats = [_matmul_cycles(arch, n, M) for n in chain if (n.domain, n.op) == MATMUL]
    vector = sum(_vector_cycles(arch, n) for n in chain if (n.domain, n.op) == ROWS)

    def cycles(b: int) -> float:
        passes = sum(max(mac * (1 + b * d.pass_overhead / M), b * wgt) for mac, wgt in mats)
        return passes + vector / b

    fits = [b for b in range(1, MOST_BLOCKS + 1) if M // b >= FEWEST_ROWS]
    return min(fits, key=cycles) if fits else 1


def _matmul_cycles(arch: Arch, node: Node, M: int) -> tuple[float, float]:
    """(cycles of the arrays at peak, cycles of reading the weights once) of a chain matmul."""
    w = np.asarray(node.attrs["weight"])
    mode = pick_mode(arch, mode_for(w) or "w8")
    K, N = w.shape
    d = arch.derived
    return M * K * N / d.macs_per_cycle[mode], K * N * MODE_BITS[mode] / 8 / d.dram_bytes_per_cycle


def _vector_cycles(arch: Arch, node: Node) -> float:
    """The lane operations of a row kernel over every lane of every Legion: one a member op and
    element of its frame."""
    return len(node.attrs["nodes"]) * math.prod(node.attrs["frame"].shape) / (arch.vector_lanes * arch.legions)


def split(M: int, count: int, align: int) -> list[range]:
    """``count`` row ranges covering ``M``, all but the last a multiple of ``align`` rows."""
    step = math.ceil(M / count / align) * align
    return [range(r, min(r + step, M)) for r in range(0, M, step)]


def lower_chain(low: Lowering, chain: list[Node], ranges: list[range], regions: list, region_name) -> None:
    """Emit ``chain`` in the row blocks ``ranges`` (the module docstring), each step opening a
    region named after its node, ordered by waits instead of barriers."""
    em, arch = low.em, low.em.arch
    start, mine = len(em.instrs), []
    for node, step in _order(low, chain, ranges):
        at = len(em.instrs)
        low.schedules.begin(node.name)
        next(step)
        if len(em.instrs) > at:
            mine.append((at - start, region_name(node)))
            em.barrier()
    program = Program(arch.name, list(em.tensors), em.instrs[start:])
    out, starts = _Rewrite(program, arch).run()
    em.instrs[start:] = out
    regions += [(start + (starts[k] if k < len(starts) else len(out)), name) for k, name in mine]


def _order(low: Lowering, chain: list[Node], ranges: list[range]):
    """(node, its generator) for each step of the chain, in the pipelined order."""
    steps = {n.name: (qmatmul_blocks if (n.domain, n.op) == MATMUL else row_kernel_blocks)(low, n, ranges)
             for n in chain}
    first = next(k for k, n in enumerate(chain) if (n.domain, n.op) == MATMUL)
    for n in chain[:first]:
        for _ in ranges:
            yield n, steps[n.name]
    segment = []
    for n in chain[first:] + [None]:
        if segment and (n is None or (n.domain, n.op) == MATMUL):
            for _ in ranges:
                for m in segment:
                    yield m, steps[m.name]
            segment = []
        if n is not None:
            segment.append(n)
    for step in steps.values():
        for _ in step:
            raise AssertionError("a chain node has more row blocks than the chain")
