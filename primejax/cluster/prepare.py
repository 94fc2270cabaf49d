"""What a scheduler's job does before it starts any process of the run, the same on SLURM and Kubernetes.

The local launcher's preparation (primejax.launcher.prepare): check the input, settle what to resume from (the
newest intact checkpoint pair; later outputs set aside), run the SFT warm-up when asked; then the run's admin
secret and the resolved config of every process, written to `<run>/configs/`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from primejax.contracts.rundir import write_resolved_config

if TYPE_CHECKING:
    from primejax.config import Config

PROCESSES = ("trainer", "orchestrator", "inference")


def prepare(cfg: Config) -> tuple[Config, int, dict[str, Path]]:
    """(the config the processes run, its start step, each process's config file). Sets $PRIMEJAX_ADMIN_TOKEN
    for this process and its children: the scheduler's secret when it set one, else made here, and written to
    `<run>/admin_token` (0600); never on a command line. Raises PreflightError / RunAlreadyDone as the launcher."""
    from primejax.inference.admin_auth import TOKEN_ENV, write_run_token
    from primejax.launcher.prepare import prepare_run

    cfg, start = prepare_run(cfg)
    os.environ[TOKEN_ENV] = write_run_token(cfg.run_dir)
    configs = {p: write_resolved_config(cfg.run_dir, p, cfg.to_json()) for p in PROCESSES}
    return cfg, start, configs
