"""dlegion-as, dlegion-dis and dlegion-arch on bad input: one line `NAME: error: ...` naming the
culprit, exit status 2, nothing written."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from isa import arch, asm, cli, encoding

EXAMPLES = Path(__file__).parent.parent / "examples"
TINY = (Path(arch.__file__).parent / "presets" / "dlegion-tiny.toml").read_text()
WORD = encoding.WORD_BYTES


def run(main, *args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_error(result, name: str, *parts: str) -> None:
    lines = result.stderr.splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"{name}: error: "), result.stderr
    for part in parts:
        assert part in lines[0], result.stderr


@pytest.fixture
def prog(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("softmax.s", "matmul_w8.s", "matmul_w8.s.data"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    return tmp_path / "softmax.s"


@pytest.mark.parametrize("old, new, message", [
    ("array = 8", 'array = "big"', 'array must be a positive integer, not "big"'),
    ("legions = 2", "legions = 2.5", "legions must be a positive integer, not 2.5"),
    ("clock_ghz = 1.0", "clock_ghz = -1", "clock_ghz must be a positive number, not -1"),
    ("dram_gbps = 64.0", "dram_gbps = -64", "dram_gbps must be a positive number, not -64"),
    ("dram_latency_cycles = 20", "dram_latency_cycles = -20", "dram_latency_cycles must not be negative"),
    ("multicast = true", 'multicast = "yes"', 'multicast must be true or false, not "yes"'),
    ("noc_link_gbps = 32.0", "noc_link_gbps = inf", "noc_link_gbps must be a positive number, not inf"),
    ('modes = ["w8", "w4", "w2"]', 'modes = "w8"', 'modes must be a list of strings, not "w8"'),
    ("[chip]", "[published]\npeak_tops = { w8 = 0 }\n[chip]", "published_peak_tops must be a table of positive"),
])
def test_a_bad_machine_value_names_the_file(prog, old, new, message):
    assert old in TINY
    Path("my.toml").write_text(TINY.replace(old, new))
    one_error(run(cli.arch_main, "my.toml"), "dlegion-arch", f"my.toml: {message}")
    Path("sub").mkdir()
    shutil.copy("my.toml", "sub/my.toml")
    with pytest.raises(arch.ArchError, match="^sub/my.toml: "):      # the path, not the name inside
        arch.load("my.toml", base=Path("sub"))


def test_the_presets_are_valid():
    for name in arch.preset_names():
        assert arch.load(name).name == name


def test_a_binary_cut_at_a_word_boundary_is_rejected(prog):
    assert run(cli.assemble_main, prog, "-o", "good.bin").exit_code == 0
    whole = Path("good.bin").read_bytes()
    Path("cut.bin").write_bytes(whole[:len(whole) - 5 * WORD])
    one_error(run(cli.disassemble_main, "cut.bin"), "dlegion-dis",
              "cut.bin: truncated: the header says 7 instructions, the file holds 2 instructions")
    Path("long.bin").write_bytes(whole + whole[-WORD:])
    one_error(run(cli.disassemble_main, "long.bin"), "dlegion-dis", "long.bin: corrupt: the header says 7")
    for words in range(7):
        with pytest.raises(asm.ProgramError, match="truncated"):
            encoding.decode_program(whole[:len(whole) - (7 - words) * WORD], "cut.bin")


@pytest.mark.parametrize("main, name, args, message", [
    (cli.assemble_main, "dlegion-as", ["softmax.s", "-o", "softmax.s"], "-o softmax.s would overwrite the program"),
    (cli.assemble_main, "dlegion-as", ["matmul_w8.s", "-o", "./matmul_w8.s.data"],
     "would overwrite the program's data file"),
    (cli.assemble_main, "dlegion-as", ["good.bin"], "the default output good.bin would overwrite the program"),
    (cli.disassemble_main, "dlegion-dis", ["good.bin", "-o", "good.bin"], "-o good.bin would overwrite the program"),
])
def test_an_output_may_not_replace_an_input(prog, main, name, args, message):
    assert run(cli.assemble_main, prog, "-o", "good.bin").exit_code == 0
    before = {p.name: p.read_bytes() for p in Path().iterdir()}
    one_error(run(main, *args), name, message)
    assert {p.name: p.read_bytes() for p in Path().iterdir()} == before


def test_an_unwritable_output_is_an_error(prog):
    Path("file").write_text("not a folder")
    one_error(run(cli.assemble_main, prog, "-o", "file/p.bin"), "dlegion-as", "file")


def test_an_unknown_arch_is_an_error_with_its_location(prog):
    prog.write_text(prog.read_text().replace(".arch dlegion-tiny", ".arch dlegion-9x9"))
    one_error(run(cli.assemble_main, prog, "-o", "p.bin"), "dlegion-as", "softmax.s:3:7: unknown architecture")
    prog.write_text(prog.read_text().replace(".arch dlegion-9x9", '.arch "machines/m.toml"'))
    one_error(run(cli.assemble_main, prog, "-o", "p.bin"), "dlegion-as", "softmax.s:3:7: ",
              "m.toml: cannot read architecture file")
    assert not Path("p.bin").exists()
    Path("machines").mkdir()
    Path("machines/m.toml").write_text(TINY)
    Path("elsewhere").mkdir()
    assert run(cli.assemble_main, prog, "-o", "elsewhere/p.bin").exit_code == 0


def test_errors_carry_the_script_name(tmp_path):
    (tmp_path / "bad.s").write_text(".arch a\nbarrier\nvadd L0 vec[0,1,1]\n")
    result = run(cli.assemble_main, tmp_path / "bad.s", "-o", tmp_path / "bad.bin")
    lines = result.stderr.splitlines()
    assert result.exit_code == 2 and lines[0].startswith("dlegion-as: error: ") and "bad.s:3:19: " in lines[0]
    assert len(lines) == 3 and lines[2].strip() == "^"           # the source line and a caret, no usage
    one_error(run(cli.arch_main, "nope"), "dlegion-arch", "unknown architecture 'nope'")
    one_error(run(cli.disassemble_main, tmp_path / "nope.bin"), "dlegion-dis", "nope.bin: cannot read")


@pytest.mark.parametrize("name, main", [("dlegion-as", "assemble_main"), ("dlegion-dis", "disassemble_main"),
                                        ("dlegion-arch", "arch_main")])
def test_a_usage_error_is_one_line_naming_the_script(name, main):
    code = f"import sys; sys.argv = [{name!r}, '--no-such-option']; from isa.cli import {main}; {main}()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{name}: error: ") and "--help" in lines[0], r.stderr


@pytest.mark.parametrize("main, name", [(cli.assemble_main, "dlegion-as"), (cli.disassemble_main, "dlegion-dis")])
def test_an_empty_output_path_is_refused(prog, main, name):
    assert run(cli.assemble_main, prog, "-o", "good.bin").exit_code == 0
    before = {p.name: p.read_bytes() for p in Path().iterdir()}
    one_error(run(main, "good.bin", "-o", ""), name, "'-o' / '--output': an empty path names no file")
    assert {p.name: p.read_bytes() for p in Path().iterdir()} == before


def test_a_byte_order_mark_is_skipped(prog):
    Path("bom.s").write_bytes(b"\xef\xbb\xbf" + prog.read_bytes())
    assert run(cli.assemble_main, "bom.s", "-o", "bom.bin").exit_code == 0
    assert asm.load("bom.bin") == asm.load(prog)


def test_a_graph_name_bound_twice_is_rejected(prog):
    prog.write_text(prog.read_text().replace('.tensor y f32[8,32] output "y"',
                                             '.tensor y f32[8,32] output "y"\n.tensor z f32[8,32] output "y"'))
    one_error(run(cli.assemble_main, "softmax.s", "-o", "p.bin"), "dlegion-as",
              "softmax.s: tensors 'y' and 'z' are both output tensors bound to graph name 'y'")
    assert not Path("p.bin").exists()


def test_a_long_token_is_quoted_by_its_start(prog):
    prog.write_text(prog.read_text().replace("@x[0,32]", "@" + "q" * 100_000 + "[0,32]"))
    result = run(cli.assemble_main, prog, "-o", "p.bin")
    head, src, _ = result.stderr.splitlines()
    assert result.exit_code == 2 and len(result.stderr) < 400
    assert f"unknown tensor '{'q' * 40}...' (declared: x, y)" in head and src.endswith("...")


def test_the_assembler_refuses_what_the_run_would(prog):
    """A Legion the machine lacks is found by dlegion-as, not first by dlegion-run."""
    text = prog.read_text()
    assert "vexp L0 " in text
    Path("bad.s").write_text(text.replace("vexp L0 ", "vexp L7 "))
    one_error(run(cli.assemble_main, "bad.s", "-o", "bad.bin"), "dlegion-as", "bad.s:", "L7", "do", "exist")
    assert not Path("bad.bin").exists()
