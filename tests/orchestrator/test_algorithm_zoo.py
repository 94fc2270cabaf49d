"""max_rl, custom advantage, opd / opsd reference scoring, sft and echo on hand-made rollouts, and the weight
streams each ships to the trainer."""

from __future__ import annotations

import asyncio

import pytest

from primejax.config import ConfigError, default_config, env
from primejax.envs.base import Example
from primejax.orchestrator.algorithms import build_algorithm
from primejax.orchestrator.algorithms.advantage import extension_runs, mean_normalized
from primejax.orchestrator.config import OrchestratorConfig
from primejax.orchestrator.rollout import Rollout, TrajectoryStep
from primejax.orchestrator.samples import rollout_to_samples
from primejax.rendering.qwen3_renderer import Qwen3Renderer
from primejax.utils.sections import build

EXAMPLE = Example(
    key="k",
    prompt=[{"role": "user", "content": "q"}],
    answer="the answer",
    info={"demonstration": "do it like this"},
)


def rollout(reward: float, tokens: int = 3, turns: int = 1) -> Rollout:
    steps = [TrajectoryStep([1, 2], [5] * tokens, [-0.1] * tokens, "stop", 0) for _ in range(turns)]
    return Rollout(env="e", example_index=0, example=EXAMPLE, group_id=0, steps=steps, reward=reward)


def algo_config(**algo) -> OrchestratorConfig:
    cfg = default_config().orchestrator
    for key, value in algo.items():
        if isinstance(value, dict) and key != "roles":
            cfg.algo[key].update(value)
        else:
            cfg.algo[key] = value
    return build(OrchestratorConfig, cfg)


def finalize(algo, group: list[Rollout]) -> None:
    async def go():
        for r in group:
            await algo.finalize_rollout(r)
        algo.finalize_group(group)

    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ max_rl


def test_max_rl_divides_the_centered_reward_by_the_group_mean():
    cfg = algo_config()
    group = [rollout(1.0), rollout(0.0), rollout(0.0), rollout(0.0)]  # p = 0.25
    finalize(build_algorithm("max_rl", cfg.algo, sampling=cfg.sampling), group)
    assert group[0].advantages == pytest.approx([3.0] * 3, abs=1e-12)  # (1 - .25) / .25
    assert group[1].advantages == pytest.approx([-1.0] * 3, abs=1e-12)  # (0 - .25) / .25
    group = [rollout(0.5), rollout(1.0)]
    finalize(build_algorithm("max_rl", cfg.algo, sampling=cfg.sampling), group)
    assert [r.advantages[0] for r in group] == pytest.approx([-1 / 3, 1 / 3], abs=1e-12)


def test_max_rl_is_zero_when_the_group_mean_is_not_positive():
    assert mean_normalized([0.0, 0.0, 0.0]) == [0.0, 0.0, 0.0]
    assert mean_normalized([-1.0, 0.5]) == [0.0, 0.0]  # mean -0.25
    assert mean_normalized([2.0]) == [0.0]  # no baseline
    assert mean_normalized([1e-3, 0.0]) == pytest.approx([1.0, -1.0], abs=1e-12)


def test_length_penalty_target_exempts_the_first_tokens_and_turns():
    cfg = algo_config(length_penalty={"type": "tokens", "coef": 1.0, "target": 32})
    group = [rollout(1.0, tokens=32), rollout(1.0, tokens=96)]  # penalties 0 and 64/128
    finalize(build_algorithm("grpo", cfg.algo, sampling=cfg.sampling), group)
    assert [r.advantages[0] for r in group] == pytest.approx([0.25, -0.25], abs=1e-12)
    cfg = algo_config(length_penalty={"type": "turns", "coef": 0.2, "target": 1})
    group = [rollout(1.0, turns=1), rollout(1.0, turns=2), rollout(1.0, turns=3)]  # penalties 0, .2, .4
    finalize(build_algorithm("max_rl", cfg.algo, sampling=cfg.sampling), group)
    mean = 1 - 0.2
    assert [r.advantages[0] for r in group] == pytest.approx(
        [(1 - mean) / mean, 0.0, (0.6 - mean) / mean], abs=1e-12
    )


