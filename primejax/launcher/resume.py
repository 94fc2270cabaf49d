"""What a restarted run resumes from, and what of the dead run's outputs must step out of its way.

The trainer and the orchestrator checkpoint independently (`checkpoints/step_N/{trainer,orchestrator}/`), and a
kill leaves them at different steps, plus rollouts, broadcasts and checkpoints past the point both reached.
The launcher resumes both from the newest step S that both have intact, and moves every output of a step
after S into `stale/<time>/` (moved, never deleted): the orchestrator then writes the batches of S+1.. again,
the trainer never reads a batch from the dead run's lineage, and the orchestrator never loads weights newer
than the policy it resumes with. A fresh start in a directory that already holds a run keeps that run the
same way, under `previous/<time>/`.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from primejax.contracts.rundir import RunDir, step_dirs
from primejax.launcher.preflight import PreflightError

STEP_DIRS = RunDir.STEP_DIRS
RUN_ENTRIES = RunDir.ENTRIES


def common_resume_step(root: str | Path, resume_step: str) -> int | None:
    """The step both processes resume from: None = a fresh run ('' or 'latest' with nothing to resume)."""
    if resume_step == "":
        return None
    from primejax.orchestrator.checkpoint import saved_steps  # deferred: these pull in JAX/Orbax
    from primejax.trainer.checkpoint import checkpoint_problem, complete_steps

    trainer = set(complete_steps(root, verified=True))
    orchestrator = set(saved_steps(root))
    common = sorted(trainer & orchestrator)
    if resume_step == "latest":
        for step in sorted(set(complete_steps(root)) - trainer):
            print(
                f"primejax: trainer checkpoint step {step} is damaged ({checkpoint_problem(root, step)}); "
                "not resuming from it",
                flush=True,
            )
        return common[-1] if common else None
    step = int(resume_step)
    if step not in common:
        raise PreflightError(
            "run.resume_step",
            f"step {step} has no intact trainer and orchestrator checkpoint "
            f"in {root} (both have: {common or 'none'})",
        )
    return step


class RunAlreadyDone(Exception):
    """The run directory's checkpoints already reach run.max_steps: nothing to resume."""


def launcher_resume_step(root: str | Path, run: Any) -> int | None:
    """What the launcher resumes from (None = a fresh start). Rerunning the same command resumes: `resume_step`
    '' means the newest intact checkpoint pair when there is one; `run.fresh` starts over. A run whose
    checkpoint already reaches `run.max_steps` raises RunAlreadyDone."""
    resume = common_resume_step(root, "" if run.fresh else (run.resume_step or "latest"))
    if resume is not None and resume >= run.max_steps:
        raise RunAlreadyDone(
            f"{root} already finished at step {resume} (run.max_steps={run.max_steps}): "
            "raise run.max_steps to train on, or add --config.run.fresh=True to start over"
        )
    return resume


def resume_hint(root: str | Path, max_steps: int | None = None) -> str:
    """How to go on after an interruption: the same command resumes from the newest checkpoint pair (the step
    `launcher_resume_step` will pick: read once every process stopped)."""
    try:
        step = common_resume_step(root, "latest")
    except Exception:  # noqa: BLE001 - a hint must never mask the interruption
        step = None
    if step is None:
        return "no checkpoint was written yet: rerunning the same command starts over"
    if max_steps is not None and step >= max_steps:
        return f"the run's checkpoint already reaches run.max_steps={max_steps}: raise it to train on"
    return (
        f"rerun the same command to resume from step {step} (its newest checkpoint); "
        "add --config.run.fresh=True to start over"
    )


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def set_aside_after(root: str | Path, step: int) -> list[Path]:
    """Move the outputs of steps > `step` to `stale/<time>/`, drop interrupted temp writes; return what moved."""
    root = Path(root)
    dest = RunDir(root).stale(_stamp())
    moved = []
    for kind in STEP_DIRS:
        directory = root / kind
        if not directory.is_dir():
            continue
        for p in sorted(directory.iterdir()):
            if p.name.startswith(".") and (p.name.endswith(".tmp") or p.name.endswith(".old")):
                # Garbage of a writer killed inside atomic_dir / atomic_write: never a complete output.
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        for s, p in step_dirs(directory):
            if s > step:
                target = dest / kind / p.name
                target.parent.mkdir(parents=True, exist_ok=True)
                p.rename(target)
                moved.append(target)
    moved += RunDir(root).set_aside_transfers(dest)
    return moved


def keep_previous_run(root: str | Path) -> Path | None:
    """A fresh run in a used directory: move the earlier run's outputs (only entries primejax creates, see
    RUN_ENTRIES) to `previous/<time>/`, return it."""
    root = Path(root)
    if not root.is_dir():
        return None
    # configs/ holds this run's own resolved configs already; previous/ is where the move goes.
    entries = [p for p in root.iterdir() if p.name in RUN_ENTRIES]
    if not entries:
        return None
    dest = RunDir(root).previous(_stamp())
    dest.mkdir(parents=True, exist_ok=True)
    for p in entries:
        p.rename(dest / p.name)
    return dest
