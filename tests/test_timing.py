"""Timing model: hand-computed cycle counts for passes, sparsity, DRAM sharing and sync."""
import dataclasses
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isa.arch import load
from isa.fields import QUEUES, Cond, DramRef, View
from isa.instructions import BY_MNEMONIC, Barrier, DmaLoad, DmaStore, Drain, MatMul, VMatMul, Wait
from isa.program import Program, Tensor
from runtime.costs import Env, cost
from runtime.timing import Deadlock, TimingError, simulate

TINY = load("dlegion-tiny")          # 2 Legions x 2 cores, 8x8 arrays, 16 lanes
ONE_CORE = dataclasses.replace(TINY, cores=1)


def mm(M, K, N, mode="w8", split="n", accumulate="set", mask=None, legion=0, wait=None):
    return MatMul(legion, View("acc", 0, N), View("act", 0, K), View("wgt", 0, N),
                  M, K, N, mode, split, accumulate, mask, wait=wait)


def prog(instrs, tensors=(), data=None):
    return Program("test", list(tensors), list(instrs), data=data)


def load_x(legion=0, dests=None, rows=1, cols=1, wait=None):
    dests = frozenset({legion} if dests is None else dests)
    return DmaLoad(legion, dests, View("act", 0, cols), DramRef(0, 0, cols), rows, cols, wait=wait)


def x_tensor(rows, cols, dtype="i8"):
    return Tensor("x", dtype, (rows, cols), "input")


def cycles(arch, *instrs, tensors=(), data=None):
    return simulate(prog(instrs, tensors, data), arch).cycles


def masked(arch, mask, **kw):
    """One MatMul with a u8 block mask; returns its timeline."""
    mask = np.asarray(mask, np.uint8)
    t = Tensor("m", "u8", mask.shape, "const", offset=0)
    return simulate(prog([mm(mask=0, **kw)], [t], mask.tobytes()), arch)


# --- matrix passes ---------------------------------------------------------------------------

def test_dip_pass_is_m_plus_n_and_ws_pass_m_plus_2n():
    ws = dataclasses.replace(ONE_CORE, dataflow="ws")
    # one pass of 64 rows on an 8x8 array, one exposed weight load of 8 cycles
    assert cycles(ONE_CORE, mm(64, 8, 8)) == 64 + 8 + 8
    assert cycles(ws, mm(64, 8, 8)) == 64 + 16 + 8


def test_weight_loads_overlap_only_when_double_buffered():
    exposed = dataclasses.replace(ONE_CORE, double_buffered_weights=False)
    # K=32 -> 4 K-slices, 1 window each: 4 passes of 16 + 8 cycles
    assert cycles(ONE_CORE, mm(16, 32, 8)) == 4 * 24 + 8
    assert cycles(exposed, mm(16, 32, 8)) == 4 * 24 + 4 * 8


def test_first_weight_load_hides_behind_the_previous_pass():
    """Double-buffered weight registers load an mm's first window during the pass before it,
    once the operands are there; after operands that arrive late, it shows."""
    t = simulate(prog([mm(16, 8, 8), mm(16, 8, 8)]), ONE_CORE)
    assert list(t.free) == [8 + 24, 8 + 24 + 24]           # one load shows, the second hides
    late = [load_x(cols=320), mm(16, 8, 8), mm(16, 8, 8, wait=Cond(0, "dma", 1))]
    t = simulate(prog(late, X320), ONE_CORE)
    assert t.done[0] == 30 and t.start[2] == 32 and t.free[2] == 30 + 8 + 24
    early = [load_x(cols=320), mm(64, 8, 8), mm(16, 8, 8, wait=Cond(0, "dma", 1))]
    t = simulate(prog(early, X320), ONE_CORE)
    assert t.free[1] == 8 + 72 and t.free[2] == 8 + 72 + 24
    exposed = dataclasses.replace(ONE_CORE, double_buffered_weights=False)
    assert simulate(prog([mm(16, 8, 8), mm(16, 8, 8)]), exposed).cycles == 2 * (24 + 8)


def test_ws32_gemm_matches_scalesim():
    t = simulate(prog([mm(256, 256, 256)]), load("ws-32"))
    assert t.cycles == 64 * (256 + 64) + 32 * 64 == 22528
    assert abs(t.cycles - 22399) / 22399 < 0.05          # SCALE-Sim v3, WS 32x32
    assert t.counters["passes"] == 64
    assert t.counters["macs"] == t.counters["dense_macs"] == 256 ** 3


