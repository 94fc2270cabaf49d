"""Every environment message is cut before the orchestrator tokenizes it (primejax/orchestrator/message_caps.py):
a primejax-native env's `env_response`, an env-driven episode's conversation and an example's prompt, not only
verifiers' tool results (issue 48: a 10 MB `env_response` message stalled the event loop for 90 s at 2.7 GB)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from orch_fakes import FakeClient

from primejax.envs.base import Environment, Example
from primejax.orchestrator.buffer import EnvSlot
from primejax.orchestrator.config import SamplingConfig
from primejax.orchestrator.generate import GroupGenerator
from primejax.orchestrator.message_caps import auto_limit, cap_messages, cap_text, check_tools
from primejax.rendering.renderer import build_renderer

HUGE = (
    300_000  # characters: big enough to show the cut, small enough that the old code's tokenization is quick
)


class Version:
    version = 0


class Algo:
    async def finalize_rollout(self, rollout):
        return None


class Flood(Environment):
    """Answers every model turn with one huge user message (`mode` env_response), or drives its own episode and
    hands the model a huge message (`mode` drive), or has a huge prompt (`mode` prompt)."""

    num_examples = 4
    max_turns = 2

    def __init__(self, mode: str):
        self.mode = mode
        self.drives_rollout = mode == "drive"

    def example(self, index: int) -> Example:
        text = "x" * HUGE if self.mode == "prompt" else "say hi"
        return Example(key=str(index), prompt=[{"role": "user", "content": text}])

    async def env_response(self, example, messages, state):
        return [{"role": "user", "content": "y" * HUGE}]

    async def rollout(self, example, state, model):
        messages = list(example.prompt)
        for _ in range(2):
            reply = await model(messages)
            if reply is None:
                break
            messages = [*messages, reply, {"role": "user", "content": [{"type": "text", "text": "z" * HUGE}]}]
        return messages

    async def score(self, example, messages, state) -> float:
        return 1.0


LIMIT = (
    2048  # orchestrator.max_env_message_chars here (the tiny tokenizer makes about one token per character)
)


def _run(tokenizer, env, max_prompt_tokens=8192, limit=LIMIT):
    gen = GroupGenerator(FakeClient(tokenizer, replies=lambda prompt, member: "hi"), build_renderer("auto", tokenizer),
                         SamplingConfig(max_tokens=8, max_turns=2), Version(), max_concurrent=4,
                         max_prompt_tokens=max_prompt_tokens, env_timeout_s=30.0,
                         max_env_message_chars=limit)  # fmt: skip
    slot = EnvSlot(name="flood", env=env, weight=1.0, algorithm=Algo())
    return asyncio.run(gen.group(slot, 0, 0, 2, 1)), gen


def _strings(value: Any):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def test_an_env_response_message_is_cut_before_it_is_tokenized(tokenizer):
    rollouts, gen = _run(tokenizer, Flood("env_response"))
    for r in rollouts:
        assert r.error is None, r.error
        env_turn = r.messages[2]["content"]
        assert len(env_turn) <= LIMIT and env_turn.endswith(f"of {HUGE} characters shown]"), env_turn[-80:]
        assert len(r.steps) == 2  # the cut message fit in the prompt: the model answered it
        assert len(r.steps[1].prompt_ids) < 8192


def test_an_env_driven_episodes_messages_are_cut_and_bridging_still_matches(tokenizer):
    rollouts, gen = _run(tokenizer, Flood("drive"))
    for r in rollouts:
        assert r.error is None, r.error
        assert len(r.steps) == 2
        # the second call's prompt extends the first call's ids exactly (the recorded conversation is the cut one)
        first = r.steps[0]
        assert r.steps[1].prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == [
            *first.prompt_ids,
            *first.completion_ids,
        ]
        assert all(len(s) <= LIMIT for s in _strings(r.messages))


def test_a_huge_prompt_is_cut_and_one_too_large_in_all_is_refused(tokenizer):
    # the prompt's one string is cut to the limit; a prompt of many such strings is refused before rendering
    rollouts, gen = _run(tokenizer, Flood("prompt"), max_prompt_tokens=256, limit=0)  # 0: auto (4096)
    assert all(
        re.fullmatch(r"request: ValueError: prompt has \d+ tokens > max_prompt_tokens", r.error)
        for r in rollouts
    ), [r.error for r in rollouts]
    assert all(len(s) <= auto_limit(256) == 4096 for r in rollouts for s in _strings(r.messages))
    many = [{"role": "user", "content": "w" * 4096}] * 9
    with pytest.raises(
        ValueError, match=r"hold 36900 characters > 8 x orchestrator.max_env_message_chars \(4096\)"
    ):
        cap_messages(many, 4096)


def test_the_cut_is_idempotent_and_leaves_the_models_own_words_alone():
    cut = cap_text("a" * 10_000, 2048)
    assert len(cut) <= 2048 and cap_text(cut, 2048) == cut and cut.endswith("of 10000 characters shown]")
    assert cap_text("short", 2048) == "short"
    assistant = {"role": "assistant", "content": "b" * 5000}
    assert cap_messages([assistant], 2048) == [assistant]


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("not a list", "must be a list of message dicts"),
        ([["role", "user"]], "must be a dict"),
        ([{"role": "user", "content": "x", "k" * 100: 1}], "key that is not a short string"),
        ([{"role": "user", "content": [[[[[[[[["deep"]]]]]]]]]}], "nests deeper"),
        ([{"role": "user", "content": "x"}] * 5000, "5000 messages"),
    ],
)
def test_malformed_env_messages_fail_with_one_line(messages, match):
    with pytest.raises(ValueError, match=match):
        cap_messages(messages, 4096)


def test_a_malformed_env_response_errors_its_rollout_alone(tokenizer):
    class Bad(Flood):
        async def env_response(self, example, messages, state):
            return {"role": "user", "content": "a dict, not a list"}

    rollouts, gen = _run(tokenizer, Bad("env_response"))
    assert all(
        r.error == "env: ValueError: environment messages must be a list of message dicts, got dict"
        for r in rollouts
    ), [r.error for r in rollouts]
    assert gen.stats.errors == {"env": 2}


def test_tool_schemas_too_large_fail_the_group_before_rendering(tokenizer):
    """The tool schemas an env advertises are rendered into every first prompt: a huge one is refused in one
    line (not cut: a cut schema would be wrong)."""

    class HugeTools(Flood):
        async def tools(self, example):
            return [
                {"type": "function", "function": {"name": "f", "description": "d" * HUGE, "parameters": {}}}
            ]

    rollouts, gen = _run(tokenizer, HugeTools("env_response"))
    assert all(
        r.error is not None
        and "tool schemas hold" in r.error
        and "orchestrator.max_env_message_chars" in r.error
        for r in rollouts
    ), [r.error for r in rollouts]
    assert not gen.stats.requests
    small = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert check_tools(small, LIMIT) is small and check_tools(None, LIMIT) is None
    with pytest.raises(ValueError, match="must be a list of tool-schema dicts"):
        check_tools({"name": "f"}, LIMIT)
