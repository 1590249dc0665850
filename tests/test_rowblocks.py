"""Matmuls and row kernels pipelined by row blocks (dlegion_cc/lower/rowblocks.py): the chain's
barriers give way to waits, the program computes what the plain one does (race-checked), and
the race check finds a wait removed from it."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import given, strategies as st

from isa import arch
from isa.instructions import Barrier, DmaLoad, DmaStore, MatMul, NocMove, VBinary, VReduce, VUnary
from dlegion_cc.lower.rowblocks import FEWEST_ROWS, _apart, _insert, _spans, _Touched, _union, split
from dlegion_cc.lower.tails import with_tails
from dlegion_cc.pipeline import Options, compile_model
from models.bitnet import BitLinear, build_bitnet, preset, save
from models.decoder import relu2, rms_norm
from models.graph import FLOAT, GraphBuilder, tensor_info
from runtime.emulator import random_inputs, run
from runtime.report import regions_by_name
from runtime.state import Trap
from runtime.timing import simulate

EIGHT = arch.load("dlegion-8x8")
SEQ = 256


@lru_cache(maxsize=None)
def _stack(tmp: str) -> str:
    """Gate/up on absmax-quantized rows, ReLU^2 * up quantized, down: one chain."""
    config = preset("tiny", layers=1, seq=SEQ, hidden=128, ffn=256)
    b, proj = GraphBuilder(), BitLinear(config, np.random.default_rng(0))
    xq = proj.prepare(b, "x")
    up = proj.project(b, xq, "up_proj", 128, 256)
    hidden = b.op("Mul", relu2(b, proj.project(b, xq, "gate_proj", 128, 256)), up)
    down = proj.project(b, proj.prepare(b, hidden), "down_proj", 256, 128)
    path = f"{tmp}/stack.onnx"
    save(b.model([tensor_info("x", FLOAT, [1, SEQ, 128])], [tensor_info(down, FLOAT, [1, SEQ, 128])]), path, external_data=False)
    return path


@lru_cache(maxsize=None)
def _compiled(tmp: str, row_blocks: bool):
    return compile_model(_stack(tmp), Options(EIGHT, row_blocks=row_blocks))[1]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("rowblocks"))


def test_split_covers_the_rows_in_aligned_blocks():
    assert split(512, 3, 16) == [range(0, 176), range(176, 352), range(352, 512)]
    assert split(256, 2, 16) == [range(0, 128), range(128, 256)]


def test_the_chain_is_emitted_by_row_blocks_and_computes_the_same(tmp):
    program, plain = _compiled(tmp, True), _compiled(tmp, False)
    names = [name for _, name in program.regions]
    # a row kernel's block merged with the next matmul block: one region named after both
    kernel = _product_kernel(program)
    assert any("gate_proj" in n and f" with {kernel}" in n for n in names)
    assert any(n.startswith("down_proj") and f" with {kernel}" in n for n in names)
    assert sum(isinstance(i, Barrier) for i in program.instrs) < sum(isinstance(i, Barrier) for i in plain.instrs)
    inputs = random_inputs(plain, 0)
    got, want = run(program, EIGHT, inputs).outputs, run(plain, EIGHT, inputs).outputs   # race-checked
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def _product_kernel(program) -> str:
    """The name of the row kernel that quantizes ReLU^2 * up for down_proj (the product itself
    is made in gate/up's drains, ``passes/gated.py``): the kernel down_proj's region is merged with."""
    return next(name.split(" with ")[1] for _, name in program.regions
                if "down_proj" in name.split(" with ")[0] and " with " in name)


def _stored_then_loaded(program) -> list[int]:
    """Loads, with a condition, of a scratch tensor an earlier store wrote: a row kernel reading
    the rows a matmul block drained."""
    written, out = set(), []
    for k, i in enumerate(program.instrs):
        if isinstance(i, DmaStore):
            written.add(i.dst.tensor)
        elif isinstance(i, DmaLoad) and i.src.tensor in written and i.condition() is not None:
            out.append(k)
    return out


def test_the_race_check_finds_a_wait_removed_from_the_chain(tmp):
    """The first load of a row kernel's block that reads what a matmul block stored waits for
    that store, on another queue: without the wait, a race."""
    program = _compiled(tmp, True)
    k = _stored_then_loaded(program)[0]
    broken = replace(program, instrs=[replace(i, wait=None) if j == k else i for j, i in enumerate(program.instrs)])
    with pytest.raises(Trap, match=rf"instruction {k}: dma.ld: race on"):
        run(broken, EIGHT, random_inputs(program, 0))


def test_a_row_kernel_block_runs_while_the_arrays_multiply_the_next(tmp):
    """The kernel of ReLU^2 * up's quantization: its first row block computes before the arrays finish the last pass
    of gate/up's second block (the two merged into one region); one after the other, none would."""
    timeline = simulate(_compiled(tmp, True), EIGHT)
    tasks = timeline.program.instrs
    kernel = _product_kernel(timeline.program)
    name, members = next((n, m) for n, m in regions_by_name(timeline.program).items()
                         if "gate_proj" in n and f"with {kernel}" in n)
    passes = [k for k in members if isinstance(tasks[k], MatMul)]
    vector = [k for k in members if isinstance(tasks[k], (VUnary, VBinary, VReduce))]
    assert passes and vector
    assert timeline.done[vector].min() < timeline.done[passes].max()


def test_a_matmul_leaves_a_wide_row_kernel_before_it_a_row_of_vec(monkeypatch):
    """A row kernel whose row needs more than half of ``vec`` (ReLU^2 * up of 2B4T) is
    interleaved with the next matmul block only if the matmul plans in what the row leaves."""
    from types import SimpleNamespace
    from dlegion_cc.lower import rowblocks
    machine = arch.load("dlegion-8x8")
    vec = machine.derived.spad_elems["vec"]
    wide, narrow = vec * 3 // 4, vec // 8
    width = {"wide": wide, "narrow": narrow}
    monkeypatch.setattr(rowblocks, "row_kernel_width", lambda n: width[n.name])
    node = lambda name, kind: SimpleNamespace(name=name, domain=kind[0], op=kind[1])  # noqa: E731
    steps = [node("a", rowblocks.MATMUL), node("narrow", rowblocks.ROWS), node("a", rowblocks.MATMUL),
             node("b", rowblocks.MATMUL), node("wide", rowblocks.ROWS), node("b", rowblocks.MATMUL)]
    rooms = rowblocks._vec_rooms(machine, steps)
    assert rooms["a"] == vec // rowblocks.VEC_SHARE
    assert rooms["b"] == vec - wide


@lru_cache(maxsize=None)
def _projection(tmp: str, row_blocks: bool):
    """A norm-like absmax quantization of x and the one projection reading it: a chain whose
    row kernel comes before its matmul."""
    seq = 4 * FEWEST_ROWS           # four row blocks
    config = preset("tiny", layers=1, seq=seq, hidden=128, ffn=256)
    b, proj = GraphBuilder(), BitLinear(config, np.random.default_rng(1))
    y = proj.project(b, proj.prepare(b, "x"), "q_proj", 128, 512)
    path = f"{tmp}/projection.onnx"
    save(b.model([tensor_info("x", FLOAT, [1, seq, 128])], [tensor_info(y, FLOAT, [1, seq, 512])]), path, external_data=False)
    return compile_model(path, Options(EIGHT, row_blocks=row_blocks))[1]


def test_a_row_kernel_before_a_matmul_runs_its_next_block_while_the_arrays_multiply(tmp):
    """Each of the quantization's row blocks but the first is merged with the projection's block
    before it (regions named after both) and computes before the arrays start the projection's
    last pass; the kernel's blocks all before the matmul, only the last would be merged. The
    same outputs, race-checked."""
    program, plain = _projection(tmp, True), _projection(tmp, False)
    assert sum(" with " in name for _, name in program.regions) == 3
    timeline = simulate(program, EIGHT)
    tasks = timeline.program.instrs
    name, members = next((n, m) for n, m in regions_by_name(timeline.program).items() if "q_proj" in n and " with " in n)
    vector = [k for k in members if isinstance(tasks[k], (VUnary, VBinary, VReduce))]
    passes = [k for k, i in enumerate(tasks) if isinstance(i, MatMul)]
    assert vector and passes
    assert timeline.done[vector].max() < timeline.start[passes].max()
    inputs = random_inputs(plain, 0)
    got, want = run(program, EIGHT, inputs).outputs, run(plain, EIGHT, inputs).outputs   # race-checked
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


@lru_cache(maxsize=None)
def _wide(tmp: str, row_blocks: bool):
    """2B4T's MLP (gate/up, ReLU^2 * up, ffn_sub_norm and quantization, down): the kernel's row
    (gate, up, the norm's weight, its quantized output in place of one of them) takes most of
    ``vec``."""
    from models.decoder import mlp
    config = preset("2b4t", layers=1, seq=SEQ)
    spec, b = config.spec(), GraphBuilder()
    rng = np.random.default_rng(2)
    out = mlp(b, "x", spec, BitLinear(config, rng), rng)
    path = f"{tmp}/wide.onnx"
    io = [tensor_info(name, FLOAT, [1, SEQ, spec.hidden]) for name in ("x", out)]
    save(b.model(io[:1], io[1:]), path, external_data=False)
    return compile_model(path, Options(EIGHT, row_blocks=row_blocks))[1]


def test_a_wide_row_kernel_with_its_output_in_place_leaves_the_matmuls_whole_row_blocks(tmp):
    """The row of ReLU^2 * up's norm and quantization counted with its output in place (as ``rowwise`` then lays it): the
    matmuls beside it keep at least the row blocks' 128 rows a pass (counted with a row of its own,
    gate/up and down were left room for passes of 64 rows, each paying its fill and drain),
    the kernel's blocks still merged with the matmul blocks after them; the same outputs as
    without row blocks, race-checked."""
    program, plain = _wide(tmp, True), _wide(tmp, False)
    names = [name for _, name in program.regions]
    kernel = _product_kernel(program)
    assert any("gate_proj" in n and f" with {kernel}" in n for n in names)
    assert any("down_proj" in n and f" with {kernel}" in n for n in names)
    # (the last matmul's columns past its first windows pass all the rows at once: ``qlong``)
    assert min(i.M for i in program.instrs if isinstance(i, MatMul)) == SEQ // 2
    inputs = random_inputs(plain, 0)
    got, want = run(program, EIGHT, inputs).outputs, run(plain, EIGHT, inputs).outputs   # race-checked
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


@lru_cache(maxsize=None)
def _layer(tmp: str, row_blocks: bool):
    """A tiny BitNet layer at two row blocks: the projections' chain, then the query's rotary
    over its heads through views."""
    path = f"{tmp}/layer.onnx"
    save(build_bitnet(preset("tiny", layers=1, seq=SEQ)), path, external_data=False)
    return compile_model(path, Options(EIGHT, row_blocks=row_blocks))[1]


def test_the_rotary_after_the_projections_runs_beside_their_last_block(tmp):
    """The query's rotary (a row kernel over heads, a chain's tail) computes the rows before the
    projections' last block while the arrays multiply that block: its first vector work is done
    before their last pass starts, in the one region named after both; the rest follows in a
    region of its own. The layer computes what the plain program does (race-checked)."""
    program, plain = _layer(tmp, True), _layer(tmp, False)
    timeline = simulate(program, EIGHT)
    tasks, regions = timeline.program.instrs, regions_by_name(timeline.program)
    name, members = next((n, m) for n, m in regions.items()
                         if n.startswith("model.layers.0.self_attn.q_proj") and " with model.layers.0.self_attn/Add_36" in n)
    passes = [k for k in members if isinstance(tasks[k], MatMul)]
    vector = [k for k in members if isinstance(tasks[k], (VUnary, VBinary, VReduce))]
    assert passes and vector
    assert timeline.done[vector].min() < timeline.start[passes].max()
    assert any(n.startswith("model.layers.0.self_attn/Add_36") for n in regions)
    inputs = random_inputs(plain, 0)
    got, want = run(program, EIGHT, inputs).outputs, run(plain, EIGHT, inputs).outputs
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_the_keys_rotary_runs_beside_the_last_block_in_a_part_of_vec_of_its_own(tmp):
    """The key's rotary is a second tail kernel: its rows before the projections' last block are
    stored in the region of that block, from elements of ``vec`` above those the query's rotary
    beside it uses, so that the two interleave: the key's first rows are stored before the
    query's last; the last rows of both follow side by side, in one region."""
    program = _layer(tmp, True)
    timeline = simulate(program, EIGHT)
    tasks, regions = timeline.program.instrs, regions_by_name(timeline.program)
    name, members = next((n, m) for n, m in regions.items() if n.startswith("model.layers.0.self_attn.q_proj")
                         and " with model.layers.0.self_attn/Add_36" in n)
    assert " + model.layers.0.self_attn/Add_43" in name
    assert any(n.startswith("model.layers.0.self_attn/Add_36") and " with model.layers.0.self_attn/Add_43" in n
               for n in regions)
    names = [t.name for t in timeline.program.tensors]

    def stores(part):
        return [k for k in members if isinstance(tasks[k], DmaStore) and part in names[tasks[k].dst.tensor]]
    query, key = stores("add_36"), stores("add_43")
    assert query and key
    assert min(tasks[k].src.addr for k in key) >= max(tasks[k].src.addr + tasks[k].cols for k in query)
    assert timeline.start[key].min() < timeline.start[query].max()      # not one kernel after the other


def test_a_tail_takes_a_block_of_rows_before_each_block_of_the_last_matmul_but_the_first():
    """The norm's blocks R, the projections' blocks M, the tails Q and K: each block's rows of
    the tails go with the next matmul block (after the norm's block merged with it)."""
    R, M, Q, K = "R", "M", "Q", "K"
    steps = [R, R, M, R, M, R, M, M]
    assert with_tails(steps, M, [Q, K]) == [R, R, M, R, Q, K, M, R, Q, K, M, Q, K, M]


def _passes_after_next_block_loads(program) -> dict[int, int]:
    """Per int8 tensor the passes read from ``act``: how many passes of its first row block
    (rows below ``SEQ // 2``) come in program order after a load of its second block's rows.
    Each Legion's ``act`` window holds what the last load (or transfer) into it brought."""
    held, late, seen = {}, {}, set()
    ranks = lambda i: range(i.span or 1)                # noqa: E731
    for i in program.instrs:
        if isinstance(i, DmaLoad) and i.dst.space == "act":
            first = i.src.offset // i.src.rs
            held.update({(legion + r, i.dst.addr): (i.src.tensor, first) for r in ranks(i) for legion in i.dests})
            if first >= SEQ // 2:
                seen.add(i.src.tensor)
        elif isinstance(i, NocMove) and i.dst.space == "act":
            held.update({(legion + r, i.dst.addr): held.get((i.legion + r, i.src.addr))
                         for r in ranks(i) for legion in i.dests})
        elif isinstance(i, MatMul):
            for r in ranks(i):
                tensor, first = held.get((i.legion + r, i.act.addr), (None, 0))
                if tensor is not None:
                    late[tensor] = late.get(tensor, 0) + (first < SEQ // 2 and tensor in seen)
    return late


def test_a_row_block_loads_its_first_rows_before_the_last_pass_of_the_block_before(tmp):
    """Each matmul of the chain takes its next row block's first activations into slots the
    block before has done with, and loads them before that block's last pass: left behind its
    last stores in the in-order DMA queue, they would cross DRAM while the arrays idle. The
    same outputs as without row blocks (``test_the_chain_is_emitted_by_row_blocks_...``)."""
    late = _passes_after_next_block_loads(_compiled(tmp, True))
    assert len(late) == 2 and all(n > 0 for n in late.values())
    assert not any(_passes_after_next_block_loads(_compiled(tmp, False)).values())


def test_with_pipelined_passes_a_chain_matmul_passes_its_row_blocks_whole(tmp):
    """With ``pass_overlap`` the cost model, which times a matmul alone, finds tiles of a few
    rows hardly slower than tiles of all of them; in a chain they drain and store more often
    behind the row kernel's work. There each tile takes all the rows of its row block (gate/up
    128, down 64 in each of its two parts of the Legions; 32 would be chosen otherwise), and the
    outputs are those of the plain program, race-checked."""
    piped = replace(EIGHT, pass_overlap=True)
    program = compile_model(_stack(tmp), Options(piped))[1]
    plain = compile_model(_stack(tmp), Options(piped, row_blocks=False))[1]
    assert {i.M for i in program.instrs if isinstance(i, MatMul)} == {SEQ // 2, SEQ // 4}
    inputs = random_inputs(plain, 0)
    got, want = run(program, piped, inputs).outputs, run(plain, piped, inputs).outputs
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def _kind(name: str, kind: tuple):
    from types import SimpleNamespace
    return SimpleNamespace(name=name, domain=kind[0], op=kind[1])


def test_a_leading_row_kernel_is_interleaved_with_the_blocks_of_the_first_segment():
    """A chain norm, matmul, kernel, matmul in four blocks: the norm's block b + 1 comes right
    before the matmul's block b, after the segment kernel's block b - 1; a matmul step takes
    the run of kernel steps before it, each node once (the norm's block 0, which its block 0
    reads, stays a step of its own)."""
    from dlegion_cc.lower import rowblocks
    norm, mm, kernel, last = (_kind("norm", rowblocks.ROWS), _kind("mm", rowblocks.MATMUL),
                              _kind("kernel", rowblocks.ROWS), _kind("last", rowblocks.MATMUL))
    steps = list(rowblocks._order([norm, mm, kernel, last], split(4 * FEWEST_ROWS, 4, 16)))
    assert [s.name for s in steps] == ["norm", "norm", "mm", "kernel", "norm", "mm", "kernel", "norm", "mm",
                                       "kernel", "mm", "kernel"] + ["last"] * 4
    before = {at: [s.name for s in rowblocks._rows_before(steps, at)]
              for at, s in enumerate(steps) if s.domain == rowblocks.MATMUL[0] and s.op == rowblocks.MATMUL[1]}
    assert before[2] == ["norm"] and before[5] == before[8] == ["kernel", "norm"] and before[10] == ["kernel"]
    assert before[12] == ["kernel"] and before[13] == []


def test_a_chain_too_short_for_two_blocks_may_take_two_of_half_the_fewest_rows(monkeypatch):
    """With a row kernel's vector work worth hiding, a chain of FEWEST_ROWS rows takes two
    blocks of half as many; one of twice as many rows never takes blocks under FEWEST_ROWS."""
    from types import SimpleNamespace
    from dlegion_cc.lower import rowblocks
    rng = np.random.default_rng(0)
    weight = rng.integers(-1, 2, size=(256, 256)).astype(np.int8)
    mm = SimpleNamespace(name="mm", domain=rowblocks.MATMUL[0], op=rowblocks.MATMUL[1], attrs={"weight": weight})

    def kernel(rows):
        return SimpleNamespace(name="k", domain=rowblocks.ROWS[0], op=rowblocks.ROWS[1],
                               attrs={"nodes": [None] * 20, "frame": SimpleNamespace(shape=(rows, 8192))})
    assert rowblocks.blocks(EIGHT, [kernel(FEWEST_ROWS), mm], FEWEST_ROWS) == 2
    assert rowblocks.blocks(EIGHT, [kernel(FEWEST_ROWS // 2), mm], FEWEST_ROWS // 2) == 1
    twice = rowblocks.blocks(EIGHT, [kernel(2 * FEWEST_ROWS), mm], 2 * FEWEST_ROWS)
    assert 2 * FEWEST_ROWS // twice >= FEWEST_ROWS


@lru_cache(maxsize=None)
def _two_projections(tmp: str, row_blocks: bool):
    """x quantized, a projection, its output quantized, a second projection: a chain whose
    leading kernel and segment kernel both run beside the first projection's blocks."""
    seq = 4 * FEWEST_ROWS           # four row blocks
    config = preset("tiny", layers=1, seq=seq, hidden=128, ffn=256)
    b, proj = GraphBuilder(), BitLinear(config, np.random.default_rng(2))
    q = proj.project(b, proj.prepare(b, "x"), "q_proj", 128, 256)
    y = proj.project(b, proj.prepare(b, q), "up_proj", 256, 128)
    path = f"{tmp}/two_projections.onnx"
    save(b.model([tensor_info("x", FLOAT, [1, seq, 128])], [tensor_info(y, FLOAT, [1, seq, 128])]), path, external_data=False)
    return compile_model(path, Options(EIGHT, row_blocks=row_blocks))[1]


def test_a_matmul_block_runs_beside_two_row_kernels_and_computes_the_same(tmp):
    """The first projection's middle blocks are each merged with the next block of the
    quantization before it and the block before of the one after it (one region named after
    the three); the outputs are the plain program's, race-checked."""
    program, plain = _two_projections(tmp, True), _two_projections(tmp, False)
    both = [name for _, name in program.regions if name.startswith("q_proj") and " with " in name and " + " in name]
    assert len(both) == 2
    inputs = random_inputs(plain, 0)
    got, want = run(program, EIGHT, inputs).outputs, run(plain, EIGHT, inputs).outputs   # race-checked
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_a_merged_row_kernel_starts_after_the_first_passes_of_its_matmul_step():
    """A row kernel merged with a matmul step is spread over it from its pass KERNEL_BEHIND to
    before its last KERNEL_AHEAD passes (at most half-way through those): its first loads, which
    wait for the step before's last stores, then do not hold the step's first loads back in the
    in-order DMA queue. A step with too few passes takes it from its start."""
    from types import SimpleNamespace
    from dlegion_cc.lower import rowblocks
    behind, ahead = rowblocks.KERNEL_BEHIND, rowblocks.KERNEL_AHEAD

    def merged(passes: int) -> tuple[list, list[int]]:
        instrs = [object.__new__(MatMul) if k < 2 * passes and k % 2 else object()      # a load, a pass
                  for k in range(2 * passes + 5)]
        kernel = list(range(2 * passes, 2 * passes + 5))
        order = rowblocks._before_last_passes(SimpleNamespace(instrs=instrs), list(range(2 * passes)), kernel)
        return order, [order.index(k) for k in kernel]

    order, at = merged(2 * behind + ahead + 4)
    assert sorted(order) == list(range(len(order)))
    assert min(at) > order.index(2 * behind + 1) and max(at) < order.index(2 * (2 * behind + 4) + 1)
    # Fewer passes: from half-way through those before the last KERNEL_AHEAD, before pass KERNEL_BEHIND.
    order, at = merged(behind + ahead + 4)
    half = (behind + 4) // 2
    assert order.index(2 * half + 1) < min(at) < order.index(2 * behind + 1)
    order, at = merged(behind + ahead)
    assert min(at) < order.index(5)


def test_a_merged_row_kernel_stores_late_and_the_matmul_loads_early():
    """A merged row kernel's store, which waits for its vector work, goes right before the
    kernel's next instruction, and a matmul's load right after the matmul's instruction before
    it, so that the kernel's DMA does not hold the matmul's next loads back in the in-order DMA
    queue; each keeps its own order."""
    from types import SimpleNamespace
    from dlegion_cc.lower import rowblocks
    store, load, other = object.__new__(DmaStore), object.__new__(DmaLoad), object()
    instrs = SimpleNamespace(instrs=[other, object.__new__(MatMul), store, other, other, load, other, store, load])
    kernel = {2, 4, 7}
    assert rowblocks._stores_late(instrs, list(range(8)), kernel) == [0, 1, 3, 2, 4, 5, 6, 7]
    assert rowblocks._stores_late(instrs, [2, 3, 5, 7], kernel) == [3, 5, 2, 7]
    assert rowblocks._loads_early(instrs, [0, 1, 2, 4, 5, 6, 7, 8], kernel) == [0, 1, 5, 2, 4, 6, 8, 7]


@lru_cache(maxsize=None)
def _with_residual(tmp: str, row_blocks: bool):
    """The stack, then its input added to down_proj's output and the sum normed (a layer's
    residual Add and final norm): one row kernel, the chain's last."""
    config = preset("tiny", layers=1, seq=SEQ, hidden=128, ffn=256)
    b, rng = GraphBuilder(), np.random.default_rng(0)
    proj = BitLinear(config, rng)
    xq = proj.prepare(b, "x")
    hidden = b.op("Mul", relu2(b, proj.project(b, xq, "gate_proj", 128, 256)), proj.project(b, xq, "up_proj", 128, 256))
    residual = b.op("Add", proj.project(b, proj.prepare(b, hidden), "down_proj", 256, 128), "x")
    normed = rms_norm(b, residual, "norm", 128, 1e-5, rng)
    path = f"{tmp}/residual.onnx"
    save(b.model([tensor_info("x", FLOAT, [1, SEQ, 128])],
                 [tensor_info(residual, FLOAT, [1, SEQ, 128]), tensor_info(normed, FLOAT, [1, SEQ, 128])]),
         path, external_data=False)
    return compile_model(path, Options(EIGHT, row_blocks=row_blocks))[1]


def _last_rows_loaded_before_the_last_pass(program) -> int:
    """Loads of the input's rows of the last row block (the residual's) from down_proj's first
    step to its last pass."""
    x = next(k for k, t in enumerate(program.tensors) if t.name == "x")
    first = min(at for at, name in program.regions if name.startswith("down_proj"))
    last = max(k for k, i in enumerate(program.instrs) if isinstance(i, MatMul))
    return sum(isinstance(i, DmaLoad) and i.src.tensor == x and i.src.offset >= SEQ // 2 * 128
               for i in program.instrs[first:last])


def test_the_last_rows_after_the_chain_load_the_residual_before_the_last_pass(tmp):
    """The residual Add and norm after down_proj's last row block run above what that block
    keeps in ``vec``, so their first loads (of the residual, the input) go ahead of its last
    pass; the outputs are the plain program's, race-checked."""
    program, plain = _with_residual(tmp, True), _with_residual(tmp, False)
    assert _last_rows_loaded_before_the_last_pass(program) > 0
    inputs = random_inputs(plain, 0)
    got, want = run(program, EIGHT, inputs).outputs, run(plain, EIGHT, inputs).outputs   # race-checked
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def _scratch_dma(tmp: str):
    """(tensors of the stack's program, a store of 16 elements of ``vec`` at ``addr`` to a scratch
    tensor at ``offset``, a load of them back): DMA transfers of Legion 0 that touch what they name."""
    from isa.fields import DramRef, View
    tensors = _compiled(tmp, True).tensors
    t = next(n for n, x in enumerate(tensors) if x.kind not in ("const", "input"))

    def store(addr: int, offset: int) -> DmaStore:
        return DmaStore(legion=0, dst=DramRef(t, offset, 16), src=View("vec", addr, 16), rows=1, cols=16)

    def load(addr: int, offset: int) -> DmaLoad:
        return DmaLoad(legion=0, dests=frozenset({0}), dst=View("vec", addr, 16), src=DramRef(t, offset, 16),
                       rows=1, cols=16)
    return tensors, store, load


def test_a_steps_loads_go_ahead_of_the_instructions_before_them_they_share_nothing_with(tmp):
    """A load goes ahead of the stores before it in the in-order DMA queue, up to one that reads
    the scratchpad it writes; one reading what a store before it writes stays behind that store."""
    from isa.program import Program
    from dlegion_cc.lower import rowblocks
    tensors, store, load = _scratch_dma(tmp)
    program = Program(EIGHT.name, tensors, [store(0, 0), store(64, 16), load(128, 64), load(0, 96), load(256, 16)])
    assert rowblocks._loads_ahead(program, EIGHT, list(range(5)), {}) == [2, 0, 3, 1, 4]


def test_the_stores_after_a_steps_last_pass_go_behind_the_next_steps_first_loads(tmp):
    """A store behind a step's last pass that nothing after it in the step reads over or waits
    for goes into the next step ahead of its first drain or store, behind its first loads and
    passes; one whose slot a later instruction of the step, or a load it would pass, writes stays."""
    from isa.fields import View
    from isa.program import Program
    from dlegion_cc.lower import rowblocks
    tensors, store, load = _scratch_dma(tmp)
    passed = MatMul(legion=0, acc=View("acc", 0, 16), act=View("act", 0, 16), wgt=View("wgt", 0, 16), M=1, K=16,
                    N=16, mode="w8", split="n", accumulate="set", mask=None)
    program = Program(EIGHT.name, tensors, [passed, store(0, 0), store(64, 16), load(64, 32),
                                            load(128, 48), passed, store(256, 64), store(128, 80)])
    before, step = [0, 1, 2, 3, 7], [4, 5, 6]
    rowblocks._stores_after(program, EIGHT, before, step, {})
    assert before == [0, 2, 3, 7] and step == [4, 5, 1, 6]


@lru_cache(maxsize=None)
def _short_blocks(tmp: str, loads_ahead_rows: int):
    """The stack's chain over FEWEST_ROWS rows, in two blocks of half as many."""
    from dlegion_cc.lower import rowblocks
    config = preset("tiny", layers=1, seq=FEWEST_ROWS, hidden=128, ffn=256)
    b, proj = GraphBuilder(), BitLinear(config, np.random.default_rng(0))
    xq = proj.prepare(b, rms_norm(b, "x", "norm", 128, 1e-5, np.random.default_rng(1)))
    down = proj.project(b, proj.prepare(b, relu2(b, proj.project(b, xq, "up_proj", 128, 256))), "down_proj", 256, 128)
    path = f"{tmp}/short.onnx"
    save(b.model([tensor_info("x", FLOAT, [1, FEWEST_ROWS, 128])], [tensor_info(down, FLOAT, [1, FEWEST_ROWS, 128])]),
         path, external_data=False)
    kept, rowblocks.LOADS_AHEAD_ROWS = rowblocks.LOADS_AHEAD_ROWS, loads_ahead_rows
    try:
        return compile_model(path, Options(EIGHT))[1]
    finally:
        rowblocks.LOADS_AHEAD_ROWS = kept


def _loads_by(program, legion: int) -> list[int]:
    """The loads among the first n loads and stores of ``legion``'s DMA queue, for each n."""
    kinds = [isinstance(i, DmaLoad) for i in program.instrs
             if isinstance(i, (DmaLoad, DmaStore)) and i.legion == legion]
    return np.cumsum(kinds).tolist()


def test_a_chain_of_short_blocks_loads_ahead_and_computes_the_same(tmp):
    """Blocks of fewer than LOADS_AHEAD_ROWS rows put their loads ahead of their stores in the DMA
    queues: the same bits as without, both race-checked."""
    ahead, behind = _short_blocks(tmp, FEWEST_ROWS), _short_blocks(tmp, 0)
    for legion in range(EIGHT.legions):
        a, b = _loads_by(ahead, legion), _loads_by(behind, legion)
        assert len(a) == len(b) and all(x >= y for x, y in zip(a, b))
    assert any(_loads_by(ahead, legion) != _loads_by(behind, legion) for legion in range(EIGHT.legions))
    assert sum(" with " in name for _, name in ahead.regions) >= 1
    x = random_inputs(ahead, 0)
    got = run(ahead, EIGHT, x, races=True).outputs
    want = run(behind, EIGHT, x, races=True).outputs
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


@given(st.lists(st.tuples(st.integers(0, 64), st.integers(0, 16)), max_size=24))
def test_windows_added_one_at_a_time_make_the_union_made_at_once(windows):
    spans = [(lo, lo + n) for lo, n in windows]
    union = ([], [])
    for lo, hi in spans:
        _insert(union, lo, hi)
    assert union == _union(spans)


def test_what_instructions_touch_grown_one_at_a_time_answers_as_apart(tmp):
    """``_Touched`` against ``_apart`` on a chain's instructions: random sets checked against
    random sets, and grown one instruction at a time."""
    program = _compiled(tmp, True)
    rng, n = np.random.default_rng(0), len(program.instrs)
    answers = set()
    for _ in range(60):
        behind = sorted(rng.choice(n, size=int(rng.integers(1, 40)), replace=False).tolist())
        touched = _Touched(_spans(program, behind[:1]))
        for j, k in enumerate(behind[1:], 1):
            touched.add(_spans(program, [k]))
            probe = [int(rng.integers(n))]
            answers.add(_apart(program, probe, behind[:j + 1]))
            assert touched.apart(_spans(program, probe)) == _apart(program, probe, behind[:j + 1])
    assert answers == {True, False}


def test_a_chain_after_a_node_that_failed_reports_that_failure(tmp, monkeypatch):
    """The attention's products fail (as the 2B4T's did at 4096, no tiling fitting): the chain
    after them reads their output and stops, and the error names the products' failure, not
    the chain's missing input with a traceback."""
    from dlegion_cc.errors import CompileError
    from dlegion_cc.lower import heads

    def no_room(*args, **kwargs):
        raise ValueError("no tiling fits")
    monkeypatch.setattr(heads, "lower_attention", no_room)
    path = f"{tmp}/failing.onnx"
    save(build_bitnet(preset("tiny", layers=1, seq=SEQ)), path, external_data=False)
    with pytest.raises(CompileError) as failed:
        compile_model(path, Options(EIGHT))
    assert str(failed.value).splitlines() == [f"{path}: node 'model.layers.0.self_attn/MatMul_51' (AttnMatMul): no tiling fits"]
