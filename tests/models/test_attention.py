"""Attention kernels agree on packed rows; unsupported requests fall back to xla with one warning."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from primejax.models.attention import attention, resolve_impl

B, T, H, K, D = 2, 128, 4, 2, 32


@pytest.fixture(scope="module")
def packed_qkv():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, T, K, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, T, K, D)), jnp.float32)
    seg = np.ones((B, T), np.int32)
    seg[0, 50:], seg[0, 100:], seg[1, 70:] = 2, 0, 2  # row 0: two samples + padding; row 1: two samples
    return q, k, v, jnp.asarray(seg)


def _reference(q, k, v, seg):
    """Per-segment loop in numpy: each sample attends causally to itself only."""
    q, k, v, seg = map(np.asarray, (q, k, v, seg))
    out = np.zeros_like(q)
    g = H // K
    for b in range(B):
        for s in np.unique(seg[b]):
            idx = np.nonzero(seg[b] == s)[0]
            for h in range(H):
                scores = q[b, idx, h] @ k[b, idx, h // g].T / np.sqrt(D)
                scores = np.where(np.tril(np.ones((len(idx),) * 2, bool)), scores, -np.inf)
                p = np.exp(scores - scores.max(-1, keepdims=True))
                out[b, idx, h] = (p / p.sum(-1, keepdims=True)) @ v[b, idx, h // g]
    return out


def test_xla_matches_per_segment_reference(packed_qkv):
    err = float(np.abs(np.asarray(attention(*packed_qkv, impl="xla")) - _reference(*packed_qkv)).max())
    assert err < 1e-5, f"xla attention vs per-segment reference: {err:.3e}"


def test_splash_kernel_matches_xla_forward_and_grad(packed_qkv):
    """The TPU splash path, run by the Pallas interpreter on CPU."""
    q, k, v, seg = packed_qkv
    fwd_err = float(
        jnp.abs(attention(q, k, v, seg, impl="splash", interpret=True) - attention(q, k, v, seg)).max()
    )
    assert fwd_err < 1e-5, f"splash vs xla forward: {fwd_err:.3e}"

    def loss(impl, **kw):
        return lambda q, k, v: (attention(q, k, v, seg, impl=impl, **kw) ** 2).sum()

    g_xla = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    g_spl = jax.grad(loss("splash", interpret=True), argnums=(0, 1, 2))(q, k, v)
    grad_err = max(float(jnp.abs(a - b).max()) for a, b in zip(g_xla, g_spl, strict=True))
    assert grad_err < 1e-4, f"splash vs xla gradients: {grad_err:.3e}"


def test_unsupported_impl_falls_back_to_xla_with_one_warning(packed_qkv, caplog):
    with caplog.at_level(logging.WARNING, logger="primejax.models.attention"):
        a = attention(*packed_qkv, impl="cudnn")
        b = attention(*packed_qkv, impl="cudnn")
    assert np.array_equal(np.asarray(a), np.asarray(attention(*packed_qkv, impl="xla")))
    assert np.array_equal(np.asarray(a), np.asarray(b))
    warnings = [r for r in caplog.records if "cudnn" in r.getMessage()]
    assert len(warnings) <= 1  # at most once per process (an earlier test may already have warned)
    assert resolve_impl("cudnn", jnp.bfloat16, backend="cpu") == "xla"
    assert resolve_impl("splash", jnp.bfloat16, backend="gpu") == "xla"


def test_auto_picks_the_backend_kernel():
    assert resolve_impl("auto", jnp.bfloat16, backend="cpu") == "xla"
    assert resolve_impl("auto", jnp.bfloat16, backend="gpu") == "cudnn"
    assert resolve_impl("auto", jnp.float32, backend="gpu") == "xla"
    assert resolve_impl("auto", jnp.bfloat16, backend="tpu") == "splash"
    with pytest.raises(ValueError, match="unknown attention"):
        resolve_impl("flash3", jnp.bfloat16, backend="cpu")
