"""Llama (`LlamaForCausalLM`): the common decoder, nothing of its own (q/k/v/o bias with `attention_bias`)."""

from __future__ import annotations

from primejax.models.families.base import Family, register, tiny_common


@register
class Llama(Family):
    model_type = "llama"
    architecture = "LlamaForCausalLM"

    def tiny(self, shape: dict) -> dict:
        return tiny_common(self, shape)