def test_split_k_and_split_n_spread_passes_differently():
    # K=24 -> 3 K-slices of one window each. split=k: cores hold slices {0,2},{1} -> 2 passes.
    # split=n: window 0 of every slice goes to core 0 -> 3 passes.
    assert cycles(TINY, mm(16, 24, 8, split="k")) == 2 * 24 + 8
    assert cycles(TINY, mm(16, 24, 8, split="n")) == 3 * 24 + 8
    # N=24 -> 3 windows per slice: split=n gives core 0 two of them per slice (2 slices -> 4)
    four = dataclasses.replace(TINY, cores=4)
    assert cycles(TINY, mm(16, 16, 24, split="n")) == 4 * 24 + 8
    assert cycles(four, mm(16, 16, 24, split="n")) == 2 * 24 + 8
    assert cycles(four, mm(16, 16, 24, split="k")) == 3 * 24 + 8


def test_modes_hold_several_tiles_a_window():
    # N=64 -> 8 column blocks: w8 8 windows, w4 4, w2 2 per K-slice
    for mode, windows in (("w8", 8), ("w4", 4), ("w2", 2)):
        assert cycles(ONE_CORE, mm(16, 8, 64, mode=mode)) == windows * 24 + 8


def test_mask_compacts_partial_windows_in_w2():
    # one K-slice with 3 of 8 blocks nonzero: 1 window of 4 tiles, not 2
    t = masked(ONE_CORE, [[1, 0, 1, 0, 0, 0, 1, 0]], M=16, K=8, N=64, mode="w2")
    c = t.counters
    assert t.cycles == 1 * 24 + 8
    assert (c["passes"], c["dense_passes"], c["windows_skipped"]) == (1, 2, 1)
    assert c["sparsity_cycles_saved"] == (2 * 24 + 8) - (1 * 24 + 8)
    assert c["macs"] == 16 * 3 * 8 * 8 and c["dense_macs"] == 16 * 8 * 64


def test_mask_skips_fully_sparse_windows_and_empty_matmuls():
    # K=20 -> slices of 8, 8, 4 rows; N=12 -> blocks of 8, 4 columns
    t = masked(ONE_CORE, [[1, 1], [0, 0], [0, 1]], M=4, K=20, N=12)
    assert t.cycles == 3 * (4 + 8) + 8
    assert t.counters["windows_skipped"] == 3
    assert t.counters["macs"] == 4 * (8 * 8 + 8 * 4 + 4 * 4)
    assert masked(ONE_CORE, [[0, 0]], M=4, K=8, N=12).cycles == 0


def test_mask_of_wrong_shape_names_instruction_and_tensor():
    with pytest.raises(TimingError, match=r"instruction 0: mask @m has shape \[1, 1\], expected \[1, 2\]"):
        masked(ONE_CORE, [[1]], M=4, K=8, N=12)


def test_psum_bytes_with_and_without_parallel_accumulators():
    # K=32 -> 4 K-slices; N=12 -> column blocks of 8 and 4; M=4; 2 cores
    def psum(arch, split, accumulate="set"):
        t = simulate(prog([mm(4, 32, 12, split=split, accumulate=accumulate)]), arch)
        return t.counters["psum_bytes"]
    # split=k: ceil(4/2) = 2 updates per block, the first of a `set` only writes
    assert psum(TINY, "k") == 4 * 4 * 12 * (2 * 2 - 1)
    assert psum(TINY, "n") == 4 * 4 * 12 * (2 * 4 - 1)
    assert psum(TINY, "n", "add") == 4 * 4 * 12 * (2 * 4)
    no_tree = dataclasses.replace(TINY, parallel_accumulators=False)
    assert psum(no_tree, "k") == psum(TINY, "n")


# --- vector unit -----------------------------------------------------------------------------

def vop(name, rows, cols, legion=0, wait=None):
    cls = BY_MNEMONIC[name]
    views = len(cls.fields()) - 5            # all but legion, rows, cols, span, wait
    return cls(legion, *[View("vec", 0, cols)] * views, rows, cols, wait=wait)


@pytest.mark.parametrize("name, expect", [("vadd", 2), ("vexp", 8), ("vdiv", 8), ("vrsum", 2),
                                          ("vrsqrt", 8), ("vsel", 2)])
