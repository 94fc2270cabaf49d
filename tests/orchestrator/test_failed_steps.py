"""A run whose every rollout errors stops after `orchestrator.max_failed_steps` steps in a row, quoting the first
error (issue 27), instead of "finishing" on empty batches; a step with any rollout that did not error resets
the count."""

from __future__ import annotations

import asyncio

import pytest
from orch_fakes import make_orchestrator, small_config

from primejax.contracts.batch import step_dir
from primejax.inference.client import InferenceClient
from primejax.orchestrator.failures import FailedSteps, RolloutsFailed
from primejax.orchestrator.rollout import Rollout
from primejax.rendering.renderer import load_tokenizer


def _rollouts(*errors):
    out = []
    for e in errors:
        r = Rollout.__new__(Rollout)
        r.error = e
        out.append(r)
    return out


def test_only_all_errored_steps_in_a_row_count():
    guard = FailedSteps(3)
    guard.observe(1, _rollouts("env: KeyError: 'x'", "env: KeyError: 'y'"))
    guard.observe(2, _rollouts("a", None))  # one rollout came through: the streak ends
    guard.observe(3, _rollouts("score: ValueError: first", "b"))
    guard.observe(4, _rollouts("c"))
    with pytest.raises(
        RolloutsFailed, match=r"3 steps in a row .* first error: step 3: score: ValueError: first"
    ):
        guard.observe(5, _rollouts("d"))
    FailedSteps(0).observe(1, _rollouts("never stops"))  # 0 = off


@pytest.mark.vllm
def test_an_env_whose_rollouts_all_fail_stops_the_run_within_the_limit(tmp_path, vllm_server, tiny_model_dir):
    run_dir = tmp_path / "run"
    cfg = small_config(run_dir, batch_size=4, group_size=2)
    cfg.model.path = str(tiny_model_dir)
    cfg.orchestrator.sampling.max_tokens = 4
    cfg.orchestrator.max_failed_steps = 2

    async def broken_score(*_a, **_k):
        raise ValueError("the judge is unreachable")

    async def main():
        client = InferenceClient(vllm_server.base_url, timeout_s=120, max_retries=1)
        try:
            orch = make_orchestrator(
                cfg, client=client, tokenizer=load_tokenizer(str(tiny_model_dir)), run_dir=run_dir
            )
            for slot in orch.slots:
                slot.env.score = broken_score
            await orch.tracker.sync_with_server()
            await orch.run(10)
        finally:
            await client.close()

    with pytest.raises(RolloutsFailed) as e:
        asyncio.run(main())
    line = str(e.value)
    assert "\n" not in line and "2 steps in a row" in line
    assert "first error: step 1: score: ValueError: the judge is unreachable" in line
    assert step_dir(run_dir, 1).exists() and not step_dir(run_dir, 2).exists()
