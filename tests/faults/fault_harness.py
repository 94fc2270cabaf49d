"""Runs `python -m primejax.train` the way a user does, with faults armed, and inspects what it left behind.

Shared by tests/faults and tests/launcher. A run is a subprocess in its own session; after it exits, every
process group it named in `<run>/pids.json` must be gone (no orphan: a vLLM engine core or a trainer that
outlived the launcher would show up there), and no process may still mention the run directory.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
from safetensors.numpy import load_file

REPO = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 420.0
MAX_STEPS = 4

CONFIG_TEMPLATE = """
from primejax.config import default_config


def get_config():
    c = default_config()
    c.run.name = {name!r}
    c.run.output_dir = {output_dir!r}
    c.run.max_steps = {max_steps}
    c.run.seed = 0
    c.model.path = {model_dir!r}
    c.model.compute_dtype = "float32"
    c.orchestrator.envs.reverse_text.args = {{"system_prompt": "", "min_len": 3, "max_len": 6}}
    c.orchestrator.batch_size = 16
    c.orchestrator.group_size = 4
    c.orchestrator.seq_len = 128
    c.orchestrator.max_prompt_tokens = 96
    c.orchestrator.sampling.max_tokens = 16
    c.orchestrator.sampling.seed = 1234  # a seed per request: generation is reproducible on CPU
    c.orchestrator.async_level = 0  # synchronous: what each step samples does not depend on timing
    # The barrier: a batch's groups in prompt order, so runs are equal bit for bit (the continuous pool, the
    # default, cuts groups in the order they finish; its faults: tests/orchestrator/test_pool.py, test_env_workers.py,
    # test_replicas_vllm.py)
    c.orchestrator.pool.mode = "step"
    c.orchestrator.weights_poll_s = 0.1
    c.orchestrator.filters.pre_batch = ()
    c.orchestrator.filters.post_batch = ()
    c.orchestrator.checkpoint.interval = 1
    c.orchestrator.checkpoint.keep = 0  # JSON only: keep all, so any trainer checkpoint has its partner
    c.orchestrator.client.base_urls = {base_urls!r}
    c.orchestrator.client.max_retries = 3
    c.trainer.checkpoint.interval = 1
    c.trainer.broadcast.dtype = "float32"  # the server samples from exactly the trained weights
    c.trainer.optim.lr = 1e-3
    c.trainer.micro_batch_size = 4
    c.monitor.tensorboard = False
    c.inference.enabled = {inference_enabled!r}
    c.inference.port = {port}
    c.inference.max_model_len = 256
    c.inference.startup_timeout_s = 240.0
    return c
"""


def reload_base_weights(base_url: str) -> None:
    """Put a shared server back on its base model (other test areas expect it, see tests/conftest.py)."""
    import urllib.request

    from primejax.inference.admin_auth import HEADER, read_token

    request = urllib.request.Request(
        base_url + "/reload_weights", data=b"", method="POST", headers={HEADER: read_token() or ""}
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.status == 200


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(
    directory: Path, name: str, model_dir: Path, *, base_url: str = "", port: int = 8000, max_steps: int = 4
) -> Path:
    """A config file for a tiny 4-step run; `base_url` = use that server, else the launcher starts one."""
    path = directory / f"{name}.py"
    path.write_text(
        CONFIG_TEMPLATE.format(
            name=name,
            output_dir=str(directory / "runs"),
            max_steps=max_steps,
            model_dir=str(model_dir),
            base_urls=(base_url,) if base_url else (),
            inference_enabled=not base_url,
            port=port,
        )
    )
    return path


@dataclass
class Result:
    returncode: int
    output: str
    seconds: float
    run_dir: Path

    def metrics(self, process: str) -> list[dict]:
        path = self.run_dir / "metrics" / f"{process}.jsonl"
        return (
            [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if path.exists()
            else []
        )

    def log(self, process: str) -> str:
        path = self.run_dir / "logs" / f"{process}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def run_dir_of(config: Path) -> Path:
    return config.parent / "runs" / config.stem


def launch(config: Path, *overrides: str, faults: str = "", timeout_s: float = LAUNCH_TIMEOUT_S) -> Result:
    """Run the launcher to completion; assert nothing it started is left running."""
    env = {k: v for k, v in os.environ.items() if k != "PRIMEJAX_FAULTS"}
    if faults:
        env["PRIMEJAX_FAULTS"] = faults
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "primejax.train", "--config", str(config), *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        start_new_session=True,
    )
    result = Result(proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start, run_dir_of(config))
    assert_no_survivors(result.run_dir)
    return result


def _live(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def survivors(run_dir: Path) -> list[str]:
    """Live processes of the run: in a process group named by pids.json, or mentioning the run directory."""
    groups = set()
    pids_file = run_dir / "pids.json"
    if pids_file.exists():
        groups = {int(pid) for name, pid in json.loads(pids_file.read_text()).items() if name != "launcher"}
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid == os.getpid() or not _live(p):
            continue
        try:
            in_group = os.getpgid(p.pid) in groups
        except ProcessLookupError:
            continue
        if in_group or str(run_dir) in " ".join(p.info["cmdline"] or []):
            found.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])[:200]}")
    return found


def assert_no_survivors(run_dir: Path) -> None:
    # The launcher has exited and reaped its children; a grandchild re-parented to init may take a moment to
    # be reaped after its SIGKILL, so poll briefly for the kernel to finish it off.
    deadline = time.monotonic() + 10.0
    while (left := survivors(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind by the run: {left}"


def final_params(run_dir: Path, step: int) -> dict[str, np.ndarray]:
    """θ_step as exported by the trainer (float32 broadcast: exactly the trainer's parameters)."""
    files = sorted(glob.glob(str(run_dir / "broadcasts" / f"step_{step}" / "*.safetensors")))
    assert files, f"no broadcast of step {step} in {run_dir}"
    return {k: v for f in files for k, v in load_file(f).items()}


def assert_params_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    unequal = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not unequal, f"parameters differ from the uninterrupted run: {unequal[:5]}"


def trained_steps_since(result: Result, since: float) -> list[int]:
    """Trainer steps logged by a run that started at wall time `since` (in order)."""
    return [r["step"] for r in result.metrics("trainer") if r["time"] >= since]
