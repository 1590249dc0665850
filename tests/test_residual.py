"""A residual Add in the drain of the quantized matmul before it (``passes/residual.py``): one
fp32 addition of the same two values, so the sum is bit for bit the one the Add's kernel made;
the matmul's product is no longer stored and read back."""
import numpy as np
import onnx
import pytest

from isa import arch
from isa.instructions import DmaStore
from dlegion_cc.passes.residual import ResidualInDrain
from models.bitnet import BitLinear, preset
from models.decoder import rms_norm
from models.graph import FLOAT, GraphBuilder, tensor_info
from runtime.check import compare, onnx_reference
from runtime.emulator import run
from progbuild import assert_bitwise_equal, assert_matches_onnx, compile_without
from runtime.timing import simulate

TINY, EIGHT = arch.load("dlegion-tiny"), arch.load("dlegion-8x8")


def _block(path, rows, depth, seed=3, product_out=False):
    """x + down(quantize(x)), then an RMS norm and one more projection of it, as a decoder
    layer's last projection and the next layer's start; ``product_out``: down's product is an
    output too (then it has a reader besides the Add). One quantization before each matmul:
    a second on fp32 products, which onnxruntime sums in another order, may round a value
    to the next integer (in the program without the pass alike)."""
    b, rng = GraphBuilder(), np.random.default_rng(seed)
    linear = BitLinear(preset("tiny", seed=seed, block=8), rng)
    down = linear.project(b, linear.prepare(b, "x"), "down_proj", depth, depth)
    h = b.op("Add", "x", down)
    after = linear.project(b, linear.prepare(b, rms_norm(b, h, "norm", depth, 1e-5, rng)), "next", depth, depth)
    outs = [(h, depth), (after, depth)] + ([(down, depth)] if product_out else [])
    onnx.save(b.model([tensor_info("x", FLOAT, [1, rows, depth])],
                      [tensor_info(o, FLOAT, [1, rows, n]) for o, n in outs]), path)
    return path, {"x": rng.standard_normal((1, rows, depth)).astype(np.float32)}


def _residual_nodes(graph) -> list:
    return [n for n in graph.nodes if n.op == "QMatMul" and len(n.inputs) > 3 and n.inputs[3]]


@pytest.mark.parametrize("machine, rows, depth, row_blocks", [
    (TINY, 6, 48, True), (TINY, 40, 32, True), (EIGHT, 256, 512, True), (EIGHT, 256, 512, False)])
def test_the_sum_in_the_drain_is_the_add_kernels_bit_for_bit(tmp_path, machine, rows, depth, row_blocks):
    path, inputs = _block(tmp_path / "block.onnx", rows, depth)
    graph, program = compile_without(path, machine, None, row_blocks)
    [node] = _residual_nodes(graph)
    assert node.inputs[3] == "x" and not any(n.op == "Add" and "x" in n.inputs for n in graph.nodes)
    ours = run(program, machine, inputs).outputs                          # race-checked
    assert_matches_onnx(ours, path, inputs)
    apart_graph, apart = compile_without(path, machine, ResidualInDrain, row_blocks)
    assert not _residual_nodes(apart_graph)
    theirs = run(apart, machine, inputs).outputs
    assert ours.keys() == theirs.keys()
    assert_bitwise_equal(ours, theirs)


def test_a_product_read_elsewhere_stays_a_product(tmp_path):
    path, inputs = _block(tmp_path / "block.onnx", 6, 48, product_out=True)
    graph, program = compile_without(path, TINY)
    assert not _residual_nodes(graph)
    for row in compare(run(program, TINY, inputs).outputs, onnx_reference(path, inputs)):
        assert row.ok, f"{row.name}: relative L2 {row.rel_l2:.2e}"


def test_the_product_is_not_stored(tmp_path):
    """down's product is no longer written to DRAM and read back with the residual: only their
    sum is written (its one reader, the norm, then loads it alone), and the program is faster."""
    path, _ = _block(tmp_path / "block.onnx", 512, 1024)
    moved = {}
    for fused in (True, False):
        _, program = compile_without(path, EIGHT, None if fused else ResidualInDrain, row_blocks=False)
        stored = sum(i.rows * i.cols * 4 for i in program.instrs if isinstance(i, DmaStore)
                     and program.tensors[i.dst.tensor].dtype == "f32")
        moved[fused] = (stored, simulate(program, EIGHT).cycles)
    assert moved[True][0] < moved[False][0]
    assert moved[True][1] < moved[False][1]
