"""A decode step's key/value cache bound inside its present output (``Program.aliases``,
dlegion_cc/lower/context.py ``cache_alias``): the past is read where it lies, only the new
token's rows are written, the outputs are onnxruntime's, the alias survives the text and
binary formats, and the race check still orders the new rows' writes against their reads."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from isa import arch
from isa.asm import format_program, parse
from isa.encoding import decode_program, encode_program
from isa.instructions import Barrier, DmaLoad, DmaStore
from isa.program import ProgramError
from isa.verify import verify
from dlegion_cc.pipeline import Options, compile_model
from models.decoder import PAST_DIM
from runtime import report
from runtime.check import compare, onnx_reference
from runtime.emulator import random_inputs, run
from runtime.state import Trap

DECODE = Path(__file__).parent.parent / "models" / "bitnet_tiny_decode.onnx"
TINY = arch.load("dlegion-tiny")
PAST, KV, HEAD, LAYERS = 11, 2, 16, 2      # the tiny preset's key/value heads, head dim, layers
CACHE = ("key", "value")


@lru_cache(maxsize=None)
def _step(alias: bool, attention: str = "fp32"):
    return compile_model(DECODE, Options(TINY, {"sequence": 1, PAST_DIM: PAST}, attention=attention,
                                         cache_alias=alias))[1]


def _index(program, io_name: str) -> int:
    return next(k for k, t in enumerate(program.tensors) if t.io_name == io_name)


def _stored(program, io_name: str) -> int:
    """Elements the program's stores write to a tensor."""
    t = _index(program, io_name)
    return sum(i.rows * i.cols * (i.span or 1) for i in program.instrs if isinstance(i, DmaStore) and i.dst.tensor == t)


def _touching(program, io_name: str) -> list:
    t = _index(program, io_name)
    return [i for i in program.instrs if isinstance(i, (DmaLoad, DmaStore))
            and (i.src.tensor if isinstance(i, DmaLoad) else i.dst.tensor) == t]


def test_every_cache_input_lies_in_its_present_output_and_only_new_rows_are_written():
    program, copied = _step(True), _step(False)
    names = {t.name: t.io_name for t in program.tensors}
    bound = {names[i]: names[o] for i, (o, _, _) in program.aliases.items()}
    assert bound == {f"past_key_values.{n}.{k}": f"present.{n}.{k}" for n in range(LAYERS) for k in CACHE}
    assert not copied.aliases
    for n in range(LAYERS):
        for k in CACHE:
            assert not _touching(program, f"past_key_values.{n}.{k}")        # read inside present
            assert _stored(program, f"present.{n}.{k}") == KV * HEAD          # the new row of each head
            assert _stored(copied, f"present.{n}.{k}") >= KV * (PAST + 1) * HEAD


@pytest.mark.parametrize("attention", ["fp32", "int8"])
def test_the_aliased_step_is_the_copying_ones_and_onnxruntimes(attention):
    program, copied = _step(True, attention), _step(False, attention)
    inputs = random_inputs(program, 0)
    got = run(program, TINY, inputs).outputs          # the race check runs too
    if attention == "fp32":          # int8: onnxruntime's within the approximation's tolerance
        assert all(r.ok for r in compare(got, onnx_reference(DECODE, inputs)))
    want = run(copied, TINY, inputs).outputs
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    for n in range(LAYERS):
        for k in CACHE:
            np.testing.assert_array_equal(got[f"present.{n}.{k}"][:, :, :PAST], inputs[f"past_key_values.{n}.{k}"])


def test_the_reports_dram_bytes_drop_by_the_cache_written():
    program, copied = _step(True), _step(False)
    inputs = random_inputs(program, 0)
    n, c = (report.summarize(run(p, TINY, inputs)) for p in (program, copied))
    cache = 2 * LAYERS * KV * PAST * HEAD * 4           # bytes of the past keys and values
    assert c["dram_write_bytes"] - n["dram_write_bytes"] >= cache
    assert n["dram_read_bytes"] <= c["dram_read_bytes"]
    assert c["compulsory_dram_bytes"] - n["compulsory_dram_bytes"] == cache
    assert n["aliases"] == {f"past_key_values.{i}.{k}": f"present.{i}.{k}" for i in range(LAYERS) for k in CACHE}


def test_the_alias_survives_text_and_binary():
    program = _step(True)
    for again in (parse(format_program(program), "step.dasm"), decode_program(encode_program(program), "step.bin")):
        assert again.aliases == program.aliases
    lines = [line for line in format_program(program).splitlines() if line.startswith(".alias ")]
    assert len(lines) == len(program.aliases) == 2 * LAYERS


def test_a_bad_alias_is_refused_in_one_line():
    program = _step(True)
    name, (out, offset, strides) = next(iter(program.aliases.items()))
    t = program.tensors[program.tensor_index(name)]
    outside = replace(program, aliases={name: (out, program.tensors[program.tensor_index(out)].numel, strides)})
    with pytest.raises(ProgramError, match=rf"alias '{name}': element \d+ is outside output"):
        verify(outside, TINY)
    overlapping = replace(program, aliases={name: (out, offset, (0,) * len(t.shape))})
    with pytest.raises(ProgramError, match="overlap elements"):
        decode_program(encode_program(overlapping), "x.bin")


def test_the_race_check_finds_the_new_rows_read_before_they_are_written():
    """The barriers between the store of the first layer's new key rows into present and the
    first load of present on another Legion (the key's quantization, a head a Legion): without
    them, a load of a new row races with its store."""
    program = _step(True, "int8")
    present = _index(program, "present.0.key")
    instrs = program.instrs
    store = next(k for k, i in enumerate(instrs) if isinstance(i, DmaStore) and i.dst.tensor == present)
    read = next(k for k in range(store, len(instrs)) if isinstance(instrs[k], DmaLoad)
                and instrs[k].src.tensor == present and instrs[k].legion != instrs[store].legion)
    cuts = [k for k in range(store, read) if isinstance(instrs[k], Barrier)]
    assert cuts
    kept = [i for k, i in enumerate(instrs) if k not in cuts]
    regions = [(at - sum(c < at for c in cuts), name) for at, name in program.regions]
    inputs = random_inputs(program, 0)
    run(program, TINY, inputs)
    new_rows = "|".join(str(h * (PAST + 1) * HEAD + PAST * HEAD + c) for h in range(KV) for c in range(HEAD))
    with pytest.raises(Trap, match=rf"dma.ld: race on @present_0_key\[({new_rows})\]: instruction {store} \(dma.st\)"):
        run(replace(program, instrs=kept, regions=regions), TINY, inputs)
