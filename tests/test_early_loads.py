"""A decode step's attention products load their first cache slices during the row kernel
before them (dlegion_cc/lower/earlyloads.py): the past keys while the rotaries run, the past
values while the softmax runs. The step stays race-free and gives onnxruntime's outputs."""
from functools import lru_cache

import pytest

from isa import arch
from isa.instructions import Barrier, DmaLoad, DmaStore, VMatMul
from dlegion_cc.pipeline import Options, compile_model
from models.bitnet import build_bitnet, preset, save
from runtime.timing import simulate
from test_prefetch_decode import assert_race_free_onnxruntimes_and_plains

EIGHT = arch.load("dlegion-8x8")
PAST = 512          # long enough that QK^T's passes, not DRAM, set its pace on every Legion


@lru_cache(maxsize=None)
def _step(tmp: str, prefetch: bool):
    path = f"{tmp}/decode.onnx"
    save(build_bitnet(preset("2b4t", layers=1, seq=1, vocab=512, past=PAST)), path, external_data=True)
    return path, compile_model(path, Options(EIGHT, prefetch=prefetch))[1]


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("decode"))
    return lambda prefetch=True: _step(tmp, prefetch)


def _tensor(program, prefix: str) -> int:
    return next(n for n, t in enumerate(program.tensors) if t.name.startswith(prefix))


def _loads(program, tensor: int) -> list[int]:
    return [k for k, i in enumerate(program.instrs) if isinstance(i, DmaLoad) and i.src.tensor == tensor]


def _stores(program, tensor: int) -> list[int]:
    return [k for k, i in enumerate(program.instrs) if isinstance(i, DmaStore) and i.dst.tensor == tensor]


def test_the_past_keys_load_while_the_rotaries_run(step):
    _, program = step()
    timed = simulate(program, EIGHT)
    expanded = timed.program
    key = _tensor(expanded, "present_0_key")
    rotary_done = max(timed.done[k] for k in _stores(expanded, key))    # the new key row stored
    first_load = min(timed.start[k] for k in _loads(expanded, key))
    assert first_load < rotary_done
    # in the program, before the rotaries' barrier; the slice holding the new row after it
    barrier = next(k for k in range(max(_stores(program, key)), len(program.instrs))
                   if isinstance(program.instrs[k], Barrier))
    early = [program.instrs[k] for k in _loads(program, key) if k < barrier]
    assert early and all((i.src.offset // i.src.rs) % (PAST + 1) + i.rows <= PAST for i in early)


def test_a_rotarys_own_legion_loads_its_first_keys_once_its_vector_work_is_done(step):
    _, program = step()
    key = _tensor(program, "present_0_key")
    barrier = next(k for k in range(max(_stores(program, key)), len(program.instrs))
                   if isinstance(program.instrs[k], Barrier))
    start = max(k for k in range(barrier) if isinstance(program.instrs[k], Barrier))
    kernel = {program.instrs[k].legion for k in range(start, barrier) if isinstance(program.instrs[k], DmaStore)}
    after = [program.instrs[k] for k in _loads(program, key) if k < barrier and program.instrs[k].wait is not None]
    # issued by a rotary's own queue, for itself, once its vector unit is done with that space
    assert after and all(i.legion in kernel and i.dests == {i.legion} and i.wait.queue == "vec" for i in after)
    # only what the product's first pass there reads: its first product waits for no more
    for i in after:
        first = next(program.instrs[k] for k in range(barrier, len(program.instrs))
                     if isinstance(program.instrs[k], VMatMul) and i.legion in _legions(program.instrs[k]))
        assert i.dst.addr == first.b.addr


def test_the_past_values_load_while_the_softmax_runs(step):
    _, program = step()
    timed = simulate(program, EIGHT)
    expanded = timed.program
    values, probs = _tensor(expanded, "present_0_value"), _tensor(expanded, "softmax")
    softmax_done = max(timed.done[k] for k in _stores(expanded, probs))
    first_value = min(timed.start[k] for k in _loads(expanded, values))
    assert first_value < softmax_done
    assert first_value < min(timed.start[k] for k in _loads(expanded, probs))


def test_the_step_is_race_free_and_onnxruntimes(step):
    path, program = step()
    _, plain = step(prefetch=False)
    assert_race_free_onnxruntimes_and_plains(path, program, plain)
    # every cache byte is still loaded once: the moved slices are the product's, not more
    for name in ("present_0_key", "present_0_value"):
        assert _bytes(program, _tensor(program, name)) == _bytes(plain, _tensor(plain, name))


def _bytes(program, tensor: int) -> int:
    return sum(program.instrs[k].rows * program.instrs[k].cols * (program.instrs[k].span or 1)
               for k in _loads(program, tensor))


def _legions(i) -> range:
    return range(i.legion, i.legion + (i.span or 1))
