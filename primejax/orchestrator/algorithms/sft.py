"""sft: hard distillation. A frozen model (`algo.sampling.source = "frozen"`, `algo.sampling.frozen`) samples
the rollouts; the policy trains with cross-entropy on every sampled token (`ce` loss component).

No credit is assigned (seed 001 §Advantage: "trains on every sampled token"), so the zero-advantage filter
never fires on sft rollouts; rewards are still computed and logged, and the other filters still apply.
"""

from __future__ import annotations

from primejax.orchestrator.algorithms.base import Algorithm, register_algorithm


@register_algorithm("sft")
class SFTDistillAlgorithm(Algorithm):
    action_loss_type = "ce"

    def setup(self) -> None:
        super().setup()
        if self.sampling_client is None:
            raise ValueError("sft needs a frozen sampling source (orchestrator.algo.sampling.source = 'frozen')")
