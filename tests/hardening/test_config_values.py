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
        ("trainer.broadcast.transfer_timeout_s", 1e300),  # issue 48: unbounded (torch's timedelta overflows)
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


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[1, 2]", "top level is a list"),
        ('{"run": 5}', "run: must be a JSON object"),
        ('{"orchestrator": {"envs": 3}}', "not a primejax config"),
        ('{"trainer": {"optim": {"lr": "x"}}}', "trainer.optim.lr: bad value 'x'"),
        ('{"orchestrator": {"envs": {"a": {"id": 5}}}}', "orchestrator.envs.a.id: bad value 5"),
        ('{"inference": {"port": 1e400}}', "inference.port: bad value inf"),
        ('{"orchestrator": {"algo": [1]}}', "orchestrator.algo: must be a JSON object"),
        (
            '{"orchestrator": {"envs": {"a": {"args": [1]}}}}',
            "orchestrator.envs.a.args: must be a JSON object",
        ),
        ('{"inference": {"extra_args": "abc"}}', "inference.extra_args: must be a JSON list"),
        # issue 48: json's decoder raised RecursionError (a traceback)
        pytest.param("[" * 100_000 + "]" * 100_000, "nests too deeply", id="deep-list"),
        pytest.param('{"a":' * 100_000 + "1" + "}" * 100_000, "nests too deeply", id="deep-object"),
    ],
)
def test_a_hostile_saved_config_is_one_line(tmp_path, text, fragment):
    """A saved config (`--config run/configs/x.json`) of the wrong shape or types: one line naming the key, no
    traceback (AttributeError / TypeError before)."""
    from primejax.config.cli import UsageError, load_config_file

    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(UsageError) as err:
        load_config_file(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_a_saved_config_that_is_not_utf8_is_one_line(tmp_path):
    from primejax.config.cli import UsageError, load_config_file

    path = tmp_path / "c.json"
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(UsageError, match="not readable as a JSON config"):
        load_config_file(path)
