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
heap: simulation costs O(log) per event, and nothing loops per cycle.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from isa.arch import Arch
from isa.expand import expand
from isa.fields import QUEUES
from isa.instructions import Barrier, Wait, family
from isa.program import Program
from runtime.costs import Blocks, CostError, Env, ceil_cycles, cost

INF = float("inf")
FAMILIES = ("dma", "matrix", "drain", "vector", "sync")
SUMMED = ("dram_read_bytes", "dram_write_bytes", "multicast_saved_bytes", "macs", "dense_macs",
          "passes", "dense_passes", "windows_skipped", "sparsity_cycles_saved", "psum_bytes", "spad_bytes",
          "vector_elems", "vector_ops")


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
    """Active flows sharing DRAM; ``served`` is the bytes every active flow has moved so far."""

    def __init__(self, total: float, link: float):
        self.total, self.link = total, link
        self.t = 0.0
        self.served = 0.0
        self.flows: list[tuple[float, int]] = []    # (served level at which it ends, instruction)

    def rate(self) -> float:
        return min(self.link, self.total / len(self.flows)) if self.flows else 0.0

    def advance(self, t: float) -> None:
        self.served += self.rate() * (t - self.t)
        self.t = t

    def add(self, k: int, nbytes: int, t: float) -> None:
        self.advance(t)
        heapq.heappush(self.flows, (self.served + nbytes, k))

    def next_end(self) -> float:
        if not self.flows:
            return INF
        return self.t + max(0.0, self.flows[0][0] - self.served) / self.rate()

    def finish(self, t: float) -> list[int]:
        """Flows ending at ``t`` (the first is due by construction; others within rounding)."""
        self.advance(t)
        ended = [heapq.heappop(self.flows)[1]]
        while self.flows and self.flows[0][0] <= self.served + 1e-9 * max(1.0, self.served):
            ended.append(heapq.heappop(self.flows)[1])
        return ended


# --- queues ----------------------------------------------------------------------------------

class _Queue:
    __slots__ = ("key", "items", "head", "busy", "prefix", "ready")

    def __init__(self, key):
        self.key = key
        self.items: list[int] = []
        self.head = 0
        self.busy = False          # running an instruction (a DMA: until its flow ends)
        self.prefix = 0            # leading instructions that are done
        self.ready = 0.0           # when the conditions met since its last instruction came true


def _queue_keys(i, arch: Arch) -> list[tuple[int, str]]:
    if isinstance(i, Barrier):
        return [(legion, q) for legion in range(arch.legions) for q in QUEUES]
    return [(i.legion, i.queue())]


