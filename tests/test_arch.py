"""The architecture description: presets, derived figures against the published ones, bad files."""
import dataclasses
import re

import pytest

from isa import arch


@pytest.mark.parametrize("name", arch.preset_names())
def test_every_preset_loads_and_derives(name):
    a = arch.load(name)
    d = a.derived
    assert set(d.peak_tops) == set(a.modes)
    for m in a.modes:
        assert d.macs_per_cycle[m] == a.legions * a.cores * a.array ** 2 * arch.MODE_TILES[m]


def test_design_point_peak_and_the_published_one():
    a = arch.load("dlegion-8x8")
    assert a.derived.peak_tops["w2"] == pytest.approx(131.072)
    assert a.published_peak_tops["w2"] == 135.68
    assert a.derived.peak_tops["w2"] / a.published_peak_tops["w2"] == pytest.approx(0.966, abs=1e-3)


def test_adip_core_matches_its_paper_in_every_mode():
    a = arch.load("adip-64")
    for mode, tops in a.published_peak_tops.items():
        assert a.derived.peak_tops[mode] == pytest.approx(tops, rel=1e-4)


def test_tpuv4i_and_dram_bytes_per_cycle_follow_the_clock():
    a = arch.load("tpuv4i")
    assert a.derived.peak_tops["w8"] == pytest.approx(138, rel=0.01)
    assert a.derived.dram_bytes_per_cycle == pytest.approx(614 / 1.05)


def test_pass_overhead_by_dataflow():
    assert arch.load("dip-64").derived.pass_overhead == 64
    assert arch.load("ws-64").derived.pass_overhead == 128


def _toml(tmp_path, text):
    base = (arch.resources.files("isa.presets") / "dlegion-tiny.toml").read_text()
    path = tmp_path / "m.toml"
    path.write_text(text(base))
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("cores = 2", "cores = 2\nwarp = 3"), "unknown parameter(s) warp"),
    (lambda t: t.replace("vector_lanes = 16\n", ""), "missing parameter(s) vector_lanes"),
    (lambda t: t.replace('modes = ["w8", "w4", "w2"]', 'modes = ["w3"]'), "modes must be"),
    (lambda t: t.replace('dataflow = "dip"', 'dataflow = "os"'), "dataflow must be"),
    (lambda t: t.replace("legions = 2", "legions = 65"), "at most 64 Legions"),
    # a scratchpad beyond what an instruction's address field reaches
    (lambda t: re.sub(r"act_kib = \d+", "act_kib = 65537", t), "act_kib holds more than the 64 Mi"),
    (lambda t: t + "\n[[", "m.toml"),
    # the energy figures are parameters like any other: no silent defaults
    (lambda t: t.replace("pj_per_dram_byte = 243.75", ""), "missing parameter(s) pj_per_dram_byte"),
    (lambda t: t.split("[energy]")[0], r"missing table \[energy]"),
    (lambda t: t.replace("static_watts = 0.008", "static_watts = -1.0"),
     "static_watts must not be negative"),
])
def test_bad_descriptions_name_the_problem(tmp_path, edit, message):
    with pytest.raises(arch.ArchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        arch.load(_toml(tmp_path, edit))


def test_unknown_preset_lists_the_presets():
    with pytest.raises(arch.ArchError, match="presets: adip-64"):
        arch.load("dlegion-9x9")


def test_a_file_arch_is_the_same_as_its_preset(tmp_path):
    path = _toml(tmp_path, lambda t: t)
    assert dataclasses.replace(arch.load(path), name="x") == dataclasses.replace(arch.load("dlegion-tiny"), name="x")


def test_energy_figures_per_mode_are_derived_for_the_modes_the_machine_has():
    tiny, ws = arch.load("dlegion-tiny"), arch.load("ws-32")
    assert tiny.derived.pj_per_mac == {"w8": tiny.pj_per_mac_w8, "w4": tiny.pj_per_mac_w4,
                                       "w2": tiny.pj_per_mac_w2}
    assert ws.derived.pj_per_mac == {"w8": ws.pj_per_mac_w8}
    # narrower weights never cost more energy per MAC than wider ones
    assert tiny.pj_per_mac_w2 <= tiny.pj_per_mac_w4 <= tiny.pj_per_mac_w8
