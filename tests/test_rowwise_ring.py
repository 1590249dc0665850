"""Row blocks on a ring of buffers (``lower/rowwise.py: _Ring``), chosen when two whole blocks of
a row kernel do not fit the vector scratchpad but one block and spare buffers do. A block's
outputs computed in place of its inputs (the residual add into one, the quantized row into the
other) keep those buffers until they are stored, after the next block has started: the ring
needs a spare for each, or it runs out mid-kernel (an internal error on any machine with a
vector scratchpad of that size; a sweep met it on a 64 KiB one at 2B4T widths)."""
import numpy as np
import pytest

from isa import arch
import dlegion_cc.lower.rowwise as rowwise
from dlegion_cc import pipeline
from dlegion_cc.passes.residual import ResidualInDrain
from dlegion_cc.pipeline import Options, compile_model
from models.bitnet import build_bitnet, preset, save
from runtime.emulator import random_inputs, run


def _machine(tmp_path, vec_kib: int):
    text = (arch.resources.files("isa.presets") / "dlegion-tiny.toml").read_text()
    assert "vec_kib = 64" in text
    path = tmp_path / f"vec{vec_kib}.toml"
    path.write_text(text.replace("vec_kib = 64", f"vec_kib = {vec_kib}"))
    return arch.load(path)


@pytest.fixture
def rings(monkeypatch):
    """The number of buffers of every ring the lowering chooses."""
    made = []
    fitting = rowwise._Ring.fitting.__func__

    def recorded(cls, *args):
        ring = fitting(cls, *args)
        if ring is not None:
            made.append(len(ring.free))
        return ring
    monkeypatch.setattr(rowwise._Ring, "fitting", classmethod(recorded))
    return made


def test_a_ring_keeps_a_spare_for_each_buffer_stored_from(tmp_path, rings, monkeypatch):
    machine = _machine(tmp_path, 14)          # rows of 512: two blocks do not fit, a ring does
    # The residual Adds stay kernels of their own rows, not down_proj's and o_proj's drains.
    monkeypatch.setattr(pipeline, "PASSES", tuple(p for p in pipeline.PASSES if not isinstance(p, ResidualInDrain)))
    model = tmp_path / "m.onnx"
    save(build_bitnet(preset("tiny", hidden=512, ffn=512, seq=16, layers=1)), model, False)
    program = compile_model(model, Options(machine, attention="fp32"))[1]
    # The residual add and the quantized row are stored from their inputs' buffers: three full
    # rows in flight (two inputs and a temp) and a spare for each of the two kept.
    assert 5 in rings
    feed = random_inputs(program, 0)
    ours = run(program, machine, feed, races=True).outputs["logits"]
    # At rows of 512 a per-token absmax rounding sits on a .5 boundary and flips between any two
    # fp32 programs (onnxruntime's run is 1.9e-3 from both), so the ring's program is held to
    # the same model compiled with room for two whole blocks, which takes no ring.
    rings.clear()
    roomy = _machine(tmp_path, 64)
    plain = compile_model(model, Options(roomy, attention="fp32"))[1]
    assert not rings
    theirs = run(plain, roomy, feed).outputs["logits"]
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 1e-6
