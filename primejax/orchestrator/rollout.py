"""The record a rollout carries through the pipeline: its trajectory steps, reward, credit and fate.

Each model call is one `TrajectoryStep` (the exact prompt ids sent, the sampled ids and their logprobs, the
policy version that served it). Credit is a per-token stream over the rollout's sampled tokens, all steps
concatenated: `assign_advantages(scalar)` broadcasts; a list must match `num_completion_tokens` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from primejax.envs.base import Example, Message


@dataclass
class TrajectoryStep:
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str
    policy_version: int
    #: Optional ce weights over `prompt_ids` for environment-provided tokens (echo-style algorithms).
    prompt_ce_weights: list[float] | None = None
    #: Routing replay: uint8 [len(completion_ids), moe_layers, top_k], the experts the sampler routed each
    #: completion token's predicting position to (orchestrator.routing_replay); None when not recorded.
    routed_experts: Any = None


@dataclass
class Rollout:
    env: str  # the env's name in orchestrator.envs
    example_index: int
    example: Example
    group_id: int
    messages: list[Message] = field(default_factory=list)
    steps: list[TrajectoryStep] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None
    error: str | None = None  # set when the env or the client raised; the rollout is then never trained
    truncated: bool = False
    advantages: list[float] | None = None  # per sampled token; None = no rl credit assigned
    ref_logprobs: list[float] | None = None  # per sampled token, for ref_kl algorithms
    filtered_by: list[str] = field(default_factory=list)  # filters that flagged it (enforced or not)
    dropped: bool = False  # an enforcing filter removed it from the batch
    finalized: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and self.reward is not None

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(s.completion_ids) for s in self.steps)

    @property
    def num_turns(self) -> int:
        return len(self.steps)

    @property
    def completion_ids(self) -> list[int]:
        return [t for s in self.steps for t in s.completion_ids]

    @property
    def completion_logprobs(self) -> list[float]:
        return [lp for s in self.steps for lp in s.completion_logprobs]

    @property
    def min_policy_version(self) -> int:
        return min((s.policy_version for s in self.steps), default=0)

    def assign_advantages(self, value: float | list[float]) -> None:
        """Write credit: a scalar is broadcast over every sampled token, a list must cover them exactly."""
        if self.finalized:
            raise RuntimeError("rollout is finalized: credit must be assigned in score_rollout / score_group")
        n = self.num_completion_tokens
        if isinstance(value, (int, float)):
            self.advantages = [float(value)] * n
            return
        if len(value) != n:
            raise ValueError(f"advantages cover {len(value)} tokens, the rollout sampled {n}")
        self.advantages = [float(v) for v in value]
