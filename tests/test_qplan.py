"""The quantized-matmul scheduler: every candidate schedule is exact, and the cost model's pick
is as fast as the best of all candidates in the timing model, up to a stated margin."""
import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isa import arch
from isa.arch import MODE_BITS, MODE_TILES
from isa.expand import expand
from isa.instructions import DmaLoad, Drain, MatMul
from dlegion_cc.lower.context import Switches
from dlegion_cc.lower.emitter import Emitter
from dlegion_cc.lower.qmatmul import block_maps
from dlegion_cc.lower import qbound, qplan
from dlegion_cc.lower.qplan import TAIL_PIECES, Problem, RowScale, candidates, choose, estimate
from dlegion_cc.lower.qtiles import emit_tiles
from runtime.costs import Env, cost
from runtime.emulator import RunResult, run
from runtime.report import summarize
from runtime.timing import simulate

TINY = arch.load("dlegion-tiny")
# The model replays the schedule with each flow's share of DRAM fixed when it is issued, and
# the timing model shares DRAM continuously: on these cases the two rank schedules alike to
# within a few percent, so the pick must be within 10% of the exhaustive best.
MARGIN = 1.10


def problem(machine, M, K, N, sparsity=0.0, seed=0, mode="w2"):
    """An Emitter holding one BitLinear-like matmul y = (a . w) / s * scale, and its Problem."""
    rng = np.random.default_rng(seed)
    em, na = Emitter(machine, "t"), machine.array
    n_pad = -(-N // na) * na
    w = rng.integers(-1, 2, (K, n_pad)).astype(np.int8)
    w[:, N:] = 0
    for r in range(0, K, 2 * na):
        for c in range(0, n_pad, 2 * na):
            if rng.random() < sparsity:
                w[r:r + 2 * na, c:c + 2 * na] = 0
    a8 = em.tensor("a", "i8", (M, K), "input", io_name="a")
    s = em.tensor("s", "f32", (M,), "input", io_name="s")
    scale = rng.uniform(0.5, 1.5, (1, n_pad)).astype(np.float32)
    weights = ((em.const("w", w, "i8" if mode == "w8" else mode), mode),)
    p = Problem(a8, RowScale(s, 0, 1, "recip"), weights, em.const("scale", scale, "f32"), 1, K, None,
                None, None, 0, "w8", None, False, em.tensor("y", "f32", (M, N), "output", io_name="y"), range(M), K, N,
                n_pad, block_maps([w], na))
    return em, p, w[:, :N], scale[0, :N]


def compiled(machine, plan, *args, **kw):
    em, p, w, scale = problem(machine, *args, **kw)
    emit_tiles(em, p, plan)
    return em.program(None), w, scale


def cycles(machine, plan, *args, **kw):
    return simulate(compiled(machine, plan, *args, **kw)[0], machine).cycles


CASES = [(8, 64, 32), (40, 256, 96), (1, 512, 64), (24, 128, 64, 0.5), (64, 96, 24)]


@pytest.mark.parametrize("case", CASES)
def test_pick_is_within_margin_of_the_exhaustive_best(case):
    em, p, _, _ = problem(TINY, *case)
    plans = candidates(TINY, p, Switches())
    assert len(plans) > 1
    real = {plan: cycles(TINY, plan, *case) for plan in plans}
    best = min(real.values())
    pick = choose(TINY, p)
    assert real[pick] <= MARGIN * best, (real[pick], best, pick)


def test_every_candidate_is_exact():
    M, K, N = 12, 160, 40          # several row blocks, chunks, tiles and slot counts among them
    em, p, _, _ = problem(TINY, M, K, N, sparsity=0.3)
    rng = np.random.default_rng(1)
    a = rng.integers(-128, 128, (M, K)).astype(np.int8)
    s = rng.uniform(0.5, 2.0, M).astype(np.float32)
    plans = candidates(TINY, p, Switches())
    assert {plan.order for plan in plans} == {"rows", "cols"}
    assert {plan.whole_rows for plan in plans} == {True, False}
    # One plan of each shape: order, slot kinds, several row blocks or column tiles or not.
    shapes = {}
    for plan in plans:
        shape = (plan.order, plan.whole_rows, plan.rows < M, plan.cols < plan.per_legion, plan.acc_slots,
                 plan.res_slots, min(plan.a_slots, 3), min(plan.w_slots, 3))
        shapes.setdefault(shape, plan)
    assert len(shapes) >= 8
    for plan in shapes.values():
        program, w, scale = compiled(TINY, plan, M, K, N, sparsity=0.3)
        got = run(program, TINY, {"a": a, "s": s}).outputs["y"]
        acc = (a.astype(np.int64) @ w.astype(np.int64)).astype(np.float32)
        want = acc * (np.float32(1) / s)[:, None] * scale[None, :]
        np.testing.assert_array_equal(got, want, err_msg=str(plan))


def test_model_tracks_the_timing_model():
    """The estimate of the pick is within 25% of its simulated cycles at the design point."""
    machine = arch.load("dlegion-8x8")
    for case in [(256, 1024, 512), (1, 2048, 1024)]:
        em, p, _, _ = problem(machine, *case)
        pick = choose(machine, p)
        est, real = estimate(machine, p, pick).cycles, cycles(machine, pick, *case)
        assert 0.75 * real <= est <= 1.25 * real, (case, est, real)


def test_weight_chunks_are_double_buffered():
    """A weight load into one slot starts while the arrays work on the other slot's chunk."""
    M, K, N = 32, 512, 32
    em, p, _, _ = problem(TINY, M, K, N)
    pick = choose(TINY, p)
    assert pick.w_slots >= 2
    program, _, _ = compiled(TINY, pick, M, K, N)
    t = simulate(program, TINY)
    loads = [k for k, i in enumerate(program.instrs) if isinstance(i, DmaLoad) and i.dst.space == "wgt"]
    mms = [k for k, i in enumerate(program.instrs) if isinstance(i, MatMul)]
    assert len(loads) > 2
    overlapped = [k for k in loads[1:] if any(t.start[m] < t.start[k] < t.done[m] for m in mms)]
    assert overlapped


def test_a_legions_first_weight_load_does_not_wait_for_its_activations():
    """Before the first pass both loads are on the critical path; later weight chunks of a
    K-chunked schedule load behind their activations (``qplan.weights_wait``)."""
    machine, case = arch.load("dlegion-8x8"), (256, 1024, 512)
    em, p, _, _ = problem(machine, *case)
    plan = next(pl for pl in candidates(machine, p, Switches()) if not pl.whole_rows)
    t = simulate(compiled(machine, plan, *case)[0], machine)
    loads = [(k, i.dst.space) for k, i in enumerate(t.program.instrs) if isinstance(i, DmaLoad) and i.legion == 1
             or isinstance(i, DmaLoad) and i.dst.space == "act"]
    acts = [k for k, space in loads if space == "act"]
    wgts = [k for k, space in loads if space == "wgt"]
    assert t.start[wgts[0]] < t.done[acts[0]]
    assert t.start[wgts[1]] >= t.done[acts[1]]


def test_a_legions_last_tile_drains_and_stores_in_row_pieces(monkeypatch):
    """Nothing hides a matmul's last store: it starts after a quarter of the last drain, so
    the matmul ends sooner than with its last tile in one piece (exactness: above)."""
    machine, case = arch.load("dlegion-8x8"), (256, 1024, 512)
    em, p, _, _ = problem(machine, *case)
    pick = choose(machine, p)
    program = compiled(machine, pick, *case)[0]
    drains = [i.M for i in program.instrs if isinstance(i, Drain) and i.legion == 0]
    assert drains[-TAIL_PIECES:] == [pick.rows // TAIL_PIECES] * TAIL_PIECES
    assert set(drains[:-TAIL_PIECES]) <= {pick.rows}
    pieces = simulate(program, machine).cycles
    monkeypatch.setattr(qplan, "TAIL_PIECES", 1)
    assert pieces < cycles(machine, pick, *case)


def test_no_accumulators_splits_passes_by_output_windows():
    em, p, _, _ = problem(TINY, 16, 128, 64)
    assert {plan.split for plan in candidates(TINY, p, Switches(accumulators=False))} == {"n"}
    assert {plan.split for plan in candidates(TINY, p, Switches())} == {"k"}


def test_nothing_fits_names_the_machine():
    """4096 scale groups of one row: their column scales alone overflow the vector scratchpad."""
    em, p, _, _ = problem(TINY, 4, 64, 16)
    huge = Problem(p.a8, None, p.weights, p.scales, 4096, 1, None, None, None, 0, "w8", None, False, p.out,
                   range(4), 4096, 16, 16)
    with pytest.raises(ValueError, match="fits the scratchpads of dlegion-tiny"):
        choose(TINY, huge)


def test_instruction_estimate_tracks_the_program():
    """The model counts instructions as qtiles emits them (once per span of Legions, and the
    waits of a multicast into a slot every Legion read): within 20% for every candidate."""
    for case in [(40, 256, 96), (12, 160, 40, 0.3)]:
        em, p, _, _ = problem(TINY, *case)
        for plan in candidates(TINY, p, Switches()):
            emitted = len(compiled(TINY, plan, *case)[0].instrs)
            assert 0.8 * emitted <= estimate(TINY, p, plan).instructions <= 1.2 * emitted, (case, plan)


def test_exact_results_get_tiles_of_half_the_accumulators():
    """Int32 results are stored straight from the accumulators: with tiles that fill them, the
    next tile's passes wait for the store. Tiles of half of them are candidates too, and the
    model picks at least two slots, one storing while another takes passes."""
    acc = TINY.derived.spad_elems["acc"]
    em, p, _, _ = problem(TINY, acc // 8, 64, 16)
    out = em.tensor("yi", "i32", (acc // 8, 16), "output", io_name="yi")
    exact = dataclasses.replace(p, rscale=None, scales=None, exact=True, out=out)
    rows = {plan.rows for plan in candidates(TINY, p, Switches())}
    assert {plan.rows for plan in candidates(TINY, exact, Switches())} > rows
    assert choose(TINY, exact).acc_slots >= 2


def _exact_batches(machine, M, K, N, batches):
    """An int32-result matmul (as a run-time B's product is) run ``batches`` times over in the
    same slots, its Problem saying so, and a function timing a plan of it."""
    em, p, _, _ = problem(machine, M, K, N, mode="w8")
    out = em.tensor("yi", "i32", (M, N), "output", io_name="yi")
    p = dataclasses.replace(p, rscale=None, scales=None, exact=True, out=out, batches=batches)

    def timed(plan):
        em2, p2, _, _ = problem(machine, M, K, N, mode="w8")
        out2 = em2.tensor("yi", "i32", (M, N), "output", io_name="yi")
        p2 = dataclasses.replace(p2, rscale=None, scales=None, exact=True, out=out2)
        emit_tiles(em2, p2, plan, more=(p2,) * (batches - 1))
        return simulate(em2.program(None), machine).cycles
    return p, timed


def test_exact_results_keep_their_stores_in_flight_in_more_accumulator_slots():
    """A store from the accumulators frees its slot one DRAM round trip after the tile's last
    pass: with a slot per tile in flight, short tiles (one batch of attention's QK^T) never wait
    for it. Two slots would leave the arrays idle for most of each round trip."""
    machine = arch.load("dlegion-8x8")
    p, timed = _exact_batches(machine, 128, 96, 128, batches=8)
    pick = choose(machine, p)
    assert pick.acc_slots > 2
    assert timed(pick) < 0.8 * timed(dataclasses.replace(pick, acc_slots=2))


@pytest.mark.parametrize("case", [(128, 96, 128, 8), (256, 96, 256, 4), (1024, 128, 512, 2)])
def test_model_tracks_the_timing_model_on_batched_exact_products(case):
    """The model replays the batches in their shared slots (the first few; the rest cost what
    the last did), and the stores of all Legions sharing DRAM: every candidate's estimate is
    within 10% of the timing model (with each store at its own link's rate, 28% below)."""
    machine = arch.load("dlegion-8x8")
    p, timed = _exact_batches(machine, *case[:3], batches=case[3])
    for plan in candidates(machine, p, Switches()):
        est, real = estimate(machine, p, plan).cycles, timed(plan)
        assert 0.9 * real <= est <= 1.1 * real, (case, plan, est, real)


# --- objectives: latency, energy, energy x delay ---------------------------------------------

OBJECTIVE_CASES = [(256, 512, 256, 0.0, 0, "w8"), (128, 1024, 256), (96, 768, 200)]


@pytest.mark.parametrize("objective", qplan.OBJECTIVES)
@pytest.mark.parametrize("case", OBJECTIVE_CASES)
def test_each_objective_picks_what_it_ranks_best(case, objective):
    """Against every candidate: none is better by the objective's own measure beyond ``EQUAL``."""
    _, p, _, _ = problem(TINY, *case)
    scores = {plan: qplan.score(TINY, p, plan, estimate(TINY, p, plan), objective)
              for plan in candidates(TINY, p, Switches())}
    pick = choose(TINY, p, Switches(objective=objective))
    assert scores[pick] <= (1 + qplan.EQUAL) * min(scores.values()), (pick, min(scores.values()))


@pytest.mark.parametrize("case", OBJECTIVE_CASES[:2])
def test_energy_trades_cycles_for_dram_traffic(case):
    """Timed, the energy pick moves fewer DRAM bytes than the latency pick and the latency pick
    takes fewer cycles; edp lies between them or on one of them."""
    _, p, _, _ = problem(TINY, *case)
    timed = {o: simulate(compiled(TINY, choose(TINY, p, Switches(objective=o)), *case)[0], TINY)
             for o in qplan.OBJECTIVES}
    dram = {o: t.counters["dram_read_bytes"] + t.counters["dram_write_bytes"] for o, t in timed.items()}
    assert dram["energy"] < dram["latency"] and timed["latency"].cycles < timed["energy"].cycles
    assert dram["energy"] <= dram["edp"] <= dram["latency"]


def test_picojoules_track_the_reports_energy():
    """The estimate's terms (DRAM, MACs, static power) against the same parts of the timed
    program's energy report, for every candidate: within 5%."""
    case = OBJECTIVE_CASES[1]
    _, p, _, _ = problem(TINY, *case)
    for plan in candidates(TINY, p, Switches())[::7]:
        tl = simulate(compiled(TINY, plan, *case)[0], TINY)
        parts = summarize(RunResult({}, tl, TINY, tl.program, None))["energy"]
        timed = sum(v for k, v in parts.items() if k in ("dram", "static") or k.startswith("mac_"))
        est = qplan.picojoules(TINY, p, plan, estimate(TINY, p, plan)) * 1e-12
        assert est == pytest.approx(timed, rel=0.05), plan


def test_an_unknown_objective_is_refused():
    _, p, _, _ = problem(TINY, 8, 64, 32)
    with pytest.raises(ValueError, match="unknown objective 'speed'"):
        choose(TINY, p, Switches(objective="speed"))


# --- floors (qbound) --------------------------------------------------------------------------

@pytest.mark.parametrize("case", [(128, 1024, 256), (96, 768, 200), (48, 1536, 384, 0.0, 0, "w8")])
def test_every_tile_shape_does_at_least_as_badly_as_the_floors(case):
    """A schedule whose passes stream a row block of ``plan.rows`` reads at least the floor's
    bytes beyond the compulsory activations and weights, and takes at least the floor's pass
    cycles (a single part: bands are its row blocks). The cases' activations outgrow ``act``,
    so the floors are not zero. One candidate of each tile shape, order and slot shape."""
    M, K, N = case[:3]
    mode = case[5] if len(case) > 5 else "w2"
    _, p, _, _ = problem(TINY, *case)
    shape = qbound.Shape(M, K, N, mode)
    assert qbound.reread_floor(TINY, shape, 1) > 0
    # Room for more partial sums (vec as well) makes tiles wider: fewer of them read again.
    assert qbound.reread_floor(TINY, shape, 1, vec=True) < qbound.reread_floor(TINY, shape, 1)
    shapes = {(plan.rows, plan.cols, plan.order, plan.whole_rows): plan for plan in candidates(TINY, p, Switches())}
    for plan in shapes.values():
        program = compiled(TINY, plan, *case)[0]
        env = Env(tuple(program.tensors), {})
        operands = {k for k, t in enumerate(program.tensors) if t.name in ("a", "w")}
        moved = sum(cost(i, TINY, env).flow_bytes for i in expand(program, TINY.legions).program.instrs
                    if isinstance(i, DmaLoad) and i.src.tensor in operands)
        compulsory = M * K + K * N * MODE_BITS[mode] // 8
        bands = -(-M // plan.rows)
        assert moved - compulsory >= qbound.reread_floor(TINY, shape, bands), plan
        assert simulate(program, TINY).cycles >= qbound.pass_floor(TINY, shape, bands), plan


def test_partial_sums_in_vec_still_take_a_window_of_the_accumulators():
    """The arrays add into the accumulators: a tile whose window of rows is as large as ``vec``
    gains nothing from keeping partial sums there, a tile of half its rows does."""
    window = TINY.array * MODE_TILES["w2"]
    rows = TINY.derived.spad_elems["vec"] // window
    tall, short = qbound.Shape(rows, 4096, 512, "w2"), qbound.Shape(rows // 2, 4096, 512, "w2")
    assert qbound.reread_floor(TINY, tall, 1, vec=True) == qbound.reread_floor(TINY, tall, 1) > 0
    assert qbound.reread_floor(TINY, short, 1, vec=True) < qbound.reread_floor(TINY, short, 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=3),
                min_size=1, max_size=3), st.integers(0, 120))
def test_mix_is_the_cheapest_convex_combination(options, allowance):
    """Against every combination of the items' options in steps of a tenth: none is cheaper
    within the allowance, and the finest one found is no dearer than the mix plus a step's worth."""
    best = qbound.mix(options, allowance)
    grid = [w / 10 for w in range(11)]
    found = math.inf
    for choice in itertools.product(*[itertools.product(range(len(o)), range(len(o)), grid) for o in options]):
        nbytes = cost = 0.0
        for points, (i, j, w) in zip(options, choice):
            nbytes += w * points[i][0] + (1 - w) * points[j][0]
            cost += w * points[i][1] + (1 - w) * points[j][1]
        if nbytes <= allowance + 1e-9:
            found = min(found, cost)
    assert found >= best - 1e-6
    if found < math.inf:
        assert found <= best + 5 * len(options) + 1e-6
    else:
        assert best == math.inf or best >= min(p[1] for o in options for p in o)


def test_tiles_fit_a_vector_room_the_fewest_row_blocks_overflow():
    """Many rows, few columns a Legion, a small part of ``vec`` (a causal QK^T's at 4096 in the
    head groups' room): the accumulators take 2048 rows of 16 columns, so the fewest row blocks
    are tiles of 820 rows and more, whose results overflow 12,288 elements; smaller tiles fit."""
    eight = arch.load("dlegion-8x8")
    _, p, _, _ = problem(eight, 4096, 128, 256, mode="w8")
    tight = dataclasses.replace(p, vec_room=12_288)
    plans = candidates(eight, tight, Switches())
    assert plans and all(plan.rows * plan.cols <= 12_288 for plan in plans)
    assert choose(eight, tight).rows < 820
    roomy = {(plan.rows, plan.cols) for plan in candidates(eight, p, Switches())}
    assert (820, 16) in roomy            # where they fit, the fewest row blocks are still there
