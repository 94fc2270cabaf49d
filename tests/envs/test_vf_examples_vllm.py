"""verifiers' own environments by id against the real vLLM-CPU server, through the orchestrator: verifiers'
`textarena` taskset (Hangman: the game engine plays the user, the Env the taskset ships), the `kuhn-poker`
self-play example (two seats, one trained per rollout) and the `glossary` tool example from verifiers'
repository (vendored unchanged: tests/envs/vf_examples/README.md). Two orchestrator steps, no errored
rollout, every batch readable by the trainer, the envs' own reward components in the JSONL and TensorBoard."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from primejax.config import env
from primejax.contracts.batch import read_batch, step_dir
from primejax.rendering.renderer import load_tokenizer
from primejax.utils.monitor import read_jsonl
from tests.envs.session_orchestrator import run_orchestrator, session_config

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


CASES = {
    # verifiers' own taskset; its package ships TextArenaEnv (the game engine plays the user, scores the game)
    "hangman": (
        env("textarena", game="Hangman-v0", num_examples=4, max_turns=3),
        "TextArenaEnv",
        ("reward_parts/hangman/game_reward",),
    ),
    # verifiers' repository self-play example: two seats, one trained per rollout
    "kuhn": (
        env("kuhn-poker", num_examples=4),
        "KuhnPokerEnv",
        ("reward_parts/kuhn/payoff", "env_metrics/kuhn/forfeit"),
    ),
    # verifiers' repository tool example: a plain taskset (one seat on the task's prompt), an MCP tool in process
    "glossary": (env("glossary", max_turns=2), None, ("reward_parts/glossary/looked_up",)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_verifiers_env_by_id_runs_two_steps_with_no_errored_rollout(
    name, tmp_path, offline_words, vf_examples, vllm_server, tiny_model_dir
):
    entry, env_class, signals = CASES[name]
    run_dir = tmp_path / "run"
    cfg = session_config(tmp_path, tiny_model_dir, {name: entry}, batch_size=4, group_size=2)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    history, orch = run_orchestrator(cfg, vllm_server.base_url, tokenizer, STEPS)
    assert len(history) == STEPS
    for metrics in history:
        assert metrics["rollouts/errored"] == 0, metrics
    (slot,) = orch.slots
    assert (type(slot.env.vf_env).__name__ if slot.env.vf_env is not None else None) == env_class
    for n in range(1, STEPS + 1):
        batch = read_batch(step_dir(run_dir, n) / "rank_0.npz", vocab_size=len(tokenizer))
        assert batch.meta["num_samples"] > 0
    rows = read_jsonl(run_dir / "metrics" / "orchestrator.jsonl")
    tags = _tensorboard_tags(run_dir / "tensorboard" / "orchestrator")
    for signal in signals:  # the env's own reward components and metrics, in the JSONL and TensorBoard
        assert all(signal in row for row in rows), sorted(k for k in rows[0] if "/" in k)
        assert signal in tags
