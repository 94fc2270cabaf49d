"""Mistral (`MistralForCausalLM`): Llama's decoder whose config.json may ask for sliding-window attention.

Mistral-7B-v0.2 on (and Mistral-Small, Codestral, Devstral) write `sliding_window: null`: full causal
attention, the common decoder exactly. A window shorter than the positions the model can see
(Mistral-7B-v0.1's 4096 of 32768) masks keys primejax's attention kernels attend to: refused in one line. The
key itself is written back unchanged (hf_extra), so vLLM and transformers read the same model.

This file is the whole family (docs/models.md, "Adding a family").
"""

from __future__ import annotations

from typing import Any

from primejax.models.families.base import Family, register, tiny_common


@register
class Mistral(Family):
    model_type = "mistral"
    architecture = "MistralForCausalLM"

    def fields(self, hf: dict) -> dict[str, Any]:
        window = hf.get("sliding_window")
        if window is not None and int(window) < int(hf.get("max_position_embeddings", 32768)):
            raise NotImplementedError(
                f"mistral with sliding_window={window} < max_position_embeddings is not implemented (full "
                "attention only: sliding_window null)"
            )
        return {}

    def tiny(self, shape: dict) -> dict:
        return dict(tiny_common(self, shape), sliding_window=None)
