"""Qwen2 (`Qwen2ForCausalLM`): a bias on q/k/v always, never on o_proj, and no `attention_bias` key."""

from __future__ import annotations

from typing import Any

from primejax.models.families.base import Family, register


@register
class Qwen2(Family):
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    hf_absent = ("attention_bias",)

    def fields(self, hf: dict) -> dict[str, Any]:
        return dict(attention_bias=True, attention_out_bias=False)
