"""Float products of a few query rows on fewer heads than Legions (a decode step's QK^T and P.V
per key/value head, dlegion_cc/lower/fmatmul.py ``spread_heads``): each head's columns go to
Legions in parts, so every Legion works; the result is numpy's and the race check accepts it."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from isa import arch
from isa.instructions import VMatMul
from dlegion_cc.lower.fmatmul import TILE
from dlegion_cc.pipeline import Options, compile_model
from runtime.emulator import random_inputs, run

EIGHT = arch.load("dlegion-8x8")


def _product(path, heads: int, M: int, K: int, N: int) -> None:
    f = TensorProto.FLOAT
    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "heads",
                          [helper.make_tensor_value_info("a", f, [1, heads, M, K]),
                           helper.make_tensor_value_info("b", f, [1, heads, K, N])],
                          [helper.make_tensor_value_info("c", f, [1, heads, M, N])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


@pytest.mark.parametrize("heads, M, K, N", [(5, 4, 128, 65), (5, 4, 65, 128), (3, 8, 200, 40), (5, 4, 513, 128)])
def test_few_heads_use_every_legion_and_give_numpys_product(tmp_path, heads, M, K, N):
    path = tmp_path / "heads.onnx"
    _product(path, heads, M, K, N)
    _, program = compile_model(path, Options(EIGHT))
    legions = {i.legion for i in program.instrs if isinstance(i, VMatMul)}
    assert legions == set(range(EIGHT.legions))
    inputs = random_inputs(program, 0)
    got = run(program, EIGHT, inputs).outputs["c"]        # the race check runs too
    want = inputs["a"].astype(np.float64) @ inputs["b"].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(K))


def test_a_product_shorter_than_a_dram_round_trip_keeps_one_legion_per_head(tmp_path):
    """A first token's P.V (one key deep): each head on a Legion of one span, one product per
    block of its columns for all the heads, not one per head and part; still numpy's product."""
    heads, M, K, N = 5, 4, 1, 128
    assert M * K * N / EIGHT.vector_lanes < EIGHT.dram_latency_cycles
    path = tmp_path / "heads.onnx"
    _product(path, heads, M, K, N)
    _, program = compile_model(path, Options(EIGHT))
    products = [i for i in program.instrs if isinstance(i, VMatMul)]
    assert {i.span for i in products} == {heads} and len(products) == -(-N // TILE)
    inputs = random_inputs(program, 0)
    got = run(program, EIGHT, inputs).outputs["c"]
    np.testing.assert_array_equal(got, inputs["a"] @ inputs["b"])    # one product each: exact


def test_a_2b4t_decode_step_copying_its_cache_is_onnxruntimes(tmp_path):
    """Without the cache bound in present, the products' loads carry its copy (lower/carry.py)
    while each head's keys and values are cut across Legions: still onnxruntime's outputs."""
    from models.bitnet import build_bitnet, preset, save
    from runtime.check import compare, onnx_reference
    path = tmp_path / "decode.onnx"
    save(build_bitnet(preset("2b4t", layers=1, seq=1, vocab=512, past=64)), path, external_data=True)
    _, program = compile_model(path, Options(EIGHT, cache_alias=False))
    assert not program.aliases
    inputs = random_inputs(program, 0)
    got = run(program, EIGHT, inputs).outputs           # the race check runs too
    assert all(r.ok for r in compare(got, onnx_reference(path, inputs)))
