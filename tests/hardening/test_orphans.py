"""A parent killed outright (kill -9 of the launcher: no atexit, no cleanup) leaves no child, no grandchild and
no SIGTERM-ignoring process of either alive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def test_sigkilled_parent_takes_stubborn_children_and_grandchildren_along(tmp_path):
    # The child ignores SIGTERM and forks a grandchild (as vLLM forks its engine core) that ignores it too.
    child_code = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"g = subprocess.Popen([sys.executable, '-c', {STUBBORN!r}])\n"
        "print(os.getpid(), g.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent_code = (
        "import sys, time\n"
        "from primejax.utils.procs import ChildProcess\n"
        f"c = ChildProcess('stubborn', [sys.executable, '-c', {child_code!r}], {str(tmp_path / 'child.log')!r})\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    leader = int(parent.stdout.readline())
    log = tmp_path / "child.log"
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text().strip()):
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.1)
    child, grandchild = (int(x) for x in log.read_text().split())
    pids = [leader, child, grandchild]
    try:
        assert all(_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        survivors = _wait_gone(pids, timeout_s=20)
        assert not survivors, f"survived the parent's kill -9: {survivors}"
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
