"""Remat policies change memory, not math; gradients flow to every parameter; padding never leaks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from primejax.models.config import ModelConfig
from primejax.models.hf_io import param_variables
from primejax.models.transformer import Transformer, init_model

CFG = ModelConfig(
    model_type="qwen3",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    rope_scaling=None,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    qk_norm=True,
    attention_bias=False,
    max_position_embeddings=512,
    param_dtype="float32",
    compute_dtype="float32",
)
rng = np.random.default_rng(0)
TOKENS = jnp.asarray(rng.integers(0, 256, size=(2, 16)), jnp.int32)
POSITIONS = jnp.asarray(np.tile(np.arange(16), (2, 1)), jnp.int32)
SEGMENTS = jnp.ones((2, 16), jnp.int32)


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, None, seed=0)


def _with_cfg(model, cfg):
    """The same parameters under another config (here: another remat policy), without a new init."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


@nnx.jit
def _loss_and_grad(model):
    def loss(model):
        h = model(TOKENS, POSITIONS, SEGMENTS)
        return jnp.mean(jnp.einsum("btd,dv->btv", h, model.lm_head_weight()) ** 2)

    return nnx.value_and_grad(loss)(model)


@pytest.fixture(scope="module")
def baseline(model):
    return _loss_and_grad(model)


@pytest.mark.parametrize(
    "policy", ["full", "dots_no_batch", pytest.param("attn_offload", marks=pytest.mark.slow)]
)
def test_remat_policy_gives_the_same_gradients(policy, model, baseline):
    loss0, g0 = baseline
    loss, g = _loss_and_grad(_with_cfg(model, dataclasses.replace(CFG, remat_policy=policy)))
    assert float(loss) == pytest.approx(float(loss0), rel=1e-6)
    err = max(
        float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g), strict=True)
    )
    assert err < 1e-6, f"remat={policy}: gradients differ by {err:.3e}"


def test_every_parameter_gets_a_gradient(baseline):
    _, grads = baseline
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert float(jnp.abs(g).max()) > 0, f"zero gradient for {jax.tree_util.keystr(path)}"


@nnx.jit
def _hidden(model, tokens, positions, segments):
    return model(tokens, positions, segments)


def test_padding_and_other_segments_do_not_change_a_sample(model):
    # the sample alone, padded to the row length
    pad = jnp.zeros((1, 6), jnp.int32)
    alone = _hidden(
        model,
        jnp.concatenate([TOKENS[:1, :10], pad], 1),
        jnp.concatenate([POSITIONS[:1, :10], pad], 1),
        jnp.concatenate([SEGMENTS[:1, :10], pad], 1),
    )
    # the same sample followed by another sample and then padding, with different tokens there
    tokens = TOKENS[:1].at[0, 10:].set(jnp.arange(6) + 100)
    positions = POSITIONS[:1].at[0, 10:].set(jnp.array([0, 1, 2, 0, 0, 0]))
    segments = SEGMENTS[:1].at[0, 10:].set(jnp.array([2, 2, 2, 0, 0, 0]))
    packed = _hidden(model, tokens, positions, segments)
    np.testing.assert_allclose(np.asarray(packed[:, :10]), np.asarray(alone[:, :10]), atol=1e-6, rtol=0)


def test_param_count_matches_config(model):
    n = sum(int(np.prod(v.shape)) for v in param_variables(model).values())
    assert n == CFG.num_params()
