"""The whole pipeline against an instant fake server: batch files, failure isolation, multi-turn merging,
checkpoint and resume."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from ml_collections import ConfigDict
from orch_fakes import FakeClient, make_orchestrator, small_config

from primejax.contracts.batch import read_batch, step_dir
from primejax.envs.alphabet_sort import NAMES
from primejax.envs.base import Environment, Example
from primejax.envs.registry import register_env
from primejax.envs.reverse_text import ReverseText
from primejax.orchestrator.checkpoint import saved_steps
from primejax.orchestrator.loop import MAX_EMPTY_BATCHES, Orchestrator


def run(cfg, client, tokenizer, steps: int) -> tuple[Orchestrator, list[dict[str, float]]]:
    orch = make_orchestrator(
        cfg, client=client, tokenizer=tokenizer, run_dir=cfg.run.output_dir + "/" + cfg.run.name
    )
    orch.resume(cfg.run.resume_step)
    return orch, asyncio.run(orch.run(steps))


@pytest.mark.parametrize("mode", ["continuous", "step"])
def test_three_steps_write_batches_the_trainer_accepts_with_the_served_token_ids(tmp_path, tokenizer, mode):
    cfg = small_config(tmp_path / "run", batch_size=8, group_size=4)
    cfg.orchestrator.pool.mode = mode
    client = FakeClient(tokenizer)
    _, history = run(cfg, client, tokenizer, 3)
    assert all(r["n"] == 4 for r in client.requests)
    if mode == "step":  # the barrier: exactly each step's 2 groups, in step order
        assert len(client.requests) == 3 * 2
    else:  # the pool keeps up to 2 steps' groups in flight; at least every batch's groups were requested
        assert 3 * 2 <= len(client.requests) <= 3 * 2 + 2 * 2
    for n in (1, 2, 3):
        batch = read_batch(step_dir(tmp_path / "run", n) / "rank_0.npz", vocab_size=len(tokenizer))
        assert batch.meta["num_samples"] == 8 and batch.meta["step"] == n
        sent = client.requests[(n - 1) * 2 : n * 2] if mode == "step" else client.requests
        prompts = {tuple(r["prompt"]) for r in sent}
        for row in range(batch.rows):
            for seg in range(1, int(batch.segment_ids[row].max()) + 1):
                sel = batch.segment_ids[row] == seg
                tokens, mask = batch.tokens[row, sel].tolist(), batch.loss_mask[row, sel]
                prompt_len = int(np.argmax(mask))
                assert tuple(tokens[:prompt_len]) in prompts  # the exact ids sent to the server
                assert mask[prompt_len:].all() and tokens[-1] == client.eos
                assert (batch.inference_logprobs[row, sel][prompt_len:] == np.float32(-0.25)).all()
    assert history[0]["reward/mean"] > 0 and history[0]["reward/reverse_text/max"] == 1.0
    assert history[0]["rollouts/errored"] == 0 and "perf/rollouts_per_s" in history[0]


class Flaky(Environment):
    """reverse-text whose scoring raises for one reply length: those rollouts fail, the rest train."""

    def __init__(self):
        self.inner = ReverseText(min_len=6, max_len=6)
        self.num_examples = self.inner.num_examples

    def example(self, index: int) -> Example:
        return self.inner.example(index)

    async def score(self, example, messages, state) -> float:
        if len(messages[-1]["content"]) == 5:  # member 1 of each group
            raise RuntimeError("scorer crashed")
        return await self.inner.score(example, messages, state)


@pytest.mark.parametrize("mode", ["continuous", "step"])
def test_an_env_raising_fails_that_rollout_only(tmp_path, tokenizer, mode):
    register_env("test-flaky", lambda: Flaky())
    cfg = small_config(tmp_path / "run", env_id="test-flaky", batch_size=8, group_size=4)
    cfg.orchestrator.pool.mode = mode
    _, (metrics,) = run(cfg, FakeClient(tokenizer), tokenizer, 1)
    # one member of every group fails; the barrier ships the step's 2 groups' 6 others, the pool cuts the batch
    # from as many finished groups as hold 8 trainable rollouts (the third one split); errors/score also counts
    # the groups that finished in the pool but wait for the next cut
    groups = 2 if mode == "step" else 3
    assert metrics["rollouts/errored"] == groups
    assert metrics["errors/score"] == groups if mode == "step" else metrics["errors/score"] >= groups
    assert metrics["batch/rollouts"] == (3 * groups if mode == "step" else 8)
    assert (
        read_batch(step_dir(tmp_path / "run", 1) / "rank_0.npz").meta["num_samples"]
        == metrics["batch/rollouts"]
    )


def sort_reply(prompt: str, member: int) -> str:
    """Sorts every name the user has sent so far; member i leaves out the last i names."""
    user_turns = [t.split("<|im_end|>")[0] for t in prompt.split("<|im_start|>user\n")[1:]]
    seen = [
        n for t in user_turns for n in t.split(":", 1)[1].replace(".", ",").split(",") if n.strip() in NAMES
    ]
    seen = [n.strip() for n in seen]
    return (
        "<alphabetical_sorted>\n" + "\n".join(sorted(seen)[: len(seen) - member]) + "\n</alphabetical_sorted>"
    )


def test_multi_turn_rollouts_merge_into_one_sample_when_the_prefix_extends(tmp_path, tokenizer):
    cfg = small_config(tmp_path / "run", env_id="alphabet-sort", batch_size=4, group_size=2)
    cfg.orchestrator.envs.reverse_text.args = ConfigDict({"num_turns": 3})
    cfg.orchestrator.update({"max_prompt_tokens": 512, "seq_len": 1024})
    cfg.orchestrator.sampling.max_tokens = 200
    client = FakeClient(tokenizer, replies=sort_reply)
    _, (metrics,) = run(cfg, client, tokenizer, 1)
    assert metrics["turns/mean"] == 3.0 and metrics["rollouts/errored"] == 0
    assert metrics["reward/max"] == 1.0
    batch = read_batch(step_dir(tmp_path / "run", 1) / "rank_0.npz")
    assert batch.meta["num_samples"] == 4  # 3 turns each, merged into one sample per rollout
    # Each sample has exactly 3 trained spans (the three replies), separated by untrained env tokens.
    for row in range(batch.rows):
        for seg in range(1, int(batch.segment_ids[row].max()) + 1):
            mask = batch.loss_mask[row, batch.segment_ids[row] == seg].astype(int)
            assert int(((mask[1:] - mask[:-1]) == 1).sum()) == 3


def test_checkpoint_and_resume_continue_the_same_prompt_stream(tmp_path, tokenizer):
    straight = FakeClient(tokenizer)
    run(small_config(tmp_path / "a"), straight, tokenizer, 3)

    cfg = small_config(tmp_path / "b")
    cfg.orchestrator.checkpoint.update({"interval": 1, "keep": 1})
    first = FakeClient(tokenizer)
    run(cfg, first, tokenizer, 2)
    assert saved_steps(tmp_path / "b") == [2]
    cfg.run.resume_step = "latest"
    resumed = FakeClient(tokenizer)
    orch, history = run(cfg, resumed, tokenizer, 3)
    assert len(history) == 1 and orch.next_step == 4
    assert [r["prompt"] for r in resumed.requests] == [r["prompt"] for r in straight.requests[4:]]
    assert read_batch(step_dir(tmp_path / "b", 3) / "rank_0.npz").meta["step"] == 3


def test_the_last_step_is_checkpointed_like_the_trainers(tmp_path, tokenizer):
    """The trainer saves its last step whatever the interval; so does the orchestrator, or a rerun with more
    steps would redo the steps after the last common multiple."""
    cfg = small_config(tmp_path / "run")
    cfg.orchestrator.checkpoint.update({"interval": 2, "keep": 0})
    run(cfg, FakeClient(tokenizer), tokenizer, 3)
    assert saved_steps(tmp_path / "run") == [2, 3]


def test_algorithm_per_env_override_and_weights(tmp_path, tokenizer):
    from primejax.orchestrator.algorithms import Algorithm, register_algorithm

    @register_algorithm("test-const")
    class Const(Algorithm):
        def score_group(self, group: list[Any]) -> None:
            for r in group:
                r.assign_advantages(2.0)

    cfg = small_config(tmp_path / "run", batch_size=8, group_size=4)
    cfg.orchestrator.envs.reverse_text.algo.type = "test-const"
    cfg.orchestrator.filters.post_batch = ()
    _, (metrics,) = run(cfg, FakeClient(tokenizer), tokenizer, 1)
    assert metrics["advantage/mean"] == 2.0


def test_repeated_empty_batches_abort_the_run(tmp_path, tokenizer):
    # group_size 1 under grpo: every advantage is 0, the post-batch zero_advantage filter drops everything.
    cfg = small_config(tmp_path / "run", batch_size=4, group_size=1)
    with pytest.raises(RuntimeError, match="empty batches in a row"):
        run(cfg, FakeClient(tokenizer), tokenizer, MAX_EMPTY_BATCHES + 3)
    assert step_dir(
        tmp_path / "run", MAX_EMPTY_BATCHES
    ).exists()  # the trainer got the empty batches meanwhile
    assert not step_dir(tmp_path / "run", MAX_EMPTY_BATCHES + 1).exists()