def test_vector_cycles(name, expect):
    # 3 x 10 = 30 elements on 16 lanes: 2 lane-ops; transcendental ones cost 4 cycles each
    t = simulate(prog([vop(name, 3, 10)]), TINY)
    assert t.cycles == expect
    assert t.counters["vector_elems"] == 30 and t.counters["count_vector"] == 1


def test_drain_cycles():
    d = Drain(0, View("vec", 0, 7), View("acc", 0, 7), 5, 7, None, None, None, None, "set")
    assert cycles(TINY, d) == 3          # ceil(35 / 16)


def test_vector_matmul_cycles():
    v = View("vec", 0, 8)
    t = simulate(prog([VMatMul(0, v, v, v, 3, 5, 7)]), TINY)
    assert t.cycles == 7                 # ceil(3 * 5 * 7 / 16) multiply-adds
    assert t.counters["count_vector"] == 1 and t.counters["vector_elems"] == 105


# --- DRAM ------------------------------------------------------------------------------------

def test_one_legion_dma_runs_at_link_rate_plus_latency():
    a = load("dlegion-8x8")
    t = simulate(prog([load_x(rows=12, cols=256)], [x_tensor(12, 256)]), a)
    assert t.done[0] == pytest.approx(3072 / 256 + 200)
    assert t.cycles == 12 + 200
    assert t.counters["dram_read_bytes"] == 3072


def test_eight_legions_share_dram_bandwidth():
    a = load("dlegion-8x8")
    loads = [load_x(legion=l, rows=12, cols=256) for l in range(8)]
    t = simulate(prog(loads, [x_tensor(12, 256)]), a)
    # each flow gets min(256, 614 / 8) bytes/cycle
    assert t.done == pytest.approx(np.full(8, 8 * 3072 / 614 + 200))
    assert t.cycles == 41 + 200
    assert t.busy[(3, "dma")] == 41


def test_multicast_costs_one_read():
    a = load("dlegion-8x8")
    t = simulate(prog([load_x(dests=range(8), rows=12, cols=256)], [x_tensor(12, 256)]), a)
    assert t.cycles == 12 + 200
    assert t.counters["dram_read_bytes"] == 3072
    assert t.counters["multicast_saved_bytes"] == 7 * 3072
    unicast = dataclasses.replace(a, multicast=False)
    assert simulate(prog([load_x(dests=range(8), rows=12, cols=256)], [x_tensor(12, 256)]),
                    unicast).counters["dram_read_bytes"] == 8 * 3072


def vec_load(legion, nbytes):
    n = nbytes // 4                        # f32 elements
    return DmaLoad(legion, frozenset({legion}), View("vec", 0, n), DramRef(0, 0, n), 1, n)


def test_flow_rates_change_when_flows_start_and_end():
    # tiny with 3 Legions: DRAM 64 B/cycle, links 32. A and B (640 B each) start at 0 at
    # 32 B/cycle. C (320 B) starts at 5, after a 5-cycle vector op: from then on each gets
    # 64/3, so C ends at 5 + 320/(64/3) = 20, when A and B have 160 B left at 32 -> 25.
    three = dataclasses.replace(TINY, legions=3)
    delay = vop("vadd", 1, 80, legion=2)
    c = dataclasses.replace(vec_load(2, 320), wait=Cond(2, "vec", 1))
    instrs = [vec_load(0, 640), vec_load(1, 640), delay, c]
    t = simulate(prog(instrs, [x_tensor(1, 160, "f32")]), three)
    assert t.start[3] == 5
    assert t.free[[0, 1, 3]] == pytest.approx([25, 25, 20])
    assert t.done[3] == pytest.approx(20 + 20)


def test_store_counts_write_bytes():
    st = DmaStore(0, DramRef(0, 0, 16), View("vec", 0, 16), 2, 16)
    t = simulate(prog([st], [x_tensor(2, 16, "i32")]), TINY)
    assert t.counters["dram_write_bytes"] == 2 * 16 * 4
    assert t.cycles == 128 // 32 + 20


# --- queues and synchronization --------------------------------------------------------------

X320 = [x_tensor(1, 320)]       # load_x(cols=320): 320 B at 32 B/cycle, flow ends at 10, done at 30


