"""GLM-4.5 MoE (`Glm4MoeForCausalLM`): a bias on q/k/v (never o_proj), optional q/k norm, partial rotary, and
the sigmoid-router MoE with groups, a correction bias and shared experts after `first_k_dense_replace` dense
layers, which DeepSeek-V3 shares (`sigmoid_moe_fields` / `sigmoid_moe_hf`).

MTP layers (`num_nextn_predict_layers`, stored after the last decoder layer) are speculative-decoding heads:
RL trains the decoder alone, so they are neither loaded nor exported (docs/models.md).
"""

from __future__ import annotations

from typing import Any

from primejax.models.families.base import Family, register, tiny_common

SIGMOID_MOE_KEYS = frozenset({
    "n_routed_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "routed_scaling_factor", "n_group", "topk_group", "n_shared_experts", "first_k_dense_replace", "hidden_act",
})  # fmt: skip


def sigmoid_moe_fields(hf: dict, defaults: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig MoE fields of a GLM-4.5 or DeepSeek-V3 `config.json` (the same router and layer layout;
    `defaults`: the transformers config class's values for absent keys). The first `first_k_dense_replace`
    layers are dense (mlp_only_layers), every later one sparse."""

    def get(key):
        return hf[key] if hf.get(key) is not None else defaults[key]

    return dict(
        num_experts=int(hf["n_routed_experts"] if "n_routed_experts" in hf else hf["num_local_experts"]),
        num_experts_per_tok=int(get("num_experts_per_tok")),
        moe_intermediate_size=int(get("moe_intermediate_size")),
        norm_topk_prob=bool(get("norm_topk_prob")),
        mlp_only_layers=tuple(range(int(get("first_k_dense_replace")))),
        router_scoring="sigmoid",
        routed_scaling_factor=float(get("routed_scaling_factor")),
        n_group=int(get("n_group")),
        topk_group=int(get("topk_group")),
        n_shared_experts=int(get("n_shared_experts")),
    )


def sigmoid_moe_hf(cfg) -> dict[str, Any]:
    k = len(cfg.mlp_only_layers)
    if cfg.mlp_only_layers != tuple(range(k)) or cfg.decoder_sparse_step != 1:
        raise ValueError(f"{cfg.model_type}: the dense layers must be the first ones (first_k_dense_replace)")
    return dict(
        n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=cfg.norm_topk_prob,
        first_k_dense_replace=k,
        routed_scaling_factor=cfg.routed_scaling_factor,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        n_shared_experts=cfg.n_shared_experts,
    )


def tiny_sigmoid_moe(shape: dict) -> dict:
    """The tiny builder's sigmoid MoE: the first layer dense (unless mlp_only_layers says otherwise, as a
    prefix), one shared expert, 2 expert groups of which 1 is kept, routed scaling 2.5, no MTP layer."""
    return dict(
        n_routed_experts=shape["num_experts"], num_experts_per_tok=shape["num_experts_per_tok"],
        moe_intermediate_size=shape["moe_intermediate_size"], norm_topk_prob=True,
        first_k_dense_replace=len(shape["mlp_only_layers"]) if shape["mlp_only_layers"] else 1,
        n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, num_nextn_predict_layers=0,
    )  # fmt: skip


def partial_rotary_factor(hf: dict, default: float) -> float:
    """`partial_rotary_factor` from the transformers-5 `rope_parameters` or the legacy top-level key."""
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    return float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default)))


# transformers' Glm4MoeConfig defaults (n_shared_experts as primejax read it before: absent = none)
_DEFAULTS = dict(
    num_experts_per_tok=8, moe_intermediate_size=1408, norm_topk_prob=True, first_k_dense_replace=1,
    routed_scaling_factor=1.0, n_group=1, topk_group=1, n_shared_experts=0,
)  # fmt: skip


@register
class Glm4Moe(Family):
    model_type = "glm4_moe"
    architecture = "Glm4MoeForCausalLM"
    moe = True
    hf_keys = SIGMOID_MOE_KEYS | {"use_qk_norm", "partial_rotary_factor"}
    partial_rotary = True
    # 96 heads of 128 are three times its hidden size of 4096, which hidden/heads would miss
    flops_own_head_dim = True

    def fields(self, hf: dict) -> dict[str, Any]:
        return dict(
            sigmoid_moe_fields(hf, _DEFAULTS),
            attention_out_bias=False,
            partial_rotary_factor=partial_rotary_factor(hf, 0.5),
        )

    def hf_fields(self, cfg) -> dict[str, Any]:
        return dict(
            sigmoid_moe_hf(cfg), use_qk_norm=cfg.qk_norm, partial_rotary_factor=cfg.partial_rotary_factor
        )

    def tiny(self, shape: dict) -> dict:
        """GLM-4.5's structure: q/k/v bias, half the head dims rotated, the sigmoid MoE (`tiny_sigmoid_moe`)."""
        common = tiny_common(self, shape)
        theta = common.pop("rope_theta")
        return dict(
            common, **tiny_sigmoid_moe(shape), attention_bias=True,
            rope_parameters=dict(rope_type="default", rope_theta=theta, partial_rotary_factor=0.5),
        )  # fmt: skip
