"""How the launcher starts one of a run's processes, and the record of the live ones.

A child is `python -m <module> --config <run>/configs/<process>.json` on the resolved config, in its own process
group (utils/procs.py), its output in `<run>/logs/<process>.log`; the same file starts it by hand on another host.
`<run>/pids.json` names the launcher and every live child.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from primejax.config import Config
from primejax.contracts.rundir import RunDir, log_path, write_resolved_config
from primejax.inference.admin_auth import TOKEN_ENV
from primejax.utils.devices import accelerator_env
from primejax.utils.io import atomic_write_json
from primejax.utils.procs import ChildProcess


def child_env(devices: str, platform_cpu: bool, memory_fraction: float = 0.0) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    # the run's admin secret (launch() sets it): server and orchestrator share it
    if os.environ.get(TOKEN_ENV):
        env[TOKEN_ENV] = os.environ[TOKEN_ENV]
    env.update(accelerator_env(devices, memory_fraction))  # a node's layout (utils/devices.py): config wins
    if platform_cpu:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def start_child(
    cfg: Config,
    process: str,
    module: str,
    devices: str = "",
    memory_fraction: float = 0.0,
    hide_gpus: bool = False,
) -> ChildProcess:
    """Start `python -m module` on the resolved config (written to configs/<process>.json); `hide_gpus`: the
    child sees no GPU and runs JAX on the CPU."""
    config_path = write_resolved_config(cfg.run_dir, process, cfg.to_json())
    env = child_env(devices, hide_gpus or os.environ.get("JAX_PLATFORMS") == "cpu", memory_fraction)
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return ChildProcess(
        process,
        [sys.executable, "-m", module, "--config", str(config_path)],
        log_path(cfg.run_dir, process),
        env=env,
    )


def write_pids(root: Path, children: list[ChildProcess]) -> None:
    atomic_write_json(RunDir(root).pids_file, {"launcher": os.getpid(), **{c.name: c.pid for c in children}})
