"""Processes of a run still alive after it: the end-to-end tests' "nothing left behind" check (tests/ is on
sys.path through its conftest)."""

from __future__ import annotations

import os
from pathlib import Path


def processes_mentioning(text: str) -> list[str]:
    """'pid: command line' of every process but this one whose command line contains `text`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd}")
    return found
