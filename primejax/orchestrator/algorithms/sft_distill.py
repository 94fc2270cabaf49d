"""sft: hard distillation. A frozen model (`algo.sampling.source = "frozen"`, `algo.sampling.frozen`) samples
the rollouts; the policy trains with cross-entropy on every sampled token (`ce` loss component).

No credit is assigned (it trains on every sampled token), so the zero-advantage filter
never fires on sft rollouts; rewards are still computed and logged, and the other filters still apply.
"""

from __future__ import annotations

from primejax.orchestrator.algorithms.base import Algorithm, AlgorithmConfig, register_algorithm
from primejax.utils.sections import ConfigError


@register_algorithm("sft")
class SFTDistillAlgorithm(Algorithm):
    action_loss_type = "ce"

    @classmethod
    def check_config(cls, config: AlgorithmConfig) -> None:
        super().check_config(config)
        if config.sampling.source != "frozen":
            raise ConfigError(
                "sampling.source",
                "sft needs a frozen source (CE on the policy's own tokens is no distillation target)",
            )

    def setup(self) -> None:
        super().setup()
        if self.sampling_client is None:
            raise ValueError(
                "sft needs a frozen sampling source (orchestrator.algo.sampling.source = 'frozen')"
            )
