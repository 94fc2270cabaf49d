"""Qwen3.5 (`qwen3_5_text`, transformers 5.17's `Qwen3_5ForCausalLM`) and Qwen3.5 MoE (`qwen3_5_moe_text`,
`Qwen3_5MoeForCausalLM`): config fields, checks, HF names and accounting.

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

from primejax.models.deltanet import CHUNK

LAYER_TYPES = ("full_attention", "linear_attention")
# The hybrid families, and the text model type of each multimodal wrapper (its `text_config`).
HYBRID_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
TEXT_TYPE_OF_WRAPPER = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# transformers' Qwen3_5TextConfig defaults for absent keys
_DEFAULTS = dict(
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, head_dim=256,
)  # fmt: skip
QWEN3_5_KEYS = set(_DEFAULTS) | {
    "layer_types",
    "full_attention_interval",
    "partial_rotary_factor",
    "hidden_act",
}
# The multimodal checkpoint's language-model tensor prefix, for the text model's `model.` one.
LANGUAGE_MODEL_PREFIX = "model.language_model."


def text_config_of(hf: dict) -> dict:
    """The language model's config.json dict of a multimodal Qwen3.5 checkpoint (its `text_config`, with the
    top-level `tie_word_embeddings`, which transformers reads there)."""
    text = dict(hf.get("text_config") or {})
    if not text:
        raise ValueError(
            f"model_type {hf.get('model_type')!r} without a text_config: not a Qwen3.5 checkpoint"
        )
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    text["model_type"] = TEXT_TYPE_OF_WRAPPER[hf["model_type"]]
    return text


def qwen3_5_fields(hf: dict) -> dict[str, Any]:
    """ModelConfig fields of a `qwen3_5_text` / `qwen3_5_moe_text` config.json beyond the common ones."""
    if hf.get("attention_bias"):
        raise NotImplementedError(f"{hf['model_type']} with attention_bias=true is not implemented")
    n = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if not types:
        every = int(hf.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}

    def get(key):
        return int(hf[key] if hf.get(key) is not None else _DEFAULTS[key])

    return dict(
        layer_types=tuple(types),
        linear_conv_kernel_dim=get("linear_conv_kernel_dim"),
        linear_key_head_dim=get("linear_key_head_dim"),
        linear_value_head_dim=get("linear_value_head_dim"),
        linear_num_key_heads=get("linear_num_key_heads"),
        linear_num_value_heads=get("linear_num_value_heads"),
        attn_output_gate=True,
        norm_offset=True,
        partial_rotary_factor=float(
            params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
        ),
    )


def qwen3_5_hf(cfg) -> dict[str, Any]:
    return dict(
        layer_types=list(cfg.layer_types),
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim,
        linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        partial_rotary_factor=cfg.partial_rotary_factor,
    )


def check_hybrid(cfg) -> None:
    """One line for a hybrid config primejax cannot run."""
    if cfg.model_type not in HYBRID_TYPES:
        raise ValueError(f"layer_types is a field of {HYBRID_TYPES}, not of {cfg.model_type}")
    if len(cfg.layer_types) != cfg.num_layers or any(t not in LAYER_TYPES for t in cfg.layer_types):
        raise ValueError(
            f"layer_types must give one of {LAYER_TYPES} for each of the {cfg.num_layers} layers"
        )
    if cfg.linear_attention_layers():
        dims = (cfg.linear_conv_kernel_dim, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                cfg.linear_num_key_heads, cfg.linear_num_value_heads)  # fmt: skip
        if min(dims) <= 0 or cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            raise ValueError(
                "Gated DeltaNet layers need positive linear_* sizes and linear_num_value_heads a multiple of "
                "linear_num_key_heads"
            )
    if cfg.scan_layers and len(set(cfg.layer_types)) > 1:
        raise ValueError("scan_layers=True needs every layer of one kind: a hybrid stack runs unrolled")
    if cfg.lora_rank:
        raise NotImplementedError(f"LoRA on {cfg.model_type} is not implemented")
    if cfg.model_type == "qwen3_5_moe_text" and cfg.num_experts <= 0:
        raise ValueError("qwen3_5_moe_text needs num_experts > 0 (every layer is sparse)")
    if cfg.model_type == "qwen3_5_text" and cfg.num_experts:
        raise ValueError(
            "qwen3_5_text has no experts: a Qwen3.5 MoE checkpoint is model_type qwen3_5_moe_text"
        )
    if cfg.num_experts and (
        cfg.sparse_layers() != tuple(range(cfg.num_layers))
        or cfg.router_scoring != "softmax"
        or not cfg.norm_topk_prob
        or cfg.n_shared_experts != 1
        or not cfg.shared_expert_gate
    ):
        raise ValueError(
            "qwen3_5_moe_text: every layer sparse, a renormalized softmax router and one gated shared expert"
        )


# transformers' Qwen3_5MoeTextConfig defaults for absent keys
_MOE_DEFAULTS = dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                     shared_expert_intermediate_size=512)  # fmt: skip
QWEN3_5_MOE_KEYS = set(_MOE_DEFAULTS) | {"num_local_experts"}


def qwen3_5_moe_fields(hf: dict) -> dict[str, Any]:
    """ModelConfig MoE fields of a `qwen3_5_moe_text` config.json: every layer sparse (transformers has no
    mlp_only_layers / decoder_sparse_step for it), the router always renormalized (no norm_topk_prob key),
    one shared expert of its own width with its sigmoid gate. `router_aux_loss_coef` and
    `output_router_logits` are transformers' training switches: written back unchanged (hf_extra)."""

    def get(key):
        return int(hf[key] if hf.get(key) is not None else _MOE_DEFAULTS[key])

    experts = hf.get("num_experts", hf.get("num_local_experts"))
    return dict(
        num_experts=int(experts if experts is not None else _MOE_DEFAULTS["num_experts"]),
        num_experts_per_tok=get("num_experts_per_tok"),
        moe_intermediate_size=get("moe_intermediate_size"),
        norm_topk_prob=True,
        n_shared_experts=1,
        shared_intermediate_size=get("shared_expert_intermediate_size"),
        shared_expert_gate=True,
    )


