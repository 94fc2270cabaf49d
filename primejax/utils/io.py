"""Atomic file and directory writes.

Every file that another process reads (batches, broadcasts, checkpoints, configs) is written to a temporary
name in the same directory and renamed into place, so a reader sees either nothing or the whole file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: What a filesystem that cannot fsync a directory answers (some network and FUSE filesystems): not a fault.
_DIR_FSYNC_UNSUPPORTED = {
    errno.EINVAL,
    errno.ENOTSUP,
    errno.EOPNOTSUPP,
    errno.EBADF,
    errno.EACCES,
    errno.EISDIR,
}


def _fsync_dir(path: Path) -> None:
    """fsync a directory (its entries: a rename in it). A filesystem that cannot is tolerated; a real failure
    (EIO, ENOSPC: the rename may not be on disk) is raised, not swallowed."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        if e.errno in _DIR_FSYNC_UNSUPPORTED:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory bottom-up, so a rename of `root` publishes only
    data that is on disk (a power loss after the rename must not leave a renamed directory of empty files)."""
    dirs = []
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            continue
        if p.is_dir():
            dirs.append(p)
        elif p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in reversed([root, *dirs]):
        _fsync_dir(d)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` through a temp file in the same directory and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp directory next to `path`; on success rename it to `path`, on failure remove it.

    Readers never see a half-written directory: every file inside is fsynced before the rename, the parent
    directory after it. With `overwrite`, an existing `path` is replaced (the old one
    is moved aside first, then removed, so there is no window where neither exists for long).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        if path.exists():
            if not overwrite:
                raise FileExistsError(f"{path} already exists")
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
