"""Two runs on one machine with default settings (issue 27): both finish, each served only by its own server.

Before, both took `inference.port` 8000; the second run's server took the port while the first was starting,
the first run's server failed to bind, and its orchestrator sampled from (and would have sent weights to) the
other run's server. Now the default port is 0 (a free one per run, recorded in the saved configs), and the
client checks each server's identity against its run's secret before the first request.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2

# Extended tier (PRIMEJAX_SLOW=1): two whole runs at once. The default tier keeps the parts it relies on: the
# impostor-server and identity tests (tests/hardening/test_server_identity.py) and the port checks.
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_two_runs_at_once_each_use_their_own_server(tmp_path, tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if k != "PRIMEJAX_ADMIN_TOKEN"}  # each run makes its own
    env["JAX_PLATFORMS"] = "cpu"
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "primejax.train",
                "--config",
                "configs/debug.py",
                f"--config.run.output_dir={tmp_path}",
                f"--config.run.name={name}",
                f"--config.run.max_steps={STEPS}",
                f"--config.model.path={tiny_model_dir}",
                "--config.model.build_tiny.enabled=False",
                "--config.orchestrator.batch_size=8",
                "--config.orchestrator.sampling.max_tokens=8",
                "--config.orchestrator.max_failed_steps=0",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in ("a", "b")
    }
    outputs = {name: p.communicate(timeout=900)[0] for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 0, f"run {name}:\n{outputs[name][-3000:]}"
    ports = {}
    for name in procs:
        run = tmp_path / name
        inference = json.loads((run / "configs" / "inference.json").read_text())["inference"]["port"]
        orchestrator = json.loads((run / "configs" / "orchestrator.json").read_text())["inference"]["port"]
        assert inference == orchestrator != 0
        ports[name] = inference
        # The server loaded only its own run's broadcasts (the orchestrator sent it nothing else).
        loads = re.findall(r"(/\S+/broadcasts/step_\d+)", (run / "logs" / "inference.log").read_text())
        assert all(path.startswith(str(run)) for path in loads), loads
    assert ports["a"] != ports["b"]
    assert (tmp_path / "a" / "admin_token").read_text() != (tmp_path / "b" / "admin_token").read_text()
