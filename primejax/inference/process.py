"""Run an inference server as a child process that is always stopped, by PID, whatever happens.

The server runs in its own process group (vLLM forks an engine-core process and workers), so `stop()`
signals the whole group: SIGTERM, then SIGKILL after a grace period. An `atexit` hook stops servers a
crashing parent forgot.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import IO

from primejax.inference.server import ServerSpec

_LIVE: weakref.WeakSet[InferenceServerProcess] = weakref.WeakSet()


def _stop_all_at_exit() -> None:
    for proc in list(_LIVE):
        proc.stop()


atexit.register(_stop_all_at_exit)


# Run as `python -c _TRAMPOLINE PARENT_PID CMD...`: ask the kernel for SIGTERM when the parent dies (Linux
# PR_SET_PDEATHSIG, kept across exec), then exec the server. Done in a trampoline rather than a Popen
# preexec_fn because preexec_fn runs Python after fork, which can deadlock in a multithreaded parent (JAX).
_TRAMPOLINE = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "except Exception:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


class ServerDiedError(RuntimeError):
    """The server process exited (or never became healthy); the message ends with its log tail."""


def tail(path: str | Path, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64_000))
            return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class InferenceServerProcess:
    """`with InferenceServerProcess(spec, log_path) as server: server.wait_healthy(300); ...`"""

    def __init__(
        self, spec: ServerSpec | object, log_path: str | Path, *, die_with_parent: bool = True, **overrides
    ):
        """`spec`: a ServerSpec, or a full primejax config (`overrides` then go to `ServerSpec.from_config`).

        `die_with_parent` makes the kernel stop the server when the thread that started it exits, which
        covers a parent killed without running atexit hooks; pass False when starting it from a worker
        thread that ends before the server should.
        """
        self.spec = spec if isinstance(spec, ServerSpec) else ServerSpec.from_config(spec, **overrides)
        self.die_with_parent = die_with_parent
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> InferenceServerProcess:
        if self.proc is not None:
            raise RuntimeError("server already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        argv = self.spec.argv()
        if self.die_with_parent:
            argv = [sys.executable, "-c", _TRAMPOLINE, str(os.getpid()), *argv]
        self.proc = subprocess.Popen(
            argv,
            env=self.spec.environ(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # own process group: stop() reaches the engine core and workers too
        )
        _LIVE.add(self)
        self.started_at = time.monotonic()
        return self

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def raise_if_dead(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerDiedError(
                f"inference server (pid {self.proc.pid}) exited with code {self.proc.returncode}; "
                f"last lines of {self.log_path}:\n{tail(self.log_path)}"
            )

    def wait_healthy(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> float:
        """Block until GET /liveness answers 200; return the seconds since start. Raises ServerDiedError."""
        if self.proc is None:
            self.start()
        deadline = time.monotonic() + timeout_s
        url = f"{self.base_url}/liveness"
        while True:
            self.raise_if_dead()
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started_at
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    # vLLM is up but our routes are not: the endpoint plugin did not load.
                    self.stop()
                    raise ServerDiedError(
                        f"{self.base_url} has no /liveness: primejax's vLLM endpoint plugin was not loaded "
                        "(is primejax installed with its entry points, `pip install -e .`?); "
                        f"log tail:\n{tail(self.log_path)}"
                    ) from None
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerDiedError(
                    f"inference server not healthy after {timeout_s:.0f} s; last lines of {self.log_path}:\n"
                    f"{tail(self.log_path)}"
                )
            time.sleep(poll_s)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `grace_s`. Idempotent."""
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is not None:
            pgid = proc.pid  # start_new_session: the group id is the leader's pid
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            # Children (engine core, workers) may outlive the leader: make sure the group is gone.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> InferenceServerProcess:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.stop(grace_s=2.0)