# ------------------------------------------------------------------------------------- custom advantage


def test_custom_advantage_by_import_path_with_kwargs():
    cfg = algo_config(advantage={"import_path": "custom_advantage_fns.normalized", "kwargs": {"eps": 0.0}})
    group = [rollout(1.0), rollout(0.0)]
    finalize(build_algorithm("grpo", cfg.algo, sampling=cfg.sampling), group)
    assert [r.advantages[0] for r in group] == pytest.approx([1.0, -1.0], abs=1e-12)


def test_custom_advantage_must_return_one_value_per_rollout():
    cfg = algo_config(advantage={"import_path": "custom_advantage_fns:wrong_length"})
    with pytest.raises(ValueError, match="returned 1 values for 2 rollouts"):
        finalize(build_algorithm("grpo", cfg.algo, sampling=cfg.sampling), [rollout(1.0), rollout(0.0)])


def test_per_env_advantage_overrides_the_global_one():
    tree = default_config().orchestrator
    tree.algo.advantage.update({"import_path": "custom_advantage_fns.constant", "kwargs": {"value": 2.0}})
    tree.envs["custom"] = env("reverse-text")
    tree.envs.custom.algo.type = "grpo"
    tree.envs.custom.algo.advantage.update(
        {"import_path": "custom_advantage_fns.constant", "kwargs": {"value": -3.0}}
    )
    cfg = build(OrchestratorConfig, tree)
    for name, expected in (("reverse_text", 2.0), ("custom", -3.0)):
        group = [rollout(1.0), rollout(0.0)]
        algo = cfg.env_algo(name)
        finalize(build_algorithm(algo.type, algo, sampling=cfg.sampling), group)
        assert [r.advantages[0] for r in group] == [expected, expected]
    assert cfg.algo.advantage.kwargs == {"value": 2.0}  # the shared section is not mutated


# ------------------------------------------------------------------------------------ reference scoring


class FakeScorer:
    """log p(token_i | prefix) = -(token_i + len(prefix)) / 100: depends on the whole context."""

    def __init__(self):
        self.calls: list[list[int]] = []

    async def score(self, ids):
        self.calls.append(list(ids))
        return [None] + [-(t + i) / 100 for i, t in enumerate(ids) if i > 0]

    async def close(self):
        pass


def test_extension_runs_group_steps_like_interleaving():
    s1 = TrajectoryStep([1, 2], [10, 11], [0, 0], "stop", 0)
    s2 = TrajectoryStep([1, 2, 10, 11, 20], [12], [0], "stop", 0)
    s3 = TrajectoryStep([1, 99], [13], [0], "stop", 0)  # extension broken
    runs = extension_runs([s1, s2, s3])
    assert runs == [([1, 2, 10, 11, 20, 12], [(2, 2), (5, 1)]), ([1, 99, 13], [(2, 1)])]


def test_opd_scores_each_sample_context_under_the_teacher_and_ships_ref_kl():
    cfg = algo_config(type="opd", teacher={"name": "teacher", "base_url": ("http://127.0.0.1:9/v1",)})
    algo = build_algorithm("opd", cfg.algo, sampling=cfg.sampling)
    assert algo.teacher_client.base_urls == ["http://127.0.0.1:9"]
    algo.teacher_client = FakeScorer()
    r = Rollout(
        env="e",
        example_index=0,
        example=EXAMPLE,
        group_id=0,
        reward=0.3,
        steps=[
            TrajectoryStep([1, 2], [10, 11], [-0.5, -0.5], "stop", 0),
            TrajectoryStep([1, 2, 10, 11, 20], [12], [-0.5], "stop", 0),
        ],
    )
    finalize(algo, [r])
    assert algo.teacher_client.calls == [[1, 2, 10, 11, 20, 12]]  # one prefill per interleaved sample
    assert r.ref_logprobs == pytest.approx([-0.12, -0.14, -0.17], abs=1e-12)
    assert r.advantages is None  # no credit
    (s,) = rollout_to_samples(r, algo.action_loss_type, 1.0, 64)
    assert s.ref_kl_weights == [0, 0, 1, 1, 0, 1] and s.rl_weights is None and s.ce_weights is None
    assert s.ref_logprobs == pytest.approx([0, 0, -0.12, -0.14, 0, -0.17], abs=1e-12)
    assert s.advantages is None


