"""The area model: every description's [area] table, its derived mm^2, and where it is shown."""
import dataclasses

import pytest
from click.testing import CliRunner

from isa import arch, cli

PARTS = {"PEs": {"um2_per_pe_w2"}, "scratchpads": {"um2_per_sram_kib"}, "vector": {"um2_per_vector_lane"},
         "accumulators": {"um2_per_acc_kib", "um2_per_adder"}, "NoC": {"um2_per_link_byte"}}


@pytest.mark.parametrize("name", arch.preset_names())
def test_every_preset_has_an_area_and_tops_per_mm2(name):
    a = arch.load(name)
    d = a.derived
    assert d.total_mm2 == pytest.approx(sum(d.area_mm2.values())) and d.total_mm2 > 0
    for m in a.modes:
        assert d.tops_per_mm2[m] == pytest.approx(d.peak_tops[m] / d.total_mm2)


@pytest.mark.parametrize("part, params", PARTS.items())
def test_each_area_figure_moves_only_its_own_part(part, params):
    tiny = arch.load("dlegion-tiny")
    doubled = dataclasses.replace(tiny, **{p: 2 * getattr(tiny, p) for p in params})
    before, after = tiny.derived.area_mm2, doubled.derived.area_mm2
    for k in before:
        assert after[k] == pytest.approx(2 * before[k] if k == part else before[k]), k
    assert before[part] > 0


def test_parts_scale_with_the_machine():
    small, big = arch.load("dlegion-8x8"), arch.load("dlegion-32x8")
    for k, v in small.derived.area_mm2.items():
        assert big.derived.area_mm2[k] == pytest.approx(4 * v), k
    # the scaled chip's peak per mm^2 is the design point's: both grow with the Legions
    assert big.derived.tops_per_mm2["w2"] == pytest.approx(small.derived.tops_per_mm2["w2"])


def test_a_pe_is_as_large_as_the_lowest_precision_mode_it_supports():
    adip, dip = arch.load("adip-64"), arch.load("dip-64")      # the same array, w8/w4/w2 or w8 only
    ratio = adip.derived.area_mm2["PEs"] / dip.derived.area_mm2["PEs"]
    assert ratio == pytest.approx(adip.um2_per_pe_w2 / dip.um2_per_pe_w8)
    # the adaptive PE is larger, but its w2 peak per mm^2 is higher than w8-only DiP's
    assert adip.derived.tops_per_mm2["w2"] > dip.derived.tops_per_mm2["w8"]


def test_a_one_legion_machine_has_no_noc():
    assert arch.load("ws-64").derived.area_mm2["NoC"] == 0
    assert arch.load("dlegion-8x8").derived.area_mm2["NoC"] > 0


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.split("[area]")[0], r"missing table \[area]"),
    (lambda t: t.replace("um2_per_sram_kib = 4049", ""), r"missing parameter\(s\) um2_per_sram_kib"),
    (lambda t: t.replace("um2_per_adder = 137", "um2_per_adder = -1"), "um2_per_adder must not be negative"),
    (lambda t: t.replace("um2_per_pe_w8 = 419", "um2_per_pe_w8 = 0"), "um2_per_pe_w8 must be a positive"),
])
def test_bad_area_tables_are_refused(tmp_path, edit, message):
    base = (arch.resources.files("isa.presets") / "dlegion-tiny.toml").read_text()
    (tmp_path / "m.toml").write_text(edit(base))
    with pytest.raises(arch.ArchError, match=message):
        arch.load(tmp_path / "m.toml")


def test_dlegion_arch_prints_mm2_and_tops_per_mm2():
    r = CliRunner().invoke(cli.arch_main, ["dlegion-8x8"])
    assert r.exit_code == 0, r.output
    d = arch.load("dlegion-8x8").derived
    assert f"area: {d.total_mm2:.2f} mm^2 at 45 nm" in r.output
    assert f"{d.tops_per_mm2['w2']:.3f} TOPS/mm^2" in r.output
