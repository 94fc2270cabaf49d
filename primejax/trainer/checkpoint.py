"""Full trainer checkpoints: `checkpoints/step_N/trainer/{state/, meta.json}` (Orbax + a JSON completion marker).

`state/` is the whole TrainState (fp32 params, optimizer state, step, RNG) saved by Orbax, asynchronously
when `trainer.checkpoint.async_save` is on: the save of step N runs in the background while training goes
on, and is finalized (waited for, then `meta.json` written, then old checkpoints pruned) at the next save or
at `close()`. `meta.json` is the completion marker and holds the data position (the next rollout step to
read), the model path it started from and the size of every file under `state/`; a directory without it is an
interrupted save and is ignored, and one whose files no longer match it (a truncated or lost file) is
skipped by `run.resume_step=latest`, which falls back to the previous complete checkpoint.

A save counts only once Orbax committed it (`state/` renamed from its temp name) and `meta.json` lists its
files; a save that failed (a full disk) is removed and raises `CheckpointError` with one line naming the disk,
and older checkpoints are pruned only after a newer one verified.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from primejax.contracts.rundir import RunDir, step_dirs
from primejax.utils.disk import disk_full_line, is_disk_full
from primejax.utils.faults import fault_point
from primejax.utils.io import atomic_write_json

log = logging.getLogger("primejax.trainer")
META = "meta.json"


class CheckpointError(RuntimeError):
    """A trainer checkpoint could not be saved (it was removed; the older ones are untouched)."""


def trainer_ckpt_dir(run_dir: str | Path, step: int) -> Path:
    return RunDir(run_dir).checkpoints(step, "trainer")


def complete_steps(run_dir: str | Path, verified: bool = False) -> list[int]:
    """Steps with a completion marker; with `verified`, only those whose files still match it."""
    steps = [
        s
        for s, _ in step_dirs(RunDir(run_dir).checkpoints())
        if (trainer_ckpt_dir(run_dir, s) / META).is_file()
    ]
    if verified:
        steps = [s for s in steps if checkpoint_problem(run_dir, s) is None]
    return steps


def _state_files(state_dir: Path) -> dict[str, int]:
    return {
        str(p.relative_to(state_dir)): p.stat().st_size for p in sorted(state_dir.rglob("*")) if p.is_file()
    }


def checkpoint_problem(run_dir: str | Path, step: int) -> str | None:
    """Why checkpoint `step` cannot be restored (missing marker, unreadable, a file lost or resized), or None."""
    path = trainer_ckpt_dir(run_dir, step)
    try:
        meta = json.loads((path / META).read_text())
    except FileNotFoundError:
        return "incomplete (no meta.json)"
    except json.JSONDecodeError as e:
        return f"unreadable meta.json ({e.msg})"
    if not isinstance(meta, dict):
        return "meta.json is not an object"
    expected = meta.get("files")
    if expected is None:  # written before sizes were recorded: nothing to compare
        return None
    if not (path / "state").is_dir():
        return "state/ is missing (the save was never committed)"
    if not isinstance(expected, dict) or not expected:
        return "meta.json lists no state files (the save was never committed)"
    actual = _state_files(path / "state")
    for name, size in expected.items():
        if name not in actual:
            return f"state/{name} is missing"
        if actual[name] != size:
            return f"state/{name} has {actual[name]} bytes, meta.json says {size}"
    return None


def resolve_resume_step(run_dir: str | Path, resume_step: str) -> int | None:
    """'' -> None (fresh run); 'latest' -> newest intact checkpoint (None if there is none); 'N' -> N."""
    if resume_step == "":
        return None
    if resume_step == "latest":
        for step in reversed(complete_steps(run_dir)):
            problem = checkpoint_problem(run_dir, step)
            if problem is None:
                return step
            log.warning(
                "trainer checkpoint step %d is damaged (%s): falling back to an older one", step, problem
            )
        return None
    step = int(resume_step)
    if step not in complete_steps(run_dir):
        raise FileNotFoundError(
            f"run.resume_step={step}: no complete trainer checkpoint (have {complete_steps(run_dir)})"
        )
    problem = checkpoint_problem(run_dir, step)
    if problem is not None:
        raise FileNotFoundError(f"run.resume_step={step}: trainer checkpoint damaged: {problem}")
    return step


class TrainerCheckpointer:
    def __init__(self, run_dir: str | Path, keep: int = 2, async_save: bool = True):
        self.run_dir = Path(
            run_dir
        ).absolute()  # Orbax refuses relative paths (run.output_dir usually is one)
        self.keep = keep
        self.async_save = async_save
        self._ckptr = (
            ocp.StandardCheckpointer() if async_save else ocp.Checkpointer(ocp.StandardCheckpointHandler())
        )
        self._pending: tuple[int, dict[str, Any]] | None = None

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start saving `state` as step `step` (returns before the write ends when async)."""
        self.finalize()
        path = trainer_ckpt_dir(self.run_dir, step)
        if jax.process_index() == 0:
            if path.exists():  # a re-run of this step after a restart: replace it
                shutil.rmtree(path)
            path.mkdir(parents=True)
        if jax.process_count() > 1:  # the other processes write their shards under it too
            multihost_utils.sync_global_devices(f"primejax checkpoint dir {step}")
        try:
            self._ckptr.save(path / "state", state)
        except Exception as e:  # a synchronous save (or the start of an async one) failed
            self._discard(step)
            raise self._failure(step, e) from e
        self._pending = (step, meta)
        if not self.async_save:
            self.finalize()

    def finalize(self) -> None:
        """Wait for the pending save, verify and mark it complete, then prune old checkpoints.

        Raises CheckpointError (after removing the failed save) when the save did not complete."""
        if self._pending is None:
            return
        step, meta = self._pending
        self._pending = None  # taken before waiting: a failed save is never finalized a second time
        path = trainer_ckpt_dir(self.run_dir, step)
        try:
            if self.async_save:
                self._ckptr.wait_until_finished()
            fault_point("trainer.checkpoint_written", step, path=path)
            if jax.process_index() == 0:
                files = _state_files(path / "state") if (path / "state").is_dir() else {}
                if files:
                    atomic_write_json(path / META, {"step": step, **meta, "files": files})
                problem = checkpoint_problem(self.run_dir, step)
                if problem is not None:
                    raise CheckpointError(f"trainer checkpoint step {step} did not verify: {problem}")
        except Exception as e:
            self._discard(step)
            raise self._failure(step, e) from e
        if jax.process_index() == 0:
            self._prune()

    def _discard(self, step: int) -> None:
        if jax.process_index() != 0:
            return
        path = trainer_ckpt_dir(self.run_dir, step)
        (path / META).unlink(missing_ok=True)  # first, so a crash mid-delete leaves an ignored dir
        shutil.rmtree(path, ignore_errors=True)
        if path.parent.is_dir() and not any(path.parent.iterdir()):
            path.parent.rmdir()

    def _failure(self, step: int, e: Exception) -> CheckpointError:
        kept = complete_steps(self.run_dir, verified=True)
        older = f"step {kept[-1]} is still the newest checkpoint" if kept else "no older checkpoint exists"
        if is_disk_full(e):
            cause = disk_full_line(RunDir(self.run_dir).checkpoints(), f"trainer checkpoint step {step}")
        else:
            cause = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return CheckpointError(f"{cause}; the incomplete save was removed, {older}")

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        verified = complete_steps(self.run_dir, verified=True)
        if not verified:
            return
        # Only checkpoints older than the newest verified one go; a damaged newer one never displaces them.
        for step in [s for s in complete_steps(self.run_dir) if s < verified[-1]][: -self.keep + 1 or None]:
            path = trainer_ckpt_dir(self.run_dir, step)
            (path / META).unlink(missing_ok=True)  # first, so a crash mid-delete leaves an ignored dir
            shutil.rmtree(path, ignore_errors=True)
            parent = path.parent
            if parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
            log.info("pruned trainer checkpoint step %d", step)

    def restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
        """Restore step `step` into the structure, dtypes and shardings of `like` (a state or abstract one)."""
        path = trainer_ckpt_dir(self.run_dir, step)
        meta = json.loads((path / META).read_text())
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), like
        )
        return self._ckptr.restore(path / "state", abstract), meta

    def close(self) -> None:
        self.finalize()
        self._ckptr.close()
