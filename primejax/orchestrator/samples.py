"""Rollouts to training samples: best-effort interleaving of trajectory steps
(docs/architecture.md#multi-turn-trajectories).

Consecutive model calls of a rollout merge into one sample while the extension property holds: the next
call's prompt ids start with the current sample's ids exactly (and the merged sample still fits `seq_len`).
Otherwise the sample is closed and a new one starts from that call's full prompt. Sampled tokens keep their
inference logprobs and credit; prompt and environment tokens have loss_mask False unless an algorithm put ce
weight on them (`TrajectoryStep.prompt_ce_weights`, echo-style observation training).

Component routing follows the algorithm's `action_loss_type`: rl ships advantages and, only when ce
observation weights exist, explicit rl/ce streams (a plain GRPO sample ships no weight stream at all); ce and
ref_kl ship their own weight stream on the sampled tokens.

Routing replay: with `routing` given, each sample also carries the experts the sampler routed every sampled
token to (each turn's own, as recorded on its `TrajectoryStep`), marked in `routed_mask`; prompt and
environment tokens stay unmarked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from primejax.contracts.batch import TrainingSample
from primejax.orchestrator.rollout import Rollout


@dataclass
class _Builder:
    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    ref_logprobs: list[float] = field(default_factory=list)
    action: list[float] = field(default_factory=list)  # 1 on sampled tokens
    observation_ce: list[float] = field(default_factory=list)  # ce weight on env tokens
    versions: list[int] = field(default_factory=list)
    routed: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (start, [n, moe_layers, top_k])
    routed_mask: list[bool] = field(default_factory=list)

    def add_context(self, ids: list[int], ce_weights: list[float] | None) -> None:
        ce = [0.0] * len(ids) if ce_weights is None else [float(w) for w in ce_weights]
        first = not self.tokens
        self.tokens += ids
        # The very first token has no predictor, so it can never be a target.
        self.mask += [w != 0.0 and not (first and i == 0) for i, w in enumerate(ce)]
        self.logprobs += [0.0] * len(ids)
        self.advantages += [0.0] * len(ids)
        self.ref_logprobs += [0.0] * len(ids)
        self.action += [0.0] * len(ids)
        self.observation_ce += [0.0 if first and i == 0 else w for i, w in enumerate(ce)]
        self.routed_mask += [False] * len(ids)

    def add_completion(
        self,
        ids: list[int],
        logprobs: list[float],
        advantages: list[float] | None,
        ref_logprobs: list[float] | None,
        routed: np.ndarray | None = None,
    ) -> None:
        n = len(ids)
        self.tokens += ids
        self.mask += [True] * n
        self.logprobs += logprobs
        self.advantages += advantages if advantages is not None else [0.0] * n
        self.ref_logprobs += ref_logprobs if ref_logprobs is not None else [0.0] * n
        self.action += [1.0] * n
        self.observation_ce += [0.0] * n
        self.routed_mask += [routed is not None] * n
        if routed is not None:
            self.routed.append((len(self.tokens) - n, routed))


def extends(sample_ids: list[int], prompt_ids: list[int]) -> bool:
    n = len(sample_ids)
    return len(prompt_ids) >= n and prompt_ids[:n] == sample_ids


def _finish(
    b: _Builder, rollout: Rollout, loss_type: str, temperature: float, routing: tuple[int, int] | None = None
) -> TrainingSample:
    has_obs = any(b.observation_ce)
    sample = TrainingSample(
        token_ids=b.tokens,
        loss_mask=b.mask,
        inference_logprobs=b.logprobs,
        temperature=temperature,
        policy_version=min(b.versions),
    )
    if routing is not None:
        # Every sample of a routing-replay batch carries the arrays; tokens without a recorded routing (prompt
        # and env tokens, a frozen sampler's turns) are unmarked and route freely in the trainer.
        experts = np.zeros((len(b.tokens), *routing), np.uint8)
        for start, rows in b.routed:
            if rows.shape[1:] != routing:
                raise ValueError(f"routed experts of shape {list(rows.shape[1:])}, expected {list(routing)}")
            experts[start : start + len(rows)] = rows
        sample.routed_experts, sample.routed_mask = experts, b.routed_mask
    if loss_type == "rl":
        sample.advantages = b.advantages if rollout.advantages is not None else None
        if has_obs:
            sample.rl_weights, sample.ce_weights = b.action, b.observation_ce
    elif loss_type == "ce":
        sample.ce_weights = [max(a, o) for a, o in zip(b.action, b.observation_ce, strict=True)]
    elif loss_type == "ref_kl":
        sample.ref_kl_weights = b.action
        sample.ref_logprobs = b.ref_logprobs
        if has_obs:
            sample.ce_weights = b.observation_ce
    else:
        raise ValueError(f"unknown loss type {loss_type!r}")
    return sample


def rollout_to_samples(
    rollout: Rollout, loss_type: str, temperature: float, seq_len: int, routing: tuple[int, int] | None = None
) -> list[TrainingSample]:
    """The training samples of one finalized rollout (see module docstring). `routing` = (moe_layers, top_k):
    the samples carry the steps' routed experts for routing replay (every turn's completion tokens)."""
    if loss_type == "ref_kl" and rollout.ref_logprobs is None:
        raise ValueError("a ref_kl rollout needs ref_logprobs (set by the algorithm's score_rollout)")
    samples: list[TrainingSample] = []
    b: _Builder | None = None
    offset = 0
    for step in rollout.steps:
        n = len(step.completion_ids)
        adv = None if rollout.advantages is None else rollout.advantages[offset : offset + n]
        ref = None if rollout.ref_logprobs is None else rollout.ref_logprobs[offset : offset + n]
        offset += n
        if b is not None and extends(b.tokens, step.prompt_ids) and len(step.prompt_ids) + n <= seq_len:
            start = len(b.tokens)
        else:
            if b is not None:
                samples.append(_finish(b, rollout, loss_type, temperature, routing))
            b, start = _Builder(), 0
        ce = None if step.prompt_ce_weights is None else step.prompt_ce_weights[start:]
        b.add_context(step.prompt_ids[start:], ce)
        b.add_completion(
            step.completion_ids,
            step.completion_logprobs,
            adv,
            ref,
            step.routed_experts if routing is not None else None,
        )
        b.versions.append(step.policy_version)
    if b is not None:
        samples.append(_finish(b, rollout, loss_type, temperature, routing))
    return samples
