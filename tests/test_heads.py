"""Attention by head groups (``dlegion_cc/lower/heads.py``): one group's softmax on the vector
unit while the arrays multiply the next group's QK^T, the same bits as all heads at once."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import numpy as np
import pytest

from isa.instructions import DmaLoad, DmaStore, MatMul, VUnary, Wait
from dlegion_cc.lower.heads import plan
from dlegion_cc.pipeline import Options, compile_model
from runtime.emulator import run
from runtime.state import Trap
from runtime.timing import simulate
from test_attention_int8 import D, WIDE, _inputs, _onnxruntime, _rel, attention

HEADS, SEQ, KV = 8, 128, 2


@lru_cache(maxsize=None)
def _compiled(tmp: str, head_groups: bool, seq: int = SEQ):
    from pathlib import Path
    path = Path(tmp) / f"attn{seq}.onnx"
    if not path.exists():
        attention(path, HEADS, seq, KV)
    return compile_model(path, Options(WIDE, attention="int8", head_groups=head_groups))[1]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("heads"))


def _qk_passes(program) -> list[int]:
    """QK^T's passes: those whose contraction is a head's width (P.V's is the sequence)."""
    return [k for k, i in enumerate(program.instrs) if isinstance(i, MatMul) and i.K <= D]


def _exps(program) -> list[int]:
    return [k for k, i in enumerate(program.instrs) if isinstance(i, VUnary) and i.MNEMONIC == "vexp"]


def test_attention_by_head_groups_matches_all_heads_at_once_and_onnxruntime(tmp):
    """The same bits as the program over all heads at once, both race-checked, and within the
    int8 attention's bound of onnxruntime."""
    grouped, plain = _compiled(tmp, True), _compiled(tmp, False)
    assert any(" + " in name for _, name in grouped.regions)
    assert not any(" + " in name for _, name in plain.regions)
    x = _inputs(HEADS, SEQ, KV)
    got = run(grouped, WIDE, x, races=True).outputs["o"]
    np.testing.assert_array_equal(got, run(plain, WIDE, x, races=True).outputs["o"])
    err = _rel(got, _onnxruntime(f"{tmp}/attn{SEQ}.onnx", x))
    assert 1e-4 < err < 2e-2


def test_a_groups_softmax_is_issued_and_runs_before_the_next_groups_last_qk_pass(tmp):
    """In program order and in time, the first group's softmax (its first exp) comes before the
    last QK^T pass; over all heads at once, after it."""
    for head_groups in (True, False):
        program = _compiled(tmp, head_groups)
        exps, passes = _exps(program), _qk_passes(program)
        assert exps and passes
        assert (exps[0] < passes[-1]) == head_groups
        timeline = simulate(program, WIDE)
        tasks = timeline.program.instrs
        qk = [k for k in range(len(timeline.start)) if isinstance(tasks[k], MatMul) and tasks[k].K <= D]
        first_exp = min(k for k in range(len(timeline.start))
                        if isinstance(tasks[k], VUnary) and tasks[k].MNEMONIC == "vexp")
        assert (timeline.done[first_exp] < timeline.start[qk].max()) == head_groups


def test_vs_quantization_runs_while_the_arrays_multiply_the_first_groups_qk(tmp):
    """V's quantization (between the softmax and P.V, reading neither) is merged with the first
    group's QK^T (one region), in the part of ``vec`` the products leave, and has stored V
    before the second group's passes start; over all heads at once it runs in its node's place,
    after the softmax. The same bits either way (``test_attention_by_head_groups_matches_...``)."""
    for head_groups in (True, False):
        program = _compiled(tmp, head_groups)
        assert any("MatMul_7 + v5_t_0_absmax_0" == name for _, name in program.regions) == head_groups
        timeline = simulate(program, WIDE)
        tasks = timeline.program.instrs
        v = next(t for t, tensor in enumerate(program.tensors) if tensor.name == "v5_t_0_q_0_t_0")
        stores = [k for k in range(len(timeline.start)) if isinstance(tasks[k], DmaStore) and tasks[k].dst.tensor == v]
        qk = sorted((k for k in range(len(timeline.start)) if isinstance(tasks[k], MatMul) and tasks[k].K <= D),
                    key=lambda k: timeline.start[k])
        assert stores and qk
        first_group = qk[len(qk) // 2] if head_groups else qk[0]     # two groups of four heads
        assert (timeline.done[stores].max() < timeline.start[first_group]) == head_groups


LONG = 256      # K of 16384 elements, 2048 a Legion: its smoothing runs in two parts


def test_ks_smoothing_runs_for_the_first_groups_k_heads_before_its_qk_and_for_the_rest_beside_it(tmp):
    """K's mean over the tokens, and its smoothed quantization for the K head the first group
    reads (one of two), run in a region of their own, the smoothing of the other merged with the
    first group's QK^T, whose first pass starts before K's last codes are stored; over all heads
    at once, each node over all of K before QK^T. The same bits either way, both race-checked;
    at sequence 128 (1024 elements of K a Legion) they run whole."""
    assert "k5_mean_1" in [name for _, name in _compiled(tmp, True).regions]
    x = _inputs(HEADS, LONG, KV)
    outs = [run(_compiled(tmp, head_groups, LONG), WIDE, x, races=True).outputs["o"] for head_groups in (True, False)]
    np.testing.assert_array_equal(*outs)
    for head_groups in (True, False):
        program = _compiled(tmp, head_groups, LONG)
        names = [name for _, name in program.regions]
        assert ("k5_mean_1 + k5_smooth_0_absmax_0" in names) == head_groups
        assert ("MatMul_7 + k5_smooth_0_absmax_0 + v5_t_0_absmax_0" in names) == head_groups
        assert ("k5_mean_1" in names and "k5_smooth_0_absmax_0" in names) != head_groups
        timeline = simulate(program, WIDE)
        tasks = timeline.program.instrs
        codes = next(t for t, tensor in enumerate(program.tensors) if tensor.name == "k5_smooth_0_q_0")
        stores = [k for k in range(len(timeline.start)) if isinstance(tasks[k], DmaStore) and tasks[k].dst.tensor == codes]
        qk = [k for k in range(len(timeline.start)) if isinstance(tasks[k], MatMul) and tasks[k].K <= D]
        assert stores and qk
        assert (timeline.start[qk].min() < timeline.done[stores].max()) == head_groups


def test_the_race_check_finds_a_wait_removed_between_a_softmax_and_its_pv(tmp):
    """P.V's first loads wait (the waits its DMA queue issues right before them) for the softmax
    that stored P on other Legions and for the QK^T drains merged before them that used their
    slots: without those waits, a load races."""
    program = _compiled(tmp, True)
    p = next(t for t, tensor in enumerate(program.tensors) if tensor.name == "p_q_0")     # the quantized P
    assert any(isinstance(i, DmaStore) and i.dst.tensor == p for i in program.instrs)
    k = next(k for k, i in enumerate(program.instrs) if isinstance(i, DmaLoad) and i.src.tensor == p)
    waits = _waits_before(program, k)
    assert waits
    broken = replace(program, instrs=[_unwaited(i, len(program.instrs)) if j in waits else i
                                      for j, i in enumerate(program.instrs)])
    run(program, WIDE, _inputs(HEADS, SEQ, KV), races=True)
    with pytest.raises(Trap, match=r"dma.ld: race on"):
        run(broken, WIDE, _inputs(HEADS, SEQ, KV), races=True)


def _waits_before(program, k: int) -> list[int]:
    """The waits, and the loads that wait, in the run of P.V's own loads (of P, its row scales,
    V and its scales) and waits that ``k``'s Legion's DMA queue issues up to ``k`` (spanned ones
    over it too)."""
    i, out = program.instrs[k], []
    for j in range(k, -1, -1):
        w = program.instrs[j]
        if not w.legion <= i.legion < w.legion + (getattr(w, "span", None) or 1) or w.queue() != "dma":
            continue
        if isinstance(w, Wait):
            out.append(j)
        elif isinstance(w, DmaLoad) and program.tensors[w.src.tensor].name.startswith(("p_", "v5_t_0")):
            out += [j] if w.wait is not None else []
        else:
            break
    return out


def _unwaited(i, far: int):
    """``i`` waiting for nothing: a Wait for all but the last ``far`` instructions of a queue."""
    if isinstance(i, Wait):
        return replace(i, until=replace(i.until, count=None, back=far))
    return replace(i, wait=None)


def test_a_single_head_is_not_grouped(tmp_path):
    """Too few heads to give each group two: no groups, the attention as over all heads."""
    from dlegion_cc.pipeline import graph_of
    from dlegion_cc.lower.context import Lowering
    from dlegion_cc.lower.emitter import Emitter
    path = attention(tmp_path / "one.onnx", 1, 64)
    graph = graph_of(path, Options(WIDE, attention="int8"))
    low = Lowering(graph, Emitter(WIDE, graph.source))
    at = next(k for k, n in enumerate(graph.nodes) if n.op == "AttnMatMul")
    assert plan(low, graph.nodes, at) == ({}, [])


def _groups(path) -> int:
    """The head groups ``plan`` picks for the attention model at ``path``."""
    from dlegion_cc.pipeline import graph_of
    from dlegion_cc.lower.context import Lowering
    from dlegion_cc.lower.emitter import Emitter
    graph = graph_of(path, Options(WIDE, attention="int8"))
    at = next(k for k, n in enumerate(graph.nodes) if n.op == "AttnMatMul")
    return len(plan(Lowering(graph, Emitter(WIDE, graph.source)), graph.nodes, at)[1])


def test_short_sequences_take_fewer_groups(tmp_path, monkeypatch):
    """Groups of fewer than FEWEST_GROUP_SCORES scores cost more than they hide: the most
    groups that hold that many, two when none does."""
    from dlegion_cc.lower import heads
    path = attention(tmp_path / "short.onnx", HEADS, SEQ, KV)
    assert HEADS // 2 * SEQ * SEQ < heads.FEWEST_GROUP_SCORES and _groups(path) == 2
    monkeypatch.setattr(heads, "FEWEST_GROUP_SCORES", HEADS // 4 * SEQ * SEQ)
    assert _groups(path) == 4
    monkeypatch.setattr(heads, "FEWEST_GROUP_SCORES", HEADS // 4 * SEQ * SEQ + 1)
    assert _groups(path) == 2


def test_long_sequences_take_groups_by_their_scores(tmp_path, monkeypatch):
    """A group's products grow with the square of the sequence: 2B4T's attention (20 heads of
    128 over 5 K heads) takes 10 groups at 512, where a group's rows of scores (heads by
    queries) would hold too few for more than 4, and 2 at 256. The same bits as in 4 groups,
    both race-checked, in fewer cycles."""
    import test_attention_int8
    from dlegion_cc.lower import heads
    monkeypatch.setattr(test_attention_int8, "D", 128)
    heads_, kv = 20, 5
    assert _groups(attention(tmp_path / "at256.onnx", heads_, 256, kv)) == 2
    path = attention(tmp_path / "at512.onnx", heads_, 512, kv)
    assert _groups(path) == 10
    ten = compile_model(path, Options(WIDE, attention="int8"))[1]
    monkeypatch.setattr(heads, "MOST_GROUPS", 4)
    assert _groups(path) == 4
    four = compile_model(path, Options(WIDE, attention="int8"))[1]
    x = _inputs(heads_, 512, kv)
    np.testing.assert_array_equal(run(ten, WIDE, x, races=True).outputs["o"],
                                  run(four, WIDE, x, races=True).outputs["o"])
    assert simulate(ten, WIDE).cycles < simulate(four, WIDE).cycles


def test_steps_bound_by_the_arrays_load_ahead_of_their_stores_and_compute_the_same(tmp, monkeypatch):
    """Where a step's passes outweigh its vector work (ARRAYS_BOUND: the last P.V at least), its
    loads go ahead of its stores in the DMA queues: the same bits as without, both race-checked,
    and P.V's passes no longer wait a DRAM round trip for each next load."""
    from pathlib import Path
    from dlegion_cc.lower import heads
    path = Path(tmp) / f"attn{SEQ}.onnx"
    ahead = _compiled(tmp, True)
    monkeypatch.setattr(heads, "_staying", lambda program, arch, ks, rows: set(ks))
    behind = compile_model(path, Options(WIDE, attention="int8", head_groups=True))[1]
    x = _inputs(HEADS, SEQ, KV)
    np.testing.assert_array_equal(run(ahead, WIDE, x, races=True).outputs["o"],
                                  run(behind, WIDE, x, races=True).outputs["o"])
    assert _stores_before_loads(ahead) < _stores_before_loads(behind)
    assert simulate(ahead, WIDE).cycles < simulate(behind, WIDE).cycles


def test_the_products_loads_go_ahead_of_the_softmaxs_stores_in_every_step(tmp, monkeypatch):
    """In the steps the arrays do not bound, the products' loads go ahead of the softmax's stores
    and the softmax's loads keep their place: the same bits as with none of them moved, both
    race-checked, in fewer cycles."""
    from pathlib import Path
    from dlegion_cc.lower import heads
    path = Path(tmp) / f"attn{SEQ}.onnx"
    ahead = _compiled(tmp, True)
    bound = heads._arrays_bound
    monkeypatch.setattr(heads, "_staying", lambda program, arch, ks, rows: set() if bound(program, arch, ks) else set(ks))
    kept = compile_model(path, Options(WIDE, attention="int8", head_groups=True))[1]
    x = _inputs(HEADS, SEQ, KV)
    np.testing.assert_array_equal(run(ahead, WIDE, x, races=True).outputs["o"],
                                  run(kept, WIDE, x, races=True).outputs["o"])
    merged = lambda program: sum(_stores_before_loads(program, n) for n, (_, name) in  # noqa: E731
                                 enumerate(program.regions) if " + " in name)
    assert merged(ahead) < merged(kept)
    assert simulate(ahead, WIDE).cycles < simulate(kept, WIDE).cycles


def test_a_causal_pvs_multicasts_are_issued_by_the_last_legion(tmp_path, monkeypatch):
    """P.V runs beside the next group's QK^T, whose first Legion has the most passes: the last
    Legion's DMA queue issues P's multicasts. The same bits as from the first Legion, both
    race-checked, in fewer cycles (2B4T's attention: 20 heads of 128 over 5 K heads, at 512)."""
    import test_attention_int8
    from dlegion_cc.lower import qplan, qtiles
    monkeypatch.setattr(test_attention_int8, "D", 128)
    path = attention(tmp_path / "pv.onnx", 20, 512, 5)
    last = compile_model(path, Options(WIDE, attention="int8"))[1]
    first = lambda p, legions: legions[-1 if p.n_reach is not None and p.n_origin is None else 0]  # noqa: E731
    monkeypatch.setattr(qplan, "multicaster", first)
    monkeypatch.setattr(qtiles, "multicaster", first)
    before = compile_model(path, Options(WIDE, attention="int8"))[1]
    assert _multicasters(last) == {WIDE.legions - 1} and _multicasters(before) == {0}
    x = _inputs(20, 512, 5)
    np.testing.assert_array_equal(run(last, WIDE, x, races=True).outputs["o"],
                                  run(before, WIDE, x, races=True).outputs["o"])
    assert simulate(last, WIDE).cycles < simulate(before, WIDE).cycles


def _multicasters(program) -> set[int]:
    """The Legions that issue the multicast loads of the last P.V's step (the region after the
    last of merged steps)."""
    ranges = program.region_ranges()
    last = max(n for n, (_, name) in enumerate(program.regions) if " + " in name) + 1
    return {program.instrs[k].legion for k in ranges[last]
            if isinstance(program.instrs[k], DmaLoad) and len(program.instrs[k].dests) > 1}


def _stores_before_loads(program, region: int | None = None) -> int:
    """Pairs of a store and a later load on one Legion's DMA queue in a region: by default the
    last P.V's step (the region after the last of merged steps)."""
    ranges = program.region_ranges()
    if region is None:
        region = max(n for n, (_, name) in enumerate(program.regions) if " + " in name) + 1
    count, stores = 0, {}
    for i in (program.instrs[k] for k in ranges[region]):
        if isinstance(i, DmaStore):
            stores[i.legion] = stores.get(i.legion, 0) + 1
        elif isinstance(i, DmaLoad):
            count += stores.get(i.legion, 0)
    return count