def qwen3_5_moe_hf(cfg) -> dict[str, Any]:
    return dict(
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_width,
    )


# Qwen3.5 MoE's HF tensor names where they differ from GLM-4.5's for the same parameter (hf_io.py).
MOE_TENSOR_NAMES = {
    "shared_gate_proj": "mlp.shared_expert.gate_proj.weight",
    "shared_up_proj": "mlp.shared_expert.up_proj.weight",
    "shared_down_proj": "mlp.shared_expert.down_proj.weight",
}


def deltanet_params(cfg, *, matmul: bool) -> int:
    """One Gated DeltaNet layer's weights: the projections, and unless `matmul` the conv, decay and norm."""
    d, hk, hv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv = 2 * hk * dk + hv * dv
    projections = d * conv + d * hv * dv + 2 * d * hv + hv * dv * d  # qkv, z, a and b, out
    if matmul:
        return projections
    return projections + cfg.linear_conv_kernel_dim * conv + 2 * hv + dv


def deltanet_flops_per_token(cfg) -> float:
    """Training FLOPs per token of one DeltaNet layer beyond its projections (6 x multiply-adds: forward and
    backward), for the chunked form as run (models/deltanet.py, chunk C): per value head and token the
    intra-chunk [C, C] products k k^T and q k^T (2 C dk), the UT matrix's inverse (deltanet.unit_lower_inverse:
    (C^2 - 1) / 3) and its products with the keys and values (C (dk + dv)), the intra-chunk attention times
    the new values (C dv), and the state's read by keys and queries and its update (3 dk dv); plus the
    depthwise conv (K per channel). Independent of the sequence length."""
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv = 2 * cfg.linear_num_key_heads * dk + hv * dv
    per_head = CHUNK * (3 * dk + 2 * dv) + (CHUNK * CHUNK - 1) // 3 + 3 * dk * dv
    return float(6 * (hv * per_head + cfg.linear_conv_kernel_dim * conv))


def language_model_name(name: str, weight_map) -> str:
    """The tensor `name` of the text model as stored in a multimodal checkpoint (`model.language_model.*`)
    when that is where it lives, else `name`."""
    if name in weight_map or not name.startswith("model."):
        return name
    return LANGUAGE_MODEL_PREFIX + name.removeprefix("model.")
