"""Lowering a whole graph: nodes in order, each followed by a barrier when it emitted work.

Each node that emits work opens a region of the program (``.region``) named after the ONNX
node(s) it came from, so reports and traces can point back at the model.
"""
from __future__ import annotations

from typing import IO

from isa.arch import Arch
from isa.program import Program
from isa.progress import SILENT, Progress
from dlegion_cc.errors import UnsupportedNodes
from dlegion_cc.ir import DLEGION, Graph, Node
from dlegion_cc.lower import carry, heads, rowblocks
from dlegion_cc.lower import elementwise, fmatmul, fused, movement, qmatmul, quant, reduce  # noqa: F401
from dlegion_cc.lower.context import LOWERINGS, Lowering, Switches
from dlegion_cc.lower.concurrent import side_by_side
from dlegion_cc.lower.earlyloads import load_early
from dlegion_cc.lower.emitter import ConstData, Emitter
from dlegion_cc.lower.movement import nd_copy
from dlegion_cc.lower.overlap import overlap
from dlegion_cc.lower.prefetch import prefetch_weights
from dlegion_cc.lower.spanwaits import span_waits


def lower_graph(graph: Graph, arch: Arch, data_file: str | None, switches: Switches = Switches(),
                progress: Progress = SILENT, data_out: IO[bytes] | None = None, schedules=None) -> Program:
    """The program for ``graph``; its constants go to ``data_out`` as each node is lowered
    (then the program carries no data), else they are kept in ``Program.data``. ``schedules``
    (``schedules.Schedules``): quantized matmuls' pinned schedules, and where the given ones go."""
    em = Emitter(arch, graph.source, data=ConstData(data_out))
    low = Lowering(graph, em, switches, schedules)
    low.declare_inputs()
    problems, regions = [], []
    with progress.task("lowering", len(graph.nodes)) as advance:
        at = 0
        while at < len(graph.nodes):
            attention, groups = heads.plan(low, graph.nodes, at) if switches.head_groups else ({}, [])
            chain, ranges = rowblocks.plan(low, graph.nodes, at) if switches.row_blocks and not attention else ([], [])
            if attention:           # attention's products and softmax pipelined by head groups
                _lower_attention(low, attention, groups, problems, regions)
                ahead = attention["ahead"].get("kernels", []) + attention["ahead"].get("views", [])
                for node in (*ahead, attention["qk"], attention["softmax"], attention["pv"]):
                    _record_approximations(em, node)
                chain = [*ahead, attention["qk"], attention["softmax"], attention["pv"],
                         *attention["between"]["before"], *attention["between"]["after"]]
            elif chain:               # matmuls and row kernels pipelined by row blocks
                _lower_chain(low, chain, ranges, problems, regions)
            else:
                _lower_node(low, graph.nodes[at], problems, regions)
            lowered = len(chain) or 1
            for _ in range(lowered):
                advance()
            at += lowered
    if problems:
        raise UnsupportedNodes(graph.source, problems)
    start = len(em.instrs)
    if carry.settle(low):           # a concat's copy no matmul was left to carry (none expected)
        em.barrier()
        regions.append((start, "copies left to a matmul"))
    low.schedules.finish(graph.source)
    _materialize_outputs(low, regions)
    program = em.program(data_file)
    program.regions = regions
    program = side_by_side(program, arch)
    program = prefetch_weights(program, arch) if switches.prefetch else program
    program = load_early(program, arch) if switches.prefetch else program
    program = overlap(program, arch) if switches.overlap else program
    return span_waits(program)


def _lower_node(low: Lowering, node: Node, problems: list, regions: list) -> None:
    em = low.em
    fn = LOWERINGS.get((node.domain, node.op))
    if fn is None:
        problems.append((node.name, node.op, "no lowering for this operator"))
        return
    before = len(em.instrs)
    low.schedules.begin(node.name)
    waiting = carry.pending(low, node)
    if waiting and not carry.reads_by_loads(node) and carry.settle(low, waiting):
        em.barrier()                # it reads a concat output a matmul's loads were to finish
    if not _reported(problems, node, lambda: fn(low, node)):
        return
    if waiting and node.op == "MatMul" and not node.domain:
        carry.settle(low, waiting)  # what its loads did not carry (blocks a causal mask skips)
    _record_approximations(em, node)
    if len(em.instrs) > before:
        em.barrier()
        regions.append((before, region_name(node)))


def _lower_attention(low: Lowering, attention: dict, groups: list, problems: list, regions: list) -> None:
    """``heads.lower_attention``, its failures reported as a node's (its QK^T's)."""
    if _reported(problems, attention["qk"],
                 lambda: heads.lower_attention(low, attention, groups, _lower_node, regions, region_name)):
        low.em.barrier()


def _lower_chain(low: Lowering, chain: list[Node], ranges: list[range], problems: list, regions: list) -> None:
    """``rowblocks.lower_chain``, its failures reported as a node's (its first's)."""
    if _reported(problems, chain[0], lambda: rowblocks.lower_chain(low, chain, ranges, regions, region_name, _lower_node)):
        low.em.barrier()
        for node in chain:
            _record_approximations(low.em, node)


def _reported(problems: list, node: Node, lower) -> bool:
    """Whether ``lower()`` lowered; if not, its failure is among ``problems``, named by ``node``.
    A KeyError is a value not computed: an input whose producer already failed, whose failure
    is reported (a chain after the 2B4T attention that found no tiling at 4096), or else a bug,
    which must not pass for a program."""
    try:
        lower()
    except KeyError:
        if not problems:
            raise
        return False
    except (ValueError, MemoryError) as e:
        problems.append((node.name, node.op, str(e)))
        return False
    return True


def _record_approximations(em: Emitter, node: Node) -> None:
    for name, value in _approximations(node):
        made = em.approximations.setdefault(name, [])
        if value is not None and value not in made:
            made.append(value)


def _approximations(node: Node) -> list[tuple[str, str | None]]:
    """What a node (or the members of a fused kernel) computes instead of ONNX's semantics, each
    with the model's value it is made in when it names one (``approximated``: an attention
    product's output)."""
    members = node.attrs.get("nodes", []) if node.domain == DLEGION and node.op == "RowKernel" else []
    return [(n.attrs["approximation"], n.attrs.get("approximated")) for n in (node, *members)
            if "approximation" in n.attrs]


NAMED_IN_FULL = 3       # a longer fused run is named by its first and last nodes


def region_name(node: Node) -> str:
    """The ONNX node names a lowered node covers, joined by "+": a fused kernel's (its first
    and last with "..." between when there are many, so a line stays readable), else its own
    (a recognized matmul keeps the name of the MatMul it replaced)."""
    if node.domain != DLEGION or node.op != "RowKernel":
        return node.name
    names = [n.name for n in node.attrs["nodes"]]
    if len(names) > NAMED_IN_FULL:
        names = [names[0], "...", names[-1]]
    return "+".join(names)


def _materialize_outputs(low: Lowering, regions: list) -> None:
    """Graph outputs that no node wrote (an input passed through): copy them."""
    declared = {t.io_name for t in low.em.tensors if t.kind == "output"}
    for name in low.graph.outputs:
        if name in declared:
            continue
        src = low.operands[name] if name in low.operands else low.operand(name)
        low.operands.pop(name, None)
        dst = low.result(name)
        regions.append((len(low.em.instrs), f"copy to output {name}"))
        nd_copy(low.em, dst, src, low.shape(name))
        low.em.barrier()
