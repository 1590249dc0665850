"""The --trace file keeps the trace-event format's rules, so Perfetto draws what the run did."""
import json
import math
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import pytest

from isa import arch, asm
from dlegion_cc.pipeline import Options, compile_model
from runtime import report
from runtime.emulator import random_inputs, run

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
BITNET = ROOT / "models" / "bitnet_tiny_relu2.onnx"


def _ns(us) -> int:
    """A time of the file in whole nanoseconds, as Perfetto keeps it."""
    return round(us * 1000)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def format_errors(trace: dict) -> list[str]:
    """Where ``trace`` breaks the format's rules: on every (pid, tid) the complete (X) slices are
    disjoint or properly nested; every pid and (pid, tid) an event uses has a name (process_name,
    thread_name metadata); timestamps and durations are non-negative finite numbers."""
    errors, slices = [], defaultdict(list)
    processes, threads, used = set(), set(), set()
    for e in trace["traceEvents"]:
        if e["ph"] == "M":
            if e["name"] == "process_name" and e["args"].get("name"):
                processes.add(e["pid"])
            if e["name"] == "thread_name" and e["args"].get("name"):
                threads.add((e["pid"], e["tid"]))
            continue
        used.add((e["pid"], e["tid"]))
        if not _number(e.get("ts")) or (e["ph"] == "X" and not _number(e.get("dur"))):
            errors.append(f"bad time: {e}")
        elif e["ph"] == "X":
            slices[(e["pid"], e["tid"])].append((_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"]), e["name"]))
    errors += [f"pid {pid} has no process_name" for pid in sorted({p for p, _ in used} - processes)]
    errors += [f"(pid, tid) {key} has no thread_name" for key in sorted(used - threads)]
    for key, spans in slices.items():
        open_ = []                                  # ends of the enclosing slices
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ and open_[-1] <= start:
                open_.pop()
            if open_ and end > open_[-1]:
                errors.append(f"{key}: {name} [{start}, {end}) overlaps the slice ending at {open_[-1]}")
            open_.append(end)
    return errors


@lru_cache(maxsize=1)
def _bitnet():
    a = arch.load("dlegion-tiny")
    _, program = compile_model(BITNET, Options(a))
    return run(program, a, random_inputs(program, 0))


def _example(name: str):
    path = EXAMPLES / name
    program = asm.parse(path.read_text(), str(path))
    if program.data_file is not None:
        program.data = (path.parent / program.data_file).read_bytes()
    return run(program, arch.load(program.arch), random_inputs(program, 3))


def test_the_validator_finds_partial_overlaps_and_unnamed_tracks():
    named = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "p"}},
             {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "t"}}]
    nested = [{"ph": "X", "name": n, "pid": 0, "tid": 0, "ts": ts, "dur": dur}
              for n, ts, dur in (("a", 0.0, 0.01), ("b", 0.002, 0.003), ("c", 0.01, 0.0), ("d", 0.01, 0.004))]
    assert format_errors({"traceEvents": named + nested}) == []
    partial = nested + [{"ph": "X", "name": "e", "pid": 0, "tid": 0, "ts": 0.012, "dur": 0.005}]
    assert format_errors({"traceEvents": named + partial}) == ["(0, 0): e [12, 17) overlaps the slice ending at 14"]
    unnamed = [{"ph": "i", "name": "x", "s": "g", "pid": 1, "tid": 2, "ts": 0.0}]
    assert format_errors({"traceEvents": named + unnamed}) == ["pid 1 has no process_name",
                                                               "(pid, tid) (1, 2) has no thread_name"]
    negative = [{"ph": "X", "name": "a", "pid": 0, "tid": 0, "ts": 1.0, "dur": -0.5}]
    assert len(format_errors({"traceEvents": named + negative})) == 1


@pytest.mark.parametrize("which", ["bitnet", "matmul_w2_multicast.s", "matmul_w8.s", "softmax.s"])
def test_the_trace_keeps_the_format_rules(which):
    result = _bitnet() if which == "bitnet" else _example(which)
    trace = json.loads(json.dumps(report.chrome_trace(result)))    # as the file holds it
    assert format_errors(trace) == []


def test_pipelined_dmas_take_as_many_lanes_as_are_in_flight_at_once():
    """BitNet's loads overlap on their queue (a load's data lands after the next has started):
    each Legion's dma track spreads over lanes, named in turn, the fewest that keep them apart."""
    result = _bitnet()
    trace = report.chrome_trace(result)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    depths = []
    for legion in range(result.arch.legions):
        dma = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == legion
               and names[(legion, e["tid"])].split(" #")[0] == "dma"]
        edges = sorted((t, d) for e in dma for t, d in ((_ns(e["ts"]), 1), (_ns(e["ts"] + e["dur"]), -1)))
        depth = max(sum(d for _, d in edges[:k + 1]) for k in range(len(edges)))
        tids = sorted({e["tid"] for e in dma})
        assert len(tids) == depth
        assert [names[(legion, t)] for t in tids] == ["dma"] + [f"dma #{n}" for n in range(2, depth + 1)]
        depths.append(depth)
    assert max(depths) > 1
    # the queues of a Legion keep their order: dma lanes, then mat, then vec
    order = [names[(0, t)].split(" #")[0] for t in sorted(t for p, t in names if p == 0)]
    assert order == sorted(order, key=["dma", "mat", "vec"].index)


def test_a_span_of_no_length_takes_no_lane_of_its_own():
    """A wait (no length) while every lane is busy nests in the lowest lane's span; with a lane
    free, it takes that one."""
    assert report.lanes([(0, 4), (1, 3), (2, 2)]) == [0, 1, 0]
    assert report.lanes([(0, 4), (1, 3), (3, 3)]) == [0, 1, 1]


def test_lanes_are_the_lowest_free_and_as_few_as_the_overlap():
    # [0,4) [1,3) [3,6) [4,5) [5,9) [2,8): at 2 three spans are open
    spans = [(0, 4), (1, 3), (3, 6), (4, 5), (5, 9), (2, 8)]
    assert report.lanes(spans) == [0, 1, 1, 0, 0, 2]
    assert report.lanes([(0, 0), (0, 2), (2, 2), (2, 3)]) == [0, 0, 0, 0]


def test_every_track_of_the_regions_process_is_named():
    result = _bitnet()
    trace = report.chrome_trace(result)
    pid = result.arch.legions + 1
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "thread_name" and e["pid"] == pid}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]
    assert names[0] == "regions" and {e["tid"] for e in spans} <= set(names)
