"""GRPO credit on hand-made groups, the Algorithm hooks' contract, and the registry."""

from __future__ import annotations

import asyncio

import pytest

from primejax.config import default_config
from primejax.envs.base import Example
from primejax.orchestrator.algorithms import Algorithm, algorithm_class, build_algorithm, register_algorithm
from primejax.orchestrator.config import OrchestratorConfig
from primejax.orchestrator.rollout import Rollout, TrajectoryStep
from primejax.utils.sections import build

EXAMPLE = Example(key="k", prompt=[{"role": "user", "content": "q"}])


def rollout(reward: float | None, tokens: int = 3, error: str | None = None, turns: int = 1) -> Rollout:
    steps = [TrajectoryStep([1, 2], [5] * tokens, [-0.1] * tokens, "stop", 0) for _ in range(turns)]
    return Rollout(
        env="e", example_index=0, example=EXAMPLE, group_id=0, steps=steps, reward=reward, error=error
    )


def grpo(**length_penalty):
    tree = default_config().orchestrator
    tree.algo.length_penalty.update(length_penalty)
    cfg = build(OrchestratorConfig, tree)
    return build_algorithm("grpo", cfg.algo, sampling=cfg.sampling)


def finalize(algo: Algorithm, group: list[Rollout]) -> None:
    async def go():
        for r in group:
            await algo.finalize_rollout(r)
        algo.finalize_group(group)

    asyncio.run(go())


def test_grpo_is_reward_minus_group_mean_broadcast_over_every_sampled_token():
    group = [
        rollout(1.0, tokens=2),
        rollout(0.0, tokens=3),
        rollout(0.5, tokens=1),
        rollout(0.5, tokens=4, turns=2),
    ]
    finalize(grpo(), group)
    assert [r.advantages for r in group] == [[0.5] * 2, [-0.5] * 3, [0.0] * 1, [0.0] * 8]
    assert all(r.finalized for r in group)


def test_all_equal_group_gets_zero_advantage():
    group = [rollout(0.7) for _ in range(4)]
    finalize(grpo(), group)
    assert all(r.advantages == [0.0] * 3 for r in group)


def test_errored_rollouts_are_left_out_of_the_baseline():
    group = [rollout(1.0), rollout(0.0), rollout(None, error="score: boom"), rollout(0.5)]
    finalize(grpo(), group)
    assert group[0].advantages == pytest.approx([0.5] * 3, abs=1e-12)
    assert group[1].advantages == pytest.approx([-0.5] * 3, abs=1e-12)
    assert group[3].advantages == pytest.approx([0.0] * 3, abs=1e-12)
    assert group[2].advantages is None  # never trained


def test_fewer_than_two_clean_rollouts_gives_zero_advantage():
    group = [rollout(1.0), rollout(None, error="request: x"), rollout(None, error="env: y")]
    finalize(grpo(), group)
    assert group[0].advantages == [0.0] * 3
    assert group[1].advantages is None and group[2].advantages is None


def test_length_penalty_tokens_and_turns():
    group = [rollout(1.0, tokens=32), rollout(1.0, tokens=96)]  # sampling.max_tokens = 128 by default
    finalize(grpo(type="tokens", coef=0.5), group)
    # scores 1 - 0.125 and 1 - 0.375; mean 0.75
    assert group[0].advantages[0] == pytest.approx(0.125, abs=1e-12)
    assert group[1].advantages[0] == pytest.approx(-0.125, abs=1e-12)
    group = [rollout(1.0, turns=1), rollout(1.0, turns=3)]
    finalize(grpo(type="turns", coef=0.1), group)
    assert group[0].advantages[0] == pytest.approx(0.1, abs=1e-12)
    assert group[1].advantages[0] == pytest.approx(-0.1, abs=1e-12)


def test_assign_advantages_validates_per_token_length_and_freezes_after_finalize():
    r = rollout(1.0, tokens=3)
    r.assign_advantages([0.1, 0.2, 0.3])
    assert r.advantages == [0.1, 0.2, 0.3]
    with pytest.raises(ValueError, match="cover 2 tokens"):
        r.assign_advantages([0.1, 0.2])
    finalize(grpo(), [r])
    with pytest.raises(RuntimeError, match="finalized"):
        r.assign_advantages(1.0)


def test_hooks_run_in_order_and_errored_rollouts_skip_them():
    seen: list[str] = []

    @register_algorithm("test-recording")
    class Recording(Algorithm):
        async def score_rollout(self, r):
            seen.append(f"rollout:{r.reward}")

        def score_group(self, group):
            seen.append(f"group:{len(group)}")
            for r in group:
                r.assign_advantages(r.reward)

    cfg = build(OrchestratorConfig, default_config().orchestrator)
    algo = build_algorithm("test-recording", cfg.algo)
    group = [rollout(1.0), rollout(None, error="x"), rollout(2.0)]
    finalize(algo, group)
    assert seen == ["rollout:1.0", "rollout:2.0", "group:2"]
    assert algorithm_class("test-recording") is Recording
    with pytest.raises(KeyError, match="unknown algorithm"):
        algorithm_class("nope")


def test_register_rejects_unknown_loss_type():
    with pytest.raises(ValueError, match="action_loss_type"):

        @register_algorithm("bad")
        class Bad(Algorithm):
            action_loss_type = "mse"
