"""The in-process verifiers driver on a scripted model: tools run in process with their state kept, malformed
tool calls answered and counted, the three stop kinds, turn caps, task.score, and the samples it builds."""

from __future__ import annotations

import asyncio
import json

import pytest

from primejax.envs.registry import load_env
from primejax.orchestrator.buffer import EnvSlot
from primejax.orchestrator.config import SamplingConfig
from primejax.orchestrator.generate import GroupGenerator
from primejax.orchestrator.samples import rollout_to_samples
from primejax.rendering.renderer import build_renderer
from primejax.rendering.renderers_adapter import PackageRenderer
from tests.envs.instant_model import Done

TASKSET = "tests.envs.vf_calc_taskset"


class ScriptedClient:
    """A one-rollout model: replies with the next scripted text + <|im_end|>, recording every prompt."""

    def __init__(self, tokenizer, script: list[str]):
        self.tok, self.script = tokenizer, list(script)
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.prompts: list[list[int]] = []

    async def generate(
        self, prompt_token_ids, *, n, max_tokens, temperature, top_p=1.0, stop=None, seed=None
    ):
        assert n == 1
        self.prompts.append(list(prompt_token_ids))
        ids = self.tok.encode(self.script.pop(0), add_special_tokens=False) + [self.eos]
        return [Done(list(prompt_token_ids), ids, [-0.5] * len(ids))]


class Version:
    version = 3


class Scorer:
    action_loss_type = "rl"

    async def finalize_rollout(self, rollout):
        rollout.assign_advantages(1.0)


def call(name, **args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from primejax.models.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("tool-tokenizer")
    build_tokenizer(out, tool_tokens=True)
    return AutoTokenizer.from_pretrained(str(out))


def run_group(tokenizer, script: list[str], max_turns=8, **args):
    env = load_env(TASKSET, {"size": 2, **args})
    client = ScriptedClient(tokenizer, script)
    renderer = build_renderer("auto", tokenizer)
    settings = SamplingConfig(max_tokens=64, max_turns=max_turns)
    gen = GroupGenerator(client, renderer, settings, Version(), max_concurrent=4, max_prompt_tokens=4096)
    slot = EnvSlot(name="calc", env=env, weight=1.0, algorithm=Scorer())
    (rollout,) = asyncio.run(gen.group(slot, 0, 0, 1, step=1))
    return rollout, client, gen, env


def test_a_verifiers_task_runs_the_same_in_an_env_worker(tool_tokenizer):
    """orchestrator.env_workers: toolsets, their state, stops and scoring in a worker process, the model calls
    (and the malformed-call count) here."""
    from primejax.envs.workers import in_workers

    env = in_workers(load_env(TASKSET, {"size": 2}), TASKSET, {"size": 2}, 1, 60.0)
    script = [call("calc_mul", a=2, b=3), "<tool_call>\n{bad json\n</tool_call>", call("calc_history_len"),
              env.example(0).answer]  # fmt: skip
    client = ScriptedClient(tool_tokenizer, script)
    gen = GroupGenerator(client, build_renderer("auto", tool_tokenizer), SamplingConfig(max_tokens=64), Version(),
                         max_concurrent=4, max_prompt_tokens=4096)  # fmt: skip
    slot = EnvSlot(name="calc", env=env, weight=1.0, algorithm=Scorer())

    async def main():
        try:
            return await gen.group(slot, 0, 0, 1, step=1)
        finally:
            await env.aclose()

    (rollout,) = asyncio.run(main())
    assert rollout.error is None, rollout.error
    tools = [m["content"] for m in rollout.messages if m["role"] == "tool"]
    assert tools[0] == "6" and tools[1].startswith("Error: could not parse this tool call (invalid_json)")
    assert tools[2] == "1 1"  # the toolset instance and its State survived between calls in the worker
    assert rollout.reward == 1.0 and rollout.state["reward_components"] == {"correct": 1.0}
    assert rollout.state["num_malformed_tool_calls"] == 1 and gen.stats.errors["malformed_tool_call"] == 1
    assert all("calc_mul" in tool_tokenizer.decode(p) for p in client.prompts)  # tools listed by the worker


def test_auto_renderer_is_the_renderers_package_qwen3(tool_tokenizer):
    renderer = build_renderer("auto", tool_tokenizer)
    assert isinstance(renderer, PackageRenderer) and renderer.family == "qwen3"


def test_tools_run_in_process_with_state_kept_and_malformed_calls_answered(tool_tokenizer):
    env = load_env(TASKSET, {"size": 2})
    answer = env.example(0).answer
    script = [
        call("calc_mul", a=2, b=3),
        "<tool_call>\n{bad json\n</tool_call>",
        call("calc_history_len"),
        answer,
    ]
    rollout, client, gen, _ = run_group(tool_tokenizer, script)
    assert rollout.error is None, rollout.error
    roles = [m["role"] for m in rollout.messages]
    assert roles == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    tools = [m for m in rollout.messages if m["role"] == "tool"]
    assert tools[0]["content"] == "6" and tools[0]["name"] == "calc_mul"
    assert tools[1]["content"].startswith("Error: could not parse this tool call (invalid_json)")
    assert tools[2]["content"] == "1 1"  # instance history and State counter both survived between calls
    assert rollout.messages[2]["tool_calls"][0]["function"] == {
        "name": "calc_mul",
        "arguments": '{"a": 2, "b": 3}',
    }
    assert rollout.state["num_malformed_tool_calls"] == 1 and gen.stats.errors["malformed_tool_call"] == 1
    assert rollout.reward == 1.0 and rollout.state["reward_components"] == {"correct": 1.0}
    assert rollout.state["metrics"] == {"used_tool": 1.0}
    # The tools were advertised in the system turn of every prompt.
    assert all("calc_mul" in tool_tokenizer.decode(p) for p in client.prompts)
    # Every call extends the previous one: one sample, tool-result tokens masked out of the loss.
    for prev, nxt in zip(rollout.steps, rollout.steps[1:], strict=False):
        assert (
            nxt.prompt_ids[: len(prev.prompt_ids) + len(prev.completion_ids)]
            == prev.prompt_ids + prev.completion_ids
        )
    (sample,) = rollout_to_samples(rollout, "rl", 1.0, seq_len=4096)
    trained = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=False) if m]
    assert trained == rollout.completion_ids


