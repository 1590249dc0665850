"""Weights loaded early across nodes in a 2B4T decode step: a projection's first weights load
during the last passes of the projection before it, and across a run of nodes that leave the
weight scratchpad alone (dlegion_cc/lower/prefetch.py). The step stays race-free and gives
onnxruntime's outputs."""
from functools import lru_cache

import numpy as np
import pytest

from isa import arch
from isa.instructions import DmaLoad, MatMul
from dlegion_cc.pipeline import Options, compile_model
from models.bitnet import build_bitnet, preset, save
from runtime.check import compare, onnx_reference
from runtime.emulator import random_inputs, run
from runtime.timing import simulate

EIGHT = arch.load("dlegion-8x8")


@lru_cache(maxsize=None)
def _step(tmp: str, prefetch: bool):
    path = f"{tmp}/decode.onnx"
    save(build_bitnet(preset("2b4t", layers=1, seq=1, vocab=512, past=64)), path, external_data=True)
    return path, compile_model(path, Options(EIGHT, prefetch=prefetch))[1]


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("decode"))
    return lambda prefetch=True: _step(tmp, prefetch)


def _entries(program) -> list[tuple[str, range]]:
    ends = [at for at, _ in program.regions[1:]] + [len(program.instrs)]
    return [(name, range(at, end)) for (at, name), end in zip(program.regions, ends)]


def test_the_next_projections_weights_load_during_the_last_passes(step):
    _, program = step()
    entries = _entries(program)
    tails = 0
    for n, (name, span) in enumerate(entries[1:-1], 1):
        before, after = entries[n - 1], entries[n + 1]
        if before[0] != after[0] or not any(isinstance(program.instrs[k], MatMul) for k in before[1]):
            continue
        loads = [program.instrs[k] for k in span]
        # inside a matmul's region, loads of another matmul's weights, each waiting for passes
        if all(isinstance(i, DmaLoad) and i.dst.space == "wgt" and i.wait is not None and i.wait.queue == "mat"
               for i in loads) and "mlp" in name:
            tails += 1
    assert tails >= 2          # gate/up's first weights in o_proj's tail, down's in gate/up's


def test_qkv_weights_load_across_the_embedding_and_the_norm(step):
    _, program = step()
    names = [name for name, _ in _entries(program)]
    qkv = next(n for n in names if "q_proj" in n)
    norm = next(n for n in names if "input_layernorm" in n)
    # the projection's first entry comes before the norm's first: its loads started in the
    # embedding's node, two nodes before it
    assert names.index(qkv) < names.index(norm)


def assert_race_free_onnxruntimes_and_plains(path, program, plain) -> None:
    """``program`` runs race-checked, within onnxruntime's tolerance, and computes the same bits
    as ``plain`` (the step compiled without the pass)."""
    inputs = random_inputs(program, 0)
    outputs = run(program, EIGHT, inputs).outputs          # the race check runs too
    assert all(r.ok for r in compare(outputs, onnx_reference(path, inputs)))
    want = run(plain, EIGHT, inputs).outputs
    assert all(np.array_equal(outputs[k], want[k]) for k in want)


def test_the_step_is_race_free_onnxruntimes_and_faster(step):
    path, program = step()
    _, plain = step(prefetch=False)
    assert_race_free_onnxruntimes_and_plains(path, program, plain)
    assert simulate(program, EIGHT).cycles < simulate(plain, EIGHT).cycles


def test_the_output_projections_weights_load_in_the_tails_of_attentions_products(step):
    _, program = step()
    entries = _entries(program)
    inside = {}
    for n, (name, span) in enumerate(entries[1:-1], 1):
        around = entries[n - 1][0]
        if "o_proj" in name and around == entries[n + 1][0] and "MatMul_5" in around:
            loads = [program.instrs[k] for k in span]
            assert all(isinstance(i, DmaLoad) and i.dst.space == "wgt" and i.wait is None for i in loads)
            inside.setdefault(around, set()).update(i.legion for i in loads)
    # in QK^T's and PV's nodes, on every Legion, each its own share on its own DMA queue
    assert len(inside) == 2 and all(ls == set(range(EIGHT.legions)) for ls in inside.values())
    # what moved is loaded once: the matmul's weight bytes are those of the program without it
    _, plain = step(prefetch=False)
    assert _weight_bytes(program) == _weight_bytes(plain)


def _weight_bytes(program) -> int:
    return sum(i.rows * i.cols * (i.span or 1) for i in program.instrs
               if isinstance(i, DmaLoad) and i.dst.space == "wgt")
