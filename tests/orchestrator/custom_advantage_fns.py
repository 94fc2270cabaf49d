"""Custom advantage functions the tests name by import path."""

from __future__ import annotations

import statistics

from primejax.orchestrator.algorithms import AdvantageInputs, AdvantageOutputs


def normalized(inputs: AdvantageInputs, eps: float = 1e-8) -> AdvantageOutputs:
    mean = statistics.fmean(inputs.scores)
    std = statistics.pstdev(inputs.scores)
    return AdvantageOutputs([(s - mean) / (std + eps) for s in inputs.scores])


def constant(inputs: AdvantageInputs, value: float = 1.0) -> list[float]:
    return [value] * len(inputs.rollouts)


def wrong_length(inputs: AdvantageInputs) -> list[float]:
    return [0.0]


def keep_none(rollout) -> list[list[bool]]:
    """Echo user filter: never echo-train anything."""
    return [[False] * len(step.prompt_ids) for step in rollout.steps]
