"""Shared tiny-model and random-batch helpers for the trainer tests."""

from __future__ import annotations

import numpy as np
import pytest

from primejax.contracts.batch import TrainingSample
from primejax.models.config import ModelConfig

VOCAB = 64


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(
        model_type="qwen3",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        rope_theta=10000.0,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qk_norm=True,
        attention_bias=False,
        max_position_embeddings=256,
        param_dtype="float32",
        compute_dtype="float32",
        attention_impl="xla",
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def random_samples(
    seed: int, n: int, min_len: int = 6, max_len: int = 30, streams: bool = True
) -> list[TrainingSample]:
    """Random samples exercising every stream: rl, ce and ref_kl weights (incl. zeros) and temperatures."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        prompt = int(rng.integers(1, min(4, length - 1) + 1))
        mask = [False] * prompt + [True] * (length - prompt)
        kw = {}
        if streams and i % 3 == 1:
            kw = dict(
                ce_weights=list(rng.choice([0.0, 0.5, 1.0], length)),
                rl_weights=list(rng.choice([0.0, 1.0], length)),
            )
        elif streams and i % 3 == 2:
            kw = dict(
                ref_kl_weights=list(rng.choice([0.0, 1.0], length)),
                ref_logprobs=list(-rng.random(length) * 4),
            )
        out.append(
            TrainingSample(
                token_ids=list(rng.integers(0, VOCAB, length)),
                loss_mask=mask,
                inference_logprobs=[0.0] * prompt + list(np.log(rng.uniform(0.005, 0.2, length - prompt))),
                advantages=list(rng.normal(size=length)),
                temperature=float(rng.choice([0.7, 1.0, 1.3])),
                **kw,
            )
        )
    return out


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    return tiny_config()


@pytest.fixture(scope="session")
def make_config():
    """`tiny_config` as a fixture: `from conftest import` inside a test finds whichever conftest pytest
    imported last, which depends on the directories collected in the run."""
    return tiny_config


@pytest.fixture(scope="session")
def make_samples():
    """`random_samples` as a fixture (test modules do not import conftest)."""
    return random_samples
