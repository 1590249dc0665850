"""A quantized matmul's first weights, loaded while the node before it runs.

Every node ends with a barrier. At decode a row kernel (a norm, a quantization) runs on one
Legion, and the next projection's weights would wait behind that barrier, though nothing in the
kernel touches the weight scratchpad. This pass moves the projection's first weight loads that
wait for nothing to just after the kernel's last load. Once the kernel's own loads have landed
(sharing DRAM with them would slow the kernel down), they stream while it computes and stores.

- **How much.** As many bytes as DRAM carries in the kernel's time (``_window``), an equal
  share for each Legion: a Legion that got less would hold up the whole matmul. They wait for
  the kernel's own loads to land, but one idle Legion's, which start at once where DRAM serves
  that flow and the kernel's at a full link's rate each (``_free_issuer``).
- **The kernel's barrier** gives way to waits that do what it did but for the moved loads
  (``_hand_off``): every queue waits for every queue the kernel ran on. A barrier would hold
  everything until the moved loads had landed, a DRAM round trip in which DRAM idles.
- **The kernel's own Legions.** A queue completes in order, so a wait for the kernel's stores
  would wait for loads issued on the same queue before them: the shares of the Legions whose
  DMA queues the kernel uses are issued, in row pieces, by the others (a load may deliver to
  another Legion's scratchpad), and the receiving matrix queue waits for those issuers.
- **When not.** A node that keeps every Legion's DMA queue busy (a prefill kernel, block after
  block) leaves no time to fill, and one that touches the weight scratchpad no room.
- **Across nodes.** The loads may go back across a run of nodes that leave the weight
  scratchpad alone (``_chain``), each node's barrier giving way to waits, as long as some Legion's
  DMA queue stays idle through all of them; and into the last passes of the matmul before the
  run (``_into_tail``): a load into weight scratchpad that matmul has read for the last time
  waits on the matrix queue for that read. No more is moved than leaves DRAM busy during the
  matmul's own passes (``_streaming``): at decode a pass of one row takes as long as one of
  sixteen, and weights all loaded early would leave its passes with DRAM idle.
- **Into the products' tails.** At decode, attention's QK^T and PV run on the vector lanes,
  which set their time, on every Legion: after each Legion's last load of such a product, its
  lanes still work while DRAM idles, so a part of that time carries the next matmul's first
  weights, on the Legion's own queue (``_into_busy``); the product's last stores queue behind
  them, so only a part (``TAIL_SHARE``).
- **Reports.** The moved loads form an entry of the matmul's region, so they count with it.

Moving instructions changes what a relative condition (``dma~2``) stands for, so every one is
rewritten to wait for at least the instructions it waited for before (``_Counts``).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

from isa.arch import Arch
from isa.expand import absolute
from isa.fields import QUEUES, Cond, DramRef
from isa.instructions import Barrier, DmaLoad, DmaStore, Gather, MatMul, VMatMul, Wait
from isa.program import Program
from dlegion_cc.lower.overlap import _meet, footprint, layer_ends
from runtime.costs import Env, cost

Key = tuple[int, str]        # (Legion, queue)


def prefetch_weights(program: Program, arch: Arch) -> Program:
    order, regions = reorder(program, arch)
    if all(k == j for j, (k, _) in enumerate(order)):
        return program
    return replace(program, instrs=_Counts(program.instrs, arch).rewrite(order), regions=regions)


def reorder(program: Program, arch: Arch) -> tuple[list[tuple[int, object]], list[tuple[int, str]]]:
    """The instructions in their new order, each with its index in ``program`` (a load cut in
    parts appears once per part; a new ``wait`` has None), and the new regions. Conditions
    are not yet fixed."""
    instrs, old = program.instrs, program.regions
    spans = program.region_ranges()
    last_of_layer = layer_ends(program)
    order = [(k, instrs[k]) for k in range(old[0][0] if old else len(instrs))]
    placed: dict[int, range] = {}         # a matmul region -> where its kept part went in ``order``
    for r, matmul in enumerate(spans):
        chain = _reach(program, arch, _chain(instrs, arch, spans[:r], matmul, last_of_layer), matmul)
        before = r - len(chain) - 1           # the region before the chain: a matmul's?
        kept = [(k, instrs[k]) for k in matmul]
        kept = _into_busy(program, arch, order, spans[:before + 1], matmul, kept, last_of_layer)
        tail, kept, taken = _into_tail(program, arch, order, placed.get(before), kept)
        moved = []
        if chain:
            moved, kept = _split(program, arch, chain, matmul, kept, taken)
        if moved:
            moved, issuers = _reissued(moved, _dma_legions(instrs, *chain), arch)
            _hand_over(order, instrs, arch, chain, moved, issuers)
        if tail:
            order[tail[0]:tail[0]] = tail[1]
        if any(isinstance(i, MatMul) for _, i in kept):
            placed[r] = range(len(order), len(order) + len(kept))
        order += kept
    return order, _regions(order, spans, old)


# What part of a float product's tail its Legions' shares of DRAM carry the next matmul's
# weights for: the product's last stores queue behind them. 2B4T decode step on dlegion-8x8, layer
# cycles with a 256-, 512- and 1024-token cache: none 37,723, 39,999, 49,266; 0.25 37,463,
# 39,615, 48,840; 0.35 37,361, 39,461, 48,670; 0.4 37,310, 39,384, 48,951; 0.45 at 512 39,673,
# 1.0 39,869 (the stores wait).
TAIL_SHARE = 0.35


def _into_busy(program: Program, arch: Arch, order: list, before: list[range], matmul: range,
               items: list, last_of_layer: set[int]) -> list:
    """The matmul's first weight loads that go into the tails of the float products before its
    chain that keep every Legion's DMA queue busy (a decode step's QK^T and PV on the vector
    lanes, which rather than DRAM set their time; a row kernel streams block after block): on each Legion,
    just after the node's last load, what its share of DRAM carries in part of the work left
    after it (``_tails``). Earlier nodes take the first loads. Returns the rest of ``items``."""
    instrs = program.instrs
    nodes = []
    for node in reversed(before):
        if not (len(node) and isinstance(instrs[node.stop - 1], Barrier)) or node.stop - 1 in last_of_layer:
            break
        if any(_touches_weights(instrs[k]) for k in node) or _makes_weights(instrs, node, matmul):
            break
        if len(_dma_legions(instrs, node)) == arch.legions and any(isinstance(instrs[k], VMatMul) for k in node):
            nodes.insert(0, node)
    for node in nodes:
        pieces, items = _take(items, _tails(program, arch, node))
        _interleave(order, node, pieces)
    return items


def _tails(program: Program, arch: Arch, node: range) -> dict[int, float]:
    """Per Legion, ``TAIL_SHARE`` of the bytes its share of DRAM carries while the node's work
    after its last load runs on it."""
    env = Env(tuple(program.tensors), {})
    work: Counter = Counter()
    for k in node:
        i = program.instrs[k]
        if isinstance(i, (DmaLoad, Gather)):
            for l in _legions(i):
                work[l] = 0
        elif not isinstance(i, (Barrier, Wait, DmaStore)):
            c = cost(i, arch, env)
            for l in _legions(i):
                if l in work:
                    work[l] += c.cycles
    share = arch.derived.dram_bytes_per_cycle / arch.legions
    return {l: work[l] * share * TAIL_SHARE for l in range(arch.legions)}


def _take(items: list, room: dict) -> tuple[dict, list]:
    """Per Legion, the first free weight loads of ``items`` (on that Legion alone, cut to whole
    rows) up to ``room`` bytes, while its DMA queue has met nothing that waits; and the rest."""
    open_ = {l: room[l] > 0 for l in room}
    taken: dict = {l: [] for l in room}
    rest = []
    for k, i in items:
        if isinstance(i, Barrier) or (i.queue() == "dma" and i.condition() is not None):
            for l in (room if isinstance(i, Barrier) else _legions(i)):
                open_[l] = False
        if not (_free_weight_load(i) and any(open_[l] for l in _legions(i))):
            rest.append((k, i))
            continue
        for run, move in _runs(i, open_):
            if not move:
                rest.append((k, _part(i, run)))
                continue
            for l in run:
                part = _part(i, range(l, l + 1))
                rows = max(0, min(part.rows, int(room[l] // part.cols)))
                if rows < part.rows:
                    open_[l] = False
                    part, left = _cut(part, rows)
                    rest.append((k, left))
                if rows:
                    taken[l].append((k, part))
                    room[l] -= rows * part.cols
    return taken, rest


def _interleave(order: list, node: range, pieces: dict) -> None:
    """Put each Legion's ``pieces`` in ``order`` just after the node's last load on that Legion."""
    last = {}
    for j, (k, i) in enumerate(order):
        if k is not None and k in node and isinstance(i, (DmaLoad, Gather)):
            for l in _legions(i):
                last[l] = j + 1
    inserts = [(last[l], l, item) for l, items in pieces.items() if l in last for item in items]
    for j, _, item in sorted(inserts, key=lambda t: (-t[0], -t[1])):
        order[j:j] = [item]


def _into_tail(program: Program, arch: Arch, order: list, prev: range | None, items: list):
    """The matmul's first weight loads that may go into the last passes of the matmul before
    it (placed at ``prev`` in ``order``): each into a part of the weight scratchpad that
    matmul has read for the last time, waiting on its Legion's matrix queue for that read, as
    many bytes as DRAM carries in the passes after it. Returns (None or (where in ``order``,
    the loads), the rest of ``items``, the bytes taken per Legion)."""
    taken: Counter = Counter()
    span = order[prev.start:prev.stop] if prev is not None else []
    loads = [j for j, (_, i) in enumerate(span) if isinstance(i, (DmaLoad, Gather))]
    if not loads or not isinstance(span[-1][1], Barrier):
        return None, items, taken
    after = loads[-1] + 1                 # after the earlier matmul's last load: its own come first
    passes = _Passes(program, arch, span)
    open_ = dict.fromkeys(range(arch.legions), True)
    picked, rest = [], []
    for k, i in items:
        if not (_free_weight_load(i) and any(open_[l] for l in _legions(i))):
            if isinstance(i, Barrier) or (i.queue() == "dma" and i.condition() is not None):
                open_ = dict.fromkeys(open_, False) if isinstance(i, Barrier) else {
                    l: open_[l] and l not in _legions(i) for l in open_}
            rest.append((k, i))
            continue
        for run, ok in _runs(i, open_):
            part = _part(i, run)
            read = [passes.last_read(part, rank, l) for rank, l in enumerate(run)] if ok else []
            if not ok or None in read:      # read until its last pass, or not to be moved: stays
                rest.append((k, part))
                continue
            room = min(passes.carried_after(l, c) - taken[l] for c, l in zip(read, run))
            rows = max(0, min(part.rows, int(room // part.cols)))
            if rows < part.rows:            # what DRAM carries in the passes left: the rest stays
                open_.update(dict.fromkeys(run, False))
                part, left = _cut(part, rows)
                rest.append((k, left))
                if not rows:
                    continue
            picked.append((max(read), k, part))
            taken.update(dict.fromkeys(run, part.rows * part.cols))
    if not picked:
        return None, items, Counter()
    at = max([after] + [c + 1 for c, _, _ in picked])
    out = [(k, replace(x, wait=Cond(None, "mat", None, min(passes.count(l, c, at) for l in _legions(x)))))
           for c, k, x in picked]
    return (prev.start + at, out), rest, taken


class _Passes:
    """The weight-scratchpad reads of a matmul's region (``span``: (index, instruction) pairs)."""

    def __init__(self, program: Program, arch: Arch, span: list):
        self.span, self.tensors = span, program.tensors
        self.share = arch.derived.dram_bytes_per_cycle / arch.legions
        env = Env(tuple(program.tensors), {})
        self.mats = {l: [j for j, (_, i) in enumerate(span) if isinstance(i, MatMul) and l in _legions(i)]
                     for l in range(arch.legions)}
        # costed dense: a block mask only shortens a pass
        self.cycles = {j: cost(replace(i, mask=None), arch, env).cycles for j, (_, i) in enumerate(span)
                       if isinstance(i, MatMul)}

    def last_read(self, load: DmaLoad, rank: int, legion: int) -> int | None:
        """Where the last instruction touching what ``load`` writes on ``legion`` is, when it
        is a matmul with others after it on the Legion; else None."""
        last = _last_conflict(self.span, load, rank, legion, self.tensors)
        if last is None or not isinstance(self.span[last][1], MatMul) or last == self.mats[legion][-1]:
            return None
        return last

    def carried_after(self, legion: int, at: int) -> float:
        """The bytes a Legion's share of DRAM carries during its passes after ``at``."""
        return sum(self.cycles[j] for j in self.mats[legion] if j > at) * self.share

    def count(self, legion: int, read: int, at: int) -> int:
        """How many of the Legion's matmuls between ``read`` and ``at`` a load placed at
        ``at`` need not wait for."""
        return sum(1 for j in self.mats[legion] if read < j < at)


