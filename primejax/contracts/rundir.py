"""The run directory: one per run, shared by every process through files only (docs/configuration.md).

    <output_dir>/<name>/
      configs/<process>.json        resolved config of each process
      rollouts/step_N/              orchestrator -> trainer (primejax.contracts.batch)
      broadcasts/step_N/            trainer -> inference (primejax.transports.weights.filesystem.broadcast)
      checkpoints/step_N/{trainer,orchestrator}/
      sft/final/                    the SFT warm-up's model
      tensorboard/<process>/        metrics/<process>.jsonl        logs/<process>.log
      metrics/<process>.run.json    tables/<process>/<name>.jsonl  wandb/   what each process ran, its tables, W&B
      timeline/step_N.json          the orchestrator's Chrome/Perfetto trace of step N
      transfers/                    collective weight-transfer offers (primejax.transports.weights.collective.offer)
      stale/<time>/  previous/<time>/  what a resume set aside; an earlier run's outputs (launcher.resume)
      pids.json  .lock  admin_token the launcher's children; its lock on the directory; the admin secret

`RunDir` names every one of these paths and `step_name` / `parse_step` / `step_dirs` are the one spelling
and reading of `step_N`; no other module spells them. `RunConfig` is the `run` config section.
"""

from __future__ import annotations

import os
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
    resume_step: str = option(
        "",
        "'' = the launcher resumes from the newest checkpoint pair when the run directory has one (a process "
        "started alone starts fresh), 'latest', or a step number",
    )
    fresh: bool = option(
        False, "start over even when the run directory has a checkpoint (the old run is kept under previous/)"
    )

    def check(self) -> None:
        if self.fresh and self.resume_step:
            raise ConfigError("fresh", f"contradicts run.resume_step={self.resume_step!r}: set one of them")
        if self.resume_step not in ("", "latest") and not self.resume_step.isdigit():
            raise ConfigError(
                "resume_step", f"must be '', 'latest' or a step number, got {self.resume_step!r}"
            )
        if not _NAME.match(self.name):
            raise ConfigError(
                "name",
                "must be a plain directory name (letters, digits, '_', '-', '.', not starting "
                f"with '.' or '-', no '/' or '~'), got {self.name!r}",
            )
        out = self.output_dir
        if not out or out.startswith("~") or Path(out).resolve() == Path(Path(out).resolve().anchor):
            raise ConfigError(
                "output_dir", f"must be a directory below the filesystem root (no '~'), got {out!r}"
            )

    @property
    def dir(self) -> Path:
        return Path(self.output_dir) / self.name


STEP_PREFIX = "step_"
_STEP = re.compile(r"^step_(\d+)$")


def step_name(step: int) -> str:
    """The name of step `step`'s directory under rollouts/, broadcasts/ and checkpoints/."""
    return f"{STEP_PREFIX}{int(step)}"


def parse_step(path: str | os.PathLike) -> int | None:
    """N for a path whose last component is `step_N` (a trailing '/' allowed), else None."""
    m = _STEP.match(Path(path).name)
    return int(m.group(1)) if m else None


