"""A run as one SLURM job: `python -m primejax.train --launcher slurm --config X [--submit]`.

Writes `<run>/cluster/job.sbatch` (and with `--submit` hands it to `sbatch`): one allocation of
`slurm.trainer_nodes + slurm.inference_nodes` nodes on the run directory's shared filesystem. The script only
starts `python -m primejax.cluster.slurm_job` in the batch step, which reads the job's node list, splits it
into trainer and inference nodes, and starts the processes with `srun` (primejax/cluster/slurm_job.py).
Submitting the same script again resumes the run from its newest checkpoint pair, as rerunning the local
launcher does (`--requeue` lets SLURM do it after a node failure).

One allocation split by the node list rather than a heterogeneous job (`#SBATCH hetjob`): it needs no site
support for heterogeneous jobs, and it can be tested on a one-node SLURM, where slurm-wlm 22.05's backfill
scheduler never starts two components of a heterogeneous job on the same node (docs/multinode.md).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from primejax.contracts.rundir import RunDir, write_resolved_config

if TYPE_CHECKING:
    from primejax.config import Config


def script_path(root: str | Path) -> Path:
    return RunDir(root).cluster("job.sbatch")


def render_script(cfg: Config, config_path: Path) -> str:
    """The sbatch script of the run: resource lines, then one driver process (primejax.cluster.slurm_job)."""
    s = cfg.slurm
    root = Path(cfg.run_dir).resolve()
    python = s.python or sys.executable
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=primejax-{cfg.run.name}",
        f"#SBATCH --nodes={s.nodes}",
        # room for the widest step on a node (the steps share the CPUs: srun --overlap); each asks its own count
        f"#SBATCH --ntasks-per-node={max(s.trainer_tasks_per_node, cfg.inference.replicas)}",
        f"#SBATCH --cpus-per-task={s.cpus_per_task}",
        f"#SBATCH --output={RunDir(root).cluster('job-%j.out')}",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",  # after a node failure SLURM may start the script again: it resumes
        "#SBATCH --signal=B:TERM@120",  # before the time limit: the driver stops every step (checkpoints kept)
    ]
    if s.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={s.gpus_per_node}")
    if s.exclusive:
        lines.append("#SBATCH --exclusive")
    for key in ("partition", "account", "qos", "time"):
        if getattr(s, key):
            lines.append(f"#SBATCH --{key}={getattr(s, key)}")
    lines += [f"#SBATCH {arg}" for arg in s.extra_args]
    lines += [
        "# Written by `python -m primejax.train --launcher slurm`; submit it again to resume the run.",
        "set -euo pipefail",
        *s.setup,
        f"cd {shlex.quote(str(Path.cwd()))}",
        # exec: SLURM's signals (scancel, --signal) reach the driver itself, which stops every step
        f"exec {shlex.quote(python)} -m primejax.cluster.slurm_job --config {shlex.quote(str(config_path))}",
        "",
    ]
    return "\n".join(lines)


def write_script(cfg: Config) -> Path:
    """Record the resolved config (`configs/train.json`) and write the job script beside it; return the script."""
    root = Path(cfg.run_dir).resolve()
    config = write_resolved_config(root, "train", cfg.to_json())
    path = script_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_script(cfg, config))
    return path


def submit(script: Path) -> str:
    """`sbatch --parsable script`: the job id. Raises RuntimeError with sbatch's own message."""
    proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout.strip().split(";")[0]


def generate(cfg: Config, submit_job: bool = False) -> int:
    """The `--launcher slurm` entry: write the script, submit it when asked; the exit status."""
    path = write_script(cfg)
    print(
        f"primejax: SLURM job script written to {path} ({cfg.slurm.trainer_nodes} trainer node(s) x "
        f"{cfg.slurm.trainer_tasks_per_node} task(s), {cfg.slurm.inference_nodes} inference node(s))",
        flush=True,
    )
    if not submit_job:
        print(f"primejax: submit it with `sbatch {path}` (again to resume)", flush=True)
        return 0
    try:
        job = submit(path)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"primejax: submitted job {job}; its log: {RunDir(path.parents[1]).cluster(f'job-{job}.out')}",
        flush=True,
    )
    return 0
