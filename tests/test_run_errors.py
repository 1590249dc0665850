"""dlegion-run on bad input: one line naming the culprit, exit status 2, nothing written."""
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from isa import asm, files
from runtime import cli

EXAMPLES = Path(__file__).parent.parent / "examples"
TINY = (Path(asm.__file__).parent / "presets" / "dlegion-tiny.toml").read_text()


@pytest.fixture
def run(monkeypatch, capsys, tmp_path):
    """dlegion-run in this process, from ``tmp_path``: (exit status, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)

    def dlegion_run(*args):
        monkeypatch.setattr(sys, "argv", ["dlegion-run", *map(str, args)])
        try:
            cli.main()
            code = 0
        except SystemExit as e:
            code = e.code or 0
        out, err = capsys.readouterr()
        return code, out, err
    return dlegion_run


@pytest.fixture
def prog(tmp_path):
    for name in ("softmax.s", "matmul_w8.s", "matmul_w8.s.data"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    return tmp_path / "softmax.s"


def one_error(err: str, *parts: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlegion-run: error: "), err
    for part in parts:
        assert part in lines[0], err


def test_a_truncated_npz_is_named(run, prog, tmp_path):
    np.savez(tmp_path / "in.npz", x=np.ones((8, 32), np.float32))
    whole = (tmp_path / "in.npz").read_bytes()
    for cut in (10, len(whole) // 2, len(whole) - 10):
        (tmp_path / "trunc.npz").write_bytes(whole[:cut])
        code, _, err = run(prog, "--inputs", "trunc.npz")
        assert code == 2
        one_error(err, "trunc.npz: cannot read inputs")


@pytest.mark.parametrize("args, culprit", [
    (["--seed", "-5"], "--seed"),
    (["--tolerance", "-1"], "--tolerance"),
    (["--check-all"], "--check-all needs --check"),
    (["--reference", "exact"], "--reference needs --check"),
    (["--tolerance", "0.1"], "--tolerance needs --check"),
    (["--check", "m.onnx", "--tolerance", "nan"], "'--tolerance': nan is not a finite number"),
    (["--check", "m.onnx", "--tolerance", "inf"], "'--tolerance': inf is not a finite number"),
    (["--inputs", "in.npz", "--seed", "3"], "--seed has no effect with --inputs"),
    (["--inputs", "in.npz", "--seed", "0"], "--seed has no effect with --inputs"),     # given, if the default
])
def test_bad_options_are_rejected(run, prog, args, culprit):
    code, _, err = run(prog, *args)
    assert code == 2
    one_error(err, culprit)


def test_a_bad_machine_file_is_named_by_its_path(run, prog, tmp_path):
    (tmp_path / "my.toml").write_text(TINY.replace("legions = 2", "legions = 2.5"))
    code, _, err = run(prog, "--arch", "my.toml")
    assert code == 2
    one_error(err, "my.toml: legions must be a positive integer, not 2.5")


def test_a_binary_cut_at_an_instruction_boundary_is_rejected(run, prog, tmp_path):
    p = asm.load(prog)
    asm.save(p, tmp_path / "good.bin", binary=True)
    whole = (tmp_path / "good.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(whole[:len(whole) - 5 * 40])
    code, _, err = run("cut.bin", "--out", "o.npz")
    assert code == 2
    one_error(err, "cut.bin: truncated: the header says 7 instructions, the file holds 2")
    assert not (tmp_path / "o.npz").exists()


def test_an_output_no_instruction_writes_is_a_warning(run, prog, tmp_path):
    prog.write_text("\n".join(l for l in prog.read_text().splitlines() if not l.startswith("dma.st")))
    code, _, err = run(prog, "--out", "o.npz")
    assert code == 0
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlegion-run: warning: ")
    assert "softmax.s: no instruction writes output tensor(s) y;" in lines[0]
    code, _, err = run(EXAMPLES / "softmax.s")
    assert code == 0 and err == ""


@pytest.mark.parametrize("args, culprit", [
    (["softmax.s", "--out", "softmax.s"], "--out softmax.s would overwrite the program"),
    (["matmul_w8.s", "--json", "matmul_w8.s.data"], "would overwrite the program's data file"),
    (["softmax.s", "--inputs", "in.npz", "--out", "in.npz"], "would overwrite the --inputs file"),
    (["softmax.s", "--check", "m.onnx", "--trace", "./m.onnx"], "would overwrite the --check model"),
    (["softmax.s", "--out", "o.npz", "--json", "o.npz"], "--json o.npz is also the --out file"),
])
def test_an_output_may_not_replace_an_input_or_another_output(run, prog, tmp_path, args, culprit):
    np.savez(tmp_path / "in.npz", x=np.ones((8, 32), np.float32))
    (tmp_path / "m.onnx").write_bytes(b"model")
    (tmp_path / "o.npz").write_bytes(b"old")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code, out, err = run(*args)
    assert code == 2 and out == ""
    one_error(err, culprit)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_an_unwritable_output_is_found_before_the_run(run, prog, tmp_path):
    # the program faults when run: the error about --json shows that nothing ran
    prog.write_text(prog.read_text().replace("vec[0,32,1] rows=8 cols=32 wait=L0.dma>=1",
                                             "vec[4000,32,1] rows=8 cols=32 wait=L0.dma>=1"))
    (tmp_path / "file").write_text("not a folder")
    code, _, err = run(prog, "--out", "o.npz", "--json", "file/j.json")
    assert code == 2
    one_error(err, "file")
    assert "vrmax" not in err
    assert not (tmp_path / "o.npz").exists()


def test_the_outputs_of_a_run_are_written_all_or_none(run, prog, tmp_path, monkeypatch):
    (tmp_path / "o.npz").write_bytes(b"old")
    real = files.os.replace

    def replace(src, dst):
        if Path(dst).name == "j.json":
            raise PermissionError(13, "permission denied", str(dst))
        real(src, dst)
    monkeypatch.setattr(files.os, "replace", replace)
    code, _, err = run(prog, "--out", "o.npz", "--json", "j.json")
    assert code == 2
    one_error(err, "j.json")
    assert (tmp_path / "o.npz").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["matmul_w8.s", "matmul_w8.s.data", "o.npz",
                                                          "softmax.s"]


def test_a_check_error_names_the_model_once(run, prog, tmp_path):
    node = helper.make_node("Softmax", ["z"], ["y"], axis=1)
    g = helper.make_graph([node], "det", [helper.make_tensor_value_info("z", TensorProto.FLOAT, [8, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 32])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "det.onnx")
    code, _, err = run(prog, "--check", "det.onnx")
    assert code == 2
    one_error(err, "det.onnx: the model takes input(s) z, which the program has not (program inputs: x)")
    assert err.count("det.onnx") == 1


def test_an_unknown_arch_names_the_directive(run, prog):
    prog.write_text(prog.read_text().replace(".arch dlegion-tiny", ".arch dlegion-9x9"))
    code, _, err = run(prog)
    assert code == 2
    one_error(err, "softmax.s:3:7: unknown architecture 'dlegion-9x9'")


def test_a_machine_file_is_relative_to_the_program(run, prog, tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "m.toml").write_text(TINY)
    (tmp_path / "sub" / "p.s").write_text(prog.read_text().replace(".arch dlegion-tiny", '.arch "m.toml"'))
    code, _, err = run("sub/p.s")
    assert code == 0, err


def test_help_says_a_faulting_program_exits_2(run):
    code, out, _ = run("--help")
    assert code == 0 and "faults" in " ".join(out.split())


@pytest.mark.parametrize("old, new, culprit", [
    # past the host's memory (numpy's MemoryError): random inputs, then zeroed DRAM
    ('.tensor x f32[8,32] input "x"', '.tensor x f32[1099511627776,1048576] input "x"',
     "tensor 'x' f32[1099511627776,1048576] (4,611,686,018,427,387,904 bytes) is too large"),
    ('.tensor x f32[8,32] input "x"', '.tensor x i64[1099511627776,524288] input "input_ids"',
     "tensor 'x' i64[1099511627776,524288]"),
    ('.tensor y f32[8,32] output "y"', '.tensor y f32[8,32] output "y"\n.tensor t f32[1099511627776,1048576] scratch',
     "tensor 't' f32[1099511627776,1048576]"),
    # past what numpy can index (its ValueError)
    ('.tensor y f32[8,32] output "y"', '.tensor y f32[8,32] output "y"\n.tensor t u8[1000000000000000000000] scratch',
     "tensor 't' u8[1000000000000000000000]"),
])
def test_a_tensor_too_large_for_the_host_is_named(run, prog, tmp_path, old, new, culprit):
    prog.write_text(prog.read_text().replace(old, new))
    asm.save(asm.load(prog), tmp_path / "big.bin", binary=True)
    for program in (prog, "big.bin"):
        code, _, err = run(program, "--out", "o.npz")
        assert code == 2
        one_error(err, f"{program}: ", culprit, "too large for the emulator's host memory")
        assert not (tmp_path / "o.npz").exists()


def test_a_long_line_is_cut_around_the_error(run, tmp_path):
    (tmp_path / "longline.s").write_text(".arch dlegion-tiny\n" + "x" * 2_000_000 + "\n")
    code, _, err = run("longline.s")
    assert code == 2 and len(err) < 500
    assert err.startswith("dlegion-run: error: longline.s:2:1: unknown mnemonic 'xxx")
    vexp = "vexp L0 vec[0,32,1] vec[0,32,1] rows=8 cols=32"
    (tmp_path / "deep.s").write_text(f'.arch dlegion-tiny\n.tensor x f32[8,32] input "x"\n{vexp}'
                                     + " " * 5000 + "junk ;" + "c" * 5000)
    code, _, err = run("deep.s")
    head, src, caret = err.splitlines()
    assert code == 2 and "deep.s:3:5047: unexpected 'junk'" in head
    assert src.startswith("  ...") and src.endswith("...") and len(src) < 140
    assert src[len(caret) - 1:].startswith("junk")               # the caret still under the culprit


def test_a_long_name_in_a_message_is_cut(run, prog):
    code, _, err = run(prog, "--arch", "q" * 100_000)
    assert code == 2 and len(err) < 500
    one_error(err, "unknown architecture 'qqq", " ... ", "tiny")     # both ends: the culprit, the choices


def test_inputs_the_program_does_not_take_are_named(run, prog, tmp_path):
    np.savez(tmp_path / "in.npz", x=np.ones((8, 32), np.float32), foo=np.ones(3), bar=np.ones(1))
    code, _, err = run(prog, "--inputs", "in.npz", "--out", "o.npz")
    assert code == 2
    one_error(err, "in.npz: the program has no input(s) bar, foo (its inputs: x)")
    for value, culprit in [(np.ones((8, 32)), "input 'x' wants float32 (f32), got float64"),
                           (np.ones((8, 16), np.float32), "input 'x' wants shape [8, 32], got [8, 16]")]:
        np.savez(tmp_path / "in.npz", x=value)
        code, _, err = run(prog, "--inputs", "in.npz", "--out", "o.npz")
        assert code == 2
        one_error(err, "softmax.s: ", culprit)
    assert not (tmp_path / "o.npz").exists()


def test_an_output_of_another_shape_than_the_models_is_bad_input(run, prog, tmp_path):
    node = helper.make_node("Reshape", ["x", "s"], ["y"])
    shape = helper.make_tensor("s", TensorProto.INT64, [2], [4, 64])
    g = helper.make_graph([node], "other", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])], [shape])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "other.onnx")
    code, out, err = run(prog, "--check", "other.onnx", "--out", "o.npz")
    assert code == 2 and "MISMATCH" not in out
    one_error(err, "other.onnx: output 'y': the program's shape [8, 32] is not the model's [4, 64]")
    assert not (tmp_path / "o.npz").exists()


@pytest.mark.parametrize("option", ["--out", "--json", "--trace", "--inputs", "--check", "--arch"])
def test_an_empty_path_is_refused(run, prog, tmp_path, option):
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = run(prog, option, "")
    assert code == 2
    one_error(err, f"'{option}': an empty path names no file")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("span, arch, culprit", [
    (2, "ws-32", "softmax.s:10: vexp: span: L1 does not exist (ws-32 has 1 Legion: L0)"),
    (4, "dlegion-tiny", "softmax.s:10: vexp: span: L2 to L3 do not exist (dlegion-tiny has 2 Legions: L0 to L1)"),
])
def test_a_span_past_the_machine_names_the_missing_legions(run, prog, span, arch, culprit):
    vexp = "vexp L0 vec[0,32,1] vec[0,32,1] rows=8 cols=32"
    prog.write_text(prog.read_text().replace(vexp, f"{vexp} span={span}"))
    code, _, err = run(prog, "--arch", arch)
    assert code == 2
    one_error(err, culprit)


def test_a_byte_order_mark_is_accepted(run, prog):
    prog.write_bytes(b"\xef\xbb\xbf" + prog.read_bytes())
    code, _, err = run(prog, "--out", "o.npz")
    assert code == 0, err


@pytest.mark.parametrize("kind, name", [("input", "x"), ("output", "y")])
def test_a_graph_name_bound_twice_names_both_tensors(run, prog, tmp_path, kind, name):
    text = prog.read_text()
    decl = f'.tensor {name} f32[8,32] {kind} "{name}"'
    prog.write_text(text.replace(decl, f"{decl}\n{decl.replace(name, name + '2', 1)}"))
    code, _, err = run("softmax.s")
    assert code == 2
    one_error(err, f"softmax.s: tensors '{name}' and '{name}2' are both {kind} tensors bound to graph name '{name}'")
    prog.write_text(text)
    p = asm.load(prog)
    p.tensors.append(dataclasses.replace(p.tensors[0 if kind == "input" else 1], name=f"{name}2"))
    (tmp_path / "dup.bin").write_bytes(_unchecked_binary(p))
    code, _, err = run("dup.bin")
    assert code == 2
    one_error(err, f"dup.bin: tensors '{name}' and '{name}2' are both {kind} tensors bound to graph name '{name}'")


def _unchecked_binary(p) -> bytes:
    """``p`` as a binary, written past the encoder's checks (as another tool might write it)."""
    from isa import encoding
    head = json.dumps(encoding.header(p)).encode()
    out = encoding.PREFIX.pack(encoding.MAGIC, encoding.VERSION, 0, len(head)) + head
    return out + bytes(-len(out) % encoding.WORD_BYTES) + b"".join(map(encoding.encode_instr, p.instrs))


def test_an_input_may_also_be_an_output(run, prog):
    """A graph that returns an input binds its name to an input and an output tensor."""
    prog.write_text(prog.read_text().replace('output "y"', 'output "x"'))
    code, _, err = run(prog, "--out", "o.npz")
    assert code == 0, err