def step_dirs(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """The `step_N` entries of `directory` as (N, path), by step; [] when it does not exist.

    The one reading of the per-step layout (rollouts/, broadcasts/, checkpoints/); temp entries of unfinished
    writes (`.step_N.*.tmp`) never match.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = ((parse_step(p), p) for p in directory.iterdir())
    return sorted((n, p) for n, p in found if n is not None)


class RunDir:
    """The run directory's layout: every path a process reads or writes in it is named here and nowhere else."""

    ROLLOUTS, BROADCASTS, CHECKPOINTS = "rollouts", "broadcasts", "checkpoints"
    STEP_DIRS = (ROLLOUTS, BROADCASTS, CHECKPOINTS)
    PIDS_FILE = "pids.json"  # the launcher's live children, by name
    LOCK_FILE = ".lock"  # held (flock) by the launcher of a live run
    ADMIN_TOKEN_FILE = "admin_token"  # the inference servers' admin secret (0600)
    TRANSFERS = "transfers"  # collective-transfer offers: owned by a live trainer, never outlive it
    CLUSTER = (
        "cluster"  # a scheduler's job files (SLURM script and logs, k8s manifests): kept across fresh starts
    )
    # What a fresh start moves aside (configs/ is this invocation's own): only primejax's entries, anything else
    # (a user's files, a project a run directory was pointed at by mistake) is never touched.
    ENTRIES = frozenset(
        {
            *STEP_DIRS,
            "logs",
            "metrics",
            "tensorboard",
            "tables",
            "timeline",
            "wandb",
            "sft",
            "stale",
            PIDS_FILE,
            ADMIN_TOKEN_FILE,
            TRANSFERS,
        }
    )

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def __fspath__(self) -> str:
        return str(self.root)

    def config(self, process: str) -> Path:
        return self.root / "configs" / f"{process}.json"

    def rollouts(self, step: int | None = None) -> Path:
        """rollouts/ or rollouts/step_N: the orchestrator's batches for the trainer (primejax.contracts.batch)."""
        return self._step(self.ROLLOUTS, step)

    def broadcasts(self, step: int | None = None) -> Path:
        """broadcasts/ or broadcasts/step_N: the trainer's weights for inference (primejax.transports.weights.filesystem.broadcast)."""
        return self._step(self.BROADCASTS, step)

    def checkpoints(self, step: int | None = None, process: str | None = None) -> Path:
        """checkpoints/, checkpoints/step_N or checkpoints/step_N/<process> (trainer, orchestrator)."""
        path = self._step(self.CHECKPOINTS, step)
        return path / process if process else path

    def broadcast_export_tmp(self, step: int) -> Path:
        """The temp directory several trainer processes fill with their shares of broadcasts/step_N."""
        final = self.broadcasts(step)
        return final.with_name(f".{final.name}.export.tmp")

    def stale(self, stamp: str) -> Path:
        """stale/<stamp>/: the outputs of steps after a resume point, set aside (launcher.resume)."""
        return self.root / "stale" / stamp

    def previous(self, stamp: str) -> Path:
        """previous/<stamp>/: an earlier run's outputs, moved aside by a fresh start in the same directory."""
        return self.root / "previous" / stamp

    def transfers(self, step: int | None = None) -> Path:
        """transfers/ or transfers/step_N.json: the trainer's offer of a collective update
        (primejax.transports.weights.collective.offer)."""
        root = self.root / self.TRANSFERS
        return root if step is None else root / f"{step_name(step)}.json"

    def set_aside_transfers(self, dest: str | os.PathLike) -> list[Path]:
        """Move every offer to `dest/transfers/` (a launcher starting or resuming a run: no trainer of it is
        alive yet, so each offer is a dead trainer's and would stall the weights' watcher); return them."""
        root = self.transfers()
        moved: list[Path] = []
        if not root.is_dir():
            return moved
        for p in sorted(root.iterdir()):
            if p.is_file():
                target = Path(dest) / self.TRANSFERS / p.name
                target.parent.mkdir(parents=True, exist_ok=True)
                p.rename(target)
                moved.append(target)
        return moved

    def _step(self, kind: str, step: int | None) -> Path:
        return self.root / kind if step is None else self.root / kind / step_name(step)

    @property
    def sft_final(self) -> Path:
        """The SFT warm-up's exported model, where RL starts from."""
        return self.root / "sft" / "final"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, process: str) -> Path:
        return self.logs / f"{process}.log"

    def metrics(self, process: str) -> Path:
        return self.root / "metrics" / f"{process}.jsonl"

    def tensorboard(self, process: str) -> Path:
        return self.root / "tensorboard" / process

    def run_info(self, process: str) -> Path:
        """What `process` ran: its resolved config and primejax's git commit (primejax.utils.monitor)."""
        return self.root / "metrics" / f"{process}.run.json"

    def table(self, process: str, name: str) -> Path:
        """tables/<process>/<name>.jsonl: one row per line (a '/' in `name` becomes '.')."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name.replace("/", "."))
        return self.root / "tables" / process / f"{safe}.jsonl"

    def timeline(self, step: int | None = None) -> Path:
        """timeline/ or timeline/step_N.json: the orchestrator's trace of step N (primejax.orchestrator.timeline)."""
        root = self.root / "timeline"
        return root if step is None else root / f"{step_name(step)}.json"

    @property
    def wandb(self) -> Path:
        """W&B's directory (each process's run lands in wandb/wandb/offline-run-* or run-*)."""
        return self.root / "wandb"

    @property
    def pids_file(self) -> Path:
        return self.root / self.PIDS_FILE

    @property
    def lock_file(self) -> Path:
        return self.root / self.LOCK_FILE

    @property
    def admin_token(self) -> Path:
        return self.root / self.ADMIN_TOKEN_FILE

    def cluster(self, name: str) -> Path:
        return self.root / self.CLUSTER / name


def run_dir(run: RunConfig) -> Path:
    return run.dir


def checkpoint_dir(root: str | Path, step: int, process: str) -> Path:
    return RunDir(root).checkpoints(step, process)


def log_path(root: str | Path, process: str) -> Path:
    return RunDir(root).log(process)


def config_path(root: str | Path, process: str) -> Path:
    return RunDir(root).config(process)


def write_resolved_config(root: str | Path, process: str, text: str) -> Path:
    """Record the exact config a process ran with, for reproducibility (and for the launcher's children)."""
    path = config_path(root, process)
    atomic_write_text(path, text)
    return path
