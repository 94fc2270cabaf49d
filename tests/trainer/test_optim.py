"""AdamW's weight decay reaches the matrices and spares norm scales, biases and the never-trained router bias,
although the stacked layers give a norm scale [layers, hidden] as many dimensions as a matrix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from primejax.models.config import ModelConfig
from primejax.models.transformer import init_model
from primejax.trainer import optim


def test_weight_decay_spares_stacked_norms_and_biases():
    cfg = ModelConfig(
        model_type="qwen3",
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        rope_theta=1e4,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qk_norm=True,
        attention_bias=True,
        max_position_embeddings=64,
    )
    params = nnx.state(init_model(cfg, None, seed=0), nnx.Param)
    opt = optim.make_optimizer(
        dict(max_norm=0.0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.5), optim.make_schedule(1.0)
    )
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zeros, opt.init(params), params)  # zero gradients: only the decay moves anything
    moved = {}
    for path, u in jax.tree_util.tree_leaves_with_path(updates):
        names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
        moved[[n for n in names if n and n != "value"][-1]] = bool(np.any(np.asarray(u) != 0))
    for name, was_moved in moved.items():
        assert was_moved != name.endswith(("norm", "bias")), (name, was_moved)
    assert {"attn_norm", "q_norm", "q_bias", "q_proj"} <= set(
        moved
    )  # stacked: norms [L, D], biases [L, H, hd]
