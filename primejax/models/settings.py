"""The `model` config section: which weights the run starts from and how the trainer runs them.

The architecture itself comes from the model directory's config.json (`primejax.models.config.ModelConfig`);
this section adds the training-side choices, whose allowed values the model code owns.
"""

from __future__ import annotations

from primejax.models.config import ATTENTION_IMPLS, REMAT_POLICIES
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

    def overrides(self) -> dict[str, str]:
        """The keyword arguments `ModelConfig` / `load_model` take from this section."""
        return {
            "param_dtype": self.param_dtype,
            "compute_dtype": self.compute_dtype,
            "attention_impl": self.attention_impl,
            "remat_policy": self.remat_policy,
        }


__all__ = ["ModelSettings"]
