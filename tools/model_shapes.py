"""HF config.json shapes of the checkpoints the benchmarks and the TPU compile tool build at random init.

From huggingface.co/Qwen/Qwen3-{0.6B,4B,8B}, Qwen/Qwen3-30B-A3B, zai-org/GLM-4.5-Air and
deepseek-ai/DeepSeek-V3 (without its fp8 quantization block). A tool that needs another
`max_position_embeddings` (a longer benchmark row) overrides it: `dict(QWEN3["qwen3-4b"], max_position_embeddings=...)`.
Plain dicts, no imports: the GPU image runs these tools without primejax's CPU-only dependencies.
"""

from __future__ import annotations

from typing import Any

# Data tables: one checkpoint a row (ruff format would put every key on its own line).
# fmt: off
_BASE = dict(model_type="qwen3", vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
             max_position_embeddings=40960, head_dim=128, num_key_value_heads=8, hidden_act="silu")
QWEN3: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(_BASE, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-4b": dict(_BASE, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=True),
    "qwen3-8b": dict(_BASE, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=False),
    # 128 experts, 8 per token, every layer sparse.
    "qwen3-30b-a3b": dict(_BASE, model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          tie_word_embeddings=False),
    # Qwen3-235B-A22B's config.json: 94 sparse layers, 128 experts top-8, 64 query / 4 kv heads of 128.
    "qwen3-235b-a22b": dict(_BASE, model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288,
                            moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                            num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                            tie_word_embeddings=False),
}

# GLM-4.5-Air (glm4_moe): 128 experts top-8 + 1 shared, sigmoid routing, first layer dense, q/k/v bias, half
# of each head rotated, 96 heads of 128 on a hidden size of 4096. Benchmarks cut it to a few layers.
GLM: dict[str, dict[str, Any]] = {
    "glm4.5-air": dict(
        model_type="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
        head_dim=128, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False, n_routed_experts=128,
        num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        norm_topk_prob=True, first_k_dense_replace=1, num_nextn_predict_layers=1, rope_theta=1000000.0,
        rms_norm_eps=1e-5, max_position_embeddings=131072, hidden_act="silu", tie_word_embeddings=False),
}

# DeepSeek-V3 (deepseek_v3): multi-head latent attention (q through a 1536 bottleneck, kv through a 512 latent
# plus a 64-dim rope key), 256 experts top-8 + 1 shared, sigmoid routing in 8 groups (4 kept), 3 dense layers
# first. Benchmarks cut it to a few layers; one sparse layer alone holds 11.3B parameters.
DEEPSEEK: dict[str, dict[str, Any]] = {
    "deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
        topk_method="noaux_tc", scoring_func="sigmoid", routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=3, moe_layer_freq=1, num_nextn_predict_layers=1, rope_theta=10000,
        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                          mscale=1.0, mscale_all_dim=1.0),
        rms_norm_eps=1e-6, max_position_embeddings=163840, hidden_act="silu", tie_word_embeddings=False),
}

# Qwen3.5 (qwen3_5_text, the language model of the multimodal checkpoints): transformers 5.17's Qwen3_5TextConfig
# defaults, which its docstring calls "Qwen3.5-9B style" (not checked against the Hub: no model hub here).
# 3 Gated DeltaNet layers then one gated full-attention layer; 16 key / 32 value DeltaNet heads of 128; full
# attention 16 heads of 256 over 4 kv heads, a quarter of each head rotated.
_QWEN3_5_HYBRID = dict(  # the DeltaNet layers and the layer pattern, alike in the dense and MoE shapes
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, full_attention_interval=4)
_QWEN3_5_COMMON = dict(
    rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False, hidden_act="silu",
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25))
QWEN3_5: dict[str, dict[str, Any]] = {
    "qwen3.5-9b": dict(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        **_QWEN3_5_HYBRID, **_QWEN3_5_COMMON),
    # Qwen3.5 MoE (qwen3_5_moe_text): transformers 5.17's Qwen3_5MoeTextConfig defaults, which its docstring calls
    # "Qwen3.5-35B-A3B style" (not checked against the Hub). The same hybrid stack (3 DeltaNet layers then one
    # full-attention layer, 16 heads of 256 over 2 kv heads) with every MLP sparse: 256 experts of 512, top-8,
    # one shared expert of 512 with its sigmoid gate.
    "qwen3.5-35b-a3b": dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, **_QWEN3_5_HYBRID, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        **_QWEN3_5_COMMON),
}

# The tools' --smoke runs (CPU): tiny(shape) is the shape with these dimensions (layer and expert counts too).
TINY = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2)
# fmt: on


def tiny(hf: dict[str, Any]) -> dict[str, Any]:
    return dict(hf, **{k: v for k, v in TINY.items() if k in hf})