def _last_conflict(span: list, load: DmaLoad, rank: int, legion: int, tensors) -> int | None:
    """Where in ``span`` the last instruction touching what ``load`` writes on ``legion`` is
    (None: nowhere)."""
    mine = [w for space, w, *_ in footprint(load, rank, tensors) if space == (legion, "wgt")]
    last = -1
    for j, (_, i) in enumerate(span):
        if not _touches_weights(i):
            continue
        theirs = [w for r in range(i.span or 1) for space, w, *_ in footprint(i, r, tensors)
                  if space == (legion, "wgt")]
        if any(_meet(a, b) for a in mine for b in theirs):
            last = j
    return last if last >= 0 else None


def _chain(instrs, arch: Arch, before: list[range], matmul: range, last_of_layer: set[int]) -> list[range]:
    """The nodes a matmul's first weights may load during: the run of regions just before it
    that end in a barrier and never touch the weight scratchpad, as long as some Legion's DMA
    queue stays idle through all of them (it issues the loads of the busy ones). Only the node
    just before it is taken across the end of a layer: the layers stay alike."""
    if not any(isinstance(instrs[k], MatMul) for k in matmul):
        return []
    chain: list[range] = []
    for node in reversed(before):
        if not (len(node) > 0 and isinstance(instrs[node.stop - 1], Barrier)):
            break
        if any(_touches_weights(instrs[k]) for k in node) or (chain and node.stop - 1 in last_of_layer):
            break
        if _makes_weights(instrs, node, matmul):
            break
        if len(_dma_legions(instrs, node, *chain)) >= arch.legions:
            break
        chain.insert(0, node)
    return chain


