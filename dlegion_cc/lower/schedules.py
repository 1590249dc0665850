"""Schedules of quantized matmuls a user can see and pin.

``dlegion-cc --emit schedule`` writes, for every schedule a quantized matmul's lowering asks
for, one JSON entry: the node, its shape and modes, the deal to the Legions, the loop order,
the tile, the chunk, the scratchpad slots, how a pass splits over the cores, and the cost
model's predicted cycles, DRAM bytes and instructions, and ``k_split``: null, or the Legions
its K is split over (``ksplit.py``) with that split's predicted cycles. ``--schedule FILE`` gives nodes
schedules back: a node the file names skips the search and takes the file's entries, in their
order, one per schedule its lowering asks for (one per batch of a batched matmul, one per
size of the parts its rows are cut into); every entry is checked against the machine and
the matmul first. A node the file does not name is searched as always.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from isa.arch import Arch
from isa.files import check_readable
from dlegion_cc.errors import CompileError
from dlegion_cc.lower import ksplit
from dlegion_cc.lower.context import Switches
from dlegion_cc.lower.qplan import (ORDERS, Plan, Problem, columns_per_legion, correction_depth, estimate, forwards, needs, room,
                                    search, skips, split_for)

FORMAT = 1
SLOTS = {"wgt": "w_slots", "act": "a_slots", "acc": "acc_slots", "vec": "res_slots"}
NAMES_SHOWN = 6         # quantized matmuls listed when the file names a node that is none


class ScheduleError(CompileError):
    """A schedule file that cannot be used: the message names the file and the node."""


def entry(node: str, p: Problem, plan: Plan, e, deal: tuple[int, int]) -> dict:
    """What a user sees of one schedule (the estimate ``e`` is ``qplan.Estimate``)."""
    return {"node": node,
            "shape": {"M": len(p.rows), "K": p.K, "N": p.N, "batches": p.batches},
            "modes": [mode for _, mode in p.weights],
            "deal": {"legions_per_part": deal[0], "parts": deal[1], "columns_per_legion": plan.per_legion},
            "loop_order": plan.order,
            "tile": {"rows": plan.rows, "cols": plan.cols},
            "chunk": {"depth": plan.depth, "whole_rows": plan.whole_rows, "homes": plan.homes},
            "slots": {space: getattr(plan, name) for space, name in SLOTS.items()},
            "split": plan.split,
            "predicted": {"cycles": e.cycles, "dram_bytes": e.dram_bytes, "instructions": e.instructions}}


@dataclass
class Schedules:
    """The schedules of one compile: those pinned (by node, from ``source``) and those given."""

    source: str = ""
    pinned: dict = field(default_factory=dict)     # node -> its entries, in the file's order
    chosen: list = field(default_factory=list)     # every schedule given, in program order
    node: str = ""                                 # the node being lowered
    asked: dict = field(default_factory=dict)      # node -> schedules its lowering took so far
    _deal: tuple = (0, 0)

    def begin(self, node: str) -> None:
        self.node = node

    def width(self, arch: Arch, rows: int, pick: Callable[[], int]) -> int:
        """Legions per part of a matmul whose parts share out all the Legions (``pick``: the
        search's choice)."""
        return self.deal(arch, rows, lambda: _whole(arch, pick()), spread=True)[0]

    def deal(self, arch: Arch, rows: int, pick: Callable[[], tuple[int, int]], spread: bool = False) -> tuple[int, int]:
        """(Legions per part, parts) for the node's ``rows`` rows: pinned, else ``pick()``."""
        self.asked.setdefault(self.node, 0)
        entries = self.pinned.get(self.node)
        if entries is None:
            self._deal = pick()
            return self._deal
        try:
            self._deal = _deal_of(entries[0])
        except ValueError as why:
            raise self._error(1, str(why)) from None
        why = _deal_problem(arch, rows, *self._deal, spread)
        if why:
            raise self._error(1, why)
        return self._deal

    @contextmanager
    def dealt(self, deal: tuple[int, int]):
        """The schedules asked for inside are of another deal of the node's columns (a part
        split off, ``qrest``), recorded and checked against it."""
        node_deal, self._deal = self._deal, deal
        try:
            yield
        finally:
            self._deal = node_deal

    def plan(self, arch: Arch, p: Problem, switches: Switches) -> Plan:
        """The schedule of ``p``: the node's next pinned one, checked, else the search's."""
        entries = self.pinned.get(self.node)
        k = self.asked.get(self.node, 0)
        self.asked[self.node] = k + 1
        if entries is None:
            e, plan = search(arch, p, switches)
        elif k >= len(entries):
            raise self._error(k + 1, f"the file gives {len(entries)} schedule(s); the lowering needs more")
        else:
            plan = self._checked(arch, p, switches, entries[k], k + 1)
            e = estimate(arch, p, plan)
        self.chosen.append(entry(self.node, p, plan, e, self._deal))
        return plan

    def k_split(self, arch: Arch, p: Problem, plan: Plan, switches: Switches, em) -> bool:
        """Emit ``p`` as a K split over the Legions (``ksplit.py``) when the pinned entry's
        ``k_split`` asks for it, or, unpinned, when it beats ``plan``; recorded in the entry."""
        entries, k = self.pinned.get(self.node), self.asked[self.node]
        parts = None if switches.ksplit else 0
        if entries is not None:
            try:
                parts = _k_split_parts(arch, entries[k - 1])
            except ValueError as why:
                raise self._error(k, str(why)) from None
        ks = ksplit.choose(arch, p, self.chosen[-1]["predicted"]["cycles"], parts)
        if parts and ks is None:
            raise self._error(k, f"k_split over {parts} Legions: the matmul cannot be split (int32 results "
                                 f"only, each Legion's K range in its scratchpads)")
        self.chosen[-1]["k_split"] = None if ks is None else {"parts": ks.parts,
                                                              "cycles": ksplit.predict(arch, p, ks)}
        if ks is not None:
            ksplit.emit(em, p, ks)
        return ks is not None

    def finish(self, model: str) -> None:
        """After lowering: every node the file names was a quantized matmul, and took every
        schedule the file gives it."""
        for node, entries in self.pinned.items():
            if node not in self.asked:
                names = list(self.asked)
                shown = ", ".join(f"'{n}'" for n in names[:NAMES_SHOWN]) + (", ..." if len(names) > NAMES_SHOWN else "")
                raise ScheduleError(f"{self.source}: node '{node}' is not a quantized matmul of {model} "
                                    f"(its quantized matmuls: {shown or 'none'})")
            if self.asked[node] < len(entries):
                raise ScheduleError(f"{self.source}: node '{node}': the file gives {len(entries)} schedule(s); "
                                    f"the lowering needs {self.asked[node]}")

    def document(self, arch: Arch, switches: Switches) -> dict:
        return {"format": FORMAT, "arch": arch.name, "objective": switches.objective, "schedules": self.chosen}

    def _checked(self, arch: Arch, p: Problem, switches: Switches, e: dict, k: int) -> Plan:
        try:
            if _deal_of(e) != self._deal:
                raise ValueError(f"its deal differs from the node's first schedule's (legions_per_part "
                                 f"{self._deal[0]}, parts {self._deal[1]})")
            return plan_of(arch, p, switches, e)
        except ValueError as why:
            raise self._error(k, str(why)) from None

    def _error(self, k: int, why: str) -> ScheduleError:
        return ScheduleError(f"{self.source}: node '{self.node}' schedule {k}: {why}")


def read(path: str | Path) -> Schedules:
    """The pinned schedules of a file ``--emit schedule`` wrote (or a user edited)."""
    check_readable(path)
    try:
        doc = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ScheduleError(f"{path}: not a JSON schedule file ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("schedules"), list):
        raise ScheduleError(f"{path}: a schedule file is a JSON object whose 'schedules' is a list")
    pinned: dict = {}
    for i, e in enumerate(doc["schedules"]):
        if not isinstance(e, dict) or not isinstance(e.get("node"), str):
            raise ScheduleError(f"{path}: schedule {i + 1} is not an object with a 'node' name")
        pinned.setdefault(e["node"], []).append(e)
    return Schedules(str(path), pinned)


# --- a pinned entry as a plan, checked against the machine and the matmul --------------------

def plan_of(arch: Arch, p: Problem, switches: Switches, e: dict) -> Plan:
    """The plan an entry gives ``p``, or ValueError saying why it cannot be one."""
    _same_matmul(p, e)
    tile, chunk, slots = _table(e, "tile"), _table(e, "chunk"), _table(e, "slots")
    order, split = _str(e, "loop_order"), _str(e, "split")
    plan = Plan(order, _int(tile, "rows"), _int(tile, "cols"), _int(chunk, "depth"), _bool(chunk, "whole_rows"),
                columns_per_legion(arch, p), *(_int(slots, space) for space in SLOTS), split,
                switches.multicast, skips(p, switches))
    homes = _count(chunk, "homes")
    plan = replace(plan, forward=homes > 0, homes=homes)
    given = _int(_table(e, "deal"), "columns_per_legion")
    why = (_shape_problem(arch, p, plan, given) or _order_problem(arch, switches, plan)
           or _forward_problem(arch, p, plan) or _space_problem(arch, p, plan))
    if why:
        raise ValueError(why)
    return replace(plan, corr_depth=correction_depth(p, plan))


def _same_matmul(p: Problem, e: dict) -> None:
    shape = _table(e, "shape")
    want = {"M": len(p.rows), "K": p.K, "N": p.N, "batches": p.batches}
    got = {k: _int(shape, k) for k in want}
    if got != want:
        raise ValueError(f"it is for a {_dims(got)} matmul; the node's is {_dims(want)}")
    modes = [mode for _, mode in p.weights]
    if e.get("modes") != modes:
        raise ValueError(f"its modes {e.get('modes')} are not the node's {modes}")


def _dims(d: dict) -> str:
    return f"{d['M']}x{d['K']}x{d['N']}" + (f" (x{d['batches']} batches)" if d["batches"] > 1 else "")


def _shape_problem(arch: Arch, p: Problem, plan: Plan, given: int) -> str | None:
    na, group = arch.array, min(p.block, p.K)
    if given != plan.per_legion:
        return f"columns_per_legion {given}: {arch.name} deals this matmul {plan.per_legion} columns a Legion"
    if plan.cols % na or plan.cols > plan.per_legion:
        return f"tile cols {plan.cols} is not a multiple of the array ({na}) up to the {plan.per_legion} columns a Legion"
    if p.gated and plan.cols % (2 * p.gated):
        return (f"tile cols {plan.cols}: the gate and up columns of this matmul's drains come in pairs of "
                f"{p.gated}-column granules, and a tile holds whole pairs ({2 * p.gated} columns)")
    if plan.depth > group or (plan.depth % na and plan.depth != group):
        return f"chunk depth {plan.depth} is not a multiple of the array ({na}) up to {group} (a scale group or K)"
    return None


def _order_problem(arch: Arch, switches: Switches, plan: Plan) -> str | None:
    if plan.order not in ORDERS:
        return f"loop_order {plan.order!r} is none of {', '.join(ORDERS)}"
    allowed = {"n", split_for(arch, switches)}
    if plan.split not in allowed:
        return f"split {plan.split!r}: {arch.name} (with these switches) splits a pass by {' or '.join(sorted(allowed))}"
    return None


def _forward_problem(arch: Arch, p: Problem, plan: Plan) -> str | None:
    if plan.forward and not forwards(arch, p, replace(plan, a_slots=0)):
        return (f"homes {plan.homes}: activations are forwarded only when multicast to several Legions, "
                f"in one batch, over more than one column tile")
    return None


def _space_problem(arch: Arch, p: Problem, plan: Plan) -> str | None:
    cap = room(arch, p)
    for space, n in needs(p, plan).items():
        if n > cap[space]:
            return f"it needs {n:,} elements of {space}; {arch.name}'s {space} scratchpad holds {cap[space]:,}"
    return None


def _deal_problem(arch: Arch, rows: int, width: int, parts: int, spread: bool) -> str | None:
    if arch.legions % width or width * parts > arch.legions:
        return f"a deal of {parts} part(s) of {width} Legion(s) does not fit {arch.name}'s {arch.legions} Legions"
    if spread and width * parts != arch.legions:
        return f"the parts of a matmul with constant weights share out all {arch.legions} Legions, not {width * parts}"
    if parts > rows:
        return f"{parts} parts of {rows} row(s) would leave a part without rows"
    return None


def _deal_of(e: dict) -> tuple[int, int]:
    deal = _table(e, "deal")
    return _int(deal, "legions_per_part"), _int(deal, "parts")


def _k_split_parts(arch: Arch, e: dict) -> int:
    """The Legions a pinned entry's ``k_split`` splits K over (null or absent: 0, none)."""
    ks = e.get("k_split")
    if ks is None:
        return 0
    if not isinstance(ks, dict):
        raise ValueError(f"'k_split' must be null or an object with 'parts', not {json.dumps(ks)}")
    parts = _int(ks, "parts")
    if not 2 <= parts <= arch.legions:
        raise ValueError(f"k_split parts {parts}: {arch.name} splits K over 2 to {arch.legions} Legions")
    return parts


def _whole(arch: Arch, width: int) -> tuple[int, int]:
    return width, arch.legions // width


# --- reading an entry's fields ---------------------------------------------------------------

def _get(table: dict, key: str, kind: type, what: str):
    v = table.get(key)
    if type(v) is not kind:
        raise ValueError(f"'{key}' must be {what}, not {json.dumps(v)}")
    return v


def _table(e: dict, key: str) -> dict:
    return _get(e, key, dict, "an object")


def _int(table: dict, key: str) -> int:
    v = _get(table, key, int, "a positive integer")
    if not 0 < v < 2 ** 31:
        raise ValueError(f"'{key}' must be a positive integer, not {v}")
    return v


def _count(table: dict, key: str) -> int:
    """An optional count (absent: 0)."""
    v = table.get(key, 0)
    if type(v) is not int or not 0 <= v < 2 ** 31:
        raise ValueError(f"'{key}' must be a count (0 or more), not {json.dumps(v)}")
    return v


def _str(table: dict, key: str) -> str:
    return _get(table, key, str, "a string")


def _bool(table: dict, key: str) -> bool:
    return _get(table, key, bool, "true or false")
