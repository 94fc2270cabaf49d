"""The `model` config section: which weights the run starts from and how the trainer runs them.

The architecture itself comes from the model directory's config.json (`primejax.models.config.ModelConfig`);
this section adds the training-side choices, whose allowed values the model code owns.
"""

from __future__ import annotations

from typing import Any

from primejax.models.config import ATTENTION_IMPLS, EXPERT_PARALLEL, GMM_IMPLS, REMAT_POLICIES
from primejax.models.lora_config import LoraConfig
from primejax.models.tiny import TinyModelConfig
from primejax.utils.sections import Section, option, section, sub


@section
class ModelSettings(Section):
    """`model`: the policy's HF directory and its training dtypes, attention kernel and remat policy."""

    path: str = option("", "an HF model directory (config.json + safetensors + tokenizer)")
    build_tiny: TinyModelConfig = sub(TinyModelConfig, "build a tiny random model at path when it is missing")
    param_dtype: str = option("float32", "master weights", choices=("float32", "bfloat16"))
    compute_dtype: str = option("bfloat16", "matmul dtype", choices=("float32", "bfloat16"))
    attention_impl: str = option(
        "auto", "attention kernel (auto: cudnn on GPU, splash on TPU, xla elsewhere)", choices=ATTENTION_IMPLS
    )
    remat_policy: str = option(
        "auto", "activation rematerialization per decoder layer (models/config.py)", choices=REMAT_POLICIES
    )
    scan_layers: bool = option(
        False,
        "apply the decoder layers as one lax.scan (compiled once: minutes less for deep models, a slower step; "
        "needs every layer dense or every layer sparse)",
    )
    gmm_impl: str = option(
        "auto",
        "MoE grouped matmul (auto: Mosaic GPU kernels on Hopper, XLA ragged_dot elsewhere)",
        choices=GMM_IMPLS,
    )
    expert_parallel: str = option(
        "fsdp",
        "MoE experts over devices: fsdp (expert weights sharded like FSDP, all-gathered; no token traffic) or ep "
        "(experts split over the fsdp axis, tokens exchanged in shard_map); docs/moe.md",
        choices=EXPERT_PARALLEL,
    )
    lora: LoraConfig = sub(
        LoraConfig, "low-rank adapters: train only them, the weights stay frozen (docs/lora.md)"
    )

    def overrides(self) -> dict[str, Any]:
        """The keyword arguments `ModelConfig` / `load_model` take from this section."""
        return {
            "param_dtype": self.param_dtype,
            "compute_dtype": self.compute_dtype,
            "attention_impl": self.attention_impl,
            "remat_policy": self.remat_policy,
            "scan_layers": self.scan_layers,
            "gmm_impl": self.gmm_impl,
            "expert_parallel": self.expert_parallel,
            **self.lora.model_overrides(),
        }


__all__ = ["ModelSettings"]
