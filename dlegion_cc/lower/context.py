"""The state of lowering one graph: which DRAM view holds each value, and the op registry."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from dlegion_cc.errors import node_error
from dlegion_cc.ir import DLEGION, Graph, Mapped, Node
from dlegion_cc.lower.emitter import Emitter
from dlegion_cc.lower.layout import Operand, is_contiguous, reshaped, transposed, whole

DRAM_DTYPE = {np.dtype(np.float32): "f32", np.dtype(np.int64): "i64", np.dtype(np.int32): "i32",
              np.dtype(np.int8): "i8", np.dtype(np.uint8): "u8", np.dtype(np.bool_): "u8"}
ATTENTION_MASK = "attention_mask"       # the name transformers' exporters give a decoder's mask input



@dataclass(frozen=True)
class Switches:
    """Features of the lowering a user may turn off to measure what each is worth, and what
    the schedules of quantized matmuls are chosen for (``qplan.OBJECTIVES``)."""

    multicast: bool = True        # one DRAM read of the activations serves every Legion
    accumulators: bool = True     # the parallel accumulators sum a pass's K-slices across cores
    sparsity: bool = True         # all-zero weight blocks are neither loaded nor multiplied
    prefetch: bool = True         # a matmul's first weights load while the node before it runs
    overlap: bool = True          # nodes end in waits for what the next ones share, not barriers
    objective: str = "latency"    # fewest cycles; or fewest joules ("energy"), or their product ("edp")
    transfers: bool = True        # activations read once and forwarded Legion to Legion (noc.mv)
    row_blocks: bool = True       # matmuls and row kernels pipelined by row blocks (rowblocks.py)
    head_groups: bool = True      # attention's products and softmax pipelined by head groups (heads.py)
    cache_alias: bool = True      # a concat's graph-input part lives inside the output (``Lowering.cache_alias``)
    ksplit: bool = True           # K split over the Legions where it beats the searched plan (ksplit.py)


Lowerer = Callable[["Lowering", Node], None]
LOWERINGS: dict[tuple[str, str], Lowerer] = {}
# Lowerings that read their inputs through ``Operand`` strides, with what each needs of a
# strided view ``op`` of its input ``name`` (``Lowering.view``): ``test(node, name, op)``.
ViewTest = Callable[[Node, str, Operand], bool]
VIEW_READERS: dict[tuple[str, str], ViewTest] = {}
# Lowerings that write their output through the strides ``Lowering.result`` gives, with what
# each needs of them: ``test(node, name, op)`` as for reading.
VIEW_WRITERS: dict[tuple[str, str], ViewTest] = {}
# Nodes that only change how a value's elements are addressed (``Lowering.through_views``).
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose"})


def perm_of(node: Node, rank: int) -> list[int]:
    """A Transpose's axis order (ONNX's default: reversed)."""
    return list(node.attrs.get("perm", range(rank)[::-1]))


def any_view(node: Node, name: str, op: Operand) -> bool:
    return True


def row_view(node: Node, name: str, op: Operand) -> bool:
    """Rows of consecutive elements (or one element repeated), as a row block loads them."""
    return op.strides[-1] in (0, 1)


def _no_view(node: Node, name: str, op: Operand) -> bool:
    return False


def lowers(*ops: str, domain: str = "", views: ViewTest | None = None, writes: ViewTest | None = None):
    """Register a lowering for ONNX op types ``ops``; ``views``: it reads strided views of
    other values that pass this test (else only a contiguous value, from its start);
    ``writes``: it writes its output to strided views that pass this test (else only to a
    contiguous tensor)."""
    def deco(fn: Lowerer) -> Lowerer:
        for op in ops:
            LOWERINGS[(domain, op)] = fn
            if views is not None:
                VIEW_READERS[(domain, op)] = views
            if writes is not None:
                VIEW_WRITERS[(domain, op)] = writes
        return fn
    return deco


class Lowering:
    """Maps graph values to DRAM operands while nodes are lowered in order."""

    def __init__(self, graph: Graph, em: Emitter, switches: Switches = Switches(), schedules=None):
        from dlegion_cc.lower.schedules import Schedules     # it imports this module
        # A switch turns a feature off, never on: a machine without multicast gets none whatever
        # the caller asked (the parallel accumulators are checked where splits are chosen).
        self.graph, self.em = graph, em
        self.schedules = schedules if schedules is not None else Schedules()     # quantized matmuls'
        self.rewrites: dict = {}      # overlap.reused's: kernels each layer repeats
        self.switches = replace(switches, multicast=switches.multicast and em.arch.multicast)
        self.operands: dict[str, Operand] = {}
        self.int8 = int8_activations(graph)
        self.written: dict = {}       # (Legion, space) -> scratchpad ranges written so far

    def shape(self, name: str) -> tuple[int, ...]:
        return self.graph.values[name].shape

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self.graph.values[name].dtype)

    def const(self, name: str) -> np.ndarray | None:
        return self.graph.const(name) if name else None

    def scalar(self, name: str) -> float | None:
        """The fp32 value of a one-element constant, else None."""
        c = self.const(name)
        return None if c is None or c.size != 1 else float(np.float32(c.reshape(())))

    def operand(self, name: str) -> Operand:
        if name in self.operands:
            return self.operands[name]
        stored = self.graph.stored(name) if name else None
        if stored is None:
            raise KeyError(f"value '{name}' is used before it is computed")
        if not isinstance(stored, Mapped) or stored.dtype != np.float32:
            stored = np.ascontiguousarray(stored, dtype=np.float32)
        self.operands[name] = whole(self.em.const(name, stored, "f32"), stored.shape)
        return self.operands[name]

    def result(self, name: str) -> Operand:
        """Where ``name`` is written: its part of the concat that is its only reader (``in_concat``),
        where the reshapes and transposes that are its only readers put it (``through_views``),
        else a fresh contiguous DRAM tensor, an output tensor if the graph returns it."""
        placed = self.in_concat(name)
        if placed is None:
            placed = self.through_views(name)
        if placed is not None:
            self.operands[name] = placed
            return placed
        shape = self.shape(name)
        if name in self.graph.outputs:
            dtype = DRAM_DTYPE.get(self.dtype(name))
            idx = self.em.tensor(name, dtype or "f32", shape, "output", io_name=name)
        else:
            idx = self.em.tensor(name, "i8" if name in self.int8 else "f32", shape, "scratch", io_name=name)
        self.operands[name] = whole(idx, shape)
        return self.operands[name]

    def destination(self, name: str) -> Operand:
        """Where ``name`` is written: where an input written in place already put it, else
        ``result``."""
        return self.operands.get(name) or self.result(name)

    def in_concat(self, name: str) -> Operand | None:
        """``name``'s part of the Concat output, when that Concat is its one reader and its
        producer writes strided results (``lowers``' ``writes``): the Concat then copies
        nothing of it. None otherwise."""
        readers = self.graph.consumers(name)
        if name in self.graph.outputs or len(readers) != 1:
            return None
        cat = readers[0]
        if (cat.op, cat.domain) != ("Concat", "") or cat.inputs.count(name) != 1:
            return None
        if (name in self.int8) != (cat.outputs[0] in self.int8):    # int8 parts of an int8 whole
            return None
        producer, out = self.graph.producer(name), cat.outputs[0]
        writes = VIEW_WRITERS.get((producer.domain, producer.op)) if producer is not None else None
        if writes is None or self.dtype(out) != self.dtype(name):
            return None
        dst = self.destination(out)
        axis = cat.attrs["axis"] % len(dst.strides)
        pos = sum(self.shape(i)[axis] for i in cat.inputs[:cat.inputs.index(name)])
        part = Operand(dst.tensor, dst.offset + pos * dst.strides[axis], dst.strides)
        return part if writes(producer, name, part) else None

    def through_views(self, name: str) -> Operand | None:
        """``name`` written where a chain of reshapes and transposes puts it, when each value of
        the chain has that one reader and the producer writes strided results (``lowers``'
        ``writes``): the chain is then views, and nothing is copied (attention's heads merged
        back after P.V). None otherwise."""
        producer = self.graph.producer(name)
        writes = VIEW_WRITERS.get((producer.domain, producer.op)) if producer is not None else None
        chain, end = self._view_chain(name)
        if (writes is None or not chain or self._applied(chain, whole(-1, self.shape(name))) is not None
                or self._undone(chain, whole(-1, self.shape(end))) is None):
            return None                # nothing to place, or the chain is views already
        op = self._undone(chain, self.destination(end))
        # Rows of consecutive elements, as every strided writer stores them.
        return op if op is not None and op.strides[-1] == 1 and writes(producer, name, op) else None

    def _view_chain(self, name: str) -> tuple[list[Node], str]:
        """The reshapes and transposes that follow ``name``, each its value's one reader, and the
        value at the end, which keeps ``name``'s dtype and is not a graph output."""
        chain, cur = [], name
        while cur not in self.graph.outputs and cur not in self.int8:
            readers = self.graph.consumers(cur)
            if (len(readers) != 1 or readers[0].domain or readers[0].op not in VIEW_OPS
                    or readers[0].inputs[0] != cur):
                break
            chain.append(readers[0])
            cur = readers[0].outputs[0]
        while chain and (cur in self.graph.outputs or self.dtype(cur) != self.dtype(name)):
            cur = chain.pop().inputs[0]
        return chain, cur

    def _applied(self, chain: list[Node], op: Operand) -> Operand | None:
        """What the chain makes of ``op`` as views; None where one of its nodes needs a copy."""
        for node in chain:
            src, out = self.shape(node.inputs[0]), self.shape(node.outputs[0])
            op = transposed(op, perm_of(node, len(src))) if node.op == "Transpose" else reshaped(op, src, out)
            if op is None:
                return None
        return op

    def _undone(self, chain: list[Node], op: Operand) -> Operand | None:
        """The operand of the chain's first input that the chain turns into ``op``."""
        for node in reversed(chain):
            src, out = self.shape(node.inputs[0]), self.shape(node.outputs[0])
            if node.op == "Transpose":
                perm = perm_of(node, len(src))
                op = transposed(op, [perm.index(a) for a in range(len(perm))])
            else:
                op = reshaped(op, out, src)
            if op is None:
                return None
        return op

    def alias(self, name: str, src: str) -> bool:
        """Let ``name`` share ``src``'s DRAM as it is (``view``)."""
        return src in self.operands and self.view(name, self.operands[src])

    def view(self, name: str, op: Operand) -> bool:
        """Let ``name`` be ``op``, another value's DRAM read through strides (a reshape, a
        transpose, a slice, an expand): no copy. Every node reads a contiguous view from the
        tensor's start; any other view only nodes whose lowerings read it (``VIEW_READERS``).
        False when ``name`` needs a tensor of its own (a graph output has one)."""
        if name in self.graph.outputs:
            return False
        shape = self.shape(name)
        whole_tensor = math.prod(shape) == math.prod(self.em.tensors[op.tensor].shape)
        plain = op.offset == 0 and whole_tensor and is_contiguous(op, shape)
        if not plain and not all(VIEW_READERS.get((n.domain, n.op), _no_view)(n, name, op)
                                 for n in self.graph.consumers(name)):
            return False
        self.operands[name] = whole(op.tensor, shape) if plain else op      # size-1 axes' strides as usual
        return True

    def declare_inputs(self) -> None:
        for name in self.graph.inputs:
            dtype = DRAM_DTYPE.get(self.dtype(name))
            if dtype is None:
                raise node_error(self.graph.source, name, "input", f"dtype {self.dtype(name)} is not supported")
            idx = self.em.tensor(name, dtype, self.shape(name), "input", io_name=name,
                                 rng=self._index_range(name))
            self.operands[name] = self.cache_alias(name, idx) or whole(idx, self.shape(name))

    def cache_alias(self, name: str, idx: int) -> Operand | None:
        """Input ``name`` (tensor ``idx``) placed in its part of the graph output
        ``present = Concat(..., name, ...)`` when that concat is its one reader: the host binds
        it there (``Program.aliases``), so the concat copies nothing of it and the program writes
        only the other parts of ``present``. A decode step's key/value cache: the past is read
        where it lies and only the new token's rows are written, as deployed decoders share the
        past and present buffers. None when it does not apply or the switch is off."""
        readers = self.graph.consumers(name)
        if not self.switches.cache_alias or name in self.graph.outputs or len(readers) != 1:
            return None
        cat = readers[0]
        out = cat.outputs[0]
        if ((cat.op, cat.domain) != ("Concat", "") or cat.inputs.count(name) != 1 or out not in self.graph.outputs
                or self.dtype(out) != self.dtype(name) or DRAM_DTYPE.get(self.dtype(name)) != "f32"
                or not math.prod(self.shape(name))):
            return None
        dst = self.destination(out)
        axis = cat.attrs["axis"] % len(dst.strides)
        pos = sum(self.shape(i)[axis] for i in cat.inputs[:cat.inputs.index(name)])
        part = Operand(dst.tensor, dst.offset + pos * dst.strides[axis], dst.strides)
        tensors = self.em.tensors
        self.em.aliases[tensors[idx].name] = (tensors[dst.tensor].name, part.offset, tuple(part.strides))
        return part

    def _index_range(self, name: str) -> tuple[int, int] | None:
        """Token ids: the rows of the table they index, so random inputs are valid; a bool
        (stored as u8): 0 or 1; an integer attention mask: 1, one unpadded sequence as token
        generation feeds it (onnxruntime-genai's graphs count its ones into GroupQueryAttention's
        seqlens_k, which any other value makes invalid)."""
        if self.dtype(name) == np.bool_:
            return (0, 2)
        if name == ATTENTION_MASK and np.issubdtype(self.dtype(name), np.integer):
            return (1, 2)
        for n in self.graph.consumers(name):
            if n.op == "Gather" and n.inputs[1] == name:
                return (0, self.shape(n.inputs[0])[n.attrs.get("axis", 0)])
        return None


def int8_activations(graph: Graph) -> set[str]:
    """Values the arrays read as int8 activations that hold exact int8 integers (the output of
    Clip(Round(.), lo >= -128, hi <= 127), also inside a fused kernel): kept in DRAM as i8, so
    a quantized matmul streams them as they are instead of converting an fp32 copy first; a
    vector op reading them converts back to the same fp32 values."""
    producers = {o: sub for node in graph.nodes for sub in _members(node) for o in sub.outputs}
    out = set()
    for node in graph.nodes:
        if node.domain != DLEGION or node.op not in ("QMatMul", "AttnMatMul") or node.attrs.get("act_offset", 0):
            continue
        for name in node.inputs[:1] + node.inputs[4:5]:     # an AttnMatMul's a pieces
            _add_int8(graph, producers, name, out)
    return out


def _add_int8(graph: Graph, producers: dict, name: str, out: set[str]) -> None:
    """``name`` and the values it is made of, into ``out`` where they hold exact int8 integers."""
    while (name in producers and producers[name].op == "Reshape" and not producers[name].domain
           and len(graph.consumers(name)) == 1 and name not in graph.outputs):
        name = producers[name].inputs[0]        # a reshape of an int8 tensor is a view of it
    if name not in graph.outputs and _clipped_round(graph, producers, name):
        out.add(name)
    elif name not in graph.outputs and _clipped_parts(graph, producers, name):
        out.update([name, *producers[name].inputs])


def _members(node: Node) -> list[Node]:
    """The ONNX nodes a node stands for: a fused kernel's, or itself."""
    return node.attrs["nodes"] if node.domain == DLEGION and node.op == "RowKernel" else [node]


def _clipped_parts(graph: Graph, producers: dict, name: str) -> bool:
    """A Concat of clipped rounds (``_clipped_round``), each read by it alone: its parts are
    stored int8 where they go in it (``Lowering.in_concat``)."""
    cat = producers.get(name)
    return (cat is not None and cat.op == "Concat" and not cat.domain
            and all(p not in graph.outputs and len(graph.consumers(p)) == 1
                    and _clipped_round(graph, producers, p) for p in cat.inputs))


def _clipped_round(graph: Graph, producers: dict, name: str) -> bool:
    clip = producers.get(name)
    if clip is None or clip.op != "Clip" or clip.domain or len(clip.inputs) < 3:
        return False
    lo, hi = graph.const(clip.inputs[1]), graph.const(clip.inputs[2])
    if lo is None or hi is None or lo.size != 1 or hi.size != 1 or float(lo) < -128 or float(hi) > 127:
        return False
    rnd = producers.get(clip.inputs[0])
    return rnd is not None and rnd.op == "Round" and not rnd.domain
