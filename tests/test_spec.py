"""grammar.lark and SPEC.md agree with the instruction table, and the grammar is clean LALR."""
from __future__ import annotations

import re

import pytest

from isa import gen
from isa.instructions import INSTRUCTIONS


def test_generated_files_are_up_to_date():
    assert gen.stale() == [], "run `python -m isa.gen`"
    assert gen.main(["--check"]) == 0


def test_grammar_has_no_lalr_conflicts():
    assert gen.lalr_conflicts(gen.GRAMMAR.read_text()) == []


def test_conflicts_are_detected():
    assert gen.lalr_conflicts('start: e\ne: e "+" e | "1"\n') != []
    assert gen.lalr_conflicts('start: a | b\na: "x"\nb: "x"\n') != []


def test_one_grammar_rule_and_one_spec_section_per_class():
    grammar, spec = gen.GRAMMAR.read_text(), gen.SPEC.read_text()
    rules = re.findall(r"^(\w+): OP_", grammar, re.M)
    assert rules == [c.__name__.lower() for c in INSTRUCTIONS]
    sections = re.findall(r"^### `([^`]+)`", spec, re.M)
    assert sections == [c.MNEMONIC for c in INSTRUCTIONS]
    for cls in INSTRUCTIONS:
        assert f"opcode `0x{cls.OPCODE:02x}`" in spec
        assert all(f"| `{f.name}` |" in spec for f in cls.fields())


@pytest.fixture
def copies(tmp_path, monkeypatch):
    """gen working on copies of the two generated files."""
    for name in ("GRAMMAR", "SPEC"):
        path = getattr(gen, name)
        copy = tmp_path / path.name
        copy.write_text(path.read_text())
        monkeypatch.setattr(gen, name, copy)
    return tmp_path


def test_check_fails_on_a_stale_file_and_regeneration_fixes_it(copies, capsys):
    grammar = gen.GRAMMAR.read_text()
    gen.GRAMMAR.write_text(re.sub(r"^vadd: .*$", "vadd: OP_VADD LEGION", grammar, flags=re.M))
    spec = gen.SPEC.read_text()
    gen.SPEC.write_text(spec.replace("opcode `0x80`", "opcode `0x99`"))
    assert gen.stale() == [gen.GRAMMAR, gen.SPEC]
    assert gen.main(["--check"]) == 1
    assert "grammar.lark is stale" in capsys.readouterr().err
    assert gen.main([]) == 0
    assert gen.stale() == [] and gen.GRAMMAR.read_text() == grammar and gen.SPEC.read_text() == spec


def test_hand_written_parts_are_kept(copies):
    gen.SPEC.write_text("intro\n" + gen.SPEC.read_text() + "outro\n")
    gen.main([])
    text = gen.SPEC.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n")


def test_missing_markers_are_an_error(copies):
    gen.GRAMMAR.write_text("start: INT\n")
    with pytest.raises(ValueError, match="markers"):
        gen.main([])
