"""Non-finite or non-numeric rewards error their rollout only (the group goes on, partial); a server answer
with out-of-vocabulary token ids or non-finite logprobs is rejected at the orchestrator, naming the server."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "orchestrator"))
from orch_fakes import FakeClient, make_orchestrator, small_config  # noqa: E402

from primejax.contracts.batch import read_batch, step_dir  # noqa: E402
from primejax.envs.base import Environment, Example  # noqa: E402
from primejax.envs.registry import register_env  # noqa: E402
from primejax.envs.reverse_text import ReverseText  # noqa: E402
from primejax.inference.client import InferenceClient  # noqa: E402
from primejax.inference.server_pool import InferenceError  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from primejax.models.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(str(out))


def assert_one_errored_per_group(run_dir, metrics) -> None:
    """Member 1 of each group of 4 errored, the other three were scored and trained. Whatever the dispatch mode:
    the barrier (pool.mode step) cuts the step's 2 groups (6 trainable), the continuous pool (the default) as
    many finished groups as hold the 8 of the batch; its errors/score also counts groups finished in the pool
    that wait for the next cut."""
    errored, total = metrics["rollouts/errored"], metrics["rollouts/total"]
    assert errored >= 2 and errored * 4 == total, metrics
    assert metrics["errors/score"] >= errored
    assert metrics["batch/rollouts"] == min(8, total - errored)
    assert read_batch(step_dir(run_dir, 1) / "rank_0.npz").meta["num_samples"] == metrics["batch/rollouts"]


class BadReward(Environment):
    """reverse-text whose member-1 rollouts (reply length 5) score `bad`."""

    def __init__(self, bad):
        self.inner = ReverseText(min_len=6, max_len=6)
        self.num_examples = self.inner.num_examples
        self.bad = bad

    def example(self, index: int) -> Example:
        return self.inner.example(index)

    async def score(self, example, messages, state):
        if len(messages[-1]["content"]) == 5:
            return self.bad
        return await self.inner.score(example, messages, state)


class DrivenBadReward(BadReward):
    """The same task run by the env's own loop (`drives_rollout`): the env calls the model itself."""

    drives_rollout = True

    async def rollout(self, example, state, model):
        reply = await model(list(example.prompt))
        return [*example.prompt, reply]


@pytest.mark.parametrize(
    ("env_cls", "bad"),
    [(BadReward, b) for b in (float("nan"), float("inf"), "0.7", True, None, 1e308, -1e308, 2e6)]
    + [(DrivenBadReward, b) for b in (float("nan"), "0.7")],
)
def test_a_bad_reward_errors_its_rollout_and_the_group_goes_on(tmp_path, tokenizer, caplog, env_cls, bad):
    """Both rollout paths: orchestrator-driven turns and an env that drives its own episode."""
    name = f"test-bad-reward-{env_cls.__name__}-{bad!r}"
    register_env(name, lambda: env_cls(bad))
    cfg = small_config(tmp_path / "run", env_id=name, batch_size=8, group_size=4)
    orch = make_orchestrator(cfg, client=FakeClient(tokenizer), tokenizer=tokenizer, run_dir=tmp_path / "run")
    orch.resume("")
    (metrics,) = asyncio.run(orch.run(1))
    assert_one_errored_per_group(tmp_path / "run", metrics)
    assert any(
        "reward must be" in r.getMessage() and "reverse_text" in r.getMessage() for r in caplog.records
    )


def _answer(token_ids, logprobs):
    def handler(req):
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(
            200,
            content=(
                '{{"choices": [{{"index": 0, "token_ids": {}, "text": "x", "finish_reason": "stop", '
                '"logprobs": {{"token_logprobs": [{}]}}}}]}}'.format(token_ids, ", ".join(logprobs))
            ).encode(),
        )

    return handler


@pytest.mark.parametrize(
    ("ids", "lps", "expected"),
    [
        ([5, 100000], ["-0.1", "-0.2"], "token id 100000 outside the vocabulary"),
        ([5, -1], ["-0.1", "-0.2"], "token id -1 outside the vocabulary"),
        ([5, 6], ["-0.1", "NaN"], "sampling logprob nan"),
        ([5, 6], ["-0.1", "Infinity"], "sampling logprob inf"),
    ],
)
def test_server_answers_outside_the_vocabulary_or_non_finite_are_rejected_naming_the_server(
    ids, lps, expected, monkeypatch
):
    monkeypatch.delenv("PRIMEJAX_ADMIN_TOKEN", raising=False)  # a scripted server: no identity to check

    async def go():
        client = InferenceClient(
            "http://srv-a:9", transport=httpx.MockTransport(_answer(ids, lps)), vocab_size=64, max_retries=0
        )
        try:
            await client.generate([1, 2], n=1, max_tokens=2, temperature=1.0)
        finally:
            await client.close()

    with pytest.raises(InferenceError) as err:
        asyncio.run(go())
    assert "server http://srv-a:9" in str(err.value) and expected in str(err.value)


class HungScore(BadReward):
    """Member-1 rollouts' scoring never answers (a judge that hangs)."""

    async def score(self, example, messages, state):
        if len(messages[-1]["content"]) == 5:
            await asyncio.Event().wait()
        return await self.inner.score(example, messages, state)


def test_a_hung_environment_call_errors_its_rollout_and_the_group_goes_on(tmp_path, tokenizer):
    register_env("test-hung-score", lambda: HungScore(None))
    cfg = small_config(tmp_path / "run", env_id="test-hung-score", batch_size=8, group_size=4)
    cfg.orchestrator.env_timeout_s = 0.5
    orch = make_orchestrator(cfg, client=FakeClient(tokenizer), tokenizer=tokenizer, run_dir=tmp_path / "run")
    orch.resume("")
    (metrics,) = asyncio.run(orch.run(1))
    assert_one_errored_per_group(tmp_path / "run", metrics)
