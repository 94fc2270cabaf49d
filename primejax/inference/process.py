"""Run an inference server as a child process that is always stopped, by PID, whatever happens.

A thin layer over `primejax.utils.procs.ChildProcess` (own process group, so `stop()` reaches vLLM's engine
core and workers; SIGTERM then SIGKILL; stopped at exit and when its parent dies) that knows how to build
the server's command line and wait for it to become healthy.
"""

from __future__ import annotations

import contextlib
import time
import urllib.error
import urllib.request
from pathlib import Path

from primejax.inference.server import ServerSpec
from primejax.utils.procs import ChildProcess, tail


class ServerDiedError(RuntimeError):
    """The server process exited (or never became healthy); the message ends with its log tail."""


class InferenceServerProcess:
    """`with InferenceServerProcess(spec, log_path) as server: server.wait_healthy(300); ...`"""

    def __init__(self, spec: ServerSpec, log_path: str | Path, *, die_with_parent: bool = True):
        """`spec`: what to start (`ServerSpec.from_config` builds one from the `inference` section).

        `die_with_parent` makes the kernel stop the server when the thread that started it exits, which
        covers a parent killed without running atexit hooks; pass False when starting it from a worker
        thread that ends before the server should.
        """
        self.spec = spec
        self.die_with_parent = die_with_parent
        self.log_path = Path(log_path)
        self.child: ChildProcess | None = None

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child else None

    def start(self) -> InferenceServerProcess:
        if self.child is not None:
            raise RuntimeError("server already started")
        self.child = ChildProcess(
            "inference",
            self.spec.argv(),
            self.log_path,
            env=self.spec.environ(),
            die_with_parent=self.die_with_parent,
        )
        self.started_at = time.monotonic()
        return self

    def poll(self) -> int | None:
        return self.child.poll() if self.child else None

    def is_running(self) -> bool:
        return self.child is not None and self.child.alive()

    def raise_if_dead(self) -> None:
        if self.child is not None and self.child.poll() is not None:
            raise ServerDiedError(
                f"inference server (pid {self.child.pid}) exited with code {self.child.poll()}; "
                f"last lines of {self.log_path}:\n{tail(self.log_path, 40)}"
            )

    def wait_healthy(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> float:
        """Block until GET /liveness answers 200; return the seconds since start. Raises ServerDiedError."""
        if self.child is None:
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
        child, self.child = self.child, None
        if child is not None:
            child.stop(grace_s)

    def __enter__(self) -> InferenceServerProcess:
        if self.child is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.stop(grace_s=2.0)
