"""Whole models in bounded memory: weights are read from their external data when needed, the
constants stream to the data file as nodes are lowered, and progress shows on a terminal."""
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from dlegion_cc import cli
from dlegion_cc.importer import import_model
from dlegion_cc.ir import Mapped
from dlegion_cc.pipeline import Options, compile_model
from isa import arch
from isa.progress import Progress

ROOT = Path(__file__).parent.parent
TINY = arch.load("dlegion-tiny")
MODEL = ROOT / "models" / "bitnet_tiny_relu2.onnx"


def _external(name: str, dims: list[int], location: str, offset: int) -> tuple[TensorProto, int]:
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=dims, data_location=TensorProto.EXTERNAL)
    length = 4 * int(np.prod(dims))
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t, length


def _embedding(path: Path, vocab: int, width: int, seq: int = 2) -> int:
    """An embedding lookup whose table lies in a sparse file of zeros (no disk, no time): the
    model's size in bytes."""
    table, size = _external("table", [vocab, width], path.name + ".data", 0)
    graph = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["x"], name="embed")], "big",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, seq])],
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, width])], [table])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    with open(f"{path}.data", "wb") as f:
        f.truncate(size)
    return size


# The peak is the process's own high-water mark (VmHWM): ru_maxrss would also count the parent
# it was forked from, which Linux carries across exec.
CHILD = """
import sys
from dlegion_cc.cli import main
sys.argv = ["dlegion-cc", *sys.argv[1:]]
try:
    main()
finally:
    hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
    print(int(hwm.split()[1]) * 1024, file=sys.stdout)
"""


def _compile_in_child(*args) -> tuple[subprocess.CompletedProcess, int]:
    """dlegion-cc in a process of its own: its result and its peak resident memory in bytes."""
    r = subprocess.run([sys.executable, "-c", CHILD, *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    return r, int(r.stdout.split()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak from Linux's /proc")
def test_a_model_over_2_gib_compiles_in_a_fraction_of_its_size(tmp_path):
    """Loaded whole, this model could not even be checked (protobuf's 2 GiB limit); here every
    step runs, the table passing to the (discarded) data file a piece at a time."""
    size = _embedding(tmp_path / "big.onnx", vocab=560_000, width=1024)
    assert size > 2 ** 31
    r, peak = _compile_in_child(tmp_path / "big.onnx", "-o", tmp_path / "big.ir", "--emit", "ir",
                                "--arch", "dlegion-tiny", "-q")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "= Gather(%table:const, %ids)" in (tmp_path / "big.ir").read_text()
    assert peak < size // 8, f"peak RSS {peak / 2 ** 20:.0f} MB for a {size / 2 ** 30:.2f} GiB model"


def test_large_weights_stay_in_their_file_until_read(tmp_path):
    path = tmp_path / "e.onnx"
    _embedding(path, vocab=300, width=64)
    with open(f"{path}.data", "r+b") as f:
        f.write(np.arange(300 * 64, dtype=np.float32).tobytes())
    graph = import_model(path)
    stored = graph.values["table"].stored
    assert isinstance(stored, Mapped) and stored.shape == (300, 64) and stored.file == str((tmp_path / "e.onnx.data").resolve())
    table = graph.const("table")
    assert not table.flags.writeable and table[299, 63] == 300 * 64 - 1
    assert [p.size for p in stored.pieces(4096 * 4)] == [4096] * 4 + [300 * 64 - 4 * 4096]


def test_a_tensor_past_the_end_of_its_file_is_named(tmp_path):
    path = tmp_path / "e.onnx"
    _embedding(path, vocab=300, width=64)
    with open(f"{path}.data", "r+b") as f:
        f.truncate(300 * 64 * 4 - 1)
    r, _ = _compile_in_child(path, "-o", tmp_path / "p.s", "-q")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("dlegion-cc: error: ") and "e.onnx.data" in r.stderr and "'table'" in r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "p.s").exists()


def test_the_streamed_data_file_is_what_an_in_memory_compile_keeps(tmp_path):
    r = cli_run(MODEL, "-o", tmp_path / "p.s", "--arch", "dlegion-tiny")
    assert r.exit_code == 0, r.output
    _, program = compile_model(MODEL, Options(TINY), "p.s.data")
    assert program.data is not None and (tmp_path / "p.s.data").read_bytes() == program.data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.s", "p.s.data"]


def test_a_compile_that_fails_while_lowering_leaves_nothing(tmp_path, monkeypatch):
    """Constants already streamed into the temporary data file go with it."""
    from dlegion_cc.lower import context

    def broken(low, node):
        raise ValueError("cannot lower this one")
    monkeypatch.setitem(context.LOWERINGS, ("dlegion", "RowKernel"), broken)
    (tmp_path / "out").mkdir()
    r = cli_run(MODEL, "-o", tmp_path / "out" / "p.s", "--arch", "dlegion-tiny")
    assert r.exit_code != 0 and "cannot lower this one" in str(r.exception)
    assert list((tmp_path / "out").iterdir()) == []


def cli_run(*args):
    from click.testing import CliRunner
    return CliRunner().invoke(cli.compile_command, [str(a) for a in args])


def test_progress_shows_on_a_terminal():
    out = io.StringIO()
    from rich.console import Console
    progress = Progress(True, Console(file=out, force_terminal=True, width=100))
    compile_model(MODEL, Options(TINY), progress=progress)
    assert "importing" in out.getvalue() and "passes" in out.getvalue() and "lowering" in out.getvalue()


def test_no_progress_without_a_terminal_nor_under_quiet(tmp_path, monkeypatch, capsys):
    r = cli_run(MODEL, "-o", tmp_path / "a.s", "--arch", "dlegion-tiny", "--attention", "fp32")
    assert r.exit_code == 0 and r.output.splitlines()[0] == f"{tmp_path / 'a.s'}: 668 instructions for dlegion-tiny"
    [census] = r.output.splitlines()[1:]        # where the matmuls run (tests/test_quantize.py)
    assert census.startswith("14 of 19 matmuls on the arrays (w2); 5 in fp32 on the vector unit: ")

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["dlegion-cc", *map(str, args)])
        capsys.readouterr()
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True)     # as on a terminal
        cli.main()
        return capsys.readouterr().err
    shown = run(MODEL, "-o", tmp_path / "b.s", "--arch", "dlegion-tiny", "--attention", "fp32")
    assert "lowering" in shown
    quiet = run(MODEL, "-o", tmp_path / "c.s", "--arch", "dlegion-tiny", "--attention", "fp32", "-q")
    assert quiet.splitlines() == [f"{tmp_path / 'c.s'}: 668 instructions for dlegion-tiny"]

