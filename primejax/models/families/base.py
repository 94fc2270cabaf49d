"""The family registry: one `Family` per HF `model_type`, each in its own file under models/families/.

A family owns what is particular to its checkpoints: its `config.json` keys both ways (`fields` /
`hf_fields`), its checks, its HF tensor names where they differ from the common ones, its FLOPs convention
and its tiny test shape. The model core (config.py, hf_config.py, accounting.py, transformer.py, hf_io.py)
asks the family and names none. Adding a family is one file: a `Family` subclass under `@register`
(docs/models.md, "Adding a family").

This module imports nothing from primejax and no jax: `ModelConfig` (config.py, hf_config.py) calls into it
and is read where only config.json matters (inference/routed_experts.py).
"""

from __future__ import annotations

from typing import Any, ClassVar

# The token mixers a layer can have (models/transformer.py `MIXERS`), by HF's `layer_types` names.
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"


class Family:
    """What one HF `model_type` needs beyond the common decoder (hf_config.py reads the common keys).

    `cfg` below is a `ModelConfig` (not imported: config.py is built on this module)."""

    model_type: ClassVar[str]
    architecture: ClassVar[str]  # the transformers class written to config.json's `architectures`
    # config.json keys `fields` reads (the rest of the unknown ones are written back unchanged: hf_extra)
    hf_keys: ClassVar[frozenset[str]] = frozenset()
    moe: ClassVar[bool] = False  # its checkpoints have experts (tools and configs that need a MoE ask)
    mixers: ClassVar[tuple[str, ...]] = (FULL_ATTENTION,)  # the layer kinds `layer_types` may name
    rope_types: ClassVar[tuple[str, ...]] = ("default", "llama3")
    # rotary on the first head_dim * partial_rotary_factor dims: the factor is also written in rope_parameters
    partial_rotary: ClassVar[bool] = False
    # FLOPs' attention term per head: its own head_dim, or prime-rl's hidden/heads (accounting.flops_per_token)
    flops_own_head_dim: ClassVar[bool] = False
    wrappers: ClassVar[tuple[str, ...]] = ()  # multimodal model_types whose `text_config` is this family
    # HF tensor names (under model.layers.{i}.) where they differ from hf_io's common table
    tensor_names: ClassVar[dict[str, str]] = {}
    hf_absent: ClassVar[tuple[str, ...]] = ()  # common config.json keys its transformers config class lacks

    def fields(self, hf: dict) -> dict[str, Any]:
        """ModelConfig fields of this family's `config.json` beyond, or instead of, the common ones."""
        return {}

    def hf_fields(self, cfg) -> dict[str, Any]:
        """The family's `config.json` keys, written over the common ones."""
        return {}

    def check(self, cfg) -> None:
        """Raise one line for a config of this family primejax cannot run."""

    def text_config(self, hf: dict) -> dict:
        """The language model's config.json of a multimodal wrapper checkpoint (`wrappers`)."""
        raise ValueError(f"model_type {hf.get('model_type')!r} is not a wrapper of {self.model_type}")

    def stored_name(self, name: str, weight_map) -> str:
        """Where tensor `name` lives in a checkpoint's weight map (a wrapper's prefix, if any)."""
        return name

    def tiny(self, shape: dict) -> dict | None:
        """The config.json of a tiny random model (models/tiny.py), from the builder's `shape`: its common
        keys (`vocab_size`, `hidden_size`, ..., `rope_theta`) and its sizes (`num_experts`,
        `num_experts_per_tok`, `moe_intermediate_size`, `mlp_only_layers`, `head_dim`). None: no tiny model."""
        return None


FAMILIES: dict[str, Family] = {}
WRAPPERS: dict[str, Family] = {}  # multimodal model_type -> the family of its language model


def register(cls: type[Family]) -> type[Family]:
    """Class decorator: make `cls` the family of its `model_type` (and of its wrapper model_types)."""
    if cls.model_type in FAMILIES:
        raise ValueError(f"model_type {cls.model_type!r} is registered twice")
    FAMILIES[cls.model_type] = family = cls()
    for wrapper in cls.wrappers:
        WRAPPERS[wrapper] = family
    return cls


def family_of(model_type: str) -> Family:
    """The family of `model_type` (one line naming the supported ones when there is none)."""
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"model_type {model_type!r} is not supported (one of {tuple(FAMILIES)})")
    return family


# The keys of a tiny model's config.json that every family writes (models/tiny.py `build_tiny_model`).
TINY_COMMON = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "rope_theta",
)  # fmt: skip


def tiny_common(family: Family, shape: dict) -> dict:
    """The common keys of `shape` (those present), as `family`'s config.json."""
    return dict({k: shape[k] for k in TINY_COMMON if k in shape}, model_type=family.model_type)
