"""Tiny random HF checkpoints (built locally with transformers, fp32) for the model tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file, save_file

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

# YaRN as DeepSeek-V3 configures it, stretched so the test positions (up to 40) cross its ramp, with the
# cos/sin factor and the softmax mscale both away from 1 (mscale != mscale_all_dim).
_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=16,
    mscale=1.0,
    mscale_all_dim=0.8,
    beta_fast=32,
    beta_slow=1,
)

# name -> (config class, model class, config kwargs)
VARIANTS = {
    "qwen3_tied": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3_untied": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(tie_word_embeddings=False),
    ),
    "llama_gqa": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(num_key_value_heads=1, tie_word_embeddings=False, rope_theta=500000.0),
    ),
    # original_max_position_embeddings=16 puts head_dim=32's wavelengths in all three llama3 bands
    # (kept, interpolated, divided by factor) for the positions the tests use.
    "llama_rope3": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            tie_word_embeddings=False,
            rope_theta=10000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "qwen2_bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    # Qwen3-MoE: expert counts / top-k, tied and untied, with and without dense layers.
    "qwen3_moe_e8k2_tied": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            tie_word_embeddings=True,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
    ),
    "qwen3_moe_e4k1_dense0": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[0],
        ),
    ),
    "qwen3_moe_e6k3_step2": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            tie_word_embeddings=False,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            num_hidden_layers=4,
        ),
    ),
    # GLM-4.5 MoE: sigmoid router with correction bias, group-limited top-k (4 groups, 2 kept), routed scaling,
    # a shared expert, the first layer dense, q/k/v bias, partial rotary (0.5); and tied embeddings with qk
    # norm, two shared experts, ungrouped routing, no renormalization, full rotary, every layer sparse.
    "glm4_moe_g4_dense1": (
        transformers.Glm4MoeConfig,
        transformers.Glm4MoeForCausalLM,
        dict(
            tie_word_embeddings=False,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            norm_topk_prob=True,
            attention_bias=True,
            num_hidden_layers=3,
            num_nextn_predict_layers=0,
        ),
    ),
    "glm4_moe_tied_qknorm": (
        transformers.Glm4MoeConfig,
        transformers.Glm4MoeForCausalLM,
        dict(
            tie_word_embeddings=True,
            n_routed_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            routed_scaling_factor=1.0,
            n_shared_experts=2,
            norm_topk_prob=False,
            use_qk_norm=True,
            attention_bias=False,
            num_nextn_predict_layers=0,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0),
        ),
    ),
    # DeepSeek-V3: multi-head latent attention with a query bottleneck (q_lora_rank), interleaved rope, 8 experts
    # top-2 in 4 groups of which 2 are kept, a shared expert, the first layer dense, untied; and without the
    # query bottleneck (q_proj), half-split rope, value heads as wide as query heads, yarn rope scaling, ungrouped routing,
    # no renormalization, every layer sparse, tied. num_key_value_heads = num_attention_heads (MLA).
    "deepseek_v3_qlora": (
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        dict(
            tie_word_embeddings=False,
            num_key_value_heads=4,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            head_dim=16,
            v_head_dim=24,
            rope_interleave=True,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            n_shared_experts=1,
            norm_topk_prob=True,
            num_hidden_layers=3,
            num_nextn_predict_layers=0,
        ),
    ),
    "deepseek_v3_noqlora_tied": (
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        dict(
            tie_word_embeddings=True,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            head_dim=16,
            v_head_dim=32,
            rope_interleave=False,
            n_routed_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            routed_scaling_factor=1.0,
            n_shared_experts=2,
            norm_topk_prob=False,
            num_nextn_predict_layers=0,
            rope_parameters=_YARN,
        ),
    ),
    # Qwen3.5 hybrid: three Gated DeltaNet layers then full attention (the default pattern), 4 value heads
    # over 2 key heads, quarter rotary, untied; and an alternating pattern starting with full attention, equal
    # head counts, narrower keys than values, a 3-wide conv, half rotary, tied.
    "qwen3_5_hybrid": (
        transformers.Qwen3_5TextConfig,
        transformers.Qwen3_5ForCausalLM,
        dict(
            tie_word_embeddings=False,
            num_hidden_layers=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
        ),
    ),
    "qwen3_5_alt_tied": (
        transformers.Qwen3_5TextConfig,
        transformers.Qwen3_5ForCausalLM,
        dict(
            tie_word_embeddings=True,
            num_hidden_layers=4,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=24,
            linear_conv_kernel_dim=3,
            layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        ),
    ),
    # Qwen3.5 MoE: the hybrid stack with every MLP sparse (renormalized softmax top-k, one shared expert with
    # its sigmoid gate). Three DeltaNet layers then full attention, 8 experts top-2, a shared expert wider
    # than the routed ones, untied; and alternating layers from full attention, 6 experts top-3, a narrower
    # shared expert, dk < dv, half rotary, tied.
    "qwen3_5_moe_hybrid": (
        transformers.Qwen3_5MoeTextConfig,
        transformers.Qwen3_5MoeForCausalLM,
        dict(
            tie_word_embeddings=False,
            num_hidden_layers=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        ),
    ),
    "qwen3_5_moe_alt_tied": (
        transformers.Qwen3_5MoeTextConfig,
        transformers.Qwen3_5MoeForCausalLM,
        dict(
            tie_word_embeddings=True,
            num_hidden_layers=2,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=24,
            linear_conv_kernel_dim=3,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=16,
            layer_types=["full_attention", "linear_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        ),
    ),
}
MOE_VARIANTS = [v for v in VARIANTS if v.startswith(("qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3_5_moe"))]


def build_hf_model(variant: str, out_dir: Path, seed: int = 0) -> transformers.PreTrainedModel:
    """Random-init HF model, with norms and biases perturbed away from HF's constant init so they matter."""
    cfg_cls, model_cls, extra = VARIANTS[variant]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**_COMMON, **extra})
    model = model_cls(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                # Spread the router's probabilities so no two experts nearly tie for a top-k place (a near
                # tie could resolve differently under torch's and XLA's rounding).
                p.copy_(0.5 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # HF starts it at zero; GLM-4.5's are not
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(out_dir)
    return model


def write_multimodal_checkpoint(src: Path, out: Path, wrapper_type: str) -> None:
    """A Qwen3.5 (`qwen3_5`) or Qwen3.5 MoE (`qwen3_5_moe`) ForConditionalGeneration-style directory made of the
    text checkpoint in `src`: its config under `text_config` (tie_word_embeddings at the top, as the published
    ones), its tensors under `model.language_model.*`, plus a vision tensor and an MTP tensor no loader reads."""
    text_cfg = json.loads((src / "config.json").read_text())
    tensors = {}
    for f in src.glob("*.safetensors"):
        for name, t in load_file(f).items():
            tensors[
                name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
            ] = t
    tensors["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    tensors["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, str(out / "model.safetensors"))
    arch = (
        "Qwen3_5MoeForConditionalGeneration"
        if wrapper_type == "qwen3_5_moe"
        else "Qwen3_5ForConditionalGeneration"
    )
    wrapper = dict(
        model_type=wrapper_type,
        architectures=[arch],
        tie_word_embeddings=text_cfg.pop("tie_word_embeddings"),
        text_config=text_cfg,
        vision_config=dict(model_type=f"{wrapper_type}_vision", depth=1),
    )
    (out / "config.json").write_text(json.dumps(wrapper))


def read_checkpoint_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors files in a checkpoint directory, by name."""
    out: dict[str, np.ndarray] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