@pytest.mark.parametrize(
    "script,args,stop,turns",
    [
        (["done STOP", "unused"], {}, "said_stop", 1),  # Response stop after the reply
        (
            [call("calc_add", a=1, b=2), "unused"],
            {"task": {"max_calls": 1}},
            "too_many_calls",
            1,
        ),  # Trace stop
        (
            [call("calc_mul", a=111, b=6), "unused"],
            {},
            "forbidden_result",
            1,
        ),  # Request stop on the tool result
        ([call("calc_add", a=1, b=1)] * 5, {}, "max_turns", 2),  # the orchestrator's turn cap
    ],
)
def test_the_three_stop_kinds_and_turn_cap(tool_tokenizer, script, args, stop, turns):
    rollout, _, _, _ = run_group(tool_tokenizer, script, max_turns=2 if stop == "max_turns" else 8, **args)
    assert rollout.error is None, rollout.error
    assert rollout.state["stop_condition"] == stop
    assert rollout.num_turns == turns


def test_token_cap_stops_before_the_next_call(tool_tokenizer):
    script = [call("calc_add", a=1, b=1)] * 5
    rollout, _, _, _ = run_group(tool_tokenizer, script, max_output_tokens=1)
    assert rollout.state["stop_condition"] == "max_output_tokens" and rollout.num_turns == 1


def test_env_run_drives_the_conversation_through_the_stand_in(tool_tokenizer):
    env = load_env(
        "tests.envs.vf_local_taskset", {"env": "tests.envs.vf_guess_env", "env_args": {"rounds": 3}}
    )
    assert env.example(0).prompt == []  # the Env's run opens the conversation
    client = ScriptedClient(tool_tokenizer, ["pear", "plum", "apple"])
    settings = SamplingConfig(max_tokens=64, max_turns=8)
    gen = GroupGenerator(
        client,
        build_renderer("auto", tool_tokenizer),
        settings,
        Version(),
        max_concurrent=4,
        max_prompt_tokens=4096,
    )
    slot = EnvSlot(name="guess", env=env, weight=1.0, algorithm=Scorer())
    (rollout,) = asyncio.run(gen.group(slot, 0, 0, 1, step=1))
    assert rollout.error is None, rollout.error
    users = [m["content"] for m in rollout.messages if m["role"] == "user"]
    assert users == ["Guess my word.", "No. It starts with 'a'.", "No. It starts with 'ap'."]
    assert [m["content"] for m in rollout.messages if m["role"] == "assistant"] == ["pear", "plum", "apple"]
    assert rollout.reward == 1.5 and rollout.num_turns == 3
    (sample,) = rollout_to_samples(rollout, "rl", 1.0, seq_len=4096)  # user turns bridged: one sample
    assert [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m] == rollout.completion_ids


