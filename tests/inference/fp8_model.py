"""The tiny Qwen3-MoE the FP8 GPU test serves (tests/gpu/test_gpu_fp8.py), shared with the CPU test that
reproduces what an H200 served of it (tests/inference/test_fp8.py): one layer holds both kinds of quantized
weights vLLM has, linear (fused q/k/v, o) and fused experts (w13, w2)."""

from __future__ import annotations

from pathlib import Path

TINY_FP8_MOE = dict(
    family="qwen3_moe",
    tied=False,
    seed=5,
    hidden_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=128,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
)


def build_fp8_moe(path: Path) -> Path:
    from primejax.models.tiny import build_tiny_model

    return build_tiny_model(path, **TINY_FP8_MOE)
