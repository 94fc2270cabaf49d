"""One live run per run directory, and a free port for its server, checked before anything starts or moves.

`RunLock` holds an exclusive `flock` on `<run>/.lock` for the life of the launcher: the kernel releases it on
any exit (kill -9 included), so a stale lock never blocks a restart, and a second launcher on the same
directory is refused in one line instead of moving the live run's outputs aside. `check_port` binds the
server's port once to see that it is free (`inference.port = 0` picks a free one).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
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
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise PreflightError(
                "run.name",
                f"{self.root} is in use by a live run ({holder}); stop it or pick "
                "another run.name / run.output_dir",
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
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


def check_port(host: str, port: int, key: str = "inference.port") -> int:
    """`port` if it can be bound on `host` now (0: a free one); PreflightError naming `key` otherwise."""
    if port == 0:
        return free_port(host)
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
