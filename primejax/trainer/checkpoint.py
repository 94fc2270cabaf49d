"""Full trainer checkpoints: `checkpoints/step_N/trainer/{state/, meta.json}` (Orbax + a JSON completion marker).

`state/` is the whole TrainState (fp32 params, optimizer state, step, RNG) saved by Orbax, asynchronously
when `trainer.checkpoint.async_save` is on: the save of step N runs in the background while training goes
on, and is finalized (waited for, then `meta.json` written, then old checkpoints pruned) at the next save or
at `close()`. `meta.json` is the completion marker and holds the data position (the next rollout step to
read), the config fingerprint and the size of every file under `state/`; a directory without it is an
interrupted save and is ignored, and one whose files no longer match it (a truncated or lost file) is
skipped by `run.resume_step=latest`, which falls back to the previous complete checkpoint.
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

from primejax.utils.io import atomic_write_json, step_dirs

log = logging.getLogger("primejax.trainer")
META = "meta.json"


def trainer_ckpt_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step}" / "trainer"


def complete_steps(run_dir: str | Path, verified: bool = False) -> list[int]:
    """Steps with a completion marker; with `verified`, only those whose files still match it."""
    steps = [s for s, p in step_dirs(Path(run_dir) / "checkpoints") if (p / "trainer" / META).is_file()]
    if verified:
        steps = [s for s in steps if checkpoint_problem(run_dir, s) is None]
    return steps


def _state_files(state_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(state_dir)): p.stat().st_size for p in sorted(state_dir.rglob("*")) if p.is_file()}


def checkpoint_problem(run_dir: str | Path, step: int) -> str | None:
    """Why checkpoint `step` cannot be restored (missing marker, unreadable, a file lost or resized), or None."""
    path = trainer_ckpt_dir(run_dir, step)
    try:
        meta = json.loads((path / META).read_text())
    except FileNotFoundError:
        return "incomplete (no meta.json)"
    except json.JSONDecodeError as e:
        return f"unreadable meta.json ({e.msg})"
    expected = meta.get("files")
    if expected is None:  # written before sizes were recorded: nothing to compare
        return None
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
            log.warning("trainer checkpoint step %d is damaged (%s): falling back to an older one", step, problem)
        return None
    step = int(resume_step)
    if step not in complete_steps(run_dir):
        raise FileNotFoundError(f"run.resume_step={step}: no complete trainer checkpoint (have "
                                f"{complete_steps(run_dir)})")
    problem = checkpoint_problem(run_dir, step)
    if problem is not None:
        raise FileNotFoundError(f"run.resume_step={step}: trainer checkpoint damaged: {problem}")
    return step


class TrainerCheckpointer:
    def __init__(self, run_dir: str | Path, keep: int = 2, async_save: bool = True):
        self.run_dir = Path(run_dir).absolute()  # Orbax refuses relative paths (run.output_dir usually is one)
        self.keep = keep
        self.async_save = async_save
        self._ckptr = ocp.StandardCheckpointer() if async_save else ocp.Checkpointer(ocp.StandardCheckpointHandler())
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
        self._ckptr.save(path / "state", state)
        self._pending = (step, meta)
        if not self.async_save:
            self.finalize()

    def finalize(self) -> None:
        """Wait for the pending save, mark it complete, prune old checkpoints."""
        if self._pending is None:
            return
        if self.async_save:
            self._ckptr.wait_until_finished()
        step, meta = self._pending
        self._pending = None
        if jax.process_index() == 0:
            path = trainer_ckpt_dir(self.run_dir, step)
            files = _state_files(path / "state")
            atomic_write_json(path / META, {"step": step, **meta, "files": files})
            self._prune()

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for step in complete_steps(self.run_dir)[: -self.keep]:
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
