"""An environment that runs its own episode (a verifiers Env: setup, the steps between agent turns, the task's
scoring as an interaction closes, finalize) is bounded by `orchestrator.env_timeout_s` on its own code, not only
on the calls the orchestrator makes into it: a hang errors that rollout alone, counted, and the step goes on
(issue 27: "environment and tool calls have no timeout")."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "orchestrator"))
from orch_fakes import FakeClient, make_orchestrator, small_config  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from primejax.models.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.mark.parametrize(
    ("hang_at", "stage"),
    [("setup", "env"), ("step", "env"), ("score", "env"), ("step_then_score", "env"), ("finalize", "score")],
)
def test_a_hung_episode_errors_its_rollout_and_the_rest_finish(hang_at, stage, tmp_path, tokenizer, caplog):
    cfg = small_config(tmp_path / "run", env_id="tests.hardening.vf_hang_env", batch_size=8, group_size=4)
    cfg.orchestrator.envs.reverse_text.args = {"env_args": {"hang_at": hang_at}}
    cfg.orchestrator.env_timeout_s = 0.5
    client = FakeClient(tokenizer)
    orch = make_orchestrator(cfg, client=client, tokenizer=tokenizer, run_dir=tmp_path / "run")
    orch.resume("")
    # Without the bound the hung episodes hold the step forever: the test fails at this outer limit instead.
    with caplog.at_level(logging.WARNING, logger="primejax.orchestrator.generate"):
        (metrics,) = asyncio.run(asyncio.wait_for(orch.run(1), 30))
    assert metrics["rollouts/errored"] == 4 and metrics[f"errors/{stage}"] == 4, metrics
    failed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout failed")]
    assert len(failed) == 4 and all("(orchestrator.env_timeout_s)" in m for m in failed), failed
    # the other four played both turns; the hung four got as far as their hang
    assert len(client.requests) == 4 * 2 + 4 * {"setup": 0, "step": 1, "step_then_score": 1}.get(hang_at, 2)
