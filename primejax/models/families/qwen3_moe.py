"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 with softmax top-k experts (models/moe.py) on every
`decoder_sparse_step`-th layer not in `mlp_only_layers`."""

from __future__ import annotations

from typing import Any

from primejax.models.families.base import Family, register, tiny_common


@register
class Qwen3Moe(Family):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    moe = True
    hf_keys = frozenset({
        "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
        "decoder_sparse_step", "mlp_only_layers",
    })  # fmt: skip

    def fields(self, hf: dict) -> dict[str, Any]:
        return dict(
            qk_norm=True,
            # transformers 5 writes num_local_experts (an alias it maps num_experts to); the Hub's
            # configs and older readers use num_experts, which is what hf_fields writes.
            num_experts=int(hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        )

    def hf_fields(self, cfg) -> dict[str, Any]:
        return dict(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
        )

    def tiny(self, shape: dict) -> dict:
        """norm_topk_prob on, as in Qwen3-30B-A3B."""
        return dict(
            tiny_common(self, shape), num_experts=shape["num_experts"], num_experts_per_tok=shape["num_experts_per_tok"],
            moe_intermediate_size=shape["moe_intermediate_size"], norm_topk_prob=True,
            mlp_only_layers=list(shape["mlp_only_layers"]),
        )  # fmt: skip
