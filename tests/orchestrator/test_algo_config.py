"""Config-time validation of algorithm components (docs/algorithms.md): one failing case per rule."""

from __future__ import annotations

import contextlib

import pytest

from primejax.config import ConfigError, default_config, env, typed, validate

_nothing = contextlib.nullcontext


def config(**algo):
    cfg = default_config()
    cfg.model.path = "unused"
    for key, value in algo.items():
        if isinstance(value, dict):
            cfg.orchestrator.algo[key].update(value)
        else:
            cfg.orchestrator.algo[key] = value
    return cfg


FROZEN = {"source": "frozen"}


def frozen(cfg):
    cfg.orchestrator.algo.sampling.frozen.update({"name": "m", "base_url": ("http://h:1/v1",)})
    return cfg


@pytest.mark.parametrize("algo", ["grpo", "max_rl", "opd", "opsd", "echo", "sft"])
def test_valid_settings_of_each_algorithm_pass(algo):
    cfg = config(type=algo)
    if algo == "opd":
        cfg.orchestrator.algo.teacher.base_url = ("http://h:1/v1",)
    if algo == "sft":
        cfg.orchestrator.algo.sampling.source = "frozen"
        frozen(cfg)
    validate(cfg)


@pytest.mark.parametrize(
    ("make", "key", "message"),
    [
        (lambda: config(type="opd"), "orchestrator.algo.teacher.base_url", "frozen teacher"),
        (
            lambda: config(type="opd", teacher={"name": "policy", "base_url": ("http://h:1",)}),
            "orchestrator.algo.teacher",
            "degenerate",
        ),
        (lambda: config(type="sft"), "orchestrator.algo.sampling.source", "frozen source"),
        (
            lambda: config(type="sft", sampling=FROZEN),
            "orchestrator.algo.sampling.frozen.base_url",
            "endpoint",
        ),
        (lambda: frozen(config(type="grpo", sampling=FROZEN)), "orchestrator.algo.type", "only feed the ce"),
        (
            lambda: frozen(config(type="opd", sampling=FROZEN, teacher={"base_url": ("http://h:1",)})),
            "orchestrator.algo.type",
            "only feed the ce",
        ),
        (
            lambda: config(type="opsd", length_penalty={"type": "tokens", "coef": 0.1}),
            "orchestrator.algo.length_penalty",
            "a key of grpo, max_rl, echo",
        ),
        (
            lambda: config(type="grpo", teacher={"base_url": ("http://h:1",)}),
            "orchestrator.algo.teacher",
            "'grpo' has no 'teacher'",
        ),
        (
            lambda: config(length_penalty={"type": "turns", "coef": -1.0}),
            "orchestrator.algo.length_penalty.coef",
            ">= 0",
        ),
        (
            lambda: config(advantage={"import_path": "nodots"}),
            "orchestrator.algo.advantage.import_path",
            "import path",
        ),
        (
            lambda: config(type="echo", filter={"import_path": "nodots"}),
            "orchestrator.algo.filter.import_path",
            "import path",
        ),
        (lambda: config(type="echo", roles={"tool": -0.1}), "orchestrator.algo.roles", "alpha"),
    ],
)
def test_each_rule_rejects_its_case(make, key, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(make())
    assert e.value.key == key


def test_per_env_algorithm_is_checked_too():
    cfg = config()
    cfg.orchestrator.envs.reverse_text.algo.type = "sft"
    with pytest.raises(ConfigError, match="frozen source") as e:
        validate(cfg)
    assert e.value.key == "orchestrator.envs.reverse_text.algo.sampling.source"
    cfg = config()
    cfg.orchestrator.envs.reverse_text.algo.type = "grpo"
    cfg.orchestrator.envs.reverse_text.algo.advantage.import_path = "nodots"
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == "orchestrator.envs.reverse_text.algo.advantage.import_path"
    cfg = config()
    cfg.orchestrator.envs.reverse_text.algo.roles = {
        "user": 1.0
    }  # set without choosing a type: not inherited
    with pytest.raises(ConfigError, match="'' has no 'roles'"):
        validate(cfg)


def test_reference_example_sft_from_a_frozen_source_next_to_grpo_on_the_policy():
    """Reference 001's mixed run: each env resolves its own sampling source, teacher, roles, length penalty."""
    cfg = config()
    o = cfg.orchestrator
    with o.envs.unlocked() if o.envs.is_locked else _nothing():
        o.envs["distill"] = env("reverse-text")
    o.envs.distill.algo.type = "sft"
    o.envs.distill.algo.sampling.update(
        {"source": "frozen", "frozen": {"name": "big", "base_url": ("http://h:1",)}}
    )
    o.envs.reverse_text.algo.type = "grpo"
    o.envs.reverse_text.algo.length_penalty.update({"type": "tokens", "coef": 0.1})
    typed_cfg = typed(cfg)
    sft, grpo = typed_cfg.orchestrator.env_algo("distill"), typed_cfg.orchestrator.env_algo("reverse_text")
    assert sft.type == "sft" and sft.sampling.frozen.base_url == ("http://h:1",)
    assert grpo.sampling.source == "policy" and grpo.length_penalty.coef == 0.1
    assert typed_cfg.orchestrator.algo.length_penalty.type == "none"  # the global block is untouched


def test_pool_thresholds_must_be_ordered_and_eval_sizes_positive():
    cfg = config()
    cfg.orchestrator.buffer.easy_threshold, cfg.orchestrator.buffer.hard_threshold = 0.5, 0.5
    with pytest.raises(ConfigError, match="below easy_threshold"):
        validate(cfg)
    cfg = config()
    cfg.orchestrator.eval.update({"interval": 2, "group_size": 0})
    with pytest.raises(ConfigError, match="group_size"):
        validate(cfg)
