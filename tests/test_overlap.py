"""Overlap across nodes (dlegion_cc/lower/overlap.py): no node ends in a barrier; the waits that
replace them keep every program ordered, which the race check proves and, for a dependency
removed on purpose, refutes."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from isa import arch
from isa.asm import parse
from isa.instructions import Barrier, DmaLoad
from dlegion_cc.lower.overlap import _meet, _window, layer_ends, overlap
from dlegion_cc.pipeline import Options, compile_model
from runtime.emulator import random_inputs, run
from runtime.state import Trap
from runtime.timing import simulate

BITNET = Path(__file__).parent.parent / "models" / "bitnet_tiny_relu2.onnx"
EIGHT = arch.load("dlegion-8x8")


@lru_cache(maxsize=None)
def _compiled(overlapped: bool):
    return compile_model(BITNET, Options(EIGHT, overlap=overlapped, attention="fp32"))[1]


def test_nodes_end_in_waits_and_compute_the_same_no_later():
    """A barrier stays only where the layers meet (``layer_ends``): between the first layer's
    down_proj, which adds the residual in its drain, and the second layer's first kernel. (Not
    slower: 13,234 cycles either way; 13,296 and 13,313 before the residual Add went into the
    drain, the layers meeting inside its kernel.)"""
    program, plain = _compiled(True), _compiled(False)
    assert sum(isinstance(i, Barrier) for i in plain.instrs) > 10
    kept = {k for k, i in enumerate(program.instrs) if isinstance(i, Barrier)}
    assert len(kept) == 1 and kept == layer_ends(program)
    inputs = random_inputs(plain, 0)
    got, want = run(program, EIGHT, inputs).outputs, run(plain, EIGHT, inputs).outputs   # race-checked
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    assert simulate(program, EIGHT).cycles <= simulate(plain, EIGHT).cycles


def test_the_race_check_finds_a_dependency_removed_across_nodes():
    """The norm kernel's first load waits for the embedding's store on another Legion, which
    only the waits that replaced the barrier order: without it, a race."""
    program = _compiled(True)
    second, third = program.regions[1][0], program.regions[2][0]
    k = next(k for k in range(second, third) if isinstance(program.instrs[k], DmaLoad)
             and program.instrs[k].condition() is not None)
    broken = replace(program, instrs=[replace(i, wait=None) if j == k else i for j, i in enumerate(program.instrs)])
    inputs = random_inputs(program, 0)
    with pytest.raises(Trap, match=rf"instruction {k}: dma.ld: race on @"):
        run(broken, EIGHT, inputs)


HEAD = """.arch dlegion-8x8
.tensor x f32[2,64] input "x"
.tensor y f32[2,64] scratch
.tensor z f32[2,64] output "z"
"""


def test_a_barrier_gives_way_to_waits_for_what_is_shared_only():
    """L1 reads the row L0 stored: it waits for L0's DMA queue up to that store, not for the
    store after it (``~1``); L2's work shares nothing with L0's and waits for nothing."""
    program = parse(HEAD + """dma.ld L0 {0} vec[0,64,1] @x[0,64] rows=2 cols=64
vadd L0 vec[128,64,1] vec[0,64,1] #1.0 rows=2 cols=64 wait=dma
dma.st L0 @y[0,64] vec[128,64,1] rows=1 cols=64 wait=vec
dma.st L0 @z[64,64] vec[192,64,1] rows=1 cols=64
barrier
dma.ld L1 {1} vec[0,64,1] @y[0,64] rows=1 cols=64
dma.st L1 @z[0,64] vec[0,64,1] rows=1 cols=64 wait=dma
dma.ld L2 {2} vec[0,64,1] @x[0,64] rows=1 cols=64
""")
    out = overlap(program, EIGHT)
    assert not any(isinstance(i, Barrier) for i in out.instrs)
    load_y, load_x = out.instrs[4], out.instrs[6]
    assert str(load_y.wait) == "L0.dma~1" and load_x.wait is None
    x = {"x": np.arange(128, dtype=np.float32).reshape(2, 64)}
    assert np.array_equal(run(out, EIGHT, x).outputs["z"], run(program, EIGHT, x).outputs["z"])


def test_interleaved_windows_do_not_meet():
    """Two Legions' columns of the same rows (a spanned store with a Legion stride) share no
    element; a window that crosses both meets each."""
    a, b = _window(0, 20, 64, 16384, 1), _window(128, 20, 64, 16384, 1)
    both = _window(0, 20, 192, 16384, 1)
    assert not _meet(a, b)
    assert _meet(both, a) and _meet(both, b) and _meet(a, a)


def _wide_kernel(path: Path, rows: int, cols: int) -> None:
    """relu(x) * y - max(x) over rows of ``cols``: one fused row kernel, two inputs, one output;
    the row maximum keeps each row whole in a block."""
    import onnx
    from onnx import TensorProto, helper
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [rows, cols]) for n in ("x", "y", "z")]
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "y"], ["m"]),
             helper.make_node("ReduceMax", ["x"], ["top"], axes=[-1], keepdims=1),
             helper.make_node("Sub", ["m", "top"], ["z"])]
    model = helper.make_model(helper.make_graph(nodes, "wide", info[:2], info[2:]),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)


def test_a_wide_kernel_computes_its_output_in_place_and_double_buffers(tmp_path):
    """Rows of 5,000 columns: x, y, relu(x) and a block of its own for z (20,000 elements) do
    not fit half the vector scratchpad (16,384); z in the block of a value that died does, so
    consecutive blocks of x load into the two halves, each while the other computes."""
    path = tmp_path / "wide.onnx"
    _wide_kernel(path, 64, 5000)
    program = compile_model(path, Options(EIGHT))[1]
    x_loads = {i.dst.addr for i in program.instrs if isinstance(i, DmaLoad) and program.tensors[i.src.tensor].name == "x"}
    assert len(x_loads) == 2
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal((64, 5000), dtype=np.float32) for _ in range(2))
    got = run(program, EIGHT, {"x": x, "y": y}).outputs["z"]
    assert np.array_equal(got, np.maximum(x, 0) * y - x.max(axis=-1, keepdims=True))


def test_the_barrier_where_the_next_layer_starts_stays():
    """A region named after no layer (one the compiler made) is of the layer before it: only
    the barrier before ``layers.1`` stays, so the layers repeat between barriers (the timing
    model and the race check take a repeating stretch once)."""
    program = parse(HEAD + """.region "model.layers.0.mlp/Relu_1"
