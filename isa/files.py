"""Writing outputs atomically: a reader never sees a half-written file, nor half of a set.

Every error names the file the user asked for, never the temporary written beside it.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _named(e: OSError, path: Path) -> OSError:
    """``e`` as the same kind of error, about ``path``."""
    return type(e)(e.errno, e.strerror or str(e), str(path))


def check_writable(path: str | Path) -> None:
    """Raise the OSError that writing ``path`` would meet, before any long work: its folder
    (created if missing) must be writable, and ``path`` must not be a folder."""
    path = Path(path)
    folder = path.parent
    blocking = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise NotADirectoryError(20, "not a directory", str(blocking))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _named(e, folder) from None
    if path.is_dir():
        raise IsADirectoryError(21, "is a directory", str(path))
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(13, "directory not writable", str(folder))


def _temp_beside(path: Path) -> Path:
    """A temporary file in ``path``'s folder with the permissions a plain open() would give."""
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
        self.temp = _temp_beside(self.path)
        try:
            self.file = open(self.temp, "wb")
        except OSError as e:
            self.temp.unlink(missing_ok=True)
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


def atomic_write_all(files: list[tuple[Path, bytes | Staged]]) -> None:
    """Write every (path, bytes) pair, or none: all are written to temporaries (a ``Staged``
    body already is one), then renamed; if a rename fails, the files already renamed get their
    old contents back."""
    temps: list[tuple[Path, Path]] = []
    try:
        for target, body in files:
            target = Path(target)
            if isinstance(body, Staged):
                body.close()
                temps.append((body.temp, target))
                continue
            tmp = _temp_beside(target)
            temps.append((tmp, target))
            try:
                tmp.write_bytes(body)
            except OSError as e:
                raise _named(e, target) from None
        _replace_all(temps)
    finally:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)


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
