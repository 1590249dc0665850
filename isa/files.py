"""Writing outputs atomically: a reader never sees a half-written file, nor half of a set."""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temp_beside(path: Path) -> Path:
    """A temporary file in ``path``'s folder with the permissions a plain open() would give."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())
    return Path(tmp)


@contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on error it is removed."""
    path = Path(path)
    tmp = _temp_beside(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_all(files: list[tuple[Path, bytes]]) -> None:
    """Write every (path, bytes) pair, or none: all are written to temporaries, then renamed."""
    temps: list[tuple[Path, Path]] = []
    try:
        for target, body in files:
            tmp = _temp_beside(Path(target))
            temps.append((tmp, Path(target)))
            tmp.write_bytes(body)
        for tmp, target in temps:
            os.replace(tmp, target)
    finally:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)


def atomic_write(path: str | Path, data: bytes | str) -> None:
    atomic_write_all([(Path(path), data.encode() if isinstance(data, str) else data)])