def test_opsd_scores_the_policy_under_the_demonstration_hint(tokenizer):
    cfg = algo_config(type="opsd", template="Demo: {demonstration}")
    policy = FakeScorer()
    algo = build_algorithm("opsd", cfg.algo, sampling=cfg.sampling, policy_client=policy, tokenizer=tokenizer)
    r = Rollout(
        env="e",
        example_index=0,
        example=EXAMPLE,
        group_id=0,
        reward=1.0,
        steps=[TrajectoryStep([1, 2, 3], [10, 11], [-0.5, -0.5], "stop", 0)],
    )
    finalize(algo, [r])
    hint = tokenizer.encode("<|im_start|>system\nDemo: do it like this<|im_end|>\n", add_special_tokens=False)
    assert policy.calls == [hint + [1, 2, 3, 10, 11]]
    h = len(hint)
    assert r.ref_logprobs == pytest.approx([-(10 + h + 3) / 100, -(11 + h + 4) / 100], abs=1e-12)
    # falls back to the example field of the same name
    algo = build_algorithm(
        "opsd",
        cfg.algo.replace(demo_key="answer"),
        sampling=cfg.sampling,
        policy_client=policy,
        tokenizer=tokenizer,
    )
    assert tokenizer.decode(algo.hint_ids("the answer")).endswith("Demo: the answer<|im_end|>\n")
    r2 = Rollout(
        env="e",
        example_index=0,
        example=Example("k2", []),
        group_id=0,
        reward=1.0,
        steps=[TrajectoryStep([1], [2], [0.0], "stop", 0)],
    )
    with pytest.raises(KeyError, match="no demonstration"):
        asyncio.run(algo.score_rollout(r2))


def test_sft_needs_a_frozen_source_and_ships_ce_on_every_sampled_token():
    with pytest.raises(ConfigError, match="sft needs a frozen source"):  # rejected with the config
        algo_config(type="sft")
    cfg = algo_config(
        type="sft",
        sampling={"source": "frozen", "frozen": {"name": "big", "base_url": ("http://127.0.0.1:9",)}},
    )
    algo = build_algorithm("sft", cfg.algo, sampling=cfg.sampling)
    assert algo.sampling_client is not None and algo.sampling_client.base_urls == ["http://127.0.0.1:9"]
    group = [rollout(1.0), rollout(1.0)]
    finalize(algo, group)
    assert all(r.advantages is None for r in group)  # the zero-advantage filter never fires
    (s,) = rollout_to_samples(group[0], algo.action_loss_type, 1.0, 64)
    assert s.ce_weights == [0, 0, 1, 1, 1] and s.rl_weights is None and s.advantages is None
    asyncio.run(algo.close())


# ------------------------------------------------------------------------------------------------ echo


