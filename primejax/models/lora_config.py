"""The `model.lora` section (docs/lora.md), apart from the adapter code so that reading a config imports no JAX."""

from __future__ import annotations

from typing import Any

from primejax.models.config import LORA_INITS, LORA_TARGETS
from primejax.utils.sections import ConfigError, Section, option, section

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts")


@section
class LoraConfig(Section):
    """`model.lora`: low-rank adapters on the frozen model (rank 0: full fine-tuning); docs/lora.md."""

    rank: int = option(0, "adapter rank r; 0 = no LoRA (every weight trained)", ge=0, le=4096)
    alpha: float = option(
        16.0, "adapter scale numerator: outputs are scaled by alpha / rank (PEFT's lora_alpha)", gt=0
    )
    dropout: float = option(0.0, "dropout on the adapters' input: not implemented, must be 0", ge=0)
    target_modules: tuple[str, ...] = option(
        DEFAULT_TARGETS,
        "weights that get adapters: q/k/v/o_proj, the dense MLP's gate/up/down_proj, experts (one adapter per "
        "expert on its gate, up and down), router (off by default)",
        choices=LORA_TARGETS,
    )
    init: str = option(
        "kaiming",
        "A's init (B starts at zero): kaiming = U(+-1/sqrt(fan_in)) (PEFT's default), gaussian = N(0, 1/r) (PEFT's "
        "init_lora_weights='gaussian')",
        choices=LORA_INITS,
    )

    def check(self) -> None:
        if self.dropout:
            raise ConfigError("dropout", f"LoRA dropout is not implemented: must be 0, got {self.dropout}")
        if (
            self.rank and self.alpha > 1024 * self.rank
        ):  # the servers' bound (inference/adapters.py MAX_LORA_SCALE)
            raise ConfigError("alpha", f"alpha / rank must be at most 1024, got {self.alpha:g} / {self.rank}")
        if self.rank and not self.target_modules:
            raise ConfigError("target_modules", "LoRA needs at least one target module")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ConfigError("target_modules", f"repeated entries in {list(self.target_modules)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def model_overrides(self) -> dict[str, Any]:
        """The `ModelConfig` fields this section sets (none when LoRA is off)."""
        if not self.enabled:
            return {}
        return {
            "lora_rank": self.rank,
            "lora_alpha": self.alpha,
            "lora_targets": tuple(self.target_modules),
            "lora_init": self.init,
        }
