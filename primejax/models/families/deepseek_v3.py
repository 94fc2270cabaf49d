"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head latent attention (models/mla.py) and GLM-4.5's sigmoid
MoE (families/glm4_moe.py), yarn rope with interleaved pairs. q_lora_rank null (no query bottleneck) is stored
as 0; the MTP layers are skipped as for GLM-4.5. `head_dim` is the rotated part of a query/key head
(qk_rope_head_dim, as transformers sets it)."""

from __future__ import annotations

from typing import Any

from primejax.models.families.base import Family, register, tiny_common
from primejax.models.families.glm4_moe import (
    SIGMOID_MOE_KEYS,
    sigmoid_moe_fields,
    sigmoid_moe_hf,
    tiny_sigmoid_moe,
)

# transformers' DeepseekV3Config defaults for absent keys
_DEFAULTS = dict(
    num_experts_per_tok=8, moe_intermediate_size=2048, norm_topk_prob=True, first_k_dense_replace=3,
    routed_scaling_factor=2.5, n_group=8, topk_group=4, n_shared_experts=1,
)  # fmt: skip
# The tiny model's latent widths: vLLM's CPU MLA decode kernel is compiled for a latent cache of 512 + 64 only
# (DeepSeek-V2/V3's kv_lora_rank + qk_rope_head_dim), so a tiny model vLLM serves keeps them.
MLA_KV_LORA_RANK, MLA_ROPE_HEAD_DIM = 512, 64
# The tiny model's rope is DeepSeek-V3's released one (its config.json): yarn stretching 4096 positions 40x over
# theta 1e4. It is also what vLLM serves right on CPU: without rope scaling, vLLM's DeepseekV2 takes its CPU
# rotary kernel, which mis-rotates MLA's [tokens, heads, 64] query and key views (docs/models.md).
MLA_ROPE = dict(
    rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
    beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
)  # fmt: skip


@register
class DeepseekV3(Family):
    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    moe = True
    hf_keys = SIGMOID_MOE_KEYS | {
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim",
        "rope_interleave", "scoring_func", "topk_method", "moe_layer_freq",
    }  # fmt: skip
    rope_types = ("default", "llama3", "yarn")

    def fields(self, hf: dict) -> dict[str, Any]:
        if hf.get("attention_bias"):
            raise NotImplementedError("deepseek_v3 with attention_bias=true is not implemented")
        # The original checkpoint's keys transformers ignores but whose other values mean another model.
        for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
            if hf.get(key, value) != value:
                raise NotImplementedError(
                    f"deepseek_v3 with {key}={hf[key]!r} is not implemented (only {value!r})"
                )
        return dict(
            sigmoid_moe_fields(hf, _DEFAULTS),
            head_dim=int(hf.get("qk_rope_head_dim", 64)),
            attention_out_bias=False,
            q_lora_rank=int(hf.get("q_lora_rank", 1536) or 0),
            kv_lora_rank=int(hf.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(hf.get("qk_nope_head_dim", 128)),
            v_head_dim=int(hf.get("v_head_dim", 128)),
            rope_interleave=bool(hf.get("rope_interleave", True)),
        )

    def hf_fields(self, cfg) -> dict[str, Any]:
        # scoring_func / topk_method: transformers ignores them (its router is always this one) but vLLM's
        # DeepseekV2 model reads them, with softmax and no correction bias as its defaults: written always.
        return dict(
            sigmoid_moe_hf(cfg),
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            q_lora_rank=cfg.q_lora_rank or None,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.head_dim,
            v_head_dim=cfg.v_head_dim,
            qk_head_dim=cfg.qk_head_dim,
            rope_interleave=cfg.rope_interleave,
        )

    def check(self, cfg) -> None:
        if not cfg.mla:
            raise ValueError("deepseek_v3 needs kv_lora_rank > 0 (multi-head latent attention)")

    def tiny(self, shape: dict) -> dict:
        """Latent attention with a query bottleneck of hidden/2, vLLM's CPU latent widths (MLA_KV_LORA_RANK +
        MLA_ROPE_HEAD_DIM), `head_dim` for the unrotated query/key part and the values, interleaved rope with
        DeepSeek-V3's yarn (MLA_ROPE), every head its own kv head; GLM-4.5's tiny sigmoid MoE."""
        common = tiny_common(self, shape)
        common.pop("rope_theta")
        common.update(num_key_value_heads=shape["num_attention_heads"], head_dim=MLA_ROPE_HEAD_DIM)
        return dict(
            common, **tiny_sigmoid_moe(shape), rope_parameters=dict(MLA_ROPE),
            q_lora_rank=max(shape["hidden_size"] // 2, 16), kv_lora_rank=MLA_KV_LORA_RANK,
            qk_rope_head_dim=MLA_ROPE_HEAD_DIM, qk_nope_head_dim=shape["head_dim"], v_head_dim=shape["head_dim"],
            rope_interleave=True,
        )  # fmt: skip
