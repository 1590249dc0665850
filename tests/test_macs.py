"""Useful MACs by unit (the arrays per mode, the vector unit's fp32 products) and the array MAC
slots spent on padding, counted by hand on a small program."""
import json
from functools import lru_cache
from pathlib import Path

import numpy as np
from rich.console import Console

from isa import arch, asm
from isa.program import pack
from dlegion_cc.pipeline import Options, compile_model
from runtime import report
from runtime.emulator import random_inputs, run

BITNET = Path(__file__).parent.parent / "models" / "bitnet_tiny_relu2.onnx"

# dlegion-tiny: 8 x 8 arrays, 2 cores per Legion, 2 Legions; a window holds 1 (w8), 2 (w4) or
# 4 (w2) 8 x 8 tiles.
PROGRAM = """\
.arch dlegion-tiny
.data "macs.s.data"
.tensor x i8[5,12] input "x"
.tensor w i8[12,20] input "w"
.tensor y i32[5,20] output "y"
.tensor u i8[4,16] input "u"
.tensor v w2[16,24] const 0
.tensor m u8[2,3] const {m}
.tensor z i32[4,24] output "z"
.tensor q w4[8,8] const {q}
.tensor r i32[2,8] output "r"
.tensor a f32[3,5] input "a"
.tensor b f32[5,7] input "b"
.tensor c f32[3,7] output "c"

dma.ld L0 {{0}} act[0,12,1] @x[0,12] rows=5 cols=12
dma.ld L0 {{0}} wgt[0,20,1] @w[0,20] rows=12 cols=20
mm L0 acc[0,20] act[0,12] wgt[0,20] M=5 K=12 N=20 mode=w8 split=k accumulate=set mask=none wait=L0.dma>=2
dma.st L0 @y[0,20] acc[0,20,1] rows=5 cols=20 wait=L0.mat>=1

dma.ld L1 {{1}} act[0,16,1] @u[0,16] rows=4 cols=16
dma.ld L1 {{1}} wgt[0,6,1] @v[0,6] rows=16 cols=6
dma.ld L1 {{1}} wgt[128,4,1] @q[0,4] rows=8 cols=4
mm L1 acc[0,24] act[0,16] wgt[0,6] M=4 K=16 N=24 mode=w2 split=n accumulate=set mask=@m wait=L1.dma>=3
mm L1 acc[256,8] act[0,16] wgt[128,4] M=2 K=8 N=8 mode=w4 split=n accumulate=set mask=none
dma.st L1 @z[0,24] acc[0,24,1] rows=4 cols=24 wait=L1.mat>=2
dma.st L1 @r[0,8] acc[256,8,1] rows=2 cols=8

dma.ld L0 {{0}} vec[0,5,1] @a[0,5] rows=3 cols=5
dma.ld L0 {{0}} vec[64,7,1] @b[0,7] rows=5 cols=7
vmm L0 vec[128,7,1] vec[0,5,1] vec[64,7,1] M=3 K=5 N=7 wait=L0.dma>=5
dma.st L0 @c[0,7] vec[128,7,1] rows=3 cols=7 wait=L0.vec>=1
"""
MASK = np.array([[1, 0, 1], [0, 0, 1]], np.uint8)     # K-slice x column block of v


@lru_cache(maxsize=1)
def _result():
    rng = np.random.default_rng(0)
    v = rng.integers(-1, 2, (16, 24)) * np.kron(MASK, np.ones((8, 8), int))    # zero where masked
    data = [pack(v, "w2").tobytes(), MASK.tobytes(), pack(rng.integers(-8, 8, (8, 8)), "w4").tobytes()]
    m, q = len(data[0]), len(data[0]) + len(data[1])
    program = asm.parse(PROGRAM.format(m=m, q=q), "macs.s")
    program.data = b"".join(data)
    return run(program, arch.load("dlegion-tiny"), random_inputs(program, 1))


# By hand, per instruction: useful MACs are M x (rows x columns of each nonzero weight block);
# a pass fills M x 8 x 8 x (tiles a window) MAC slots; padding is the slots beyond the useful.
# w8  M=5 K=12 N=20: K-slices of 8, 4 rows, column blocks 8, 8, 4: 2 x 3 windows of one tile.
W8_USEFUL, W8_SLOTS = 5 * 12 * 20, 6 * 5 * 64 * 1
# w2  M=4 K=16 N=24, mask [[1,0,1],[0,0,1]]: slice 0 packs its 2 blocks in one 4-tile window,
# slice 1 its one block in another; the masked blocks are skipped, not padding.
W2_USEFUL, W2_SLOTS = 4 * 3 * 8 * 8, 2 * 4 * 64 * 4
# w4  M=2 K=8 N=8: one block in a window of two tiles.
W4_USEFUL, W4_SLOTS = 2 * 8 * 8, 1 * 2 * 64 * 2
VMM = 3 * 5 * 7


def test_useful_and_padded_macs_by_unit_and_mode():
    result = _result()
    n = json.loads(json.dumps(report.summarize(result)))         # as --json writes it
    assert n["macs_by_mode"] == {"w8": W8_USEFUL, "w2": W2_USEFUL, "w4": W4_USEFUL}
    assert n["padded_macs_by_mode"] == {"w8": W8_SLOTS - W8_USEFUL, "w2": W2_SLOTS - W2_USEFUL,
                                        "w4": W4_SLOTS - W4_USEFUL} == {"w8": 720, "w2": 1280, "w4": 128}
    assert n["array_macs"] == W8_USEFUL + W2_USEFUL + W4_USEFUL == 2096
    assert n["padded_macs"] == 720 + 1280 + 128
    assert n["vector_macs"] == VMM
    assert n["macs"] == 2096 + VMM
    assert n["achieved_tops"] == 2 * (2096 + VMM) / n["time_s"] / 1e12


def test_the_printed_report_names_each_unit_and_the_padding():
    console = Console(record=True, width=200)
    report.print_report(report.summarize(_result()), console)
    text = console.export_text()
    assert f"({2096 + VMM:,} useful MACs)" in text
    assert "useful MACs: arrays 2,096 (w8 1,200, w2 768, w4 128), vector unit fp32 105\n" in text
    assert "padding: 2,128 array MAC slots (50.4% of the arrays' passes) not counted" in text


def test_float_matmuls_count_as_useful_macs_of_the_vector_unit():
    """A compiled BitNet: its fp32 products (QK^T, PV, the head) are vector MACs, all of them
    in the total, and its whole-block matmuls leave no array padding."""
    a = arch.load("dlegion-tiny")
    _, program = compile_model(BITNET, Options(a))
    result = run(program, a, random_inputs(program, 0))
    n = report.summarize(result)
    vmm = [i for i in result.program.instrs if i.MNEMONIC == "vmm"]
    assert n["vector_macs"] == sum(i.M * i.K * i.N for i in vmm) > 0
    assert n["macs"] == n["array_macs"] + n["vector_macs"] == sum(r["macs"] for r in n["matmuls"])
    assert n["padded_macs"] == sum(r["padded_macs"] for r in n["matmuls"]) == 0
