"""Row kernels keep two blocks in flight on each Legion: the next block loads while the current
one computes."""
import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper

from isa import arch
from isa.instructions import DmaLoad
from dlegion_cc.pipeline import Options, compile_model
from runtime.emulator import run

WIDE = arch.load("dlegion-8x8")
ROWS, COLS = 4096, 512


def _softmax(tmp_path):
    node = helper.make_node("Softmax", ["x"], ["y"], axis=-1)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TP.FLOAT, [ROWS, COLS])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [ROWS, COLS])])
    path = tmp_path / "softmax.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), path)
    return compile_model(path, Options(WIDE))[1]


def test_blocks_alternate_halves_and_the_vector_unit_stays_busy(tmp_path):
    program = _softmax(tmp_path)
    half = WIDE.derived.spad_elems["vec"] // 2
    assert {i.dst.addr for i in program.instrs if isinstance(i, DmaLoad)} == {0, half}
    x = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    result = run(program, WIDE, {"x": x})
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(result.outputs["y"], e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)
    # Each block's load and store hide behind the vector work of its neighbours: the vector
    # queue of every Legion is busy nearly all the time (one block after another it was ~60%).
    tl = result.timeline
    vec = min(tl.busy[(legion, "vec")] for legion in range(WIDE.legions))
    assert vec >= 0.9 * tl.cycles, (vec, tl.cycles)
