"""Outputs are written all or nothing, and errors name the file asked for."""
import os

import pytest

from isa import files
from isa.files import atomic_write, atomic_write_all


def _contents(folder):
    return {p.name: p.read_text() for p in folder.iterdir() if p.is_file()}


def test_a_failed_rename_gives_the_files_renamed_before_it_their_old_contents(tmp_path, monkeypatch):
    a, b = tmp_path / "prog.s", tmp_path / "prog.s.data"
    atomic_write(a, "old program")
    atomic_write(b, "old data")
    real, failed = os.replace, []

    def replace(src, dst):
        if str(dst) == str(b) and not failed:
            failed.append(src)
            raise PermissionError(1, "operation not permitted", str(dst))
        real(src, dst)

    monkeypatch.setattr(files.os, "replace", replace)
    with pytest.raises(PermissionError) as e:
        atomic_write_all([(a, b"new program"), (b, b"new data")])
    assert e.value.filename == str(b)
    assert _contents(tmp_path) == {"prog.s": "old program", "prog.s.data": "old data"}


def test_a_folder_in_the_way_fails_before_anything_is_replaced(tmp_path):
    a, b = tmp_path / "out.json", tmp_path / "out.csv"
    atomic_write(a, "old")
    b.mkdir()
    with pytest.raises(IsADirectoryError) as e:
        atomic_write_all([(a, b"new"), (b, b"new")])
    assert e.value.filename == str(b)
    assert _contents(tmp_path) == {"out.json": "old"}


def test_errors_name_the_target_not_its_temporary(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / ".x.abc.tmp"))

    monkeypatch.setattr(files.tempfile, "mkstemp", full)
    with pytest.raises(OSError) as e:
        atomic_write(tmp_path / "x", "y")
    assert e.value.filename == str(tmp_path / "x")


def test_the_output_folder_is_made(tmp_path):
    atomic_write(tmp_path / "build" / "prog.s", "p")
    assert (tmp_path / "build" / "prog.s").read_text() == "p"
    assert sorted(p.name for p in (tmp_path / "build").iterdir()) == ["prog.s"]


def test_a_file_where_the_output_folder_should_be_is_named(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError) as e:
        atomic_write(tmp_path / "afile" / "sub" / "x.s", "y")
    assert e.value.filename == str(tmp_path / "afile") and e.value.strerror == "not a directory"


def test_checking_an_output_makes_no_folder(tmp_path):
    files.check_writable(tmp_path / "new" / "deeper" / "x.s")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_removes_the_folders_it_made(tmp_path):
    (tmp_path / "in_the_way").mkdir()
    with pytest.raises(IsADirectoryError):
        atomic_write_all([(tmp_path / "new" / "a.s", b"a"), (tmp_path / "in_the_way", b"b")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in_the_way"]


def test_a_device_is_neither_read_nor_replaced(tmp_path):
    os.symlink(os.devnull, tmp_path / "null")
    with pytest.raises(OSError, match="a character device, not a regular file"):
        files.check_readable(tmp_path / "null")
    with pytest.raises(OSError, match="a character device, not a regular file"):
        atomic_write(tmp_path / "null", "x")
    assert (tmp_path / "null").is_symlink()
