"""The race check's ordering table (runtime/races.py's Order, computed by chains in
runtime/races_chains.py) is the one computed instruction by instruction (tests/races_oracle.py):
on random programs with waits and barriers, with and without segments left unchecked, and on
compiled models."""
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from isa.arch import load
from isa.asm import parse
from isa.expand import in_program_order
from isa.verify import verify
from runtime.emulator import _repeated_segments
from runtime.races import Order

from races_oracle import known_by_instructions
from test_races_bulk import random_lines

ARCH = load("dlegion-tiny")
MODELS = Path(__file__).parent.parent / "models"


@st.composite
def waiting_programs(draw):
    """Random loads, vector ops, stores and barriers (``random_lines``)."""
    return verify(parse(random_lines(draw, 24, barriers=True)), ARCH)


def assert_as_by_instructions(program, arch, unchecked) -> None:
    assert in_program_order(program.instrs, arch.legions)
    order = Order(program, arch, unchecked)
    np.testing.assert_array_equal(order.known, known_by_instructions(order, program.instrs))
    assert order.known.dtype == np.int32


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(waiting_programs(), st.data())
def test_random_programs(program, data):
    n = len(program.instrs.source)
    assert_as_by_instructions(program, ARCH, None)
    assert_as_by_instructions(program, ARCH, _repeated_segments(program.instrs.source, program))
    # Any instructions left unchecked, not only whole segments: their rows stay 0 alike.
    skipped = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), np.bool_)
    assert_as_by_instructions(program, ARCH, skipped)


@lru_cache(maxsize=None)
def _compiled(name: str, dims: tuple):
    from dlegion_cc.pipeline import Options, compile_model
    return verify(compile_model(str(MODELS / name), Options(ARCH, dims=dict(dims)))[1], ARCH)


@pytest.mark.parametrize("name, dims", [
    ("bitnet_tiny_relu2.onnx", ()),
    ("bitnet_tiny_decode.onnx", (("sequence", 1), ("past_sequence_length", 7))),       # a decode step
])
def test_compiled_models(name, dims):
    program = _compiled(name, dims)
    assert_as_by_instructions(program, ARCH, None)
    unchecked = _repeated_segments(program.instrs.source, program)
    assert_as_by_instructions(program, ARCH, unchecked)
    # Every other instruction left unchecked: rows read from one left uncomputed are 0 alike.
    assert_as_by_instructions(program, ARCH, np.arange(len(unchecked)) % 2 == 1)
