"""The chunked LM-head logprobs match the naive full-logits computation, forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from primejax.trainer.logprobs import token_logprobs, token_logprobs_reference


def _inputs(b=2, t=37, d=16, v=50, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (b, t, d))
    w = jax.random.normal(k[1], (d, v)) * 0.5
    y = jax.random.randint(k[2], (b, t), 0, v)
    tau = jax.random.uniform(k[3], (b, t), minval=0.5, maxval=1.5)
    return h, w, y, tau


@pytest.mark.parametrize("chunk", [1, 8, 37, 1024])
def test_chunked_matches_reference_forward(chunk):
    h, w, y, tau = _inputs()
    lp, ent = token_logprobs(h, w, y, tau, chunk_size=chunk)
    lp_ref, ent_ref = token_logprobs_reference(h, w, y, tau)
    np.testing.assert_allclose(lp, lp_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ent_ref, rtol=1e-5, atol=1e-5)
    # entropy of a softmax over 50 classes lies in [0, log 50]
    assert (ent >= -1e-5).all() and (ent <= np.log(50) + 1e-5).all()


def test_chunked_matches_reference_gradients():
    h, w, y, tau = _inputs()
    coef = jax.random.normal(jax.random.key(9), y.shape)

    def objective(fn):
        def f(h, w):
            lp, ent = fn(h, w)
            return jnp.sum(coef * lp) + 0.1 * jnp.sum(ent)

        return jax.grad(f, argnums=(0, 1))

    g_fast = objective(lambda h, w: token_logprobs(h, w, y, tau, chunk_size=8))(h, w)
    g_ref = objective(lambda h, w: token_logprobs_reference(h, w, y, tau))(h, w)
    for a, b in zip(g_fast, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_backward_does_not_keep_every_chunks_logits():
    """With chunking, the compiled gradient's temporaries stay far below one full [B, T, V] fp32 logits."""
    b, t, d, v = 1, 4096, 16, 2048
    h = jnp.ones((b, t, d))
    w = jnp.ones((d, v)) * 0.01
    y = jnp.zeros((b, t), jnp.int32)
    tau = jnp.ones((b, t))
    full_logits_bytes = b * t * v * 4

    def temp_bytes(chunk):
        f = jax.grad(lambda h, w: jnp.sum(token_logprobs(h, w, y, tau, chunk_size=chunk)[0]), argnums=(0, 1))
        analysis = jax.jit(f).lower(h, w).compile().memory_analysis()
        return analysis.temp_size_in_bytes

    assert temp_bytes(256) < full_logits_bytes / 4


def test_bf16_hidden_accumulates_in_fp32():
    h, w, y, tau = _inputs()
    lp, _ = token_logprobs(h.astype(jnp.bfloat16), w, y, tau, chunk_size=8)
    lp_ref, _ = token_logprobs_reference(h, w, y, tau)
    assert lp.dtype == jnp.float32
    np.testing.assert_allclose(lp, lp_ref, atol=0.1)
