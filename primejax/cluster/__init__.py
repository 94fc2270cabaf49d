"""Multi-node runs on the scheduler a cluster already has: SLURM (`slurm.py` writes the job script,
`slurm_job.py` runs inside it) and Kubernetes (`k8s.py` writes the manifests). docs/multinode.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from primejax.config import Config


def generate(cfg: Config, scheduler: str, submit: bool = False) -> int:
    """`python -m primejax.train --launcher {slurm,k8s}`: write the job's files (SLURM: and submit when asked)."""
    if cfg.judge.enabled:  # the judge server is the single-node launcher's (primejax/envs/judge.py)
        import sys

        print(f"error: judge.enabled: --launcher {scheduler} starts no judge server; give the envs' judges an "
              "address (their judge.base_url and model)", file=sys.stderr)  # fmt: skip
        return 2
    if scheduler == "slurm":
        from primejax.cluster.slurm import generate as slurm

        return slurm(cfg, submit_job=submit)
    from primejax.cluster.k8s import generate as k8s

    return k8s(cfg)
