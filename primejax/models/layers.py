"""Per-token building blocks every attention kind shares: RMSNorm and rotary position embedding.

Rotary embedding as transformers computes it for these families: inverse frequencies for the `rotary_dim`
rotated dims (default, llama3 or yarn scaling), cos/sin tables in the half-split (rotate_half) convention,
optionally scaled by yarn's attention factor, and DeepSeek's interleaved layout (`rope_interleave`: pairs
(x0, x1), (x2, x3), ... rotate together; transformers de-interleaves them to [evens, odds] and rotates halves,
which is what `apply_rope(..., interleaved=True)` does, so q.k is the same).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# Rope scaling types implemented (transformers' names). yarn is DeepSeek-V3's (and checked only there).
ROPE_TYPES = ("default", "llama3", "yarn")


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, offset: bool = False) -> jax.Array:
    """HF RMSNorm: normalize in fp32, cast back, then scale in the compute dtype.

    `offset` (Qwen3.5's zero-centered norm): the scale is 1 + weight, applied in fp32 before the cast, as
    transformers' Qwen3_5RMSNorm does."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return y.astype(x.dtype) * weight.astype(x.dtype)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times (transformers' get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_factor(cfg) -> float:
    s = cfg.rope_scaling
    factor = s.get("factor")
    if factor is None:  # as transformers: the stretch of max_position_embeddings over the pre-training length
        factor = cfg.max_position_embeddings / s["original_max_position_embeddings"]
    return float(factor)


def rope_attention_factor(cfg) -> float:
    """The factor yarn multiplies cos/sin by (1.0 for default and llama3 rope), as transformers."""
    s = cfg.rope_scaling
    if s is None or s.get("rope_type") != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor, mscale, mscale_all_dim = _yarn_factor(cfg), s.get("mscale"), s.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def rope_inv_freq(cfg) -> np.ndarray:
    """Inverse frequencies [R/2] (float32) for the R = cfg.rotary_dim rotated dims, with llama3 or yarn
    frequency-dependent scaling when configured."""
    dim = cfg.rotary_dim
    pos_freqs = cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)
    inv_freq = (1.0 / pos_freqs).astype(np.float32)
    scaling = cfg.rope_scaling
    rope_type = "default" if scaling is None else scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "yarn":
        return _yarn_inv_freq(cfg, pos_freqs.astype(np.float32))
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(cfg, pos_freqs: np.ndarray) -> np.ndarray:
    """YaRN (transformers' _compute_yarn_parameters): dims rotating more than beta_fast times over the
    pre-training length keep their frequency, those under beta_slow are divided by `factor`, a linear ramp
    between."""
    s, dim, base = cfg.rope_scaling, cfg.rotary_dim, cfg.rope_theta
    factor = _yarn_factor(cfg)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    old_len = s["original_max_position_embeddings"]

    def correction_dim(rotations):
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_extra = (1.0 / pos_freqs).astype(np.float32)
    inv_inter = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    return (inv_inter * (1 - extrapolation) + inv_extra * extrapolation).astype(np.float32)


def rope_tables(positions: jax.Array, cfg, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, R] (R = rotary_dim) for the half-split (rotate_half) convention HF uses for these
    families, times yarn's attention factor when configured."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(cfg))
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    factor = rope_attention_factor(cfg)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(
    x_btnh: jax.Array, cos_btr: jax.Array, sin_btr: jax.Array, *, interleaved: bool = False
) -> jax.Array:
    """Rotate the first R = cos.shape[-1] dims of each head (all of them unless partial rotary); the rest pass.

    `interleaved` (DeepSeek's rope_interleave): the rotated dims are first de-interleaved to [evens, odds],
    as transformers does, so the output holds them in that order."""
    r = cos_btr.shape[-1]
    if r < x_btnh.shape[-1]:
        rotated = apply_rope(x_btnh[..., :r], cos_btr, sin_btr, interleaved=interleaved)
        return jnp.concatenate([rotated, x_btnh[..., r:]], axis=-1)
    if interleaved:
        x_btnh = jnp.concatenate([x_btnh[..., 0::2], x_btnh[..., 1::2]], axis=-1)
    half = r // 2
    rotated = jnp.concatenate([-x_btnh[..., half:], x_btnh[..., :half]], axis=-1)
    return x_btnh * cos_btr[:, :, None] + rotated * sin_btr[:, :, None]
