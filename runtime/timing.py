"""Event-driven timing model: when each instruction starts and completes, and in what order.

The model (every number comes from the :class:`~isa.arch.Arch` passed in, or its ``derived``):

- **Dispatch.** The program's instructions go, in order, to queues keyed (Legion, queue): the
  class's ``QUEUE``, or the queue a ``wait`` names; a ``barrier`` goes to every queue. A queue
  runs its instructions in order, one at a time; queues run concurrently.
- **Times.** Each instruction has a ``start``, a ``free`` time (its queue may start the next
  one) and a ``done`` time (its effect is visible). A DMA (load, store, gather) is a *flow*
  through the shared DRAM from ``start``; ``free`` is when its last byte leaves DRAM and
  ``done = free + dram_latency_cycles``: the DMA engine is pipelined, each request arrives one
  latency after its data left. Any other instruction holds its queue for its duration
  (``runtime/costs.py``): ``free = done = start + duration``. An instruction with a ``lead``
  (a matmul's first weight-window load, with double-buffered weight registers) needs that
  many cycles after its inputs are ready before its duration starts: ``free = max(start,
  ready + lead) + duration``, where ``ready`` is when the last condition it (or a ``wait``
  just before it) waited for came true. Back to back with operands already there, the load
  hides behind the previous pass.
- **Sync.** Each queue counts its *completed prefix*: how many of its instructions, from the
  first, are done. An instruction with ``wait=L0.dma>=5`` (or a ``wait`` instruction) starts
  only once queue (L0, dma) has a completed prefix of at least 5; a ``wait`` then passes,
  taking no time. A ``barrier`` holds every queue until all of them have reached it with
  everything before it done, then releases them all at once.
- **DRAM** is a fluid shared server: the n active flows share ``dram_bytes_per_cycle``
  equally, each capped by one Legion link (``link_bytes_per_cycle``), so each moves at
  min(link, dram / n); rates change whenever a flow starts or ends. A multicast load is one
  flow: one DRAM read delivered over the receivers' links in parallel.

All flows move at the same rate, so one "bytes served per flow" clock orders their ends in a
heap: simulation costs O(log) per event, and nothing loops per cycle. What is simulated is cut
at barriers, one Legion of each class that runs the same tasks standing for the class, and
stretches alike are timed once (``runtime/lockstep.py``): the times are those of every task.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from isa.arch import Arch
from isa.expand import expand
from isa.fields import QUEUES
from isa.instructions import family
from runtime.lockstep import BARRIER, TASK, WAIT
from isa.program import Program
from runtime import lockstep
from runtime.costs import Blocks, CostError, Env, ceil_cycles, cost

INF = float("inf")
FAMILIES = ("dma", "matrix", "drain", "vector", "sync")
SUMMED = ("dram_read_bytes", "dram_write_bytes", "multicast_saved_bytes", "noc_bytes", "macs", "dense_macs",
          "passes", "dense_passes", "windows_skipped", "sparsity_cycles_saved", "psum_bytes", "spad_bytes",
          "vector_elems", "vector_ops", "vector_macs", "padded_macs")


class Deadlock(Exception):
    """Some queue waits for progress that the remaining instructions never make."""


class TimingError(ValueError):
    """A program the timing model cannot cost (the message names the instruction)."""


@dataclass
class Timeline:
    cycles: int                 # ceil of the last completion
    start: np.ndarray           # per instruction, in cycles (float)
    free: np.ndarray            # per instruction: its queue may start the next one
    done: np.ndarray            # per instruction: its effect is visible
    busy: dict                  # (legion, queue) -> cycles the queue was occupied
    counters: dict
    program: Program | None = None   # what was timed: one task per Legion of each span


# --- shared DRAM -----------------------------------------------------------------------------

class _Dram:
    """Active flows sharing DRAM; ``served`` is the bytes every active flow has moved so far.
    A flow may stand for several equal ones (Legions in lockstep): it counts that many times."""

    def __init__(self, total: float, link: float):
        self.total, self.link = total, link
        self.t = 0.0
        self.served = 0.0
        self.active = 0                               # flows, each counted with its multiplicity
        self.flows: list[tuple[float, int, int]] = []  # (served level at which it ends, task, multiplicity)
        self.due: float | None = None                 # next_end, until flows start or end

    def rate(self) -> float:
        return min(self.link, self.total / self.active) if self.active else 0.0

    def advance(self, t: float) -> None:
        if self.active:                                # (rate() inline: it runs per flow event)
            self.served += min(self.link, self.total / self.active) * (t - self.t)
        self.t = t
        self.due = None                                # add and finish change the flows next

    def add(self, k: int, nbytes: int, t: float, mult: int) -> None:
        if t != self.t:                                # (at the same time, advance moves nothing)
            self.advance(t)
        self.due = None
        self.active += mult
        heapq.heappush(self.flows, (self.served + nbytes, k, mult))

    def next_end(self) -> float:
        if not self.flows:
            return INF
        if self.due is None:      # the same state gives the same time: computed once per change
            self.due = self.t + max(0.0, self.flows[0][0] - self.served) / self.rate()
        return self.due

    def finish(self, t: float) -> list[int]:
        """Flows ending at ``t`` (the first is due by construction; others within rounding)."""
        self.advance(t)
        flows, pop = self.flows, heapq.heappop
        _, k, mult = pop(flows)
        ended, active = [k], self.active - mult
        level = self.served + 1e-9 * max(1.0, self.served)
        while flows and flows[0][0] <= level:
            _, k, mult = pop(flows)
            ended.append(k)
            active -= mult
        self.active = active
        return ended


# --- queues ----------------------------------------------------------------------------------

class _Queue:
    __slots__ = ("key", "id", "items", "head", "busy", "prefix", "ready", "waiting")

    def __init__(self, key, id_: int, items: list[int]):
        self.key = key             # (legion, queue name)
        self.id = id_              # the Part's id of it
        self.items = items
        self.head = 0
        self.busy = False          # running an instruction (a DMA: until its flow ends)
        self.prefix = 0            # leading instructions that are done
        self.ready = 0.0           # when the conditions met since its last instruction came true
        self.waiting: dict = {}    # id -> (queue waiting on this one's prefix, for what count)


def _queues(part) -> tuple[dict, list]:
    """The queues of a :class:`~runtime.lockstep.Part` by id, each with its tasks in order (a
    barrier's on every party), and each task's queue (a barrier's: the first party). The
    parties come first, then the other queues as their first tasks come (an instruction on a
    Legion the machine lacks, in an unverified program, gets a queue of its own, which holds
    no barrier)."""
    barrier = part.kind == BARRIER
    own, bars = np.flatnonzero(~barrier), np.flatnonzero(barrier)
    ids, first, where = np.unique(part.queue[own], return_index=True, return_inverse=True)
    # each queue's own tasks in order: the tasks sorted by queue, cut where the queue changes
    runs = np.split(own[np.argsort(where, kind="stable")], np.cumsum(np.bincount(where, minlength=len(ids)))[:-1])
    mine = dict(zip(ids.tolist(), runs))
    with_bars = (lambda q: np.sort(np.concatenate([q, bars]))) if len(bars) else (lambda q: q)
    queues = {p: _Queue(part.key(p), p, with_bars(mine.get(p, bars[:0])).tolist()) for p in part.parties}
    for q in ids[np.argsort(first, kind="stable")].tolist():
        if q not in queues:
            queues[q] = _Queue(part.key(q), q, mine[q].tolist())
    at = np.empty(len(ids), dtype=object)
    at[:] = [queues[q] for q in ids.tolist()]
    of = np.empty(len(part.kind), dtype=object)
    of[own] = at[where]
    if len(bars):
        of[bars] = queues[part.parties[0]]
    return queues, of.tolist()


def machine_queues(arch: Arch) -> list[tuple[int, str]]:
    """The queues a barrier holds: every queue of every Legion of the machine."""
    return [(legion, q) for legion in range(arch.legions) for q in QUEUES]


class _Sim:
    """The event loop over a :class:`~runtime.lockstep.Part`: its tasks' start, free and done
    times from 0, and the order in which the non-sync ones complete. It runs once per task
    of every segment not timed before, so its inner steps work on local lists and inline the
    common case (a task issued on its queue); times are Python floats until :meth:`run` ends."""

    def __init__(self, part, arch: Arch):
        n = len(part.kind)
        self.part = part
        self.kinds = part.kind.tolist()
        self.start, self.free, self.done = ([INF * 0] * n for _ in range(3))
        self.order: list[int] = []                  # tasks in completion order (not waits, barriers)
        self.is_done = [False] * n
        self.is_flow = part.flows
        self.queues, self.queue_of = _queues(part)
        self.parties = [self.queues[p] for p in part.parties]
        self.arrived: dict[int, set] = defaultdict(set)        # barrier -> queues that reached it
        self.events: list[tuple[float, int]] = []              # (done time, instruction)
        self.dram = _Dram(arch.derived.dram_bytes_per_cycle, arch.derived.link_bytes_per_cycle)
        self.latency = arch.dram_latency_cycles
        self._woken: list = []      # queues a passed wait or a released barrier woke (advance's)

    def run(self) -> None:
        advance = self._advancer()
        for q in self.queues.values():
            advance(q, 0.0)
        events, dram, pop, push = self.events, self.dram, heapq.heappop, heapq.heappush
        flows = dram.flows
        conds, kinds, timing, start, free = self.part.conds, self.kinds, self.part.timing, self.start, self.free
        queue_of, done, is_flow, order, is_done = self.queue_of, self.done, self.is_flow, self.order, self.is_done
        while True:
            if flows:
                t_flow = dram.due                    # (next_end's cached case, inline)
                if t_flow is None:
                    t_flow = dram.next_end()
                if not events or t_flow <= events[0][0]:
                    self._flows_end(t_flow, advance)
                    continue
            elif not events:
                break
            # A task completes (inline: it is the most frequent event). Only its queue's
            # prefix moves: a barrier is never scheduled.
            t, k = pop(events)
            q = queue_of[k]
            done[k] = t
            if not is_flow[k]:
                q.busy = False
            order.append(k)
            is_done[k] = True
            items, n, prefix = q.items, len(q.items), q.prefix
            while prefix < n and is_done[items[prefix]]:
                prefix += 1
            q.prefix = prefix
            if not q.busy and q.head < n:       # else advance would issue nothing and wake none
                k = items[q.head]
                if conds[k] is None and kinds[k] == TASK and not is_flow[k]:
                    # advance's common case, inline: the queue's next task needs nothing but the queue
                    cycles, lead, _ = timing[k]
                    start[k] = t
                    q.busy = True
                    after = q.ready + lead
                    q.ready = 0.0
                    end = (after if after > t else t) + cycles
                    free[k] = end
                    push(events, (end, k))
                    q.head += 1
                else:
                    advance(q, t)
            waiting = q.waiting
            if waiting:           # only the queues whose count it reached: the others would wait on
                due = [other for other, count in waiting.values() if count <= q.prefix]
                for other in due:
                    del waiting[other.id]
                for other in due:
                    advance(other, t)
        self.start, self.free, self.done = (np.array(x, dtype=np.float64)
                                            for x in (self.start, self.free, self.done))

    def stuck(self) -> list[tuple[int, _Queue]]:
        """The task at the head of each queue that did not finish, in task order."""
        return sorted(((q.items[q.head], q) for q in self.queues.values() if q.head < len(q.items)),
                      key=lambda x: x[0])

    # Events. Ties in time pop in task order, and a task that waits on another is only
    # scheduled after that one completed, so the completion order is always a valid order.

    def _flows_end(self, t: float, advance) -> None:
        latency, events, queue_of, free, dram = self.latency, self.events, self.queue_of, self.free, self.dram
        conds, kinds, is_flow = self.part.conds, self.kinds, self.is_flow
        for k in dram.finish(t):
            q = queue_of[k]
            free[k] = t
            q.busy = False
            heapq.heappush(events, (t + latency, k))
            if q.head == len(q.items):
                continue
            k = q.items[q.head]
            if conds[k] is None and kinds[k] == TASK and is_flow[k]:
                # advance's common case, inline: the queue's next DMA needs nothing but the queue
                self.start[k] = t
                q.busy = True
                q.ready = 0.0
                dram.add(k, self.part.timing[k][2], t, self.part.mult[k])
                q.head += 1
            else:
                advance(q, t)

    # Issuing: run a queue as far as it can go at time t; progress may wake other queues.

    def _advancer(self):
        """``advance(q, t)`` for one :meth:`run`: a closure over the state it reads (it runs per
        event; a closure kept on the _Sim would make it a reference cycle, whose many tuples
        only the cycle collector frees)."""
        conds, kinds, timing, mult = self.part.conds, self.kinds, self.part.timing, self.part.mult
        queues, done, is_done, woken, start, free = self.queues, self.done, self.is_done, self._woken, self.start, self.free
        events, dram, barrier, push = self.events, self.dram, self._barrier, heapq.heappush

        def advance(q: _Queue, t: float) -> None:
            """Issue from ``q`` while it is idle and its head's condition holds, then from the
            queues a passed wait or a released barrier woke (a task issued inline: a DMA starts
            its flow; any other task holds its queue from when its lead after ``ready`` is over)."""
            work = None
            while True:
                items, n = q.items, len(q.items)
                while not q.busy and q.head < n:
                    k = items[q.head]
                    cond = conds[k]
                    if cond is not None:
                        key, count = cond
                        target = queues.get(key)
                        if target is None or target.prefix < count:
                            if target is not None:         # woken when the named queue progresses
                                target.waiting[q.id] = (q, count)
                            break
                        if count:                          # queues complete in order: when its count-th did
                            at = done[target.items[count - 1]]
                            if at > q.ready:
                                q.ready = at
                    kind = kinds[k]
                    if kind == TASK:
                        cycles, lead, flow = timing[k]
                        start[k] = t
                        q.busy = True
                        ready, q.ready = q.ready, 0.0
                        if flow is not None:
                            dram.add(k, flow, t, mult[k])
                        else:
                            after = ready + lead           # max() by hand: this runs per task
                            end = (after if after > t else t) + cycles
                            free[k] = end
                            push(events, (end, k))
                    elif kind == WAIT:                     # passes at once, and wakes its queue's waiters
                        start[k] = free[k] = done[k] = t
                        is_done[k] = True
                        while q.prefix < n and is_done[items[q.prefix]]:
                            q.prefix += 1
                        if q.waiting:
                            woken.extend(other for other, _ in q.waiting.values())
                            q.waiting = {}
                    elif not barrier(q, k, t, woken):
                        break
                    q.head += 1
                if woken:
                    if work is None:
                        work = []
                    work.extend(woken)
                    woken.clear()
                if not work:
                    return
                q = work.pop()
        return advance

    def _finish(self, k: int) -> None:
        """Mark ``k`` done and move the completed prefix of its queue(s)."""
        is_done = self.is_done
        is_done[k] = True
        for q in self.parties if self.kinds[k] == BARRIER else (self.queue_of[k],):
            items, n = q.items, len(q.items)
            while q.prefix < n and is_done[items[q.prefix]]:
                q.prefix += 1

    def _mark(self, k: int, t: float) -> None:
        self.start[k] = self.free[k] = self.done[k] = t

    def _barrier(self, q: _Queue, k: int, t: float, woken: list) -> bool:
        if q.prefix < q.head:
            return False            # retried when the queue's earlier work completes
        self.arrived[k].add(q.key)
        if len(self.arrived[k]) < len(self.parties):
            return False            # released by the last queue to arrive
        self._mark(k, t)
        self._finish(k)
        for other in self.parties:
            other.ready = max(other.ready, t)
            if other is not q:
                other.head += 1
                woken.append(other)
        return True


def _deadlock(program: Program, sim: _Sim) -> Deadlock:
    """The first stuck instruction of a whole-program simulation, and why."""
    stuck = sim.stuck()
    k, q = stuck[0]
    others = len({kk for kk, _ in stuck}) - 1
    more = f"; {others} other instruction(s) blocked too" if others else ""
    return Deadlock(f"{program.where(k)}: {_why_stuck(program, sim, k, q)}{more}")


def _why_stuck(program: Program, sim: _Sim, k: int, q: _Queue) -> str:
    i = program.instrs[k]
    cond = i.condition()
    if cond is not None:
        target = next((t for t in sim.queues.values() if t.key == (cond.legion, cond.queue)), None)
        reached = target.prefix if target is not None else 0
        return (f"{i.MNEMONIC} on L{q.key[0]} {q.key[1]} waits for {cond}, never satisfied "
                f"(L{cond.legion}.{cond.queue} completed {reached})")
    missing = sorted({p.key for p in sim.parties} - sim.arrived[k])
    names = ", ".join(f"L{l}.{n}" for l, n in missing[:4])
    return f"barrier never reached by {names}{' and others' if len(missing) > 4 else ''}"


# --- costs and counters ----------------------------------------------------------------------

def _masks(program: Program, distinct: list | None = None) -> dict:
    """Decoded block masks of the u8 const tensors MatMuls name; ``distinct``, if given, the
    index of one instruction of each set of equal ones, which name the same mask."""
    source = program.instrs.source
    used = {getattr(source[o], "mask", None) for o in (range(len(source)) if distinct is None else distinct)} - {None}
    out = {}
    for m in sorted(used):
        t = program.tensors[m] if m < len(program.tensors) else None
        if t is None or t.dtype != "u8" or t.kind != "const":
            continue                # costs.matmul reports it against the instruction
        raw = np.frombuffer(program.const_bytes(t), dtype=np.uint8).reshape(t.shape)
        out[m] = Blocks.from_mask(raw)
    return out


@dataclass
class Costed:
    """Each instruction's cost, and per task the instruction it came from."""

    costs: list             # per instruction of the source program
    origin: np.ndarray      # per task
    first: list             # per instruction, its first task
    ids: np.ndarray         # per instruction, the first instruction equal to it (whose cost it shares)

    def per_task(self) -> list:
        return [self.costs[o] for o in self.origin.tolist()]


def _costs(program: Program, arch: Arch) -> Costed:
    """The tasks of one span differ only by Legion, DRAM offset and destinations, which no
    cost depends on: each instruction is costed once, as written (its first task but for the
    span and condition, which no cost reads either)."""
    tasks = program.instrs
    first, ids = tasks.first.tolist(), tasks.alike().ids    # alike instructions (each layer's) cost alike
    distinct = np.flatnonzero(np.asarray(ids) == np.arange(len(ids))).tolist()
    env = Env(tuple(program.tensors), _masks(program, distinct))
    costs = [None] * len(first)
    for o in distinct:                                      # each distinct one, once
        costs[o] = _cost(program, first[o], tasks.source[o], arch, env)
    return Costed([costs[i] for i in ids], tasks.origin, first, np.asarray(ids, dtype=np.int64))


def _cost(program: Program, k: int, i, arch: Arch, env: Env):
    try:
        return cost(i, arch, env)
    except CostError as e:
        raise TimingError(f"{program.where(k)}: {e}") from None


def _counters(program: Program, costed: Costed, tasks, start: np.ndarray, free: np.ndarray,
              done: np.ndarray) -> tuple[dict, dict]:
    """The counters summed over the tasks, busy cycles by family and by queue, and the
    per-instruction rows of the matmuls; an instruction's tasks share its cost."""
    origin, costs, first = costed.origin, costed.costs, costed.first
    counters = dict.fromkeys(SUMMED, 0)
    # Per distinct instruction (equal ones share a cost), the tasks of all its equals.
    times = np.bincount(costed.ids[origin], minlength=len(costs))
    for o in np.flatnonzero(times).tolist():
        n = int(times[o])
        for name, v in costs[o].counters.items():
            counters[name] += v * n
    fam = _families(program.instrs.source, costed.ids)[origin] if len(origin) else origin
    held = free - start
    count = np.bincount(fam, minlength=len(FAMILIES))
    cycles = np.bincount(fam, weights=held, minlength=len(FAMILIES))
    for f, name in enumerate(FAMILIES):
        counters[f"count_{name}"] = int(count[f])
        counters[f"busy_{name}"] = ceil_cycles(cycles[f])
    counters["per_instr"] = _per_instr(program, costed, first, start, done, tasks.legion)
    return counters, _busy(tasks, fam, held)


def _families(source: list, ids: np.ndarray) -> np.ndarray:
    """Per instruction, the index of its family in FAMILIES, looked up once per distinct one."""
    index: dict = {}                    # class -> its family's
    distinct = np.flatnonzero(ids == np.arange(len(ids)))
    for o in distinct.tolist():
        cls = type(source[o])
        if cls not in index:
            index[cls] = FAMILIES.index(family(cls))
    fam = np.zeros(len(ids), dtype=np.int64)
    fam[distinct] = [index[type(source[o])] for o in distinct.tolist()]
    return fam[ids]


def _busy(tasks, fam: np.ndarray, held: np.ndarray) -> dict:
    """Cycles each queue was held, but by sync instructions."""
    legion, queue = tasks.legion, tasks.queue
    held_by = (fam != FAMILIES.index("sync")) & (legion >= 0) & (queue >= 0)
    names = tasks.names
    slot = legion[held_by] * len(names) + queue[held_by]
    sums = np.bincount(slot, weights=held[held_by])
    used = np.bincount(slot, minlength=len(sums))
    return {(int(s) // len(names), names[int(s) % len(names)]): ceil_cycles(sums[s]) for s in np.flatnonzero(used)}


def _per_instr(program: Program, costed: Costed, first: list, start, done, legion: np.ndarray) -> list:
    rows = []
    detailed = [o for o, c in enumerate(costed.costs) if c.detail is not None]
    n = len(costed.origin)
    for o in detailed:
        lo = first[o]
        hi = first[o + 1] if o + 1 < len(first) else n
        # each row a copy of one laid out in the report's order (half the time of building it)
        layout = {"index": 0, "legion": 0, **costed.costs[o].detail, "start": 0.0, "done": 0.0}
        for k, lg, s, d in zip(range(lo, hi), legion[lo:hi].tolist(), start[lo:hi].tolist(), done[lo:hi].tolist()):
            row = layout.copy()
            row["index"], row["legion"], row["start"], row["done"] = k, lg, s, d
            rows.append(row)
    return rows


def simulate(program: Program, arch: Arch, execute=None, progress=None) -> Timeline:
    """Time ``program`` on ``arch``; ``execute(i)`` is called for each non-sync instruction
    after every instruction it depends on, in nondecreasing completion time. Instruction
    indices are those of the program expanded into one task per Legion (isa/expand.py).
    ``progress(n)``, if given, is told of the tasks timed as they are."""
    program = expand(program, arch.legions).program
    if arch.derived.dram_bytes_per_cycle <= 0 or arch.derived.link_bytes_per_cycle <= 0:
        raise TimingError(f"{arch.name}: DRAM and link bandwidth must be positive")
    costed = _costs(program, arch)
    tasks = lockstep.tasks_of(program, costed)
    n = len(tasks.kind)
    times = tuple(np.full(n, np.nan) for _ in range(3))
    if lockstep.fits(tasks, arch.legions):
        _by_segment(program, arch, tasks, times, execute, progress)
    else:
        _at_once(program, arch, tasks, times, execute, progress)
    start, free, done = times
    counters, busy = _counters(program, costed, tasks, start, free, done)
    last = float(np.nanmax(done)) if n else 0.0
    return Timeline(cycles=ceil_cycles(last), start=start, free=free, done=done,
                    busy=busy, counters=counters, program=program)


def _at_once(program: Program, arch: Arch, tasks, times: tuple, execute, progress) -> None:
    """The whole program as one part, every task simulated (an unverified program whose
    Legions the machine lacks)."""
    sim = _Sim(lockstep.whole(tasks, machine_queues(arch)), arch)
    sim.run()
    if sim.stuck():
        raise _deadlock(program, sim)
    for out, got in zip(times, (sim.start, sim.free, sim.done)):
        out[:] = got
    for k in sim.order:
        if execute is not None:
            execute(k)
    if progress is not None:
        progress(len(sim.order))


def _by_segment(program: Program, arch: Arch, tasks, times: tuple, execute, progress) -> None:
    """Segment by segment, the Legions of each in lockstep classes (runtime/lockstep.py)."""
    parties = machine_queues(arch)
    timed: dict = {}          # segment key -> (start, free, done, completion order), from 0
    t0 = 0.0
    for seg in lockstep.segments(tasks, arch.legions, parties):
        got = timed.get(seg.key)
        if got is None:
            got = timed[seg.key] = _time_part(program, arch, tasks, seg)
        for out, rel in zip(times, got[:3]):
            out[seg.order] = rel + t0
            out[seg.dst] = rel[seg.src] + t0
        if execute is not None:
            for k in seg.in_order(got[3]).tolist():
                execute(k)
        if progress is not None:
            progress(int(np.count_nonzero(tasks.kind[seg.lo:seg.hi] == TASK)))
        if seg.hi > seg.lo:
            t0 = max(t0, float(np.max(times[2][seg.lo:seg.hi])))
        if seg.hi < len(tasks.kind):
            for out in times:
                out[seg.hi] = t0          # the barrier after it: released by the last to finish


def _time_part(program: Program, arch: Arch, tasks, seg) -> tuple:
    sim = _Sim(seg.part(), arch)
    sim.run()
    if sim.stuck():
        # Name the culprit as the whole program sees it: simulated at once, it stops there too.
        _at_once(program, arch, tasks, tuple(np.full(len(tasks.kind), np.nan) for _ in range(3)), None, None)
        raise Deadlock(f"{program.where(seg.order[sim.stuck()[0][0]])}: a wait is never satisfied")
    return sim.start, sim.free, sim.done, sim.order