class _Sim:
    def __init__(self, program: Program, arch: Arch, costs: list, execute):
        n = len(program.instrs)
        self.program, self.costs, self.execute = program, costs, execute
        self.start, self.free, self.done = (np.full(n, np.nan) for _ in range(3))
        self.is_done = [False] * n
        self.queues: dict[tuple, _Queue] = {k: _Queue(k) for k in _queue_keys(Barrier(), arch)}
        # The queues a barrier holds: the machine's. An instruction on a Legion it lacks (an
        # unverified program) gets a queue of its own, which holds no barrier.
        self.parties = list(self.queues.values())
        self.queue_of: list[_Queue] = []
        for k, i in enumerate(program.instrs):
            keys = _queue_keys(i, arch)
            for key in keys:
                self.queues.setdefault(key, _Queue(key)).items.append(k)
            self.queue_of.append(self.queues[keys[0]])
        # Per task, what the event loop asks of it each time it looks at it.
        self.conds = [i.condition() for i in program.instrs]
        self.is_barrier = [isinstance(i, Barrier) for i in program.instrs]
        self.waiters: dict[tuple, dict] = defaultdict(dict)   # queue key -> queues waiting on it
        self.arrived: dict[int, set] = defaultdict(set)        # barrier -> queues that reached it
        self.events: list[tuple[float, int]] = []              # (done time, instruction)
        self.dram = _Dram(arch.derived.dram_bytes_per_cycle, arch.derived.link_bytes_per_cycle)
        self.latency = arch.dram_latency_cycles
        self.handlers = {Wait: self._wait, Barrier: self._barrier}

    def run(self) -> None:
        for q in self.queues.values():
            self._advance(q, 0.0)
        while True:
            t_event = self.events[0][0] if self.events else INF
            t_flow = self.dram.next_end()
            if t_event == INF and t_flow == INF:
                break
            if t_flow <= t_event:
                self._flows_end(t_flow)
                continue
            t, k = heapq.heappop(self.events)
            self._complete(k, t)
        self._check_deadlock()

    # Events. Ties in time pop in program order, and an instruction that waits on another is
    # only scheduled after that one completed, so `execute` always sees a valid order.

    def _flows_end(self, t: float) -> None:
        for k in self.dram.finish(t):
            q = self.queue_of[k]
            self.free[k] = t
            q.busy = False
            heapq.heappush(self.events, (t + self.latency, k))
            self._advance(q, t)

    def _complete(self, k: int, t: float) -> None:
        q = self.queue_of[k]
        self.done[k] = t
        if self.costs[k].flow_bytes is None:
            q.busy = False
        if self.execute is not None:
            self.execute(k)
        self._finish(k)
        self._advance(q, t)
        self._wake(q, t)

    # Issuing: run a queue as far as it can go at time t; progress may wake other queues.

    def _advance(self, q: _Queue, t: float) -> None:
        work = [q]
        while work:
            work.extend(self._step(work.pop(), t))

    def _wake(self, q: _Queue, t: float) -> None:
        for waiting in list(self.waiters.pop(q.key, {}).values()):
            self._advance(waiting, t)

    def _finish(self, k: int) -> None:
        """Mark ``k`` done and move the completed prefix of its queue(s)."""
        self.is_done[k] = True
        for q in self._queues_of(k):
            while q.prefix < len(q.items) and self.is_done[q.items[q.prefix]]:
                q.prefix += 1

    def _queues_of(self, k: int) -> list[_Queue]:
        if self.is_barrier[k]:
            return self.parties
        return [self.queue_of[k]]

    def _step(self, q: _Queue, t: float) -> list[_Queue]:
        woken: list[_Queue] = []
        while not q.busy and q.head < len(q.items):
            k = q.items[q.head]
            cond = self.conds[k]
            if cond is not None:
                if not self._holds(q, cond):
                    break
                q.ready = max(q.ready, self._met_at(cond))
            handler = self.handlers.get(type(self.program.instrs[k]), self._issue)
            if not handler(q, k, t, woken):
                break
            q.head += 1
        return woken

    def _holds(self, q: _Queue, cond) -> bool:
        """True when ``cond`` holds; else ``q`` is woken when the named queue progresses."""
        target = self.queues.get((cond.legion, cond.queue))
        if target is not None and target.prefix >= cond.count:
            return True
        if target is not None:
            self.waiters[target.key][q.key] = q
        return False

    def _met_at(self, cond) -> float:
        """When a condition that holds came true: queues complete in order, so when the
        count-th instruction of the named queue did."""
        if not cond.count:
            return 0.0
        return float(self.done[self.queues[(cond.legion, cond.queue)].items[cond.count - 1]])

    def _mark(self, k: int, t: float) -> None:
        self.start[k] = self.free[k] = self.done[k] = t

    def _wait(self, q: _Queue, k: int, t: float, woken: list) -> bool:
        self._mark(k, t)
        self._finish(k)
        woken.extend(self.waiters.pop(q.key, {}).values())
        return True

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

    def _issue(self, q: _Queue, k: int, t: float, woken: list) -> bool:
        c = self.costs[k]
        self.start[k] = t
        q.busy = True
        ready, q.ready = q.ready, 0.0
        if c.flow_bytes is not None:
            self.dram.add(k, c.flow_bytes, t)
            return True
        end = max(t, ready + c.lead) + c.cycles
        self.free[k] = end
        heapq.heappush(self.events, (end, k))
        return True

    def _check_deadlock(self) -> None:
        stuck = sorted(((q.items[q.head], q) for q in self.queues.values() if q.head < len(q.items)),
                       key=lambda x: x[0])
        if not stuck:
            return
        k, q = stuck[0]
        others = len({kk for kk, _ in stuck}) - 1
        more = f"; {others} other instruction(s) blocked too" if others else ""
        raise Deadlock(f"{self.program.where(k)}: {self._why_stuck(k, q)}{more}")

    def _why_stuck(self, k: int, q: _Queue) -> str:
        i = self.program.instrs[k]
        cond = i.condition()
        if cond is not None:
            target = self.queues.get((cond.legion, cond.queue))
            reached = target.prefix if target is not None else 0
            return (f"{i.MNEMONIC} on L{q.key[0]} {q.key[1]} waits for {cond}, never satisfied "
                    f"(L{cond.legion}.{cond.queue} completed {reached})")
        missing = sorted({p.key for p in self.parties} - self.arrived[k])
        names = ", ".join(f"L{l}.{n}" for l, n in missing[:4])
        return f"barrier never reached by {names}{' and others' if len(missing) > 4 else ''}"


