"""A full disk during a save loses nothing: the failed save is removed, older checkpoints stay until a newer
one verifies, and the error is one line naming the disk. Runs on a real 2 MB tmpfs where mounting is allowed."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from primejax.orchestrator.checkpoint import save_checkpoint, saved_steps
from primejax.trainer import checkpoint as trainer_checkpoint
from primejax.trainer.checkpoint import (
    TrainerCheckpointer,
    checkpoint_problem,
    complete_steps,
    resolve_resume_step,
    trainer_ckpt_dir,
)
from primejax.utils import io as io_mod

SMALL = {"w": jnp.arange(1000, dtype=jnp.float32)}
# Random values do not compress: 2.4 MB of them cannot fit a 2 MB disk.
BIG = {"w": jnp.arange(1000, dtype=jnp.float32), "v": jax.random.normal(jax.random.key(0), (600_000,))}


@pytest.mark.parametrize("keep", [1, 2])
def test_trainer_checkpoint_on_full_disk_keeps_the_previous_one(small_disk, keep):
    disk, mode = small_disk
    root = disk / "run"
    ckpt = TrainerCheckpointer(root, keep=keep, async_save=True)
    ckpt.save(1, SMALL, {"data_step": 2})
    ckpt.finalize()
    with pytest.raises(trainer_checkpoint.CheckpointError) as err:
        ckpt.save(2, BIG if mode == "tmpfs" else SMALL, {"data_step": 3})
        ckpt.finalize()
    ckpt.close()  # closing again must not "finalize" the failed save a second time
    line = str(err.value)
    assert "\n" not in line and "disk full" in line and str(disk) in line, line
    assert "step 1 is still the newest checkpoint" in line
    assert not trainer_ckpt_dir(root, 2).exists()  # the failed save was removed
    assert complete_steps(root) == [1] and checkpoint_problem(root, 1) is None
    assert resolve_resume_step(root, "latest") == 1
    restored, meta = TrainerCheckpointer(root, keep=keep).restore(1, SMALL)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(SMALL["w"]))
    assert meta["data_step"] == 2


def test_a_manifest_that_lists_no_files_is_not_a_checkpoint(tmp_path):
    path = trainer_ckpt_dir(tmp_path, 3)
    (path / "state.orbax-checkpoint-tmp").mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"step": 3, "files": {}}))
    assert checkpoint_problem(tmp_path, 3) is not None
    assert resolve_resume_step(tmp_path, "latest") is None


def test_prune_waits_for_a_newer_checkpoint_that_verifies(tmp_path):
    ckpt = TrainerCheckpointer(tmp_path, keep=2, async_save=False)
    ckpt.save(1, SMALL, {})
    ckpt.save(2, SMALL, {})
    meta_path = trainer_ckpt_dir(tmp_path, 2) / "meta.json"  # step 2 damaged: a file no longer matches
    meta = json.loads(meta_path.read_text())
    first = next(iter(meta["files"]))
    meta["files"][first] += 1
    meta_path.write_text(json.dumps(meta))
    ckpt.keep = 1
    ckpt._prune()
    ckpt.close()
    assert checkpoint_problem(tmp_path, 1) is None  # the only usable checkpoint is never pruned
    assert resolve_resume_step(tmp_path, "latest") == 1


def test_orchestrator_checkpoint_on_full_disk_keeps_the_previous_one(small_disk):
    disk, mode = small_disk
    if mode != "tmpfs":
        pytest.skip("needs a real small disk")
    save_checkpoint(disk, 1, {"progress": 1}, keep=1)
    with pytest.raises(OSError):
        save_checkpoint(disk, 2, {"progress": 2}, keep=1, records={"big": [{"x": "y" * 1000}] * 3000})
    assert saved_steps(disk) == [1]
    assert not [p for p in (disk / "checkpoints").iterdir() if p.name.startswith(".")]  # no temp left behind


def test_atomic_dir_fsyncs_every_file_before_the_rename(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(io_mod.os, "fsync", fsync)
    monkeypatch.setattr(io_mod.os, "replace", replace)
    with io_mod.atomic_dir(tmp_path / "out") as tmp:
        (tmp / "a.bin").write_bytes(b"a" * 10)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(b"b" * 10)
    rename_at = events.index(("rename", str(tmp_path / "out")))
    synced = {os.path.basename(p) for kind, p in events[:rename_at] if kind == "fsync"}
    assert {"a.bin", "b.bin"} <= synced, events
    assert ("fsync", str(tmp_path)) in events[rename_at:]  # then the parent directory


def test_broadcast_on_full_disk_leaves_the_previous_one_stable(small_disk):
    from primejax.transports.weights.filesystem.broadcast import is_stable, stable_steps, write_broadcast

    disk, mode = small_disk
    if mode != "tmpfs":
        pytest.skip("needs a real small disk")
    write_broadcast(disk, 1, lambda d: (d / "model.safetensors").write_bytes(os.urandom(100_000)))
    with pytest.raises(OSError) as err:
        write_broadcast(disk, 2, lambda d: (d / "model.safetensors").write_bytes(os.urandom(3_000_000)))
    from primejax.utils.disk import disk_full_line, is_disk_full

    assert is_disk_full(err.value)
    assert stable_steps(disk) == [1] and is_stable(disk / "broadcasts" / "step_1")
    assert [p.name for p in (disk / "broadcasts").iterdir()] == ["step_1"]  # the temp dir was removed
    line = disk_full_line(disk / "broadcasts", "broadcast step 2")
    assert str(disk) in line and "MB free" in line


def test_an_io_error_line_names_the_runs_disk_and_the_error(tmp_path):
    """Issue 48: the trainer's disk-full line for an export whose error names no file said `under .` on the
    filesystem at `/` (the process's cwd), and an EIO ended in a traceback. Both are one line about the run's
    directory now (`primejax/entrypoints/trainer.py` prints it)."""
    import errno

    from primejax.utils.disk import io_error_line, mount_point

    full = io_error_line(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), tmp_path, "its outputs")
    assert full.startswith(
        f"disk full: no space left writing its outputs under {tmp_path} on the filesystem at "
        f"{mount_point(tmp_path)} ("
    ), full
    eio = io_error_line(OSError(errno.EIO, os.strerror(errno.EIO), str(tmp_path / "x.safetensors")), tmp_path,
                        "its outputs")  # fmt: skip
    assert eio == f"I/O error writing its outputs under {tmp_path / 'x.safetensors'}: Input/output error"


@pytest.mark.parametrize(("code", "raised"), [("EIO", True), ("ENOSPC", True), ("EINVAL", False)])
def test_a_directory_fsync_failure_is_raised_unless_the_filesystem_cannot_fsync_dirs(
    tmp_path, monkeypatch, code, raised
):
    """Issue 48: every error of a directory's fsync was swallowed, so a rename that may not be on disk (EIO)
    counted as written. A filesystem that cannot fsync directories (EINVAL) is still tolerated."""
    import errno
    import stat

    from primejax.utils.io import atomic_write_bytes

    real = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            n = getattr(errno, code)
            raise OSError(n, os.strerror(n))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    if raised:
        with pytest.raises(OSError) as err:
            atomic_write_bytes(tmp_path / "f.bin", b"data")
        assert err.value.errno == getattr(errno, code)
    else:
        atomic_write_bytes(tmp_path / "f.bin", b"data")
    assert (tmp_path / "f.bin").read_bytes() == b"data"  # the file itself was written and synced
