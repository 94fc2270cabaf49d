"""The tools that read a model directory check it as the entrypoints do (primejax/launcher/preflight.py): a
missing directory or a malformed config.json is one line on stderr and exit status 2, no traceback (issue 27:
"every entrypoint ..., tools, runs the same preflight for what it reads")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (tool argv with MODEL for the directory it reads, the key the error line names)
TOOLS = {
    "convert-to-orbax": (["tools.convert_checkpoint", "to-orbax", "--hf", "MODEL", "--out", "OUT"], "--hf"),
    "convert-to-hf": (
        ["tools.convert_checkpoint", "to-hf", "--orbax", "OUT", "--config", "MODEL", "--out", "OUT"],
        "--config",
    ),
    "tpu-compile": (
        [
            "tools.tpu_compile",
            "--config",
            "configs/debug.py",
            "--topology",
            "v5e-4",
            "--config.model.path=MODEL",
        ],
        "model.path",
    ),
}


def _model(kind: str, tmp_path: Path) -> tuple[Path, str]:
    """A bad model directory and the line the preflight prints for it."""
    if kind == "missing":
        path = tmp_path / "no-such-model"
        return path, f"{str(path)!r} is not a directory"
    path = tmp_path / "model"
    path.mkdir()
    if kind == "bad_json":
        (path / "config.json").write_text('{"model_type": "qwen3",')
        return (
            path,
            f"{path / 'config.json'} is not valid JSON (Expecting property name enclosed in double quotes)",
        )
    (path / "config.json").write_text('["qwen3"]')
    return path, f"{path / 'config.json'} must hold a JSON object, got list"


@pytest.mark.parametrize(
    ("tool", "kind"),
    [
        ("convert-to-orbax", "missing"),
        ("convert-to-orbax", "bad_json"),
        ("convert-to-hf", "missing"),
        ("convert-to-hf", "not_an_object"),
        ("tpu-compile", "missing"),
        ("tpu-compile", "bad_json"),
    ],
)
def test_a_tool_refuses_a_bad_model_directory_in_one_line(tool, kind, tmp_path):
    argv, key = TOOLS[tool]
    model, reason = _model(kind, tmp_path)
    argv = [a.replace("MODEL", str(model)).replace("OUT", str(tmp_path / "out")) for a in argv]
    proc = subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == f"error: {key}: {reason}"
