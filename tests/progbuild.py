"""Build small programs in Python for tests: declare tensors, append instructions.

    b = Builder("dlegion-tiny")
    x = b.tensor("x", "i8", [4, 16], "input")
    w = b.tensor("w", "w2", [16, 8], "const", values=weights)     # packed into the data bytes
    b.add(DmaLoad(0, frozenset({0}), View("act", 0, 16), DramRef(x, 0, 16), 4, 16))
    machine = b.machine()
"""
from __future__ import annotations

import numpy as np

from isa import arch as arch_mod
from isa.instructions import Instr
from isa.program import Program, Tensor, pack
from runtime.state import Machine


class Builder:
    def __init__(self, arch: str = "dlegion-tiny"):
        self.arch = arch_mod.load(arch)
        self.program = Program(arch=arch, data_file="test.data")
        self._data = bytearray()

    def tensor(self, name: str, dtype: str, shape, kind: str = "scratch", values=None,
               io_name: str | None = None) -> int:
        """Declare a tensor and return its index; a const packs ``values`` into the data bytes."""
        if io_name is None and kind in ("input", "output"):
            io_name = name
        t = Tensor(name, dtype, tuple(shape), kind, io_name=io_name)
        if kind == "const":
            t.offset = len(self._data)
            self._data += pack(np.asarray(values).reshape(t.shape), dtype).tobytes()
        self.program.tensors.append(t)
        return len(self.program.tensors) - 1

    def add(self, *instrs: Instr) -> "Builder":
        self.program.instrs.extend(instrs)
        return self

    def build(self) -> Program:
        self.program.data = bytes(self._data)
        return self.program

    def machine(self) -> Machine:
        return Machine(self.build(), self.arch)


def compile_without(path, machine, without: type | None = None, row_blocks: bool = True):
    """``path`` compiled for ``machine`` by every pass of the pipeline but those of class
    ``without`` (the ablation a pass's test compares with): the graph, and the program."""
    from dlegion_cc import pipeline
    passes = tuple(p for p in pipeline.PASSES if without is None or not isinstance(p, without))
    options = pipeline.Options(machine, row_blocks=row_blocks)
    graph = pipeline.import_model(path, {})
    for p in passes:
        p.run(graph, options)
        graph.remove_dead()
    return graph, pipeline.lower_graph(graph, machine, None, options.switches())


def assert_matches_onnx(outputs: dict, path, inputs: dict) -> None:
    """Every output of a program within the tolerance of onnxruntime's run of ``path``."""
    from runtime.check import compare, onnx_reference
    for row in compare(outputs, onnx_reference(path, inputs)):
        assert row.ok, f"{row.name}: relative L2 {row.rel_l2:.2e}"


def assert_bitwise_equal(ours: dict, theirs: dict) -> None:
    """Every output of ``theirs`` (the program a rewrite is compared with) equal in ``ours``, bit for bit."""
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name])