def test_independent_queues_overlap_and_a_wait_serializes():
    dma = load_x(cols=320)
    work = mm(16, 8, 8)                     # 1 pass: 16 + 8 + 8 = 32
    assert cycles(TINY, dma, work, tensors=X320) == 32
    t = simulate(prog([dma, dataclasses.replace(work, wait=Cond(0, "dma", 1))], X320), TINY)
    assert t.start[1] == 30 and t.cycles == 30 + 32


def test_wait_for_the_nth_dma_starts_after_it_is_done_latency_included():
    # the second load starts when the first one's flow ends, at 10; it is done at 20 + 20
    instrs = [load_x(cols=320), load_x(cols=320),
              vop("vadd", 1, 16, wait=Cond(0, "dma", 1)),
              vop("vadd", 1, 16, wait=Cond(0, "dma", 2))]
    t = simulate(prog(instrs, X320), TINY)
    assert list(t.free[:2]) == [10, 20] and list(t.done[:2]) == [30, 40]
    assert list(t.start[2:]) == [30, 40]


def test_progress_counts_only_the_completed_prefix():
    # the wait on L0 dma passes at 10, when the load's flow ends and the queue is free, but
    # the queue's completed prefix reaches 2 only when the load is done, at 30
    instrs = [vop("vadd", 1, 16),                              # L0 vec, done at 1
              load_x(cols=320),
              Wait(0, "dma", Cond(0, "vec", 1)),
              vop("vexp", 1, 16, wait=Cond(0, "dma", 2))]
    t = simulate(prog(instrs, X320), TINY)
    assert t.start[2] == t.done[2] == 10
    assert t.start[3] == 30


def test_next_dma_starts_when_previous_flow_ends():
    t = simulate(prog([load_x(cols=320), load_x(cols=320)], X320), TINY)
    assert t.start[1] == 10 and t.done[1] == 40
    assert t.busy[(0, "dma")] == 20 and t.counters["busy_dma"] == 20


def test_embedded_and_standalone_waits_time_the_same():
    # a standalone wait is one more instruction of its queue, so later counts of it move by one
    embedded = [load_x(cols=320), mm(16, 8, 8, wait=Cond(0, "dma", 1)),
                vop("vadd", 1, 16, wait=Cond(0, "mat", 1))]
    standalone = [load_x(cols=320), Wait(0, "mat", Cond(0, "dma", 1)), mm(16, 8, 8),
                  Wait(0, "vec", Cond(0, "mat", 2)), vop("vadd", 1, 16)]
    a, b = (simulate(prog(p, X320), TINY) for p in (embedded, standalone))
    work = [0, 2, 4]                # the standalone program's non-sync instructions
    for times in ("start", "free", "done"):
        assert list(getattr(a, times)) == list(getattr(b, times)[work])
    assert list(a.start) == [0, 30, 62] and a.cycles == b.cycles == 63
    assert list(b.start[[1, 3]]) == [30, 62]       # each wait passes once its condition holds


def test_barrier_releases_every_queue_when_the_last_work_completes():
    # before it: L0 dma done at 30 (its flow ends at 10, plus latency), L0 mat at 20, L0 vec
    # at 1; Legion 1 is idle. Everything after it starts at 30, on both Legions.
    before = [load_x(cols=320), mm(4, 8, 8), vop("vadd", 1, 16)]
    after = [vop("vadd", 1, 16, legion=1), load_x(legion=1, cols=320), mm(16, 8, 8, legion=1),
             vop("vexp", 1, 16)]
    t = simulate(prog([*before, Barrier(), *after], X320), TINY)
    assert list(t.done[:3]) == [30, 20, 1]
    assert t.start[3] == t.done[3] == 30
    assert list(t.start[4:]) == [30] * 4
    assert t.cycles == 30 + 32


def test_barrier_with_idle_queues_counts_in_every_queue():
    # Only L0 mat works before the first barrier. L1 vec runs nothing but the barriers, so
    # its completed prefix is 1 once the first one passes. A last barrier ends with the work.
    instrs = [mm(16, 8, 8), Barrier(), vop("vadd", 1, 16, wait=Cond(1, "vec", 1)), Barrier()]
    t = simulate(prog(instrs), TINY)
    assert t.done[1] == 32 and t.start[2] == 32
    assert t.start[3] == t.done[3] == 33 and t.cycles == 33
    assert simulate(prog([Barrier(), Barrier()]), TINY).cycles == 0


