"""One live run per run directory, and a free port for its server, checked before anything starts or moves.

`RunLock` holds an exclusive `flock` on `<run>/.lock` for the life of the launcher: the kernel releases it on
any exit (kill -9 included), so a stale lock never blocks a restart, and a second launcher on the same
directory is refused in one line instead of moving the live run's outputs aside. `check_port` binds the
server's port once to see that it is free (`inference.port = 0` picks a free one).

A bind only says the port is free *now*: a run whose server was still starting (its SFT warm-up, vLLM's
import) had not bound it yet, so a second run on the same explicit port passed the check and started a second
server. So an explicit port is also reserved host-wide for the launcher's life: an exclusive `flock` on
`<tmp>/primejax-ports/<host>_<port>.held` (dropped by the kernel on any exit), and a second launcher asking for
it is refused at once, naming the holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
import time
from pathlib import Path

from primejax.contracts.rundir import RunDir
from primejax.inference.server import free_port
from primejax.launcher.preflight import PreflightError

LOCK_FILE = RunDir.LOCK_FILE


class RunLock:
    """`with RunLock(root):` ... the run; raises PreflightError when another live process holds `root`."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.root.mkdir(parents=True, exist_ok=True)
        try:  # no symlink followed: a link planted as .lock must not get its target truncated and overwritten
            fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise PreflightError(
                "run.name",
                f"{self.root / LOCK_FILE}: cannot be the run's lock file "
                f"({e.strerror}{'; a symlink?' if os.path.islink(self.root / LOCK_FILE) else ''})",
            ) from None
        holder = _flock_or_holder(fd)
        if holder is not None:
            raise PreflightError(
                "run.name",
                f"{self.root} is in use by a live run ({holder}); stop it or pick "
                "another run.name / run.output_dir",
            )
        _stamp(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing drops the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


#: (host, port) -> the open lock file this process holds (module docstring).
_RESERVED: dict[tuple[str, int], int] = {}


def port_lock_dir() -> Path:
    return Path(tempfile.gettempdir()) / "primejax-ports"


def reserve_port(host: str, port: int, key: str = "inference.port") -> None:
    """Hold `host:port` for this process's life (module docstring); PreflightError naming `key` when another
    live process holds it. Idempotent within a process."""
    if (host, port) in _RESERVED:
        return
    d = port_lock_dir()
    path = d / f"{host}_{port}.held"  # not '.lock': that name belongs to the run directory (RunDir)
    try:
        if not d.is_dir():
            d.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):
                os.chmod(d, 0o1777)  # shared by every user's runs, like /tmp itself
        # no symlink followed: another user's link must not make us open (and truncate) its target
        try:
            fd, writable = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666), True
        except PermissionError:  # another user's file: a read-only descriptor holds a flock as well
            fd, writable = os.open(path, os.O_RDONLY | os.O_NOFOLLOW), False
    except OSError as e:
        raise PreflightError(key, f"cannot reserve {host}:{port} ({path}: {e.strerror})") from None
    holder = _flock_or_holder(fd)
    if holder is not None:
        raise PreflightError(
            key,
            f"{host}:{port} is reserved by another primejax run ({holder}) whose server may still be starting; "
            f"stop it, pick another port, or set {key}=0 for a free one",
        )
    if writable:
        _stamp(fd)
    _RESERVED[host, port] = fd


def _flock_or_holder(fd: int) -> str | None:
    """Take `fd`'s exclusive flock without waiting: None when taken, else the holder's stamp (and `fd` closed)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        return holder
    return None


def _stamp(fd: int) -> None:
    """Write who holds the lock (read back by a refused second process)."""
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())


def release_ports() -> None:
    """Drop every port this process reserved (the kernel does it at exit; tests call it)."""
    for fd in _RESERVED.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _RESERVED.clear()


def check_port(host: str, port: int, key: str = "inference.port") -> int:
    """`port` if it can be bound on `host` now (0: a free one) and, when explicit, is reserved by no other
    primejax run (it is then reserved for this process); PreflightError naming `key` otherwise."""
    if port == 0:
        return free_port(host)
    reserve_port(host, port, key)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as the server binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            raise PreflightError(
                key,
                f"{host}:{port} is already in use ({e.strerror}); stop what holds it, "
                f"pick another port, or set {key}=0 for a free one",
            ) from None
    return port
