"""A Hugging Face `config.json` <-> the fields of a `ModelConfig` (config.py), both ways.

The keys every family shares are read and written here; the family of the checkpoint's `model_type`
(models/families/) reads and writes its own. Keys neither knows travel in `hf_extra` and are written back
unchanged, so an exported directory loads in transformers and vLLM as the source did.

`cfg` below is a `ModelConfig`, not imported: config.py is built on this module. Like config.py it imports no
jax, for the readers of config.json alone (inference/routed_experts.py).
"""

from __future__ import annotations

from typing import Any

from primejax.models.families import FAMILIES, WRAPPERS

# The model families (HF model_type -> its transformers class), as registered in models/families/.
ARCHITECTURES = {t: f.architecture for t, f in FAMILIES.items()}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
# config.json keys every family reads (read_hf_config); a family's own are its `hf_keys`
COMMON_HF_KEYS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling",
    "rope_parameters", "rms_norm_eps", "tie_word_embeddings", "attention_bias", "max_position_embeddings",
    "architectures", "torch_dtype", "dtype", "transformers_version",
})  # fmt: skip


def read_hf_config(hf: dict) -> dict[str, Any]:
    """The ModelConfig fields of an HF `config.json` dict (`ModelConfig.from_hf_config` adds the overrides).

    The keys every family shares are read here, the family's own by its `fields` (models/families/)."""
    if hf.get("model_type") in WRAPPERS:  # a multimodal checkpoint: its language model
        hf = WRAPPERS[hf["model_type"]].text_config(hf)
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"HF model_type {model_type!r} is not supported (one of {SUPPORTED_MODEL_TYPES})")
    family = FAMILIES[model_type]
    if hf.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is implemented")
    if hf.get("mlp_bias", False):
        raise NotImplementedError("mlp_bias=true is not implemented")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise NotImplementedError(
            f"quantized checkpoints ({method}) are not loaded: convert the weights to bf16 first"
        )
    if hf.get("use_sliding_window", False):
        raise NotImplementedError("sliding-window attention (use_sliding_window=true) is not implemented")

    rope_theta, rope_scaling = read_rope(hf)
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    bias = bool(hf.get("attention_bias", False))
    known = COMMON_HF_KEYS | family.hf_keys
    fields: dict[str, Any] = dict(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf.get("intermediate_size", 0)),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=bool(hf.get("use_qk_norm", False)),
        attention_bias=bias,
        attention_out_bias=bias,
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        hf_extra={k: v for k, v in hf.items() if k not in known},
    )
    fields.update(family.fields(hf))
    return fields


def write_hf_config(cfg, dtype: str | None = None) -> dict:
    """An HF `config.json` dict that transformers and vLLM load unchanged.

    `dtype` is the dtype the weights are stored in (defaults to param_dtype). Rope settings are written in
    both the transformers-5 form (`rope_parameters`) and the legacy one (`rope_theta` / `rope_scaling`)
    so older readers agree with newer ones.
    """
    dtype = dtype or cfg.param_dtype
    rope_params = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling is not None:
        rope_params.update({k: v for k, v in cfg.rope_scaling.items() if k != "type"})
        rope_params["rope_type"] = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
    hf: dict[str, Any] = dict(cfg.hf_extra)
    hf.update(
        architectures=[ARCHITECTURES[cfg.model_type]],
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rope_scaling=None if cfg.rope_scaling is None else dict(cfg.rope_scaling),
        rope_parameters=rope_params,
        torch_dtype=dtype,
        dtype=dtype,
        attention_bias=cfg.attention_bias,
    )
    family = cfg.family
    if family.partial_rotary:
        rope_params["partial_rotary_factor"] = cfg.partial_rotary_factor
    hf.update(family.hf_fields(cfg))
    for key in family.hf_absent:
        del hf[key]
    return hf


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