def test_deadlock_names_the_unsatisfiable_wait():
    instrs = [vop("vadd", 1, 16), Wait(0, "mat", Cond(0, "vec", 2)), mm(4, 8, 8),
              vop("vadd", 1, 16, legion=1, wait=Cond(0, "mat", 1))]
    with pytest.raises(Deadlock) as e:
        simulate(prog(instrs), TINY)
    assert str(e.value) == ("<program>: instruction 1: wait on L0 mat waits for L0.vec>=2, never "
                            "satisfied (L0.vec completed 1); 1 other instruction(s) blocked too")


def test_deadlock_names_an_unsatisfiable_embedded_wait():
    with pytest.raises(Deadlock) as e:
        simulate(prog([mm(4, 8, 8, wait=Cond(1, "dma", 1))]), TINY)
    assert str(e.value) == ("<program>: instruction 0: mm on L0 mat waits for L1.dma>=1, never "
                            "satisfied (L1.dma completed 0)")


def test_deadlock_behind_a_barrier():
    # the matmul waits for L0 dma's second instruction, the barrier, which the matmul's own
    # queue can only reach after the matmul; every other queue is held at the barrier
    instrs = [load_x(cols=320), mm(4, 8, 8, wait=Cond(0, "dma", 2)), Barrier(), vop("vadd", 1, 16)]
    with pytest.raises(Deadlock) as e:
        simulate(prog(instrs, X320), TINY)
    assert str(e.value) == ("<program>: instruction 1: mm on L0 mat waits for L0.dma>=2, never "
                            "satisfied (L0.dma completed 1); 1 other instruction(s) blocked too")


def test_barrier_holds_only_the_queues_of_the_machine():
    # An instruction on a Legion the machine lacks (the verifier rejects it) has a queue of
    # its own, which holds no barrier: the barrier must not wait for it, nor skip its work.
    instrs = [vop("vadd", 1, 16, legion=5), Barrier(), vop("vadd", 1, 16, legion=5), mm(4, 8, 8)]
    t = simulate(prog(instrs), TINY)
    assert list(t.start) == [0, 0, 1, 0]


def test_execute_order_respects_dependencies_and_time():
    instrs = [vop("vadd", 1, 16),                               # 0: L0 vec, done at 1
              vop("vexp", 1, 16, wait=Cond(0, "dma", 1)),       # 1: after the DMA, done at 34
              load_x(cols=320),                                 # 2: L0 dma, done at 30
              Barrier(),                                        # 3: at 34, no effect to execute
              mm(16, 8, 8)]                                     # 4: L0 mat, from 34 to 66
    seen = []
    t = simulate(prog(instrs, X320), TINY, seen.append)
    assert seen == [0, 2, 1, 4]
    assert list(np.diff(t.done[seen]) >= 0) == [True] * 3
    assert t.done[3] == 34 and t.done[4] == 34 + 32


def test_zero_time_dependent_runs_after_what_it_waits_for():
    # an empty matmul and vector op take no time; the vector op (index 0) is earlier in
    # program order but waits on the matmul (index 1)
    instrs = [vop("vadd", 0, 16, wait=Cond(0, "mat", 1)), mm(4, 0, 8)]
    seen = []
    simulate(prog(instrs), TINY, seen.append)
    assert seen == [1, 0]


def test_execute_exception_propagates():
    def boom(i):
        raise RuntimeError(f"bad {i}")
    with pytest.raises(RuntimeError, match="bad 0"):
        simulate(prog([mm(4, 8, 8)]), TINY, boom)


def test_counts_per_family_and_per_matmul_rows():
    x = [x_tensor(1, 16)]
    instrs = [load_x(cols=16), Wait(0, "mat", Cond(0, "dma", 1)), mm(4, 8, 8, mode="w4"),
              vop("vexp", 1, 16), Barrier()]
    c = simulate(prog(instrs, x), TINY).counters
    assert [c[f"count_{f}"] for f in ("dma", "matrix", "drain", "vector", "sync")] == [1, 1, 0, 1, 2]
    assert c["busy_sync"] == 0
    (row,) = c["per_instr"]
    assert (row["index"], row["mode"], row["macs"], row["cycles"]) == (2, "w4", 256, 4 + 8)
    assert row["done"] - row["start"] == 8 + 4 + 8     # its weights' load shows: they came with the wait


