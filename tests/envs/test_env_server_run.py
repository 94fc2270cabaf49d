"""Orchestrator runs through verifiers' env server (`args.driver = "env_server"`) against the real vLLM-CPU
server: the pool of env servers the orchestrator starts itself, one of which dies mid-run (its episode kills
it: tests/envs/vf_crash_taskset.py). The run finishes its steps, the lost rollout is errored and counted
(`env_servers/lost`, `rollouts/errored`), the server is replaced, and every step ships a batch the trainer can
read. The same env trained by `python -m primejax.train`, on local and on remote servers:
tests/envs/test_env_server_train.py (extended tier)."""

from __future__ import annotations

import pytest

from primejax.config import env
from primejax.contracts.batch import read_batch, step_dir
from primejax.rendering.renderer import load_tokenizer
from primejax.utils.monitor import read_jsonl
from tests.envs.session_orchestrator import only_env, run_orchestrator, session_config
from tests.envs.vf_crash_taskset import MARKER_VAR

pytestmark = pytest.mark.vllm
STEPS = 2


def test_an_orchestrator_run_on_local_env_servers_survives_a_killed_server(
    tmp_path, monkeypatch, vllm_server, tiny_model_dir
):
    marker = tmp_path / "crashed"
    monkeypatch.setenv(MARKER_VAR, str(marker))  # the servers the orchestrator starts inherit it
    run_dir = tmp_path / "run"
    args = dict(size=4, driver="env_server", server_workers=2, server_timeout_s=20)
    # one group a step: its two rollouts go to the two servers
    cfg = session_config(
        tmp_path,
        tiny_model_dir,
        {"calc": env("tests.envs.vf_crash_taskset", **args)},
        batch_size=2,
        group_size=2,
    )
    cfg.orchestrator.sampling.max_turns = 2
    tokenizer = load_tokenizer(str(tiny_model_dir))
    history, servers = run_orchestrator(
        cfg, vllm_server.base_url, tokenizer, STEPS, lambda orch: only_env(orch).servers
    )
    assert marker.exists()  # the crash happened
    assert len(history) == STEPS
    # every rollout in flight on the killed server errored and was counted, none other; it was replaced once
    assert sum(m["rollouts/errored"] for m in history) == servers.lost >= 1
    rows = read_jsonl(run_dir / "metrics" / "orchestrator.jsonl")
    assert sum(r["env_servers/lost"] for r in rows) == servers.lost
    # The replacement starts when the server dies and ends when the new one answers: on a loaded machine that
    # may be after the last step's row, so it is counted in a row or still held by the counter, exactly once.
    pending = servers.take_counts()
    assert pending["env_servers/lost"] == 0
    assert (
        sum(r["env_servers/replaced"] for r in rows) + pending["env_servers/replaced"]
        == servers.replaced
        == 1
    )
    batches = [read_batch(step_dir(run_dir, n) / "rank_0.npz", vocab_size=len(tokenizer)) for n in (1, 2)]
    assert sum(b.meta["num_samples"] for b in batches) >= 2 * STEPS - servers.lost
