"""The trainer -> inference broadcast contract: atomic directories, STABLE manifests, pruning."""

from __future__ import annotations

import pytest

from primejax.transports.weights.filesystem.broadcast import (
    STABLE,
    BroadcastError,
    broadcast_dir,
    is_stable,
    latest_stable_step,
    prune_broadcasts,
    verify_broadcast,
    write_broadcast,
)


def _write(tmp):
    (tmp / "model.safetensors").write_bytes(b"x" * 100)
    (tmp / "config.json").write_text("{}")
    return "ok"


def test_write_marks_stable_with_manifest(tmp_path):
    d, result = write_broadcast(tmp_path, 3, _write)
    assert result == "ok" and d == broadcast_dir(tmp_path, 3) and is_stable(d)
    manifest = verify_broadcast(d)
    assert manifest["step"] == 3 and manifest["files"]["model.safetensors"]["size"] == 100
    assert latest_stable_step(tmp_path) == 3
    assert [p.name for p in d.parent.iterdir()] == ["step_3"]  # no temp dir left behind


def test_failed_write_leaves_nothing(tmp_path):
    def boom(tmp):
        _write(tmp)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_broadcast(tmp_path, 1, boom)
    assert latest_stable_step(tmp_path) is None
    assert list((tmp_path / "broadcasts").iterdir()) == []


def test_verify_detects_truncation_and_corruption(tmp_path):
    d, _ = write_broadcast(tmp_path, 1, _write)
    (d / "model.safetensors").write_bytes(b"x" * 99 + b"y")
    with pytest.raises(BroadcastError, match="sha256"):
        verify_broadcast(d)
    (d / "model.safetensors").write_bytes(b"x" * 50)
    with pytest.raises(BroadcastError, match="50 bytes"):
        verify_broadcast(d)


def test_unstable_dirs_are_ignored_and_pruning(tmp_path):
    for step in (1, 2, 3, 4):
        write_broadcast(tmp_path, step, _write)
    (broadcast_dir(tmp_path, 5)).mkdir()  # a directory without STABLE is not a broadcast
    assert latest_stable_step(tmp_path) == 4
    assert prune_broadcasts(tmp_path, keep_from_step=3) == [1, 2]
    assert sorted(p.name for p in (tmp_path / "broadcasts").iterdir()) == ["step_3", "step_4", "step_5"]
    assert not (broadcast_dir(tmp_path, 5) / STABLE).exists()
