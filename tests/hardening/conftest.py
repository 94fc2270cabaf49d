"""Hardening fixtures: a real small disk (a 2 MB tmpfs) where the machine lets us mount one."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def small_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, str]]:
    """(a directory on a 2 MB filesystem, "tmpfs"); where mounting is refused, (a plain directory, "fault") and
    PRIMEJAX_FAULTS armed so the checkpoint write path raises ENOSPC instead."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        == 0
    )
    if not mounted:
        monkeypatch.setenv("PRIMEJAX_FAULTS", "trainer.checkpoint_written@2=enospc")
    try:
        yield mnt, "tmpfs" if mounted else "fault"
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
