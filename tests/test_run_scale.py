"""What lets dlegion-run take whole models: the data file is mapped, not read; constants are
views of it; errors about the file stay what they were."""
import mmap
import subprocess
import sys

import numpy as np
import pytest

from isa import arch
from isa.asm import load
from isa.program import ProgramError
from runtime.emulator import run
from runtime.state import Machine

TINY = arch.load("dlegion-tiny")
PROGRAM = """.arch dlegion-tiny
.data "prog.s.data"
.tensor w i8[4,8] const 0
.tensor y i8[4,8] output "y"
dma.ld L0 {0} act[0,8,1] @w[0,8] rows=4 cols=8
dma.st L0 @y[0,8] act[0,8,1] rows=4 cols=8 wait=L0.dma>=1
"""
W = np.arange(-16, 16, dtype=np.int8).reshape(4, 8)


@pytest.fixture
def program_path(tmp_path):
    (tmp_path / "prog.s").write_text(PROGRAM)
    (tmp_path / "prog.s.data").write_bytes(W.tobytes())
    return tmp_path / "prog.s"


def test_the_data_file_is_mapped_and_constants_are_views_of_it(program_path):
    p = load(program_path)
    assert isinstance(p.data, memoryview) and isinstance(p.data.obj, mmap.mmap)
    assert p.data == W.tobytes()
    m = Machine(p, TINY)
    w = m.dram[p.tensor_index("w")]
    assert not w.flags.writeable and not w.flags.owndata      # no copy of the bytes
    np.testing.assert_array_equal(run(p, TINY, {}).outputs["y"], W)


def test_a_missing_data_file_is_named(program_path):
    (program_path.parent / "prog.s.data").unlink()
    with pytest.raises(ProgramError, match=r"prog.s: cannot read data file 'prog.s.data' \(No such file"):
        load(program_path)


@pytest.mark.parametrize("size", [0, 31])
def test_a_short_data_file_is_named_before_running(program_path, size):
    (program_path.parent / "prog.s.data").write_bytes(W.tobytes()[:size])
    code = "import sys; from runtime.cli import main; sys.argv[0] = 'dlegion-run'; main()"
    r = subprocess.run([sys.executable, "-c", code, str(program_path)], capture_output=True, text=True)
    assert r.returncode == 2
    [line] = r.stderr.strip().splitlines()
    assert "const bytes 0..32 lie beyond the data file 'prog.s.data', which has " + str(size) in line
