"""The launcher's watch over a run's children while they run.

An inference server (the policy's replicas, the judge's) is kept up by an `InferenceSupervisor`: it is restarted
when it exits, never answers /liveness after its start, or stops answering (`inference.restart_on_failure`, at
most `inference.max_restarts` times); a server refusing its arguments, or a port another program answers on,
stops the run instead. Any other child exiting before it is done raises `ChildFailed`, which `report_failure`
prints with the line of the child's log that says what went wrong.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence

from primejax.inference import identity
from primejax.inference.admin_auth import TOKEN_ENV
from primejax.inference.server import InferenceConfig
from primejax.launcher.progress import Progress
from primejax.utils.procs import ChildProcess

POLL_S = 0.5
# A server's exit status for arguments it refuses: primejax's inference entry point after ServerSpec.check_model,
# and vLLM's own argument parser. Restarting it with the same arguments cannot help.
REFUSED_EXIT = 2
LIVENESS_POLL_S = 2.0


class ChildFailed(RuntimeError):
    def __init__(self, child: ChildProcess, code: int | None, reason: str = ""):
        self.child = child
        self.code = code
        self.reason = reason or f"exit status {code}"
        super().__init__(f"{child.name} failed ({self.reason})")


class Liveness(threading.Thread):
    """Polls GET /liveness in the background; `last_ok` is when the run's own server last answered 200.

    A 200 counts only from a server that answered the identity challenge (primejax.inference.identity) since
    the last failed connection: a port another program took answers /liveness too. `impostor` says why the
    server at the address is not the run's."""

    def __init__(self, base_url: str, secret: str | None = None):
        super().__init__(name="primejax-liveness", daemon=True)
        self.base_url = base_url
        self.url = base_url + "/liveness"
        self.secret = secret
        self.verified = False
        self.impostor = ""
        self.last_ok: float | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    if r.status == 200 and self._identified():
                        self.last_ok = time.monotonic()
            except OSError:  # URLError, HTTPError (503: engine dead), refused, timed out
                self.verified = False
            self._stop_event.wait(LIVENESS_POLL_S)

    def _identified(self) -> bool:
        if self.verified or not self.secret:
            return True
        why = identity.verify_sync(self.base_url, self.secret)
        if why:
            self.impostor = why
            return False
        self.verified = True
        return True

    def stop(self) -> None:
        self._stop_event.set()


class InferenceSupervisor:
    """Keeps the run's inference server up: restarts it when it exits or hangs, a bounded number of times."""

    def __init__(
        self,
        start: Callable[[], ChildProcess],
        inf: InferenceConfig,
        on_restart: Callable[[ChildProcess], None],
    ):
        """`start` starts the server child; `inf` (the `inference` section) says where it listens and the
        restart policy."""
        self.start_child, self.inf = start, inf
        self.on_restart = on_restart
        self.restarts = 0
        self.child = self._start()

    def _start(self) -> ChildProcess:
        self.child = self.start_child()
        self.started = time.monotonic()
        self.liveness = Liveness(f"http://{self.inf.host}:{self.inf.port}", os.environ.get(TOKEN_ENV))
        self.liveness.start()
        return self.child

    def _problem(self) -> str | None:
        inf = self.inf
        code = self.child.poll()
        if code is not None:
            return f"exit status {code}"
        last_ok, now = self.liveness.last_ok, time.monotonic()
        if last_ok is None and now - self.started > inf.startup_timeout_s:
            return f"not healthy {inf.startup_timeout_s:.0f} s after start"
        if last_ok is not None and now - last_ok > inf.hang_timeout_s:
            return f"hung: no answer on /liveness for {now - last_ok:.0f} s"
        return None

    def check(self) -> None:
        """Restart the server if it failed (raise ChildFailed when that is not allowed or too many times)."""
        if self.liveness.impostor:  # a restart would bind the same taken port: stop the run, saying why
            raise ChildFailed(self.child, self.child.poll(), self.liveness.impostor)
        problem = self._problem()
        if problem is None:
            return
        inf = self.inf
        if self.child.poll() == REFUSED_EXIT:  # a restart would be refused the same way
            raise ChildFailed(self.child, REFUSED_EXIT, problem + ": the server refused its arguments")
        if not inf.restart_on_failure or self.restarts >= inf.max_restarts:
            limit = "" if not inf.restart_on_failure else f"; {self.restarts} restarts already"
            raise ChildFailed(self.child, self.child.poll(), problem + limit)
        self.restarts += 1
        print(
            f"primejax: inference server failed ({problem}); restarting it "
            f"({self.restarts}/{inf.max_restarts}), log {self.child.log_path}",
            file=sys.stderr,
            flush=True,
        )
        self.stop()
        self._start()
        self.on_restart(self.child)

    def stop(self) -> None:
        self.liveness.stop()
        self.child.stop()


def wait_healthy(supervisors: list[InferenceSupervisor], others: list[ChildProcess]) -> None:
    """Block until every server answered /liveness (restarting one that failed, as the run would); raise
    ChildFailed when a server cannot start or another child died meanwhile."""
    while not all(s.liveness.last_ok is not None for s in supervisors):
        for supervisor in supervisors:
            supervisor.check()
        for child in others:
            if child.poll() is not None:
                raise ChildFailed(child, child.poll())
        time.sleep(POLL_S)


def watch(
    children: list[ChildProcess],
    until_done: list[ChildProcess],
    progress: Progress | None,
    supervisors: Sequence[InferenceSupervisor] = (),
) -> None:
    """Block until every child in `until_done` exits 0; raise ChildFailed as soon as any child fails."""
    while True:
        for supervisor in supervisors:
            supervisor.check()
        for child in children:
            code = child.poll()
            if code is not None and (code != 0 or child not in until_done):
                raise ChildFailed(child, code)
        if progress is not None:
            progress.update()
        if all(c.poll() == 0 for c in until_done):
            return
        time.sleep(POLL_S)


def _error_line(log_text: str) -> str:
    """The line of a log that says what went wrong: our `error: ...` line, else a traceback's last line."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error:"):
            return ln
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt")) and " " not in head:
            return ln
    return ""


def report_failure(err: ChildFailed) -> None:
    tail = err.child.log_tail(40)
    cause = _error_line(tail)
    print(
        f"\nprimejax: {err.child.name} failed ({err.reason}){': ' + cause if cause else ''}; stopping the run.",
        file=sys.stderr,
    )
    print(f"--- last lines of {err.child.log_path} ---", file=sys.stderr)
    print(tail, file=sys.stderr)
