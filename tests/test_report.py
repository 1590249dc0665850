"""The run report: compulsory traffic, roofline, the per-matmul table, energy, regions, JSON."""
import dataclasses
import json
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import onnx
import pytest

from isa import arch, asm, encoding
from isa.instructions import TRANSCENDENTAL, family
from dlegion_cc.lower.graph import region_name
from dlegion_cc.pipeline import Options, compile_model
from runtime import report
from runtime.emulator import random_inputs, run

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
BITNET = ROOT / "models" / "bitnet_tiny_relu2.onnx"


def _run_text(text: str, source: Path):
    """Run program ``text`` as if it were the file ``source`` (for its data file)."""
    program = asm.parse(text, str(source))
    if program.data_file is not None:
        program.data = (source.parent / program.data_file).read_bytes()
    return run(program, arch.load(program.arch), random_inputs(program, 3))


def _with_regions(name: str, regions: dict[int, str]):
    """Example ``name`` with a ``.region`` line before the instructions at the given indices."""
    path = EXAMPLES / name
    lines, n = [], 0
    for line in path.read_text().splitlines():
        if line and line.split()[0] in asm.FAST_LINES:
            if n in regions:
                lines.append(f'.region "{regions[n]}"')
            n += 1
        lines.append(line)
    return _run_text("\n".join(lines) + "\n", path)


# --- compulsory traffic and the roofline ---------------------------------------------------------

def test_compulsory_traffic_and_roofline_of_a_compute_bound_program():
    result = _with_regions("matmul_w8.s", {})
    a, n = result.arch, report.summarize(result)
    # x i8[16,32] + w i8[32,24] read once, y i32[16,24] written once
    assert n["compulsory_dram_bytes"] == 16 * 32 + 32 * 24 + 16 * 24 * 4 == 2816
    # 16 x 32 x 24 MACs at 256 w8 MACs/cycle (2 Legions x 2 cores x 8x8) beat 2816 B at 64 B/cycle
    assert n["macs_by_mode"] == {"w8": 16 * 32 * 24}
    assert n["roofline_cycles"] == 48.0 == 16 * 32 * 24 / a.derived.macs_per_cycle["w8"]
    assert 2816 / a.derived.dram_bytes_per_cycle == 44.0
    assert n["roofline_bound"] == "compute"
    assert n["roofline_fraction"] == 48.0 / n["cycles"] and n["cycles"] >= 48


def test_roofline_of_a_dram_bound_program_counts_each_tensor_once():
    result = _with_regions("matmul_w2_multicast.s", {0: "x@w"})
    n = report.summarize(result)
    # x i8[32,64] 2048 B + w w2[64,32] 512 B (loaded as two halves) + y i32[32,32] 4096 B
    assert n["compulsory_dram_bytes"] == 2048 + 512 + 4096
    assert n["roofline_cycles"] == 6656 / 64 == 104.0 and n["roofline_bound"] == "dram"
    # One region over the whole program: the same bound, the same span as the run.
    [mm] = n["matmuls"]
    assert mm["nodes"] == ["x@w"] and mm["mode"] == "w2" and mm["macs"] == 2 * 32 * 64 * 16
    assert mm["legions"] == 2                   # each Legion runs the passes of its 16 columns
    assert mm["roofline_cycles"] == 104.0 and mm["cycles"] == n["cycles"]


def test_a_region_counts_only_its_own_loads_and_stores():
    result = _with_regions("matmul_w2_multicast.s", {0: "loads", 3: "MatMul_0+Mul_1"})
    tl = result.timeline
    [mm] = report.summarize(result)["matmuls"]
    assert mm["region"] == "MatMul_0+Mul_1" and mm["nodes"] == ["MatMul_0", "Mul_1"]
    # the region runs two mm, a wait and the store of y i32[32,32]: 65536 w2 MACs at
    # 1024 MACs/cycle, 4096 B at 64 B/cycle
    assert mm["roofline_cycles"] == max(65536 / 1024, 4096 / 64) == 64.0
    assert mm["cycles"] == math.ceil(tl.done[3:7].max() - tl.start[3:7].min())
    assert mm["cycles"] < tl.cycles and mm["roofline_fraction"] == 64.0 / mm["cycles"]


def test_region_ranges_and_owners_follow_the_program_order():
    p = asm.parse('.arch a\nbarrier\n.region "a"\nbarrier\nbarrier\n.region "e"\n.region "b"\nbarrier\n'
                  '.region "end"\n')
    assert report.region_ranges(p) == [range(1, 3), range(3, 3), range(3, 4), range(4, 4)]
    assert report.region_of(p).tolist() == [-1, 0, 0, 2]


# --- energy --------------------------------------------------------------------------------------

