"""Token-budget batches (`orchestrator.batch_tokens`): a step's batch sized in training tokens, not rollouts.

With long-tailed rollout lengths (agents, tools, reasoning) a fixed number of rollouts per step makes the
trainer's work per step swing with the tail; a token budget keeps it steady. A batch is the trainable rollouts
in group order (as `cut_batch` takes them) while their training tokens fit the budget: the first rollout that
would cross it ends the batch, so a batch holds at most `batch_tokens` tokens and, once enough rollouts
finished, more than `batch_tokens - seq_len` (no rollout's sample is longer than seq_len). A rollout's
training tokens are what its samples hold (`rollout_to_samples`: a turn whose prompt extends the previous
sample continues it while the merged sample fits `seq_len`; any other turn starts a new sample from its whole
prompt, so ids the previous sample already held count again).

How many rollouts that is varies, so generation sizes itself from what it saw: the step barrier samples rounds
(the first of `batch_size / group_size * oversampling_factor` groups, later ones sized by the mean tokens per
trainable rollout so far) until the budget is covered; the continuous pool dispatches for the rollouts a
budget held on average (`TokenMeter`), `batch_size` until the first group finished.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from primejax.orchestrator.rollout import Rollout


def rollout_tokens(rollout: Rollout, seq_len: int) -> int:
    """The tokens the rollout's training samples hold (the same bridging rule as `rollout_to_samples`)."""
    total, held = 0, []  # `held`: the current sample's ids, as far as they matter for bridging
    for step in rollout.steps:
        n = len(held)
        fits = len(step.prompt_ids) + len(step.completion_ids) <= seq_len
        if held and fits and len(step.prompt_ids) >= n and step.prompt_ids[:n] == held:
            total += len(step.prompt_ids) - n + len(step.completion_ids)
        else:
            total += len(step.prompt_ids) + len(step.completion_ids)
        held = step.prompt_ids + step.completion_ids
    return total


def trainable(rollout: Rollout) -> bool:
    return rollout.ok and not rollout.dropped


def cut_by_tokens(groups: Iterable[list[Rollout]], batch_tokens: int, seq_len: int) -> list[Rollout]:
    """The trainable rollouts in group order while their tokens fit `batch_tokens` (module docstring)."""
    batch: list[Rollout] = []
    used = 0
    for group in groups:
        for rollout in group:
            if not trainable(rollout):
                continue
            tokens = rollout_tokens(rollout, seq_len)
            if used + tokens > batch_tokens:
                return batch
            batch.append(rollout)
            used += tokens
    return batch


class TokenMeter:
    """Mean training tokens per trainable rollout, over what finished so far: how many rollouts a budget needs."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self.tokens = 0
        self.rollouts = 0

    def observe(self, rollouts: Iterable[Rollout]) -> int:
        """Count a finished group's trainable rollouts; returns their tokens."""
        tokens = count = 0
        for rollout in rollouts:
            if trainable(rollout):
                tokens += rollout_tokens(rollout, self.seq_len)
                count += 1
        self.tokens += tokens
        self.rollouts += count
        return tokens

    def rollouts_for(self, batch_tokens: int, fallback: int) -> int:
        """Rollouts a budget of `batch_tokens` holds at the mean seen so far (`fallback` before any)."""
        if not self.tokens:
            return fallback
        return max(1, math.ceil(batch_tokens * self.rollouts / self.tokens))
