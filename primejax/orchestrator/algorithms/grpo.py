"""grpo: reward minus the group mean (DR-GRPO, no std normalization), the default algorithm.

Partial groups: only clean rollouts reach `score_group`, so errored ones are out of the baseline; with fewer
than two clean rollouts there is no baseline to compare against and the credit is zero.
"""

from __future__ import annotations

from primejax.orchestrator.algorithms.base import Algorithm, register_algorithm
from primejax.orchestrator.rollout import Rollout


def group_relative(scores: list[float]) -> list[float]:
    if len(scores) < 2:
        return [0.0] * len(scores)
    mean = sum(scores) / len(scores)
    return [s - mean for s in scores]


@register_algorithm("grpo")
class GRPOAlgorithm(Algorithm):
    action_loss_type = "rl"

    def length_penalty(self, rollout: Rollout) -> float:
        """Subtracted from the reward before the baseline. `tokens`: coef x sampled tokens / max_tokens per
        turn; `turns`: coef x model turns; `none`: 0. Subclasses may override for other shaping."""
        penalty = self.config.length_penalty
        if penalty.type == "tokens":
            max_tokens = self.sampling.max_tokens if self.sampling is not None else 1
            return penalty.coef * rollout.num_completion_tokens / max(1, max_tokens)
        if penalty.type == "turns":
            return penalty.coef * rollout.num_turns
        return 0.0

    def group_scores(self, group: list[Rollout]) -> list[float]:
        return [r.reward - self.length_penalty(r) for r in group]

    def advantages(self, scores: list[float]) -> list[float]:
        return group_relative(scores)

    def score_group(self, group: list[Rollout]) -> None:
        for rollout, advantage in zip(group, self.advantages(self.group_scores(group)), strict=True):
            rollout.assign_advantages(advantage)