# --- costs and counters ----------------------------------------------------------------------

def _masks(program: Program) -> dict:
    """Decoded block masks of the u8 const tensors MatMuls name."""
    used = {getattr(i, "mask", None) for i in program.instrs} - {None}
    out = {}
    for m in sorted(used):
        t = program.tensors[m] if m < len(program.tensors) else None
        if t is None or t.dtype != "u8" or t.kind != "const":
            continue                # costs.matmul reports it against the instruction
        raw = np.frombuffer(program.const_bytes(t), dtype=np.uint8).reshape(t.shape)
        out[m] = Blocks.from_mask(raw)
    return out


def _costs(program: Program, arch: Arch) -> list:
    """Each task's cost. The tasks of one span differ only by Legion, DRAM offset and
    destinations, which no cost depends on: each instruction is costed once."""
    env = Env(tuple(program.tensors), _masks(program))
    origin = program.origin or range(len(program.instrs))
    out, by_origin = [], {}
    for k, i in enumerate(program.instrs):
        c = by_origin.get(origin[k])
        if c is None:
            c = by_origin[origin[k]] = _cost(program, k, i, arch, env)
        out.append(c)
    return out


def _cost(program: Program, k: int, i, arch: Arch, env: Env):
    try:
        return cost(i, arch, env)
    except CostError as e:
        raise TimingError(f"{program.where(k)}: {e}") from None


def _counters(program: Program, costs: list, sim: _Sim) -> tuple[dict, dict]:
    counters = dict.fromkeys(SUMMED, 0)
    counters |= {f"count_{f}": 0 for f in FAMILIES} | {f"busy_{f}": 0.0 for f in FAMILIES}
    busy: dict = defaultdict(float)
    per_instr = []
    held = sim.free - sim.start
    for k, (i, c) in enumerate(zip(program.instrs, costs)):
        fam = family(type(i))
        counters[f"count_{fam}"] += 1
        counters[f"busy_{fam}"] += held[k]
        if fam != "sync":
            busy[(i.legion, i.queue())] += held[k]
        for name, v in c.counters.items():
            counters[name] += v
        if c.detail is not None:
            per_instr.append({"index": k, "legion": i.legion, **c.detail,
                              "start": float(sim.start[k]), "done": float(sim.done[k])})
    counters |= {f"busy_{f}": ceil_cycles(counters[f"busy_{f}"]) for f in FAMILIES}
    counters["per_instr"] = per_instr
    return counters, {key: ceil_cycles(v) for key, v in busy.items()}


def simulate(program: Program, arch: Arch, execute=None) -> Timeline:
    """Time ``program`` on ``arch``; ``execute(i)`` is called for each non-sync instruction at
    its completion, in nondecreasing completion time (ties in program order). Instruction
    indices are those of the program expanded into one task per Legion (isa/expand.py)."""
    program = expand(program, arch.legions).program
    if arch.derived.dram_bytes_per_cycle <= 0 or arch.derived.link_bytes_per_cycle <= 0:
        raise TimingError(f"{arch.name}: DRAM and link bandwidth must be positive")
    costs = _costs(program, arch)
    sim = _Sim(program, arch, costs, execute)
    sim.run()
    counters, busy = _counters(program, costs, sim)
    last = float(sim.done.max()) if len(sim.done) else 0.0
    return Timeline(cycles=ceil_cycles(last), start=sim.start, free=sim.free, done=sim.done,
                    busy=busy, counters=counters, program=program)
