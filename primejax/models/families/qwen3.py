"""Qwen3 (`Qwen3ForCausalLM`): the common decoder with per-head q/k RMSNorm."""

from __future__ import annotations

from typing import Any

from primejax.models.families.base import Family, register, tiny_common


@register
class Qwen3(Family):
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"

    def fields(self, hf: dict) -> dict[str, Any]:
        return dict(qk_norm=True)

    def tiny(self, shape: dict) -> dict:
        return tiny_common(self, shape)