def test_sft_renders_tool_demonstrations_with_the_rollout_renderer(tool_tokenizer):
    from primejax.sft.data import conversation_to_sample

    env = load_env(TASKSET, {"size": 2})
    ex, data = env.example(0), env.tasks[0].data
    tools = asyncio.run(env.tools(ex))
    calls = [
        {"id": "c0", "type": "function", "function": {"name": "calc_mul", "arguments": '{"a": 28, "b": 4}'}}
    ]
    messages = [
        *ex.prompt,
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c0", "content": data.answer},
        {"role": "assistant", "content": data.answer},
    ]
    renderer = build_renderer("auto", tool_tokenizer)
    sample = conversation_to_sample(tool_tokenizer, messages, renderer=renderer, tools=tools)
    assert sample.token_ids[: len(renderer.render_ids(ex.prompt, tools))] == renderer.render_ids(
        ex.prompt, tools
    )
    trained = tool_tokenizer.decode([t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m])
    call = '<tool_call>\n{"name": "calc_mul", "arguments": {"a": 28, "b": 4}}\n</tool_call><|im_end|>'
    assert trained == f"<think>\n\n</think>\n\n{call}<think>\n\n</think>\n\n{data.answer}<|im_end|>"
    # The second turn's prompt extends the first turn verbatim, as a rollout's bridge does.
    context = tool_tokenizer.decode(sample.token_ids)
    assert (
        f"</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{data.answer}\n</tool_response>"
        in context
    )
    assert env.example(0).answer == data.answer  # sft.from_env and opsd read it


def _run_judged(tokenizer, index: int, script: list[str]):
    env = load_env(
        "tests.envs.vf_local_taskset", {"env": "tests.envs.vf_judged_env", "env_args": {"rounds": 3}}
    )
    gen = GroupGenerator(
        ScriptedClient(tokenizer, script),
        build_renderer("auto", tokenizer),
        SamplingConfig(max_tokens=64, max_turns=8),
        Version(),
        max_concurrent=4,
        max_prompt_tokens=4096,
    )
    slot = EnvSlot(name="judged", env=env, weight=1.0, algorithm=Scorer())
    (rollout,) = asyncio.run(gen.group(slot, index, 0, 1, step=1))
    return rollout


def test_env_finalize_judges_the_episode_after_each_trace_is_scored(tool_tokenizer):
    # A quick win (2 turns): exact 1 + mentions 0.5 + finalize's `quick` 1 x weight 2.
    quick = _run_judged(tool_tokenizer, 0, ["pear", "apple"])
    assert quick.error is None, quick.error
    assert quick.state["reward_components"] == {"exact": 1.0, "mentions": 1.0, "quick": 1.0}
    assert quick.state["metrics"] == {"episode_traces": 1.0, "scored_before_finalize": 1.0}
    assert quick.reward == 3.5
    # Three turns: finalize records quick = 0 on the same trace.
    slow = _run_judged(tool_tokenizer, 0, ["pear", "plum", "apple"])
    assert slow.state["reward_components"]["quick"] == 0.0 and slow.reward == 1.5


def test_env_finalize_raising_fails_the_rollout(tool_tokenizer):
    rollout = _run_judged(tool_tokenizer, 2, ["stone"])  # index 2 is "stone": finalize raises
    assert rollout.reward is None and "finalize refuses stones" in rollout.error


def test_a_huge_tool_result_is_cut_before_tokenizing_with_a_marker_the_model_sees(tool_tokenizer):
    env = load_env(TASKSET, {"size": 2})
    script = [call("calc_mul", a=123, b=456), env.example(0).answer]
    rollout, client, _, _ = run_group(tool_tokenizer, script, max_tool_output_chars=2)
    tool = next(m for m in rollout.messages if m["role"] == "tool")
    assert tool["content"] == "56\n[tool output truncated: 2 of 5 characters shown]"
    assert "tool output truncated" in tool_tokenizer.decode(client.prompts[1])


def test_a_hung_tool_errors_its_rollout_within_the_timeout(tool_tokenizer, monkeypatch):
    import asyncio as aio

    from primejax.envs import verifiers_adapter

    async def hang(self, name, arguments):
        await aio.Event().wait()  # never set: a tool that never answers

    real = verifiers_adapter._World.call_tool

    async def hung_call(self, name, arguments):
        server, tool = self.servers[name]
        monkeypatch.setattr(server, "call_tool", lambda *a, **k: hang(None, None, None))
        return await real(self, name, arguments)

    monkeypatch.setattr(verifiers_adapter._World, "call_tool", hung_call)
    env = load_env(TASKSET, {"size": 2})
    script = [call("calc_mul", a=2, b=3), env.example(0).answer]
    rollout, _, gen, _ = run_group(tool_tokenizer, script, tool_timeout_s=0.2)
    assert rollout.error is not None and "did not answer within 0.2 s (tool_timeout_s)" in rollout.error
    assert sum(gen.stats.errors.values()) >= 1
