"""Every standalone entrypoint checks the model it reads before it starts: a missing one is one line on
stderr and exit status 2, no traceback (issue 27: `python -m primejax.sft` with a missing model printed a
transformers traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "module",
    ["primejax.trainer", "primejax.orchestrator", "primejax.inference", "primejax.sft", "primejax.eval"],
)
def test_a_missing_model_is_one_line_and_exit_2(module, tmp_path):
    missing = tmp_path / "no-such-model"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            module,
            "--config",
            "configs/debug.py",
            f"--config.run.output_dir={tmp_path}",
            f"--config.model.path={missing}",
            "--config.model.build_tiny.enabled=False",
            "--config.sft.steps=2",
            "--config.sft.from_env=reverse_text",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert lines[-1] == f"error: model.path: {str(missing)!r} is not a directory", lines[-1]
