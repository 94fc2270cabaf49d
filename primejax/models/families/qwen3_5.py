"""Qwen3.5 (`qwen3_5_text`, transformers 5.17's `Qwen3_5ForCausalLM`) and Qwen3.5 MoE (`qwen3_5_moe_text`,
`Qwen3_5MoeForCausalLM`).

The hybrid stack (docs/models.md): each layer's token mixer is either Gated DeltaNet linear attention
(models/deltanet.py) or gated full attention (GQA whose q_proj also yields a per-head output gate, sigmoid,
applied before o_proj; q/k RMSNorm; rotary on the first quarter of each head), in the order of the config's
`layer_types` (by default three DeltaNet layers then one full-attention layer). Every RMSNorm but the
DeltaNet's gated one stores its weight zero-centered (applied as 1 + w). The MLP is the dense SwiGLU.

The published checkpoints are multimodal (`model_type` "qwen3_5", `Qwen3_5ForConditionalGeneration`): the
language model's config is their `text_config` and its tensors are named `model.language_model.*`; loading
reads that language model (the vision tower and the MTP head are not loaded), and the export is the
text-only `Qwen3_5ForCausalLM` checkpoint.

Qwen3.5 MoE is the same hybrid stack with every layer's MLP a sparse MoE block (moe.py): Qwen3-MoE's softmax
top-k router, always renormalized over the chosen experts, plus one shared expert (a SwiGLU of
`shared_expert_intermediate_size`) whose output is scaled by a per-token sigmoid gate (`shared_expert_gate`,
[1, D]) before it is added. Its tensors are `mlp.gate`, `mlp.experts.*`, `mlp.shared_expert.*` (singular, not
GLM-4.5's `shared_experts`) and `mlp.shared_expert_gate`; the multimodal `qwen3_5_moe` checkpoints wrap it as
the dense ones do.
"""

from __future__ import annotations

from typing import Any

from primejax.models.families.base import FULL_ATTENTION, LINEAR_ATTENTION, Family, register, tiny_common
from primejax.models.families.glm4_moe import partial_rotary_factor

# transformers' Qwen3_5TextConfig defaults for absent keys
_DEFAULTS = dict(
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, head_dim=256,
)  # fmt: skip
# transformers' Qwen3_5MoeTextConfig defaults for absent keys
_MOE_DEFAULTS = dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                     shared_expert_intermediate_size=512)  # fmt: skip
# The multimodal checkpoint's language-model tensor prefix, for the text model's `model.` one.
LANGUAGE_MODEL_PREFIX = "model.language_model."


@register
class Qwen3_5(Family):
    model_type = "qwen3_5_text"
    architecture = "Qwen3_5ForCausalLM"
    wrappers = ("qwen3_5",)
    hf_keys = frozenset(
        set(_DEFAULTS) | {"layer_types", "full_attention_interval", "partial_rotary_factor", "hidden_act"}
    )
    mixers = (FULL_ATTENTION, LINEAR_ATTENTION)
    partial_rotary = True

    def fields(self, hf: dict) -> dict[str, Any]:
        if hf.get("attention_bias"):
            raise NotImplementedError(f"{hf['model_type']} with attention_bias=true is not implemented")
        n = int(hf["num_hidden_layers"])
        types = hf.get("layer_types")
        if not types:
            every = int(hf.get("full_attention_interval", 4))
            types = [LINEAR_ATTENTION if (i + 1) % every else FULL_ATTENTION for i in range(n)]

        def get(key):
            return int(hf[key] if hf.get(key) is not None else _DEFAULTS[key])

        return dict(
            qk_norm=True,
            layer_types=tuple(types),
            linear_conv_kernel_dim=get("linear_conv_kernel_dim"),
            linear_key_head_dim=get("linear_key_head_dim"),
            linear_value_head_dim=get("linear_value_head_dim"),
            linear_num_key_heads=get("linear_num_key_heads"),
            linear_num_value_heads=get("linear_num_value_heads"),
            attn_output_gate=True,
            norm_offset=True,
            partial_rotary_factor=partial_rotary_factor(hf, 0.25),
        )

    def hf_fields(self, cfg) -> dict[str, Any]:
        return dict(
            layer_types=list(cfg.layer_types),
            linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
            linear_key_head_dim=cfg.linear_key_head_dim,
            linear_value_head_dim=cfg.linear_value_head_dim,
            linear_num_key_heads=cfg.linear_num_key_heads,
            linear_num_value_heads=cfg.linear_num_value_heads,
            partial_rotary_factor=cfg.partial_rotary_factor,
        )

    def check(self, cfg) -> None:
        if cfg.lora_rank:
            raise NotImplementedError(f"LoRA on {cfg.model_type} is not implemented")
        if cfg.num_experts:
            raise ValueError(
                "qwen3_5_text has no experts: a Qwen3.5 MoE checkpoint is model_type qwen3_5_moe_text"
            )

    def text_config(self, hf: dict) -> dict:
        """The language model's config.json dict of a multimodal Qwen3.5 checkpoint (its `text_config`, with the
        top-level `tie_word_embeddings`, which transformers reads there)."""
        text = dict(hf.get("text_config") or {})
        if not text:
            raise ValueError(
                f"model_type {hf.get('model_type')!r} without a text_config: not a Qwen3.5 checkpoint"
            )
        if "tie_word_embeddings" in hf:
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        text["model_type"] = self.model_type
        return text

    def stored_name(self, name: str, weight_map) -> str:
        """The text model's tensor `name` as stored in a multimodal checkpoint (`model.language_model.*`) when
        that is where it lives, else `name`."""
        if name in weight_map or not name.startswith("model."):
            return name
        return LANGUAGE_MODEL_PREFIX + name.removeprefix("model.")

    def tiny(self, shape: dict) -> dict:
        """Full attention every 4th layer and last (so 2 layers are one of each), Gated DeltaNet with
        num_heads key heads and twice as many value heads of head_dim, conv kernel 4, a quarter rotary."""
        common = tiny_common(self, shape)
        theta = common.pop("rope_theta")
        n, heads, hd = shape["num_hidden_layers"], shape["num_attention_heads"], shape["head_dim"]
        every = min(4, n)
        return dict(
            common, layer_types=[LINEAR_ATTENTION if (i + 1) % every else FULL_ATTENTION for i in range(n)],
            linear_num_key_heads=heads, linear_num_value_heads=2 * heads, linear_key_head_dim=hd,
            linear_value_head_dim=hd, linear_conv_kernel_dim=4,
            rope_parameters=dict(rope_type="default", rope_theta=theta, partial_rotary_factor=0.25),
        )  # fmt: skip


