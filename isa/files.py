"""Writing outputs atomically: a reader never sees a half-written file, nor half of a set.

Every error names the file the user asked for, never the temporary written beside it.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

# What a path that is not a regular file is, by its mode: reading a device or a FIFO blocks or
# never ends, and writing one by renaming a temporary over it would replace the device itself.
_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _named(e: OSError, path: Path) -> OSError:
    """``e`` as the same kind of error, about ``path``."""
    return type(e)(e.errno, e.strerror or str(e), str(path))


def _irregular(path: Path, mode: int) -> OSError | None:
    """The error for a path that exists but is not a regular file (a folder, a device...)."""
    if stat.S_ISDIR(mode):
        return IsADirectoryError(21, "is a directory", str(path))
    if stat.S_ISREG(mode):
        return None
    kind = next((what for test, what in _KINDS if test(mode)), "a special file")
    return OSError(0, f"{kind}, not a regular file", str(path))


def check_readable(path: str | Path) -> None:
    """Raise the OSError reading ``path`` would meet, before it is opened: it must exist and be
    a regular file (opening a FIFO waits for a writer; a device never ends)."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise _named(e, path) from None
    problem = _irregular(path, mode)
    if problem is not None:
        raise problem


def check_writable(path: str | Path) -> None:
    """Raise the OSError that writing ``path`` would meet, before any long work: the nearest
    existing folder on its way must be writable (the missing ones are made only when the output
    is written, so a run refused for its input leaves none), and ``path``, if it exists, must be
    a regular file."""
    path = Path(path)
    existing = next(p for p in (path.parent, *path.parent.parents) if p.exists() or p.is_symlink())
    if not existing.is_dir():
        raise NotADirectoryError(20, "not a directory", str(existing))
    try:
        problem = _irregular(path, os.stat(path).st_mode)
    except OSError:
        problem = None          # absent (or a dangling link): written as a new file
    if problem is not None:
        raise problem
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(13, "directory not writable", str(existing))


def _make_folder(path: Path) -> list[Path]:
    """Make ``path``'s missing folders; those made, innermost first (to be removed on failure)."""
    check_writable(path)
    made = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _named(e, path.parent) from None
    return made


def _remove_folders(made: list[Path]) -> None:
    """Remove the folders a failed write made, if still empty."""
    for d in made:
        try:
            d.rmdir()
        except OSError:
            return


def _temp_beside(path: Path) -> Path:
    """A temporary file in ``path``'s folder (which must exist) with the permissions a plain
    open() would give."""
    check_writable(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise _named(e, path) from None
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())
    return Path(tmp)


class Staged:
    """An output written piece by piece while the work runs (a compiler's data file), into a
    temporary file beside it: ``atomic_write_all`` renames it into place with the others, and
    leaving the ``with`` block removes it if that never happened (an error, an interrupt)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.made = _make_folder(self.path)
        try:
            self.temp = _temp_beside(self.path)
        except OSError:
            _remove_folders(self.made)
            raise
        try:
            self.file = open(self.temp, "wb")
        except OSError as e:
            self.temp.unlink(missing_ok=True)
            _remove_folders(self.made)
            raise _named(e, self.path) from None

    def write(self, chunk) -> int:
        try:
            return self.file.write(chunk)
        except OSError as e:
            raise _named(e, self.path) from None

    def close(self) -> None:
        try:
            self.file.close()
        except OSError as e:    # the last buffered bytes could not be written
            raise _named(e, self.path) from None

    def __enter__(self) -> "Staged":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.file.close()
        except OSError:
            pass            # the file is going; the error that brought us here is the one to report
        self.temp.unlink(missing_ok=True)
        if exc[0] is not None:
            _remove_folders(self.made)


def atomic_write_all(files: list[tuple[Path, bytes | Staged]]) -> None:
    """Write every (path, bytes) pair, or none: all are written to temporaries (a ``Staged``
    body already is one), then renamed; if a rename fails, the files already renamed get their
    old contents back."""
    temps: list[tuple[Path, Path]] = []
    made: list[Path] = []
    try:
        for target, body in files:
            target = Path(target)
            if isinstance(body, Staged):
                body.close()
                temps.append((body.temp, target))
                continue
            made += _make_folder(target)
            tmp = _temp_beside(target)
            temps.append((tmp, target))
            try:
                tmp.write_bytes(body)
            except OSError as e:
                raise _named(e, target) from None
        _replace_all(temps)
    except BaseException:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)
        _remove_folders(made)
        raise


def _replace_all(temps: list[tuple[Path, Path]]) -> None:
    """Rename each temporary over its target; on failure undo the renames already made."""
    done: list[tuple[Path, Path | None]] = []        # (target, its old contents moved aside)
    try:
        for tmp, target in temps:
            old = None
            if target.exists() or target.is_symlink():
                old = _temp_beside(target)
                _move(target, old, target)
            done.append((target, old))
            _move(tmp, target, target)
    except BaseException:
        for target, old in reversed(done):
            try:
                if old is not None:
                    os.replace(old, target)
                else:
                    target.unlink(missing_ok=True)
            except OSError:
                pass            # the first error is the one to report
        raise
    for _, old in done:
        if old is not None:
            old.unlink(missing_ok=True)


def _move(src: Path, dst: Path, named: Path) -> None:
    try:
        os.replace(src, dst)
    except OSError as e:
        raise _named(e, named) from None


def atomic_write(path: str | Path, data: bytes | str) -> None:
    atomic_write_all([(Path(path), data.encode() if isinstance(data, str) else data)])
