"""What each pod of a Kubernetes run runs (the manifests: primejax/cluster/k8s.py).

`python -m primejax.cluster.k8s_task ROLE --config /etc/primejax/train.json`:
- `driver`: settles what to resume from and writes every process's config (primejax/cluster/prepare.py), then
  marks this JobSet attempt ready (`<run>/cluster/ready-<jobset uid>-<attempt>`) and runs the orchestrator;
  its exit status is the orchestrator's.
- `trainer`: waits for its attempt's ready mark (`k8s.start_timeout_s`), then becomes
  `python -m primejax.trainer` on the driver's trainer config; its rank is the pod's completion index
  (PRIMEJAX_PROCESS_ID, from the manifest's downward API).
- `inference`: becomes `python -m primejax.inference` on the run's config (bound to 0.0.0.0 by the manifests).
The admin secret comes from the Secret through the environment ($PRIMEJAX_ADMIN_TOKEN).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from primejax.contracts.rundir import RunDir

if TYPE_CHECKING:
    from primejax.config import Config

ROLES = ("driver", "trainer", "inference")
POLL_S = 2.0


class TaskError(RuntimeError):
    """A pod started without what its role needs: one line, exit status 2."""


def ready_mark(cfg: Config, environ: Mapping[str, str]) -> Path:
    """This JobSet attempt's mark: a new JobSet (new uid) or a restart (new attempt) never sees an old one."""
    uid, attempt = environ.get("PRIMEJAX_JOBSET_UID", ""), environ.get("PRIMEJAX_RESTART_ATTEMPT", "")
    if not uid or not attempt.isdigit():
        raise TaskError(
            "PRIMEJAX_JOBSET_UID and PRIMEJAX_RESTART_ATTEMPT must be set (the JobSet's pod labels, "
            "see primejax/cluster/k8s.py)"
        )
    return RunDir(cfg.run_dir).cluster(f"ready-{uid}-{attempt}")


def wait_ready(mark: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not mark.exists():
        left = deadline - time.monotonic()
        if left <= 0:
            raise TaskError(
                f"the driver did not prepare the run within k8s.start_timeout_s={timeout_s:g} ({mark})"
            )
        time.sleep(min(POLL_S, left))


def _exec(module: str, config: Path) -> int:
    os.execv(sys.executable, [sys.executable, "-m", module, "--config", str(config)])
    return 1  # unreachable


def run_driver(cfg: Config, environ: Mapping[str, str]) -> int:
    from primejax.cluster.prepare import prepare
    from primejax.launcher.resume import RunAlreadyDone
    from primejax.launcher.runlock import RunLock
    from primejax.utils.io import atomic_write_text

    mark = ready_mark(cfg, environ)
    with RunLock(cfg.run_dir):
        try:
            cfg, start, configs = prepare(cfg)
        except RunAlreadyDone as done:  # the trainer pods wait for a mark that never comes: say why here
            print(f"primejax: {done}", flush=True)
            return 0
        atomic_write_text(mark, str(start))
        print(f"primejax: run {cfg.run_dir} prepared at step {start}; starting the orchestrator", flush=True)
        return subprocess.call(
            [sys.executable, "-m", "primejax.orchestrator", "--config", str(configs["orchestrator"])]
        )


def main() -> int:
    argv = sys.argv[1:]
    if len(argv) != 3 or argv[0] not in ROLES or argv[1] != "--config":
        print(
            f"usage: python -m primejax.cluster.k8s_task {{{','.join(ROLES)}}} --config FILE", file=sys.stderr
        )
        return 2
    from primejax.config import from_json, typed
    from primejax.launcher.preflight import PreflightError

    role, config = argv[0], Path(argv[2])
    cfg = typed(from_json(config.read_text()))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        if role == "inference":
            return _exec("primejax.inference", config)
        if role == "driver":
            return run_driver(cfg, os.environ)
        wait_ready(ready_mark(cfg, os.environ), cfg.k8s.start_timeout_s)
        return _exec("primejax.trainer", RunDir(cfg.run_dir).config("trainer"))
    except (TaskError, PreflightError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from primejax.config.cli import run_main

    run_main(main)
