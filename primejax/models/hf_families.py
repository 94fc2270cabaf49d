"""The `config.json` keys of the families whose fields need more than a rename: the sigmoid-router MoE of
GLM-4.5 and DeepSeek-V3 (with DeepSeek-V3's latent attention) and the two ways rope parameters are written.

`ModelConfig.from_hf_config` / `to_hf_config` (models/config.py) call these in both directions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from primejax.models.config import ModelConfig


def _sigmoid_moe_fields(hf: dict, defaults: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig MoE fields of a GLM-4.5 or DeepSeek-V3 `config.json` (the same router and layer layout;
    `defaults`: the transformers config class's values for absent keys).

    The first `first_k_dense_replace` layers are dense (mlp_only_layers), every later one sparse. MTP layers
    (`num_nextn_predict_layers`, stored after the last decoder layer) are speculative-decoding heads: RL trains
    the decoder alone, so they are neither loaded nor exported (docs/models.md).
    """

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


def _sigmoid_moe_hf(cfg: ModelConfig) -> dict[str, Any]:
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


# transformers' Glm4MoeConfig defaults (n_shared_experts as primejax read it before: absent = none)
_GLM4_MOE_DEFAULTS = dict(
    num_experts_per_tok=8, moe_intermediate_size=1408, norm_topk_prob=True, first_k_dense_replace=1,
    routed_scaling_factor=1.0, n_group=1, topk_group=1, n_shared_experts=0,
)  # fmt: skip


def glm4_moe_fields(hf: dict) -> dict[str, Any]:
    """ModelConfig fields of a GLM-4.5 `config.json`: the sigmoid MoE plus partial rotary."""
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    return dict(
        _sigmoid_moe_fields(hf, _GLM4_MOE_DEFAULTS),
        partial_rotary_factor=float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))),
    )


def glm4_moe_hf(cfg: ModelConfig) -> dict[str, Any]:
    return dict(_sigmoid_moe_hf(cfg), use_qk_norm=cfg.qk_norm, partial_rotary_factor=cfg.partial_rotary_factor)


# transformers' DeepseekV3Config defaults for absent keys
_DEEPSEEK_V3_DEFAULTS = dict(
    num_experts_per_tok=8, moe_intermediate_size=2048, norm_topk_prob=True, first_k_dense_replace=3,
    routed_scaling_factor=2.5, n_group=8, topk_group=4, n_shared_experts=1,
)  # fmt: skip
DEEPSEEK_V3_KEYS = {
    "n_routed_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "routed_scaling_factor", "n_group", "topk_group", "n_shared_experts", "first_k_dense_replace", "hidden_act",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim",
    "rope_interleave", "scoring_func", "topk_method", "moe_layer_freq",
}


def deepseek_v3_fields(hf: dict) -> dict[str, Any]:
    """ModelConfig fields of a DeepSeek-V3 `config.json`: multi-head latent attention plus the sigmoid MoE.
    q_lora_rank null (no query bottleneck) is stored as 0; the MTP layers are skipped as for GLM-4.5."""
    if hf.get("attention_bias"):
        raise NotImplementedError("deepseek_v3 with attention_bias=true is not implemented")
    # The original checkpoint's keys transformers ignores but whose other values mean another model.
    for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if hf.get(key, value) != value:
            raise NotImplementedError(f"deepseek_v3 with {key}={hf[key]!r} is not implemented (only {value!r})")
    return dict(
        _sigmoid_moe_fields(hf, _DEEPSEEK_V3_DEFAULTS),
        q_lora_rank=int(hf.get("q_lora_rank", 1536) or 0),
        kv_lora_rank=int(hf.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(hf.get("qk_nope_head_dim", 128)),
        v_head_dim=int(hf.get("v_head_dim", 128)),
        rope_interleave=bool(hf.get("rope_interleave", True)),
    )


def deepseek_v3_hf(cfg: ModelConfig) -> dict[str, Any]:
    # scoring_func / topk_method: transformers ignores them (its router is always this one) but vLLM's
    # DeepseekV2 model reads them, with softmax and no correction bias as its defaults: written always.
    return dict(
        _sigmoid_moe_hf(cfg),
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


def read_rope(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the transformers-5 `rope_parameters` or the legacy keys."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        scaling = None
        if rope_type != "default":
            scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
            scaling["rope_type"] = rope_type
        return float(theta), scaling
    scaling = hf.get("rope_scaling")
    if scaling:
        scaling = dict(scaling)
        scaling["rope_type"] = scaling.pop("type", scaling.get("rope_type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return float(hf.get("rope_theta", 10000.0)), scaling or None