def _makes_weights(instrs, node: range, matmul: range) -> bool:
    """Weights the node computes (attention's quantized V, stored in place) wait for it."""
    made = {instrs[k].dst.tensor for k in node if isinstance(instrs[k], DmaStore)}
    return any(isinstance(instrs[k], DmaLoad) and instrs[k].dst.space == "wgt"
               and instrs[k].src.tensor in made for k in matmul)


def _regions(order: list, spans: list[range], old: list) -> list[tuple[int, str]]:
    """The regions of the new order: each instruction stays in its old region (a moved load in
    its matmul's), a new wait in that of the instruction before it."""
    region_of = {k: r for r, span in enumerate(spans) for k in span}
    out, last = [], None
    for at, (k, _) in enumerate(order):
        r = last if k is None else region_of.get(k, last)
        if r is not None and r != last:
            out.append((at, old[r][1]))
        last = r
    return out


def _hand_over(order: list, instrs, arch: Arch, chain: list[range], moved: list, issuers: dict) -> None:
    """Rewrite the ``chain`` of nodes, which went into ``order`` as they were (they run no
    matmul) and end it: the ``moved`` loads go in after the first node's last load and the
    waits that hold them until those have landed (``_gates``); each node's barrier gives way to
    waits that stand for it (``_hand_off``, each with the barrier's index), and after the last
    the matrix queue of a Legion whose loads another issued (``issuers``: receiver -> issuers)
    waits for those."""
    stop = len(order)
    for n, node in reversed(list(enumerate(chain))):
        barrier = order[stop - 1][0]
        waits = [(barrier, w) for w in _hand_off(instrs, arch, node)]
        if n == len(chain) - 1:
            waits += [(None, Wait(x, "mat", Cond(l, "dma", None, 0))) for x, ls in sorted(issuers.items()) for l in ls]
        order[stop - 1:stop] = waits
        stop -= len(node)
    at = stop + (_tail(instrs, chain[0]).start - chain[0].start)
    order[at:at] = _gates(instrs, arch, chain[0]) + moved


