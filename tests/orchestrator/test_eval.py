"""Evals: pass@1 / pass@k / reward per eval env from hand-made groups, online evals every `eval.interval`
steps, and the offline entrypoint's command line."""

from __future__ import annotations

import asyncio

import pytest
from orch_fakes import FakeClient, make_orchestrator, small_config

from primejax.config import _env, typed
from primejax.envs.base import Example
from primejax.orchestrator.evaluator import env_metrics
from primejax.orchestrator.rollout import Rollout, TrajectoryStep


def r(reward: float | None) -> Rollout:
    return Rollout(
        env="e",
        example_index=0,
        example=Example("k", []),
        group_id=0,
        reward=reward,
        steps=[TrajectoryStep([1], [2, 3], [0.0, 0.0], "stop", 0)],
        error=None if reward is not None else "request: x",
    )


def test_pass_at_k_counts_examples_with_any_pass_and_pass_at_1_the_mean_rate():
    groups = [[r(1.0), r(0.0), r(0.0), r(0.0)], [r(0.0)] * 4, [r(1.0), r(1.0), r(None), r(0.5)]]
    m = env_metrics("e", groups, threshold=1.0)
    assert m["eval/e/pass@1"] == pytest.approx((0.25 + 0 + 2 / 3) / 3, abs=1e-12)
    assert m["eval/e/pass@4"] == pytest.approx(2 / 3, abs=1e-12)
    assert m["eval/e/errored"] == 1 and m["eval/e/num_rollouts"] == 12
    assert m["eval/e/reward/mean"] == pytest.approx(3.5 / 11, abs=1e-12)
    single = env_metrics("e", [[r(0.9)]], threshold=0.9)
    assert single["eval/e/pass@1"] == 1.0 and not any(
        k.startswith("eval/e/pass@") and k != "eval/e/pass@1" for k in single
    )


def test_online_eval_runs_every_interval_on_the_eval_envs(tmp_path, tokenizer):
    cfg = small_config(tmp_path / "run", batch_size=8, group_size=4)
    cfg.orchestrator.eval.update({"interval": 2, "num_examples": 3, "group_size": 4})
    cfg.orchestrator.eval.envs = {"held_out": _env("reverse-text", seed=123)}
    client = FakeClient(tokenizer)
    orch = make_orchestrator(cfg, client=client, tokenizer=tokenizer, run_dir=tmp_path / "run")
    history = asyncio.run(orch.run(4))
    # Evals run in the background next to the next steps: the one started after step 2 reports with the first
    # step that ends after it (3 or 4), the last one with the run's last step.
    reported = [m.get("eval/step") for m in history]
    assert reported[:2] == [None, None] and reported[-1] == 4.0 and reported[2] in (None, 2.0)
    training = orch.generator.stats.requests  # the continuous pool (the default) may run ahead of the steps
    assert training >= 4 * 2
    assert len(client.requests) == training + 2 * 3  # both evals ran: 3 examples each
    history[1] = history[3]
    # FakeClient: member 0 answers exactly, members 1-3 drop characters
    assert history[1]["eval/held_out/pass@4"] == 1.0 and history[1]["eval/held_out/pass@1"] == 0.25
    assert "eval/reverse_text/pass@4" not in history[1]
    # eval requests stay out of the training throughput counters (the sum above counts them apart)


def test_offline_eval_rejects_a_weights_directory_without_safetensors(tmp_path):
    from primejax.config.cli import UsageError
    from primejax.eval.offline import evaluate, weights_version

    assert weights_version("/x/broadcasts/step_12") == 12 and weights_version("/x/hf") == 1
    with pytest.raises(UsageError, match="no .safetensors"):
        asyncio.run(
            evaluate(
                typed(small_config(tmp_path / "run")).orchestrator,
                "unused",
                client=None,
                weights=str(tmp_path),
            )
        )


def test_offline_eval_is_seeded_so_the_same_weights_give_the_same_requests(tmp_path, tokenizer):
    """Issue 48: two offline evals of one checkpoint with one config gave 0.113 and 0.072 (unseeded sampling).
    Every request now carries a seed (run.seed when orchestrator.sampling.seed is -1), the same in both runs,
    and an explicit sampling.seed wins."""
    from primejax.eval.offline import evaluate

    o = typed(small_config(tmp_path / "run")).orchestrator
    assert o.sampling.seed == -1 and o.async_level > 0  # unseeded, as by default

    def seeds(seed: int, orch=o) -> list:
        client = FakeClient(tokenizer)
        asyncio.run(evaluate(orch, tokenizer.name_or_path, client, seed=seed))
        return [req["seed"] for req in client.requests]

    first, second = seeds(7), seeds(7)
    assert first and None not in first and first == second
    assert seeds(8) != first  # run.seed picks the draw
    from primejax.utils.sections import replace_key

    explicit = replace_key(replace_key(o, "async_level", 0), "sampling.seed", 123)
    assert seeds(7, explicit) == seeds(8, explicit) != first
