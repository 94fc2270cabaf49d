"""grpo: reward minus the group mean (DR-GRPO, no std normalization), the default algorithm.

The grpo family (grpo, max_rl, echo) shares this class's scoring: an optional length penalty is subtracted
from each reward, then credit is either the class's own group math (`advantages`) or a custom advantage
function named by `algo.advantage.import_path`. Partial groups: only clean rollouts reach `score_group`, so
errored ones are out of the baseline; with fewer than two clean rollouts the credit is zero.
"""

from __future__ import annotations

from primejax.orchestrator.algorithms.advantage import (
    AdvantageInputs,
    group_relative,
    load_advantage_fn,
)
from primejax.orchestrator.algorithms.base import Algorithm, AlgorithmConfig, ImportConfig, register_algorithm
from primejax.orchestrator.rollout import Rollout
from primejax.utils.sections import Section, option, section, sub


@section
class LengthPenaltyConfig(Section):
    """A reward penalty on length, subtracted before the group baseline."""

    type: str = option("none", "what is penalized", choices=("none", "tokens", "turns"))
    coef: float = option(0.0, "penalty per unit over target", ge=0)
    target: int = option(0, "free length (tokens or turns)", ge=0)


@section
class GRPOConfig(AlgorithmConfig):
    """Group-relative credit (grpo, max_rl, echo): an optional length penalty and custom advantage."""

    length_penalty: LengthPenaltyConfig = sub(LengthPenaltyConfig, "length penalty")
    advantage: ImportConfig = sub(ImportConfig, "a custom advantage function of the group (docs/algorithms.md)")

__all__ = ["GRPOAlgorithm", "group_relative"]


@register_algorithm("grpo")
class GRPOAlgorithm(Algorithm):
    action_loss_type = "rl"
    config_class = GRPOConfig
    config: GRPOConfig

    def setup(self) -> None:
        super().setup()
        adv = self.config.advantage
        self.custom_advantage = load_advantage_fn(adv.import_path, adv.kwargs) if adv.import_path else None

    def length_penalty(self, rollout: Rollout) -> float:
        """Subtracted from the reward before the baseline (`algo.length_penalty`, coef c, target t):
        `tokens`: c * max(0, sampled tokens - t) / max_tokens (the per-turn budget, so c is "reward per full
        turn of tokens"); `turns`: c * max(0, model turns - t); `none`: 0."""
        penalty = self.config.length_penalty
        target = penalty.target
        if penalty.type == "tokens":
            max_tokens = self.sampling.max_tokens if self.sampling is not None else 1
            return penalty.coef * max(0, rollout.num_completion_tokens - target) / max(1, max_tokens)
        if penalty.type == "turns":
            return penalty.coef * max(0, rollout.num_turns - target)
        return 0.0

    def group_scores(self, group: list[Rollout]) -> list[float]:
        return [r.reward - self.length_penalty(r) for r in group]

    def advantages(self, scores: list[float]) -> list[float]:
        """The class's group math; override for a new group-relative algorithm (see max_rl)."""
        return group_relative(scores)

    def score_group(self, group: list[Rollout]) -> None:
        scores = self.group_scores(group)
        if self.custom_advantage is not None:
            values = self.custom_advantage(AdvantageInputs(rollouts=group, scores=scores))
        else:
            values = self.advantages(scores)
        for rollout, advantage in zip(group, values, strict=True):
            rollout.assign_advantages(advantage)
