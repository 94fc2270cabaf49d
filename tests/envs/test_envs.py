"""Builtin environments (determinism, rewards, multi-turn), the registry, and the verifiers adapter."""

from __future__ import annotations

import asyncio

import pytest

from primejax.envs import Environment, Example, load_env, register_env, registered_envs
from primejax.envs.alphabet_sort import TAG
from primejax.envs.reverse_text import lcs_ratio


def reply(messages, text):
    return [*messages, {"role": "assistant", "content": text}]


def score(env, example, messages):
    return asyncio.run(env.score(example, messages, {}))


def test_builtins_are_registered_and_deterministic_by_index():
    assert {"reverse-text", "alphabet-sort", "arithmetic"} <= set(registered_envs())
    for env_id in ("reverse-text", "alphabet-sort", "arithmetic"):
        a, b = load_env(env_id), load_env(env_id)
        assert [a.example(i) for i in range(5)] == [b.example(i) for i in range(5)]
        assert len({a.example(i).key for i in range(50)}) > 10


def test_reverse_text_prompts_and_lcs_reward():
    env = load_env("reverse-text", {"min_len": 3, "max_len": 6, "seed": 1})
    lengths = set()
    for i in range(200):
        ex = env.example(i)
        text = ex.prompt[-1]["content"]
        lengths.add(len(text))
        assert text.isalpha() and text.islower() and ex.answer == text[::-1]
    assert lengths == {3, 4, 5, 6}
    ex = env.example(0)
    assert score(env, ex, reply(ex.prompt, ex.answer)) == 1.0
    assert score(env, ex, reply(ex.prompt, f"<reversed_text>{ex.answer}</reversed_text>")) == 1.0
    assert score(env, ex, reply(ex.prompt, ex.answer[:-1])) == pytest.approx(
        lcs_ratio(ex.answer[:-1], ex.answer)
    )
    assert lcs_ratio("abcd", "abxd") == pytest.approx(0.75, abs=1e-12)
    assert score(env, ex, reply(ex.prompt, "")) == 0.0


def test_arithmetic_reward_reads_the_last_number():
    env = load_env("arithmetic", {"max_operand": 9, "ops": "+*"})
    ex = env.example(3)
    assert score(env, ex, reply(ex.prompt, f"{ex.prompt[-1]['content']} {ex.answer}")) == 1.0
    assert score(env, ex, reply(ex.prompt, str(ex.answer + 1))) == 0.0
    assert score(env, ex, reply(ex.prompt, "no idea")) == 0.0


def test_alphabet_sort_is_multi_turn_and_scores_every_turn():
    env = load_env("alphabet-sort", {"num_turns": 2, "initial_names": 3, "names_per_turn": 2})
    assert env.max_turns == 2
    ex = env.example(7)
    first, second = ex.answer
    messages = reply(ex.prompt, f"<{TAG}>\n" + "\n".join(sorted(first)) + f"\n</{TAG}>")
    follow_up = asyncio.run(env.env_response(ex, messages, {}))
    assert follow_up and all(name in follow_up[0]["content"] for name in second)
    messages = reply(messages + follow_up, f"<{TAG}>\n" + "\n".join(sorted(first + second)) + f"\n</{TAG}>")
    assert asyncio.run(env.env_response(ex, messages, {})) is None
    assert score(env, ex, messages) == 1.0
    wrong = messages[:-1] + [{"role": "assistant", "content": "no tags"}]
    assert score(env, ex, wrong) == pytest.approx(0.5, abs=1e-12)


class Constant(Environment):
    num_examples = 2

    def __init__(self, value: float = 0.5):
        self.value = value

    def example(self, index: int) -> Example:
        return Example(key=str(index), prompt=[{"role": "user", "content": "hi"}])

    async def score(self, example, messages, state) -> float:
        return self.value


def load_constant(**args) -> Constant:
    return Constant(**args)


def test_user_envs_by_import_path_and_by_registration():
    env = load_env(f"{__name__}:load_constant", {"value": 0.25})
    assert isinstance(env, Constant) and env.value == 0.25
    register_env("test-constant", load_constant)
    assert load_env("test-constant").value == 0.5
    with pytest.raises(TypeError, match="not a primejax Environment"):
        load_env(f"{__name__}:reply", {"messages": [], "text": ""})


def test_verifiers_taskset_loads_by_id_and_scores_in_process():
    env = load_env("tests.envs.vf_local_taskset", {"prefix": "Repeat"})
    assert env.num_examples == 3 and env.drives_rollout  # turns end when a reply has no tool call
    ex = env.example(1)
    assert ex.prompt == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Repeat river"},
    ]
    assert score(env, ex, reply(ex.prompt, "river")) == 1.5  # exact (1.0) + mentions (0.5 x 1.0)
    assert score(env, ex, reply(ex.prompt, "the river")) == 0.5
    assert score(env, ex, reply(ex.prompt, "stone")) == 0.0
    limited = load_env("tests.envs.vf_local_taskset", {"num_examples": 2})
    assert limited.num_examples == 2