def _hand_off(instrs, arch: Arch, node: range) -> list[Wait]:
    """What the barrier that ends the node did for what follows, but for the moved loads: every
    queue of every Legion waits for every queue the node ran instructions on. A barrier would
    also hold them until the moved loads have landed, a DRAM round trip in which DRAM idles."""
    return [_everywhere(arch, q, x, queue) for x, queue in _queues_used(instrs, node) for q in QUEUES]


def _reissued(moved: list, busy: list[int], arch: Arch) -> tuple[list, dict]:
    """``moved`` with the loads of Legions whose DMA queues the node uses (``busy``) issued by
    the others, in turn, into the same scratchpads; and per such Legion, the Legions that issue
    its loads. A wait for the node's stores on its own queue would otherwise wait for them too:
    a queue completes in order."""
    idle = [l for l in range(arch.legions) if l not in busy]
    inside = {l: l in busy for l in range(arch.legions)}
    out, issuers, turn = [], {}, 0
    for k, i in moved:
        for run, on_busy in _runs(i, inside):
            if not on_busy:
                out.append((k, _part(i, run)))
                continue
            for x in run:
                for piece in _row_pieces(_part(i, range(x, x + 1)), len(idle)):
                    l = idle[turn % len(idle)]
                    turn += 1
                    out.append((k, replace(piece, legion=l)))
                    issuers.setdefault(x, set()).add(l)
    return out, {x: sorted(ls) for x, ls in issuers.items()}


