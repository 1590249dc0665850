"""Neighbouring nodes that share nothing run side by side (dlegion_cc/lower/concurrent.py): at
a decode step the query's rotary, the key's and the value row's copy into the cache each run on
one Legion; with the barriers between them dropped they run at once. The step stays race-free
and gives onnxruntime's outputs; a node that writes what its neighbour reads keeps its barrier."""
from dataclasses import replace
from functools import lru_cache

import numpy as np
import pytest

from isa import arch
from isa.instructions import Barrier, DmaStore
from dlegion_cc.lower.concurrent import _Accesses, side_by_side
from dlegion_cc.pipeline import Options, compile_model
from models.bitnet import build_bitnet, preset, save
from runtime.check import compare, onnx_reference
from runtime.emulator import random_inputs, run
from runtime.report import regions_by_name
from runtime.timing import simulate

EIGHT = arch.load("dlegion-8x8")
SIDE = ("Add_36", "Add_43", "Concat_45")      # q's rotary, k's rotary, v's row into the cache


@lru_cache(maxsize=None)
def _step(tmp: str):
    path = f"{tmp}/decode.onnx"
    save(build_bitnet(preset("2b4t", layers=1, seq=1, vocab=512, past=64)), path, external_data=True)
    return path, compile_model(path, Options(EIGHT))[1]


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    return _step(str(tmp_path_factory.mktemp("decode")))


def _nodes(program) -> dict[str, range]:
    ends = [at for at, _ in program.regions[1:]] + [len(program.instrs)]
    return {name: range(at, end) for (at, name), end in zip(program.regions, ends)}


def _side(program) -> list[range]:
    nodes = _nodes(program)
    return [next(span for name, span in nodes.items() if name.endswith(s) or f"{s}." in name) for s in SIDE]


def test_the_rotaries_and_the_value_copy_run_at_once(step):
    _, program = step
    spans = _side(program)
    # no barrier between them, one after the last
    assert [isinstance(program.instrs[s.stop - 1], Barrier) for s in spans] == [False, False, True]
    timeline = simulate(program, EIGHT)
    starts = []
    for name, ks in regions_by_name(timeline.program).items():
        if any(name.endswith(s) or f"{s}." in name for s in SIDE):
            starts.append(timeline.start[np.asarray(ks)].min())
    assert len(starts) == 3 and max(starts) - min(starts) < EIGHT.dram_latency_cycles


def test_the_step_is_race_free_and_onnxruntimes(step):
    path, program = step
    inputs = random_inputs(program, 0)
    outputs = run(program, EIGHT, inputs).outputs          # the race check runs too
    assert all(r.ok for r in compare(outputs, onnx_reference(path, inputs)))


def test_a_node_writing_what_its_neighbour_reads_keeps_its_barrier(step):
    _, program = step
    q_rot, k_rot, _ = _side(program)
    assert _Accesses(program, q_rot).apart(_Accesses(program, k_rot))
    # k's rotary made to store where q's rotary stores: the two now meet in DRAM
    q_store = next(program.instrs[k] for k in q_rot if isinstance(program.instrs[k], DmaStore))
    instrs = list(program.instrs)
    for k in k_rot:
        if isinstance(instrs[k], DmaStore):
            instrs[k] = replace(instrs[k], dst=q_store.dst)
    clash = replace(program, instrs=instrs)
    assert not _Accesses(clash, q_rot).apart(_Accesses(clash, k_rot))
    assert side_by_side(program, EIGHT) is program      # nothing left to drop
