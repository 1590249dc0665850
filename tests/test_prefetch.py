"""A quantized matmul's first weights, loaded while the node before it runs. The tiny BitNet's row
kernels run on one Legion of dlegion-8x8, as a decode step's do."""
from collections import Counter, defaultdict
from functools import lru_cache
from pathlib import Path

import numpy as np

from isa import arch, asm, encoding
from isa.expand import expand
from isa.fields import QUEUES
from isa.instructions import Barrier, DmaLoad, Wait
from dlegion_cc.lower.prefetch import prefetch_weights, reorder
from dlegion_cc.pipeline import Options, compile_model
from models.bitnet import build_bitnet, preset, save
from runtime.emulator import random_inputs, run
from runtime.report import regions_by_name
from runtime.timing import simulate

BITNET = Path(__file__).parent.parent / "models" / "bitnet_tiny_relu2.onnx"
EIGHT = arch.load("dlegion-8x8")


@lru_cache(maxsize=None)
def _compiled(prefetch: bool):
    # barriers at node ends, which the prefetch replaces around the loads it moves
    return compile_model(BITNET, Options(EIGHT, prefetch=prefetch, overlap=False, attention="fp32"))[1]


def test_each_projections_first_weights_load_during_the_kernel_before():
    program, plain = _compiled(True), _compiled(False)
    entries = Counter(name for _, name in program.regions)
    matmuls = [name for name, members in regions_by_name(program).items()
               if any(program.instrs[k].MNEMONIC == "mm" for k in members)]
    # every projection (Q/K/V, O, gate/up, down of both layers) has an entry of weight loads
    # inside the row kernel before it
    assert len(matmuls) == 8 and all(entries[name] == 2 for name in matmuls)
    ends = [at for at, _ in program.regions[1:]] + [len(program.instrs)]
    prefetched = [range(at, end) for (at, name), end in zip(program.regions, ends)
                  if name in matmuls and not any(program.instrs[k].MNEMONIC == "mm" for k in range(at, end))]
    # weight loads that wait for nothing but the wait (the kernel's own) just before them
    gates = [program.instrs[r.start - 1] for r in prefetched]
    assert all(isinstance(w, Wait) and w.queue() == "dma" for w in gates)
    loads = [program.instrs[k] for r in prefetched for k in r]
    assert loads and all(isinstance(i, DmaLoad) and i.dst.space == "wgt" and i.wait is None for i in loads)
    # a region entered twice survives the text and binary formats
    assert asm.parse(asm.format_program(program)).regions == program.regions
    assert encoding.decode_program(encoding.encode_program(program)).regions == program.regions
    # the same work, sooner, to the bit
    assert simulate(program, EIGHT).cycles < simulate(plain, EIGHT).cycles
    inputs = random_inputs(plain, 0)
    got, want = run(program, EIGHT, inputs).outputs, run(plain, EIGHT, inputs).outputs
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_a_kernel_on_every_legion_leaves_no_time_to_fill(tmp_path):
    """With 16 rows of 256 on two Legions, each row kernel keeps both DMA queues busy: nothing
    moves into them. With attention's products in fp32 on the vector lanes, the next matmul's
    first weights go into the products' tails only."""
    path = tmp_path / "bitnet.onnx"
    save(build_bitnet(preset("tiny", hidden=256, ffn=512, layers=1, seq=16, vocab=64)), path, False)
    tiny = arch.load("dlegion-tiny")
    on, off = (compile_model(path, Options(tiny, prefetch=p, attention="int8"))[1] for p in (True, False))
    assert on.instrs == off.instrs and on.regions == off.regions
    on, off = (compile_model(path, Options(tiny, prefetch=p, attention="fp32"))[1] for p in (True, False))
    ends = [at for at, _ in on.regions[1:]] + [len(on.instrs)]
    entries = [(name, range(at, end)) for (at, name), end in zip(on.regions, ends)]
    inside = [n for n in range(1, len(entries) - 1) if entries[n - 1][0] == entries[n + 1][0]]
    assert inside
    for n in inside:
        around = [on.instrs[k].MNEMONIC for k in entries[n - 1][1]]
        assert "vmm" in around and "mm" not in around
        assert all(isinstance(on.instrs[k], DmaLoad) and on.instrs[k].dst.space == "wgt" for k in entries[n][1])
    # only loads moved: the rest is the same instructions in the same order
    assert [i.MNEMONIC for i in on.instrs if not isinstance(i, DmaLoad)] == \
        [i.MNEMONIC for i in off.instrs if not isinstance(i, DmaLoad)]


