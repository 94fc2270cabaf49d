"""A new advantage is one registered function: named in the config, it credits the groups of a real
orchestrator step (fake server) and its values reach the batch file; the registry and the config refuse what
would be ambiguous, and a function returning a non-finite value is one clear error."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from orch_fakes import FakeClient, make_orchestrator, small_config

from primejax.config import ConfigError, default_config
from primejax.contracts.batch import read_batch, step_dir
from primejax.envs.base import Example
from primejax.orchestrator.algorithms import AdvantageInputs, build_algorithm, register_advantage
from primejax.orchestrator.algorithms.advantage import registered_advantages
from primejax.orchestrator.config import OrchestratorConfig
from primejax.orchestrator.rollout import Rollout, TrajectoryStep
from primejax.utils.sections import build


@register_advantage("rank_for_test")
def rank(inputs: AdvantageInputs, spread: float = 1.0) -> list[float]:
    """Rank credit: the lowest score gets -spread/2, the highest +spread/2, evenly between (ties by order)."""
    order = sorted(range(len(inputs.scores)), key=lambda i: inputs.scores[i])
    out = [0.0] * len(order)
    for r, i in enumerate(order):
        out[i] = spread * (r / max(1, len(order) - 1) - 0.5)
    return out


def test_a_registered_advantage_credits_an_orchestrator_step_and_reaches_the_batch(tmp_path, tokenizer):
    cfg = small_config(tmp_path / "run", batch_size=8, group_size=4)
    cfg.orchestrator.pool.mode = "step"
    cfg.orchestrator.algo.advantage.name = "rank_for_test"
    cfg.orchestrator.algo.advantage.kwargs = {"spread": 3.0}
    orch = make_orchestrator(cfg, client=FakeClient(tokenizer), tokenizer=tokenizer, run_dir=tmp_path / "run")
    (metrics,) = asyncio.run(orch.run(1))
    assert metrics["batch/rollouts"] == 8
    batch = read_batch(step_dir(tmp_path / "run", 1) / "rank_0.npz")
    values = np.unique(batch.advantages[batch.loss_mask])
    # 4 members a group: ranks 0..3 -> 3 * (r/3 - 1/2); every sampled token carries its rollout's value
    np.testing.assert_allclose(values, [-1.5, -0.5, 0.5, 1.5], atol=1e-6)


def _rollout(reward: float) -> Rollout:
    example = Example(key="k", prompt=[{"role": "user", "content": "q"}])
    steps = [TrajectoryStep([1, 2], [3, 4], [-0.1, -0.2], "stop", 0)]
    return Rollout(env="e", example_index=0, example=example, group_id=0, steps=steps, reward=reward)


def _grpo(**advantage) -> object:
    tree = default_config().orchestrator
    tree.algo.advantage.update(advantage)
    cfg = build(OrchestratorConfig, tree)
    return build_algorithm("grpo", cfg.algo, sampling=cfg.sampling)


def test_the_registry_and_the_config_refuse_what_is_ambiguous():
    assert {"group_relative", "mean_normalized", "rank_for_test"} <= set(registered_advantages())
    assert register_advantage("rank_for_test")(rank) is rank  # the same function again: a no-op
    with pytest.raises(ValueError, match="already registered as 'rank_for_test'"):
        register_advantage("rank_for_test")(lambda inputs: [])
    with pytest.raises(
        ConfigError, match=r"advantage.name.*'nope' is not registered \(registered: .*'group_relative'"
    ):
        _grpo(name="nope")
    with pytest.raises(ConfigError, match="set one"):
        _grpo(name="rank_for_test", import_path="custom_advantage_fns.constant")


def test_a_non_finite_advantage_is_one_clear_error():
    register_advantage("nan_for_test")(lambda inputs: [float("nan")] * len(inputs.rollouts))
    algo = _grpo(name="nan_for_test")
    with pytest.raises(ValueError, match="advantage 'nan_for_test' returned a non-finite value"):
        algo.finalize_group([_rollout(1.0), _rollout(0.0)])
