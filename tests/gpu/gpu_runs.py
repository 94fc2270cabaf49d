"""The user's command on a GPU with a small model, as the GPU tier's run tests start it, and the trained steps it
recorded. Imported by the tests beside it (pytest puts this folder on sys.path, as for gpu_env.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpu_env import GPUS, RUN_GPU  # tests/gpu/gpu_env.py

REPO = Path(__file__).resolve().parents[2]


def small_run(tmp_path: Path, *extra: str, max_steps: int = 3) -> subprocess.CompletedProcess:
    """The user's command (configs/gpu_single.py) with a small bf16 model, on RUN_GPU. On a one-GPU node the
    session's server (30% of the card) holds the same GPU, so the run's two shares shrink to fit beside it."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": RUN_GPU, "PYTHONUNBUFFERED": "1"}
    shares = (
        []
        if GPUS >= 2
        else ["--config.trainer.memory_fraction=0.25", "--config.inference.gpu_memory_utilization=0.25"]
    )
    args = [
        sys.executable,
        "-m",
        "primejax.train",
        "--config",
        str(REPO / "configs/gpu_single.py"),
        f"--config.run.output_dir={tmp_path}",
        "--config.run.name=run",
        f"--config.run.max_steps={max_steps}",
        f"--config.model.path={tmp_path / 'model'}",
        "--config.model.build_tiny.hidden_size=256",
        "--config.model.build_tiny.num_layers=2",
        "--config.model.build_tiny.num_heads=4",
        "--config.model.build_tiny.num_kv_heads=2",
        "--config.model.build_tiny.intermediate_size=512",
        "--config.sft.steps=20",
        "--config.orchestrator.batch_size=64",
        *shares,
        *extra,
    ]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def trained_steps(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics" / "trainer.jsonl").read_text().splitlines()]
    return [r for r in rows if "mismatch_kl" in r]
