"""The `model` config section: which weights the run starts from and how the trainer runs them.

The architecture itself comes from the model directory's config.json (`primejax.models.config.ModelConfig`);
this section adds the training-side choices, whose allowed values the model code owns.
"""

from __future__ import annotations

from typing import Any

from primejax.models.config import (
    A2A_CAPACITY_FACTOR,
    A2A_IMPLS,
    ATTENTION_IMPLS,
    DELTANET_IMPLS,
    EXPERT_PARALLEL,
    GMM_IMPLS,
    REMAT_POLICIES,
    a2a_capacity_problem,
    kept_transfer_problems,
)
from primejax.models.lora_config import LoraConfig
from primejax.models.tiny import TinyModelConfig
from primejax.utils.sections import ConfigError, Section, option, section, sub


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
    scan_unroll: int = option(
        1,
        "with scan_layers: layers per scan iteration (>1 lets a layer's FSDP weight gathers run under the "
        "previous layer's compute; a longer compile)",
        ge=1,
    )
    gmm_impl: str = option(
        "auto",
        "MoE grouped matmul (auto: Mosaic GPU kernels on Hopper, XLA ragged_dot elsewhere)",
        choices=GMM_IMPLS,
    )
    expert_parallel: str = option(
        "fsdp",
        "MoE experts over devices: fsdp (expert weights sharded like FSDP, all-gathered; no token traffic), ep "
        "(experts split over the fsdp axis, tokens all-gathered) or a2a (experts split, each token's rows sent "
        "to its experts' devices and back by all-to-all; within one NVLink host fsdp measured faster, a2a is for "
        "many devices over slower links); docs/moe.md",
        choices=EXPERT_PARALLEL,
    )
    a2a_impl: str = option(
        "auto",
        "expert_parallel=a2a's exchange: ragged (ragged_all_to_all; TPU, ~10x slower on GPU), padded (all_to_all "
        "of fixed slots, any backend) or auto (ragged on TPU, padded elsewhere); docs/moe.md",
        choices=A2A_IMPLS,
    )
    a2a_capacity_factor: float = option(
        A2A_CAPACITY_FACTOR,
        "expert_parallel=a2a: each peer's slot in a round of the exchange, as a multiple of the balanced share "
        "of tokens that visit a device, and the received pairs the first expert MLP call covers (x tokens x "
        "top-k); a device that sends some peer more takes extra rounds, pairs past the window one more call "
        "(dropless, exact); <= 0: one round of worst-case slots; docs/moe.md",
    )
    keep_gathered_experts: bool = option(
        False,
        "expert_parallel=fsdp with remat: keep each sparse layer's all-gathered experts for the backward instead "
        "of gathering them again (a third less expert traffic, E x 3 x D x I compute-dtype values more memory "
        "per layer and GPU: 1.2 GB for Qwen3-30B-A3B); docs/moe.md",
    )
    keep_exchanged_tokens: bool = option(
        False,
        "expert_parallel=a2a with remat: keep each sparse layer's received tokens for the backward, so its "
        "recompute exchanges nothing (4 token exchanges per layer and step instead of 5; devices x slot x hidden "
        "compute-dtype values more memory per layer and GPU: 0.27 GB for Qwen3-30B-A3B at 16k tokens on 4 "
        "GPUs); docs/moe.md",
    )
    deltanet_impl: str = option(
        "auto",
        "Gated DeltaNet chunk recurrence (Qwen3.5): pallas (Triton kernels, GPU), xla (lax.scan, any backend) or "
        "auto (pallas on NVIDIA GPUs from Ampere on, xla elsewhere); docs/models.md",
        choices=DELTANET_IMPLS,
    )
    lora: LoraConfig = sub(
        LoraConfig, "low-rank adapters: train only them, the weights stay frozen (docs/lora.md)"
    )

    def check(self) -> None:
        if problem := a2a_capacity_problem(self.a2a_capacity_factor):
            raise ConfigError("a2a_capacity_factor", problem)
        for key, problem in kept_transfer_problems(self):
            raise ConfigError(key, problem)

    def overrides(self) -> dict[str, Any]:
        """The keyword arguments `ModelConfig` / `load_model` take from this section."""
        return {
            "param_dtype": self.param_dtype,
            "compute_dtype": self.compute_dtype,
            "attention_impl": self.attention_impl,
            "remat_policy": self.remat_policy,
            "scan_layers": self.scan_layers,
            "scan_unroll": self.scan_unroll,
            "gmm_impl": self.gmm_impl,
            "expert_parallel": self.expert_parallel,
            "a2a_impl": self.a2a_impl,
            "a2a_capacity_factor": self.a2a_capacity_factor,
            "keep_gathered_experts": self.keep_gathered_experts,
            "keep_exchanged_tokens": self.keep_exchanged_tokens,
            "deltanet_impl": self.deltanet_impl,
            **self.lora.model_overrides(),
        }


__all__ = ["ModelSettings"]
