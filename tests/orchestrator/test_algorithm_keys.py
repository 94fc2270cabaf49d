"""Each algorithm's own keys, set in one env's `algo` block the way a config file sets them, reach that env's
algorithm instance (and only it): the typed view carries them from the ConfigDict to the class."""

from __future__ import annotations

import asyncio

import pytest

from primejax.config import default_config, env, typed
from primejax.envs.base import Example
from primejax.orchestrator.algorithms import registered_algorithms
from primejax.orchestrator.loop import build_env_slots
from primejax.orchestrator.rollout import Rollout, TrajectoryStep

ADV = "custom_advantage_fns.constant"


def rollouts(n: int = 2) -> list[Rollout]:
    example = Example(key="k", prompt=[{"role": "user", "content": "q"}], info={"hint": "do this"})
    steps = [TrajectoryStep([1, 2], [5, 6, 7], [-0.1] * 3, "stop", 0)]
    return [
        Rollout(env="e", example_index=0, example=example, group_id=0, steps=steps, reward=float(i))
        for i in range(n)
    ]


def check_grpo(algo):
    assert algo.config.length_penalty.coef == 0.5 and algo.config.length_penalty.target == 1
    group = rollouts()
    algo.finalize_group(group)
    assert [r.advantages[0] for r in group] == [4.0, 4.0]  # the custom advantage with this env's kwargs


def check_max_rl(algo):
    assert (algo.config.length_penalty.type, algo.config.length_penalty.coef) == ("turns", 0.25)
    assert algo.length_penalty(rollouts(1)[0]) == 0.0  # one turn, target 1
    assert algo.advantage_name == "mean_normalized"  # max_rl's own


def check_echo(algo):
    assert algo.roles == {"user": 0.3} and algo.user_filter is not None


def check_opd(algo):
    assert algo.teacher_client.base_urls == ["http://127.0.0.1:8911"]
    assert algo.teacher_client._model == "teacher"  # the served name this env asked for


def check_opsd(algo):
    assert algo.config.demo_key == "hint"
    assert algo.tokenizer.decode(algo.hint_ids("x")).endswith("Teacher says: x<|im_end|>\n")


def check_sft(algo):
    assert algo.sampling_client.base_urls == ["http://127.0.0.1:8912"]


CASES = {
    "grpo": (
        {
            "length_penalty": {"type": "tokens", "coef": 0.5, "target": 1},
            "advantage": {"import_path": ADV, "kwargs": {"value": 4.0}},
        },
        check_grpo,
    ),
    "max_rl": ({"length_penalty": {"type": "turns", "coef": 0.25, "target": 1}}, check_max_rl),
    "echo": (
        {"roles": {"user": 0.3}, "filter": {"import_path": "custom_advantage_fns.keep_none"}},
        check_echo,
    ),
    "opd": ({"teacher": {"name": "teacher", "base_url": ("http://127.0.0.1:8911/v1",)}}, check_opd),
    "opsd": ({"demo_key": "hint", "template": "Teacher says: {demonstration}"}, check_opsd),
    "sft": (
        {"sampling": {"source": "frozen", "frozen": {"base_url": ("http://127.0.0.1:8912",)}}},
        check_sft,
    ),
}


def test_every_builtin_algorithm_has_a_case():
    assert set(CASES) <= set(registered_algorithms())
    assert {n for n in registered_algorithms() if not n.startswith("test-")} == set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_an_envs_own_algorithm_keys_reach_its_instance(name, tokenizer):
    keys, check = CASES[name]
    tree = default_config()
    tree.model.path = "unused"
    tree.orchestrator.envs["own"] = env("reverse-text")
    block = tree.orchestrator.envs.own.algo
    block.type = name
    for key, value in keys.items():
        if isinstance(value, dict) and key not in ("roles",):
            block[key].update(value)
        else:
            block[key] = value
    cfg = typed(tree)
    slots = {
        s.name: s for s in build_env_slots(cfg.orchestrator, policy_client=object(), tokenizer=tokenizer)
    }
    own, other = slots["own"].algorithm, slots["reverse_text"].algorithm
    try:
        assert type(own).__name__ != "Algorithm" and own.config.type == name
        check(own)
        # the other env runs the global default block, untouched by this env's keys
        assert other.config == cfg.orchestrator.algo and other.config.type == "grpo"
        assert other.config.length_penalty.coef == 0.0 and other.advantage_name == "group_relative"
    finally:
        asyncio.run(own.close())