def test_equal_instructions_share_a_cost_and_count_once_per_task():
    # Equal instructions are costed once; the counters still add that cost for every task of
    # each (a span of 2 is two tasks), and each task keeps its own family's count.
    x = [x_tensor(1, 16)]
    spanned = dataclasses.replace(vop("vadd", 1, 16), span=2)
    instrs = [load_x(cols=16), load_x(cols=16), vop("vadd", 1, 16), vop("vadd", 1, 16),
              vop("vadd", 1, 16, legion=1), spanned, spanned, mm(4, 8, 8), mm(4, 8, 8), mm(4, 8, 16)]
    c = simulate(prog(instrs, x), TINY).counters
    want = Counter()
    for i in instrs:
        for _ in range(getattr(i, "span", None) or 1):
            want.update(cost(i, TINY, Env(tuple(x), {})).counters)
    assert {name: c[name] for name in want} == dict(want)
    assert (c["count_dma"], c["count_vector"], c["count_matrix"]) == (2, 7, 3)


def test_costs_shared_by_place_differ_by_every_field_they_read():
    """DMA and MatMul costs are cached by the fields they depend on: the same cost for another
    place, a different one for another type, dtype, receiver count, shape or accumulation."""
    env = Env((x_tensor(1, 64), x_tensor(1, 64, "f32")), {})
    ld = load_x(cols=64)
    moved = dataclasses.replace(ld, src=DramRef(0, 32, 64), dst=View("act", 128, 64))
    assert cost(moved, TINY, env) == cost(ld, TINY, env)
    assert cost(dataclasses.replace(ld, src=DramRef(1, 0, 64)), TINY, env).flow_bytes == 4 * 64
    both = cost(load_x(cols=64, dests={0, 1}), TINY, env).counters
    assert both["multicast_saved_bytes"] == 64 and both["spad_bytes"] == 2 * 64
    store = DmaStore(0, DramRef(0, 0, 64), View("act", 0, 64), 1, 64)
    assert cost(store, TINY, env).counters["dram_write_bytes"] == 64
    assert "dram_write_bytes" not in cost(ld, TINY, env).counters
    a = mm(16, 32, 8)
    assert cost(dataclasses.replace(a, acc=View("acc", 64, 8), legion=1), TINY, env) == cost(a, TINY, env)
    assert cost(mm(8, 32, 8), TINY, env).cycles < cost(a, TINY, env).cycles
    psum = cost(a, TINY, env).counters["psum_bytes"]
    assert cost(mm(16, 32, 8, accumulate="add"), TINY, env).counters["psum_bytes"] > psum
    k = mm(16, 32, 8, split="k")
    assert cost(k, ONE_CORE, env).cycles > cost(k, TINY, env).cycles
    assert cost(a, dataclasses.replace(TINY, dataflow="ws"), env).cycles > cost(a, TINY, env).cycles


def test_twenty_thousand_instructions_with_barriers_simulate():
    # Speed is measured in bench/bench_layer.py, not here: the machine is shared.
    a = load("dlegion-8x8")
    drain = Drain(0, View("vec", 0, 64), View("acc", 0, 64), 16, 64, None, None, None, None, "set")

    def block(r):
        # in repetition r each queue's (r + 1)-th instruction is the one waited for; a barrier
        # ends every tenth repetition and counts once in every queue
        n = r + 1 + r // 10
        out = []
        for l in range(8):
            out += [load_x(legion=l, dests={l}, rows=4, cols=64),
                    mm(16, 64, 64, legion=l, wait=Cond(l, "dma", n)),
                    dataclasses.replace(drain, legion=l, wait=Cond(l, "mat", n))]
        return out + [Barrier()] * (r % 10 == 9)

    reps = 20000 // 24 + 1
    p = prog([i for r in range(reps) for i in block(r)], [x_tensor(4, 64)])
    t = simulate(p, a)
    assert t.counters["count_matrix"] == 8 * reps and t.counters["count_sync"] == reps // 10
    assert np.all(t.done >= t.start)


# --- a property of every schedule ------------------------------------------------------------

KEYS = [(legion, q) for legion in range(TINY.legions) for q in QUEUES]