dma.ld L0 {0} vec[0,64,1] @x[0,64] rows=2 cols=64
dma.st L0 @y[0,64] vec[0,64,1] rows=2 cols=64 wait=dma
barrier
.region "relu_1_absmax_0"
dma.ld L1 {1} vec[0,64,1] @y[0,64] rows=2 cols=64
dma.st L1 @z[0,64] vec[0,64,1] rows=2 cols=64 wait=dma
barrier
.region "model.layers.1.mlp/Relu_2"
dma.ld L0 {0} vec[0,64,1] @z[0,64] rows=2 cols=64
dma.st L0 @y[0,64] vec[0,64,1] rows=2 cols=64 wait=dma
barrier
.region "model.norm/Mul_3"
dma.ld L2 {2} vec[0,64,1] @y[0,64] rows=2 cols=64
dma.st L2 @z[0,64] vec[0,64,1] rows=2 cols=64 wait=dma
""")
    out = overlap(program, EIGHT)
    kept = [k for k, i in enumerate(out.instrs) if isinstance(i, Barrier)]
    second = next(at for at, name in out.regions if name.startswith("model.layers.1."))
    assert kept == [second - 1]
    x = {"x": np.arange(128, dtype=np.float32).reshape(2, 64)}
    assert np.array_equal(run(out, EIGHT, x).outputs["z"], x["x"])


def test_a_ledger_in_address_blocks_finds_what_one_list_finds():
    """A DRAM tensor's accesses filed by address block: a row's read meets the write of its
    own row (in its block), a column of every row (filed wide) and nothing in other blocks;
    a wide read meets every write."""
    from dlegion_cc.lower.overlap import _Ledger
    ledger = _Ledger(size=64 * 100)                # blocks of 100 elements
    for q, row in enumerate((0, 3, 40)):           # three queues write rows of 50
        ledger.add(_window(row * 50, 1, 50, 50, 1), q, 1, True, q, True)
    ledger.add(_window(10, 64, 1, 50, 1), 3, 1, True, 3, False)      # a column of 64 rows
    known = [0] * 4

    def need(win):
        got = {}
        ledger.need(win, False, 99, known, 5, got)
        return got

    assert need(_window(170, 1, 10, 50, 1)) == {1: 1}                  # row 3 past the column
    assert need(_window(150, 1, 50, 50, 1)) == {1: 1, 3: 1}            # row 3, column and all
    assert need(_window(2020, 1, 10, 50, 1)) == {2: 1}                 # row 40: another block
    assert need(_window(0, 64, 50, 50, 1)) == {0: 1, 1: 1, 2: 1, 3: 1}
    known[1] = 1                                   # what a queue knows done needs no wait
    assert need(_window(170, 1, 10, 50, 1)) == {}


def test_pruning_and_address_blocks_leave_the_program_as_is(monkeypatch):
    """What pruning drops would never be waited for, and the blocks find what one list finds:
    the same program with neither."""
    from dlegion_cc.lower import overlap as module
    plain = _compiled(False)
    want = overlap(plain, EIGHT).instrs
    monkeypatch.setattr(module._Ledger, "BLOCKS", 1)
    monkeypatch.setattr(module._Ledger, "PRUNE_EVERY", 10 ** 9)
    assert overlap(plain, EIGHT).instrs == want
