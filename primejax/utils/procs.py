"""Child processes that are always stopped: own process group, killed by PID group on stop, exit or signal.

The launcher, the inference process wrapper and the tests all start children through `ChildProcess`, so no code
path can leave an orphan behind: `stop()` sends SIGTERM to the whole group, waits, then SIGKILLs it, an `atexit`
hook stops whatever is still running when the parent exits normally, and a parent that is killed outright
(kill -9, OOM) takes its children with it: a watcher leading each child's group is told by the kernel when
the parent dies and kills the whole group (see watcher.py).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

_LIVE: weakref.WeakSet[ChildProcess] = weakref.WeakSet()


def _stop_all_at_exit() -> None:
    for child in list(_LIVE):
        child.stop()


atexit.register(_stop_all_at_exit)


# Each child runs as `python watcher.py PARENT_PID CMD...` (primejax/utils/watcher.py, a plain script: it
# imports nothing of primejax). A watcher rather than a Popen preexec_fn: preexec_fn runs Python between fork
# and exec, which can deadlock in a multithreaded parent (JAX, httpx); the watcher is single-threaded.
_WATCHER = str(Path(__file__).with_name("watcher.py"))


def stop_all(children: Sequence[ChildProcess], grace_s: float = 10.0) -> None:
    """Stop several children at once: SIGTERM every group first, so their shutdowns overlap, then sweep each."""
    for child in children:
        if child.alive():
            child._signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(c.alive() for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    for child in children:
        child.stop(grace_s=0.0)


def tail(path: str | Path, lines: int = 30) -> str:
    """The last `lines` lines of a log file ("" if it does not exist)."""
    path = Path(path)
    if not path.exists():
        return ""
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 64 * 1024))
        data = f.read().decode("utf-8", errors="replace")
    return "\n".join(data.splitlines()[-lines:])


class ChildProcess:
    """A subprocess in its own process group whose output goes to a log file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: str | Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        die_with_parent: bool = True,
    ):
        """`die_with_parent`: the child's group is killed when the thread that started it exits; pass False
        when a worker thread that ends first starts it."""
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self._log = self.log_path.open("ab")
        argv = self.argv
        if die_with_parent:
            argv = [sys.executable, _WATCHER, str(os.getpid()), *argv]
        self.popen = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            cwd=cwd,
            start_new_session=True,  # own process group: stop() reaches grandchildren (vLLM engine cores)
        )
        _LIVE.add(self)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def log_tail(self, lines: int = 30) -> str:
        return tail(self.log_path, lines)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the group, then SIGKILL it after `grace_s`. Safe to call more than once."""
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self.popen.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        # The leader may be gone while workers it forked linger in the group: always sweep it.
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)
        self._wait_group_gone(timeout_s=5.0)
        with contextlib.suppress(Exception):
            self._log.close()
        _LIVE.discard(self)
        return self.popen.returncode

    def _wait_group_gone(self, timeout_s: float) -> None:
        # Killed members other than the leader (the child under its watcher, vLLM's workers) are reaped by init,
        # not by us; until then the group still exists. Callers rely on "stopped" meaning no member is left.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.popen.pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.02)

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