@st.composite
def forward_programs(draw):
    """Programs on TINY whose conditions name only instructions earlier in program order, so
    that they cannot deadlock."""
    dispatched = Counter()          # queue -> its instructions so far
    instrs = []
    for _ in range(draw(st.integers(1, 14))):
        what = draw(st.sampled_from(["vadd", "mm", "dma.ld", "wait", "barrier"]))
        if what == "barrier":
            instrs.append(Barrier())
            dispatched.update(KEYS)
            continue
        target = draw(st.sampled_from(KEYS))
        cond = Cond(*target, draw(st.integers(0, dispatched[target])))
        if what != "wait" and draw(st.booleans()):
            cond = None
        legion = draw(st.integers(0, TINY.legions - 1))
        i = {"vadd": lambda: vop("vadd", 1, draw(st.integers(1, 48)), legion=legion, wait=cond),
             "mm": lambda: mm(draw(st.integers(1, 16)), 8, 8, legion=legion, wait=cond),
             "dma.ld": lambda: load_x(legion=legion, cols=draw(st.integers(1, 320)), wait=cond),
             "wait": lambda: Wait(legion, draw(st.sampled_from(QUEUES)), cond)}[what]()
        instrs.append(i)
        dispatched[(i.legion, i.queue())] += 1
    return prog(instrs, X320)


def queue_items(p) -> dict:
    items = {key: [] for key in KEYS}
    for k, i in enumerate(p.instrs):
        for key in KEYS if isinstance(i, Barrier) else [(i.legion, i.queue())]:
            items[key].append(k)
    return items


@settings(max_examples=150, deadline=None)
@given(forward_programs())
def test_every_instruction_starts_as_soon_as_its_queue_and_condition_allow(p):
    t = simulate(p, TINY)
    items = queue_items(p)

    def prefix_done(key, n):        # when queue ``key`` has completed its first n instructions
        return max((t.done[k] for k in items[key][:n]), default=0.0)

    for k, i in enumerate(p.instrs):
        if isinstance(i, Barrier):
            ready = max(prefix_done(key, items[key].index(k)) for key in KEYS)
            assert t.start[k] == t.done[k] == ready, k
            continue
        key = (i.legion, i.queue())
        at = items[key].index(k)
        cond = i.until if isinstance(i, Wait) else i.wait
        ready = max(t.free[items[key][at - 1]] if at else 0.0,
                    prefix_done((cond.legion, cond.queue), cond.count) if cond else 0.0)
        assert t.start[k] == ready, k


def test_overlapped_passes_pay_one_fill_and_drain():
    """K=32 -> 4 passes on one 8x8 core; lead: the first window's 8-cycle load. Pipelined, a pass
    starts every max(M, 8) cycles and only the last pass's fill and drain (8, or 16 for WS) show."""
    piped = dataclasses.replace(ONE_CORE, pass_overlap=True)
    assert cycles(ONE_CORE, mm(16, 32, 8)) == 8 + 4 * (16 + 8)
    assert cycles(piped, mm(16, 32, 8)) == 8 + 3 * 16 + (16 + 8)
    # fewer rows than a weight load: the next window's load paces the passes
    assert cycles(piped, mm(4, 32, 8)) == 8 + 3 * 8 + (4 + 8)
    ws = dataclasses.replace(piped, dataflow="ws")
    assert cycles(ws, mm(16, 32, 8)) == 8 + 3 * 16 + (16 + 16)
    # one pass has nothing to overlap with
    assert cycles(piped, mm(16, 8, 8)) == cycles(ONE_CORE, mm(16, 8, 8))


def test_pass_overlap_needs_double_buffered_weights():
    with pytest.raises(ValueError, match="pass_overlap needs double_buffered_weights"):
        dataclasses.replace(ONE_CORE, pass_overlap=True, double_buffered_weights=False)


def test_psum_port_bounds_a_matmul_when_narrower_than_its_updates():
    """4 passes of 16 rows x 8 columns: 16 x 8 x (2 x 4 - 1) = 896 psum words (the first update
    of a `set` only writes). A port of 8 words a cycle needs 112 cycles, more than the passes' 96."""
    narrow = dataclasses.replace(ONE_CORE, parallel_accumulators=False, acc_port_words=8)
    t = simulate(prog([mm(16, 32, 8)]), narrow)
    assert t.counters["psum_bytes"] == 4 * 896
    assert t.cycles == 8 + 112
    wide = dataclasses.replace(narrow, acc_port_words=16)
    assert cycles(wide, mm(16, 32, 8)) == 8 + 4 * 24      # 56 cycles of port work hide in the passes
