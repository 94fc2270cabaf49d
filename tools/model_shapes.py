"""HF config.json shapes of the Qwen3 checkpoints the benchmarks and the TPU compile tool build at random init.

From huggingface.co/Qwen/Qwen3-{0.6B,4B,8B} and Qwen/Qwen3-30B-A3B. A tool that needs another
`max_position_embeddings` (a longer benchmark row) overrides it: `dict(QWEN3["qwen3-4b"], max_position_embeddings=...)`.
Plain dicts, no imports: the GPU image runs these tools without primejax's CPU-only dependencies.
"""

from __future__ import annotations

from typing import Any

_BASE = dict(
    model_type="qwen3",
    vocab_size=151936,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    head_dim=128,
    num_key_value_heads=8,
    hidden_act="silu",
)
QWEN3: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        _BASE,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        tie_word_embeddings=True,
    ),
    "qwen3-4b": dict(
        _BASE,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        _BASE,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),
    # 128 experts, 8 per token, every layer sparse.
    "qwen3-30b-a3b": dict(
        _BASE,
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}
