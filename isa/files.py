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


def atomic_write_all(files: list[tuple[Path, bytes]]) -> None:
    """Write every (path, bytes) pair, or none: all are written to temporaries, then renamed;
    if a rename fails, the files already renamed get their old contents back."""
    temps: list[tuple[Path, Path]] = []
    try:
        for target, body in files:
            target = Path(target)
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
