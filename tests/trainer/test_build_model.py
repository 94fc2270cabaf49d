"""Fake-data mode without a model directory: the trainer's model is the `model.build_tiny` shape, whole."""

from __future__ import annotations

import jax

from primejax.models.settings import ModelSettings
from primejax.models.sharding import make_mesh
from primejax.models.tiny import TinyModelConfig
from primejax.trainer.loop import build_model


def test_no_model_path_builds_the_build_tiny_architecture():
    tiny = TinyModelConfig(tokenizer="bytes", vocab_size=270, hidden_size=32, num_heads=2, num_kv_heads=1)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    model, cfg = build_model(
        ModelSettings(build_tiny=tiny, compute_dtype="float32"), mesh, max_positions=8192
    )
    assert (cfg.vocab_size, cfg.hidden_size, cfg.max_position_embeddings) == (270, 32, 8192)
    assert cfg.compute_dtype == "float32" and model.embed[...].shape == (270, 32)
