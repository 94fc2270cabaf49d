"""The run directory: one per run, shared by every process through files only (ARCHITECTURE.md §Run directory).

    <output_dir>/<name>/
      configs/<process>.json        resolved config of each process
      rollouts/step_N/              orchestrator -> trainer (primejax.contracts.batch)
      broadcasts/step_N/            trainer -> inference (primejax.contracts.broadcast)
      checkpoints/step_N/{trainer,orchestrator}/
      tensorboard/<process>/        metrics/<process>.jsonl        logs/<process>.log
"""

from __future__ import annotations

from pathlib import Path

from ml_collections import ConfigDict

from primejax.config import to_json
from primejax.utils.io import atomic_write_text


def run_dir(cfg: ConfigDict) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def checkpoint_dir(root: str | Path, step: int, process: str) -> Path:
    return Path(root) / "checkpoints" / f"step_{step}" / process


def log_path(root: str | Path, process: str) -> Path:
    return Path(root) / "logs" / f"{process}.log"


def write_resolved_config(cfg: ConfigDict, process: str) -> Path:
    """Record the exact config a process ran with, for reproducibility (and for the launcher's children)."""
    path = run_dir(cfg) / "configs" / f"{process}.json"
    atomic_write_text(path, to_json(cfg))
    return path
