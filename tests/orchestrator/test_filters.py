"""Each filter's rule at and around its threshold, and the slots' monitor vs enforce behaviour."""

from __future__ import annotations

from primejax.config import default_config
from primejax.envs.base import Example
from primejax.orchestrator.filters import (
    FilterSlot,
    build_slots,
    make_gibberish,
    make_repetition,
    repetition_fraction,
    zero_advantage,
)
from primejax.orchestrator.rollout import Rollout, TrajectoryStep


def rollout(
    completion: list[int],
    logprobs: list[float] | None = None,
    advantage: float | None = 1.0,
    error: str | None = None,
) -> Rollout:
    lps = logprobs if logprobs is not None else [-1.0] * len(completion)
    r = Rollout(
        env="e",
        example_index=0,
        example=Example("k", []),
        group_id=0,
        steps=[TrajectoryStep([1], completion, lps, "stop", 0)],
        reward=None if error else 1.0,
        error=error,
    )
    if advantage is not None:
        r.assign_advantages(advantage)
    return r


def test_zero_advantage_fires_only_on_all_zero_streams():
    assert zero_advantage(rollout([5, 6], advantage=0.0))
    assert not zero_advantage(rollout([5, 6], advantage=1e-9))
    assert not zero_advantage(rollout([5, 6], advantage=None))  # no rl credit (opd/sft): never fires
    r = rollout([5, 6], advantage=None)
    r.assign_advantages([0.0, 0.3])
    assert not zero_advantage(r)


def test_gibberish_threshold_is_strict():
    f = make_gibberish(-2.0)
    assert f(rollout([5, 6], [-2.0, -2.01]))  # mean -2.005 < -2
    assert not f(rollout([5, 6], [-2.0, -2.0]))  # at the threshold: kept
    assert not f(rollout([5, 6], [-1.0, -2.5]))


def test_repetition_fraction_and_threshold():
    assert repetition_fraction([1, 2, 3, 4], 2) == 0.0
    assert repetition_fraction([1, 2, 1, 2, 1, 2], 2) == 1 - 2 / 5  # grams 12 21 12 21 12
    assert repetition_fraction([1], 2) == 0.0
    f = make_repetition(0.6, 2)
    assert not f(rollout([1, 2, 1, 2, 1, 2]))  # 0.6: at the threshold, kept
    assert f(rollout([1, 2, 1, 2, 1, 2, 1]))  # grams 12 21 12 21 12 21: 1 - 2/6 = 0.667 > 0.6


def test_monitor_slot_flags_but_keeps_and_enforcing_slot_drops():
    flagged, clean, errored = (
        rollout([5], advantage=0.0),
        rollout([5]),
        rollout([5], advantage=None, error="x"),
    )
    monitor = FilterSlot("pre_batch", {"zero_advantage": zero_advantage}, enforce=False)
    kept, counts = monitor.apply([flagged, clean, errored])
    assert kept == [flagged, clean, errored] and counts == {"zero_advantage": 1}
    assert flagged.filtered_by == ["zero_advantage"] and not flagged.dropped
    enforce = FilterSlot("post_batch", {"zero_advantage": zero_advantage}, enforce=True)
    kept, counts = enforce.apply([flagged, clean])
    assert kept == [clean] and counts == {"zero_advantage": 1, "dropped": 1}
    assert flagged.dropped and flagged.filtered_by == ["zero_advantage"]  # flagged once, not twice


def test_default_slots_register_all_three_filters():
    pre, post = build_slots(default_config().orchestrator.filters)
    assert set(pre.filters) == set(post.filters) == {"gibberish", "repetition", "zero_advantage"}
    assert not pre.enforce and post.enforce
