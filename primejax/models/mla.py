"""Multi-head latent attention (DeepSeek-V3; transformers' DeepseekV3Attention), in its training form.

Queries: q = q_b_proj(RMSNorm(q_a_proj(x))) through a rank-Rq bottleneck, or q_proj(x) when q_lora_rank is
None (stored 0). Keys and values: kv_a_proj_with_mqa(x) gives a compressed latent c [Rkv] and one rope key
k_pe [Dr] shared by every head; c is RMSNorm'ed and kv_b_proj expands it to each head's k_nope [Dn] and
v [Dv]. Each head's query and key are [nope | rope] (Dn + Dr); the rope part is rotated (DeepSeek's
interleaved pairs when rope_interleave), the nope part not. Softmax scale (Dn + Dr)^-0.5, times yarn's
mscale(factor, mscale_all_dim)^2 with yarn rope scaling, as transformers.

Training form: the latent is decompressed to full per-head k/v and the ordinary packed causal attention runs
(any kernel, packed segments, context parallelism: models/attention.py), since every token is both a query
and a key in a training step. The absorbed form (kv_b_proj folded into the query and the output so attention
runs over the Rkv latent, a KV cache of Rkv + Dr per token) pays off only when decoding one token against a
long cache: that is the sampler's business (vLLM), not implemented here.

Weights of one layer (stacked over layers in DecoderStack):
  q_a_proj [D, Rq]   q_a_norm [Rq]   q_b_proj [Rq, H, Dn+Dr]     (or q_proj [D, H, Dn+Dr])
  kv_a_proj [D, Rkv+Dr]   kv_a_norm [Rkv]   kv_b_proj [Rkv, H, Dn+Dv]   o_proj [H, Dv, D]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from primejax.models.layers import apply_rope, rms_norm, yarn_mscale

LATENT_NORM_EPS = 1e-6


def attention_scale(cfg) -> float:
    """Softmax scale of MLA: (Dn + Dr)^-0.5, times mscale^2 with yarn rope scaling (mscale_all_dim)."""
    scale = cfg.qk_head_dim**-0.5
    s = cfg.rope_scaling
    if s is not None and s.get("rope_type") == "yarn" and s.get("mscale_all_dim"):
        m = yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"]))
        scale = scale * m * m
    return scale


def mla_qkv(
    cfg, p: dict[str, jax.Array], h_btd: jax.Array, cos, sin
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k [B, T, H, Dn+Dr] and v [B, T, H, Dv] of one layer (`p`: its weights) from normed hidden states."""
    # transformers builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps, not rms_norm_eps (DeepSeek's
    # own code does the same); vLLM uses rms_norm_eps. The released configs set 1e-6 for both.
    dt, eps = h_btd.dtype, LATENT_NORM_EPS
    dn, rkv = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        cq_btr = rms_norm(jnp.einsum("btd,dr->btr", h_btd, p["q_a_proj"].astype(dt)), p["q_a_norm"], eps)
        q_btnh = jnp.einsum("btr,rnh->btnh", cq_btr, p["q_b_proj"].astype(dt))
    else:
        q_btnh = jnp.einsum("btd,dnh->btnh", h_btd, p["q_proj"].astype(dt))
    ckv_btr = jnp.einsum("btd,dr->btr", h_btd, p["kv_a_proj"].astype(dt))
    c_btr = rms_norm(ckv_btr[..., :rkv], p["kv_a_norm"], eps)
    kv_btnh = jnp.einsum("btr,rnh->btnh", c_btr, p["kv_b_proj"].astype(dt))
    k_nope, v_btnh = kv_btnh[..., :dn], kv_btnh[..., dn:]
    # The rope key is one [Dr] vector per token, rotated once and shared by all heads.
    k_pe = apply_rope(ckv_btr[..., None, rkv:], cos, sin, interleaved=cfg.rope_interleave)
    q_pe = apply_rope(q_btnh[..., dn:], cos, sin, interleaved=cfg.rope_interleave)
    q_btnh = jnp.concatenate([q_btnh[..., :dn], q_pe], axis=-1)
    k_btnh = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, (*k_nope.shape[:-1], k_pe.shape[-1]))], axis=-1)
    return q_btnh, k_btnh, v_btnh
