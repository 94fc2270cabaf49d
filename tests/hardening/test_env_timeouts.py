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
    # The barrier: exactly the step's two groups are generated, so the requests below count the hung episodes'
    # progress (the continuous pool, the default, would start more groups meanwhile).
    cfg.orchestrator.pool.mode = "step"
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


class EchoModel:
    """Replies with the word the prompt asks for ("Say <word>")."""

    def __init__(self, tokenizer):
        self.tok, self.eos = tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>")

    def reply(self, prompt_token_ids):
        word = self.tok.decode(prompt_token_ids).rsplit("Say ", 1)[1].split("<|im_end|>", 1)[0]
        return self.tok.encode(word, add_special_tokens=False) + [self.eos]


class Version:
    version = 1


class Scorer:
    async def finalize_rollout(self, rollout):
        rollout.assign_advantages(1.0)


@pytest.mark.slow  # verifiers' own loop: a harness program per rollout (tens of seconds on a loaded CPU)
def test_verifiers_own_loop_bounds_the_envs_scoring(tiny_model_dir):
    """verifiers' own loop (`args.driver` auto: the reward needs the runtime) takes `env_timeout_s` as its own
    deadline for the env's stages without model calls (task setup, scoring, finalize): the hung judge fails its
    episode and that rollout errors; the other group's rollout is scored."""
    from primejax.envs.registry import load_env
    from primejax.envs.verifiers_loop import VerifiersLoopEnv
    from primejax.orchestrator.buffer import EnvSlot
    from primejax.orchestrator.config import SamplingConfig
    from primejax.orchestrator.generate import GroupGenerator
    from primejax.rendering.renderer import build_renderer, load_tokenizer
    from tests.envs.instant_model import InstantServer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    env = load_env("tests.hardening.vf_hang_loop_taskset", {})
    assert isinstance(env, VerifiersLoopEnv)

    async def main():
        async with InstantServer(EchoModel(tokenizer), str(tiny_model_dir)) as server:
            settings = SamplingConfig(max_tokens=16, max_turns=2)
            gen = GroupGenerator(
                server,
                build_renderer("auto", tokenizer),
                settings,
                Version(),
                max_concurrent=4,
                max_prompt_tokens=4096,
                env_timeout_s=5.0,
            )
            slot = EnvSlot(name="judged", env=env, weight=1.0, algorithm=Scorer())
            try:
                groups = await asyncio.wait_for(
                    asyncio.gather(gen.group(slot, 0, 0, 1, step=1), gen.group(slot, 1, 1, 1, step=1)), 180
                )
            finally:
                await env.aclose()
            return [g[0] for g in groups], gen.stats

    (apple, river), stats = asyncio.run(main())
    assert apple.error is None and apple.reward == 1.0, apple.error
    assert river.error == (
        "env: RuntimeError: verifiers' task scoring did not finish within its deadline (orchestrator.env_timeout_s)"
    )
    assert stats.errors.get("env") == 1, stats.errors
