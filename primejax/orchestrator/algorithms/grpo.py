"""grpo: reward minus the group mean (DR-GRPO, no std normalization), the default algorithm.

The grpo family (grpo, max_rl, echo) shares this class's scoring: an optional length penalty is subtracted
from each reward, then one advantage function of the group gives the credit: a registered one
(advantage.py), the class's own `default_advantage` (grpo: `group_relative`; max_rl names another) unless
`algo.advantage.name` names one, or any function at `algo.advantage.import_path`. Partial groups: only clean
rollouts reach `score_group`, so errored ones are out of the baseline; with fewer than two clean rollouts the
credit is zero.
"""

from __future__ import annotations

from typing import ClassVar

from primejax.orchestrator.algorithms.advantage import (
    AdvantageInputs,
    group_relative,
    load_advantage_fn,
    registered_advantage,
)
from primejax.orchestrator.algorithms.base import Algorithm, AlgorithmConfig, ImportConfig, register_algorithm
from primejax.orchestrator.rollout import Rollout
from primejax.utils.sections import ConfigError, Section, option, section, sub


@section
class LengthPenaltyConfig(Section):
    """A reward penalty on length, subtracted before the group baseline."""

    type: str = option("none", "what is penalized", choices=("none", "tokens", "turns"))
    coef: float = option(0.0, "penalty per unit over target", ge=0)
    target: int = option(0, "free length (tokens or turns)", ge=0)


@section
class AdvantageConfig(ImportConfig):
    """The advantage function of the group: a registered one by `name`, or any function by `import_path`."""

    name: str = option(
        "",
        "a registered advantage (group_relative, mean_normalized, or your own); '' = the "
        "algorithm's own (grpo: group_relative, max_rl: mean_normalized)",
    )

    def check(self) -> None:
        super().check()
        if self.name and self.import_path:
            raise ConfigError(
                "name", f"names {self.name!r} and import_path names {self.import_path!r}: set one"
            )


@section
class GRPOConfig(AlgorithmConfig):
    """Group-relative credit (grpo, max_rl, echo): an optional length penalty and the advantage function."""

    length_penalty: LengthPenaltyConfig = sub(LengthPenaltyConfig, "length penalty")
    advantage: AdvantageConfig = sub(
        AdvantageConfig, "the advantage function of the group (docs/algorithms.md)"
    )


__all__ = ["GRPOAlgorithm", "group_relative"]


@register_algorithm("grpo")
class GRPOAlgorithm(Algorithm):
    action_loss_type = "rl"
    config_class = GRPOConfig
    config: GRPOConfig
    default_advantage: ClassVar[str] = (
        "group_relative"  # the registered advantage used unless the block names one
    )

    def setup(self) -> None:
        super().setup()
        adv = self.config.advantage
        self.advantage_name = adv.import_path or adv.name or self.default_advantage
        if adv.import_path:
            self.advantage = load_advantage_fn(adv.import_path, adv.kwargs)
        else:
            try:
                self.advantage = registered_advantage(self.advantage_name, adv.kwargs)
            except KeyError as e:
                raise ConfigError("advantage.name", str(e.args[0])) from None

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

    def score_group(self, group: list[Rollout]) -> None:
        values = self.advantage(AdvantageInputs(rollouts=group, scores=self.group_scores(group)))
        for rollout, advantage in zip(group, values, strict=True):
            rollout.assign_advantages(advantage)
