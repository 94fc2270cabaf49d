"""Naming a full disk in one line: which filesystem, how much is free, what was being written.

A write that runs out of space surfaces as `OSError(ENOSPC)` from Python, or as a message carrying
"No space left on device" / `os_error_code='28'` from libraries with their own I/O (Orbax's TensorStore).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

_ENOSPC_TEXT = ("No space left on device", "os_error_code='28'", "RESOURCE_EXHAUSTED: Error writing")


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether `exc` (or anything in its cause/context chain) is an out-of-space error."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(t in str(exc) for t in _ENOSPC_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def mount_point(path: str | os.PathLike) -> Path:
    """The mount point of the filesystem holding `path` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def describe_disk(path: str | os.PathLike) -> str:
    """'the filesystem at /mnt (0.0 MB free of 2.0 MB)' for the disk that holds `path`."""
    mount = mount_point(path)
    try:
        usage = shutil.disk_usage(mount)
    except OSError:
        return f"the filesystem at {mount}"
    return f"the filesystem at {mount} ({usage.free / 1e6:.1f} MB free of {usage.total / 1e6:.1f} MB)"


def io_error_line(exc: OSError, fallback: str | os.PathLike, what: str) -> str:
    """One line for an I/O error while writing `what`: the disk-full line (on the disk of the file the error
    names, else of `fallback`, the directory being written, never the process's cwd), or the error itself."""
    where = exc.filename or fallback
    if is_disk_full(exc):
        return disk_full_line(where, what)
    return f"I/O error writing {what} under {where}: {os.strerror(exc.errno) if exc.errno else exc}"


def disk_full_line(path: str | os.PathLike, what: str) -> str:
    """The one line a process prints when writing `what` under `path` ran out of space."""
    return f"disk full: no space left writing {what} under {path} on {describe_disk(path)}"