@register
class Qwen3_5Moe(Qwen3_5):
    model_type = "qwen3_5_moe_text"
    architecture = "Qwen3_5MoeForCausalLM"
    wrappers = ("qwen3_5_moe",)
    moe = True
    hf_keys = Qwen3_5.hf_keys | set(_MOE_DEFAULTS) | {"num_local_experts"}
    hf_absent = ("intermediate_size",)  # every layer sparse: no dense MLP width
    flops_own_head_dim = True  # 16 heads of 256 over a hidden size of 2048
    # its one shared expert's names, where GLM-4.5's (hf_io's common table) say shared_experts
    tensor_names = {
        "shared_gate_proj": "mlp.shared_expert.gate_proj.weight",
        "shared_up_proj": "mlp.shared_expert.up_proj.weight",
        "shared_down_proj": "mlp.shared_expert.down_proj.weight",
    }

    def fields(self, hf: dict) -> dict[str, Any]:
        """Every layer sparse (transformers has no mlp_only_layers / decoder_sparse_step for it) with no dense
        MLP width, the router always renormalized (no norm_topk_prob key), one shared expert of its own width
        with its sigmoid gate. `router_aux_loss_coef` and `output_router_logits` are transformers' training
        switches: written back unchanged (hf_extra)."""

        def get(key):
            return int(hf[key] if hf.get(key) is not None else _MOE_DEFAULTS[key])

        experts = hf.get("num_experts", hf.get("num_local_experts"))
        return dict(
            super().fields(hf),
            intermediate_size=0,
            num_experts=int(experts if experts is not None else _MOE_DEFAULTS["num_experts"]),
            num_experts_per_tok=get("num_experts_per_tok"),
            moe_intermediate_size=get("moe_intermediate_size"),
            norm_topk_prob=True,
            n_shared_experts=1,
            shared_intermediate_size=get("shared_expert_intermediate_size"),
            shared_expert_gate=True,
        )

    def hf_fields(self, cfg) -> dict[str, Any]:
        return dict(
            super().hf_fields(cfg),
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            shared_expert_intermediate_size=cfg.shared_width,
        )

    def check(self, cfg) -> None:
        if cfg.lora_rank:
            raise NotImplementedError(f"LoRA on {cfg.model_type} is not implemented")
        if cfg.num_experts <= 0:
            raise ValueError("qwen3_5_moe_text needs num_experts > 0 (every layer is sparse)")
        if (
            cfg.sparse_layers() != tuple(range(cfg.num_layers))
            or cfg.router_scoring != "softmax"
            or not cfg.norm_topk_prob
            or cfg.n_shared_experts != 1
            or not cfg.shared_expert_gate
        ):
            raise ValueError(
                "qwen3_5_moe_text: every layer sparse, a renormalized softmax router and one gated shared expert"
            )

    def tiny(self, shape: dict) -> dict:
        """Qwen3.5's hybrid with every MLP sparse and one gated shared expert as wide as an expert."""
        hf = super().tiny(shape)
        hf.pop("intermediate_size")
        return dict(
            hf, model_type=self.model_type, num_experts=shape["num_experts"],
            num_experts_per_tok=shape["num_experts_per_tok"], moe_intermediate_size=shape["moe_intermediate_size"],
            shared_expert_intermediate_size=shape["moe_intermediate_size"],
        )  # fmt: skip