def _energy_by_hand(a, n) -> float:
    pj = (sum(n["macs_by_mode"].get(m, 0) * getattr(a, f"pj_per_mac_{m}") for m in a.modes)
          + (n["dram_read_bytes"] + n["dram_write_bytes"]) * a.pj_per_dram_byte
          + (n["spad_bytes"] + n["psum_bytes"]) * a.pj_per_sram_byte
          + n["vector_ops"] * a.pj_per_vector_op)
    return pj * 1e-12 + a.static_watts * n["cycles"] / (a.clock_ghz * 1e9)


@pytest.mark.parametrize("name", ["matmul_w8.s", "matmul_w2_multicast.s", "softmax.s"])
def test_energy_is_the_sum_of_its_parts_with_the_preset_figures(name):
    result = _with_regions(name, {})
    n = report.summarize(result)
    assert n["energy_joules"] == pytest.approx(_energy_by_hand(result.arch, n), rel=1e-12)
    assert n["energy_joules"] == pytest.approx(sum(n["energy"].values()), rel=1e-12)
    assert n["average_watts"] == pytest.approx(n["energy_joules"] / n["time_s"], rel=1e-12)
    assert n["energy"]["static"] == pytest.approx(result.arch.static_watts * n["time_s"], rel=1e-12)


@pytest.mark.parametrize("param, parts", [
    ("pj_per_mac_w2", {"mac_w2"}), ("pj_per_dram_byte", {"dram"}),
    ("pj_per_sram_byte", {"scratchpad", "psum"}), ("static_watts", {"static"}),
])
def test_each_energy_figure_moves_only_its_own_parts(param, parts):
    result = _with_regions("matmul_w2_multicast.s", {})
    base = report.summarize(result)["energy"]
    doubled = dataclasses.replace(result.arch, **{param: 2 * getattr(result.arch, param)})
    moved = report.summarize(dataclasses.replace(result, arch=doubled))["energy"]
    for part in base:
        assert moved[part] == pytest.approx(2 * base[part] if part in parts else base[part], rel=1e-12)
    assert all(base[part] > 0 for part in parts)


def test_vector_lane_ops_count_a_transcendental_by_its_cycles():
    result = _with_regions("softmax.s", {})
    a, program = result.arch, result.program
    want = sum(i.rows * i.cols * (a.vector_transcendental_cycles if type(i) in TRANSCENDENTAL else 1)
               for i in program.instrs if family(type(i)) == "vector")
    # vrmax, vsub, vrsum one lane-op an element; vexp and vdiv four (vector_transcendental_cycles)
    assert result.timeline.counters["vector_ops"] == want == 8 * 32 * (3 + 2 * 4)
    assert report.summarize(result)["energy"]["vector"] == pytest.approx(want * a.pj_per_vector_op * 1e-12)


# --- a compiled BitNet model ---------------------------------------------------------------------

@lru_cache(maxsize=1)
def _bitnet():
    a = arch.load("dlegion-tiny")
    graph, program = compile_model(BITNET, Options(a, {"sequence": 6}, attention="fp32"))
    return graph, run(program, a, random_inputs(program, 0))


def test_every_quantized_matmul_of_bitnet_has_a_row_named_after_its_matmul():
    graph, result = _bitnet()
    rows = [r for r in report.summarize(result)["matmuls"] if r["mode"] != report.VECTOR_MODE]
    matmuls = [n.name for n in onnx.load(BITNET).graph.node if n.op_type == "MatMul"]
    # 7 BitLinear layers (q, k, v, o, gate, up, down) per decoder layer, 2 layers; Q/K/V and
    # gate/up each run as one fused matmul, whose row names all of its MatMuls
    assert len(rows) == 8 and sum(len(r["nodes"]) for r in rows) == 14
    assert [r["nodes"] for r in rows] == [n.name.split("+") for n in graph.nodes if n.op == "QMatMul"]
    assert all(name in matmuls and "_proj/MatMul" in name for r in rows for name in r["nodes"])
    assert {r["mode"] for r in rows} == {"w2"}
    assert sum(r["macs"] for r in rows) == result.timeline.counters["macs"]


def test_float_matmuls_have_rows_against_the_vector_lanes_peak():
    """QK^T and PV of both layers and the head run in fp32 on the vector lanes: a row each, with
    all their vmm products, at most the lanes' rate."""
    graph, result = _bitnet()
    rows = [r for r in report.summarize(result)["matmuls"] if r["mode"] == report.VECTOR_MODE]
    float_mms = [n.name for n in graph.nodes if n.op == "MatMul"]
    assert [r["region"] for r in rows] == float_mms and len(rows) == 5
    vmm = [i for i in result.program.instrs if i.MNEMONIC == "vmm"]
    assert sum(r["macs"] for r in rows) == sum(i.M * i.K * i.N for i in vmm)
    lanes = result.arch.vector_lanes * result.arch.legions
    assert all(r["macs"] / lanes <= r["roofline_cycles"] <= r["cycles"] for r in rows)


