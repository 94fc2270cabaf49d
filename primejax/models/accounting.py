"""Parameter and FLOP counts of a model, from its `ModelConfig` alone (MFU, logs, benchmarks).

The conventions are prime-rl's (and torchtitan's), so MFU numbers compare with theirs; a family that departs
from them says so on its class (`Family.flops_own_head_dim`, models/families/).

`cfg` below is a `ModelConfig`, not imported: config.py is built on this module (its `num_params`,
`flops_per_token`, ... call these).
"""

from __future__ import annotations


def num_matmul_params(cfg) -> int:
    """Weights that take part in a token's matmuls: projections and MLP of every layer plus lm_head.

    For a MoE model only the active parameters count (top-k experts plus the router), as in prime-rl's
    MFU accounting of Qwen3-30B-A3B.

    lm_head is counted even when tied to the embedding (it still costs a matmul); the embedding lookup,
    norms and biases are not, as in prime-rl's MFU accounting.
    """
    d, h, k, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = _mla_params(cfg) if cfg.mla else d * h * hd + 2 * d * k * hd + h * hd * d
    if cfg.attn_output_gate:  # q_proj's second half: the output gate
        attn += d * h * hd
    mlp = 3 * d * cfg.intermediate_size
    return (
        len(cfg.full_attention_layers()) * attn
        + _linear_attention_params(cfg, matmul=True)
        + len(cfg.dense_layers()) * mlp
        + _moe_params(cfg, active=True)
        + (d * cfg.vocab_size)
    )


def num_matmul_params_per_layer(cfg) -> int:
    return (num_matmul_params(cfg) - cfg.hidden_size * cfg.vocab_size) // cfg.num_layers


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), prime-rl's formula.

    6 * matmul params + 12 * layers * heads * (hidden / heads) * seq_len. The attention term uses
    hidden/heads, not head_dim, exactly as prime-rl (and torchtitan) do, so MFU numbers are comparable.
    GLM-4.5 uses its own head width (12 * layers * heads * head_dim * seq_len: QK^T and PV, forward and
    backward): its 96 heads of 128 are three times its hidden size of 4096, which hidden/heads would miss.
    Qwen3.5 MoE too (16 heads of 256 against a hidden size of 2048), over its full-attention layers only;
    the hybrid families add their DeltaNet layers' own term (deltanet.deltanet_flops_per_token).
    DeepSeek-V3 (MLA, trained decompressed) counts QK^T over Dn + Dr and PV over Dv per head:
    6 * layers * heads * (Dn + Dr + Dv) * seq_len (V3: 192 + 128 against hidden/heads = 56).
    """
    if cfg.mla:
        per_token = 6 * cfg.num_layers * cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len
        return float(6 * num_matmul_params(cfg) + per_token)
    # GLM-4.5 and Qwen3.5 MoE (16 heads of 256 over a hidden size of 2048) use their own head width
    own = cfg.family.flops_own_head_dim
    per_head = cfg.head_dim if own else cfg.hidden_size // cfg.num_heads
    full = len(cfg.full_attention_layers())
    linear = 0.0
    if cfg.layer_types:
        # deltanet.py imports jax; config.json's readers (and so this module) stay without it
        from primejax.models.deltanet import deltanet_flops_per_token

        linear = len(cfg.linear_attention_layers()) * deltanet_flops_per_token(cfg)
    return float(6 * num_matmul_params(cfg) + 12 * full * cfg.num_heads * per_head * seq_len + linear)


def num_params(cfg) -> int:
    """All parameters as stored (embedding once when tied, norms and biases included)."""
    d, h, k, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = d * h * hd * (2 if cfg.attn_output_gate else 1) + 2 * d * k * hd + h * hd * d
    if cfg.mla:  # its matmuls plus the latent norms
        per_layer = _mla_params(cfg) + cfg.q_lora_rank + cfg.kv_lora_rank
    if cfg.qk_norm:
        per_layer += 2 * hd
    if cfg.attention_bias:
        per_layer += (h + 2 * k) * hd
    if cfg.attention_out_bias:
        per_layer += d
    attention = len(cfg.full_attention_layers()) * per_layer + _linear_attention_params(cfg, matmul=False)
    head = 0 if cfg.tie_word_embeddings else d * cfg.vocab_size
    mlp = len(cfg.dense_layers()) * 3 * d * cfg.intermediate_size + _moe_params(cfg, active=False)
    if cfg.router_scoring == "sigmoid":  # e_score_correction_bias
        mlp += len(cfg.sparse_layers()) * cfg.num_experts
    return attention + cfg.num_layers * 2 * d + mlp + cfg.vocab_size * d + head + d


def _linear_attention_params(cfg, *, matmul: bool) -> int:
    """The Gated DeltaNet layers' weights (qwen3_5_text): all, or only those in matmuls."""
    if not cfg.layer_types:
        return 0
    from primejax.models.deltanet import deltanet_params  # jax: as in flops_per_token

    return len(cfg.linear_attention_layers()) * deltanet_params(cfg, matmul=matmul)


def _mla_params(cfg) -> int:
    """One layer's multi-head latent attention matmul weights (q path, kv_a, kv_b, o_proj)."""
    d, h, rq, rkv = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    q = d * rq + rq * h * cfg.qk_head_dim if rq else d * h * cfg.qk_head_dim
    kv = d * (rkv + cfg.head_dim) + rkv * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + h * cfg.v_head_dim * d


def _moe_params(cfg, *, active: bool) -> int:
    """Expert + router weights of all sparse layers; `active`: only the top-k experts a token uses. The
    shared experts and Qwen3.5 MoE's shared-expert gate [D] count in both."""
    d, routed = cfg.hidden_size, (cfg.num_experts_per_tok if active else cfg.num_experts)
    per_layer = 3 * d * (cfg.moe_intermediate_size * routed + cfg.shared_width) + d * cfg.num_experts
    return len(cfg.sparse_layers()) * (per_layer + (d if cfg.shared_expert_gate else 0))
