"""A cache's copy into ``present`` carried by the loads of the float matmul that reads it
(dlegion_cc/lower/carry.py), when the cache is not bound inside ``present`` (``cache_alias``
off; tests/test_cache_alias.py has the default): the past is read once, the outputs are
onnxruntime's, and the race check accepts the program."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from isa import arch
from isa.instructions import DmaLoad, DmaStore
from dlegion_cc.pipeline import Options, compile_model
from runtime.check import compare, onnx_reference
from runtime.emulator import random_inputs, run

HEADS, PAST, D = 3, 70, 8


def _attention(path, also_added: bool = False) -> None:
    """scores = q @ present_k^T, out = scores @ present_v, present_* = Concat(past_*, new_*);
    ``also_added``: present_k also feeds an Add (a reader that is no matmul)."""
    f = TensorProto.FLOAT
    shape = lambda s: [1, HEADS, s, D]
    nodes = [helper.make_node("Concat", ["past_k", "new_k"], ["present_k"], axis=2),
             helper.make_node("Concat", ["past_v", "new_v"], ["present_v"], axis=2),
             helper.make_node("Transpose", ["present_k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["scores"]),
             helper.make_node("MatMul", ["scores", "present_v"], ["out"])]
    outputs = [helper.make_tensor_value_info(n, f, s) for n, s in
               (("out", shape(1)), ("present_k", shape(PAST + 1)), ("present_v", shape(PAST + 1)))]
    if also_added:
        nodes.append(helper.make_node("Add", ["present_k", "present_k"], ["twice"]))
        outputs.append(helper.make_tensor_value_info("twice", f, shape(PAST + 1)))
    inputs = [helper.make_tensor_value_info(n, f, s) for n, s in
              (("q", shape(1)), ("past_k", shape(PAST)), ("new_k", shape(1)),
               ("past_v", shape(PAST)), ("new_v", shape(1)))]
    graph = helper.make_graph(nodes, "carry", inputs, outputs)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def _read_elements(program, name: str) -> int:
    t = next(i for i, t in enumerate(program.tensors) if t.io_name == name)
    return sum(i.rows * i.cols * (i.span or 1) for i in program.instrs
               if isinstance(i, DmaLoad) and i.src.tensor == t)


def _stores_to(program, name: str) -> int:
    t = next(i for i, t in enumerate(program.tensors) if t.io_name == name)
    return sum(1 for i in program.instrs if isinstance(i, DmaStore) and i.dst.tensor == t)


@pytest.mark.parametrize("also_added", [False, True])
def test_the_past_is_read_once_and_the_outputs_are_onnxruntimes(tmp_path, also_added):
    path = tmp_path / "carry.onnx"
    _attention(path, also_added)
    machine = arch.load("dlegion-tiny")
    _, program = compile_model(path, Options(machine, cache_alias=False))
    # Carried: read once, by the products' loads. Else copied by the concat (read once too),
    # and the products read present.
    for past in ("past_k", "past_v"):
        assert _read_elements(program, past) == HEADS * PAST * D
    assert (_stores_to(program, "present_v") > 0) and (_read_elements(program, "present_v") < HEADS * PAST * D)
    if not also_added:
        assert _read_elements(program, "present_k") < HEADS * PAST * D
    inputs = random_inputs(program, 0)
    outputs = run(program, machine, inputs).outputs         # the race check runs too
    result = compare(outputs, onnx_reference(path, inputs))
    assert all(r.ok for r in result), result
    for name in ("present_k", "present_v"):
        np.testing.assert_array_equal(outputs[name][:, :, :PAST], inputs["past_" + name[-1]])