def test_bitnet_matmuls_take_at_least_their_roofline():
    graph, result = _bitnet()
    p = result.program
    qmm = {n.name: n for n in graph.nodes if n.op == "QMatMul"}
    ranges = report.regions_by_name(p)
    for r in report.summarize(result)["matmuls"]:
        if r["mode"] == report.VECTOR_MODE:
            continue
        k, n = qmm[r["region"]].attrs["weight"].shape
        mms = [p.instrs[j] for j in ranges[r["region"]] if p.instrs[j].MNEMONIC == "mm"]
        # dense weights: every streamed row (sequence 6, padded to whole blocks) meets all K x N
        assert r["macs"] == sum(i.M * i.K * i.N for i in mms) >= 6 * k * n
        assert sum(i.N for i in mms if i.accumulate == "set") >= n      # fused: laid out per Legion
        assert 0 < r["roofline_cycles"] <= r["cycles"] and r["roofline_fraction"] <= 1


def test_compiled_regions_survive_text_and_binary_round_trips():
    graph, result = _bitnet()
    p = result.program
    # a region per node that emitted work, in graph order by its last entry, none empty, from the
    # first instruction; a matmul's weights loaded during the nodes before make an earlier entry
    names = iter(region_name(n) for n in graph.nodes)
    last = {name: at for at, name in p.regions}
    assert all(name in names for name in sorted(last, key=last.get))
    assert p.regions[0][0] == 0 and all(report.region_ranges(p))
    assert asm.parse(asm.format_program(p)).regions == p.regions
    assert encoding.decode_program(encoding.encode_program(p)).regions == p.regions
    fused = [name for _, name in p.regions if "+" in name]
    assert fused and all(len(name.split("+")) <= 3 for name in fused)


def test_json_carries_the_report_keys():
    _, result = _bitnet()
    n = json.loads(json.dumps(report.summarize(result)))
    for key in ("cycles", "dram_read_bytes", "dram_write_bytes", "macs", "arch", "roofline_cycles",
                "compulsory_dram_bytes", "psum_bytes", "energy_joules", "average_watts", "matmuls"):
        assert key in n
    assert n["arch"] == "dlegion-tiny" and n["energy_joules"] > 0
    assert n["area_mm2"] == result.arch.derived.total_mm2
    assert n["achieved_tops_per_mm2"] == pytest.approx(n["achieved_tops"] / n["area_mm2"])
    for row in n["matmuls"]:
        assert {"nodes", "mode", "macs", "cycles", "roofline_cycles"} <= set(row)
        assert isinstance(row["cycles"], int) and isinstance(row["macs"], int)


def test_chrome_trace_names_the_region_of_each_instruction():
    _, result = _bitnet()
    p, trace = result.program, report.chrome_trace(result)
    owner = report.region_of(p)
    first_task = {}                  # the program runs expanded: one task per Legion of a span
    for t, k in enumerate(p.origin or range(len(p.instrs))):
        first_task.setdefault(k, t)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] <= result.arch.legions]
    assert spans and all(e["args"]["region"] == p.regions[owner[first_task[int(e["args"]["line"].split()[-1])]]][1]
                         for e in spans)
    track = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == result.arch.legions + 1]
    named = [name for (_, name), members in zip(p.regions, report.region_ranges(p)) if members]
    assert [e["name"] for e in track] == named


def test_the_printed_report_shows_roofline_energy_and_the_matmul_table():
    from rich.console import Console
    _, result = _bitnet()
    console = Console(record=True, width=200)
    report.print_report(report.summarize(result), console)
    text = console.export_text()
    assert "roofline:" in text and "per run, average power" in text and " mm^2 at 45 nm; " in text
    assert "model.layers.1.mlp.down_proj/MatMul_233" in text
    assert np.isfinite(report.summarize(result)["tops_per_watt"])
    # Each table's title is a line of its own, not wrapped to its columns' width.
    lines = text.splitlines()
    assert any(l.startswith("instructions: ") and l.endswith(" in the program, run as one task per Legion of a span")
               for l in lines), text


def test_a_matmul_narrower_than_the_legions_is_named_with_the_legions_it_ran_on(tmp_path):
    """8 output columns are one array-wide tile on dlegion-tiny: one of its two Legions runs it,
    which the report's row and the sweep's ``narrow_matmuls`` say."""
    from onnx import TensorProto as TP, helper
    from dlegion_cc.dse_measure import measure
    node = helper.make_node("MatMulInteger", ["a", "b"], ["y"], name="narrow")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TP.INT8, [16, 32]),
                                        helper.make_tensor_value_info("b", TP.INT8, [32, 8])],
                          [helper.make_tensor_value_info("y", TP.INT32, [16, 8])])
    path = tmp_path / "narrow.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), path)
    tiny = arch.load("dlegion-tiny")
    _, program = compile_model(path, Options(tiny))
    result = run(program, tiny, random_inputs(program))
    [mm] = report.summarize(result)["matmuls"]
    assert mm["nodes"] == ["narrow"] and mm["legions"] == 1
    assert measure(program, tiny)["narrow_matmuls"] == [{"region": "narrow", "legions": 1}]
