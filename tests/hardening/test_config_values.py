"""Every float key finite, every size in a range a machine can hold: rejected at start-up naming the key."""

from __future__ import annotations

import pytest

from primejax.config import ConfigError, default_config, validate

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("trainer.optim.lr", NAN),
        ("trainer.optim.lr", INF),
        ("sft.lr", NAN),
        ("trainer.loss.is_clip", NAN),
        ("orchestrator.sampling.temperature", INF),
        ("orchestrator.sampling.temperature", 0.0),  # greedy: the trainer would divide the logits by 0
        ("orchestrator.max_abs_reward", 1e308),  # float32 advantages would overflow
        ("orchestrator.max_failed_steps", -1),
        ("orchestrator.client.timeout_s", NAN),
        ("inference.startup_timeout_s", INF),
        ("trainer.loss.kl_tau", NAN),
        ("trainer.optim.max_norm", NAN),
        ("orchestrator.filters.gibberish_threshold", -INF),
        ("trainer.batch_timeout_s", NAN),
        ("orchestrator.seq_len", 10**12),
        ("inference.port", 70000),
        ("inference.port", -1),
        ("inference.max_model_len", 10**12),
        ("sft.batch_size", 0),
        ("sft.batch_size", -4),
        ("sft.seq_len", 0),
        ("sft.steps", -1),
    ],
)
def test_bad_values_fail_at_start_up_naming_the_key(key, value):
    c = default_config()
    c.model.path = "m"
    *parents, last = key.split(".")
    node = c
    for p in parents:
        node = node[p]
    node[last] = value
    with pytest.raises(ConfigError) as err:
        validate(c)
    assert str(err.value).startswith(f"{key}: ") and "\n" not in str(err.value)


def test_sft_lr_must_be_positive_when_sft_runs():
    c = default_config()
    c.model.path, c.sft.steps, c.sft.data_path, c.sft.lr = "m", 10, "d.jsonl", 0.0
    with pytest.raises(ConfigError, match="^sft.lr: "):
        validate(c)
