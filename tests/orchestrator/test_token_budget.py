"""Token-budget batches (orchestrator.batch_tokens, primejax/orchestrator/token_budget.py): a rollout's tokens are
what its training samples hold; a batch is the group-order prefix of trainable rollouts that fits the budget;
with long-tailed reply lengths every step's batch holds (budget - seq_len, budget] tokens, in the step
barrier and in the continuous pool, while the number of rollouts per step follows the lengths."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
from orch_fakes import FakeClient, make_orchestrator, reverse_reply, small_config

from primejax.config import typed
from primejax.envs.base import Example
from primejax.orchestrator.rollout import Rollout, TrajectoryStep
from primejax.orchestrator.samples import rollout_to_samples
from primejax.orchestrator.token_budget import TokenMeter, cut_by_tokens, rollout_tokens
from primejax.utils.sections import ConfigError


def _rollout(steps: list[tuple[list[int], list[int]]], *, error: str | None = None, dropped: bool = False):
    r = Rollout(env="e", example_index=0, example=Example(prompt=[], key="k"), group_id=0, error=error, dropped=dropped,
                reward=None if error else 1.0)  # fmt: skip
    r.steps = [TrajectoryStep(p, c, [-0.5] * len(c), "stop", 0) for p, c in steps]
    if not error:
        r.assign_advantages(1.0)
    return r


def test_rollout_tokens_are_what_its_training_samples_hold():
    one = _rollout([([1, 2, 3], [4, 5])])
    bridged = _rollout(
        [([1, 2, 3], [4, 5]), ([1, 2, 3, 4, 5, 6, 7], [8])]
    )  # turn 2 extends turn 1: one sample
    split = _rollout([([1, 2, 3], [4, 5]), ([9, 9], [8, 8, 8])])  # turn 2 does not: two samples
    for r in (one, bridged, split):
        samples = rollout_to_samples(r, "rl", 1.0, seq_len=4096)
        assert rollout_tokens(r, 4096) == sum(len(s) for s in samples)
    assert [rollout_tokens(r, 4096) for r in (one, bridged, split)] == [5, 8, 10]


def test_rollout_tokens_count_a_turn_that_seq_len_split_off_in_full():
    # turn 2 extends turn 1, but the merged sample (7 + 1 ids) would pass seq_len 6: rollout_to_samples starts a
    # new sample from turn 2's whole prompt, so turn 1's ids are trained twice and count twice
    r = _rollout([([1, 2, 3], [4, 5]), ([1, 2, 3, 4, 5, 6, 7], [8])])
    samples = rollout_to_samples(r, "rl", 1.0, seq_len=6)
    assert [len(s) for s in samples] == [5, 8]
    assert rollout_tokens(r, 6) == 13
    meter = TokenMeter(6)
    assert meter.observe([r]) == 13
    assert cut_by_tokens([[r]], 12, 6) == [] and cut_by_tokens([[r]], 13, 6) == [r]


def test_a_batch_is_the_group_order_prefix_that_fits_the_budget():
    rng = random.Random(0)
    lengths = [int(rng.paretovariate(1.2) * 20) for _ in range(64)]  # long-tailed: most short, a few huge
    rollouts = [_rollout([([7] * 10, [1] * n)]) for n in lengths]
    rollouts[3] = _rollout([([7] * 10, [1] * 5)], error="env failed")  # never trained, never counted
    rollouts[5].dropped = True
    groups = [rollouts[i : i + 8] for i in range(0, 64, 8)]
    trainable = [r for r in rollouts if r.ok and not r.dropped]
    seq_len = max(rollout_tokens(r, 10**9) for r in trainable)
    for budget in (seq_len, 2 * seq_len, 5 * seq_len):
        batch = cut_by_tokens(groups, budget, seq_len)
        used = sum(rollout_tokens(r, seq_len) for r in batch)
        assert batch == trainable[: len(batch)]
        assert budget - seq_len < used <= budget
    assert cut_by_tokens(groups, 10**9, seq_len) == trainable  # short of the budget: everything trainable
    meter = TokenMeter(seq_len)
    assert meter.rollouts_for(1000, fallback=32) == 32
    meter.observe(trainable)
    total = sum(rollout_tokens(r, seq_len) for r in trainable)
    assert meter.rollouts_for(1000, fallback=32) == math.ceil(1000 * len(trainable) / total)  # at the mean


def test_batch_tokens_is_checked_with_one_line(tmp_path):
    cfg = small_config(tmp_path / "run", batch_tokens=100)  # seq_len 256
    with pytest.raises(ConfigError, match=r"batch_tokens.*must be 0 \(off\) or at least seq_len \(256\)"):
        typed(cfg)


def long_tail_reply(prompt: str, member: int) -> str:
    """reverse_reply's distinct rewards; the last member of a group also rambles on (a long-tailed length)."""
    return reverse_reply(prompt, member) + (" and so on" * 20 if member == 3 else "")


@pytest.mark.parametrize("mode", ["step", "continuous"])
def test_every_batch_holds_the_token_budget_with_long_tailed_lengths(tmp_path, tokenizer, mode):
    budget = 600
    cfg = small_config(tmp_path / "run", batch_size=8, group_size=4, batch_tokens=budget)  # seq_len 256
    cfg.orchestrator.pool.mode = mode
    client = FakeClient(tokenizer, replies=long_tail_reply)
    orch = make_orchestrator(cfg, client=client, tokenizer=tokenizer, run_dir=tmp_path / "run")
    history = asyncio.run(orch.run(4))
    assert len(history) == 4
    for m in history:
        assert budget - 256 < m["samples/tokens"] <= budget, m["samples/tokens"]
    # the rollouts per step follow the lengths, not batch_size (which only sized the first round)
    assert {m["batch/rollouts"] for m in history} != {8.0}
