"""Rollouts -> training samples (alignment, interleaving, component streams) and packing via the contract."""

from __future__ import annotations

import numpy as np
import pytest

from primejax.contracts.batch import pack_samples, read_batch, write_batch
from primejax.envs.base import Example
from primejax.orchestrator.rollout import Rollout, TrajectoryStep
from primejax.orchestrator.samples import rollout_to_samples

EXAMPLE = Example(key="k", prompt=[])


def make_rollout(steps: list[TrajectoryStep], advantage: float | None = 1.0) -> Rollout:
    r = Rollout(env="e", example_index=0, example=EXAMPLE, group_id=0, steps=steps, reward=1.0)
    if advantage is not None:
        r.assign_advantages(advantage)
    return r


def step(prompt: list[int], completion: list[int], version: int = 0) -> TrajectoryStep:
    return TrajectoryStep(
        prompt, completion, [-0.1 * (i + 1) for i in range(len(completion))], "stop", version
    )


def test_single_turn_sample_aligns_every_stream_with_token_ids():
    (s,) = rollout_to_samples(make_rollout([step([1, 2, 3], [7, 8], version=3)], 0.5), "rl", 0.7, 64)
    assert s.token_ids == [1, 2, 3, 7, 8]
    assert s.loss_mask == [False, False, False, True, True]
    assert s.inference_logprobs == pytest.approx([0, 0, 0, -0.1, -0.2])
    assert s.advantages == [0, 0, 0, 0.5, 0.5]
    assert s.temperature == 0.7 and s.policy_version == 3
    assert s.rl_weights is None and s.ce_weights is None and s.ref_kl_weights is None  # plain GRPO hot path


def test_five_step_trajectory_with_extension_breaking_at_step_4_gives_two_samples():
    # Steps 1-3 extend each other (env tokens 20/21 arrive between turns); step 4 re-renders history
    # differently (e.g. thinking stripped), so a new sample starts; step 5 extends step 4.
    s1 = step([1, 2], [10, 11], version=1)
    s2 = step([1, 2, 10, 11, 20], [12], version=1)
    s3 = step([1, 2, 10, 11, 20, 12, 21], [13, 14], version=2)
    s4 = step([1, 2, 99, 20, 12, 21, 13, 14, 22], [15], version=2)
    s5 = step([1, 2, 99, 20, 12, 21, 13, 14, 22, 15, 23], [16], version=3)
    r = make_rollout([s1, s2, s3, s4, s5], advantage=None)
    r.assign_advantages([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])
    a, b = rollout_to_samples(r, "rl", 1.0, 64)
    assert a.token_ids == [1, 2, 10, 11, 20, 12, 21, 13, 14]
    assert a.loss_mask == [False, False, True, True, False, True, False, True, True]
    assert a.advantages == pytest.approx([0, 0, 0.1, 0.2, 0, 0.3, 0, 0.4, 0.5])
    assert a.inference_logprobs == pytest.approx([0, 0, -0.1, -0.2, 0, -0.1, 0, -0.1, -0.2])
    assert a.policy_version == 1
    assert b.token_ids == [1, 2, 99, 20, 12, 21, 13, 14, 22, 15, 23, 16]
    assert b.loss_mask == [False] * 9 + [True, False, True]
    assert b.advantages == pytest.approx([0] * 9 + [0.6, 0, 0.7])
    assert b.policy_version == 2


def test_merge_that_would_overflow_seq_len_starts_a_new_sample():
    s1 = step([1, 2], [10, 11])
    s2 = step([1, 2, 10, 11, 20], [12, 13])
    samples = rollout_to_samples(make_rollout([s1, s2]), "rl", 1.0, seq_len=6)
    assert [x.token_ids for x in samples] == [[1, 2, 10, 11], [1, 2, 10, 11, 20, 12, 13]]
    assert samples[1].loss_mask == [False] * 5 + [True, True]


def test_ce_ref_kl_and_observation_streams():
    (ce,) = rollout_to_samples(make_rollout([step([1, 2], [7, 8])], advantage=None), "ce", 1.0, 64)
    assert ce.ce_weights == [0, 0, 1, 1] and ce.advantages is None and ce.rl_weights is None
    r = make_rollout([step([1, 2], [7, 8])], advantage=None)
    r.ref_logprobs = [-1.0, -2.0]
    (kl,) = rollout_to_samples(r, "ref_kl", 1.0, 64)
    assert kl.ref_kl_weights == [0, 0, 1, 1] and kl.ref_logprobs == [0, 0, -1.0, -2.0]
    with pytest.raises(ValueError, match="ref_logprobs"):
        rollout_to_samples(make_rollout([step([1, 2], [7])], advantage=None), "ref_kl", 1.0, 64)
    # echo-style: ce weight on the env tokens of turn 2, rl on sampled tokens.
    s2 = step([1, 2, 7, 8, 20, 21], [9])
    s2.prompt_ce_weights = [0, 0, 0, 0, 0.1, 0.1]
    (echo,) = rollout_to_samples(make_rollout([step([1, 2], [7, 8]), s2], 0.5), "rl", 1.0, 64)
    assert echo.loss_mask == [False, False, True, True, True, True, True]
    assert echo.ce_weights == pytest.approx([0, 0, 0, 0, 0.1, 0.1, 0])
    assert echo.rl_weights == [0, 0, 1, 1, 0, 0, 1]
    assert echo.advantages == [0, 0, 0.5, 0.5, 0, 0, 0.5]


def test_multi_sample_batch_packs_and_round_trips_through_the_contract(tmp_path):
    rollouts = [
        make_rollout([step(list(range(1, 2 + i)), [50 + i] * (3 + i), version=i % 2)], 0.25 * i)
        for i in range(6)
    ]
    samples = [s for r in rollouts for s in rollout_to_samples(r, "rl", 1.0, 16)]
    (batch,) = pack_samples(samples, 16)
    path = write_batch(tmp_path, 0, batch, {"step": 1})
    back = read_batch(path)
    assert back.meta["num_samples"] == 6 and back.meta["step"] == 1
    assert int(back.loss_mask.sum()) == sum(3 + i for i in range(6))
    # Every sample is recoverable from its segment: tokens and advantages in place.
    for s in samples:
        found = False
        for row in range(back.rows):
            for seg in range(1, int(back.segment_ids[row].max()) + 1):
                sel = back.segment_ids[row] == seg
                if back.tokens[row, sel].tolist() == s.token_ids:
                    np.testing.assert_allclose(back.advantages[row, sel], s.advantages, rtol=0, atol=1e-7)
                    found = True
        assert found