def test_every_condition_still_covers_what_it_covered():
    """Expanded, each task waits for at least the instructions it waited for before the move, but
    for loads another Legion now issues, and for nothing more but moved loads, the waits that
    hold them (index None) and the waits that stand for the barrier they replace (its index)."""
    plain = _compiled(False)
    order, _ = reorder(plain, EIGHT)
    moved = _moved(order) | {None}
    barriers = {k for k, i in enumerate(plain.instrs) if isinstance(i, Barrier)}
    reissued = {k for k, i in order if k is not None and isinstance(i, DmaLoad) and i.legion != plain.instrs[k].legion}
    before = _covered(plain, list(range(len(plain.instrs))))
    after = _covered(prefetch_weights(plain, EIGHT), [k for k, _ in order])
    assert len(moved) > 1 and reissued
    assert before.keys() == {task for task in after if task[0] is not None and task[0] not in barriers}
    for task, need in before.items():
        assert need - after[task] <= reissued and after[task] - need <= moved | barriers, task


def test_a_kernels_barrier_gives_way_to_waits_and_its_legions_loads_to_the_others():
    """The row kernel's own Legion stores last; its share of the weights is issued by the Legions
    the kernel leaves idle, and its matrix queue waits for them before its first pass."""
    program, plain = _compiled(True), _compiled(False)
    count = lambda p: sum(isinstance(i, Barrier) for i in p.instrs)
    assert count(program) == count(plain) - 8          # one per projection
    # (a float product's first loads issued by another Legion go to the vector scratchpad, and the
    # kernel's barrier, which stays, orders them: lower/earlyloads.py)
    foreign = [i for i in program.instrs if isinstance(i, DmaLoad) and i.dests != frozenset({i.legion})
               and len(i.dests) == 1 and i.dst.space != "vec"]
    assert foreign and all(i.dst.space == "wgt" for i in foreign)
    for receiver in {next(iter(i.dests)) for i in foreign}:
        waits = [i for i in program.instrs if isinstance(i, Wait) and i.legion == receiver
                 and i.queue() == "mat" and i.until.queue == "dma" and i.until.legion != receiver]
        assert {w.until.legion for w in waits} >= {i.legion for i in foreign if i.dests == frozenset({receiver})}


def _moved(order) -> set[int]:
    """The instructions that now come before some that preceded them."""
    out, least = set(), len(order) + 1
    for k, _ in reversed(order):
        if k is None:
            continue
        if k > least:
            out.add(k)
        least = min(least, k)
    return out


def _covered(program, old_index: list[int]) -> dict:
    """Per (instruction, Legion) that waits: the instructions (by index before the move) its
    condition covers once expanded to an absolute count."""
    flat = expand(program, EIGHT.legions)
    on_queue = defaultdict(list)
    out = {}
    for task, origin in zip(flat.program.instrs, flat.origin):
        cond = task.condition()
        if cond is not None:
            key = (old_index[origin], task.legion)
            out[key] = set(on_queue[(cond.legion, cond.queue)][:cond.count])
        for key in _keys(task):
            on_queue[key].append(old_index[origin])
    return out


def _keys(task) -> list:
    if task.MNEMONIC == "barrier":
        return [(legion, q) for legion in range(EIGHT.legions) for q in QUEUES]
    return [(task.legion, task.queue())]
