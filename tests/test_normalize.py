"""Baselines scaled to D-Legion: equal PE count, equal peak w8 TOPS, and the footings named."""
import math

from isa.arch import load
from isa.normalize import EQUAL_PEAK, EQUAL_PES, PUBLISHED, equal_peak, equal_pes, footings, pe_count


def test_equal_pes_adds_arrays_with_their_psum_port_rows():
    ref, ws = load("dlegion-8x8"), load("ws-64")
    scaled = equal_pes(ws, ref)
    assert pe_count(scaled) == pe_count(ref) == 8 * 8 * 16 * 16
    assert scaled.cores == 16 * 16 * 64 // (64 * 64)
    assert scaled.acc_port_words == ws.acc_port_words * scaled.cores
    assert scaled.dram_gbps == ws.dram_gbps and scaled.legions == 1


def test_equal_peak_clocks_the_scaled_machine_to_the_reference_w8_peak():
    ref, tpu = load("dlegion-32x8"), load("tpuv4i")
    assert equal_pes(tpu, ref) is tpu                       # 4 x 128^2 = 32 x 8 x 16^2 PEs
    fast = equal_peak(tpu, ref)
    assert math.isclose(fast.derived.peak_tops["w8"], ref.derived.peak_tops["w8"])
    assert fast.clock_ghz < tpu.clock_ghz


def test_footings_name_each_distinct_machine_once():
    ws = [label for _, label in footings(load("ws-64"), load("dlegion-8x8"))]
    assert ws == [PUBLISHED, f"{EQUAL_PES} = {EQUAL_PEAK}"]        # both w8-only at 1 GHz
    tpu = [label for _, label in footings(load("tpuv4i"), load("dlegion-32x8"))]
    assert tpu == [f"{PUBLISHED} = {EQUAL_PES}", EQUAL_PEAK]
