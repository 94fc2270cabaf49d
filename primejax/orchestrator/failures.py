"""A run whose rollouts keep erroring stops and says why, instead of "finishing" on empty batches.

A step in which every rollout errored (the environment, the scorer or the server refused each one) writes an
empty batch, which keeps the trainer in step but trains nothing. After `orchestrator.max_failed_steps` such
steps in a row the orchestrator raises `RolloutsFailed`: one line quoting the first rollout error of the streak,
printed by the orchestrator (`error: orchestrator: ...`, exit status 1) and repeated by the launcher.
"""

from __future__ import annotations

from collections.abc import Sequence

from primejax.orchestrator.rollout import Rollout


class RolloutsFailed(RuntimeError):
    """Too many steps in a row in which every rollout errored (one line)."""


class FailedSteps:
    def __init__(self, limit: int):
        self.limit = limit  # 0 = never stop
        self.streak = 0
        self.first_error = ""

    def observe(self, step: int, rollouts: Sequence[Rollout]) -> None:
        """Count `step` (raise RolloutsFailed at the limit) when it had rollouts and all of them errored."""
        errors = [r.error for r in rollouts if r.error is not None]
        if not rollouts or len(errors) < len(rollouts):
            self.streak, self.first_error = 0, ""
            return
        if self.streak == 0:
            self.first_error = f"step {step}: {errors[0]}"
        self.streak += 1
        if self.limit and self.streak >= self.limit:
            raise RolloutsFailed(
                f"every rollout errored in {self.streak} steps in a row (orchestrator.max_failed_steps = "
                f"{self.limit}); first error: {self.first_error[:500]}"
            )