def echo_rollout(tokenizer) -> Rollout:
    """Two model calls bridged by the qwen3 renderer; a tool result and a user note arrive in between."""
    renderer = Qwen3Renderer(tokenizer)
    prompt = [{"role": "system", "content": "sys"}, {"role": "user", "content": "call the tool"}]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    c1 = tokenizer.encode("calling", add_special_tokens=False) + [eos]
    p1 = renderer.render_ids(prompt)
    new = [{"role": "tool", "content": "result: 42"}, {"role": "user", "content": "thanks, now answer"}]
    p2 = renderer.bridge_to_next_turn(p1, c1, new)
    c2 = tokenizer.encode("the answer is 42", add_special_tokens=False) + [eos]
    messages = prompt + [
        {"role": "assistant", "content": "calling"},
        *new,
        {"role": "assistant", "content": "the answer is 42"},
    ]
    steps = [
        TrajectoryStep(p1, c1, [-0.1] * len(c1), "stop", 0),
        TrajectoryStep(p2, c2, [-0.2] * len(c2), "stop", 0),
    ]
    return Rollout(
        env="e",
        example_index=0,
        example=Example("k", prompt),
        group_id=0,
        messages=messages,
        steps=steps,
        reward=1.0,
    )


def spans(weights: list[float]) -> list[tuple[int, int, float]]:
    out, i = [], 0
    while i < len(weights):
        if weights[i]:
            j = i
            while j < len(weights) and weights[j] == weights[i]:
                j += 1
            out.append((i, j, weights[i]))
            i = j
        else:
            i += 1
    return out


def test_echo_weights_observation_content_by_role_and_ships_rl_plus_ce(tokenizer):
    cfg = algo_config(type="echo", roles={"tool": 0.25, "user": 0.05})
    algo = build_algorithm("echo", cfg.algo, sampling=cfg.sampling, tokenizer=tokenizer)
    r, other = echo_rollout(tokenizer), echo_rollout(tokenizer)
    other.reward = 0.0
    finalize(algo, [r, other])
    assert r.steps[0].prompt_ce_weights is None  # the dataset prompt is not an observation
    w = r.steps[1].prompt_ce_weights
    (tool_start, tool_end, a), (user_start, user_end, b) = spans(w)
    ids = r.steps[1].prompt_ids
    assert (a, b) == (0.25, 0.05)
    assert tokenizer.decode(ids[tool_start:tool_end]) == "result: 42"
    assert tokenizer.decode(ids[user_start:user_end]) == "thanks, now answer"
    (s,) = rollout_to_samples(r, algo.action_loss_type, 1.0, 512)  # the bridge keeps extension: one sample
    n1 = len(r.steps[0].prompt_ids) + len(r.steps[0].completion_ids)
    assert s.ce_weights[n1 : len(ids)] == w[n1:] and sum(s.ce_weights[:n1]) == 0
    assert s.rl_weights == [float(m and c == 0) for m, c in zip(s.loss_mask, s.ce_weights, strict=True)]
    assert [s.loss_mask[i] for i in range(tool_start, tool_end)] == [True] * (tool_end - tool_start)
    assert s.advantages[-1] == 0.5  # grpo credit on the sampled tokens


def test_echo_default_trains_tool_bodies_only_and_user_filter_narrows(tokenizer):
    cfg = algo_config(type="echo")  # {"tool": 0.1}
    algo = build_algorithm("echo", cfg.algo, sampling=cfg.sampling, tokenizer=tokenizer)
    r = echo_rollout(tokenizer)
    finalize(algo, [r, echo_rollout(tokenizer)])
    ((start, end, alpha),) = spans(r.steps[1].prompt_ce_weights)
    assert alpha == 0.1 and tokenizer.decode(r.steps[1].prompt_ids[start:end]) == "result: 42"
    cfg = algo_config(type="echo", filter={"import_path": "custom_advantage_fns.keep_none"})
    algo = build_algorithm("echo", cfg.algo, sampling=cfg.sampling, tokenizer=tokenizer)
    r = echo_rollout(tokenizer)
    finalize(algo, [r])
    assert all(s.prompt_ce_weights is None for s in r.steps)
    (s,) = rollout_to_samples(r, "rl", 1.0, 512)
    assert s.ce_weights is None and s.rl_weights is None  # nothing echoed: the plain GRPO hot path