def _cut(i: DmaLoad, rows: int) -> tuple[DmaLoad, DmaLoad]:
    """``i``'s first ``rows`` rows and the rest, as two loads."""
    return _piece(i, 0, rows), _piece(i, rows, i.rows)


def _piece(i: DmaLoad, r0: int, r1: int) -> DmaLoad:
    return replace(i, dst=replace(i.dst, addr=i.dst.addr + r0 * i.dst.rs),
                   src=DramRef(i.src.tensor, i.src.offset + r0 * i.src.rs, i.src.rs), rows=r1 - r0)


def _row_pieces(i: DmaLoad, parts: int) -> list[DmaLoad]:
    """``i`` (on one Legion) cut into up to ``parts`` loads of consecutive rows, so that as many
    queues share it."""
    cuts = [i.rows * j // parts for j in range(parts + 1)]
    return [_piece(i, r0, r1) for r0, r1 in zip(cuts, cuts[1:]) if r1 > r0]


def _queues_used(instrs, node: range) -> list[Key]:
    """The queues the node runs instructions on (its barrier aside)."""
    return sorted({(l, instrs[k].queue()) for k in node if not isinstance(instrs[k], Barrier)
                   for l in _legions(instrs[k])})


def _dma_legions(instrs, *nodes: range) -> list[int]:
    """The Legions whose DMA queues the nodes use."""
    return sorted({l for node in nodes for l, queue in _queues_used(instrs, node) if queue == "dma"})


def _everywhere(arch: Arch, queue: str, legion: int, until: str) -> Wait:
    """A wait on ``queue`` of every Legion for all that was issued to ``until`` of ``legion``."""
    return Wait(0, queue, Cond(legion, until, None, 0), span=arch.legions if arch.legions > 1 else None)


def _gates(instrs, arch: Arch, node: range) -> list[tuple[None, Wait]]:
    """Waits that hold the moved loads until the node's own loads have landed: sharing DRAM
    with them would slow the node down. But one idle Legion's go at once where DRAM serves its
    flow and each of the node's at a full link's rate (``_free_issuer``)."""
    free = _free_issuer(instrs, arch, node)
    spans = [(0, arch.legions)] if free is None else [(0, free), (free + 1, arch.legions - free - 1)]
    return [(None, Wait(base, "dma", Cond(x, "dma", None, 0), span=count if count > 1 else None))
            for x in _dma_legions(instrs, node) for base, count in spans if count > 0]


def _free_issuer(instrs, arch: Arch, node: range) -> int | None:
    """The first Legion whose DMA queue the node leaves idle, when DRAM carries one flow more
    than the node's (one per DMA queue it uses) at a full link's rate; else None."""
    busy = _dma_legions(instrs, node)
    d = arch.derived
    idle = [l for l in range(arch.legions) if l not in busy]
    return idle[0] if idle and (len(busy) + 1) * d.link_bytes_per_cycle <= d.dram_bytes_per_cycle else None


def _tail(instrs, node: range) -> range:
    """What the node runs after its last load: its compute, its stores and its barrier."""
    loads = [k for k in node if isinstance(instrs[k], (DmaLoad, Gather))]
    return range(loads[-1] + 1 if loads else node.start, node.stop)


def _touches_weights(i) -> bool:
    return isinstance(i, MatMul) or (isinstance(i, DmaLoad) and i.dst.space == "wgt")


def _legions(i) -> range:
    return range(i.legion, i.legion + (i.span or 1))


def _split(program: Program, arch: Arch, chain: list[range], matmul: range, items: list,
           taken: Counter) -> tuple[list, list]:
    """(the loads to move, the rest of the matmul's region), each as (old index, instruction).
    A Legion's loads move while its DMA queue has met nothing that waits, up to its share of
    what DRAM carries while the nodes of the ``chain`` run."""
    share, near = _shares(program, arch, chain)
    open_ = {l: True for l in range(arch.legions)}
    # Past what the node just before it covers, no more than leaves DRAM busy during its passes.
    room = {l: min(share, max(near, left) - taken[l]) for l, left in _streaming(program, arch, matmul).items()}
    moved, kept = [], []
    for k, i in items:
        if isinstance(i, Barrier):      # what follows may read what the region wrote before it
            open_ = dict.fromkeys(open_, False)
        if isinstance(i, Barrier) or i.queue() != "dma":
            kept.append((k, i))
            continue
        if _free_weight_load(i):
            nbytes = i.rows * i.cols
            for l in _legions(i):
                open_[l] = open_[l] and room[l] >= nbytes
            for run, move in _runs(i, open_):
                (moved if move else kept).append((k, _part(i, run)))
            for l in _legions(i):
                room[l] -= nbytes
            continue
        if i.condition() is not None:
            for l in _legions(i):
                open_[l] = False
        kept.append((k, i))
    return moved, kept


def _shares(program: Program, arch: Arch, chain: list[range]) -> tuple[float, float]:
    """Per Legion, the weight bytes DRAM carries while the whole chain runs, and while its last
    node does (at most the weight scratchpad)."""
    d = arch.derived
    windows = [_window(program, arch, node) for node in chain]
    return tuple(min(d.spad_elems["wgt"], w * d.dram_bytes_per_cycle / arch.legions)
                 for w in (sum(windows), windows[-1]))


def _reach(program: Program, arch: Arch, chain: list[range], matmul: range) -> list[range]:
    """The chain, or its last node alone when no Legion has more weights to load early than
    that node covers (more nodes would only lose their barriers)."""
    if len(chain) < 2:
        return chain
    _, near = _shares(program, arch, chain)
    if all(left <= near for left in _streaming(program, arch, matmul).values()):
        return chain[-1:]
    return chain


def _streaming(program: Program, arch: Arch, matmul: range) -> dict[int, float]:
    """Per Legion, the weight bytes that may load before the matmul and leave DRAM busy while
    it runs: its weights but what its share of DRAM carries during its passes. Weights all
    loaded before, its passes would run with DRAM idle."""
    env = Env(tuple(program.tensors), {})
    weights, passes = Counter(), Counter()
    for k in matmul:
        i = program.instrs[k]
        if isinstance(i, DmaLoad) and i.dst.space == "wgt":
            for l in _legions(i):
                weights[l] += i.rows * i.cols
        elif isinstance(i, MatMul):     # costed dense: a block mask only shortens its passes
            for l in _legions(i):
                passes[l] += cost(replace(i, mask=None), arch, env).cycles
    share = arch.derived.dram_bytes_per_cycle / arch.legions
    return {l: max(0.0, weights[l] - passes[l] * share) for l in range(arch.legions)}


def _window(program: Program, arch: Arch, node: range) -> float:
    """Cycles the node takes on its busiest Legion: its vector work, its transfers at one
    Legion's share of DRAM (the prefetch takes the rest), and a DRAM latency each way."""
    env = Env(tuple(program.tensors), {})
    busy: Counter = Counter()
    share = arch.derived.dram_bytes_per_cycle / arch.legions
    for k in node:
        i = program.instrs[k]
        if isinstance(i, Barrier):
            continue
        c = cost(i, arch, env)
        busy[i.legion] += c.flow_bytes / share if c.flow_bytes is not None else c.cycles
    return max(busy.values(), default=0) + 2 * arch.dram_latency_cycles


def _free_weight_load(i) -> bool:
    return (isinstance(i, DmaLoad) and i.dst.space == "wgt" and i.wait is None
            and i.dests == frozenset({i.legion}))


def _runs(i, open_: dict) -> list[tuple[range, bool]]:
    """The Legions of ``i``'s span in runs of those that may move and those that may not."""
    out: list = []
    for l in _legions(i):
        if out and out[-1][1] == open_[l]:
            out[-1] = (range(out[-1][0].start, l + 1), open_[l])
        else:
            out.append((range(l, l + 1), open_[l]))
    return out


def _part(i: DmaLoad, run: range) -> DmaLoad:
    """``i`` on the Legions ``run`` of its span only."""
    if run == _legions(i):
        return i
    rank = run.start - i.legion
    src = i.src if i.lstride is None else DramRef(i.src.tensor, i.src.offset + rank * i.lstride, i.src.rs)
    many = len(run) > 1
    return replace(i, legion=run.start, dests=frozenset({run.start}), src=src,
                   span=len(run) if many else None, lstride=i.lstride if many else None)


class _Counts:
    """Queue by queue, which instructions a relative condition of the old order stood for.

    A condition ``q~b`` on an instruction means: all the instructions issued to queue ``q``
    before it, but the last ``b``. In the new order it must still cover those, so it becomes
    the shortest prefix of the queue that holds them all (moved loads only come earlier, so it
    never waits for an instruction issued after it)."""

    def __init__(self, instrs, arch: Arch):
        self.arch = arch
        self.old = defaultdict(list)      # key -> old indices issued to it, in the old order
        self.target: dict = {}            # old index -> {key: completed count it needs}
        issued: Counter = Counter()
        for k, i in enumerate(instrs):
            cond = i.condition()
            if cond is not None and cond.count is None:
                counts = (absolute(cond, l, issued) for l in _legions(i))
                self.target[k] = {(c.legion, c.queue): c.count for c in counts}
            for key in self._issued_to(i):
                self.old[key].append(k)
                issued[key] += 1

    def rewrite(self, order: list) -> list:
        position = defaultdict(dict)      # key -> old index -> place in the new order
        issued: Counter = Counter()
        for k, i in order:
            for key in self._issued_to(i):
                position[key][k] = issued[key]
                issued[key] += 1
        # A load another Legion now issues is not on its old queue: what waited for it there
        # waits for it by other means (``_hand_over``).
        reach = {key: _prefix_max([position[key].get(k, -1) for k in ks]) for key, ks in self.old.items()}
        out, issued = [], Counter()
        for k, i in order:
            if k in self.target:
                i = self._retarget(i, k, issued, reach)
            for key in self._issued_to(i):
                issued[key] += 1
            out.append(i)
        return out

    def _retarget(self, i, k: int, issued: Counter, reach: dict):
        cond = i.condition()
        backs = []
        for key in self._keys(i, cond):
            need = self.target[k].get(key, 0)
            covered = reach[key][need - 1] + 1 if need > 0 else 0
            if covered > issued[key]:
                raise ValueError(f"internal: moving weight loads made an instruction wait for a later one ({i})")
            backs.append(issued[key] - covered)
        back = min(backs)
        if back == cond.back:
            return i
        new = Cond(cond.legion, cond.queue, None, back)
        return replace(i, until=new) if isinstance(i, Wait) else replace(i, wait=new)

    def _keys(self, i, cond: Cond) -> list[Key]:
        if cond.legion is not None:
            return [(cond.legion, cond.queue)]
        return [(l, cond.queue) for l in _legions(i)]

    def _issued_to(self, i) -> list[Key]:
        if isinstance(i, Barrier):
            return [(l, q) for l in range(self.arch.legions) for q in QUEUES]
        return [(l, i.queue()) for l in _legions(i)]


def _prefix_max(values: list[int]) -> list[int]:
    out, best = [], -1
    for v in values:
        best = max(best, v)
        out.append(best)
    return out
