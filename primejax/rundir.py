"""The run directory: one per run, shared by every process through files only (docs/configuration.md).

    <output_dir>/<name>/
      configs/<process>.json        resolved config of each process
      rollouts/step_N/              orchestrator -> trainer (primejax.contracts.batch)
      broadcasts/step_N/            trainer -> inference (primejax.contracts.broadcast)
      checkpoints/step_N/{trainer,orchestrator}/
      tensorboard/<process>/        metrics/<process>.jsonl        logs/<process>.log
"""

from __future__ import annotations

import re
from pathlib import Path

from primejax.utils.io import atomic_write_text
from primejax.utils.sections import MAX_STEPS, ConfigError, Section, option, section

# A run name is one plain directory name: no separators, no '.'/'..', no '~' or leading '-' or '.'.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=@-]*$")


@section
class RunConfig(Section):
    """`run`: the run's name, where it writes, how long it runs, and what it resumes from."""

    name: str = option("default", "the run directory is <output_dir>/<name>")
    output_dir: str = option("outputs", "parent of run directories")
    max_steps: int = option(20, "training steps", gt=0, le=MAX_STEPS)
    seed: int = option(0, "seed of initialization, sampling order and the server", ge=0)
    resume_step: str = option("", "'' = fresh run, 'latest', or a step number")

    def check(self) -> None:
        if self.resume_step not in ("", "latest") and not self.resume_step.isdigit():
            raise ConfigError("resume_step", f"must be '', 'latest' or a step number, got {self.resume_step!r}")
        if not _NAME.match(self.name):
            raise ConfigError("name", "must be a plain directory name (letters, digits, '_', '-', '.', not starting "
                                      f"with '.' or '-', no '/' or '~'), got {self.name!r}")
        out = self.output_dir
        if not out or out.startswith("~") or Path(out).resolve() == Path(Path(out).resolve().anchor):
            raise ConfigError("output_dir", f"must be a directory below the filesystem root (no '~'), got {out!r}")

    @property
    def dir(self) -> Path:
        return Path(self.output_dir) / self.name


def run_dir(run: RunConfig) -> Path:
    return run.dir


def checkpoint_dir(root: str | Path, step: int, process: str) -> Path:
    return Path(root) / "checkpoints" / f"step_{step}" / process


def log_path(root: str | Path, process: str) -> Path:
    return Path(root) / "logs" / f"{process}.log"


def config_path(root: str | Path, process: str) -> Path:
    return Path(root) / "configs" / f"{process}.json"


def write_resolved_config(root: str | Path, process: str, text: str) -> Path:
    """Record the exact config a process ran with, for reproducibility (and for the launcher's children)."""
    path = config_path(root, process)
    atomic_write_text(path, text)
    return path
